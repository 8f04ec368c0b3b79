// bf16/fp16 conversions, exhaustively over all 65,536 bit patterns, against independent
// references: the F16C hardware conversion for fp16 and exact-midpoint arithmetic for bf16.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstdint>

#include "kernels/dtype.h"

using namespace strata::kernels;

namespace {
bool is_nan_bits16_bf16(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu); }
bool is_nan_bits16_f16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu); }

__attribute__((target("f16c"))) uint16_t hw_f32_to_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
}  // namespace

TEST(DType, Bf16RoundTripAllPatterns) {
  for (uint32_t i = 0; i < 65536; ++i) {
    uint16_t h = static_cast<uint16_t>(i);
    float f = bf16_to_f32(h);
    uint16_t back = f32_to_bf16(f);
    if (is_nan_bits16_bf16(h)) {
      EXPECT_TRUE(std::isnan(f)) << i;
      EXPECT_TRUE(is_nan_bits16_bf16(back)) << i;
      EXPECT_EQ(back & 0x8000u, h & 0x8000u) << "NaN sign kept " << i;
    } else {
      ASSERT_EQ(back, h) << "pattern " << i;
    }
  }
}

TEST(DType, Bf16RoundsToNearestEvenAtEveryMidpoint) {
  // For each finite bf16 value h (not the largest), the float halfway to h+1 must round to the
  // even one of the two; just above halfway rounds up, just below rounds down.
  for (uint32_t i = 0; i < 65536; ++i) {
    uint16_t h = static_cast<uint16_t>(i);
    if ((h & 0x7f80u) == 0x7f80u || (h & 0x7fffu) == 0x7f7fu) continue;  // Inf/NaN or max finite
    uint32_t lo = static_cast<uint32_t>(h) << 16;
    uint32_t mid = lo + 0x8000u;
    uint16_t even = (h & 1u) ? static_cast<uint16_t>(h + 1) : h;
    ASSERT_EQ(f32_to_bf16(std::bit_cast<float>(mid)), even) << i;
    ASSERT_EQ(f32_to_bf16(std::bit_cast<float>(mid + 1)), static_cast<uint16_t>(h + 1)) << i;
    ASSERT_EQ(f32_to_bf16(std::bit_cast<float>(mid - 1)), h) << i;
  }
  EXPECT_EQ(f32_to_bf16(INFINITY), 0x7f80u);
  EXPECT_EQ(f32_to_bf16(-INFINITY), 0xff80u);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x7f7fffffu)), 0x7f80u);  // FLT_MAX rounds to Inf
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  // A signalling NaN whose payload lives only in the low bits must stay NaN, not become Inf.
  EXPECT_TRUE(is_nan_bits16_bf16(f32_to_bf16(std::bit_cast<float>(0x7f800001u))));
}

TEST(DType, F16MatchesHardwareForAllPatterns) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU has no F16C to compare against";
  for (uint32_t i = 0; i < 65536; ++i) {
    uint16_t h = static_cast<uint16_t>(i);
    float ours = f16_to_f32(h), hw = hw_f16_to_f32(h);
    if (is_nan_bits16_f16(h)) {
      EXPECT_TRUE(std::isnan(ours)) << i;
      EXPECT_TRUE(is_nan_bits16_f16(f32_to_f16(ours))) << i;
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(ours), std::bit_cast<uint32_t>(hw)) << "f16->f32 pattern " << i;
    ASSERT_EQ(f32_to_f16(ours), h) << "round trip " << i;
  }
}

TEST(DType, F16RoundingMatchesHardwareAroundEveryPattern) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU has no F16C to compare against";
  // Around every fp16 value: the value, the midpoints to its neighbours, and one ulp (fp32) on
  // either side of those midpoints; also every fp32 in the subnormal/underflow range's edges.
  for (uint32_t i = 0; i < 65536; ++i) {
    uint16_t h = static_cast<uint16_t>(i);
    if ((h & 0x7c00u) == 0x7c00u) continue;
    float a = f16_to_f32(h);
    float b = f16_to_f32(static_cast<uint16_t>(h + 1));
    if ((static_cast<uint16_t>(h + 1) & 0x7c00u) == 0x7c00u && (static_cast<uint16_t>(h + 1) & 0x3ffu)) continue;
    float mid = static_cast<float>((static_cast<double>(a) + static_cast<double>(b)) / 2);
    uint32_t mb = std::bit_cast<uint32_t>(mid);
    for (uint32_t u : {mb - 1, mb, mb + 1, std::bit_cast<uint32_t>(a)}) {
      float f = std::bit_cast<float>(u);
      ASSERT_EQ(f32_to_f16(f), hw_f32_to_f16(f)) << "f32 bits " << std::hex << u;
    }
  }
  for (uint32_t e = 0; e < 0x48000000u; e += 0x00012345u) {  // a sweep over small magnitudes
    float f = std::bit_cast<float>(e);
    ASSERT_EQ(f32_to_f16(f), hw_f32_to_f16(f)) << std::hex << e;
    ASSERT_EQ(f32_to_f16(-f), hw_f32_to_f16(-f)) << std::hex << e;
  }
  EXPECT_EQ(f32_to_f16(65520.f), 0x7c00u);  // rounds to Inf
  EXPECT_EQ(f32_to_f16(65519.f), 0x7bffu);
  EXPECT_EQ(f32_to_f16(INFINITY), 0x7c00u);
}

TEST(DType, NamesAndParsing) {
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("fp32"), DType::f32);
  EXPECT_EQ(parse_dtype("float16"), DType::f16);
  EXPECT_EQ(dtype_name(DType::bf16), "bf16");
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_THROW(parse_dtype("int8"), std::invalid_argument);
}
