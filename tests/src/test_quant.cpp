// quant.h against a reference written here from the definitions (bitsandbytes' NF4 with double
// quantization, int8 per row): a linear scan for the nearest level in float64 with bitsandbytes'
// rule at midpoints, where quant.cpp runs a branch-free decision tree and a binary search. Bytes
// and decoded values must agree bit for bit, on normal and heavy-tailed weights, fp32 and bf16,
// sizes on and off the 64/256 block grid; row slices decode as the whole; and fixed hashes from a
// Python port of bitsandbytes' CUDA kernels (tests/src/fixtures/bnb_nf4_port.py).
//
// The reference computes in float64 and rounds to fp32 wherever bitsandbytes' fp32 arithmetic
// rounds: a product of two fp32 values is exact in float64, a quotient's double rounding is
// harmless, and the sums here are of values close enough in magnitude to be exact too.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"
#include "kernels/dtype.h"
#include "src/model/quant.h"

namespace strata {
namespace {

using kernels::DType;

float f32(double x) { return static_cast<float>(x); }

// ---- reference --------------------------------------------------------------------------------

// dQuantizeNF4's thresholds as csrc/kernels.cu writes them: the midpoints of neighbouring levels
// as decimal float literals, which the compiler rounds to fp32 (four of them up, toward the upper
// level: -0.61, -0.34, -0.23, 0.12).
constexpr float kTreeLiterals[15] = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
    0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};

// The nearest NF4 level; a tie goes to the lower one, and so does x on a literal that rounded up
// (nearer the upper level, but bitsandbytes goes up only for x > t).
int ref_nf4_code(float x) {
  const auto& lv = nf4_levels();
  int best = 0;
  for (int k = 1; k < 16; ++k)
    if (std::abs(double{x} - lv[k]) < std::abs(double{x} - lv[best])) best = k;
  if (best > 0 && x == kTreeLiterals[best - 1]) --best;
  return best;
}

// The dynamic map's code: with map[j] < x <= map[j+1], the side of their fp32 midpoint; on the
// midpoint the even index (bitsandbytes' binary search always stops on an even index, and a tie
// keeps it).
int ref_dynamic_code(float x) {
  const auto& map = dynamic_map_signed();
  if (x <= map[0]) return 0;
  if (x >= map[255]) return 255;
  int j = 0;
  while (!(x <= map[j + 1])) ++j;
  if (x == map[j + 1]) return j + 1;
  const float mid = f32((double{map[j]} + map[j + 1]) / 2);
  if (x != mid) return x > mid ? j + 1 : j;
  return j % 2 == 0 ? j : j + 1;
}

struct RefQuant {
  std::vector<uint8_t> bytes;  // laid out as quant_layout says
  std::vector<float> values;   // the decoded matrix, fp32
};

RefQuant ref_nf4(const std::vector<float>& w, int64_t rows, int64_t cols) {
  const QuantLayout l = quant_layout(QuantKind::nf4, rows, cols);
  const auto n = static_cast<size_t>(rows * cols), nb = static_cast<size_t>(l.n_blocks);
  std::vector<int> code(n);
  std::vector<float> absmax(nb);
  for (size_t b = 0; b < nb; ++b) {
    const size_t e0 = 64 * b, e1 = std::min(n, e0 + 64);
    float a = 0;
    for (size_t e = e0; e < e1; ++e) a = std::max(a, std::abs(w[e]));
    absmax[b] = a;
    const float inv = a == 0 ? 0.0f : f32(1.0 / a);
    for (size_t e = e0; e < e1; ++e) code[e] = a == 0 ? 7 : ref_nf4_code(f32(double{w[e]} * inv));
  }
  double sum = 0;
  for (float a : absmax) sum += a;
  const float offset = f32(sum / static_cast<double>(nb));
  std::vector<int> q8(nb);
  std::vector<float> absmax2(static_cast<size_t>(l.n_absmax_blocks));
  for (size_t g = 0; g < absmax2.size(); ++g) {
    const size_t b0 = 256 * g, b1 = std::min(nb, b0 + 256);
    float a2 = 0;
    for (size_t b = b0; b < b1; ++b) a2 = std::max(a2, std::abs(f32(double{absmax[b]} - offset)));
    absmax2[g] = a2;
    for (size_t b = b0; b < b1; ++b)
      q8[b] = a2 == 0 ? 127 : ref_dynamic_code(f32(double{f32(double{absmax[b]} - offset)} * f32(1.0 / a2)));
  }
  RefQuant r;
  r.bytes.assign(l.total_bytes, 0);
  for (size_t i = 0; i < (n + 1) / 2; ++i)
    r.bytes[i] = static_cast<uint8_t>((code[2 * i] << 4) | (2 * i + 1 < n ? code[2 * i + 1] : 7));
  for (size_t b = 0; b < nb; ++b) r.bytes[l.absmax_codes_offset + b] = static_cast<uint8_t>(q8[b]);
  std::memcpy(r.bytes.data() + l.scales_offset, &offset, 4);
  std::memcpy(r.bytes.data() + l.scales_offset + 4, absmax2.data(), 4 * absmax2.size());
  r.values.resize(n);
  for (size_t e = 0; e < n; ++e) {
    const size_t b = e / 64;
    const float a = f32(double{f32(double{dynamic_map_signed()[static_cast<size_t>(q8[b])]} * absmax2[b / 256])} + offset);
    r.values[e] = f32(double{nf4_levels()[static_cast<size_t>(code[e])]} * a);
  }
  return r;
}

RefQuant ref_int8(const std::vector<float>& w, int64_t rows, int64_t cols) {
  const QuantLayout l = quant_layout(QuantKind::int8, rows, cols);
  RefQuant r;
  r.bytes.assign(l.total_bytes, 0);
  r.values.resize(w.size());
  for (int64_t i = 0; i < rows; ++i) {
    const auto row = static_cast<size_t>(i * cols);
    float a = 0;
    for (int64_t j = 0; j < cols; ++j) a = std::max(a, std::abs(w[row + static_cast<size_t>(j)]));
    const float scale = f32(double{a} / 127);
    std::memcpy(r.bytes.data() + l.scales_offset + 4 * static_cast<size_t>(i), &scale, 4);
    for (int64_t j = 0; j < cols; ++j) {
      const size_t e = row + static_cast<size_t>(j);
      const int q = scale == 0 ? 0 : static_cast<int>(std::clamp(std::nearbyint(double{f32(double{w[e]} / scale)}), -127.0, 127.0));
      r.bytes[e] = static_cast<uint8_t>(static_cast<int8_t>(q));
      r.values[e] = f32(q * double{scale});
    }
  }
  return r;
}

// ---- weights ----------------------------------------------------------------------------------

std::vector<float> normal_weights(int64_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0.0, 0.02);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& x : w) x = f32(d(g));
  return w;
}

