// Internal helpers for the CPU layer ops (elementwise, norms, embedding, RoPE, cross-entropy):
// element-type traits so each op is one template instantiated for fp32/bf16/fp16, a dtype
// dispatcher, a vectorisable exp, and a grow-only per-thread scratch buffer.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"
#include "kernels/dtype.h"

namespace strata::kernels::cpu {

// Storage type and fp32 conversions of one activation dtype (round-to-nearest-even stores).
template <DType D> struct Elem;
template <> struct Elem<DType::f32> {
  using T = float;
  __attribute__((always_inline)) static float load(float v) { return v; }
  __attribute__((always_inline)) static float store(float v) { return v; }
};
// fp32 -> bf16 without branches, bit-identical to dtype.h's f32_to_bf16 (round to nearest even,
// NaN quietened; checked in tests), so loops storing bf16 vectorise.
inline __attribute__((always_inline)) uint16_t f32_to_bf16_branchless(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const int32_t abs = static_cast<int32_t>(u & 0x7fffffffu);
  const uint32_t m_nan = ~static_cast<uint32_t>((abs - 0x7f800001) >> 31);  // all ones iff NaN
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((quiet & m_nan) | (rounded & ~m_nan));
}

template <> struct Elem<DType::bf16> {
  using T = uint16_t;
  __attribute__((always_inline)) static float load(uint16_t v) { return bf16_to_f32(v); }
  __attribute__((always_inline)) static uint16_t store(float v) { return f32_to_bf16_branchless(v); }
};

// fp16 <-> fp32 without branches, bit-identical to dtype.h's f16_to_f32 / f32_to_f16 (checked
// in tests over every fp16 value and the rounding boundaries), so loops over fp16 data
// vectorise; the dtype.h versions branch. Case selection uses arithmetic masks, not ternaries
// or compares, which GCC would turn back into control flow.
inline __attribute__((always_inline)) float f16_to_f32_branchless(uint16_t h) {
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent+mantissa, f32 place
  const uint32_t exp = em & 0x0f800000u;
  const uint32_t is_inf_nan = (exp + 0x00800000u) >> 28;          // 1 iff exponent field is 31
  const uint32_t normal = em + (112u << 23) + is_inf_nan * (112u << 23);  // rebias 15 -> 127 (31 -> 255)
  // Subnormal (and zero): m·2^-24 = 2^-14·(1 + m/1024) - 2^-14, exact in fp32.
  const float sub = std::bit_cast<float>(normal + (1u << 23)) - std::bit_cast<float>(113u << 23);
  const uint32_t m_sub = 0u - ((exp - 1u) >> 31);                 // all ones iff exp == 0
  const uint32_t bits = (std::bit_cast<uint32_t>(sub) & m_sub) | (normal & ~m_sub);
  return std::bit_cast<float>(bits | (static_cast<uint32_t>(h & 0x8000u) << 16));
}
inline __attribute__((always_inline)) uint16_t f32_to_f16_branchless(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int32_t abs = static_cast<int32_t>(u & 0x7fffffffu);
  const uint32_t ua = static_cast<uint32_t>(abs);
  const uint32_t nan = 0x7e00u | ((ua >> 13) & 0x3ffu);
  const uint32_t normal = (ua + 0xfffu + ((ua >> 13) & 1u) - 0x38000000u) >> 13;  // round to even
  // Below 2^-14: adding 0.5f puts the fp16 subnormal step (2^-24) at fp32's last mantissa bit,
  // so the hardware add rounds to nearest even exactly as fp16 would.
  const uint32_t sub = std::bit_cast<uint32_t>(std::bit_cast<float>(ua) + 0.5f) - 0x3f000000u;
  // (abs - K) >> 31 is all ones iff abs < K (no overflow: both in [0, 2^31)).
  const uint32_t m_sub = static_cast<uint32_t>((abs - 0x38800000) >> 31);
  const uint32_t m_big = ~static_cast<uint32_t>((abs - 0x477ff000) >> 31);   // overflows to Inf
  const uint32_t m_nan = ~static_cast<uint32_t>((abs - 0x7f800001) >> 31);
  const uint32_t bits = (nan & m_nan) | (0x7c00u & m_big & ~m_nan) | (sub & m_sub) | (normal & ~(m_sub | m_big));
  return static_cast<uint16_t>(bits | sign);
}

template <> struct Elem<DType::f16> {
  using T = uint16_t;
  __attribute__((always_inline)) static float load(uint16_t v) { return f16_to_f32_branchless(v); }
  __attribute__((always_inline)) static uint16_t store(float v) { return f32_to_f16_branchless(v); }
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

// Runs body(lo, hi) over [0, n) on the compute team with the body compiled twice: for the
// build's baseline ISA and for AVX-512 (chosen at run time by use_avx512()), so plain loops over
// fp32/bf16/fp16 with fast_exp and the branchless conversions become 16-lane zmm code. The body
// must be a lambda marked STRATA_SIMD_BODY so it is inlined into each wrapper and compiled there.
#define STRATA_SIMD_BODY __attribute__((always_inline))
template <class Body>
void simd_range_baseline(const Body& body, int64_t lo, int64_t hi) {
  body(lo, hi);
}
template <class Body>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void simd_range_avx512(const Body& body,
                                                                                         int64_t lo, int64_t hi) {
  body(lo, hi);
}
template <class Body>
void parallel_simd(int64_t n, int64_t grain, const Body& body) {
  const bool avx512 = use_avx512();
  parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    if (avx512) simd_range_avx512(body, lo, hi);
    else simd_range_baseline(body, lo, hi);
  });
}

