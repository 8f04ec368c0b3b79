// int8 / NF4 quantization of frozen weights, bit for bit as written in quant.h. Hot loops are
// plain fp32 code compiled once per x86-64 level (target_clones): each clone does the same IEEE
// operations (the file is built with -ffp-contract=off), so every machine stores the same bytes.
// NF4's level is a count of thresholds passed (bitsandbytes' decision tree, branch-free) and
// absmaxes are maxima of |x|'s bits, so both vectorise without -ffast-math.
#include "src/model/quant.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu/act_types.h"
#include "kernels/cpu/parallel.h"

namespace strata {
namespace {

using kernels::DType;
using kernels::cpu::Elem;

#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)  // TSan: see init_normal.cpp
#define STRATA_QUANT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define STRATA_QUANT_CLONES
#endif
#define STRATA_INLINE inline __attribute__((always_inline))
#define STRATA_LAMBDA_INLINE __attribute__((always_inline))

// Calls f(Elem<D>{}, p as D's storage type) for the run-time dtype t. f must be a lambda marked
// STRATA_LAMBDA_INLINE, so it is inlined into (and compiled for) each target_clones clone that calls this.
template <class P, class F>
STRATA_INLINE void with_dtype(DType t, P* p, F&& f) {
  using U = std::conditional_t<std::is_const_v<P>, const uint16_t, uint16_t>;
  using W = std::conditional_t<std::is_const_v<P>, const float, float>;
  switch (t) {
    case DType::f32: return f(Elem<DType::f32>{}, static_cast<W*>(p));
    case DType::bf16: return f(Elem<DType::bf16>{}, static_cast<U*>(p));
    case DType::f16: return f(Elem<DType::f16>{}, static_cast<U*>(p));
  }
}

// bitsandbytes/functional.py get_4bit_type("nf4") (divided by its absmax, 1.0: unchanged).
constexpr std::array<float, 16> kNf4 = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
    0.7229568362236023f, 1.0f};
// The float literals of csrc/kernels.cu dQuantizeNF4's decision tree, ascending: the midpoints of
// neighbouring levels as decimals, which the compiler rounds to fp32 (four of them up, so x on
// such a threshold is nearer the upper level yet goes to the lower). The tree's leaf is the
// number of thresholds with x > t (a NaN passes none: code 0, as in the tree).
constexpr std::array<float, 15> kNf4Thresholds = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
    0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};
constexpr uint8_t kNf4Zero = 7;        // kNf4[7] == 0.0
constexpr uint8_t kDynamicZero = 127;  // dynamic_map_signed()[127] == 0.0

// torch.linspace(start, end, steps) in float32 as torch's CPU kernel writes it
// (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp: from the start below steps/2, from the end
// above), without fused multiply-adds.
void linspace_f32(float start, float end, int steps, float* out) {
  const float step = (end - start) / static_cast<float>(steps - 1);
  for (int i = 0; i < steps; ++i)
    out[i] = i < steps / 2 ? start + step * static_cast<float>(i) : end - step * static_cast<float>(steps - i - 1);
}

