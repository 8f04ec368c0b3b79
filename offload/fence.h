// Fence: "this work has completed", across every kind of asynchronous work offload/ issues —
// stream events (device<->host copies), io/ requests (NVMe), and host-side signals. A fence is
// a cheap, copyable set of parts. Nothing ever blocks inside a stream: a stream waits only on
// events; every other part is waited for on a host thread (wait_host), counted by whoever waits.
#pragma once
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace strata::kernels {
class Runtime;
class Stream;
class Event;
}  // namespace strata::kernels

namespace strata::offload {

// One piece of asynchronous work. wait() rethrows the work's error, if any.
class Waitable {
 public:
  virtual ~Waitable() = default;
  virtual void wait() = 0;
  virtual bool ready() = 0;
  // The part's host side: what a host thread must see complete before a stream may be ordered
  // behind the rest with enqueue_wait. Everything, for host work; nothing, for a stream event.
  virtual bool host_ready() { return ready(); }
  virtual void wait_host() { wait(); }
  // Orders later work on s after the part's stream side without the host; false when the part
  // has none (host work: its host side is all of it).
  virtual bool enqueue_wait(kernels::Stream&) { return false; }
};

// Set once by whoever finishes the work (any thread), with the work's error or none.
class Signal final : public Waitable {
 public:
  void set(std::exception_ptr error = nullptr);
  void wait() override;
  bool ready() override;
  bool failed();  // set with an error

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// A recorded stream event: a stream waits on it without the host.
class EventPart final : public Waitable {
 public:
  explicit EventPart(std::unique_ptr<kernels::Event> e);
  ~EventPart() override;
  void wait() override;
  bool ready() override;
  bool host_ready() override { return true; }
  void wait_host() override {}
  bool enqueue_wait(kernels::Stream& s) override;
  kernels::Event& event() { return *event_; }

 private:
  std::unique_ptr<kernels::Event> event_;
};

// A stream event that a host thread records later (stream work that must first wait for host
// work, e.g. a device copy of bytes still arriving from NVMe): its host side is "recorded" (or
// failed, carrying the error of what it waited for); after that it is a plain event.
class DeferredEventPart final : public Waitable {
 public:
  explicit DeferredEventPart(std::shared_ptr<EventPart> event) : event_(std::move(event)) {}
  kernels::Event& event() { return event_->event(); }
  void recorded() { signal_.set(); }                     // after event() was recorded
  void failed(std::exception_ptr e) { signal_.set(e); }  // never recorded
  void wait() override;
  bool ready() override;
  bool host_ready() override { return signal_.ready(); }
  void wait_host() override { signal_.wait(); }
  bool enqueue_wait(kernels::Stream& s) override;

 private:
  std::shared_ptr<EventPart> event_;
  Signal signal_;
};

// Stream events for fences, reused once no fence holds them (an event is re-recordable), so
// copies and releases do not create events.
class EventPool {
 public:
  explicit EventPool(kernels::Runtime& rt) : rt_(rt) {}
  std::shared_ptr<EventPart> take();
  size_t size() const;  // events created so far

 private:
  kernels::Runtime& rt_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<EventPart>> events_;
  size_t next_ = 0;
};

class Fence {
 public:
  Fence() = default;  // empty: already complete
  explicit Fence(std::shared_ptr<Waitable> w) { add(std::move(w)); }
  void add(std::shared_ptr<Waitable> w);
  void add(const Fence& f);
  void wait() const;                              // host waits; rethrows the first error
  bool ready() const;                             // never blocks
  // The host sides of every part (I/O, host signals, deferred events not yet recorded):
  // complete? / wait for them on this thread, rethrowing the first error.
  bool host_ready() const;
  void wait_host() const;
  // s waits for every part's stream side (events). Host sides are not the stream's to wait
  // for: a part whose host side is not complete is waited for here, on the calling thread,
  // and its error left to whoever owns it (call wait_host first to see errors and to count the
  // wait). Never enqueues a blocking host function.
  void enqueue_wait(kernels::Stream& s) const;
  // Adds f's parts that can fail (host work, deferred events): their errors are what a fence
  // of stream work ordered after f must rethrow.
  void carry_errors(const Fence& f);
  void prune();                                   // drops completed parts (keeps failed ones)
  // The same completion without the errors: for "whoever used this range last is done" (a
  // failed move must not fail the next, unrelated owner of its memory).
  Fence quiet() const;
  bool empty() const { return parts_.empty(); }

 private:
  std::vector<std::shared_ptr<Waitable>> parts_;
};

}  // namespace strata::offload
