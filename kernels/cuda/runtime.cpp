// The CUDA runtime: device memory from cudaMalloc, pinned host memory from cudaHostAlloc,
// streams and events as CUDA's own (created non-blocking, events without timing).
#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/runtime.h"

namespace strata::kernels::cuda {
namespace {

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    STRATA_CUDA_CHECK(cudaSetDevice(device_));
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { cudaEventDestroy(ev_); }
  void synchronize() override { STRATA_CUDA_CHECK(cudaEventSynchronize(ev_)); }
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
  void record(Event& e) override { STRATA_CUDA_CHECK(cudaEventRecord(static_cast<CudaEvent&>(e).get(), s_)); }
  void wait(Event& e) override { STRATA_CUDA_CHECK(cudaStreamWaitEvent(s_, static_cast<CudaEvent&>(e).get(), 0)); }
  void synchronize() override { STRATA_CUDA_CHECK(cudaStreamSynchronize(s_)); }
  void memcpy_async(void* dst, const void* src, size_t bytes) override {
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s_));
  }
  void memset_async(void* dst, int value, size_t bytes) override {
    STRATA_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, s_));
  }
  void host_fn(std::function<void()> fn) override {
    auto* heap = new std::function<void()>(std::move(fn));
    cudaError_t e = cudaLaunchHostFunc(
        s_,
        [](void* p) {
          std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(p));
          (*f)();
        },
        heap);
    if (e != cudaSuccess) {
      delete heap;
      throw_cuda(e, "cudaLaunchHostFunc", __FILE__, __LINE__);
    }
  }
  cudaStream_t get() const { return s_; }

 private:
  int device_;
  cudaStream_t s_ = nullptr;
};

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
  void* alloc_device(size_t bytes) override {
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess)
      throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(e));
    return p;
  }
  void free_device(void* p) override { if (p) STRATA_CUDA_CHECK(cudaFree(p)); }
  void* alloc_pinned(size_t bytes) override {
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess)
      throw std::runtime_error("cudaHostAlloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(e));
    return p;
  }
  void free_pinned(void* p) override { if (p) STRATA_CUDA_CHECK(cudaFreeHost(p)); }
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
