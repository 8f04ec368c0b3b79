// IoEngine, run on every engine configuration (io_uring with a reaper thread, io_uring reaped by
// the caller, the pread/pwrite fallback): random round trips, many concurrent requests waited in
// random order, injected short I/O / EAGAIN / EIO, alignment errors, end of file, registered buffers.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "io/aligned_buffer.h"
#include "io/engine.h"
#include "tests/io/io_test_util.h"

using namespace strata::io;
using namespace strata::io::testing;

namespace {

constexpr uint64_t kFileBytes = 16 << 20;

class EngineTest : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    STRATA_SKIP_WITHOUT_URING(GetParam());
    path_ = dir_.path() + "/data";
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
    if (fd_ < 0) fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);  // tmpfs without O_DIRECT
    ASSERT_GE(fd_, 0) << std::strerror(errno);
    ASSERT_EQ(::ftruncate(fd_, kFileBytes), 0);
  }
  void TearDown() override {
    engine_.reset();
    if (fd_ >= 0) ::close(fd_);
  }
  IoEngine& make(EngineOptions o) {
    engine_ = make_engine(o);
    file_ = engine_->add_file(fd_, path_);
    return *engine_;
  }
  IoEngine& make() { return make(options_for(GetParam())); }

  ScratchDir dir_;
  std::string path_;
  int fd_ = -1;
  std::unique_ptr<IoEngine> engine_;
  FileId file_ = -1;
};

TEST_P(EngineTest, RandomRoundTrips) {
  IoEngine& e = make();
  EXPECT_NE(e.kind(), EngineKind::automatic);
  std::mt19937_64 rng(1234);
  std::vector<unsigned char> image(kFileBytes, 0);  // what the file must hold
  AlignedBuffer buf(1 << 20), back(1 << 20);
  for (int t = 0; t < 40; ++t) {
    uint64_t len = (1 + rng() % 256) * 4096;  // 4 KiB .. 1 MiB, usually several pieces
    uint64_t off = (rng() % ((kFileBytes - len) / 4096 + 1)) * 4096;
    fill_random(buf.data(), len, rng());
    IoHandle h = e.write(file_, off, len, buf.data());
    h.wait();
    EXPECT_EQ(h.bytes(), len);
    std::memcpy(image.data() + off, buf.data(), len);
    IoHandle r = e.read(file_, off, len, back.data());
    r.wait();
    ASSERT_EQ(std::memcmp(back.data(), buf.data(), len), 0) << "trip " << t << " off " << off << " len " << len;
  }
  // The whole file against the image: no write landed anywhere else.
  AlignedBuffer all(kFileBytes);
  e.read(file_, 0, kFileBytes, all.data()).wait();
  EXPECT_EQ(std::memcmp(all.data(), image.data(), kFileBytes), 0);
  EngineStats s = e.stats();
  EXPECT_GT(s.pieces, s.requests);  // large requests were split
  EXPECT_EQ(s.errors, 0u);
}

