// SwapSpace on every engine configuration: striped round trips over two paths, free-list reuse,
// preallocation failure (RLIMIT_FSIZE) leaving existing extents intact, EIO naming the extent,
// checksum mismatch detected, path errors, buffered fallback, and cleanup of the swap files.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <vector>

#include "io/aligned_buffer.h"
#include "io/crc32c.h"
#include "io/swap_space.h"
#include "tests/io/io_test_util.h"

using namespace strata::io;
using namespace strata::io::testing;
namespace fs = std::filesystem;

namespace {

class SwapTest : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override { STRATA_SKIP_WITHOUT_URING(GetParam()); }
  std::unique_ptr<IoEngine> engine(CompletionHook hook = {}) {
    EngineOptions o = options_for(GetParam());
    o.completion_hook = std::move(hook);
    return make_engine(o);
  }
  SwapOptions two_paths(uint64_t stripe = 64 << 10) {
    fs::create_directories(a_.path() + "/ssd0");
    fs::create_directories(b_.path() + "/ssd1");
    SwapOptions s;
    s.paths = {a_.path() + "/ssd0", b_.path() + "/ssd1"};
    s.stripe_bytes = stripe;
    return s;
  }
  ScratchDir a_, b_;
};

// A file-size limit (and SIGXFSZ ignored: writes past it fail with EFBIG instead of killing the
// process) for one scope, restored even when an assertion returns early.
class FsizeLimit {
 public:
  explicit FsizeLimit(rlim_t bytes) {
    if (getrlimit(RLIMIT_FSIZE, &old_) != 0) return;
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = old_;
    lim.rlim_cur = bytes;
    ok_ = setrlimit(RLIMIT_FSIZE, &lim) == 0;
  }
  ~FsizeLimit() {
    if (ok_) setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }
  bool ok() const { return ok_; }

 private:
  struct rlimit old_{};
  void (*old_handler_)(int) = SIG_DFL;
  bool ok_ = false;
};

TEST_P(SwapTest, StripedRoundTripsOfRandomSizes) {
  auto e = engine();
  SwapOptions so = two_paths();
  so.checksums = true;
  SwapSpace swap(so, *e);
  std::mt19937_64 rng(21);
  struct Live {
    Extent ext;
    uint64_t seed;
  };
  std::vector<Live> live;
  AlignedBuffer buf(2 << 20), back(2 << 20);
  uint64_t ever_allocated = 0;
  for (int t = 0; t < 40; ++t) {
    uint64_t bytes = 1 + rng() % (2 << 20);  // rounded up to 4 KiB by allocate
    Extent x = swap.allocate(bytes);
    ASSERT_EQ(x.bytes, round_up(bytes));
    ever_allocated += x.bytes;
    uint64_t seed = rng();
    fill_random(buf.data(), x.bytes, seed);
    swap.write(x, buf.data()).wait();
    live.push_back({x, seed});
    if (rng() % 3 == 0) {  // free a random live extent so later allocations reuse holes
      size_t k = rng() % live.size();
      swap.free(live[k].ext);
      EXPECT_FALSE(live[k].ext);
      live.erase(live.begin() + static_cast<long>(k));
    }
  }
  for (Live& l : live) {  // every surviving extent reads back exactly
    fill_random(buf.data(), l.ext.bytes, l.seed);
    std::memset(back.data(), 0, l.ext.bytes);
    swap.read(l.ext, back.data()).wait();
    ASSERT_EQ(std::memcmp(buf.data(), back.data(), l.ext.bytes), 0) << "extent " << l.ext.id;
    // ... and so does a random aligned sub-range (it may start and end inside stripes)
    const uint64_t pages = l.ext.bytes / 4096, first = rng() % pages, count = 1 + rng() % (pages - first);
    std::memset(back.data(), 0, count * 4096);
    swap.read(l.ext, first * 4096, count * 4096, back.data()).wait();
    ASSERT_EQ(std::memcmp(buf.as<char>() + first * 4096, back.data(), count * 4096), 0)
        << "extent " << l.ext.id << " pages " << first << "+" << count;
  }
  // Both paths hold data (striping), and freed holes were reused: less space is reserved than
  // was ever allocated (and at least what is live now).
  for (const std::string& f : swap.files()) EXPECT_GT(fs::file_size(f), 0u) << f;
  SwapStats s = swap.stats();
  EXPECT_EQ(s.extents, live.size());
  EXPECT_GE(s.bytes_reserved, s.bytes_allocated);
  EXPECT_LT(s.bytes_reserved, ever_allocated);
  EXPECT_EQ(s.checksum_failures, 0u);
}

