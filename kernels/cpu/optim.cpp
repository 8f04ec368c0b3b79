// The CPU backend's memory-bound ops: fused AdamW (the CPU optimizer step of ZeRO-Offload),
// sum of squares (global grad norm), scale and dtype casts. Each has a portable path and an
// AVX-512 path chosen at run time (the build has no -march), and streams its data once,
// split across the compute arena in contiguous chunks.
// GCC 12 reports its own AVX-512 intrinsics (_mm512_undefined_*) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"

#define STRATA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

namespace strata::kernels::cpu {
namespace {

bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}
std::atomic<bool> g_avx512_enabled{true};

constexpr int64_t kGrain = int64_t{1} << 15;  // elements; a chunk is at least 128 KiB of fp32

// parallel_for over [0, n) in chunks whose boundaries are multiples of 16 elements (one
// 64-byte line of fp32), so vector loops only meet a tail at the very end.
template <class F>
void for_chunks(int64_t n, F&& f) {
  const int64_t lines = (n + 15) / 16;
  parallel_for(0, lines, kGrain / 16, [&](int64_t lo, int64_t hi) { f(lo * 16, std::min(hi * 16, n)); });
}

// ---- AdamW --------------------------------------------------------------------------------

// Per-step constants, computed once in double and rounded to fp32.
struct AdamConsts {
  float decay;         // 1 - lr·wd
  float b1, one_m_b1;  // beta1, 1 - beta1
  float b2, one_m_b2;
  float step_size;     // lr / (1 - beta1^step)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^step)
  float eps, grad_scale;
};
AdamConsts adam_consts(const AdamWArgs& a) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), static_cast<double>(a.step));
  AdamConsts c;
  c.decay = static_cast<float>(1.0 - static_cast<double>(a.lr) * a.weight_decay);
  c.b1 = a.beta1, c.one_m_b1 = static_cast<float>(1.0 - a.beta1);
  c.b2 = a.beta2, c.one_m_b2 = static_cast<float>(1.0 - a.beta2);
  c.step_size = static_cast<float>(a.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = a.eps, c.grad_scale = a.grad_scale;
  return c;
}

void adamw_portable(const AdamWArgs& a, const AdamConsts& c, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    // The AVX-512 kernel's operations (adamw16) and the CUDA kernel's, rounding for rounding.
    const float g = load_as_f32(a.grad, a.grad_dtype, i) * c.grad_scale;
    float p = a.param_in[i] * c.decay;
    const float m = std::fma(a.m_in[i], c.b1, g * c.one_m_b1);
    const float v = std::fma(a.v_in[i], c.b2, (g * g) * c.one_m_b2);
    const float denom = std::fma(std::sqrt(v), c.inv_sqrt_bc2, c.eps);
    p = std::fma(-c.step_size, m / denom, p);
    a.param[i] = p, a.m[i] = m, a.v[i] = v;
    if (a.param_copy) store_from_f32(a.param_copy, a.copy_dtype, i, p);
  }
}

// fp32 -> bf16 bits, round to nearest even, NaN kept quiet: bit-identical to f32_to_bf16
// (vcvtneps2bf16 would flush subnormals, so the rounding is done on the integer bits).
STRATA_AVX512 inline __m256i cvt_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}
STRATA_AVX512 inline __m512 load_bf16(const uint16_t* p, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
STRATA_AVX512 inline __m512 load_f16(const uint16_t* p, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}
STRATA_AVX512 inline __m512 load_any(const void* p, DType t, int64_t i, __mmask16 k) {
  switch (t) {
    case DType::f32: return _mm512_maskz_loadu_ps(k, static_cast<const float*>(p) + i);
    case DType::bf16: return load_bf16(static_cast<const uint16_t*>(p) + i, k);
    case DType::f16: return load_f16(static_cast<const uint16_t*>(p) + i, k);
  }
  return _mm512_setzero_ps();
}
STRATA_AVX512 inline void store_any(void* p, DType t, int64_t i, __m512 x, __mmask16 k) {
  switch (t) {
    case DType::f32: _mm512_mask_storeu_ps(static_cast<float*>(p) + i, k, x); break;
    case DType::bf16: _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, k, cvt_bf16(x)); break;
    case DType::f16:
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, k, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
      break;
  }
}
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

