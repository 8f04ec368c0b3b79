// The plain OpenMP AdamW loop, built with -O3 -march=native -fno-math-errno -fopenmp (see the
// CMake files that compile it). Deliberately free of standard-library templates: an inline
// function instantiated here with AVX-512 code could otherwise be picked by the linker for
// the whole binary.
#include <cstdint>

#include "bench/reference/reference.h"

namespace strata::bench_ref {

void adamw_plain_omp(int64_t n, float* param, const void* grad, bool grad_bf16, float* m, float* v, float lr,
                     float beta1, float beta2, float eps, float weight_decay, int64_t step, int threads) {
  float bc1 = 1.f, bc2 = 1.f;
  for (int64_t t = 0; t < step; ++t) bc1 *= beta1, bc2 *= beta2;
  bc1 = 1.f - bc1, bc2 = 1.f - bc2;
  const float step_size = lr / bc1, bc2_sqrt = __builtin_sqrtf(bc2), decay = 1.f - lr * weight_decay;
  const float* g32 = static_cast<const float*>(grad);
  const uint16_t* g16 = static_cast<const uint16_t*>(grad);
  if (grad_bf16) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) {
      union { uint32_t u; float f; } cvt;
      cvt.u = uint32_t(g16[i]) << 16;
      const float g = cvt.f;
      const float p = param[i] * decay;
      m[i] = beta1 * m[i] + (1.f - beta1) * g;
      v[i] = beta2 * v[i] + (1.f - beta2) * g * g;
      param[i] = p - step_size * m[i] / (__builtin_sqrtf(v[i]) / bc2_sqrt + eps);
    }
  } else {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) {
      const float g = g32[i];
      const float p = param[i] * decay;
      m[i] = beta1 * m[i] + (1.f - beta1) * g;
      v[i] = beta2 * v[i] + (1.f - beta2) * g * g;
      param[i] = p - step_size * m[i] / (__builtin_sqrtf(v[i]) / bc2_sqrt + eps);
    }
  }
}

}  // namespace strata::bench_ref