TEST_P(SwapTest, LargeExtentIsStripedRoundRobin) {
  auto e = engine();
  SwapSpace swap(two_paths(64 << 10), *e);
  Extent x = swap.allocate(1 << 20);  // 16 stripes: 8 per path
  std::vector<std::string> files = swap.files();
  EXPECT_EQ(fs::file_size(files[0]), 512u << 10);
  EXPECT_EQ(fs::file_size(files[1]), 512u << 10);
  AlignedBuffer buf(1 << 20);
  for (int k = 0; k < 16; ++k) std::memset(buf.as<char>() + k * (64 << 10), 'a' + k, 64 << 10);
  swap.write(x, buf.data()).wait();
  // Stripe k is at (k / 2) * stripe in path (k % 2) (x is the first extent: it starts on path 0).
  for (int k = 0; k < 16; ++k) {
    int fd = ::open(files[k % 2].c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    char c = 0;
    ASSERT_EQ(::pread(fd, &c, 1, (k / 2) * (64 << 10) + 100), 1);
    EXPECT_EQ(c, 'a' + k) << "stripe " << k;
    ::close(fd);
  }
  // Sub-range I/O crossing stripe boundaries.
  AlignedBuffer part(256 << 10);
  swap.read(x, 48 << 10, 256 << 10, part.data()).wait();
  EXPECT_EQ(std::memcmp(part.data(), buf.as<char>() + (48 << 10), 256 << 10), 0);
}

TEST_P(SwapTest, FileSizeLimitFailsAtAllocationAndKeepsExtents) {
  auto e = engine();
  SwapOptions so;
  so.paths = {a_.path()};
  so.checksums = true;
  SwapSpace swap(so, *e);
  Extent keep = swap.allocate(4 << 20);
  AlignedBuffer buf(4 << 20), back(4 << 20);
  fill_random(buf.data(), 4 << 20, 77);
  swap.write(keep, buf.data()).wait();

  FsizeLimit limit(6 << 20);
  ASSERT_TRUE(limit.ok());
  bool threw = false;
  try {
    swap.allocate(16 << 20);
  } catch (const IoError& err) {
    threw = true;
    EXPECT_EQ(err.errno_value(), EFBIG) << err.what();
    EXPECT_EQ(err.path(), swap.files()[0]);
    EXPECT_EQ(err.offset(), 4u << 20);
    EXPECT_EQ(err.length(), 16u << 20);
  }
  Extent small = swap.allocate(1 << 20);  // what still fits is still granted
  EXPECT_TRUE(threw);
  EXPECT_EQ(fs::file_size(swap.files()[0]), 5u << 20);
  swap.read(keep, back.data()).wait();  // verified by checksum as well as here
  EXPECT_EQ(std::memcmp(buf.data(), back.data(), 4 << 20), 0);
  EXPECT_EQ(swap.stats().extents, 2u);
  swap.free(small);
}

TEST_P(SwapTest, EioNamesTheExtent) {
  std::atomic<bool> inject{false};
  auto e = engine([&](IoOp op, uint64_t, uint64_t, int64_t res) -> int64_t {
    return inject.load() && op == IoOp::read ? -EIO : res;
  });
  SwapSpace swap(two_paths(), *e);
  Extent x = swap.allocate(512 << 10);
  AlignedBuffer buf(512 << 10);
  swap.write(x, buf.data()).wait();
  inject = true;
  try {
    swap.read(x, buf.data()).wait();
    FAIL() << "EIO not reported";
  } catch (const IoError& err) {
    EXPECT_EQ(err.errno_value(), EIO);
    std::string m = err.what();
    EXPECT_NE(m.find("extent " + std::to_string(x.id)), std::string::npos) << m;
    EXPECT_NE(m.find("Input/output error"), std::string::npos) << m;
  }
}

// Flips one bit of a swap file behind the engine's back (a buffered pwrite; an O_DIRECT read
// of the range then sees it: direct reads flush the page cache's dirty pages first).
void flip_bit(const std::string& file, uint64_t at) {
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << file;
  char c = 0;
  ASSERT_EQ(::pread(fd, &c, 1, static_cast<off_t>(at)), 1);
  c ^= 0x40;
  ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(at)), 1);
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
}

