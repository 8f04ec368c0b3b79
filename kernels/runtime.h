// The device runtime that offload/ and src/ stand on (ggml-style split): a Runtime per device
// hands out raw device and pinned-host memory, Streams (in-order queues of async work) and
// Events (points in a stream's order). The CPU backend is a real backend: its stream is an
// in-order worker thread, so code written against streams behaves the same on CPU and CUDA.
// Public headers carry no CUDA types.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace strata::kernels {

class Ops;

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
};

// An in-order queue of asynchronous work. Work is ordered by events across streams, never by
// host synchronisation on the hot path. An exception thrown by asynchronous work is kept and
// rethrown by the next synchronize() (of the stream, or of an event recorded after it); work
// enqueued after a failure is skipped.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual void record(Event& e) = 0;      // e completes when all work enqueued so far has
  virtual void wait(Event& e) = 0;        // later work on this stream waits for e's last record
  virtual void synchronize() = 0;         // host waits for all enqueued work
  // Copies between any memory of this runtime (device, pinned host, pageable host).
  virtual void memcpy_async(void* dst, const void* src, size_t bytes) = 0;
  virtual void memset_async(void* dst, int value, size_t bytes) = 0;
  // Runs fn on a host thread in stream order (CPU: the worker; CUDA: cudaLaunchHostFunc).
  // fn must not enqueue work on this stream and wait for it.
  virtual void host_fn(std::function<void()> fn) = 0;
  // Milliseconds this stream has spent running work (not waiting for events or for work to
  // arrive), since it was created: how busy compute was. 0 where the backend does not keep it.
  virtual double busy_ms() const { return 0; }
};

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual const DeviceInfo& info() const = 0;
  // Raw allocations; alignment at least 4096 bytes (O_DIRECT- and device-friendly). Throw
  // std::runtime_error naming the size when the memory is not there. Frees never throw.
  virtual void* alloc_device(size_t bytes) = 0;
  virtual void free_device(void* p) = 0;
  virtual void* alloc_pinned(size_t bytes) = 0;  // page-locked host memory (CPU: mlock where permitted)
  virtual void free_pinned(void* p) = 0;
  virtual std::unique_ptr<Stream> create_stream() = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  virtual Ops& ops() = 0;  // the op set for this backend
};

// Creates the runtime for backend b, device index `device`. CUDA: throws when strata was built
// without CUDA or no device is present (message says which).
std::unique_ptr<Runtime> make_runtime(Backend b, int device = 0);
// True when strata was built with CUDA and at least one device is visible.
bool cuda_available();
// True when backend b implements the whole op set, so a model can train on it. The CUDA op set
// is still being written (kernels/cuda/ops_todo.cpp): the trainer refuses it up front.
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