// Student-t with 3 degrees of freedom, a few huge outliers, and an all-zero block and row.
std::vector<float> heavy_weights(int64_t n, int64_t cols, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::student_t_distribution<double> t(3.0);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& x : w) x = f32(0.02 * t(g));
  std::uniform_int_distribution<int64_t> pos(0, n - 1);
  for (double big : {1e4, -3e3, 750.0, -64.0}) w[static_cast<size_t>(pos(g))] = f32(big);
  if (n >= 192) std::fill(w.begin() + 64, w.begin() + 128, 0.0f);
  if (n >= 4 * cols) std::fill(w.begin() + 2 * cols, w.begin() + 3 * cols, 0.0f);
  return w;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& w) {
  std::vector<uint16_t> h(w.size());
  for (size_t i = 0; i < w.size(); ++i) h[i] = kernels::f32_to_bf16(w[i]);
  return h;
}
std::vector<float> from_bf16(const std::vector<uint16_t>& h) {
  std::vector<float> w(h.size());
  for (size_t i = 0; i < h.size(); ++i) w[i] = kernels::bf16_to_f32(h[i]);
  return w;
}

struct Shape {
  int64_t rows, cols;
};
// On and off the grid: one element, one short block, exact blocks, < 256 blocks, 300 blocks (a
// short second absmax group), odd element counts, 4 full absmax groups.
const Shape kShapes[] = {{1, 1}, {3, 5}, {2, 32}, {7, 64}, {64, 64}, {300, 64}, {33, 257}, {130, 257}, {512, 128}};

