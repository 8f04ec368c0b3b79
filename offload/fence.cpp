// Fence parts: host signals, stream events (recorded now or later), the event pool, and the
// set that joins them.
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

bool Signal::failed() {
  std::lock_guard lock(mu_);
  return done_ && error_;
}

EventPart::EventPart(std::unique_ptr<kernels::Event> e) : event_(std::move(e)) {}
EventPart::~EventPart() = default;
void EventPart::wait() { event_->synchronize(); }
bool EventPart::ready() { return event_->query(); }
bool EventPart::enqueue_wait(kernels::Stream& s) {
  s.wait(*event_);
  return true;
}

void DeferredEventPart::wait() {
  signal_.wait();  // rethrows the error of what the recording waited for
  event_->wait();
}

bool DeferredEventPart::ready() {
  if (!signal_.ready()) return false;
  return signal_.failed() || event_->ready();
}

bool DeferredEventPart::enqueue_wait(kernels::Stream& s) {
  if (!signal_.ready() || signal_.failed()) return false;
  return event_->enqueue_wait(s);
}

std::shared_ptr<EventPart> EventPool::take() {
  std::lock_guard lock(mu_);
  // Round robin from where the last search stopped: an event no fence holds any more (only the
  // pool does) may be recorded again.
  for (size_t i = 0; i < events_.size(); ++i) {
    const size_t k = (next_ + i) % events_.size();
    if (events_[k].use_count() == 1) {
      next_ = k + 1;
      return events_[k];
    }
  }
  events_.push_back(std::make_shared<EventPart>(rt_.create_event()));
  next_ = 0;
  return events_.back();
}

size_t EventPool::size() const {
  std::lock_guard lock(mu_);
  return events_.size();
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
    if (!p->host_ready()) return false;
  return true;
}

void Fence::wait_host() const {
  for (const auto& p : parts_) p->wait_host();
}

void Fence::enqueue_wait(kernels::Stream& s) const {
  for (const auto& p : parts_) {
    if (!p->host_ready()) {
      try {
        p->wait_host();
      } catch (...) {  // its owner sees it (wait_host / the fence of the work behind it)
      }
    }
    p->enqueue_wait(s);  // false: host work, complete by now
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
  bool host_ready() override { return w_->host_ready(); }
  void wait_host() override {
    try {
      w_->wait_host();
    } catch (...) {
    }
  }
  // A stream event stays one when only its completion is asked for: the stream waits on it
  // directly (a stream wait carries no error), never through the host.
  bool enqueue_wait(kernels::Stream& s) override { return w_->enqueue_wait(s); }

 private:
  std::shared_ptr<Waitable> w_;
};

// Parts whose error a later fence must carry: anything but a plain stream event or a quiet part.
bool can_fail(const std::shared_ptr<Waitable>& p) {
  return !dynamic_cast<EventPart*>(p.get()) && !dynamic_cast<QuietPart*>(p.get());
}
}  // namespace

Fence Fence::quiet() const {
  Fence out;
  for (const auto& p : parts_)
    out.parts_.push_back(dynamic_cast<QuietPart*>(p.get()) ? p : std::make_shared<QuietPart>(p));
  return out;
}

void Fence::carry_errors(const Fence& f) {
  for (const auto& p : f.parts_)
    if (can_fail(p) && !(p->ready() && [&] {
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