// bitsandbytes/functional.py create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
// for exponent i in 0..6, the midpoints of linspace(0.1, 1, 2^i + 1) times 10^(i-6), both signs
// (a torch float32 tensor times a Python float: the float is cast to fp32 first), then 0 and 1.0,
// sorted. (additional_items is 0 for these arguments.) bitsandbytes has torch build the map at run
// time, so its last bits follow torch's linspace kernel: Debian's torch 1.13 (a vectorised
// linspace, FMA in its AVX2/AVX-512 kernels) differs from this by 1-2 ulp in 32 to 44 of the 256
// entries, depending on ATEN_CPU_CAPABILITY. This is current torch's scalar formula, without FMA.
std::array<float, 256> build_dynamic_map() {
  constexpr double kPow10[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::array<float, 256> map{};
  int n = 0;
  for (int i = 0; i < 7; ++i) {
    const int steps = (1 << i) + 1;
    float bounds[65];
    linspace_f32(0.1f, 1.0f, steps, bounds);
    const float scale = static_cast<float>(kPow10[i]);
    for (float sign : {1.0f, -1.0f})
      for (int k = 0; k + 1 < steps; ++k) map[static_cast<size_t>(n++)] = (sign * scale) * ((bounds[k] + bounds[k + 1]) / 2.0f);
  }
  map[static_cast<size_t>(n++)] = 0.0f;
  map[static_cast<size_t>(n++)] = 1.0f;
  std::sort(map.begin(), map.end());
  return map;
}

// csrc/kernels.cu dQuantize<0> (not stochastic): a binary search over the 256 sorted values from
// index 127 in steps 64, 32, ..., 1, so it always ends on an even index p, then the neighbour on
// x's side if x is past their fp32 midpoint (a tie keeps p). The kernel tracks the neighbours as
// the last pivots above and below; after the step of 1 they are p + 1 and p - 1 (0 at the
// bottom, where x < code[0] and x >= code[0] both give 0). Written with arithmetic on the
// comparisons, not branches: x is random, and the branches' mispredictions took ~35% of NF4's time.
STRATA_INLINE uint8_t dynamic_search(const float* code, float x) {
  int p = 127;
  for (int i = 64; i > 0; i >>= 1) {
    const int up = x > code[p];
    p += (2 * up - 1) * i;
  }
  const float val = code[p], upper = code[p + 1], lower = code[p - (p > 0)];
  const int above = x > val;
  const int go_up = above & (x > (upper + val) * 0.5f);
  const int go_down = (1 - above) & (x < (lower + val) * 0.5f) & (p > 0);
  return static_cast<uint8_t>(p + go_up - go_down);
}

size_t align16(size_t x) { return (x + 15) & ~size_t{15}; }

STRATA_INLINE uint8_t nf4_leaf(float x) {
  int32_t k = 0;
  for (float t : kNf4Thresholds) k += x > t ? 1 : 0;
  return static_cast<uint8_t>(k);
}

STRATA_INLINE uint32_t abs_bits(float x) { return std::bit_cast<uint32_t>(x) & 0x7fffffffu; }

// One NF4 block of 64 values: its absmax and 32 code bytes (high nibble first).
template <class E>
STRATA_INLINE float nf4_block(const typename E::T* src, uint8_t* out) {
  alignas(64) float v[kNf4Block];
  alignas(64) uint8_t c[kNf4Block];
  uint32_t m = 0;
  for (int j = 0; j < kNf4Block; ++j) {
    v[j] = E::load(src[j]);
    m = std::max(m, abs_bits(v[j]));
  }
  const float a = std::bit_cast<float>(m);
  if (a == 0.0f) {
    std::memset(out, kNf4Zero * 0x11, kNf4Block / 2);
    return a;
  }
  const float inv = 1.0f / a;
  for (int j = 0; j < kNf4Block; ++j) c[j] = nf4_leaf(v[j] * inv);
  for (int j = 0; j < kNf4Block / 2; ++j) out[j] = static_cast<uint8_t>((c[2 * j] << 4) | c[2 * j + 1]);
  return a;
}

// NF4 blocks [b_lo, b_hi) of the n values at src. A short last block is padded with zeros, which
// code as 0.0 (7), as bitsandbytes' kernel loads them.
template <class E>
STRATA_INLINE void nf4_blocks(const typename E::T* src, int64_t n, int64_t b_lo, int64_t b_hi, uint8_t* codes,
                              float* absmax) {
  for (int64_t b = b_lo; b < b_hi; ++b) {
    const int64_t e0 = b * kNf4Block, len = std::min(kNf4Block, n - e0);
    if (len == kNf4Block) {
      absmax[b] = nf4_block<E>(src + e0, codes + e0 / 2);
      continue;
    }
    typename E::T padded[kNf4Block] = {};  // all-zero bits: +0.0 in every dtype
    std::memcpy(padded, src + e0, static_cast<size_t>(len) * sizeof(typename E::T));
    uint8_t out[kNf4Block / 2];
    absmax[b] = nf4_block<E>(padded, out);
    std::memcpy(codes + e0 / 2, out, static_cast<size_t>((len + 1) / 2));
  }
}

STRATA_QUANT_CLONES void nf4_quantize_blocks(const void* src, DType t, int64_t n, int64_t b_lo, int64_t b_hi,
                                             uint8_t* codes, float* absmax) {
  with_dtype(t, src, [&](auto e, auto* s) STRATA_LAMBDA_INLINE { nf4_blocks<decltype(e)>(s, n, b_lo, b_hi, codes, absmax); });
}

// One block of the double quantization: len <= 256 absmaxes less the offset, their absmax a2
// (returned) and 8-bit codes.
STRATA_QUANT_CLONES float quantize_absmax_group(const float* absmax, int64_t len, float offset, uint8_t* q8) {
  float v[kNf4AbsmaxBlock];
  uint32_t m = 0;
  for (int64_t j = 0; j < len; ++j) {
    v[j] = absmax[j] - offset;
    m = std::max(m, abs_bits(v[j]));
  }
  const float a2 = std::bit_cast<float>(m);
  if (a2 == 0.0f) {
    std::memset(q8, kDynamicZero, static_cast<size_t>(len));
    return a2;
  }
  const float inv = 1.0f / a2;
  const float* code = dynamic_map_signed().data();
  for (int64_t j = 0; j < len; ++j) q8[j] = dynamic_search(code, v[j] * inv);
  return a2;
}

// The double quantization of the n_blocks absmaxes (quant.h): offset, 8-bit codes, absmax2.
void quantize_absmaxes(const float* absmax, int64_t n_blocks, uint8_t* q8, float* offset_out, float* absmax2) {
  double sum = 0;
  for (int64_t b = 0; b < n_blocks; ++b) sum += absmax[b];
  const float offset = static_cast<float>(sum / static_cast<double>(n_blocks));
  *offset_out = offset;
  const int64_t n_groups = (n_blocks + kNf4AbsmaxBlock - 1) / kNf4AbsmaxBlock;
  kernels::cpu::parallel_for(0, n_groups, 16, [&](int64_t g_lo, int64_t g_hi) {
    for (int64_t g = g_lo; g < g_hi; ++g) {
      const int64_t b0 = g * kNf4AbsmaxBlock;
      absmax2[g] = quantize_absmax_group(absmax + b0, std::min(kNf4AbsmaxBlock, n_blocks - b0), offset, q8 + b0);
    }
  });
}

// int8 rows [r_lo, r_hi): scale and codes per row.
template <class E>
STRATA_INLINE void int8_rows(const typename E::T* src, int64_t cols, int64_t r_lo, int64_t r_hi, int8_t* codes,
                             float* scales) {
  for (int64_t r = r_lo; r < r_hi; ++r) {
    const typename E::T* row = src + r * cols;
    int8_t* q = codes + r * cols;
    uint32_t m = 0;
    for (int64_t j = 0; j < cols; ++j) m = std::max(m, abs_bits(E::load(row[j])));
    const float scale = std::bit_cast<float>(m) / 127.0f;
    scales[r] = scale;
    if (scale == 0.0f) {
      std::memset(q, 0, static_cast<size_t>(cols));
      continue;
    }
    for (int64_t j = 0; j < cols; ++j) {
      float x = E::load(row[j]) / scale;
      x = x < -127.0f ? -127.0f : x;
      x = x > 127.0f ? 127.0f : x;
      x = (x + 12582912.0f) - 12582912.0f;  // round half to even (1.5 * 2^23: |x| <= 127 is exact)
      q[j] = static_cast<int8_t>(static_cast<int32_t>(x));
    }
  }
}

STRATA_QUANT_CLONES void int8_quantize_rows(const void* src, DType t, int64_t cols, int64_t r_lo, int64_t r_hi,
                                            int8_t* codes, float* scales) {
  with_dtype(t, src, [&](auto e, auto* s) STRATA_LAMBDA_INLINE { int8_rows<decltype(e)>(s, cols, r_lo, r_hi, codes, scales); });
}

// Elements [e_lo, e_hi) of an NF4 matrix into out (element e_lo at out[0]), blocks
// [b_lo, b_hi) of them.
template <class E>
STRATA_INLINE void nf4_decode(const uint8_t* codes, const uint8_t* q8, const float* absmax2, float offset,
                              int64_t e_lo, int64_t e_hi, int64_t b_lo, int64_t b_hi, typename E::T* out) {
  const float* map = dynamic_map_signed().data();
  for (int64_t b = b_lo; b < b_hi; ++b) {
    float a = map[q8[b]] * absmax2[b / kNf4AbsmaxBlock];
    a = a + offset;
    typename E::T level[16];  // the block's 16 values, stored: each element is then a lookup
    for (int k = 0; k < 16; ++k) level[k] = E::store(kNf4[static_cast<size_t>(k)] * a);
    const int64_t s = std::max(b * kNf4Block, e_lo), e = std::min((b + 1) * kNf4Block, e_hi);
    if ((s & 1) == 0 && (e & 1) == 0) {
      typename E::T* o = out + (s - e_lo);
      for (int64_t j = 0; j < (e - s) / 2; ++j) {
        const uint8_t byte = codes[s / 2 + j];
        o[2 * j] = level[byte >> 4];
        o[2 * j + 1] = level[byte & 15];
      }
      continue;
    }
    for (int64_t i = s; i < e; ++i) {
      const uint8_t byte = codes[i >> 1];
      out[i - e_lo] = level[(i & 1) ? (byte & 15) : (byte >> 4)];
    }
  }
}

STRATA_QUANT_CLONES void nf4_decode_blocks(const uint8_t* codes, const uint8_t* q8, const float* absmax2, float offset,
                                           int64_t e_lo, int64_t e_hi, int64_t b_lo, int64_t b_hi, void* out,
                                           DType t) {
  with_dtype(t, out, [&](auto e, auto* o) STRATA_LAMBDA_INLINE {
    nf4_decode<decltype(e)>(codes, q8, absmax2, offset, e_lo, e_hi, b_lo, b_hi, o);
  });
}

#if defined(__x86_64__)
#define STRATA_NF4_AVX512 1
// The same decode with AVX-512BW's permutes for the lookup: a block's 16 stored levels are a
// table, each code byte's two nibbles index it. Same levels, same bytes out as nf4_decode; 2.5x
// its speed on one core (bench_quant), which the NF4 base pays for every layer, twice a step.
template <class E>
__attribute__((target("avx512f,avx512bw"))) void nf4_decode_avx512(const uint8_t* codes, const uint8_t* q8,
                                                                   const float* absmax2, float offset, int64_t e_lo,
                                                                   int64_t e_hi, int64_t b_lo, int64_t b_hi,
                                                                   typename E::T* out) {
  using T = typename E::T;
  const float* map = dynamic_map_signed().data();
  // The all-lanes masks: the unmasked intrinsics start from _mm512_undefined, which GCC 12
  // reports as maybe-uninitialized.
  constexpr __mmask16 kAll16 = 0xffff;
  constexpr __mmask32 kAll32 = 0xffffffffu;
  const __m512i nibble = _mm512_set1_epi32(15);
  // 32 floats from 16 bytes: [hi_0, lo_0, hi_1, lo_1, ...], from the two lookups' halves.
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  alignas(64) T level[64 / sizeof(T)] = {};  // one 512-bit table, the 16 levels first
  for (int64_t b = b_lo; b < b_hi; ++b) {
    float a = map[q8[b]] * absmax2[b / kNf4AbsmaxBlock];
    a = a + offset;
    for (int k = 0; k < 16; ++k) level[k] = E::store(kNf4[static_cast<size_t>(k)] * a);
    const int64_t s = std::max(b * kNf4Block, e_lo), e = std::min((b + 1) * kNf4Block, e_hi);
    if (e - s != kNf4Block) {  // a block cut by the range: element by element
      for (int64_t i = s; i < e; ++i) {
        const uint8_t byte = codes[i >> 1];
        out[i - e_lo] = level[(i & 1) ? (byte & 15) : (byte >> 4)];
      }
      continue;
    }
    const uint8_t* c = codes + s / 2;
    T* o = out + (s - e_lo);
    for (int half = 0; half < 2; ++half) {
      const __m512i v = _mm512_maskz_cvtepu8_epi32(kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * half)));
      const __m512i hi = _mm512_maskz_srli_epi32(kAll16, v, 4), lo = _mm512_and_si512(v, nibble);
      if constexpr (sizeof(T) == 2) {  // 16-bit lanes hi_j, lo_j: the output's order
        const __m512i table = _mm512_load_si512(level);
        const __m512i idx = _mm512_or_si512(hi, _mm512_maskz_slli_epi32(kAll16, lo, 16));
        _mm512_storeu_si512(o + 32 * half, _mm512_maskz_permutexvar_epi16(kAll32, idx, table));
      } else {
        const __m512 table = _mm512_load_ps(level);
        const __m512 h = _mm512_maskz_permutexvar_ps(kAll16, hi, table), l = _mm512_maskz_permutexvar_ps(kAll16, lo, table);
        _mm512_storeu_ps(o + 32 * half, _mm512_maskz_permutex2var_ps(kAll16, h, first, l));
        _mm512_storeu_ps(o + 32 * half + 16, _mm512_maskz_permutex2var_ps(kAll16, h, second, l));
      }
    }
  }
}

