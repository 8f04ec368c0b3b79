// Checked CUDA calls: every failure becomes an exception naming the call, file and line.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace strata::kernels::cuda {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                           ") in " + call + " at " + file + ":" + std::to_string(line));
}

}  // namespace strata::kernels::cuda

#define STRATA_CUDA_CHECK(call)                                                            \
  do {                                                                                     \
    cudaError_t strata_err_ = (call);                                                      \
    if (strata_err_ != cudaSuccess) ::strata::kernels::cuda::throw_cuda(strata_err_, #call, __FILE__, __LINE__); \
  } while (0)
