// SwapSpace: per-path swap files grown with fallocate (so a full disk fails at allocate()),
// a first-fit free list per file, RAID-0 striping of large extents across paths, and crc32c
// per 4 KiB block written, verified on every read of it (whole-extent or sub-range).
#include "io/swap_space.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/aligned_buffer.h"
#include "io/cleanup.h"
#include "io/crc32c.h"

namespace strata::io {

struct SwapSpace::Impl {
  struct Dir {
    std::string root;  // the user's --nvme-path
    std::string dir;   // our private directory under it
    std::string file;  // the swap file
    int fd = -1;
    FileId id = -1;
    bool direct = true;
    int cleanup_dir = -1, cleanup_file = -1;  // io/cleanup.h slots (signal-time removal)
    uint64_t end = 0;                     // bytes preallocated (file size)
    std::map<uint64_t, uint64_t> free;    // offset -> bytes, coalesced
  };
  struct Region {
    uint32_t dir;
    uint64_t off;
    uint64_t bytes;
  };
  // Stripe k (extent bytes k·stripe ..) lives in regions[k % regions.size()] at
  // off + (k / regions.size())·stripe. One region: the whole extent, contiguous (stripe = bytes).
  struct Info {
    uint64_t bytes = 0;
    uint64_t stripe = 0;
    std::vector<Region> regions;
    // Per 4 KiB checksum block (with checksums on): the crc32c of what was last written there,
    // and whether it was ever written (a block never written is read unverified). Sized at
    // allocate and never resized, so I/O on disjoint ranges updates them without the lock.
    std::unique_ptr<uint32_t[]> crc;
    std::unique_ptr<uint8_t[]> written;
  };

  SwapOptions opts;
  std::vector<Dir> dirs;
  mutable std::mutex mu;  // guards everything below and each Dir's end/free
  std::unordered_map<uint64_t, Info> extents;
  uint64_t next_id = 1;
  uint32_t next_dir = 0;
  uint64_t bytes_allocated = 0;
  std::atomic<uint64_t> checksum_failures{0};
  std::atomic<uint64_t> checksum_ns{0};  // time in crc32c_blocks, summed over threads