// One AdamW update of 16 lanes (k masks the tail). GD/CD: grad and copy dtypes, fixed at
// compile time so the hot loop has no branches.
template <DType GD, DType CD, bool Copy>
STRATA_AVX512 inline void adamw16(const AdamWArgs& a, const AdamConsts& c, int64_t i, __mmask16 k) {
  const __m512 g = _mm512_mul_ps(load_any(a.grad, GD, i, k), _mm512_set1_ps(c.grad_scale));
  __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, a.param_in + i), _mm512_set1_ps(c.decay));
  __m512 m = _mm512_maskz_loadu_ps(k, a.m_in + i);
  __m512 v = _mm512_maskz_loadu_ps(k, a.v_in + i);
  m = _mm512_fmadd_ps(m, _mm512_set1_ps(c.b1), _mm512_mul_ps(g, _mm512_set1_ps(c.one_m_b1)));
  v = _mm512_fmadd_ps(v, _mm512_set1_ps(c.b2), _mm512_mul_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(c.one_m_b2)));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.inv_sqrt_bc2), _mm512_set1_ps(c.eps));
  p = _mm512_fnmadd_ps(_mm512_set1_ps(c.step_size), _mm512_div_ps(m, denom), p);
  _mm512_mask_storeu_ps(a.param + i, k, p);
  _mm512_mask_storeu_ps(a.m + i, k, m);
  _mm512_mask_storeu_ps(a.v + i, k, v);
  if constexpr (Copy) store_any(a.param_copy, CD, i, p, k);
}

template <DType GD, DType CD, bool Copy>
STRATA_AVX512 void adamw_avx512_t(const AdamWArgs& a, const AdamConsts& c, int64_t lo, int64_t hi) {
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) adamw16<GD, CD, Copy>(a, c, i, 0xffff);
  if (i < hi) adamw16<GD, CD, Copy>(a, c, i, tail_mask(hi - i));
}

template <DType GD>
void adamw_avx512_g(const AdamWArgs& a, const AdamConsts& c, int64_t lo, int64_t hi) {
  if (!a.param_copy) return adamw_avx512_t<GD, DType::f32, false>(a, c, lo, hi);
  switch (a.copy_dtype) {
    case DType::f32: return adamw_avx512_t<GD, DType::f32, true>(a, c, lo, hi);
    case DType::bf16: return adamw_avx512_t<GD, DType::bf16, true>(a, c, lo, hi);
    case DType::f16: return adamw_avx512_t<GD, DType::f16, true>(a, c, lo, hi);
  }
}
void adamw_avx512(const AdamWArgs& a, const AdamConsts& c, int64_t lo, int64_t hi) {
  switch (a.grad_dtype) {
    case DType::f32: return adamw_avx512_g<DType::f32>(a, c, lo, hi);
    case DType::bf16: return adamw_avx512_g<DType::bf16>(a, c, lo, hi);
    case DType::f16: return adamw_avx512_g<DType::f16>(a, c, lo, hi);
  }
}

// ---- sum of squares -----------------------------------------------------------------------

// Squares of fp32 values are exact in fp64, so summing them in fp64 blocks loses only
// fp64 rounding. Fixed blocks (independent of the thread count) are summed in order, so the
// result is the same for any number of threads.
constexpr int64_t kMaxBlocks = 1024;

double sumsq_portable(const void* x, DType t, int64_t lo, int64_t hi) {
  double acc[4] = {0, 0, 0, 0};
  int64_t i = lo;
  for (; i + 4 <= hi; i += 4)
    for (int j = 0; j < 4; ++j) {
      const double v = load_as_f32(x, t, i + j);
      acc[j] += v * v;
    }
  for (; i < hi; ++i) {
    const double v = load_as_f32(x, t, i);
    acc[0] += v * v;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

STRATA_AVX512 double sumsq_avx512(const void* x, DType t, int64_t lo, int64_t hi) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd(), a2 = _mm512_setzero_pd(), a3 = _mm512_setzero_pd();
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    const __m512 f0 = load_any(x, t, i, 0xffff), f1 = load_any(x, t, i + 16, 0xffff);
    const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(f0));
    const __m512d d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f0), 1)));
    const __m512d d2 = _mm512_cvtps_pd(_mm512_castps512_ps256(f1));
    const __m512d d3 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f1), 1)));
    a0 = _mm512_fmadd_pd(d0, d0, a0);
    a1 = _mm512_fmadd_pd(d1, d1, a1);
    a2 = _mm512_fmadd_pd(d2, d2, a2);
    a3 = _mm512_fmadd_pd(d3, d3, a3);
  }
  for (; i < hi; i += 16) {
    const __m512 f = load_any(x, t, i, tail_mask(hi - i));
    const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
    const __m512d d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
    a0 = _mm512_fmadd_pd(d0, d0, a0);
    a1 = _mm512_fmadd_pd(d1, d1, a1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
}

// ---- scale and cast ----------------------------------------------------------------------

void scale_portable(void* x, DType t, float s, int64_t lo, int64_t hi) {
  if (t == DType::f32) {
    float* f = static_cast<float*>(x);
    for (int64_t i = lo; i < hi; ++i) f[i] *= s;
    return;
  }
  for (int64_t i = lo; i < hi; ++i) store_from_f32(x, t, i, load_as_f32(x, t, i) * s);
}
STRATA_AVX512 void scale_avx512(void* x, DType t, float s, int64_t lo, int64_t hi) {
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 k = tail_mask(hi - i);
    store_any(x, t, i, _mm512_mul_ps(load_any(x, t, i, k), vs), k);
  }
}