// Rows per parallel task so a task touches at least ~min_elems elements.
inline int64_t row_grain(int64_t cols, int64_t min_elems = 16384) {
  const int64_t g = min_elems / (cols > 0 ? cols : 1);
  return g > 0 ? g : 1;
}

// e^x in fp32 (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial, 2^n
// applied as two factors so no exponent field overflows). Max relative error ~1e-7; returns 0
// below -87.3 (no denormals), +Inf above 88.72, NaN for NaN.
// Written so that loops calling it vectorise at the baseline ISA without -ffast-math: every
// float value is computed unconditionally and out-of-range inputs are handled by integer
// masks at the end. (Under the default -ftrapping-math GCC will not if-convert a select whose
// float arm it has sunk into a branch, e.g. `x < lo ? 0.f : y`, so avoid that shape here.)
inline __attribute__((always_inline)) float fast_exp(float x) {
  // n = round(x / ln 2) with the 1.5·2^23 trick (no rounding instruction needed).
  const float fn = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  float fn_c = fn < -127.f ? -127.f : fn;  // keeps the int conversion in range; results outside
  fn_c = fn_c > 128.f ? 128.f : fn_c;      // [-87.3, 88.72] are replaced below anyway
  const int32_t n = static_cast<int32_t>(fn_c);
  const int32_t n1 = n >> 1, n2 = n - n1;  // 2^n1, 2^n2 are normal floats
  const float y = e * std::bit_cast<float>((n1 + 127) << 23) * std::bit_cast<float>((n2 + 127) << 23);
  const int32_t keep_lo = x < -87.3f ? 0 : -1, keep_hi = x > 88.72f ? 0 : -1;
  const int32_t inf = x > 88.72f ? 0x7f800000 : 0;
  return std::bit_cast<float>((std::bit_cast<int32_t>(y) & keep_lo & keep_hi) | inf);
}

// A grow-only float buffer owned by the calling thread, so ops that need scratch allocate once,
// not once per call. Tag separates users: a thread waiting in one op's parallel_for may run
// another op's task, which must not resize the buffer the first op is still using.
template <class Tag>
float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace strata::kernels::cpu
