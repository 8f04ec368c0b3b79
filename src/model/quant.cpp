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


#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
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
  quant_layout(kind, rows, cols);  // checks the shape
  if (row_lo < 0 || row_hi > rows || row_lo >= row_hi)
    throw std::invalid_argument("dequantize_rows: row range [" + std::to_string(row_lo) + ", " +
                                std::to_string(row_hi) + ") is empty or outside the matrix's " +
                                std::to_string(rows) + " rows");
  check_pointer("dequantize_rows", "q", q);
  check_pointer("dequantize_rows", "out", out);
  kernels::DequantizeArgs a = dequantize_args(kind, q, rows, cols, out, out_dtype);
  a.row_lo = row_lo;
  a.row_hi = row_hi;
  kernels::cpu::dequantize(a);
}

kernels::DequantizeArgs dequantize_args(QuantKind kind, const void* q, int64_t rows, int64_t cols, void* out,
                                        DType out_dtype) {
  const QuantLayout l = quant_layout(kind, rows, cols);
  const auto* in = static_cast<const uint8_t*>(q);
  kernels::DequantizeArgs a;
  a.format = static_cast<kernels::StoredFormat>(kind);
  a.rows = rows;
  a.cols = cols;
  a.codes = q;
  if (kind == QuantKind::int8 || kind == QuantKind::nf4) a.scales = reinterpret_cast<const float*>(in + l.scales_offset);
  if (kind == QuantKind::nf4) {
    a.absmax_codes = in + l.absmax_codes_offset;
    a.levels = kNf4.data();
    a.map = dynamic_map_signed().data();
  }
  a.out = out;
  a.out_dtype = out_dtype;
  return a;
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
