// Element types and their conversions. bf16/fp16 <-> fp32 round to nearest even and keep
// NaN (quietened) and Inf; these scalar conversions are the reference the vector paths match.
#pragma once
#include <bit>
#include <cstdint>
#include <cstddef>
#include <string>
#include <string_view>

namespace strata::kernels {

enum class DType : uint8_t { f32, bf16, f16 };

constexpr size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }
std::string_view dtype_name(DType t);
// Parses "fp32"/"f32"/"float32", "bf16"/"bfloat16", "fp16"/"f16"/"float16"; throws naming the text.
DType parse_dtype(std::string_view text);

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}
inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_f16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (after rounding) or Inf
  if (abs < 0x38800000u) {  // result is subnormal or zero: shift the implicit-1 mantissa, round to even
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exp;  // 14..24
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round mantissa to 10 bits, ties to even
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { mant <<= 1; ++e; } while ((mant & 0x400u) == 0);
    u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(u);
}

// Load/store one element of any dtype as float (used by scalar and reference paths).
inline float load_as_f32(const void* p, DType t, size_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.f;
}
inline void store_from_f32(void* p, DType t, size_t i, float x) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = x; break;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(x); break;
    case DType::f16: static_cast<uint16_t*>(p)[i] = f32_to_f16(x); break;
  }
}

}  // namespace strata::kernels
