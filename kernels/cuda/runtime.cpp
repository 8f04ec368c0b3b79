// The CUDA runtime: device memory from cudaMalloc, pinned host memory from cudaHostAlloc,
// non-blocking streams, events whose records come from a per-runtime pool of CUDA events, waits
// on other runtimes' events (a CPU event through a host-mapped flag and cuStreamWaitValue32),
// and per stream the scratch and device error record the ops use (cuda_ops.h).
#include <cuda.h>
#include <cuda_runtime.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/runtime.h"

namespace strata::kernels::cuda {
namespace {

void report_free_error(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "strata: warning: %s failed: %s\n", what, cudaGetErrorString(e));
}

// ---- driver entry points (no link against libcuda: strata loads on machines without a driver)

using WaitValueFn = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
struct StreamMemOps {
  WaitValueFn wait32 = nullptr;
  WaitValueFn write32 = nullptr;
};
const StreamMemOps& stream_mem_ops() {
  static const StreamMemOps ops = [] {
    StreamMemOps m;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      m.wait32 = reinterpret_cast<WaitValueFn>(fn);
    fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      m.write32 = reinterpret_cast<WaitValueFn>(fn);
    if (!m.wait32 || !m.write32) m = {};
    return m;
  }();
  return ops;
}
std::atomic<bool> g_memops_fallback_warned{false};

// ---- errors a stream keeps for synchronize ---------------------------------------------------

// Shared by a stream, its host functions, its events' records and the waits it enqueued: the
// first host-side error (a host function that threw, or an error adopted from a waited-on CPU
// event) with its sequence number, and the device error record kernels write (cuda_ops.h).
struct StreamErrors {
  std::mutex mu;
  std::exception_ptr error;
  uint64_t failed_at = UINT64_MAX;  // sequence number of the failed host function or wait
  uint64_t enqueued = 0;            // host functions and cross-runtime waits enqueued so far
  int* claim = nullptr;                    // device memory, 0 = free
  DeviceErrorRecord* record = nullptr;     // host-mapped: the host's pointer
  DeviceErrorRecord* record_dev = nullptr; // the same memory as the GPU addresses it

  explicit StreamErrors(int device) {
    STRATA_CUDA_CHECK(cudaSetDevice(device));
    STRATA_CUDA_CHECK(cudaMalloc(&claim, sizeof(int)));
    STRATA_CUDA_CHECK(cudaMemset(claim, 0, sizeof(int)));
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, sizeof(DeviceErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaFree(claim);
      throw_cuda(e, "cudaHostAlloc(device error record)", __FILE__, __LINE__);
    }
    record = static_cast<DeviceErrorRecord*>(p);
    std::memset(record, 0, sizeof(DeviceErrorRecord));
    void* d = nullptr;
    e = cudaHostGetDevicePointer(&d, p, 0);
    if (e != cudaSuccess) {
      cudaFree(claim);
      cudaFreeHost(p);
      throw_cuda(e, "cudaHostGetDevicePointer(device error record)", __FILE__, __LINE__);
    }
    record_dev = static_cast<DeviceErrorRecord*>(d);
  }
  ~StreamErrors() {
    report_free_error(cudaFree(claim), "cudaFree(device error claim)");
    report_free_error(cudaFreeHost(record), "cudaFreeHost(device error record)");
  }
  StreamErrors(const StreamErrors&) = delete;
  StreamErrors& operator=(const StreamErrors&) = delete;