std::vector<float> decode(const QuantizedTensor& q, DType out) {
  const auto n = static_cast<size_t>(q.rows * q.cols);
  std::vector<float> v(n);
  if (out == DType::f32) {
    q.dequantize_rows(0, q.rows, v.data(), out);
    return v;
  }
  std::vector<uint16_t> h(n);
  q.dequantize_rows(0, q.rows, h.data(), out);
  for (size_t i = 0; i < n; ++i) v[i] = out == DType::bf16 ? kernels::bf16_to_f32(h[i]) : kernels::f16_to_f32(h[i]);
  return v;
}

std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<uint32_t>(v[i]);
  return b;
}

// Quantizes w (given as fp32 values; as bf16 bits when `bf16`) and checks bytes and decodes.
void expect_matches_reference(QuantKind kind, const std::vector<float>& w32, Shape s, bool bf16) {
  SCOPED_TRACE(std::string(quant_kind_name(kind)) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
               (bf16 ? " bf16" : " fp32"));
  const std::vector<uint16_t> h = to_bf16(w32);
  const std::vector<float> w = bf16 ? from_bf16(h) : w32;
  const QuantizedTensor q = bf16 ? QuantizedTensor::make(kind, h.data(), DType::bf16, s.rows, s.cols)
                                 : QuantizedTensor::make(kind, w.data(), DType::f32, s.rows, s.cols);
  const RefQuant r = kind == QuantKind::nf4 ? ref_nf4(w, s.rows, s.cols) : ref_int8(w, s.rows, s.cols);
  ASSERT_EQ(q.bytes.size(), bytes_for(kind, s.rows, s.cols));
  EXPECT_EQ(q.bytes, r.bytes);
  EXPECT_EQ(bits_of(decode(q, DType::f32)), bits_of(r.values));
  std::vector<float> r_bf16(r.values.size());
  for (size_t i = 0; i < r.values.size(); ++i) r_bf16[i] = kernels::bf16_to_f32(kernels::f32_to_bf16(r.values[i]));
  EXPECT_EQ(bits_of(decode(q, DType::bf16)), bits_of(r_bf16));
  std::vector<float> r_f16(r.values.size());
  for (size_t i = 0; i < r.values.size(); ++i) r_f16[i] = kernels::f16_to_f32(kernels::f32_to_f16(r.values[i]));
  EXPECT_EQ(bits_of(decode(q, DType::f16)), bits_of(r_f16));
}

// ---- tests ------------------------------------------------------------------------------------

TEST(Quant, KindNamesParseAndPrint) {
  for (QuantKind k : {QuantKind::bf16, QuantKind::fp16, QuantKind::int8, QuantKind::nf4})
    EXPECT_EQ(parse_quant_kind(quant_kind_name(k)), k);
  EXPECT_EQ(parse_quant_kind("f16"), QuantKind::fp16);
}