bool has_avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
}
#endif

// nf4_decode for blocks [b_lo, b_hi), with AVX-512BW where the CPU has it.
void nf4_decode_range(const uint8_t* codes, const uint8_t* q8, const float* absmax2, float offset, int64_t e_lo,
                      int64_t e_hi, int64_t b_lo, int64_t b_hi, void* out, DType t) {
#ifdef STRATA_NF4_AVX512
  if (has_avx512bw()) {
    switch (t) {
      case DType::f32:
        return nf4_decode_avx512<Elem<DType::f32>>(codes, q8, absmax2, offset, e_lo, e_hi, b_lo, b_hi,
                                                   static_cast<float*>(out));
      case DType::bf16:
        return nf4_decode_avx512<Elem<DType::bf16>>(codes, q8, absmax2, offset, e_lo, e_hi, b_lo, b_hi,
                                                    static_cast<uint16_t*>(out));
      case DType::f16:
        return nf4_decode_avx512<Elem<DType::f16>>(codes, q8, absmax2, offset, e_lo, e_hi, b_lo, b_hi,
                                                   static_cast<uint16_t*>(out));
    }
  }
#endif
  nf4_decode_blocks(codes, q8, absmax2, offset, e_lo, e_hi, b_lo, b_hi, out, t);
}