TEST_P(SwapTest, ChecksumMismatchIsDetected) {
  auto e = engine();
  SwapOptions so;
  so.paths = {a_.path()};
  SwapSpace swap(so, *e);  // checksums are on by default
  Extent x = swap.allocate(256 << 10);  // first extent: file offset 0
  AlignedBuffer buf(256 << 10);
  fill_random(buf.data(), 256 << 10, 5);
  const uint32_t written = crc32c(buf.as<char>() + 24 * 4096, 4096);  // the block holding byte 100000
  swap.write(x, buf.data()).wait();
  flip_bit(swap.files()[0], 100000);
  IoHandle h = swap.read(x, buf.data());
  try {
    h.wait();
    FAIL() << "corruption not detected";
  } catch (const ChecksumError& err) {
    EXPECT_EQ(err.extent_id(), x.id);
    EXPECT_EQ(err.path(), swap.files()[0]);
    EXPECT_EQ(err.file_offset(), 24u * 4096);
    EXPECT_EQ(err.block_index(), 24u);
    EXPECT_EQ(err.expected(), written);
    EXPECT_EQ(err.actual(), crc32c(buf.as<char>() + 24 * 4096, 4096));  // what was read: the flipped bytes
  }
  EXPECT_THROW(h.wait(), ChecksumError);
  EXPECT_EQ(swap.stats().checksum_failures, 1u);
  swap.write(x, buf.data()).wait();  // rewriting records the new checksum
  swap.read(x, buf.data()).wait();
}

// The offload store's I/O: sub-range writes and reads of a striped extent. A flipped bit is
// caught by any read covering its block, and only by those; the error names the swap file the
// bit is in, the byte offset in that file and the block.
TEST_P(SwapTest, SubRangeCorruptionNamesFileOffsetAndBlock) {
  auto e = engine();
  SwapSpace swap(two_paths(64 << 10), *e);
  Extent x = swap.allocate(1 << 20);  // 16 stripes of 64 KiB, alternating paths
  AlignedBuffer buf(1 << 20), back(1 << 20);
  fill_random(buf.data(), 1 << 20, 9);
  // Written as the offload store does: pieces that start and end inside stripes.
  const uint64_t cuts[] = {0, 12 << 10, 200 << 10, 204 << 10, 700 << 10, 1 << 20};
  for (size_t i = 0; i + 1 < std::size(cuts); ++i)
    swap.write(x, cuts[i], cuts[i + 1] - cuts[i], buf.as<char>() + cuts[i]).wait();
  // Extent byte 300000 is in stripe 4 (256..320 KiB): path 0, file offset 2·64 KiB + (300000 - 256 KiB).
  const uint64_t extent_byte = 300000, stripe_k = extent_byte / (64 << 10);
  const std::string file = swap.files()[stripe_k % 2];
  const uint64_t file_byte = (stripe_k / 2) * (64 << 10) + (extent_byte - stripe_k * (64 << 10));
  flip_bit(file, file_byte);

  // Reads that miss the bad block pass and return the written bytes.
  swap.read(x, 0, 292 << 10, back.data()).wait();
  EXPECT_EQ(std::memcmp(back.data(), buf.data(), 292 << 10), 0);
  swap.read(x, 296 << 10, 100 << 10, back.data()).wait();
  EXPECT_EQ(std::memcmp(back.data(), buf.as<char>() + (296 << 10), 100 << 10), 0);
  // Any read covering it fails, naming where.
  for (uint64_t lo : {uint64_t{292} << 10, uint64_t{256} << 10, uint64_t{0}}) {
    try {
      swap.read(x, lo, (1 << 20) - lo, back.data()).wait();
      ADD_FAILURE() << "corruption not detected reading from " << lo;
    } catch (const ChecksumError& err) {
      EXPECT_EQ(err.path(), file);
      EXPECT_EQ(err.file_offset(), file_byte / 4096 * 4096);
      EXPECT_EQ(err.extent_offset(), extent_byte / 4096 * 4096);
      EXPECT_EQ(err.block_index(), extent_byte / 4096);
      const std::string m = err.what();
      EXPECT_NE(m.find(file), std::string::npos) << m;
      EXPECT_NE(m.find("byte offset " + std::to_string(file_byte / 4096 * 4096)), std::string::npos) << m;
      EXPECT_NE(m.find("block " + std::to_string(extent_byte / 4096) + " of extent " + std::to_string(x.id)),
                std::string::npos) << m;
      EXPECT_EQ(err.with_context("offload block 'w'").what(), m.substr(0, m.find("; the disk")) +
                                                                 "; offload block 'w'" + m.substr(m.find("; the disk")));
    }
  }
  EXPECT_EQ(swap.stats().checksum_failures, 3u);
}