TEST(Quant, MalformedArgumentsThrowNamingTheThing) {
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "(no std::invalid_argument)";
  };
  EXPECT_NE(message([] { parse_quant_kind("nf5"); }).find("'nf5'"), std::string::npos);
  EXPECT_NE(message([] { parse_quant_kind(""); }).find("quantization kind"), std::string::npos);
  std::vector<float> w(64, 1.0f);
  std::vector<uint8_t> q(bytes_for(QuantKind::nf4, 4, 16));
  EXPECT_NE(message([&] { quantize(QuantKind::nf4, w.data(), DType::f32, 0, 16, q.data()); }).find("rows 0"),
            std::string::npos);
  EXPECT_NE(message([&] { quantize(QuantKind::int8, w.data(), DType::f32, 4, -1, q.data()); }).find("cols -1"),
            std::string::npos);
  EXPECT_NE(message([] { bytes_for(QuantKind::int8, 0, 0); }).find("rows"), std::string::npos);
  EXPECT_NE(message([&] { quantize(QuantKind::nf4, nullptr, DType::f32, 4, 16, q.data()); }).find("src"),
            std::string::npos);
  quantize(QuantKind::nf4, w.data(), DType::f32, 4, 16, q.data());
  std::vector<float> out(64);
  for (auto [lo, hi] : {std::pair{0, 5}, std::pair{-1, 2}, std::pair{2, 2}, std::pair{3, 1}})
    EXPECT_NE(message([&] { dequantize_rows(QuantKind::nf4, q.data(), 4, 16, lo, hi, out.data(), DType::f32); })
                  .find("row range [" + std::to_string(lo) + ", " + std::to_string(hi) + ")"),
              std::string::npos);
}

TEST(Quant, LayoutIsCodesThenScalesInOneBuffer) {
  const int64_t rows = 4096, cols = 14336, n = rows * cols;
  const QuantLayout nf4 = quant_layout(QuantKind::nf4, rows, cols);
  EXPECT_EQ(nf4.codes_bytes, static_cast<size_t>(n / 2));
  EXPECT_EQ(nf4.n_blocks, n / 64);
  EXPECT_EQ(nf4.n_absmax_blocks, n / 64 / 256);
  EXPECT_EQ(nf4.absmax_codes_offset, nf4.codes_bytes);
  EXPECT_EQ(nf4.scales_offset, nf4.absmax_codes_offset + static_cast<size_t>(n / 64));
  EXPECT_EQ(nf4.total_bytes, nf4.scales_offset + 4 + 4 * static_cast<size_t>(n / 64 / 256));
  // 4.127 bits per weight: QLoRA's 4 + 8/64 + 32/(64*256).
  EXPECT_NEAR(8.0 * static_cast<double>(nf4.total_bytes) / static_cast<double>(n), 4.127, 1e-3);
  const QuantLayout i8 = quant_layout(QuantKind::int8, 3, 5);
  EXPECT_EQ(i8.codes_bytes, 15u);
  EXPECT_EQ(i8.scales_offset, 16u);
  EXPECT_EQ(i8.total_bytes, 28u);
  EXPECT_EQ(bytes_for(QuantKind::bf16, 3, 5), 30u);
  EXPECT_EQ(bytes_for(QuantKind::fp16, 3, 5), 30u);
  const QuantLayout odd = quant_layout(QuantKind::nf4, 3, 5);  // 15 values: 8 code bytes, 1 block
  EXPECT_EQ(odd.codes_bytes, 8u);
  EXPECT_EQ(odd.absmax_codes_offset, 16u);
  EXPECT_EQ(odd.scales_offset, 32u);
  EXPECT_EQ(odd.total_bytes, 40u);
}