template <class E>
STRATA_INLINE void int8_decode(const int8_t* codes, const float* scales, int64_t cols, int64_t r_lo, int64_t r_hi,
                               typename E::T* out) {
  for (int64_t r = r_lo; r < r_hi; ++r) {
    const float scale = scales[r];
    const int8_t* q = codes + r * cols;
    for (int64_t j = 0; j < cols; ++j) out[j] = E::store(static_cast<float>(q[j]) * scale);
    out += cols;
  }
}

STRATA_QUANT_CLONES void int8_decode_rows(const int8_t* codes, const float* scales, int64_t cols, int64_t r_lo,
                                          int64_t r_hi, void* out, DType t) {
  with_dtype(t, out, [&](auto e, auto* o) STRATA_LAMBDA_INLINE { int8_decode<decltype(e)>(codes, scales, cols, r_lo, r_hi, o); });
}

// Elements [lo, hi) of src (dtype from) to dst (dtype to), through fp32: the bf16/fp16 kinds.
STRATA_QUANT_CLONES void convert_range(const void* src, DType from, void* dst, DType to, int64_t lo, int64_t hi) {
  with_dtype(from, src, [&](auto f, auto* s) STRATA_LAMBDA_INLINE {
    with_dtype(to, dst, [&](auto t, auto* d) STRATA_LAMBDA_INLINE {
      for (int64_t i = lo; i < hi; ++i) d[i] = decltype(t)::store(decltype(f)::load(s[i]));
    });
  });
}

