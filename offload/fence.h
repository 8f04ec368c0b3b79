// Fence: "this work has completed", across every kind of asynchronous work offload/ issues —
// stream events (device<->host copies), io/ requests (NVMe), and host-side signals. A fence is
// a cheap, copyable set of parts; it waits on the host or orders a stream behind itself.
#pragma once
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace strata::kernels {
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
  // Orders later work on s after this without the host; false if this kind cannot (then the
  // host must wait for it: see Fence::wait_host).
  virtual bool enqueue_wait(kernels::Stream&) { return false; }
  // True for work a stream can wait on by itself (a recorded stream event).
  virtual bool is_stream_event() const { return false; }
};

// Set once by whoever finishes the work (any thread), with the work's error or none.
class Signal final : public Waitable {
 public:
  void set(std::exception_ptr error = nullptr);
  void wait() override;
  bool ready() override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// A recorded stream event: stream waits on it without the host.
class EventPart final : public Waitable {
 public:
  explicit EventPart(std::unique_ptr<kernels::Event> e);
  ~EventPart() override;
  void wait() override;
  bool ready() override;
  bool enqueue_wait(kernels::Stream& s) override;
  bool is_stream_event() const override { return true; }
  kernels::Event& event() { return *event_; }

 private:
  std::unique_ptr<kernels::Event> event_;
};

class Fence {
 public:
  Fence() = default;  // empty: already complete
  explicit Fence(std::shared_ptr<Waitable> w) { add(std::move(w)); }
  void add(std::shared_ptr<Waitable> w);
  void add(const Fence& f);
  void wait() const;                              // host waits; rethrows the first error
  bool ready() const;                             // never blocks
  // The parts that are not stream events (I/O, host signals): complete? / wait for them on the
  // host, rethrowing the first error. After wait_host, enqueue_wait only orders by events.
  bool host_ready() const;
  void wait_host() const;
  // s waits for every part: events in stream order, other parts by a host function on s that
  // waits and swallows their errors (a host function must not throw on CUDA). Errors do not
  // travel through streams: work ordered this way carries its inputs' errors in its own fence
  // (see carry_errors).
  void enqueue_wait(kernels::Stream& s) const;
  // Adds f's parts that are not stream events (host signals, I/O): their errors are what a
  // fence of stream work ordered after f must rethrow.
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
