// The io_uring engine: one ring, a bounded number of pieces in flight (the rest wait in a
// backlog, so callers never hit "not enough buffers"), registered files and buffers, and
// completions reaped by a dedicated thread or by the caller inside wait().
#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

#include "io/engine_base.h"

namespace strata::io {
namespace {

using detail::Outcome;
using detail::Piece;
using detail::Request;

constexpr unsigned kMaxFiles = 256;    // registered-file table slots
constexpr unsigned kMaxBuffers = 64;   // registered-buffer table slots
constexpr size_t kMaxFixedBuffer = size_t{1} << 30;  // the kernel's limit per registered buffer

[[noreturn]] void fatal(const char* what, int err) {
  std::fprintf(stderr, "strata: fatal: io_uring %s failed: %s\n", what, std::strerror(err));
  std::abort();
}

class UringEngine final : public detail::EngineBase, public detail::Reaper {
 public:
  explicit UringEngine(const EngineOptions& opts) : EngineBase(opts) {
    io_uring_params p{};
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = 2 * opts.queue_depth + 8;  // in-flight pieces never exceed queue_depth: no overflow
    int ret = io_uring_queue_init_params(opts.queue_depth + 1, &ring_, &p);
    if (ret < 0) throw std::runtime_error(std::string("io_uring_queue_init: ") + std::strerror(-ret));
    if (io_uring_register_files_sparse(&ring_, kMaxFiles) == 0) {
      file_slots_.assign(kMaxFiles, false);
    }
    if (io_uring_register_buffers_sparse(&ring_, kMaxBuffers) == 0) buffers_sparse_ = true;
    if (opts.reaper_thread) reaper_ = std::thread([this] { reaper_loop(); });
  }

  ~UringEngine() override {
    drain();
    if (reaper_.joinable()) {
      {
        std::lock_guard lk(sq_mu_);
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        assert(sqe);
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, 0);  // user_data 0: the reaper's stop signal
        submit_locked();
      }
      reaper_.join();
    }
    io_uring_queue_exit(&ring_);
  }

  bool register_buffer(void* p, size_t bytes) override {
    if (!buffers_sparse_) return false;
    std::lock_guard lk(sq_mu_);
    char* base = static_cast<char*>(p);
    for (size_t off = 0; off < bytes; off += kMaxFixedBuffer) {
      const int slot = free_buffer_slot_locked();
      int ret = -ENOBUFS;
      iovec iov{base + off, std::min(kMaxFixedBuffer, bytes - off)};
      if (slot >= 0) ret = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(slot), &iov, nullptr, 1);
      if (ret < 0) {
        static std::once_flag warned;
        std::call_once(warned, [ret] {
          std::fprintf(stderr, "strata: warning: io_uring buffer registration refused (%s); using unregistered I/O\n",
                       std::strerror(-ret));
        });
        unregister_locked(base);  // all or nothing: drop the pieces already registered
        return false;
      }
      buffers_.push_back(FixedBuffer{base, static_cast<char*>(iov.iov_base), iov.iov_len, slot});
    }
    return true;
  }

  void unregister_buffer(void* p) override {
    std::lock_guard lk(sq_mu_);
    unregister_locked(static_cast<char*>(p));
  }

  IoHandle submit(IoOp op, std::span<const IoSpan> spans, RequestOptions ropts) override {
    std::shared_ptr<Request> r = make_request(op, spans, std::move(ropts));
    if (!opts_.reaper_thread) r->reaper = this;
    if (!r->pieces.empty()) {
      outstanding_.fetch_add(r->pieces.size(), std::memory_order_relaxed);
      std::lock_guard lk(sq_mu_);
      for (Piece& p : r->pieces) backlog_.push_back(&p);
      fill_locked();
    }
    return IoHandle(std::move(r));
  }

  size_t poll() override {
    if (opts_.reaper_thread) return 0;
    std::unique_lock lk(cq_mu_, std::try_to_lock);
    if (!lk) return 0;
    return process_cqes(nullptr);
  }