// Blocks never written hold whatever the file held (a freed extent's bytes): read unverified.
TEST_P(SwapTest, NeverWrittenBlocksAreNotVerified) {
  auto e = engine();
  SwapOptions so;
  so.paths = {a_.path()};
  SwapSpace swap(so, *e);
  Extent x = swap.allocate(64 << 10);
  AlignedBuffer buf(64 << 10);
  fill_random(buf.data(), 64 << 10, 3);
  swap.write(x, 0, 32 << 10, buf.data()).wait();
  flip_bit(swap.files()[0], (48 << 10) + 7);  // in the half never written
  swap.read(x, buf.data()).wait();
  EXPECT_EQ(swap.stats().checksum_failures, 0u);
}

// stats().checksum_ms counts the time writes spend summing and reads checking, and nothing
// without checksums.
TEST_P(SwapTest, ChecksumTimeIsCounted) {
  auto e = engine();
  for (bool checksums : {true, false}) {
    SwapOptions so;
    so.paths = {a_.path()};
    so.checksums = checksums;
    SwapSpace swap(so, *e);
    EXPECT_EQ(swap.stats().checksum_ms, 0.0);
    Extent x = swap.allocate(4 << 20);
    AlignedBuffer buf(4 << 20);
    fill_random(buf.data(), 4 << 20, 5);
    swap.write(x, buf.data()).wait();
    const double after_write = swap.stats().checksum_ms;
    swap.read(x, buf.data()).wait();
    const double after_read = swap.stats().checksum_ms;
    if (checksums) {
      EXPECT_GT(after_write, 0.0);
      EXPECT_GT(after_read, after_write);
    } else {
      EXPECT_EQ(after_read, 0.0);
    }
    swap.free(x);
  }
}

// zero(): a striped range that held data reads back as zeros — through fallocate ZERO_RANGE, and
// through the written-zeros fallback — the bytes around it are kept, and the zeros are verified:
// a bit flipped inside the zeroed range is a ChecksumError naming its file.
TEST_P(SwapTest, ZeroedRangesReadAsZerosAndAreVerified) {
  for (bool fallback : {false, true}) {
    SCOPED_TRACE(fallback ? "writing zeros" : "ZERO_RANGE");
    auto e = engine();
    SwapOptions so = two_paths(64 << 10);
    so.test_no_zero_range = fallback;
    SwapSpace swap(so, *e);
    Extent x = swap.allocate(1 << 20);
    AlignedBuffer buf(1 << 20), back(1 << 20);
    fill_random(buf.data(), 1 << 20, 17);
    swap.write(x, buf.data()).wait();
    const uint64_t lo = 100 << 10, len = 600 << 10;  // starts and ends inside stripes, spans both paths
    swap.zero(x, lo, len);
    swap.read(x, back.data()).wait();
    std::memset(buf.as<char>() + lo, 0, len);
    EXPECT_EQ(std::memcmp(back.data(), buf.data(), 1 << 20), 0);
    // Extent byte 300000: stripe 4, path 0, file offset 2·64 KiB + (300000 - 256 KiB).
    const uint64_t file_byte = 2 * (64 << 10) + (300000 - (256 << 10));
    flip_bit(swap.files()[0], file_byte);
    try {
      swap.read(x, lo, len, back.data()).wait();
      ADD_FAILURE() << "corruption of a zeroed range not detected";
    } catch (const ChecksumError& err) {
      EXPECT_EQ(err.path(), swap.files()[0]);
      EXPECT_EQ(err.file_offset(), file_byte / 4096 * 4096);
    }
    EXPECT_THROW(swap.zero(x, 100, 4096), AlignmentError);
    EXPECT_THROW(swap.zero(x, 0, 2 << 20), std::out_of_range);
  }
}