DType storage_dtype(QuantKind k) { return k == QuantKind::bf16 ? DType::bf16 : DType::f16; }

void check_pointer(const char* fn, const char* what, const void* p) {
  if (!p) throw std::invalid_argument(std::string(fn) + ": " + what + " is null");
}

constexpr int64_t kGrainElems = 1 << 16;  // elements per parallel task, at least

}  // namespace

std::string_view quant_kind_name(QuantKind k) {
  switch (k) {
    case QuantKind::bf16: return "bf16";
    case QuantKind::fp16: return "fp16";
    case QuantKind::int8: return "int8";
    case QuantKind::nf4: return "nf4";
  }
  return "?";
}

QuantKind parse_quant_kind(std::string_view text) {
  if (text == "bf16") return QuantKind::bf16;
  if (text == "fp16" || text == "f16") return QuantKind::fp16;
  if (text == "int8") return QuantKind::int8;
  if (text == "nf4") return QuantKind::nf4;
  throw std::invalid_argument("unknown quantization kind '" + std::string(text) + "' (valid: bf16, fp16, int8, nf4)");
}

QuantLayout quant_layout(QuantKind kind, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0)
    throw std::invalid_argument("quantized matrix: rows and cols must be positive (got rows " + std::to_string(rows) +
                                ", cols " + std::to_string(cols) + ")");
  const auto n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  QuantLayout l;
  switch (kind) {
    case QuantKind::bf16:
    case QuantKind::fp16:
      l.codes_bytes = 2 * n;
      l.total_bytes = l.codes_bytes;
      break;
    case QuantKind::int8:
      l.codes_bytes = n;
      l.scales_offset = align16(n);
      l.total_bytes = l.scales_offset + 4 * static_cast<size_t>(rows);
      break;
    case QuantKind::nf4:
      l.n_blocks = static_cast<int64_t>((n + kNf4Block - 1) / kNf4Block);
      l.n_absmax_blocks = (l.n_blocks + kNf4AbsmaxBlock - 1) / kNf4AbsmaxBlock;
      l.codes_bytes = (n + 1) / 2;
      l.absmax_codes_offset = align16(l.codes_bytes);
      l.scales_offset = align16(l.absmax_codes_offset + static_cast<size_t>(l.n_blocks));
      l.total_bytes = l.scales_offset + 4 * (1 + static_cast<size_t>(l.n_absmax_blocks));
      break;
  }
  return l;
}