// create_dynamic_map(signed=True) as bitsandbytes' formula gives it in fp32 with torch's scalar
// linspace: the hash is of the 256 fp32 values from the Python port (fixtures/bnb_nf4_port.py,
// whose fp32 arithmetic after linspace matches torch's on every CPU capability).
TEST(Quant, DynamicMapIsBitsandbytesSignedMap) {
  const auto& map = dynamic_map_signed();
  EXPECT_TRUE(std::is_sorted(map.begin(), map.end()));
  EXPECT_EQ(std::adjacent_find(map.begin(), map.end()), map.end());
  EXPECT_EQ(map[127], 0.0f);
  EXPECT_EQ(map[255], 1.0f);
  EXPECT_EQ(std::bit_cast<uint32_t>(map[0]), 0xbf7e3333u);  // -(0.99296875) in fp32
  // Each entry is 10^(i-6) times the midpoint of linspace(0.1, 1, 2^i + 1), within about 2 ulp.
  std::vector<double> exact{0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int steps = (1 << i) + 1;
    for (int k = 0; k + 1 < steps; ++k) {
      const double mid = 0.1 + 0.9 * (k + 0.5) / (steps - 1);
      exact.push_back(std::pow(10.0, i - 6) * mid);
      exact.push_back(-std::pow(10.0, i - 6) * mid);
    }
  }
  std::sort(exact.begin(), exact.end());
  ASSERT_EQ(exact.size(), 256u);
  for (size_t i = 0; i < 256; ++i) EXPECT_LE(std::abs(map[i] - exact[i]), 4 * std::abs(exact[i]) * 0x1p-24) << i;
  uint64_t h = 0xcbf29ce484222325ull;
  for (float v : map)
    for (int b = 0; b < 4; ++b) h = (h ^ ((std::bit_cast<uint32_t>(v) >> (8 * b)) & 0xffu)) * 0x100000001b3ull;
  EXPECT_EQ(h, 0x619efdf6517c4850ull);
}

// Every NF4 threshold and the fp32 values either side of it, and every level, through a block
// whose absmax is 1 (so x is the weight itself): the tree and the reference agree, and a value on
// a threshold goes to the lower level, even where it is nearer the upper one.
TEST(Quant, Nf4DecisionsAtEveryThreshold) {
  const auto& lv = nf4_levels();
  std::vector<float> w{1.0f};
  std::vector<int> want{15};
  int nearer_upper = 0;
  for (int k = 0; k < 15; ++k) {
    const float t = kTreeLiterals[k];
    EXPECT_LE(std::abs(double{t} - (double{lv[k]} + lv[k + 1]) / 2), std::abs(double{t}) * 0x1p-24);  // half an ulp
    nearer_upper += double{lv[k + 1]} - t < double{t} - lv[k];
    for (float x : {std::nextafter(t, -2.0f), t, std::nextafter(t, 2.0f)}) {
      w.push_back(x);
      want.push_back(x > t ? k + 1 : k);
      EXPECT_EQ(nf4_code(x), want.back()) << "x = " << x;
      EXPECT_EQ(ref_nf4_code(x), want.back()) << "x = " << x;
    }
    w.push_back(lv[k]);
    want.push_back(k);
  }
  EXPECT_EQ(nearer_upper, 4);
  ASSERT_EQ(w.size(), 61u);
  const QuantizedTensor q = QuantizedTensor::make(QuantKind::nf4, w.data(), DType::f32, 1, 61);
  for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ((q.bytes[i / 2] >> (i % 2 ? 0 : 4)) & 15, want[i]) << i;
  EXPECT_EQ(q.bytes[30] & 15, 7);  // 61 values: the last low nibble pads with 0.0's code
}

TEST(Quant, DynamicDecisionsAtEveryMidpoint) {
  const auto& map = dynamic_map_signed();
  for (int j = 0; j < 255; ++j) {
    const float mid = (map[static_cast<size_t>(j)] + map[static_cast<size_t>(j) + 1]) * 0.5f;
    for (float x : {map[static_cast<size_t>(j)], std::nextafter(mid, -2.0f), mid, std::nextafter(mid, 2.0f)}) {
      EXPECT_EQ(dynamic_code(x), ref_dynamic_code(x)) << "j " << j << " x " << x;
    }
    EXPECT_EQ(dynamic_code(mid), j % 2 == 0 ? j : j + 1) << j;
  }
  for (float x : {-2.0f, -1.0f, 0.0f, 1.0f, 2.0f}) EXPECT_EQ(dynamic_code(x), ref_dynamic_code(x)) << x;
  std::mt19937_64 g(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = u(g) * std::pow(10.0f, -static_cast<float>(i % 7));
    ASSERT_EQ(dynamic_code(x), ref_dynamic_code(x)) << x;
  }
}