  DeviceErrorSink sink() const {
    DeviceErrorSink s;
    s.claim = claim;
    s.record = record_dev;
    return s;
  }
  void fail(std::exception_ptr e, uint64_t seq) {
    std::lock_guard lock(mu);
    if (!error) error = std::move(e), failed_at = seq;
  }
  // The error a kernel recorded, as the exception the CPU backend would have thrown; null if none.
  std::exception_ptr device_error() const {
    const volatile DeviceErrorRecord* r = record;
    const int op = r->op;
    if (op == kNoDeviceError) return nullptr;
    const std::string row = std::to_string(r->row), value = std::to_string(r->value),
                      limit = std::to_string(r->limit);
    std::string msg;
    switch (op) {
      case kErrEmbedding: msg = "embedding: token " + row + " has id " + value + " outside [0, " + limit + ")"; break;
      case kErrEmbeddingBackward:
        msg = "embedding_backward: token " + row + " has id " + value + " outside [0, " + limit + ")";
        break;
      case kErrCrossEntropy:
      case kErrCrossEntropyStats:
      case kErrCrossEntropyFinish:
        msg = std::string(op == kErrCrossEntropy ? "cross_entropy" :
                          op == kErrCrossEntropyStats ? "cross_entropy_stats" : "cross_entropy_finish") +
              ": row " + row + " has target " + value + " outside [0, " + limit + ") (-1 = ignored)";
        break;
      default: msg = "unknown device error " + std::to_string(op); break;
    }
    return std::make_exception_ptr(std::out_of_range(msg + " (found on the GPU; the row was skipped)"));
  }
  // The error an event recorded after `n` host functions/waits reports (host error first).
  std::exception_ptr error_before(uint64_t n) {
    {
      std::lock_guard lock(mu);
      if (error && failed_at < n) return error;
    }
    return device_error();
  }
};

// ---- events -----------------------------------------------------------------------------------

// CUDA events without timing, reused: each record takes one and gives it back when no stream or
// waiter holds that record any more, so a step loop creates no events after the first step.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t e : free_) report_free_error(cudaEventDestroy(e), "cudaEventDestroy");
  }
  cudaEvent_t take() {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    STRATA_CUDA_CHECK(cudaSetDevice(device_));
    cudaEvent_t e = nullptr;
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void give(cudaEvent_t e) {
    std::lock_guard lock(mu_);
    free_.push_back(e);
  }

 private:
  int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

// One record of a CUDA event: the pooled CUDA event, and the stream errors it reports.
class CudaRecord final : public EventPoint {
 public:
  CudaRecord(std::shared_ptr<EventPool> pool, std::shared_ptr<StreamErrors> errors, uint64_t after)
      : pool_(std::move(pool)), errors_(std::move(errors)), after_(after), ev_(pool_->take()) {}
  ~CudaRecord() override { pool_->give(ev_); }
  cudaEvent_t get() const { return ev_; }
  std::exception_ptr wait_host() override {
    STRATA_CUDA_CHECK(cudaEventSynchronize(ev_));
    return errors_->error_before(after_);
  }
  void on_complete(std::function<void(std::exception_ptr)>) override {
    throw std::logic_error("EventPoint::on_complete is not implemented for CUDA events (a CPU stream waits on a "
                           "CUDA event with wait_host)");
  }
  bool query() const {
    cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    throw_cuda(e, "cudaEventQuery", __FILE__, __LINE__);
  }

 private:
  std::shared_ptr<EventPool> pool_;
  std::shared_ptr<StreamErrors> errors_;
  uint64_t after_;
  cudaEvent_t ev_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(std::shared_ptr<EventPool> pool, Runtime& rt) : pool_(std::move(pool)), rt_(rt) {}
  Runtime& runtime() const override { return rt_; }
  void synchronize() override {
    auto r = current();
    if (!r) return;
    if (std::exception_ptr e = r->wait_host()) std::rethrow_exception(e);
  }
  bool query() override {
    auto r = current();
    return !r || r->query();
  }
  Backend backend() const override { return Backend::cuda; }
  std::shared_ptr<EventPoint> point() override { return current(); }
  std::shared_ptr<CudaRecord> current() {
    std::lock_guard lock(mu_);
    return rec_;
  }
  void set(std::shared_ptr<CudaRecord> r) {
    std::lock_guard lock(mu_);
    rec_ = std::move(r);
  }
  const std::shared_ptr<EventPool>& pool() const { return pool_; }

 private:
  std::shared_ptr<EventPool> pool_;
  Runtime& rt_;
  std::mutex mu_;
  std::shared_ptr<CudaRecord> rec_;
};

// ---- a CUDA stream waiting on a CPU event -------------------------------------------------------

// A host-mapped page of flags. Wait number i (from 1) uses slot i % kSlots: the CPU worker that
// completes the point stores i there (on_complete), the GPU waits until the slot reaches i
// (cuStreamWaitValue32, cyclic >=), then writes i to `passed` (cuStreamWriteValue32). A slot is
// reused by wait i + kSlots only once `passed` shows the GPU is past wait i, so a late store for
// one wait can never release another. Nothing blocks a host thread or a CUDA host function.
class HostWaits {
 public:
  static constexpr uint32_t kSlots = 256;
  struct Page {
    uint32_t slot[kSlots];
    uint32_t passed;
  };
  HostWaits() {
    void* p = nullptr;
    STRATA_CUDA_CHECK(cudaHostAlloc(&p, sizeof(Page), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(p, 0, sizeof(Page));
    page_ = std::shared_ptr<Page>(static_cast<Page*>(p),
                                  [](Page* q) { report_free_error(cudaFreeHost(q), "cudaFreeHost(wait flags)"); });
    void* d = nullptr;
    STRATA_CUDA_CHECK(cudaHostGetDevicePointer(&d, p, 0));
    page_dev_ = static_cast<Page*>(d);
  }

  // Enqueues on s a wait for point p (errors: where an error the point carries goes; seq: its
  // sequence number there). Returns false when this device cannot run stream memory operations
  // (nothing was enqueued).
  bool wait(cudaStream_t s, const std::shared_ptr<EventPoint>& p, const std::shared_ptr<StreamErrors>& errors,
            uint64_t seq) {
    const StreamMemOps& mo = stream_mem_ops();
    if (!mo.wait32) return false;
    const uint32_t i = ++issued_;
    if (i > kSlots) {  // the slot's previous wait (i - kSlots) must be behind the GPU
      while (static_cast<int32_t>(__atomic_load_n(&page_->passed, __ATOMIC_ACQUIRE) - (i - kSlots)) < 0)
        std::this_thread::yield();
    }
    uint32_t* flag = &page_->slot[i % kSlots];
    CUresult r = mo.wait32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(&page_dev_->slot[i % kSlots]),
                           i, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_ERROR_NOT_SUPPORTED) {
      --issued_;
      return false;
    }
    STRATA_CU_CHECK(r);
    STRATA_CU_CHECK(mo.write32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(&page_dev_->passed), i, 0));
    // Registered after the wait is enqueued: if the point already completed, the store happens
    // now and the GPU passes at once.
    p->on_complete([page = page_, flag, i, errors, seq](std::exception_ptr err) {
      if (err) errors->fail(err, seq);
      __atomic_store_n(flag, i, __ATOMIC_RELEASE);
    });
    return true;
  }

 private:
  std::shared_ptr<Page> page_;  // the host's view
  Page* page_dev_ = nullptr;    // the same page as the GPU addresses it
  uint32_t issued_ = 0;
};

// ---- streams ----------------------------------------------------------------------------------

class CudaStream final : public Stream, public StreamContext {
 public:
  CudaStream(int device, Runtime& rt) : rt_(rt), errors_state_(std::make_shared<StreamErrors>(device)) {
    device_ = device;
    STRATA_CUDA_CHECK(cudaSetDevice(device_));
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    errors_ = errors_state_->sink();
  }
  ~CudaStream() override {
    cudaSetDevice(device_);
    if (scratch_) report_free_error(cudaFreeAsync(scratch_, stream_), "cudaFreeAsync(scratch)");
    report_free_error(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    report_free_error(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }
  Runtime& runtime() const override { return rt_; }
  void record(Event& e) override {
    if (&e.runtime() != &rt_)
      throw std::invalid_argument("Stream::record: the event belongs to another runtime (create it from this one)");
    auto& ev = static_cast<CudaEvent&>(e);
    auto rec = std::make_shared<CudaRecord>(ev.pool(), errors_state_, errors_state_->enqueued);
    STRATA_CUDA_CHECK(cudaEventRecord(rec->get(), stream_));
    ev.set(std::move(rec));
  }
  void wait(Event& e) override {
    if (e.backend() == Backend::cuda) {  // this or another CUDA runtime (device)
      auto rec = static_cast<CudaEvent&>(e).current();
      if (rec) STRATA_CUDA_CHECK(cudaStreamWaitEvent(stream_, rec->get(), 0));
      return;
    }
    std::shared_ptr<EventPoint> p = e.point();
    if (!p) return;
    const uint64_t seq = errors_state_->enqueued++;
    if (!host_waits_) host_waits_ = std::make_unique<HostWaits>();
    if (host_waits_->wait(stream_, p, errors_state_, seq)) return;
    // Fallback where stream memory operations are unavailable: a host function that blocks the
    // CUDA callback thread until the point completes (correct, but it stalls this device's other
    // host functions meanwhile).
    if (!g_memops_fallback_warned.exchange(true))
      std::fprintf(stderr, "strata: warning: cuStreamWaitValue32 is not available; CUDA streams wait on CPU events "
                           "in a blocking host function\n");
    struct Call {
      std::shared_ptr<EventPoint> point;
      std::shared_ptr<StreamErrors> errors;
      uint64_t seq;
    };
    auto* call = new Call{std::move(p), errors_state_, seq};
    cudaError_t r = cudaLaunchHostFunc(
        stream_,
        [](void* q) {
          std::unique_ptr<Call> c(static_cast<Call*>(q));
          std::exception_ptr err;
          try {
            err = c->point->wait_host();
          } catch (...) {
            err = std::current_exception();
          }
          if (err) c->errors->fail(err, c->seq);
        },
        call);
    if (r != cudaSuccess) {
      delete call;
      throw_cuda(r, "cudaLaunchHostFunc", __FILE__, __LINE__);
    }
  }
  // Rethrows (once) the first error: a host function's or a waited-on producer's, else one a
  // kernel recorded in the device error record (which is then cleared).
  void synchronize() override {
    STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    {
      std::lock_guard lock(errors_state_->mu);
      if (errors_state_->error) {
        std::exception_ptr e = std::exchange(errors_state_->error, nullptr);
        errors_state_->failed_at = UINT64_MAX;
        std::rethrow_exception(e);
      }
    }
    if (std::exception_ptr e = errors_state_->device_error()) {
      volatile DeviceErrorRecord* r = errors_state_->record;
      r->op = kNoDeviceError;
      STRATA_CUDA_CHECK(cudaMemsetAsync(errors_state_->claim, 0, sizeof(int), stream_));
      std::rethrow_exception(e);
    }
  }
  void memcpy_async(void* dst, const void* src, size_t bytes) override {
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  }
  void memset_async(void* dst, int value, size_t bytes) override {
    STRATA_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_));
  }
  // An exception must not leave the CUDA callback (that would terminate the process): it is
  // kept for synchronize(), and the stream's later host functions are skipped until then.
  // (Device work already enqueued still runs; the error does not cross CUDA event waits.)
  void host_fn(std::function<void()> fn) override {
    struct Call {
      std::function<void()> fn;
      std::shared_ptr<StreamErrors> errors;
      uint64_t seq;
    };
    auto* call = new Call{std::move(fn), errors_state_, errors_state_->enqueued++};
    cudaError_t e = cudaLaunchHostFunc(
        stream_,
        [](void* p) {
          std::unique_ptr<Call> c(static_cast<Call*>(p));
          {
            std::lock_guard lock(c->errors->mu);
            if (c->errors->error) return;
          }
          try {
            c->fn();
          } catch (...) {
            c->errors->fail(std::current_exception(), c->seq);
          }
        },
        call);
    if (e != cudaSuccess) {
      delete call;
      throw_cuda(e, "cudaLaunchHostFunc", __FILE__, __LINE__);
    }
  }
  void* scratch(size_t bytes) override {
    if (bytes <= scratch_bytes_) return scratch_;
    // Grow to at least 1.5x (a few growths at warm-up, then none), in whole MiB.
    size_t want = std::max(bytes, scratch_bytes_ + scratch_bytes_ / 2);
    want = (want + (size_t{1} << 20) - 1) & ~((size_t{1} << 20) - 1);
    if (scratch_) STRATA_CUDA_CHECK(cudaFreeAsync(scratch_, stream_));
    scratch_ = nullptr, scratch_bytes_ = 0;
    cudaError_t e = cudaMallocAsync(&scratch_, want, stream_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not left for the next launch's check
      throw std::runtime_error("cudaMallocAsync of " + std::to_string(want) + " bytes of op scratch failed: " +
                               cudaGetErrorString(e));
    }
    scratch_bytes_ = want;
    return scratch_;
  }

 private:
  Runtime& rt_;
  std::shared_ptr<StreamErrors> errors_state_;
  std::unique_ptr<HostWaits> host_waits_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

class CudaRuntime final : public Runtime {
 public:
  explicit CudaRuntime(int device) : pool_(std::make_shared<EventPool>(device)), ops_(device) {
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
    if (e != cudaSuccess) {
      // A failed allocation also sets the thread's last error, which the next kernel launch's
      // check (cudaGetLastError) would report as that kernel's: clear it, it is thrown here.
      (void)cudaGetLastError();
      throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(e));
    }
    return p;
  }
  // Frees run from buffer destructors: a failure is reported, never thrown (that would terminate).
  void free_device(void* p) override {
    if (p) report_free_error(cudaFree(p), "cudaFree");
  }
  void* alloc_pinned(size_t bytes) override {
    STRATA_CUDA_CHECK(cudaSetDevice(info_.index));
    if (bytes >= kRegisterFrom)
      if (void* p = alloc_registered(bytes)) return p;
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not left for the next launch's check (see alloc_device)
      throw std::runtime_error("cudaHostAlloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(e));
    }
    return p;
  }
  void free_pinned(void* p) override {
    if (!p) return;
    size_t registered = 0;
    {
      std::lock_guard lock(registered_mu_);
      if (auto it = registered_.find(p); it != registered_.end()) registered = it->second, registered_.erase(it);
    }
    if (!registered) return report_free_error(cudaFreeHost(p), "cudaFreeHost");
    report_free_error(cudaHostUnregister(p), "cudaHostUnregister");
    if (munmap(p, registered) != 0) std::fprintf(stderr, "strata: munmap of pinned memory failed: %s\n", std::strerror(errno));
  }
  bool device_memory(const void* p) const override {
    cudaPointerAttributes a{};
    if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // (pageable memory on old drivers: an error, and host memory)
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }
  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CudaStream>(info_.index, *this); }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(pool_, *this); }
  Ops& ops() override { return ops_; }

 private:
  // Large pinned buffers: cudaHostAlloc faults and zeroes every page on one thread (18 GiB took
  // 11 s on the H200's host, most of a run's start-up). Instead the pages are faulted in by all
  // cores at once, then page-locked with cudaHostRegister; where that fails, cudaHostAlloc.
  static constexpr size_t kRegisterFrom = size_t{256} << 20;
  void* alloc_registered(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    const size_t n = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16);
    const size_t slice = (bytes / n + 4095) / 4096 * 4096;
    std::vector<std::thread> touch;
    try {
      for (size_t i = 0; i < n && i * slice < bytes; ++i)
        touch.emplace_back([p, i, slice, bytes] {
          std::memset(static_cast<char*>(p) + i * slice, 0, std::min(slice, bytes - i * slice));
        });
    } catch (const std::system_error&) {  // no thread to be had: cudaHostAlloc instead
      for (auto& t : touch) t.join();
      munmap(p, bytes);
      return nullptr;
    }
    for (auto& t : touch) t.join();
    if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) != cudaSuccess) {
      (void)cudaGetLastError();  // not left for the next launch's check; cudaHostAlloc instead
      munmap(p, bytes);
      return nullptr;
    }
    std::lock_guard lock(registered_mu_);
    registered_.emplace(p, bytes);
    return p;
  }

  DeviceInfo info_;
  std::shared_ptr<EventPool> pool_;
  CudaOps ops_;
  std::mutex registered_mu_;
  std::map<void*, size_t> registered_;  // pinned buffers from alloc_registered, and their sizes
};

}  // namespace

StreamContext& context(Stream& s) {
  auto* cs = dynamic_cast<CudaStream*>(&s);
  if (!cs) throw std::invalid_argument("CUDA op: the stream belongs to another runtime (use a stream of the CUDA runtime)");
  STRATA_CUDA_CHECK(cudaSetDevice(cs->device()));
  return *cs;
}

cudaStream_t native(Stream& s) { return context(s).stream(); }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;  // no driver or no device: not an error here
  return n;
}

std::unique_ptr<Runtime> make_cuda_runtime(int device) { return std::make_unique<CudaRuntime>(device); }

}  // namespace strata::kernels::cuda