TEST_P(EngineTest, ManyConcurrentRequestsWaitedInRandomOrder) {
  IoEngine& e = make();
  constexpr int kN = 256;
  constexpr uint64_t kSlot = 64 << 10;  // (kN, kSlot) slots, each request a random prefix of its slot
  AlignedBuffer src(kN * kSlot), dst(kN * kSlot);
  fill_random(src.data(), kN * kSlot, 99);
  std::mt19937_64 rng(5);
  std::vector<uint64_t> len(kN);
  std::vector<IoHandle> hs;
  for (int i = 0; i < kN; ++i) {
    len[i] = (1 + rng() % (kSlot / 4096)) * 4096;
    hs.push_back(e.write(file_, i * kSlot, len[i], src.as<char>() + i * kSlot));  // far beyond queue depth
  }
  std::vector<int> order(kN);
  for (int i = 0; i < kN; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (int i : order) hs[i].wait();
  hs.clear();
  std::memset(dst.data(), 0, kN * kSlot);
  for (int i = 0; i < kN; ++i) hs.push_back(e.read(file_, i * kSlot, len[i], dst.as<char>() + i * kSlot));
  std::shuffle(order.begin(), order.end(), rng);
  for (int i : order) {
    hs[i].wait();
    EXPECT_TRUE(hs[i].ready());
    ASSERT_EQ(std::memcmp(dst.as<char>() + i * kSlot, src.as<char>() + i * kSlot, len[i]), 0) << "request " << i;
  }
}

TEST_P(EngineTest, ConcurrentSubmittersFromSeveralThreads) {
  IoEngine& e = make();
  constexpr int kThreads = 4, kPer = 30;
  constexpr uint64_t kRegion = kFileBytes / kThreads;
  std::vector<std::thread> ts;
  std::atomic<int> bad{0};
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      AlignedBuffer a(256 << 10), b(256 << 10);
      for (int i = 0; i < kPer; ++i) {
        uint64_t len = (1 + rng() % 64) * 4096;
        uint64_t off = t * kRegion + (rng() % ((kRegion - len) / 4096)) * 4096;
        fill_random(a.data(), len, rng());
        e.write(file_, off, len, a.data()).wait();
        e.read(file_, off, len, b.data()).wait();
        if (std::memcmp(a.data(), b.data(), len) != 0) bad.fetch_add(1);
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_P(EngineTest, ShortTransfersAreCompletedForTheRemainder) {
  EngineOptions o = options_for(GetParam());
  std::atomic<int> truncated{0};
  // Every piece longer than 4 KiB completes short (half, rounded down to 4 KiB) the first time.
  o.completion_hook = [&](IoOp, uint64_t, uint64_t length, int64_t res) -> int64_t {
    if (res > 4096 && static_cast<uint64_t>(res) == length) {
      truncated.fetch_add(1);
      return static_cast<int64_t>(length / 2 / 4096 * 4096);
    }
    return res;
  };
  IoEngine& e = make(o);
  AlignedBuffer a(1 << 20), b(1 << 20);
  fill_random(a.data(), 1 << 20, 3);
  e.write(file_, 8192, 1 << 20, a.data()).wait();
  e.read(file_, 8192, 1 << 20, b.data()).wait();
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 1 << 20), 0);
  EXPECT_GT(truncated.load(), 0);
  EXPECT_GE(e.stats().short_requeues, static_cast<uint64_t>(truncated.load()));
  EXPECT_EQ(e.stats().bytes_read, uint64_t{1} << 20);  // each byte counted once despite re-queues
}

// A read's check_piece sees every piece once, whole (also when it completed short and was
// re-queued for the rest), with its bytes already there; verify runs after all of them.
TEST_P(EngineTest, EachPieceOfAReadIsCheckedOnceWithItsBytes) {
  EngineOptions o = options_for(GetParam());
  o.block_bytes = 64 << 10;
  o.completion_hook = [](IoOp, uint64_t, uint64_t length, int64_t res) -> int64_t {
    return res > 4096 && static_cast<uint64_t>(res) == length ? static_cast<int64_t>(length / 2 / 4096 * 4096) : res;
  };
  IoEngine& e = make(o);
  constexpr uint64_t kLen = 1 << 20;
  AlignedBuffer a(kLen), b(kLen);
  fill_random(a.data(), kLen, 11);
  e.write(file_, 4096, kLen, a.data()).wait();
  std::memset(b.data(), 0, kLen);
  std::mutex mu;
  std::vector<std::pair<uint64_t, uint64_t>> seen;  // (offset in the buffer, bytes)
  bool all_there = true, verified_after = true;
  RequestOptions ro;
  ro.check_piece = [&](const char* from, uint64_t bytes) {
    const uint64_t at = static_cast<uint64_t>(from - b.as<char>());
    std::lock_guard lk(mu);
    seen.emplace_back(at, bytes);
    all_there = all_there && std::memcmp(from, a.as<char>() + at, bytes) == 0;
  };
  ro.verify = [&] {
    std::lock_guard lk(mu);
    verified_after = seen.size() == kLen / (64 << 10);
  };
  IoSpan span{file_, 4096, kLen, b.data()};
  IoHandle h = e.submit(IoOp::read, std::span<const IoSpan>(&span, 1), std::move(ro));
  h.wait();
  std::sort(seen.begin(), seen.end());
  ASSERT_EQ(seen.size(), kLen / (64 << 10));
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].first, i * (64 << 10));
    EXPECT_EQ(seen[i].second, uint64_t{64} << 10);
  }
  EXPECT_TRUE(all_there);
  EXPECT_TRUE(verified_after);
  EXPECT_GT(e.stats().short_requeues, 0u);
}

