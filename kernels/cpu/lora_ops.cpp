// LoRA's ops on the CPU (kernels/ops.h): dequantize, a frozen weight matrix as --base-dtype
// stores it decoded to the working dtype, and dropout, the adapters' input mask. NF4's lookup
// has an AVX-512BW path (a block's 16 stored levels as one permute table) and a portable one;
// both store the same bytes, the levels being computed the same way (the file is built with
// -ffp-contract=off: no FMA, as in the CUDA kernels).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/counter_rng.h"
#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"

namespace strata::kernels::cpu {
namespace {

#define STRATA_AVX512_BW __attribute__((target("avx512f,avx512bw")))

constexpr int64_t kNf4Block = 64;         // elements per absmax
constexpr int64_t kNf4AbsmaxBlock = 256;  // absmaxes per double-quantization block
constexpr int64_t kGrainElems = 1 << 16;  // elements per parallel task, at least

// Block b's 16 levels in the output's dtype.
template <class E>
inline void nf4_levels(const DequantizeArgs& a, int64_t b, typename E::T* level) {
  const auto* scales = a.scales;
  float absmax = a.map[a.absmax_codes[b]] * scales[1 + b / kNf4AbsmaxBlock];
  absmax = absmax + scales[0];
  for (int k = 0; k < 16; ++k) level[k] = E::store(a.levels[k] * absmax);
}

// Elements [s, e) of one block, element by element; element e_lo lands at out[0].
template <class T>
inline void nf4_lookup(const uint8_t* codes, const T* level, int64_t s, int64_t e, int64_t e_lo, T* out) {
  for (int64_t i = s; i < e; ++i) {
    const uint8_t byte = codes[i >> 1];
    out[i - e_lo] = level[(i & 1) ? (byte & 15) : (byte >> 4)];
  }
}

template <class E>
void nf4_portable(const DequantizeArgs& a, int64_t e_lo, int64_t e_hi, int64_t b_lo, int64_t b_hi,
                  typename E::T* out) {
  const auto* codes = static_cast<const uint8_t*>(a.codes);
  typename E::T level[16];
  for (int64_t b = b_lo; b < b_hi; ++b) {
    nf4_levels<E>(a, b, level);
    nf4_lookup(codes, level, std::max(b * kNf4Block, e_lo), std::min((b + 1) * kNf4Block, e_hi), e_lo, out);
  }
}

// A whole block's 32 code bytes at a time: cvtepu8 to 32-bit lanes, the high and low nibbles
// index the table. The unmasked intrinsics start from _mm512_undefined, which GCC 12 reports
// as maybe-uninitialized: all-lane masks instead.
template <class E>
STRATA_AVX512_BW void nf4_avx512(const DequantizeArgs& a, int64_t e_lo, int64_t e_hi, int64_t b_lo, int64_t b_hi,
                                 typename E::T* out) {
  using T = typename E::T;
  constexpr __mmask16 kAll16 = 0xffff;
  constexpr __mmask32 kAll32 = 0xffffffffu;
  const __m512i nibble = _mm512_set1_epi32(15);
  // 32 floats from 16 bytes, [hi_0, lo_0, hi_1, lo_1, ...], from the two lookups' halves.
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const auto* codes = static_cast<const uint8_t*>(a.codes);
  alignas(64) T level[64 / sizeof(T)] = {};  // one 512-bit table, the 16 levels first
  for (int64_t b = b_lo; b < b_hi; ++b) {
    nf4_levels<E>(a, b, level);
    const int64_t s = std::max(b * kNf4Block, e_lo), e = std::min((b + 1) * kNf4Block, e_hi);
    if (e - s != kNf4Block) {  // a block cut by the range
      nf4_lookup(codes, level, s, e, e_lo, out);
      continue;
    }
    const uint8_t* c = codes + s / 2;
    T* o = out + (s - e_lo);
    for (int half = 0; half < 2; ++half) {
      const __m512i v =
          _mm512_maskz_cvtepu8_epi32(kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * half)));
      const __m512i hi = _mm512_maskz_srli_epi32(kAll16, v, 4), lo = _mm512_and_si512(v, nibble);
      if constexpr (sizeof(T) == 2) {  // 16-bit lanes hi_j, lo_j: the output's order
        const __m512i table = _mm512_load_si512(level);
        const __m512i idx = _mm512_or_si512(hi, _mm512_maskz_slli_epi32(kAll16, lo, 16));
        _mm512_storeu_si512(o + 32 * half, _mm512_maskz_permutexvar_epi16(kAll32, idx, table));
      } else {
        const __m512 table = _mm512_load_ps(level);
        const __m512 h = _mm512_maskz_permutexvar_ps(kAll16, hi, table);
        const __m512 l = _mm512_maskz_permutexvar_ps(kAll16, lo, table);
        _mm512_storeu_ps(o + 32 * half, _mm512_maskz_permutex2var_ps(kAll16, h, first, l));
        _mm512_storeu_ps(o + 32 * half + 16, _mm512_maskz_permutex2var_ps(kAll16, h, second, l));
      }
    }
  }
}

