// Checked CUDA, cuBLAS(Lt) and driver-API calls: every failure becomes an exception naming the
// call, file and line. Kernel launches are checked with STRATA_CUDA_CHECK_LAUNCH() right after
// the launch (a bad configuration is reported there, not at some later call).
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace strata::kernels::cuda {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                           ") in " + call + " at " + file + ":" + std::to_string(line));
}

[[noreturn]] inline void throw_cublas(cublasStatus_t e, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("cuBLAS error ") + cublasGetStatusName(e) + " (" + cublasGetStatusString(e) +
                           ") in " + call + " at " + file + ":" + std::to_string(line));
}

// Driver-API results (CUresult) as plain ints: the driver is reached through entry points
// (cudaGetDriverEntryPointByVersion), so strata never links libcuda and loads without a driver.
[[noreturn]] inline void throw_driver(int e, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA driver error ") + std::to_string(e) + " in " + call + " at " + file +
                           ":" + std::to_string(line));
}

}  // namespace strata::kernels::cuda

#define STRATA_CUDA_CHECK(call)                                                            \
  do {                                                                                     \
    cudaError_t strata_err_ = (call);                                                      \
    if (strata_err_ != cudaSuccess) ::strata::kernels::cuda::throw_cuda(strata_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define STRATA_CUBLAS_CHECK(call)                                                          \
  do {                                                                                     \
    cublasStatus_t strata_st_ = (call);                                                    \
    if (strata_st_ != CUBLAS_STATUS_SUCCESS)                                               \
      ::strata::kernels::cuda::throw_cublas(strata_st_, #call, __FILE__, __LINE__);        \
  } while (0)

#define STRATA_CU_CHECK(call)                                                              \
  do {                                                                                     \
    int strata_cu_ = static_cast<int>(call);                                               \
    if (strata_cu_ != 0) ::strata::kernels::cuda::throw_driver(strata_cu_, #call, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: a launch failure (bad grid, too much shared memory) names the kernel.
#define STRATA_CUDA_CHECK_LAUNCH() STRATA_CUDA_CHECK(cudaGetLastError())