void cast_portable(const CastArgs& a, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) store_from_f32(a.dst, a.dst_dtype, i, load_as_f32(a.src, a.src_dtype, i));
}
template <DType S, DType D>
STRATA_AVX512 void cast_avx512_t(const void* src, void* dst, int64_t lo, int64_t hi) {
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) store_any(dst, D, i, load_any(src, S, i, 0xffff), 0xffff);
  if (i < hi) {
    const __mmask16 k = tail_mask(hi - i);
    store_any(dst, D, i, load_any(src, S, i, k), k);
  }
}
void cast_avx512(const CastArgs& a, int64_t lo, int64_t hi) {
  using T = DType;
#define STRATA_CAST(s, d) \
  if (a.src_dtype == T::s && a.dst_dtype == T::d) return cast_avx512_t<T::s, T::d>(a.src, a.dst, lo, hi);
  STRATA_CAST(f32, bf16) STRATA_CAST(f32, f16) STRATA_CAST(bf16, f32)
  STRATA_CAST(bf16, f16) STRATA_CAST(f16, f32) STRATA_CAST(f16, bf16)
#undef STRATA_CAST
  cast_portable(a, lo, hi);
}

}  // namespace

bool use_avx512() { return cpu_has_avx512() && g_avx512_enabled.load(std::memory_order_relaxed); }
void set_avx512_enabled(bool enabled) { g_avx512_enabled.store(enabled); }

void adamw(const AdamWArgs& args) {
  const AdamWArgs a = args.with_inputs();
  const AdamConsts c = adam_consts(a);
  const bool vec = use_avx512();
  for_chunks(a.n, [&](int64_t lo, int64_t hi) {
    if (vec) adamw_avx512(a, c, lo, hi);
    else adamw_portable(a, c, lo, hi);
  });
}

void sum_squares(const SumSquaresArgs& a) {
  // (n_blocks) partial sums; block size a multiple of 16 and at least 4096.
  const int64_t block = std::max<int64_t>(4096, ((a.n + kMaxBlocks - 1) / kMaxBlocks + 15) / 16 * 16);
  const int64_t n_blocks = (a.n + block - 1) / block;
  double partial[kMaxBlocks];
  const bool vec = use_avx512();
  parallel_for(0, n_blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t i0 = b * block, i1 = std::min(a.n, i0 + block);
      partial[b] = vec ? sumsq_avx512(a.x, a.dtype, i0, i1) : sumsq_portable(a.x, a.dtype, i0, i1);
    }
  });
  double total = 0;
  for (int64_t b = 0; b < n_blocks; ++b) total += partial[b];
  *a.out += total;
}

void scale(const ScaleArgs& a) {
  const bool vec = use_avx512();
  for_chunks(a.n, [&](int64_t lo, int64_t hi) {
    if (vec) scale_avx512(a.x, a.dtype, a.s, lo, hi);
    else scale_portable(a.x, a.dtype, a.s, lo, hi);
  });
}

void rank_order_sum(const RankOrderSumArgs& a) {
  const size_t es = dtype_size(a.dtype);
  const auto* others = static_cast<const char*>(a.others);
  for_chunks(a.n, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float acc = 0;
      for (int r = 0; r < a.world; ++r) {
        const void* src = r == a.me ? a.mine
                                    : others + static_cast<size_t>((r < a.me ? r : r - 1) * a.others_stride) * es;
        acc = r == 0 ? load_as_f32(src, a.dtype, static_cast<size_t>(i)) : acc + load_as_f32(src, a.dtype, static_cast<size_t>(i));
      }
      store_from_f32(a.out, a.dtype, static_cast<size_t>(i), acc);
    }
  });
}

void cast(const CastArgs& a) {
  if (a.src_dtype == a.dst_dtype) {
    const size_t es = dtype_size(a.src_dtype);
    for_chunks(a.n, [&](int64_t lo, int64_t hi) {
      std::memcpy(static_cast<char*>(a.dst) + lo * es, static_cast<const char*>(a.src) + lo * es, (hi - lo) * es);
    });
    return;
  }
  const bool vec = use_avx512();
  for_chunks(a.n, [&](int64_t lo, int64_t hi) {
    if (vec) cast_avx512(a, lo, hi);
    else cast_portable(a, lo, hi);
  });
}

}  // namespace strata::kernels::cpu