  void drain() override {
    if (opts_.reaper_thread) {
      std::unique_lock lk(idle_mu_);
      idle_cv_.wait(lk, [this] { return outstanding_.load(std::memory_order_acquire) == 0; });
      return;
    }
    std::lock_guard lk(cq_mu_);
    while (outstanding_.load(std::memory_order_acquire) != 0) wait_and_process();
  }

  void reap_until(Request& r) override {
    while (!r.done.load(std::memory_order_acquire)) {
      std::unique_lock lk(cq_mu_, std::try_to_lock);
      if (!lk) {  // another caller is reaping; it completes our request too
        std::this_thread::sleep_for(std::chrono::microseconds(20));
        continue;
      }
      while (!r.done.load(std::memory_order_acquire)) wait_and_process();
    }
  }

  EngineKind kind() const override { return EngineKind::uring; }

 protected:
  int register_fd(int fd) override {
    std::lock_guard lk(sq_mu_);
    for (unsigned i = 0; i < file_slots_.size(); ++i) {
      if (file_slots_[i]) continue;
      if (io_uring_register_files_update(&ring_, i, &fd, 1) < 0) return -1;  // use the raw fd
      file_slots_[i] = true;
      return static_cast<int>(i);
    }
    return -1;
  }
  void unregister_fd(int slot) override {
    std::lock_guard lk(sq_mu_);
    int none = -1;
    int ret = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &none, 1);
    if (ret < 0) std::fprintf(stderr, "strata: warning: io_uring file unregister failed: %s\n", std::strerror(-ret));
    file_slots_[slot] = false;
  }

 private:
  struct FixedBuffer {
    char* registered_as;  // the p of the register_buffer call it came from
    char* p;
    size_t bytes;
    int index;
  };

  int free_buffer_slot_locked() const {
    for (unsigned slot = 0; slot < kMaxBuffers; ++slot)
      if (std::none_of(buffers_.begin(), buffers_.end(), [&](const FixedBuffer& b) { return b.index == int(slot); }))
        return static_cast<int>(slot);
    return -1;
  }

  // Empties the table slots registered for `base` (the kernel unpins those pages) and forgets them.
  void unregister_locked(char* base) {
    for (const FixedBuffer& b : buffers_) {
      if (b.registered_as != base) continue;
      iovec none{nullptr, 0};
      int ret = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(b.index), &none, nullptr, 1);
      if (ret < 0)
        std::fprintf(stderr, "strata: warning: io_uring buffer unregister failed: %s\n", std::strerror(-ret));
    }
    std::erase_if(buffers_, [&](const FixedBuffer& b) { return b.registered_as == base; });
  }

  int fixed_index_locked(const char* p, uint64_t len) const {
    for (const FixedBuffer& b : buffers_)
      if (p >= b.p && p + len <= b.p + b.bytes) return b.index;
    return -1;
  }

  void prep_locked(io_uring_sqe* sqe, Piece& p) {
    const bool fixed_file = p.fixed_file >= 0;
    const int fd = fixed_file ? p.fixed_file : p.fd;
    const unsigned len = static_cast<unsigned>(p.length);
    const int buf_index = fixed_index_locked(p.buf, p.length);
    if (buf_index >= 0) {
      st_.fixed_pieces.fetch_add(1, std::memory_order_relaxed);
      if (p.op == IoOp::read) io_uring_prep_read_fixed(sqe, fd, p.buf, len, p.offset, buf_index);
      else io_uring_prep_write_fixed(sqe, fd, p.buf, len, p.offset, buf_index);
    } else {
      if (p.op == IoOp::read) io_uring_prep_read(sqe, fd, p.buf, len, p.offset);
      else io_uring_prep_write(sqe, fd, p.buf, len, p.offset);
    }
    if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, &p);
  }

  // Moves backlog pieces into the ring up to queue_depth, then one submit syscall for the batch.
  void fill_locked() {
    unsigned n = 0;
    while (in_flight_ < opts_.queue_depth && !backlog_.empty()) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) break;
      Piece* p = backlog_.front();
      backlog_.pop_front();
      prep_locked(sqe, *p);
      ++in_flight_;
      ++n;
    }
    if (n) submit_locked();
  }

  void submit_locked() {
    while (io_uring_sq_ready(&ring_) > 0) {
      int ret = io_uring_submit(&ring_);
      st_.submit_calls.fetch_add(1, std::memory_order_relaxed);
      if (ret == -EINTR || ret == -EAGAIN || ret == -EBUSY) continue;
      if (ret < 0) fatal("submit", -ret);
    }
  }

  void wait_and_process() {
    io_uring_cqe* cqe = nullptr;
    int ret = io_uring_wait_cqe(&ring_, &cqe);
    if (ret == -EINTR || ret == -EAGAIN) return;
    if (ret < 0) fatal("wait_cqe", -ret);
    process_cqes(nullptr);
  }

  // Reaps every available completion; returns how many pieces finished for good. Sets *stop when
  // the shutdown NOP is seen.
  size_t process_cqes(bool* stop) {
    io_uring_cqe* cqes[64];
    size_t finished_total = 0;
    for (;;) {
      unsigned n = io_uring_peek_batch_cqe(&ring_, cqes, 64);
      if (n == 0) return finished_total;
      Piece* requeue[64];
      Piece* finished[64];
      unsigned n_requeue = 0, n_finished = 0, n_pieces = 0;
      // Judged under sq_mu_: a piece was submitted under it, so taking it here orders the
      // submitter's writes to the piece before our reads for ThreadSanitizer, which cannot see
      // the ordering the kernel provides through the rings.
      std::unique_lock lk(sq_mu_);
      for (unsigned i = 0; i < n; ++i) {
        Piece* p = static_cast<Piece*>(io_uring_cqe_get_data(cqes[i]));
        if (!p) {
          if (stop) *stop = true;
          continue;
        }
        ++n_pieces;
        if (on_result(*p, cqes[i]->res) == Outcome::requeue) requeue[n_requeue++] = p;
        else finished[n_finished++] = p;
      }
      io_uring_cq_advance(&ring_, n);
      in_flight_ -= n_pieces;
      for (unsigned i = n_requeue; i-- > 0;) backlog_.push_front(requeue[i]);
      fill_locked();
      lk.unlock();
      for (unsigned i = 0; i < n_finished; ++i) finished[i]->req->finish_piece(*finished[i]);
      if (n_finished) {
        if (outstanding_.fetch_sub(n_finished, std::memory_order_acq_rel) == n_finished && opts_.reaper_thread) {
          std::lock_guard idle_lk(idle_mu_);
          idle_cv_.notify_all();
        }
      }
      finished_total += n_finished;
    }
  }

  void reaper_loop() {
    bool stop = false;
    while (!stop) {
      io_uring_cqe* cqe = nullptr;
      int ret = io_uring_wait_cqe(&ring_, &cqe);
      if (ret == -EINTR || ret == -EAGAIN) continue;
      if (ret < 0) fatal("wait_cqe", -ret);
      process_cqes(&stop);
    }
  }

  io_uring ring_{};
  std::mutex sq_mu_;            // guards the SQ, backlog_, in_flight_, buffers_, file_slots_
  std::deque<Piece*> backlog_;  // pieces waiting for a queue slot (re-queued remainders at the front)
  unsigned in_flight_ = 0;
  std::vector<FixedBuffer> buffers_;
  bool buffers_sparse_ = false;
  std::vector<bool> file_slots_;
  std::mutex cq_mu_;  // caller-reaped mode: one reaper at a time
  std::atomic<uint64_t> outstanding_{0};  // pieces submitted and not finished for good
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::thread reaper_;
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(const EngineOptions& opts) { return std::make_unique<UringEngine>(opts); }

}  // namespace strata::io
