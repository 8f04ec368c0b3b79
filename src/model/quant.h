// Quantized storage of a frozen weight matrix (the base of a QLoRA run): int8 per output row
// (absmax), NF4 in blocks of 64 with double-quantized absmaxes as bitsandbytes stores them, and
// plain bf16/fp16. A quantized matrix is one byte range (codes, then scales), so the offload
// manager moves it between tiers as one block, and dequantize_rows decodes a slice of rows, so
// a GEMM never needs the whole matrix back in floating point.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/ops.h"

namespace strata {

// The formats as the op set decodes them (kernels::StoredFormat, the same values).
enum class QuantKind : uint8_t { bf16, fp16, int8, nf4 };
static_assert(static_cast<int>(QuantKind::nf4) == static_cast<int>(kernels::StoredFormat::nf4));

std::string_view quant_kind_name(QuantKind k);  // "bf16", "fp16", "int8", "nf4"
// Parses the names above ("fp16" also as "f16"); throws std::invalid_argument naming the text.
QuantKind parse_quant_kind(std::string_view text);

inline constexpr int64_t kNf4Block = 64;          // elements per NF4 absmax (flattened row-major)
inline constexpr int64_t kNf4AbsmaxBlock = 256;   // absmaxes per block of the double quantization

// Where the parts of a quantized (rows, cols) matrix lie in its buffer, in bytes. n = rows*cols.
//   bf16, fp16  values (rows, cols), 2 bytes each, at 0.
//   int8        codes (rows, cols) int8 at 0; scale fp32 (rows) at scales_offset.
//   nf4         codes: ceil(n/2) bytes at 0, element 2i in the high nibble of byte i and 2i+1 in
//               the low one (bitsandbytes' order; an odd n pads the last low nibble with the
//               code of 0.0, 7); absmax codes uint8 (n_blocks = ceil(n/64)) at
//               absmax_codes_offset; at scales_offset the fp32 offset (mean of the absmaxes),
//               then absmax2 fp32 (n_absmax_blocks = ceil(n_blocks/256)). The 16 levels and the
//               256-entry map are constants (nf4_levels, dynamic_map_signed), not stored.
// Parts start on 16-byte boundaries; the padding between them is zero.
struct QuantLayout {
  size_t codes_bytes = 0;
  size_t absmax_codes_offset = 0;  // nf4 only
  size_t scales_offset = 0;        // int8, nf4
  size_t total_bytes = 0;
  int64_t n_blocks = 0;            // nf4 only
  int64_t n_absmax_blocks = 0;     // nf4 only
};
// Throws std::invalid_argument when rows or cols is not positive.
QuantLayout quant_layout(QuantKind kind, int64_t rows, int64_t cols);
size_t bytes_for(QuantKind kind, int64_t rows, int64_t cols);

// Quantizes src (rows, cols) of dtype src_dtype (f32, bf16 or f16) into dst, which holds
// bytes_for(kind, rows, cols) bytes. Weights are taken to be finite. The arithmetic, exactly:
//   int8  scale[r] = absmax(row r) / 127 (fp32 division); q = w / scale (fp32 division),
//         clamped to [-127, 127] and rounded half to even (torch.round's rule); a row whose
//         scale is 0 stores scale 0 and q 0.
//   nf4   bitsandbytes' CUDA kernel (kQuantizeBlockwise, NF4): a = absmax of the block,
//         x = w * (1.0f / a) in fp32, code = dQuantizeNF4(x): x goes to the upper of two
//         neighbouring levels iff x > their midpoint as the kernel's fp32 literal has it, so a
//         value on it goes down (even the four where the literal rounded toward the upper level).
//         Double quantization as quantize_4bit(compress_statistics=True): offset = mean of the
//         absmaxes (summed in double in order, rounded once to fp32; bitsandbytes takes torch's
//         fp32 mean(), which can differ in the last bit), v = a - offset (fp32), then
//         blocks of 256 v: a2 = absmax, x = v * (1.0f / a2), q8 = dQuantize<0> over the signed
//         dynamic map (nearest; on the fp32 midpoint the even index wins).
//         One deviation: a block whose absmax is 0 stores the code of 0.0 (NF4 7, map 127).
//         bitsandbytes computes 0 * (1/0) = NaN there, which its search sends to code 0; for NF4
//         that decodes to -absmax' (not 0) once the absmax went through the double quantization.
//   bf16, fp16  round to nearest even (kernels::f32_to_bf16 / f32_to_f16).
// Runs on the compute pool every CPU op shares (kernels::cpu::parallel_for: OpenMP, or oneTBB
// under STRATA_CPU_POOL=tbb), over rows (int8) or blocks (nf4); the bytes do not depend on it.
void quantize(QuantKind kind, const void* src, kernels::DType src_dtype, int64_t rows, int64_t cols, void* dst);

// Decodes rows [row_lo, row_hi) of the quantized matrix q into out ((row_hi - row_lo, cols) of
// out_dtype: f32, bf16 or f16, rounded to nearest even from the fp32 value):
//   int8  w' = q * scale[r] (fp32).
//   nf4   absmax' = map[q8] * absmax2[b / 256] + offset, w' = NF4[code] * absmax', each product
//         and sum rounded to fp32 on its own (bitsandbytes' dequantize_4bit; no FMA).
// The rows decode the same bits as the same rows of a whole decode. Throws std::invalid_argument
// for a shape or row range that does not fit.
void dequantize_rows(QuantKind kind, const void* q, int64_t rows, int64_t cols, int64_t row_lo, int64_t row_hi,
                     void* out, kernels::DType out_dtype);

// The op set's arguments that decode the whole quantized matrix q into out (Ops::dequantize,
// on any backend; q and out in that backend's memory, the NF4 tables on the host).
kernels::DequantizeArgs dequantize_args(QuantKind kind, const void* q, int64_t rows, int64_t cols, void* out,
                                        kernels::DType out_dtype);

// The 16 NormalFloat4 levels (bitsandbytes' get_4bit_type("nf4")), ascending.
const std::array<float, 16>& nf4_levels();
// bitsandbytes' create_dynamic_map(signed=True) (256 values, ascending; see quant.cpp for how its
// float32 bits are pinned down).
const std::array<float, 256>& dynamic_map_signed();

// The decisions on one normalized value x (w / absmax, as quantize computes it), for tests and
// for device kernels to match: NF4's code (0..15) and the 8-bit code of the dynamic map.
uint8_t nf4_code(float x);
uint8_t dynamic_code(float x);

// A quantized matrix that owns its bytes (the layout above).
struct QuantizedTensor {
  QuantKind kind = QuantKind::bf16;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> bytes;

  static QuantizedTensor make(QuantKind kind, const void* src, kernels::DType src_dtype, int64_t rows, int64_t cols);
  QuantLayout layout() const { return quant_layout(kind, rows, cols); }
  void dequantize_rows(int64_t row_lo, int64_t row_hi, void* out, kernels::DType out_dtype) const;
};

}  // namespace strata