  void open_dir(Dir& d);
  uint64_t alloc_region(Dir& d, uint64_t bytes);  // throws IoError on ENOSPC etc.
  void free_region(Dir& d, uint64_t off, uint64_t bytes);
  void close_all();
  // Where extent byte `offset` lives: its path index and byte offset in that path's swap file.
  std::pair<uint32_t, uint64_t> locate(const Info& info, uint64_t offset) const {
    const uint64_t n = info.regions.size(), k = offset / info.stripe;
    const Region& r = info.regions[k % n];
    return {r.dir, r.off + (k / n) * info.stripe + (offset - k * info.stripe)};
  }
};

namespace {

IoError path_error(const std::string& path, int err, const std::string& hint) {
  return IoError("swap space at", path, 0, 0, err, hint);
}

// Writes and reads back one aligned block: some filesystems accept O_DIRECT at open and
// reject it at the first I/O. Returns 0, or the errno of the step that failed (a short transfer
// counts as EIO): only EINVAL means "rejects O_DIRECT"; ENOSPC, EIO, ... are real failures.
int direct_io_probe(int fd) {
  AlignedBuffer buf(kDirectAlign);
  std::memset(buf.data(), 0x5a, kDirectAlign);
  auto failed = [](ssize_t n) { return n == static_cast<ssize_t>(kDirectAlign) ? 0 : (n < 0 ? errno : EIO); };
  if (int err = failed(::pwrite(fd, buf.data(), kDirectAlign, 0))) return err;
  if (int err = failed(::pread(fd, buf.data(), kDirectAlign, 0))) return err;
  return ::ftruncate(fd, 0) == 0 ? 0 : errno;
}

// Swap directories of strata runs that died without cleaning up (SIGKILL, a crash): named
// strata-swap-<pid>-XXXXXX, removed when that pid is no longer alive. Never anything else.
void remove_dead_leftovers(const std::string& root) {
  DIR* dir = ::opendir(root.c_str());
  if (!dir) return;
  const std::string prefix = "strata-swap-";
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    const size_t dash = name.find('-', prefix.size());
    if (dash == std::string::npos) continue;
    const std::string pid_text = name.substr(prefix.size(), dash - prefix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    const std::string path = root + "/" + name;
    ::unlink((path + "/swap").c_str());
    if (::rmdir(path.c_str()) == 0)
      std::fprintf(stderr, "strata: removed %s, left by a run (pid %ld) that did not finish\n", path.c_str(), pid);
  }
  ::closedir(dir);
}

}  // namespace

void SwapSpace::Impl::open_dir(Dir& d) {
  struct stat st{};
  // errno taken before the hint is built (its allocation may set it).
  if (::stat(d.root.c_str(), &st) != 0) {
    const int err = errno;
    throw path_error(d.root, err, "the " + opts.path_flag + " directory does not exist");
  }
  if (!S_ISDIR(st.st_mode)) throw path_error(d.root, ENOTDIR, opts.path_flag + " must be a directory");
  if (::access(d.root.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    throw path_error(d.root, err, "the " + opts.path_flag + " directory is not writable");
  }
  remove_dead_leftovers(d.root);
  // The pid in the name lets a later run remove what a killed one left (remove_dead_leftovers).
  std::string tmpl = d.root + "/strata-swap-" + std::to_string(::getpid()) + "-XXXXXX";
  if (!::mkdtemp(tmpl.data())) throw path_error(d.root, errno, "cannot create a private swap directory (is it writable?)");
  d.dir = tmpl;
  d.file = d.dir + "/swap";
  d.cleanup_dir = register_cleanup(d.dir, true);
  d.cleanup_file = register_cleanup(d.file, false);
  const int base = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  d.direct = true;
  d.fd = opts.test_reject_direct ? (errno = EINVAL, -1) : ::open(d.file.c_str(), base | O_DIRECT, 0600);
  if (d.fd < 0 && errno != EINVAL) {
    int err = errno;
    ::rmdir(d.dir.c_str());
    throw path_error(d.file, err, "cannot create the swap file");
  }
  if (d.fd >= 0) {
    const int err = direct_io_probe(d.fd);
    if (err != 0) {
      ::close(d.fd);
      ::unlink(d.file.c_str());
      d.fd = -1;
      if (err != EINVAL) {  // not an O_DIRECT refusal: a full disk, an I/O error, ...
        ::rmdir(d.dir.c_str());
        throw path_error(d.file, err, "the first write/read of the swap file failed");
      }
    }
  }
  if (d.fd < 0) {  // the filesystem rejects O_DIRECT
    if (!opts.allow_buffered) {
      ::rmdir(d.dir.c_str());
      throw path_error(d.root, EINVAL,
                       "this filesystem rejects O_DIRECT; use a path on a real disk, or allow buffered I/O "
                       "(--allow-buffered-io: slower, goes through the page cache)");
    }
    std::fprintf(stderr, "strata: warning: %s rejects O_DIRECT; using buffered I/O there (allowed by the user)\n",
                 d.root.c_str());
    d.direct = false;
  }
  if (d.fd < 0) {
    d.fd = ::open(d.file.c_str(), base, 0600);
    if (d.fd < 0) {
      int err = errno;
      ::rmdir(d.dir.c_str());
      throw path_error(d.file, err, "cannot create the swap file");
    }
  }
  if (::fchmod(d.fd, 0600) != 0) throw path_error(d.file, errno, "cannot set mode 0600");
}

uint64_t SwapSpace::Impl::alloc_region(Dir& d, uint64_t bytes) {
  for (auto it = d.free.begin(); it != d.free.end(); ++it) {  // first fit
    if (it->second < bytes) continue;
    uint64_t off = it->first, len = it->second;
    d.free.erase(it);
    if (len > bytes) d.free.emplace(off + bytes, len - bytes);
    return off;
  }
  // Grow the file; a free block touching the end is reused, so only the shortfall is new.
  uint64_t off = d.end;
  bool reuse_tail = false;
  if (!d.free.empty()) {
    auto last = std::prev(d.free.end());
    if (last->first + last->second == d.end) {
      off = last->first;
      reuse_tail = true;
    }
  }
  uint64_t grow = off + bytes - d.end;
  if (::fallocate(d.fd, 0, static_cast<off_t>(d.end), static_cast<off_t>(grow)) != 0) {
    int err = errno;
    if (::ftruncate(d.fd, static_cast<off_t>(d.end)) != 0) { /* size unchanged on failure; best effort */ }
    std::string hint = err == ENOSPC ? "no space left to preallocate swap; free space or add another " + opts.path_flag
                       : err == EFBIG ? "file size limit (ulimit -f) reached while preallocating swap"
                       : err == EOPNOTSUPP ? "this filesystem cannot preallocate (fallocate); use ext4/xfs"
                                           : "cannot preallocate swap";
    throw IoError("allocate swap in", d.file, d.end, grow, err, hint);
  }
  d.end += grow;
  if (reuse_tail) d.free.erase(off);  // the trailing free block is now part of this region
  return off;
}

void SwapSpace::Impl::free_region(Dir& d, uint64_t off, uint64_t bytes) {
  auto next = d.free.lower_bound(off);
  if (next != d.free.end() && off + bytes == next->first) {
    bytes += next->second;
    next = d.free.erase(next);
  }
  if (next != d.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += bytes;
      return;
    }
  }
  d.free.emplace(off, bytes);
}

void SwapSpace::Impl::close_all() {
  for (Dir& d : dirs) {
    if (d.fd >= 0) ::close(d.fd);
    if (!d.file.empty()) ::unlink(d.file.c_str());
    if (!d.dir.empty()) ::rmdir(d.dir.c_str());
    unregister_cleanup(d.cleanup_file);
    unregister_cleanup(d.cleanup_dir);
    d.cleanup_file = d.cleanup_dir = -1;
    d.fd = -1;
  }
}

SwapSpace::SwapSpace(const SwapOptions& opts, IoEngine& engine) : impl_(std::make_unique<Impl>()), engine_(engine) {
  if (opts.paths.empty()) throw std::invalid_argument("SwapSpace: at least one " + opts.path_flag + " is required");
  if (opts.stripe_bytes == 0 || opts.stripe_bytes % kDirectAlign)
    throw std::invalid_argument("SwapSpace: stripe must be a positive multiple of 4096 bytes, got " +
                                std::to_string(opts.stripe_bytes));
  impl_->opts = opts;
  impl_->dirs.resize(opts.paths.size());
  try {
    for (size_t i = 0; i < opts.paths.size(); ++i) {
      impl_->dirs[i].root = opts.paths[i];
      impl_->open_dir(impl_->dirs[i]);
      impl_->dirs[i].id = engine_.add_file(impl_->dirs[i].fd, impl_->dirs[i].file);
    }
  } catch (...) {
    for (Impl::Dir& d : impl_->dirs)
      if (d.id >= 0) engine_.remove_file(d.id);
    impl_->close_all();
    throw;
  }
}

SwapSpace::~SwapSpace() {
  for (Impl::Dir& d : impl_->dirs)
    if (d.id >= 0) engine_.remove_file(d.id);
  impl_->close_all();
}

Extent SwapSpace::allocate(uint64_t bytes) {
  if (bytes == 0) throw std::invalid_argument("SwapSpace::allocate: zero bytes");
  if (bytes > (uint64_t{1} << 62))  // no disk holds it, and rounding up would wrap
    throw std::invalid_argument("SwapSpace::allocate: " + std::to_string(bytes) + " bytes is beyond any swap space");
  bytes = round_up(bytes);
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  const uint32_t n = static_cast<uint32_t>(m.dirs.size());
  const uint64_t stripe = m.opts.stripe_bytes;
  Impl::Info info;
  info.bytes = bytes;
  const uint32_t first = m.next_dir++ % n;
  // Stripe k (bytes k*stripe ..) goes to path (first + k) % n; small extents live on one path.
  const uint64_t n_stripes = (bytes + stripe - 1) / stripe;
  const uint32_t n_used = static_cast<uint32_t>(std::min<uint64_t>(n, n_stripes));
  std::vector<uint64_t> region_bytes(n_used, 0);
  // Region j holds stripes j, j + n_used, ...: all full but the last stripe of the extent.
  // Counted, not looped over: a huge extent must fail at fallocate, not spin here first.
  for (uint32_t j = 0; j < n_used; ++j)
    region_bytes[j] = (n_stripes / n_used + (j < n_stripes % n_used ? 1 : 0)) * stripe;
  region_bytes[(n_stripes - 1) % n_used] -= n_stripes * stripe - bytes;
  try {
    for (uint32_t j = 0; j < n_used; ++j) {
      uint32_t d = (first + j) % n;
      uint64_t off = m.alloc_region(m.dirs[d], region_bytes[j]);
      info.regions.push_back({d, off, region_bytes[j]});
    }
  } catch (...) {
    for (const Impl::Region& r : info.regions) m.free_region(m.dirs[r.dir], r.off, r.bytes);
    throw;
  }
  info.stripe = n_used == 1 ? bytes : stripe;
  if (m.opts.checksums) {
    info.crc = std::make_unique<uint32_t[]>(bytes / kChecksumBlock);
    info.written = std::make_unique<uint8_t[]>(bytes / kChecksumBlock);  // zeroed: nothing written yet
  }
  Extent e{m.next_id++, bytes};
  m.bytes_allocated += bytes;
  m.extents.emplace(e.id, std::move(info));
  return e;
}

void SwapSpace::free(Extent& e) {
  if (!e) return;
  Impl& m = *impl_;
  std::lock_guard lk(m.mu);
  auto it = m.extents.find(e.id);
  assert(it != m.extents.end() && "SwapSpace::free of an unknown extent");
  if (it == m.extents.end()) return;
  for (const Impl::Region& r : it->second.regions) m.free_region(m.dirs[r.dir], r.off, r.bytes);
  m.bytes_allocated -= it->second.bytes;
  m.extents.erase(it);
  e = Extent{};
}

IoHandle SwapSpace::write(const Extent& e, const void* buf) { return write(e, 0, e.bytes, buf); }
IoHandle SwapSpace::read(const Extent& e, void* buf) { return read(e, 0, e.bytes, buf); }
IoHandle SwapSpace::write(const Extent& e, uint64_t offset, uint64_t length, const void* buf) {
  return extent_io(IoOp::write, e, offset, length, const_cast<void*>(buf));
}
IoHandle SwapSpace::read(const Extent& e, uint64_t offset, uint64_t length, void* buf) {
  return extent_io(IoOp::read, e, offset, length, buf);
}

namespace {

uint64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count());
}