void expect_matches_reference_on_every_shape(QuantKind kind, uint64_t seed) {
  for (const Shape& s : kShapes)
    for (bool bf16 : {false, true}) {
      expect_matches_reference(kind, normal_weights(s.rows * s.cols, seed++), s, bf16);
      expect_matches_reference(kind, heavy_weights(s.rows * s.cols, s.cols, seed++), s, bf16);
    }
}

TEST(Quant, Nf4MatchesReferenceOnNormalAndHeavyTailedWeights) { expect_matches_reference_on_every_shape(QuantKind::nf4, 1); }

TEST(Quant, Int8MatchesReferenceOnNormalAndHeavyTailedWeights) {
  expect_matches_reference_on_every_shape(QuantKind::int8, 100);
}

TEST(Quant, Int8RoundsHalfToEvenAndZeroRowsStayZero) {
  // absmax 127: scale 1, so q is w rounded.
  const std::vector<float> w{127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -126.5f, 3.49f, 0, 0, 0, 0, 0, 0, 0, 0};
  const QuantizedTensor q = QuantizedTensor::make(QuantKind::int8, w.data(), DType::f32, 2, 8);
  const std::vector<int8_t> want{127, 0, 2, 2, 0, -2, -126, 3, 0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(static_cast<int8_t>(q.bytes[i]), want[i]) << i;
  float scales[2];
  std::memcpy(scales, q.bytes.data() + q.layout().scales_offset, sizeof scales);
  EXPECT_EQ(scales[0], 1.0f);
  EXPECT_EQ(scales[1], 0.0f);
}

TEST(Quant, Bf16AndFp16KindsRoundToNearestEven) {
  const std::vector<float> w = heavy_weights(33 * 257, 257, 9);
  for (QuantKind kind : {QuantKind::bf16, QuantKind::fp16}) {
    const QuantizedTensor q = QuantizedTensor::make(kind, w.data(), DType::f32, 33, 257);
    const std::vector<float> got = decode(q, DType::f32);
    for (size_t i = 0; i < w.size(); ++i) {
      const float want = kind == QuantKind::bf16 ? kernels::bf16_to_f32(kernels::f32_to_bf16(w[i]))
                                                 : kernels::f16_to_f32(kernels::f32_to_f16(w[i]));
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want)) << i;
    }
  }
}

// Any rows [lo, hi) decode to the bits of the same rows of the whole, in every output dtype.
TEST(Quant, RowSlicesDecodeAsTheWhole) {
  const Shape shapes[] = {{130, 257}, {33, 257}, {7, 3}, {300, 64}};
  for (const Shape& s : shapes) {
    const std::vector<float> w = heavy_weights(s.rows * s.cols, s.cols, 5);
    for (QuantKind kind : {QuantKind::bf16, QuantKind::fp16, QuantKind::int8, QuantKind::nf4}) {
      const QuantizedTensor q = QuantizedTensor::make(kind, w.data(), DType::f32, s.rows, s.cols);
      for (DType out : {DType::f32, DType::bf16, DType::f16}) {
        const size_t es = kernels::dtype_size(out), row_bytes = static_cast<size_t>(s.cols) * es;
        std::vector<uint8_t> whole(static_cast<size_t>(s.rows) * row_bytes);
        q.dequantize_rows(0, s.rows, whole.data(), out);
        const std::pair<int64_t, int64_t> ranges[] = {{0, 1},           {1, 2},   {1, s.rows}, {s.rows / 2, s.rows / 2 + 3},
                                                      {s.rows - 1, s.rows}, {3, s.rows - 1}};
        for (auto [lo, hi] : ranges) {
          if (hi > s.rows || lo >= hi) continue;
          std::vector<uint8_t> part(static_cast<size_t>(hi - lo) * row_bytes);
          q.dequantize_rows(lo, hi, part.data(), out);
          EXPECT_EQ(0, std::memcmp(part.data(), whole.data() + static_cast<size_t>(lo) * row_bytes, part.size()))
              << quant_kind_name(kind) << " " << s.rows << "x" << s.cols << " rows [" << lo << ", " << hi << ") "
              << kernels::dtype_name(out);
        }
      }
    }
  }
}