TEST_P(SwapTest, BadPathsGiveClearErrors) {
  auto e = engine();
  SwapOptions so;
  so.paths = {a_.path() + "/does-not-exist"};
  try {
    SwapSpace swap(so, *e);
    FAIL();
  } catch (const IoError& err) {
    EXPECT_EQ(err.errno_value(), ENOENT);
    EXPECT_NE(std::string(err.what()).find("does-not-exist"), std::string::npos);
  }
  std::string file = a_.path() + "/plain-file";
  ::close(::open(file.c_str(), O_CREAT | O_WRONLY, 0600));
  so.paths = {a_.path(), file};  // the second path fails: the first one's files are cleaned up
  EXPECT_THROW(SwapSpace(so, *e), IoError);
  size_t entries = 0;
  for (auto& d : fs::directory_iterator(a_.path())) entries += d.path() != file;
  EXPECT_EQ(entries, 0u);
  so.paths = {a_.path()};
  so.stripe_bytes = 1000;
  EXPECT_THROW(SwapSpace(so, *e), std::invalid_argument);
}

TEST_P(SwapTest, FilesArePrivateAndRemoved) {
  auto e = engine();
  std::vector<std::string> files;
  {
    SwapSpace swap(two_paths(), *e);
    files = swap.files();
    for (const std::string& f : files) {
      struct stat st{};
      ASSERT_EQ(::stat(f.c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
      ASSERT_EQ(::stat(fs::path(f).parent_path().c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0700u);
    }
    Extent x = swap.allocate(1 << 20);
    (void)x;
  }
  for (const std::string& f : files) {
    EXPECT_FALSE(fs::exists(f));
    EXPECT_FALSE(fs::exists(fs::path(f).parent_path()));
  }
}

TEST_P(SwapTest, NoDirectIoIsAnErrorUnlessBufferedIsAllowed) {
  auto e = engine();
  SwapOptions so;
  so.paths = {a_.path()};
  so.test_reject_direct = true;
  try {
    SwapSpace swap(so, *e);
    FAIL() << "O_DIRECT rejection not reported";
  } catch (const IoError& err) {
    EXPECT_EQ(err.errno_value(), EINVAL);
    EXPECT_NE(std::string(err.what()).find("O_DIRECT"), std::string::npos) << err.what();
  }
  EXPECT_TRUE(fs::is_empty(a_.path()));  // nothing left behind
  so.allow_buffered = true;
  SwapSpace swap(so, *e);
  EXPECT_TRUE(swap.stats().buffered);
  Extent x = swap.allocate(128 << 10);
  AlignedBuffer a(128 << 10), b(128 << 10);
  fill_random(a.data(), 128 << 10, 6);
  swap.write(x, a.data()).wait();
  swap.read(x, b.data()).wait();
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 128 << 10), 0);
}

// A swap file whose first write fails for a reason other than O_DIRECT (here EFBIG: a 0-byte
// file-size limit, standing in for a full disk) is that error, naming the file, even when
// buffered I/O is allowed: it is not mistaken for "rejects O_DIRECT".
TEST_P(SwapTest, FailedProbeWriteIsNotAnODirectRefusal) {
  auto e = engine();
  SwapOptions so;
  so.paths = {a_.path()};
  so.allow_buffered = true;
  FsizeLimit limit(0);
  ASSERT_TRUE(limit.ok());
  try {
    SwapSpace swap(so, *e);
    FAIL() << "a failing first write was accepted";
  } catch (const IoError& err) {
    EXPECT_EQ(err.errno_value(), EFBIG) << err.what();
    EXPECT_NE(std::string(err.what()).find("first write/read"), std::string::npos) << err.what();
    EXPECT_EQ(std::string(err.what()).find("O_DIRECT"), std::string::npos) << err.what();
  }
  EXPECT_TRUE(fs::is_empty(a_.path())) << "the private swap directory was left behind";
}

TEST_P(SwapTest, MisalignedExtentIoIsRejected) {
  auto e = engine();
  SwapSpace swap(two_paths(), *e);
  Extent x = swap.allocate(64 << 10);
  AlignedBuffer a(64 << 10);
  EXPECT_THROW(swap.read(x, 100, 4096, a.data()), AlignmentError);
  EXPECT_THROW(swap.write(x, a.as<char>() + 8), AlignmentError);
  EXPECT_THROW(swap.read(x, 0, 128 << 10, a.data()), std::out_of_range);
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapTest,
                         ::testing::Values(Config::uring_reaper, Config::uring_caller, Config::threads), config_name);

}  // namespace