template <class E>
void nf4(const DequantizeArgs& a, typename E::T* out) {
  const int64_t e_lo = a.row_lo * a.cols, e_hi = a.hi() * a.cols;
  const int64_t b_lo = e_lo / kNf4Block, b_hi = (e_hi + kNf4Block - 1) / kNf4Block;
  const bool vec = use_avx512();
  parallel_for(b_lo, b_hi, kGrainElems / kNf4Block, [&](int64_t lo, int64_t hi) {
    if (vec)
      nf4_avx512<E>(a, e_lo, e_hi, lo, hi, out);
    else
      nf4_portable<E>(a, e_lo, e_hi, lo, hi, out);
  });
}

template <class E>
void int8(const DequantizeArgs& a, typename E::T* out) {
  const auto* codes = static_cast<const int8_t*>(a.codes);
  parallel_for(a.row_lo, a.hi(), std::max<int64_t>(1, kGrainElems / a.cols), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float scale = a.scales[r];
      const int8_t* q = codes + r * a.cols;
      typename E::T* o = out + (r - a.row_lo) * a.cols;
      for (int64_t j = 0; j < a.cols; ++j) o[j] = E::store(static_cast<float>(q[j]) * scale);
    }
  });
}

template <class F>
void with_out(DType t, void* out, F&& f) {
  switch (t) {
    case DType::f32: return f(Elem<DType::f32>{}, static_cast<float*>(out));
    case DType::bf16: return f(Elem<DType::bf16>{}, static_cast<uint16_t*>(out));
    case DType::f16: return f(Elem<DType::f16>{}, static_cast<uint16_t*>(out));
  }
}

template <class E>
void dropout_impl(const DropoutArgs& a) {
  using T = typename E::T;
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const float keep_scale = 1.f / (1.f - a.p);
  parallel_for(0, a.n, kGrainElems, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float v = counter_uniform(a.key, dropout_mask_index(a, i)) >= a.p ? E::load(x[i]) * keep_scale : 0.f;
      out[i] = E::store(a.accumulate ? E::load(out[i]) + v : v);
    }
  });
}

}  // namespace

void dropout(const DropoutArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { dropout_impl<decltype(e)>(a); });
}

void dequantize(const DequantizeArgs& a) {
  switch (a.format) {
    case StoredFormat::bf16:
    case StoredFormat::fp16: {  // a cast from the stored dtype
      const DType from = a.format == StoredFormat::bf16 ? DType::bf16 : DType::f16;
      const int64_t n = (a.hi() - a.row_lo) * a.cols;
      const void* src = static_cast<const uint16_t*>(a.codes) + a.row_lo * a.cols;
      cast({.n = n, .src = src, .src_dtype = from, .dst = a.out, .dst_dtype = a.out_dtype});
      return;
    }
    case StoredFormat::int8:
      return with_out(a.out_dtype, a.out, [&](auto e, auto* o) { int8<decltype(e)>(a, o); });
    case StoredFormat::nf4:
      return with_out(a.out_dtype, a.out, [&](auto e, auto* o) { nf4<decltype(e)>(a, o); });
  }
}

}  // namespace strata::kernels::cpu
