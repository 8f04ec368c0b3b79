// Backend selection: make_runtime picks the CPU or (when built) the CUDA runtime.
#include "kernels/runtime.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_ops.h"

namespace strata::kernels {

#ifdef STRATA_HAVE_CUDA
namespace cuda {
std::unique_ptr<Runtime> make_cuda_runtime(int device);
int device_count();
}  // namespace cuda
#endif

std::string_view backend_name(Backend b) { return b == Backend::cpu ? "cpu" : "cuda"; }

Backend parse_backend(std::string_view s) {
  if (s == "cpu") return Backend::cpu;
  if (s == "cuda") return Backend::cuda;
  throw std::invalid_argument("unknown backend '" + std::string(s) + "' (expected cpu or cuda)");
}

bool cuda_available() {
#ifdef STRATA_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

void* Stream::host_staging(size_t bytes) {
  if (bytes <= staging_bytes_) return staging_;
  synchronize();  // the old memory's users are done
  release_host_staging();
  // Grow to at least 1.5x, in whole MiB: a few growths at warm-up, then none.
  size_t want = std::max(bytes, staging_bytes_ + staging_bytes_ / 2);
  want = (want + (size_t{1} << 20) - 1) & ~((size_t{1} << 20) - 1);
  staging_rt_ = &runtime();
  staging_ = staging_rt_->alloc_pinned(want);
  staging_bytes_ = want;
  return staging_;
}

// Both backends implement the whole op set (the CUDA one is kernels/cuda/*.cu).
bool backend_trains(Backend b) { return b == Backend::cpu || b == Backend::cuda; }

std::unique_ptr<Runtime> make_runtime(Backend b, int device) {
  if (b == Backend::cpu) return cpu::make_cpu_runtime();
#ifdef STRATA_HAVE_CUDA
  int n = cuda::device_count();
  if (n == 0) throw std::runtime_error("--backend cuda: no CUDA device is visible (use --backend cpu)");
  if (device < 0 || device >= n)
    throw std::runtime_error("CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(n) +
                             " visible)");
  return cuda::make_cuda_runtime(device);
#else
  (void)device;
  throw std::runtime_error("--backend cuda: this strata was built without CUDA; use --backend cpu, or rebuild with -DSTRATA_CUDA=ON and the CUDA toolkit installed");
#endif
}

}  // namespace strata::kernels