TEST_P(EngineTest, EagainAndEintrAreRetried) {
  EngineOptions o = options_for(GetParam());
  std::atomic<int> n{0};
  o.completion_hook = [&](IoOp, uint64_t, uint64_t, int64_t res) -> int64_t {
    int k = n.fetch_add(1);
    return k % 3 == 0 ? -EAGAIN : k % 3 == 1 ? -EINTR : res;  // the re-issued piece repeats the transfer
  };
  IoEngine& e = make(o);
  AlignedBuffer a(512 << 10), b(512 << 10);
  fill_random(a.data(), 512 << 10, 4);
  e.write(file_, 0, 512 << 10, a.data()).wait();
  e.read(file_, 0, 512 << 10, b.data()).wait();
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 512 << 10), 0);
  EXPECT_GT(e.stats().retries, 0u);
}

TEST_P(EngineTest, EioIsReportedWithPathOffsetAndLength) {
  EngineOptions o = options_for(GetParam());
  const uint64_t bad_off = 3 * (64 << 10);  // the 4th piece of a request at offset 0
  o.completion_hook = [&](IoOp op, uint64_t off, uint64_t, int64_t res) -> int64_t {
    return op == IoOp::read && off == bad_off ? -EIO : res;
  };
  IoEngine& e = make(o);
  AlignedBuffer a(1 << 20);
  e.write(file_, 0, 1 << 20, a.data()).wait();
  IoHandle h = e.read(file_, 0, 1 << 20, a.data());
  try {
    h.wait();
    FAIL() << "EIO was not reported";
  } catch (const IoError& err) {
    EXPECT_EQ(err.errno_value(), EIO);
    EXPECT_EQ(err.path(), path_);
    EXPECT_EQ(err.offset(), bad_off);
    EXPECT_EQ(err.length(), 64u << 10);
    EXPECT_NE(std::string(err.what()).find(path_), std::string::npos) << err.what();
  }
  EXPECT_THROW(h.wait(), IoError);  // idempotent
  e.read(file_, 0, 64 << 10, a.data()).wait();  // the engine carries on
  EXPECT_GE(e.stats().errors, 1u);
}

TEST_P(EngineTest, MisalignedRequestsAreRejectedBeforeTheKernel) {
  IoEngine& e = make();
  AlignedBuffer a(64 << 10);
  EXPECT_THROW(e.read(file_, 0, 4096, a.as<char>() + 512), AlignmentError);
  EXPECT_THROW(e.read(file_, 100, 4096, a.data()), AlignmentError);
  EXPECT_THROW(e.write(file_, 0, 1000, a.data()), AlignmentError);
  EXPECT_EQ(e.stats().pieces, 0u);
}

TEST_P(EngineTest, ReadPastEndOfFileIsAnErrorNotZeros) {
  IoEngine& e = make();
  AlignedBuffer a(64 << 10);
  IoHandle h = e.read(file_, kFileBytes - 8192, 64 << 10, a.data());
  try {
    h.wait();
    FAIL() << "short read at EOF not reported";
  } catch (const IoError& err) {
    EXPECT_EQ(err.offset(), kFileBytes);  // the first byte that could not be read
    EXPECT_NE(std::string(err.what()).find("end of file"), std::string::npos) << err.what();
  }
}

TEST_P(EngineTest, RegisteredBufferRoundTrip) {
  IoEngine& e = make();
  AlignedBuffer pool(2 << 20);  // a staging pool, registered once
  bool registered = e.register_buffer(pool.data(), pool.size());
  fill_random(pool.data(), 1 << 20, 8);
  e.write(file_, 0, 1 << 20, pool.data()).wait();
  e.read(file_, 0, 1 << 20, pool.as<char>() + (1 << 20)).wait();
  EXPECT_EQ(std::memcmp(pool.data(), pool.as<char>() + (1 << 20), 1 << 20), 0);
  if (e.kind() == EngineKind::uring && registered) {
    EXPECT_GT(e.stats().fixed_pieces, 0u);
  }
}

