// The device runtime that offload/ and src/ stand on (ggml-style split): a Runtime per device
// hands out raw device and pinned-host memory, Streams (in-order queues of async work) and
// Events (points in a stream's order). The CPU backend is a real backend: its stream is an
// in-order worker thread, so code written against streams behaves the same on CPU and CUDA.
// Public headers carry no CUDA types.
#pragma once
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

namespace strata::kernels {

class Ops;
class EventPoint;
class Runtime;

enum class Backend : uint8_t { cpu, cuda };
std::string_view backend_name(Backend b);
Backend parse_backend(std::string_view text);  // "cpu" | "cuda"; throws naming the text

struct DeviceInfo {
  Backend backend = Backend::cpu;
  int index = 0;
  std::string name;
  size_t total_bytes = 0;   // device memory (CPU: physical RAM)
  int n_threads = 1;        // CPU: compute threads; CUDA: SM count
  bool has_bf16_matmul = false;  // native bf16 GEMM (AVX512_BF16/AMX on CPU, tensor cores on CUDA)
};

// A point in a stream's order. record() on a stream moves it; synchronize() blocks the host
// until the work before the most recent record() has completed and rethrows that stream's
// first asynchronous error, if any.
class Event {
 public:
  virtual ~Event() = default;
  virtual void synchronize() = 0;
  virtual bool query() = 0;  // true when completed (or never recorded)
  virtual Backend backend() const = 0;  // of the runtime that created it
  virtual Runtime& runtime() const = 0;  // the runtime that created it
  // The most recent record as a handle of its own (later records do not move it); null when
  // never recorded. This is the plumbing behind Stream::wait on another runtime's event.
  virtual std::shared_ptr<EventPoint> point() = 0;
};

// One recorded point of an event (backend plumbing for cross-runtime ordering; user code calls
// Stream::wait and never needs this).
//  - A CPU stream waiting on any event enqueues a task that calls wait_host() on its worker:
//    the worker is a host thread, so blocking it is what "wait" means for a CPU stream.
//  - A CUDA stream waiting on a CPU event does not block a host thread or a CUDA host function:
//    it enqueues a wait on a host-mapped flag (cuStreamWaitValue32), and on_complete() has the
//    CPU worker write that flag when it reaches the recorded point (kernels/cuda/runtime.cpp).
// A producer's asynchronous error travels with the point: the waiting stream adopts it, so its
// own synchronize() rethrows it.
class EventPoint {
 public:
  virtual ~EventPoint() = default;
  // Blocks the calling host thread until the point has completed; returns the producing
  // stream's error at that point (null if none) rather than throwing.
  virtual std::exception_ptr wait_host() = 0;
  // Calls fn(error) once when the point completes: at once on this thread if it already has,
  // else on the thread that completes it. fn must be quick and must not block or enqueue work.
  // CPU points implement it; CUDA points throw std::logic_error (nothing needs it).
  virtual void on_complete(std::function<void(std::exception_ptr)> fn) = 0;
};

// An in-order queue of asynchronous work. Work is ordered by events across streams, never by
// host synchronisation on the hot path. An exception thrown by asynchronous work is kept and
// rethrown by the next synchronize() (of the stream, or of an event recorded after it); work
// enqueued after a failure is skipped (CUDA: host functions are skipped; device work already
// enqueued still runs).
class Stream {
 public:
  // (A backend's destructor ends its work first; then the staging memory goes. Inline: the
  // class keeps no key function, as the fuzz targets link no runtime.cpp.)
  virtual ~Stream() { release_host_staging(); }
  virtual Runtime& runtime() const = 0;  // the runtime that created it (its events may be recorded here)
  // e completes when all work enqueued so far has; e must come from this stream's runtime (the
  // same Runtime object, not only the same backend: std::invalid_argument otherwise).
  virtual void record(Event& e) = 0;
  // Later work on this stream waits for e's last record (taken now; a later record does not
  // move this wait). e may come from another runtime: a CPU stream can wait on a CUDA event
  // and a CUDA stream on a CPU event (see EventPoint for how; neither blocks a CUDA stream's
  // host functions), or a CUDA event of another device.
  virtual void wait(Event& e) = 0;
  // Host waits for all enqueued work, then rethrows (once) the first asynchronous error. On
  // CUDA this includes errors kernels find in the data, which the CPU backend throws at the
  // call: a token id or target outside the vocabulary (embedding, embedding_backward,
  // cross_entropy) is recorded by the kernel in the stream's device error record and thrown
  // here as std::out_of_range naming the op, the row and the id (an event recorded after the
  // bad op rethrows it too, without clearing it). The bad row is skipped; later work still runs.
  virtual void synchronize() = 0;
  // Copies between any memory of this runtime (device, pinned host, pageable host).
  virtual void memcpy_async(void* dst, const void* src, size_t bytes) = 0;
  virtual void memset_async(void* dst, int value, size_t bytes) = 0;
  // Runs fn on a host thread in stream order (CPU: the worker; CUDA: cudaLaunchHostFunc).
  // fn must not enqueue work on this stream and wait for it.
  virtual void host_fn(std::function<void()> fn) = 0;
  // Milliseconds this stream has spent running work (not waiting for events or for work to
  // arrive), since it was created: how busy compute was. 0 where the backend does not keep it.
  virtual double busy_ms() const { return 0; }
  // Page-locked host memory of at least `bytes`, owned by this stream, for copies between the
  // stream's memory and host code that the stream orders (the mpi communicator stages device
  // buffers here). Growing it first waits for the stream's work (synchronize, which rethrows a
  // pending error), so nothing enqueued earlier still uses the old memory. Valid until the next
  // call that grows it, or the stream's end (streams end before their runtime).
  void* host_staging(size_t bytes);