// The decode's AVX-512 path (NF4: the levels as a permute table) and its portable one write the
// same bytes, for whole matrices and row slices cut through blocks; and the op set's dequantize,
// enqueued on a CPU stream, is dequantize_rows.
TEST(Quant, DecodePathsAndTheOpAgree) {
  auto rt = kernels::cpu::make_cpu_runtime();
  auto stream = rt->create_stream();
  for (const Shape s : {Shape{130, 257}, Shape{33, 64}, Shape{7, 3}}) {
    const std::vector<float> w = heavy_weights(s.rows * s.cols, s.cols, 11);
    for (QuantKind kind : {QuantKind::bf16, QuantKind::fp16, QuantKind::int8, QuantKind::nf4}) {
      const QuantizedTensor q = QuantizedTensor::make(kind, w.data(), DType::f32, s.rows, s.cols);
      for (DType out : {DType::f32, DType::bf16, DType::f16}) {
        const size_t bytes = static_cast<size_t>(s.rows * s.cols) * kernels::dtype_size(out);
        std::vector<uint8_t> vec(bytes), portable(bytes), op(bytes, 0xAB);
        const int64_t lo = s.rows / 3, hi = s.rows - s.rows / 4;
        q.dequantize_rows(lo, hi, vec.data(), out);
        kernels::cpu::set_avx512_enabled(false);
        q.dequantize_rows(lo, hi, portable.data(), out);
        kernels::cpu::set_avx512_enabled(true);
        EXPECT_EQ(vec, portable) << quant_kind_name(kind) << " " << s.rows << "x" << s.cols << " " << kernels::dtype_name(out);
        std::vector<uint8_t> whole(bytes);
        q.dequantize_rows(0, s.rows, whole.data(), out);
        rt->ops().dequantize(*stream, dequantize_args(kind, q.bytes.data(), s.rows, s.cols, op.data(), out));
        stream->synchronize();
        EXPECT_EQ(op, whole) << quant_kind_name(kind) << " " << kernels::dtype_name(out) << ": Ops::dequantize";
      }
    }
  }
}

TEST(Quant, SameBytesOnOneThreadAndMany) {
  const std::vector<float> w = normal_weights(512 * 1000, 3);
  const int threads = kernels::cpu::num_threads();
  kernels::cpu::set_num_threads(1);
  const QuantizedTensor one = QuantizedTensor::make(QuantKind::nf4, w.data(), DType::f32, 512, 1000);
  kernels::cpu::set_num_threads(threads);
  const QuantizedTensor many = QuantizedTensor::make(QuantKind::nf4, w.data(), DType::f32, 512, 1000);
  EXPECT_EQ(one.bytes, many.bytes);
}

// ---- fixture from a Python port of bitsandbytes ----------------------------------------------
// The port (fixtures/bnb_nf4_port.py) follows csrc/kernels.cu's
// kQuantizeBlockwise / dQuantizeNF4 / dQuantize<0> line by line on fp32 values and
// functional.py's quantize_4bit(compress_statistics=True) and create_dynamic_map; the hashes are
// FNV-1a 64 of its outputs. The input is exactly representable, the same in both languages.

uint64_t fnv1a(const void* p, size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 0x100000001b3ull;
  return h;
}

uint64_t splitmix64(uint64_t i) {
  uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform 24-bit values times 0.05, every 97th times 64, elements [128, 192) zero.
std::vector<float> fixture_weights(int64_t n) {
  std::vector<float> w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto u = static_cast<int32_t>(splitmix64(static_cast<uint64_t>(i)) >> 40);
    float x = (static_cast<float>(u - (1 << 23)) * 0x1p-23f) * 0.05f;
    if (i % 97 == 0) x *= 64.0f;
    if (i >= 128 && i < 192) x = 0.0f;
    w[static_cast<size_t>(i)] = x;
  }
  return w;
}

