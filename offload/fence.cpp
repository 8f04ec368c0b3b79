// Fence parts: host signals, stream events, and the set that joins them.
#include "offload/fence.h"

#include "kernels/runtime.h"

namespace strata::offload {

void Signal::set(std::exception_ptr error) {
  std::lock_guard lock(mu_);
  done_ = true;
  error_ = error;
  cv_.notify_all();
}

void Signal::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool Signal::ready() {
  std::lock_guard lock(mu_);
  return done_;
}

EventPart::EventPart(std::unique_ptr<kernels::Event> e) : event_(std::move(e)) {}
EventPart::~EventPart() = default;
void EventPart::wait() { event_->synchronize(); }
bool EventPart::ready() { return event_->query(); }
bool EventPart::enqueue_wait(kernels::Stream& s) {
  s.wait(*event_);
  return true;
}

void Fence::add(std::shared_ptr<Waitable> w) {
  if (w) parts_.push_back(std::move(w));
}

void Fence::add(const Fence& f) {
  for (const auto& p : f.parts_) parts_.push_back(p);
  if (parts_.size() > 16) prune();
}

void Fence::wait() const {
  for (const auto& p : parts_) p->wait();
}

bool Fence::ready() const {
  for (const auto& p : parts_)
    if (!p->ready()) return false;
  return true;
}

bool Fence::host_ready() const {
  for (const auto& p : parts_)
    if (!p->is_stream_event() && !p->ready()) return false;
  return true;
}

void Fence::wait_host() const {
  for (const auto& p : parts_)
    if (!p->is_stream_event()) p->wait();
}

void Fence::enqueue_wait(kernels::Stream& s) const {
  for (const auto& p : parts_) {
    if (p->enqueue_wait(s)) continue;
    if (p->ready()) continue;  // complete: nothing to order (its error is the host's to see)
    std::shared_ptr<Waitable> keep = p;  // alive until the stream runs the wait
    s.host_fn([keep] {
      try {
        keep->wait();
      } catch (...) {  // carried by the fence of the work behind it, not by the stream
      }
    });
  }
}

namespace {
class QuietPart final : public Waitable {
 public:
  explicit QuietPart(std::shared_ptr<Waitable> w) : w_(std::move(w)) {}
  void wait() override {
    try {
      w_->wait();
    } catch (...) {  // completion is all that is asked for
    }
  }
  bool ready() override { return w_->ready(); }
  // A stream event stays one when only its completion is asked for: the stream waits on it
  // directly (a stream wait carries no error), never through the host.
  bool enqueue_wait(kernels::Stream& s) override { return w_->enqueue_wait(s); }
  bool is_stream_event() const override { return w_->is_stream_event(); }

 private:
  std::shared_ptr<Waitable> w_;
};
}  // namespace

Fence Fence::quiet() const {
  Fence out;
  for (const auto& p : parts_)
    out.parts_.push_back(dynamic_cast<QuietPart*>(p.get()) ? p : std::make_shared<QuietPart>(p));
  return out;
}

void Fence::carry_errors(const Fence& f) {
  for (const auto& p : f.parts_)
    if (!p->is_stream_event() && !(p->ready() && [&] {
          try {
            p->wait();
            return true;
          } catch (...) {
            return false;
          }
        }()))
      parts_.push_back(p);
  if (parts_.size() > 16) prune();
}

void Fence::prune() {
  std::vector<std::shared_ptr<Waitable>> kept;
  for (auto& p : parts_) {
    if (!p->ready()) {
      kept.push_back(std::move(p));
      continue;
    }
    try {
      p->wait();  // completed: keep it only if it failed, so the error is not lost
    } catch (...) {
      kept.push_back(std::move(p));
    }
  }
  parts_ = std::move(kept);
}

}  // namespace strata::offload