size_t bytes_for(QuantKind kind, int64_t rows, int64_t cols) { return quant_layout(kind, rows, cols).total_bytes; }

const std::array<float, 16>& nf4_levels() { return kNf4; }

const std::array<float, 256>& dynamic_map_signed() {
  static const std::array<float, 256> map = build_dynamic_map();
  return map;
}

uint8_t nf4_code(float x) { return nf4_leaf(x); }
uint8_t dynamic_code(float x) { return dynamic_search(dynamic_map_signed().data(), x); }

void quantize(QuantKind kind, const void* src, DType src_dtype, int64_t rows, int64_t cols, void* dst) {
  const QuantLayout l = quant_layout(kind, rows, cols);
  check_pointer("quantize", "src", src);
  check_pointer("quantize", "dst", dst);
  auto* out = static_cast<uint8_t*>(dst);
  std::memset(out + l.codes_bytes, 0, l.total_bytes - l.codes_bytes);  // the padding between parts
  const int64_t n = rows * cols;
  switch (kind) {
    case QuantKind::bf16:
    case QuantKind::fp16:
      kernels::cpu::parallel_for(0, n, kGrainElems, [&](int64_t lo, int64_t hi) {
        convert_range(src, src_dtype, dst, storage_dtype(kind), lo, hi);
      });
      return;
    case QuantKind::int8: {
      auto* codes = reinterpret_cast<int8_t*>(out);
      auto* scales = reinterpret_cast<float*>(out + l.scales_offset);
      kernels::cpu::parallel_for(0, rows, std::max<int64_t>(1, kGrainElems / cols), [&](int64_t lo, int64_t hi) {
        int8_quantize_rows(src, src_dtype, cols, lo, hi, codes, scales);
      });
      return;
    }
    case QuantKind::nf4: {
      const auto absmax = std::make_unique_for_overwrite<float[]>(static_cast<size_t>(l.n_blocks));
      kernels::cpu::parallel_for(0, l.n_blocks, kGrainElems / kNf4Block, [&](int64_t lo, int64_t hi) {
        nf4_quantize_blocks(src, src_dtype, n, lo, hi, out, absmax.get());
      });
      auto* scales = reinterpret_cast<float*>(out + l.scales_offset);
      quantize_absmaxes(absmax.get(), l.n_blocks, out + l.absmax_codes_offset, scales, scales + 1);
      return;
    }
  }
}