// crc32c of a 4 KiB block of zeros: what a zeroed range verifies against.
uint32_t zero_block_crc() {
  static const uint32_t crc = [] {
    AlignedBuffer z(kChecksumBlock);
    std::memset(z.data(), 0, kChecksumBlock);
    return crc32c(z.data(), kChecksumBlock);
  }();
  return crc;
}

// Writes `len` zero bytes at `off` (fd may be O_DIRECT: the buffer and sizes stay aligned).
// Returns 0 or the errno (a write that makes no progress counts as EIO).
int write_zeros(int fd, uint64_t off, uint64_t len) {
  AlignedBuffer buf(static_cast<size_t>(std::min<uint64_t>(len, uint64_t{1} << 20)));
  std::memset(buf.data(), 0, buf.size());
  while (len > 0) {
    const ssize_t n = ::pwrite(fd, buf.data(), static_cast<size_t>(std::min<uint64_t>(len, buf.size())),
                               static_cast<off_t>(off));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    off += static_cast<uint64_t>(n);
    len -= static_cast<uint64_t>(n);
  }
  return 0;
}

}  // namespace

void SwapSpace::zero(const Extent& e, uint64_t offset, uint64_t length) {
  Impl& m = *impl_;
  if (!is_aligned(offset) || !is_aligned(length))
    throw AlignmentError("extent " + std::to_string(e.id) + ": zero needs 4 KiB aligned offset and length (offset " +
                         std::to_string(offset) + ", length " + std::to_string(length) + ")");
  if (length == 0) return;
  struct Span {
    int fd;
    std::string file;
    uint64_t off, len;
  };
  std::vector<Span> spans;
  uint32_t* crc = nullptr;
  uint8_t* written = nullptr;
  {
    std::lock_guard lk(m.mu);
    auto it = m.extents.find(e.id);
    if (it == m.extents.end()) throw std::invalid_argument("SwapSpace: unknown or freed extent " + std::to_string(e.id));
    Impl::Info& info = it->second;
    if (offset + length > info.bytes)
      throw std::out_of_range("extent " + std::to_string(e.id) + " holds " + std::to_string(info.bytes) +
                              " bytes; zero asks for " + std::to_string(length) + " at " + std::to_string(offset));
    const uint64_t n = info.regions.size(), stripe = info.stripe, end = offset + length;
    for (uint64_t k = offset / stripe; k * stripe < end; ++k) {
      const Impl::Region& r = info.regions[k % n];
      const uint64_t lo = std::max(offset, k * stripe), hi = std::min(end, (k + 1) * stripe);
      spans.push_back({m.dirs[r.dir].fd, m.dirs[r.dir].file, r.off + (k / n) * stripe + (lo - k * stripe), hi - lo});
    }
    crc = info.crc.get() ? info.crc.get() + offset / kChecksumBlock : nullptr;
    written = info.written.get() ? info.written.get() + offset / kChecksumBlock : nullptr;
  }
  for (const Span& s : spans) {
    int err = 0;
    if (m.opts.test_no_zero_range) {
      err = EOPNOTSUPP;
    } else if (::fallocate(s.fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(s.off),
                           static_cast<off_t>(s.len)) != 0) {
      err = errno;
    }
    if (err == EOPNOTSUPP || err == EINVAL) err = write_zeros(s.fd, s.off, s.len);  // e.g. tmpfs: no ZERO_RANGE
    if (err != 0) throw IoError("zero", s.file, s.off, s.len, err, "cannot zero a range of swap");
  }
  if (crc) {
    std::fill(crc, crc + length / kChecksumBlock, zero_block_crc());
    std::memset(written, 1, length / kChecksumBlock);
  }
}