// A buffer unregistered before it is freed is forgotten: I/O through its range is no longer
// "fixed", and a new buffer (the allocator often hands back the same address) registered in its
// place reads and writes its own pages, not the old pinned ones.
TEST_P(EngineTest, UnregisteredBufferIsForgottenAndItsAddressReusable) {
  IoEngine& e = make();
  for (int round = 0; round < 3; ++round) {
    AlignedBuffer pool(2 << 20);
    const bool registered = e.register_buffer(pool.data(), pool.size());
    fill_random(pool.data(), 1 << 20, 30 + round);
    e.write(file_, 0, 1 << 20, pool.data()).wait();
    std::memset(pool.as<char>() + (1 << 20), 0, 1 << 20);
    e.read(file_, 0, 1 << 20, pool.as<char>() + (1 << 20)).wait();
    ASSERT_EQ(std::memcmp(pool.data(), pool.as<char>() + (1 << 20), 1 << 20), 0) << "round " << round;
    e.unregister_buffer(pool.data());
    const uint64_t fixed = e.stats().fixed_pieces;
    e.read(file_, 0, 1 << 20, pool.data()).wait();
    EXPECT_EQ(e.stats().fixed_pieces, fixed) << "I/O still used the unregistered buffer";
    if (e.kind() == EngineKind::uring && registered) {
      EXPECT_GT(fixed, 0u);
    }
  }
}

TEST_P(EngineTest, PollingReadyAloneCompletesRequests) {
  IoEngine& e = make();
  AlignedBuffer a(1 << 20), b(1 << 20);
  fill_random(a.data(), 1 << 20, 12);
  IoHandle w = e.write(file_, 0, 1 << 20, a.data());
  while (!w.ready()) std::this_thread::yield();  // caller-reaped engines reap inside ready()
  IoHandle r = e.read(file_, 0, 1 << 20, b.data());
  while (!r.ready()) std::this_thread::yield();
  r.wait();
  EXPECT_EQ(std::memcmp(a.data(), b.data(), 1 << 20), 0);
  EXPECT_GT(r.latency_us(), 0.0);  // measured (0 means it was never set)
}

TEST_P(EngineTest, DestructionWaitsForRequestsInFlight) {
  IoEngine& e = make();
  AlignedBuffer a(4 << 20);
  fill_random(a.data(), 4 << 20, 11);
  std::vector<IoHandle> hs;
  for (int i = 0; i < 4; ++i) hs.push_back(e.write(file_, i * (1 << 20), 1 << 20, a.as<char>() + i * (1 << 20)));
  if (GetParam() == Config::uring_caller) e.drain();  // the caller reaps: drain is its explicit wait
  engine_.reset();
  for (IoHandle& h : hs) EXPECT_TRUE(h.ready());
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineTest,
                         ::testing::Values(Config::uring_reaper, Config::uring_caller, Config::threads), config_name);

TEST(EngineFactory, KindsAndFallbackProbe) {
  EXPECT_EQ(parse_engine_kind("threads"), EngineKind::threads);
  EXPECT_EQ(parse_engine_kind("uring"), EngineKind::uring);
  EXPECT_THROW(parse_engine_kind("libaio"), std::invalid_argument);
  EngineOptions topt;
  topt.kind = EngineKind::threads;
  auto t = make_engine(topt);
  EXPECT_EQ(t->kind(), EngineKind::threads);
  std::string why;
  bool ok = uring_available(&why);
  auto a = make_engine({});
  EXPECT_EQ(a->kind(), ok ? EngineKind::uring : EngineKind::threads) << why;
  if (!ok) {
    EXPECT_GE(fallback_count(), 1u);
  }
  EngineOptions bad;
  bad.block_bytes = 1000;
  EXPECT_THROW(make_engine(bad), std::invalid_argument);
}

}  // namespace