void dequantize_rows(QuantKind kind, const void* q, int64_t rows, int64_t cols, int64_t row_lo, int64_t row_hi,
                     void* out, DType out_dtype) {
  const QuantLayout l = quant_layout(kind, rows, cols);
  if (row_lo < 0 || row_hi > rows || row_lo >= row_hi)
    throw std::invalid_argument("dequantize_rows: row range [" + std::to_string(row_lo) + ", " +
                                std::to_string(row_hi) + ") is empty or outside the matrix's " +
                                std::to_string(rows) + " rows");
  check_pointer("dequantize_rows", "q", q);
  check_pointer("dequantize_rows", "out", out);
  const auto* in = static_cast<const uint8_t*>(q);
  const int64_t e_lo = row_lo * cols, e_hi = row_hi * cols;
  switch (kind) {
    case QuantKind::bf16:
    case QuantKind::fp16: {
      const void* src = in + 2 * e_lo;
      kernels::cpu::parallel_for(0, e_hi - e_lo, kGrainElems, [&](int64_t lo, int64_t hi) {
        convert_range(src, storage_dtype(kind), out, out_dtype, lo, hi);
      });
      return;
    }
    case QuantKind::int8: {
      const auto* codes = reinterpret_cast<const int8_t*>(in);
      const auto* scales = reinterpret_cast<const float*>(in + l.scales_offset);
      const size_t out_row = static_cast<size_t>(cols) * kernels::dtype_size(out_dtype);
      kernels::cpu::parallel_for(row_lo, row_hi, std::max<int64_t>(1, kGrainElems / cols), [&](int64_t lo, int64_t hi) {
        int8_decode_rows(codes, scales, cols, lo, hi, static_cast<uint8_t*>(out) + static_cast<size_t>(lo - row_lo) * out_row,
                         out_dtype);
      });
      return;
    }
    case QuantKind::nf4: {
      const auto* scales = reinterpret_cast<const float*>(in + l.scales_offset);
      const int64_t b_lo = e_lo / kNf4Block, b_hi = (e_hi + kNf4Block - 1) / kNf4Block;
      kernels::cpu::parallel_for(b_lo, b_hi, kGrainElems / kNf4Block, [&](int64_t lo, int64_t hi) {
        nf4_decode_range(in, in + l.absmax_codes_offset, scales + 1, scales[0], e_lo, e_hi, lo, hi, out, out_dtype);
      });
      return;
    }
  }
}

QuantizedTensor QuantizedTensor::make(QuantKind kind, const void* src, DType src_dtype, int64_t rows, int64_t cols) {
  QuantizedTensor t;
  t.kind = kind;
  t.rows = rows;
  t.cols = cols;
  t.bytes.resize(bytes_for(kind, rows, cols));
  quantize(kind, src, src_dtype, rows, cols, t.bytes.data());
  return t;
}

void QuantizedTensor::dequantize_rows(int64_t row_lo, int64_t row_hi, void* out, DType out_dtype) const {
  strata::dequantize_rows(kind, bytes.data(), rows, cols, row_lo, row_hi, out, out_dtype);
}

}  // namespace strata
