// dtype names and parsing.
#include "kernels/dtype.h"

#include <stdexcept>

namespace strata::kernels {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::f16: return "fp16";
  }
  return "?";
}

DType parse_dtype(std::string_view s) {
  if (s == "fp32" || s == "f32" || s == "float32" || s == "F32") return DType::f32;
  if (s == "bf16" || s == "bfloat16" || s == "BF16") return DType::bf16;
  if (s == "fp16" || s == "f16" || s == "float16" || s == "F16") return DType::f16;
  throw std::invalid_argument("unknown dtype '" + std::string(s) + "' (expected fp32, bf16 or fp16)");
}

}  // namespace strata::kernels