 private:
  inline void release_host_staging() noexcept;
  Runtime* staging_rt_ = nullptr;  // what allocated it (runtime() is not callable in ~Stream)
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual const DeviceInfo& info() const = 0;
  // Raw allocations; alignment at least 4096 bytes (O_DIRECT- and device-friendly). Throw
  // std::runtime_error naming the size when the memory is not there. Frees never throw. The
  // CPU runtime's come back zeroed and faulted in (from every core: first touch is slow).
  virtual void* alloc_device(size_t bytes) = 0;
  virtual void free_device(void* p) = 0;
  virtual void* alloc_pinned(size_t bytes) = 0;  // page-locked host memory (CPU: mlock where permitted)
  virtual void free_pinned(void* p) = 0;
  // Whether p is this runtime's device memory (host code cannot touch it): never on the CPU.
  virtual bool device_memory(const void* /*p*/) const { return false; }
  virtual std::unique_ptr<Stream> create_stream() = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  virtual Ops& ops() = 0;  // the op set for this backend
};

// Waits for everything queued on s and drops its error: for destructors, which must not free
// what a stream still reads or writes, and have nothing to report (the failure that brought
// them there already is being reported).
inline void settle(Stream& s) noexcept {
  try {
    s.synchronize();
  } catch (...) {  // the stream's error: already the caller's to report, or moot
  }
}

inline void Stream::release_host_staging() noexcept {
  if (staging_) staging_rt_->free_pinned(staging_);
  staging_ = nullptr;
  staging_bytes_ = 0;
}

// Creates the runtime for backend b, device index `device`. CUDA: throws when strata was built
// without CUDA or no device is present (message says which).
std::unique_ptr<Runtime> make_runtime(Backend b, int device = 0);
// True when strata was built with CUDA and at least one device is visible.
bool cuda_available();
// The CUDA devices visible (0 without CUDA or a driver).
int cuda_device_count();
// True when backend b implements the whole op set, so a model can train on it (both do).
bool backend_trains(Backend b);

// RAII holders for raw allocations of a runtime.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Runtime& rt, size_t bytes) : rt_(&rt), p_(rt.alloc_device(bytes)), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept { DeviceBuffer t(std::move(o)); swap(t); return *this; }
  ~DeviceBuffer() { if (p_) rt_->free_device(p_); }
  void* data() const { return p_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
 private:
  void swap(DeviceBuffer& o) noexcept { std::swap(rt_, o.rt_); std::swap(p_, o.p_); std::swap(bytes_, o.bytes_); }
  Runtime* rt_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(Runtime& rt, size_t bytes) : rt_(&rt), p_(rt.alloc_pinned(bytes)), bytes_(bytes) {}
  PinnedBuffer(PinnedBuffer&& o) noexcept { swap(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept { PinnedBuffer t(std::move(o)); swap(t); return *this; }
  ~PinnedBuffer() { if (p_) rt_->free_pinned(p_); }
  void* data() const { return p_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
 private:
  void swap(PinnedBuffer& o) noexcept { std::swap(rt_, o.rt_); std::swap(p_, o.p_); std::swap(bytes_, o.bytes_); }
  Runtime* rt_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace strata::kernels