IoHandle SwapSpace::extent_io(IoOp op, const Extent& e, uint64_t offset, uint64_t length, void* buf) {
  Impl& m = *impl_;
  if (!is_aligned(offset) || !is_aligned(length) || !is_aligned(buf))
    throw AlignmentError("extent " + std::to_string(e.id) + ": buffer, offset and length must be 4 KiB aligned (offset " +
                         std::to_string(offset) + ", length " + std::to_string(length) + ")");
  static_assert(kChecksumBlock == kDirectAlign, "every aligned I/O covers whole checksum blocks");
  std::vector<IoSpan> spans;
  RequestOptions ro;
  std::string where;
  uint32_t* crc = nullptr;
  uint8_t* written = nullptr;
  {
    std::lock_guard lk(m.mu);
    auto it = m.extents.find(e.id);
    if (it == m.extents.end()) throw std::invalid_argument("SwapSpace: unknown or freed extent " + std::to_string(e.id));
    Impl::Info& info = it->second;
    if (offset + length > info.bytes)
      throw std::out_of_range("extent " + std::to_string(e.id) + " holds " + std::to_string(info.bytes) +
                              " bytes; I/O asks for " + std::to_string(length) + " at " + std::to_string(offset));
    // Only the stripes [offset, offset + length) touches are visited, not every stripe of a
    // large extent under the lock. (Neighbouring stripes are on different paths, and a one-path
    // extent is a single stripe, so no two spans are ever contiguous in one file.)
    const uint64_t n = info.regions.size(), stripe = info.stripe, end = offset + length;
    for (uint64_t k = offset / stripe; k * stripe < end; ++k) {
      const Impl::Region& r = info.regions[k % n];
      const uint64_t lo = std::max(offset, k * stripe), hi = std::min(end, (k + 1) * stripe);
      spans.push_back({m.dirs[r.dir].id, r.off + (k / n) * stripe + (lo - k * stripe), hi - lo,
                       static_cast<char*>(buf) + (lo - offset)});
    }
    where = "path " + m.dirs[info.regions[0].dir].root + (n > 1 ? " (striped)" : "");
    // The arrays outlive this I/O (an extent is not freed with I/O in flight); the caller keeps
    // at most one operation per range in flight, so no two threads touch the same entries.
    crc = info.crc.get() ? info.crc.get() + offset / kChecksumBlock : nullptr;
    written = info.written.get() ? info.written.get() + offset / kChecksumBlock : nullptr;
  }
  const uint64_t n_blocks = length / kChecksumBlock;
  if (crc && op == IoOp::write) {
    // On the submitting thread, outside the lock. (The bytes are seldom still in a cache: a
    // write-back goes long after the optimizer or the backward wrote them.)
    const auto t0 = std::chrono::steady_clock::now();
    crc32c_blocks(buf, n_blocks, kChecksumBlock, crc);
    m.checksum_ns.fetch_add(elapsed_ns(t0), std::memory_order_relaxed);
    std::memset(written, 1, n_blocks);
  }
  if (crc && op == IoOp::read) {
    // Each piece's blocks are checked as the piece arrives (RequestOptions::check_piece), so
    // checking a 400 MB read overlaps its own I/O instead of adding ~20 ms after it; the first
    // wait() reports what the pieces found.
    struct Found {
      std::mutex mu;
      uint64_t bad = 0, first = UINT64_MAX;  // first: the lowest bad block of the read
      uint32_t expected = 0, actual = 0;
    };
    auto found = std::make_shared<Found>();
    const char* base = static_cast<const char*>(buf);
    std::atomic<uint64_t>* spent = &m.checksum_ns;  // the space outlives its I/O
    ro.check_piece = [found, base, crc, written, spent](const char* from, uint64_t bytes) {
      const auto t0 = std::chrono::steady_clock::now();
      constexpr uint64_t kBatch = 64;
      uint32_t got[kBatch];
      const uint64_t b_lo = static_cast<uint64_t>(from - base) / kChecksumBlock, n = bytes / kChecksumBlock;
      for (uint64_t b0 = 0; b0 < n; b0 += kBatch) {
        const uint64_t nb = std::min(kBatch, n - b0);
        crc32c_blocks(from + b0 * kChecksumBlock, nb, kChecksumBlock, got);
        for (uint64_t j = 0; j < nb; ++j) {
          const uint64_t b = b_lo + b0 + j;
          if (!written[b] || got[j] == crc[b]) continue;
          std::lock_guard lk(found->mu);
          ++found->bad;
          if (b < found->first) {
            found->first = b;
            found->expected = crc[b];
            found->actual = got[j];
          }
        }
      }
      spent->fetch_add(elapsed_ns(t0), std::memory_order_relaxed);
    };
    const uint64_t id = e.id;
    ro.verify = [&m, found, offset, id] {
      // Runs once, on the first thread to wait for the read, after every piece was checked.
      std::lock_guard flk(found->mu);
      if (found->bad == 0) return;
      m.checksum_failures.fetch_add(1);
      ChecksumError::Where w;
      w.extent_id = id;
      w.extent_offset = offset + found->first * kChecksumBlock;
      w.block_bytes = kChecksumBlock;
      w.bad_blocks = found->bad;
      w.expected = found->expected;
      w.actual = found->actual;
      {
        std::lock_guard lk(m.mu);
        auto it = m.extents.find(id);
        if (it != m.extents.end()) {
          auto [dir, file_offset] = m.locate(it->second, w.extent_offset);
          w.path = m.dirs[dir].file;
          w.file_offset = file_offset;
        }
      }
      throw ChecksumError(std::move(w));
    };
  }
  ro.label = "extent " + std::to_string(e.id) + " (" + std::to_string(length) + " bytes at extent offset " +
             std::to_string(offset) + ", " + where + ")";
  return engine_.submit(op, spans, std::move(ro));
}

SwapStats SwapSpace::stats() const {
  std::lock_guard lk(impl_->mu);
  SwapStats s;
  s.bytes_allocated = impl_->bytes_allocated;
  for (const Impl::Dir& d : impl_->dirs) {
    s.bytes_reserved += d.end;
    s.buffered |= !d.direct;
  }
  s.extents = impl_->extents.size();
  s.checksum_failures = impl_->checksum_failures.load();
  s.checksum_ms = static_cast<double>(impl_->checksum_ns.load(std::memory_order_relaxed)) / 1e6;
  return s;
}

std::vector<std::string> SwapSpace::files() const {
  std::vector<std::string> f;
  for (const Impl::Dir& d : impl_->dirs) f.push_back(d.file);
  return f;
}

}  // namespace strata::io
