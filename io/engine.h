// IoEngine: asynchronous block I/O on files, the only way strata touches NVMe. Two engines
// behind one interface: io_uring (O_DIRECT, registered buffers and files, bounded depth) and a
// pread/pwrite thread pool for kernels or sandboxes that forbid io_uring.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "io/aligned_buffer.h"
#include "io/errors.h"

namespace strata::io {

enum class IoOp : uint8_t { read, write };
enum class EngineKind : uint8_t { automatic, uring, threads };

const char* to_string(EngineKind k);
EngineKind parse_engine_kind(const std::string& s);  // "auto" | "uring" | "threads"

// Test hook: sees every piece's raw result (bytes done or -errno) and returns the result the
// engine should act on, e.g. fewer bytes (short I/O), -EIO, -EAGAIN. Called on the reaping thread.
using CompletionHook = std::function<int64_t(IoOp op, uint64_t offset, uint64_t length, int64_t result)>;

struct EngineOptions {
  EngineKind kind = EngineKind::automatic;  // automatic: io_uring if permitted, else threads (warns once)
  unsigned queue_depth = 32;                // pieces in flight at most; the rest wait in a backlog
  uint64_t block_bytes = 1 << 20;           // requests longer than this go out as pieces in flight together
  bool reaper_thread = true;                // false: the caller reaps completions inside wait()/poll()
  unsigned n_threads = 4;                   // threads engine: workers (its queue depth)
  CompletionHook completion_hook;           // tests only
};

struct EngineStats {
  uint64_t requests = 0;        // read()/write()/submit() calls
  uint64_t pieces = 0;          // block-sized pieces issued (requeues not counted)
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t short_requeues = 0;  // short reads/writes re-issued for the remainder
  uint64_t retries = 0;         // EAGAIN / EINTR re-issued
  uint64_t errors = 0;          // pieces that failed (a request fails if any of its pieces does)
  uint64_t submit_calls = 0;    // io_uring_submit syscalls (uring engine)
  uint64_t fixed_pieces = 0;    // pieces that used a registered buffer
};

namespace detail {
struct Request;
}

// The completion of one request. Cheap to copy; wait() is idempotent and may be called from any
// thread. A request's buffer must stay alive and untouched until ready() is true.
class IoHandle {
 public:
  IoHandle() = default;
  explicit IoHandle(std::shared_ptr<detail::Request> r) : r_(std::move(r)) {}
  bool valid() const { return r_ != nullptr; }
  bool ready() const;      // every piece has finished (ok or not); never blocks (reaps what is there)
  void wait();             // blocks until ready; throws IoError / ChecksumError on failure
  uint64_t bytes() const;  // bytes the request covers
  double latency_us() const;  // submit -> last piece done; valid once ready()

 private:
  std::shared_ptr<detail::Request> r_;
};

using FileId = int32_t;

// Optional per-request extras (SwapSpace uses them): a label appended to every error message,
// and a check run once by the first wait() after the I/O succeeded (e.g. checksum verification).
struct RequestOptions {
  std::string label;
  std::function<void()> verify;
  // A read only: called with each piece's [from, from + bytes) of the buffer once the piece has
  // arrived, on the thread that completes it (so a check overlaps the rest of the read). It
  // must not throw: it records what it finds for `verify` to report.
  std::function<void(const char*, uint64_t)> check_piece;
};

// One contiguous range of a request: `length` bytes at `offset` of `file`, to/from `buf`.
struct IoSpan {
  FileId file = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
  void* buf = nullptr;
};

// Thread-safe: any thread may submit and wait. Buffers, offsets and lengths must be multiples of
// 4 KiB (AlignmentError otherwise). Destroying the engine waits for everything in flight.
class IoEngine {
 public:
  virtual ~IoEngine() = default;
  IoEngine() = default;
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Register an open fd (the caller keeps it open until remove_file); `path` names it in errors.
  virtual FileId add_file(int fd, const std::string& path) = 0;
  virtual void remove_file(FileId f) = 0;  // nothing may be in flight on it
  // Register a long-lived (pinned) staging buffer: pieces inside it use read_fixed/write_fixed.
  // Returns false (and I/O still works, unregistered) if the kernel refuses, e.g. memlock limit.
  virtual bool register_buffer(void* p, size_t bytes) = 0;
  // Drops the registration made for the buffer starting at p (no-op if there is none), so the
  // kernel unpins its pages and a later buffer at the same address is registered afresh. Call
  // before freeing the buffer, with no I/O in flight on it.
  virtual void unregister_buffer(void* p) = 0;

  IoHandle read(FileId f, uint64_t offset, uint64_t length, void* buf);
  IoHandle write(FileId f, uint64_t offset, uint64_t length, const void* buf);
  // Several spans as one request (e.g. the stripes of an extent), submitted in one batch.
  virtual IoHandle submit(IoOp op, std::span<const IoSpan> spans, RequestOptions ropts = {}) = 0;

  virtual size_t poll() = 0;  // reap what has completed without blocking (caller-reaped mode)
  virtual void drain() = 0;   // wait for everything in flight

  virtual EngineKind kind() const = 0;
  virtual const EngineOptions& options() const = 0;
  virtual EngineStats stats() const = 0;
};

// Build an engine. kind=uring throws if io_uring is not permitted; kind=automatic falls back to
// the threads engine, printing one warning per process and counting it (fallback_count()).
std::unique_ptr<IoEngine> make_engine(const EngineOptions& opts = {});

// Probe: can this process create an io_uring (io_uring_queue_init)? `why` gets the reason if not.
bool uring_available(std::string* why = nullptr);
uint64_t fallback_count();

}  // namespace strata::io
