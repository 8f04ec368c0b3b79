// Internal to io/: the request/piece bookkeeping both engines share — alignment checks,
// splitting into block-sized pieces, and the one place a piece's result is judged (done,
// re-queue the remainder of a short transfer, retry EAGAIN/EINTR, or fail with context).
#pragma once
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "io/engine.h"

namespace strata::io::detail {

struct Request;

// One block-sized (or smaller) contiguous transfer; the unit in flight. Its offset/buf/length
// advance when a short transfer is re-queued for the remainder.
struct Piece {
  Request* req = nullptr;
  IoOp op = IoOp::read;
  FileId file = -1;
  int fd = -1;          // raw fd
  int fixed_file = -1;  // registered-file slot, -1 if none
  uint64_t offset = 0;
  uint64_t length = 0;
  char* buf = nullptr;
  int zero_progress = 0;  // consecutive 0-byte writes
  char* start = nullptr;  // the piece as submitted (buf and length advance on a short transfer)
  uint64_t total = 0;
};

// Implemented by an engine whose completions the caller reaps (no reaper thread).
class Reaper {
 public:
  virtual void reap_until(Request& r) = 0;
  virtual size_t poll() = 0;  // non-blocking

 protected:
  ~Reaper() = default;
};

struct Request {
  IoOp op = IoOp::read;
  uint64_t bytes = 0;
  std::vector<Piece> pieces;  // reserved up front: addresses are stable (user_data points here)
  std::atomic<uint32_t> pieces_left{0};
  std::atomic<uint32_t> done{0};
  Reaper* reaper = nullptr;  // non-null: wait() drives the engine's completion loop
  std::string label;
  std::function<void()> verify;
  std::function<void(const char*, uint64_t)> check_piece;  // RequestOptions::check_piece
  std::once_flag verify_once;
  std::exception_ptr verify_error;
  // The first failure, kept as plain data: each wait() throws its own IoError built from it, so
  // no exception object is shared between the completing and the waiting thread.
  struct Failure {
    std::string op, path, hint;
    uint64_t offset = 0, length = 0;
    int err = 0;
  };
  std::mutex error_mu;
  std::optional<Failure> error;  // written before `done` is released
  std::chrono::steady_clock::time_point t_submit;
  std::atomic<int64_t> latency_ns{0};
  std::shared_ptr<Request> self;  // keeps the request alive while pieces are in flight

  void fail(Failure f) {
    std::lock_guard lk(error_mu);
    if (!error) error = std::move(f);
  }
  // Called once per piece when it is finished for good; the last one completes the request. A
  // read's piece is checked first (check_piece), here on the thread that reaped it, so the
  // check overlaps the rest of the read instead of following it.
  void finish_piece(const Piece& p) {
    if (check_piece) {
      bool failed;
      {
        std::lock_guard lk(error_mu);
        failed = error.has_value();
      }
      if (!failed) check_piece(p.start, p.total);  // records what it finds; never throws
    }
    if (pieces_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    latency_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t_submit).count(),
                     std::memory_order_relaxed);
    std::shared_ptr<Request> keep = std::move(self);
    done.store(1, std::memory_order_release);
    done.notify_all();
  }
};

enum class Outcome { done, requeue, failed };

// State and logic shared by the uring and threads engines.
class EngineBase : public IoEngine {
 public:
  explicit EngineBase(const EngineOptions& opts);

  FileId add_file(int fd, const std::string& path) override;
  void remove_file(FileId f) override;
  const EngineOptions& options() const override { return opts_; }
  EngineStats stats() const override;

 protected:
  struct FileEntry {
    int fd = -1;
    int fixed = -1;
    std::string path;
  };
  // Validates (AlignmentError) and splits the spans into pieces; the request holds itself alive.
  std::shared_ptr<Request> make_request(IoOp op, std::span<const IoSpan> spans, RequestOptions&& ropts);
  // Judges one raw result of a piece (after the test hook). On requeue the piece has been
  // advanced past the bytes done; on failed the request carries the error.
  Outcome on_result(Piece& p, int64_t res);
  std::string file_path(FileId f) const;
  // Engine hooks for file registration (uring: registered-file table).
  virtual int register_fd(int /*fd*/) { return -1; }
  virtual void unregister_fd(int /*slot*/) {}

  EngineOptions opts_;
  mutable std::shared_mutex files_mu_;
  std::vector<FileEntry> files_;
  std::vector<FileId> free_ids_;

  struct AtomicStats {
    std::atomic<uint64_t> requests{0}, pieces{0}, bytes_read{0}, bytes_written{0}, short_requeues{0}, retries{0},
        errors{0}, submit_calls{0}, fixed_pieces{0};
  } st_;
};

}  // namespace strata::io::detail
