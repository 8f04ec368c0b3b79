// What strata's CPU kernels are measured against, side by side in one process: a bare oneDNN
// matmul primitive (no strata code between the caller and oneDNN) and the plain OpenMP AdamW
// loop a user would write, compiled for this machine (-O3 -march=native -fno-math-errno).
#pragma once
#include <cstdint>
#include <memory>

namespace strata::bench_ref {

// C (m, n) = A (m, k) · B (k, n), packed row-major; bf16 inputs when `bf16`, C always fp32.
// The primitive is created in the constructor; run() only executes it.
class OnednnMatmul {
 public:
  OnednnMatmul(int64_t m, int64_t n, int64_t k, bool bf16);
  ~OnednnMatmul();
  void run(const void* a, const void* b, float* c);
  const char* impl() const;  // oneDNN's implementation name, e.g. "brg:avx512_core_bf16"

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// torch.optim.AdamW, step `step`, over n fp32 params as one `#pragma omp parallel for` loop on
// `threads` OpenMP threads. grad_bf16: grad holds bf16 bits instead of fp32.
void adamw_plain_omp(int64_t n, float* param, const void* grad, bool grad_bf16, float* m, float* v, float lr,
                     float beta1, float beta2, float eps, float weight_decay, int64_t step, int threads);

}  // namespace strata::bench_ref
