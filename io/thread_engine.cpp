// The fallback engine: a small pool of threads doing pread/pwrite, for kernels or sandboxes
// where io_uring is not permitted. Same interface and the same result judging (short transfers
// re-queued, EAGAIN/EINTR retried, everything else an IoError with context).
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <thread>

#include "io/engine_base.h"

namespace strata::io {
namespace {

using detail::Outcome;
using detail::Piece;
using detail::Request;

class ThreadEngine final : public detail::EngineBase {
 public:
  explicit ThreadEngine(const EngineOptions& opts) : EngineBase(opts) {
    unsigned n = opts.n_threads ? opts.n_threads : 1;
    for (unsigned i = 0; i < n; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  ~ThreadEngine() override {
    drain();
    {
      std::lock_guard lk(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  bool register_buffer(void*, size_t) override { return true; }  // nothing to register for pread/pwrite
  void unregister_buffer(void*) override {}

  IoHandle submit(IoOp op, std::span<const IoSpan> spans, RequestOptions ropts) override {
    std::shared_ptr<Request> r = make_request(op, spans, std::move(ropts));
    if (!r->pieces.empty()) {
      {
        std::lock_guard lk(mu_);
        for (Piece& p : r->pieces) queue_.push_back(&p);
        outstanding_ += r->pieces.size();
      }
      if (r->pieces.size() == 1) work_cv_.notify_one();
      else work_cv_.notify_all();
    }
    return IoHandle(std::move(r));
  }

  size_t poll() override { return 0; }  // workers complete requests themselves

  void drain() override {
    std::unique_lock lk(mu_);
    idle_cv_.wait(lk, [this] { return outstanding_ == 0; });
  }

  EngineKind kind() const override { return EngineKind::threads; }

 private:
  void worker_loop() {
    for (;;) {
      Piece* p;
      {
        std::unique_lock lk(mu_);
        work_cv_.wait(lk, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and drained
        p = queue_.front();
        queue_.pop_front();
      }
      run_piece(*p);
      Request* r = p->req;
      r->finish_piece(*p);  // may free the request (and p)
      std::lock_guard lk(mu_);
      if (--outstanding_ == 0) idle_cv_.notify_all();
    }
  }

  void run_piece(Piece& p) {
    for (;;) {
      ssize_t n = p.op == IoOp::read ? ::pread(p.fd, p.buf, p.length, static_cast<off_t>(p.offset))
                                     : ::pwrite(p.fd, p.buf, p.length, static_cast<off_t>(p.offset));
      int64_t res = n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
      if (on_result(p, res) != Outcome::requeue) return;
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<Piece*> queue_;
  uint64_t outstanding_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoEngine> make_thread_engine(const EngineOptions& opts) { return std::make_unique<ThreadEngine>(opts); }

}  // namespace strata::io
