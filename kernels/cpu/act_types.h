// Internal helpers for the CPU layer ops (elementwise, norms, embedding, RoPE, cross-entropy):
// element-type traits so each op is one template instantiated for fp32/bf16/fp16, a dtype
// dispatcher, a vectorisable exp, and a grow-only per-thread scratch buffer.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/dtype.h"

namespace strata::kernels::cpu {

// Storage type and fp32 conversions of one activation dtype (round-to-nearest-even stores).
template <DType D> struct Elem;
template <> struct Elem<DType::f32> {
  using T = float;
  __attribute__((always_inline)) static float load(float v) { return v; }
  __attribute__((always_inline)) static float store(float v) { return v; }
};
template <> struct Elem<DType::bf16> {
  using T = uint16_t;
  __attribute__((always_inline)) static float load(uint16_t v) { return bf16_to_f32(v); }
  __attribute__((always_inline)) static uint16_t store(float v) { return f32_to_bf16(v); }
};
template <> struct Elem<DType::f16> {
  using T = uint16_t;
  __attribute__((always_inline)) static float load(uint16_t v) { return f16_to_f32(v); }
  __attribute__((always_inline)) static uint16_t store(float v) { return f32_to_f16(v); }
};

// Calls f(Elem<D>{}) for the runtime dtype t; f is a generic lambda.
template <class F>
decltype(auto) dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::bf16: return f(Elem<DType::bf16>{});
    case DType::f16: return f(Elem<DType::f16>{});
    case DType::f32: break;
  }
  return f(Elem<DType::f32>{});
}

// Rows per parallel task so a task touches at least ~min_elems elements.
inline int64_t row_grain(int64_t cols, int64_t min_elems = 16384) {
  const int64_t g = min_elems / (cols > 0 ? cols : 1);
  return g > 0 ? g : 1;
}

// e^x in fp32, branch-free so loops over it vectorise (Cephes expf: range reduction by ln 2 in
// two parts, degree-5 polynomial, 2^n applied as two factors so no exponent overflows). Max
// relative error ~2e-7; returns 0 below -87.3 (no denormals) and +Inf above ~88.72.
inline __attribute__((always_inline)) float fast_exp(float x) {
  const float xc = x < -87.5f ? -87.5f : (x > 89.f ? 89.f : x);
  // n = round(x / ln 2) with the 1.5·2^23 trick (no rounding instruction needed).
  const float fn = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (xc - fn * 0.693359375f) + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  const int32_t n = static_cast<int32_t>(fn);
  const int32_t n1 = n >> 1, n2 = n - n1;  // each in [-64, 65): 2^n1, 2^n2 are normal floats
  const float y = e * std::bit_cast<float>((n1 + 127) << 23) * std::bit_cast<float>((n2 + 127) << 23);
  return x < -87.3f ? 0.f : y;
}

// A grow-only float buffer owned by the calling thread (an op's stream worker), so ops that need
// partial sums allocate once, not once per call.
inline float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace strata::kernels::cpu