struct PortHashes {
  Shape shape;
  bool bf16;
  uint64_t codes, q8, absmax2;
  uint32_t offset;
  uint64_t values, values_bf16;
};

TEST(Quant, Nf4MatchesBitsandbytesPythonPort) {
  const PortHashes cases[] = {
      {{3, 6000}, false, 0xd3fc63b64447e293ull, 0x94fabed90550ead9ull, 0xc43fa226b7b4e5fcull, 0x3f88f0a1u,
       0xaece9fa7b99efb86ull, 0x278030d2190d9906ull},
      {{3, 6000}, true, 0x450d674c0eaea86cull, 0x17f73cec11e8a658ull, 0xb972e4338b765851ull, 0x3f88f450u,
       0x8b1cd57a1843ee35ull, 0x90397e3115486907ull},
      {{5, 4001}, false, 0x45f21e1636b7fca7ull, 0xdf4c18565dc991dcull, 0x88743df727411acbull, 0x3f8959f8u,
       0x52728ada7859568aull, 0x70d54198bce98d09ull},
      {{5, 4001}, true, 0x10376bd2d0e8037full, 0x7e828bb46678345full, 0x3135b55765ec3922ull, 0x3f895e02u,
       0x2275afd54d0185c4ull, 0x235e73f4d2cc9476ull},
  };
  for (const PortHashes& c : cases) {
    SCOPED_TRACE(std::to_string(c.shape.rows) + "x" + std::to_string(c.shape.cols) + (c.bf16 ? " bf16" : " fp32"));
    const std::vector<float> w = fixture_weights(c.shape.rows * c.shape.cols);
    const std::vector<uint16_t> h = to_bf16(w);
    const QuantizedTensor q = c.bf16 ? QuantizedTensor::make(QuantKind::nf4, h.data(), DType::bf16, c.shape.rows, c.shape.cols)
                                     : QuantizedTensor::make(QuantKind::nf4, w.data(), DType::f32, c.shape.rows, c.shape.cols);
    const QuantLayout l = q.layout();
    EXPECT_EQ(fnv1a(q.bytes.data(), l.codes_bytes), c.codes);
    EXPECT_EQ(fnv1a(q.bytes.data() + l.absmax_codes_offset, static_cast<size_t>(l.n_blocks)), c.q8);
    EXPECT_EQ(fnv1a(q.bytes.data() + l.scales_offset + 4, 4 * static_cast<size_t>(l.n_absmax_blocks)), c.absmax2);
    uint32_t offset;
    std::memcpy(&offset, q.bytes.data() + l.scales_offset, 4);
    EXPECT_EQ(offset, c.offset);
    const std::vector<float> v = decode(q, DType::f32);
    EXPECT_EQ(fnv1a(v.data(), 4 * v.size()), c.values);
    std::vector<uint16_t> vb(v.size());
    q.dequantize_rows(0, q.rows, vb.data(), DType::bf16);
    EXPECT_EQ(fnv1a(vb.data(), 2 * vb.size()), c.values_bf16);
  }
}

TEST(Quant, Int8MatchesPythonPort) {
  const std::vector<float> w = fixture_weights(5 * 4001);
  const QuantizedTensor q = QuantizedTensor::make(QuantKind::int8, w.data(), DType::f32, 5, 4001);
  const QuantLayout l = q.layout();
  EXPECT_EQ(fnv1a(q.bytes.data(), l.codes_bytes), 0x1995bfc4851b6e09ull);
  EXPECT_EQ(fnv1a(q.bytes.data() + l.scales_offset, 4 * 5), 0x79aa04243df74ee4ull);
  const std::vector<float> v = decode(q, DType::f32);
  EXPECT_EQ(fnv1a(v.data(), 4 * v.size()), 0xe6e64520a27cababull);
}

}  // namespace
}  // namespace strata
