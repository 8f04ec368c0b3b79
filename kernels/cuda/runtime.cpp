// The CUDA runtime: device memory from cudaMalloc, pinned host memory from cudaHostAlloc,
// streams and events as CUDA's own (created non-blocking, events without timing).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/runtime.h"

namespace strata::kernels::cuda {
namespace {

// What a stream's host functions report back: the first exception one threw (kept until the
// stream's synchronize rethrows it) and the sequence number of the host function that threw.
// Shared with the callbacks and with events recorded on the stream.
struct HostFnErrors {
  std::mutex mu;
  std::exception_ptr error;
  uint64_t failed_at = UINT64_MAX;  // sequence number of the failed host function
  uint64_t enqueued = 0;            // host functions enqueued so far (guarded by the stream's owner)
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    STRATA_CUDA_CHECK(cudaSetDevice(device_));
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { cudaEventDestroy(ev_); }
  void synchronize() override {
    STRATA_CUDA_CHECK(cudaEventSynchronize(ev_));
    if (!errors_) return;
    std::lock_guard lock(errors_->mu);  // a host function before this record failed: rethrow
    if (errors_->error && errors_->failed_at < recorded_after_) std::rethrow_exception(errors_->error);
  }
  // Called by CudaStream::record: the event now follows `n` host functions of that stream.
  void recorded(std::shared_ptr<HostFnErrors> errors, uint64_t n) {
    errors_ = std::move(errors);
    recorded_after_ = n;
  }
  bool query() override {
    cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    throw_cuda(e, "cudaEventQuery", __FILE__, __LINE__);
  }
  cudaEvent_t get() const { return ev_; }

 private:
  int device_;
  cudaEvent_t ev_ = nullptr;
  std::shared_ptr<HostFnErrors> errors_;
  uint64_t recorded_after_ = 0;
};

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int device) : device_(device) {
    STRATA_CUDA_CHECK(cudaSetDevice(device_));
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
  }
  ~CudaStream() override {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
  }
  void record(Event& e) override {
    auto& ev = static_cast<CudaEvent&>(e);
    STRATA_CUDA_CHECK(cudaEventRecord(ev.get(), s_));
    ev.recorded(errors_, errors_->enqueued);
  }
  void wait(Event& e) override { STRATA_CUDA_CHECK(cudaStreamWaitEvent(s_, static_cast<CudaEvent&>(e).get(), 0)); }
  // Rethrows (once) the first exception a host function threw, as the CPU stream does.
  void synchronize() override {
    STRATA_CUDA_CHECK(cudaStreamSynchronize(s_));
    std::lock_guard lock(errors_->mu);
    if (!errors_->error) return;
    std::exception_ptr e = std::exchange(errors_->error, nullptr);
    errors_->failed_at = UINT64_MAX;
    std::rethrow_exception(e);
  }
  void memcpy_async(void* dst, const void* src, size_t bytes) override {
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s_));
  }
  void memset_async(void* dst, int value, size_t bytes) override {
    STRATA_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, s_));
  }
  // An exception must not leave the CUDA callback (that would terminate the process): it is
  // kept for synchronize(), and the stream's later host functions are skipped until then.
  // (Device work already enqueued still runs; the error does not cross event waits.)
  void host_fn(std::function<void()> fn) override {
    struct Call {
      std::function<void()> fn;
      std::shared_ptr<HostFnErrors> errors;
      uint64_t seq;
    };
    auto* call = new Call{std::move(fn), errors_, errors_->enqueued++};
    cudaError_t e = cudaLaunchHostFunc(
        s_,
        [](void* p) {
          std::unique_ptr<Call> c(static_cast<Call*>(p));
          {
            std::lock_guard lock(c->errors->mu);
            if (c->errors->error) return;
          }
          try {
            c->fn();
          } catch (...) {
            std::lock_guard lock(c->errors->mu);
            if (!c->errors->error) c->errors->error = std::current_exception(), c->errors->failed_at = c->seq;
          }
        },
        call);
    if (e != cudaSuccess) {
      delete call;
      throw_cuda(e, "cudaLaunchHostFunc", __FILE__, __LINE__);
    }
  }
  cudaStream_t get() const { return s_; }

 private:
  int device_;
  cudaStream_t s_ = nullptr;
  std::shared_ptr<HostFnErrors> errors_ = std::make_shared<HostFnErrors>();
};

void report_free_error(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "strata: warning: %s failed: %s\n", what, cudaGetErrorString(e));
}

class CudaRuntime final : public Runtime {
 public:
  explicit CudaRuntime(int device) {
    STRATA_CUDA_CHECK(cudaSetDevice(device));
    cudaDeviceProp prop{};
    STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    info_.backend = Backend::cuda;
    info_.index = device;
    info_.name = prop.name;
    info_.total_bytes = prop.totalGlobalMem;
    info_.n_threads = prop.multiProcessorCount;
    info_.has_bf16_matmul = prop.major >= 8;
  }
  const DeviceInfo& info() const override { return info_; }
  // The current device is per host thread: every entry point selects the runtime's own.
  void* alloc_device(size_t bytes) override {
    STRATA_CUDA_CHECK(cudaSetDevice(info_.index));
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess)
      throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(e));
    return p;
  }
  // Frees run from buffer destructors: a failure is reported, never thrown (that would terminate).
  void free_device(void* p) override {
    if (p) report_free_error(cudaFree(p), "cudaFree");
  }
  void* alloc_pinned(size_t bytes) override {
    STRATA_CUDA_CHECK(cudaSetDevice(info_.index));
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess)
      throw std::runtime_error("cudaHostAlloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(e));
    return p;
  }
  void free_pinned(void* p) override {
    if (p) report_free_error(cudaFreeHost(p), "cudaFreeHost");
  }
  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CudaStream>(info_.index); }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(info_.index); }
  Ops& ops() override { return ops_; }

 private:
  DeviceInfo info_;
  CudaOps ops_;
};

}  // namespace

cudaStream_t native(Stream& s) { return static_cast<CudaStream&>(s).get(); }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;  // no driver or no device: not an error here
  return n;
}

std::unique_ptr<Runtime> make_cuda_runtime(int device) { return std::make_unique<CudaRuntime>(device); }

}  // namespace strata::kernels::cuda
