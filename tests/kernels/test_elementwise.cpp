// Elementwise CPU ops (bias add, SwiGLU, GELU, add) against float64 references, their
// backwards against float64 central finite differences of L = Σ w·y, in fp32, bf16 and fp16;
// plus one op through the Ops interface on a CPU stream.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <cmath>
#include <random>
#include <stdexcept>

#include "kernels/counter_rng.h"
#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/runtime.h"
#include "layer_test_util.h"

using namespace strata::kernels;
using namespace strata::kernels::test;

namespace {

struct Shape {
  int64_t rows, cols;
};
const Shape kShapes[] = {{1, 1}, {3, 3}, {2, 17}, {5, 129}, {33, 64}};

// Tolerances: fp32 math vs float64, or rounding of the stored result for 16-bit types.
double rtol_for(DType t) { return t == DType::f32 ? 2e-6 : (t == DType::bf16 ? 1e-2 : 2e-3); }

class ElementwiseTest : public DtypeIsaTest {};

TEST_P(ElementwiseTest, BiasAddMatchesReference) {
  const DType t = dtype();
  uint32_t seed = 1;
  for (const Shape s : kShapes) {
    TypedBuf y(t, random_vec(s.rows * s.cols, seed++)), bias(t, random_vec(s.cols, seed++));
    const auto y0 = y.values(), b = bias.values();
    cpu::bias_add({.dtype = t, .rows = s.rows, .cols = s.cols, .y = y.data(), .bias = bias.data()});
    std::vector<double> want(y0.size());
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t c = 0; c < s.cols; ++c) want[r * s.cols + c] = y0[r * s.cols + c] + b[c];
    expect_close(y.values(), want, 1e-7, rtol_for(t), "bias_add " + std::to_string(s.cols));
  }
}

TEST_P(ElementwiseTest, BiasBackwardAccumulatesFiniteDifferenceGradient) {
  const DType t = dtype();
  uint32_t seed = 10;
  for (const Shape s : kShapes) {
    // L(bias) = Σ w·(y0 + bias) so dL/dy = w; the kernel gets dy = w.
    const auto y0 = random_vec(s.rows * s.cols, seed++);
    TypedBuf w(t, random_vec(s.rows * s.cols, seed++));
    const auto wv = w.values();
    auto loss = [&](const std::vector<double>& b) {
      double l = 0;
      for (int64_t r = 0; r < s.rows; ++r)
        for (int64_t c = 0; c < s.cols; ++c) l += wv[r * s.cols + c] * (y0[r * s.cols + c] + b[c]);
      return l;
    };
    const auto fd = finite_diff(random_vec(s.cols, seed++), loss);
    std::vector<float> dbias(s.cols);
    const auto init = random_vec(s.cols, seed++);
    for (int64_t c = 0; c < s.cols; ++c) dbias[c] = static_cast<float>(init[c]);
    cpu::bias_backward({.dtype = t, .rows = s.rows, .cols = s.cols, .dy = w.data(), .dbias = dbias.data()});
    std::vector<double> got(s.cols), want(s.cols);
    for (int64_t c = 0; c < s.cols; ++c) got[c] = dbias[c], want[c] = init[c] + fd[c];
    expect_close(got, want, 1e-5 * s.rows, 1e-5, "bias_backward " + std::to_string(s.cols));
  }
}

double silu(double g) { return g / (1 + std::exp(-g)); }

TEST_P(ElementwiseTest, SwigluForwardAndBackwardInFusedBuffer) {
  const DType t = dtype();
  uint32_t seed = 20;
  for (const Shape s : kShapes) {
    const int64_t ld = 2 * s.cols;  // fused [gate | up] rows
    TypedBuf fused(t, random_vec(s.rows * ld, seed++, -4, 4));
    const auto fv = fused.values();
    auto forward = [&](const std::vector<double>& in) {  // in: (rows, 2·cols)
      std::vector<double> out(s.rows * s.cols);
      for (int64_t r = 0; r < s.rows; ++r)
        for (int64_t c = 0; c < s.cols; ++c) out[r * s.cols + c] = silu(in[r * ld + c]) * in[r * ld + s.cols + c];
      return out;
    };
    TypedBuf out(t, s.rows * s.cols);
    const char* base = static_cast<const char*>(fused.data());
    const size_t half = s.cols * dtype_size(t);
    cpu::swiglu({.dtype = t, .rows = s.rows, .cols = s.cols, .ld = ld, .gate = base, .up = base + half,
                 .out = out.data()});
    expect_close(out.values(), forward(fv), 1e-6, rtol_for(t), "swiglu " + std::to_string(s.cols));

    TypedBuf w(t, random_vec(s.rows * s.cols, seed++));
    const auto wv = w.values();
    const auto fd = finite_diff(fv, [&](const std::vector<double>& in) { return dot(wv, forward(in)); });
    TypedBuf dfused(t, s.rows * ld);
    char* dbase = static_cast<char*>(dfused.data());
    cpu::swiglu_backward({.dtype = t, .rows = s.rows, .cols = s.cols, .ld = ld, .gate = base, .up = base + half,
                          .dout = w.data(), .dgate = dbase, .dup = dbase + half});
    expect_close(dfused.values(), fd, 1e-5 + 2 * rtol_for(t) * max_abs(fd), 1e-4,
                 "swiglu_backward " + std::to_string(s.cols));
  }
}

double gelu_ref(double x, bool tanh_approx) {
  if (tanh_approx) return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
  return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
}

TEST_P(ElementwiseTest, GeluForwardAndBackwardBothForms) {
  const DType t = dtype();
  uint32_t seed = 30;
  for (bool tanh_approx : {false, true}) {
    for (int64_t n : {1, 3, 17, 129, 1000}) {
      TypedBuf x(t, random_vec(n, seed++, -5, 5));
      const auto xv = x.values();
      auto forward = [&](const std::vector<double>& in) {
        std::vector<double> y(in.size());
        for (size_t i = 0; i < in.size(); ++i) y[i] = gelu_ref(in[i], tanh_approx);
        return y;
      };
      TypedBuf y(t, n);
      cpu::gelu({.dtype = t, .n = n, .tanh_approx = tanh_approx, .x = x.data(), .y = y.data()});
      const std::string what = std::string(tanh_approx ? "gelu_tanh " : "gelu ") + std::to_string(n);
      expect_close(y.values(), forward(xv), 1e-6, rtol_for(t), what);

      TypedBuf w(t, random_vec(n, seed++));
      const auto wv = w.values();
      const auto fd = finite_diff(xv, [&](const std::vector<double>& in) { return dot(wv, forward(in)); });
      TypedBuf dx(t, random_vec(n, seed++));
      const auto dx0 = dx.values();
      // Overwrite, then accumulate on top of the result: dx = 2·grad after the second call.
      cpu::gelu_backward({.dtype = t, .n = n, .tanh_approx = tanh_approx, .x = x.data(), .dy = w.data(),
                          .dx = dx.data()});
      expect_close(dx.values(), fd, 1e-5, 2 * rtol_for(t), what + " backward");
      cpu::gelu_backward({.dtype = t, .n = n, .tanh_approx = tanh_approx, .x = x.data(), .dy = w.data(),
                          .dx = dx.data(), .accumulate = true});
      std::vector<double> twice(fd);
      for (auto& v : twice) v *= 2;
      expect_close(dx.values(), twice, 1e-5, 4 * rtol_for(t), what + " backward accumulate");
    }
  }
}

TEST_P(ElementwiseTest, AddInPlaceAndOutOfPlace) {
  const DType t = dtype();
  for (int64_t n : {1, 17, 40000}) {
    TypedBuf a(t, random_vec(n, 40)), b(t, random_vec(n, 41)), out(t, n);
    const auto av = a.values(), bv = b.values();
    std::vector<double> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = av[i] + bv[i];
    cpu::add({.dtype = t, .n = n, .a = a.data(), .b = b.data(), .out = out.data()});
    expect_close(out.values(), want, 1e-7, rtol_for(t), "add");
    cpu::add({.dtype = t, .n = n, .a = a.data(), .b = b.data(), .out = a.data()});  // out aliases a
    expect_close(a.values(), want, 1e-7, rtol_for(t), "add in place");
  }
}

// The communicators' fixed-order sum: against float64 within one rounding of the sum (the fp32
// accumulation's error is far below a 16-bit rounding), bitwise the same for every `me` (the
// sum runs in rank order whichever contribution is this rank's), and in place.
TEST_P(ElementwiseTest, RankOrderSumAddsInRankOrderWhateverTheRank) {
  const DType t = dtype();
  const int64_t n = 4099, stride = n + 5;
  for (int world : {1, 2, 3, 5}) {
    std::vector<TypedBuf> x;
    for (int r = 0; r < world; ++r) x.emplace_back(t, random_vec(n, static_cast<uint32_t>(60 + r)));
    std::vector<double> want(static_cast<size_t>(n), 0.0);
    for (int r = 0; r < world; ++r) {
      const auto v = x[static_cast<size_t>(r)].values();
      for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] += v[static_cast<size_t>(i)];
    }
    std::vector<std::vector<uint8_t>> got;
    for (int me = 0; me < world; ++me) {
      // The others' contributions in rank order, me's left out, stride elements apart.
      TypedBuf others(t, std::max<int64_t>(1, (world - 1) * stride)), out(t, n);
      const size_t es = dtype_size(t);
      for (int r = 0, k = 0; r < world; ++r)
        if (r != me)
          std::memcpy(static_cast<char*>(others.data()) + static_cast<size_t>(k++ * stride) * es,
                      x[static_cast<size_t>(r)].data(), static_cast<size_t>(n) * es);
      const RankOrderSumArgs args{.dtype = t, .n = n, .mine = x[static_cast<size_t>(me)].data(), .me = me,
                                  .world = world, .others = world > 1 ? others.data() : nullptr,
                                  .others_stride = stride, .out = out.data()};
      cpu::rank_order_sum(args);
      expect_close(out.values(), want, 1e-6, rtol_for(t), "rank_order_sum");
      got.emplace_back(static_cast<const uint8_t*>(out.data()), static_cast<const uint8_t*>(out.data()) + n * es);
      TypedBuf in_place = x[static_cast<size_t>(me)];
      RankOrderSumArgs a2 = args;
      a2.mine = a2.out = in_place.data();
      cpu::rank_order_sum(a2);
      EXPECT_EQ(std::memcmp(in_place.data(), out.data(), static_cast<size_t>(n) * es), 0) << "in place, me " << me;
    }
    for (int me = 1; me < world; ++me) EXPECT_TRUE(got[static_cast<size_t>(me)] == got[0]) << "world " << world << " me " << me;
  }
}

// LoRA's adapter dropout against float64: element i kept iff its counter uniform is >= p, kept
// ones scaled by 1 / (1 - p), added to what is there when accumulating; about p of them dropped;
// another key gives another mask.
TEST_P(ElementwiseTest, DropoutKeepsTheCounterMaskAndScales) {
  const DType t = dtype();
  const int64_t n = 40000;
  const float p = 0.25f;
  TypedBuf x(t, random_vec(n, 42)), out(t, n), acc(t, random_vec(n, 43)), other(t, n);
  const auto xv = x.values(), av = acc.values();
  std::vector<double> want(n), want_acc(n);
  int64_t dropped = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = static_cast<double>(counter_uniform(77, i)) >= p;
    dropped += !keep;
    want[i] = keep ? xv[i] / (1.0 - p) : 0.0;
    want_acc[i] = av[i] + want[i];
  }
  EXPECT_NEAR(static_cast<double>(dropped) / n, p, 0.01);
  cpu::dropout({.dtype = t, .n = n, .x = x.data(), .out = out.data(), .key = 77, .p = p, .accumulate = false});
  expect_close(out.values(), want, 1e-7, rtol_for(t), "dropout");
  cpu::dropout({.dtype = t, .n = n, .x = x.data(), .out = acc.data(), .key = 77, .p = p, .accumulate = true});
  expect_close(acc.values(), want_acc, 1e-6, 2 * rtol_for(t), "dropout accumulating");
  cpu::dropout({.dtype = t, .n = n, .x = x.data(), .out = other.data(), .key = 78, .p = p, .accumulate = false});
  EXPECT_NE(other.values(), out.values()) << "another key, the same mask";
}

// A column slice of a wider mask (a tensor-parallel rank's part of a layer's input): its
// elements are the whole dropout's at those columns, bit for bit, for every slice.
TEST_P(ElementwiseTest, DropoutOfAColumnSliceIsTheWholeMasksColumns) {
  const DType t = dtype();
  const int64_t rows = 37, cols = 96, parts = 3, w = cols / parts;
  TypedBuf x(t, random_vec(rows * cols, 44)), whole(t, rows * cols);
  cpu::dropout({.dtype = t, .n = rows * cols, .x = x.data(), .out = whole.data(), .key = 91, .p = 0.3f});
  const auto xv = x.values(), wv = whole.values();
  for (int64_t k = 0; k < parts; ++k) {
    std::vector<double> xs(static_cast<size_t>(rows * w)), want(static_cast<size_t>(rows * w));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < w; ++c) {
        xs[static_cast<size_t>(r * w + c)] = xv[static_cast<size_t>(r * cols + k * w + c)];
        want[static_cast<size_t>(r * w + c)] = wv[static_cast<size_t>(r * cols + k * w + c)];
      }
    TypedBuf xk(t, xs), out(t, rows * w);
    cpu::dropout({.dtype = t, .n = rows * w, .x = xk.data(), .out = out.data(), .key = 91, .p = 0.3f,
                  .accumulate = false, .cols = w, .mask_cols = cols, .mask_col0 = k * w});
    EXPECT_EQ(out.values(), want) << "slice " << k;
  }
  auto rt = make_runtime(Backend::cpu);
  auto s = rt->create_stream();
  EXPECT_THROW(rt->ops().dropout(*s, {.dtype = t, .n = 10, .x = x.data(), .out = whole.data(), .key = 1, .p = 0.1f,
                                      .accumulate = false, .cols = 3, .mask_cols = 6, .mask_col0 = 0}),
               std::invalid_argument);  // 3 does not divide 10
  EXPECT_THROW(rt->ops().dropout(*s, {.dtype = t, .n = 12, .x = x.data(), .out = whole.data(), .key = 1, .p = 0.1f,
                                      .accumulate = false, .cols = 3, .mask_cols = 6, .mask_col0 = 4}),
               std::invalid_argument);  // [4, 7) is outside 6 columns
}

INSTANTIATE_TEST_SUITE_P(DTypes, ElementwiseTest, dtype_isa_values(), dtype_isa_name);

// bias_backward sums each column over the rows in row order, whatever the partition: the same
// bits on 1 and on 3 threads.
TEST(ElementwiseOps, BiasBackwardIsIndependentOfThreadCount) {
  const int64_t rows = 777, cols = 300;
  const auto dy = random_vec(rows * cols, 12);
  std::vector<float> dyf(dy.begin(), dy.end()), one(cols, 0.5f), three(cols, 0.5f);
  for (auto [db, threads] : {std::pair{&one, 1}, std::pair{&three, 3}})
    with_threads(threads, [&] { cpu::bias_backward({.rows = rows, .cols = cols, .dy = dyf.data(), .dbias = db->data()}); });
  EXPECT_EQ(one, three);
}

TEST(ElementwiseOps, GeluTanhIsHfGeluNewAtKnownPoints) {
  // HF gelu_new(1.0) = 0.8411919906082768, exact gelu(1.0) = 0.8413447460685429.
  float x[2] = {1.f, -2.f}, y[2];
  cpu::gelu({.dtype = DType::f32, .n = 2, .tanh_approx = true, .x = x, .y = y});
  EXPECT_NEAR(y[0], 0.8411919906082768, 1e-6);
  EXPECT_NEAR(y[1], -0.04540230591222612, 1e-6);
  cpu::gelu({.dtype = DType::f32, .n = 2, .tanh_approx = false, .x = x, .y = y});
  EXPECT_NEAR(y[0], 0.8413447460685429, 1e-6);
  EXPECT_NEAR(y[1], -0.04550026389635842, 1e-6);
}

TEST(ElementwiseOps, RunsThroughOpsOnAStreamAndValidates) {
  auto rt = make_runtime(Backend::cpu);
  auto stream = rt->create_stream();
  const int64_t n = 1000;
  std::vector<float> a(n), b(n), out(n, 0.f);
  for (int64_t i = 0; i < n; ++i) a[i] = static_cast<float>(i), b[i] = 0.5f * static_cast<float>(i);
  rt->ops().add(*stream, {.dtype = DType::f32, .n = n, .a = a.data(), .b = b.data(), .out = out.data()});
  stream->synchronize();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], 1.5f * static_cast<float>(i)) << i;
  EXPECT_THROW(rt->ops().add(*stream, {.dtype = DType::f32, .n = 0, .a = a.data(), .b = b.data(), .out = out.data()}),
               std::invalid_argument);
  EXPECT_THROW(rt->ops().swiglu(*stream, {.dtype = DType::f32, .rows = 2, .cols = 4, .ld = 3, .gate = a.data(),
                                          .up = b.data(), .out = out.data()}),
               std::invalid_argument);
  stream->synchronize();
}

}  // namespace

namespace {

TEST(FastExp, RelativeErrorAndEdgeCases) {
  double worst = 0;
  for (double xd = -87.3; xd <= 88.7; xd += 0.00731) {
    const float x = static_cast<float>(xd);
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(cpu::fast_exp(x) - want) / want);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(cpu::fast_exp(0.f), 1.f);
  EXPECT_EQ(cpu::fast_exp(-87.5f), 0.f);  // flushed instead of a denormal
  EXPECT_EQ(cpu::fast_exp(-1e30f), 0.f);
  EXPECT_EQ(cpu::fast_exp(-INFINITY), 0.f);
  EXPECT_TRUE(std::isinf(cpu::fast_exp(88.8f)));
  EXPECT_TRUE(std::isinf(cpu::fast_exp(1e30f)));
  EXPECT_TRUE(std::isinf(cpu::fast_exp(INFINITY)));
  EXPECT_TRUE(std::isnan(cpu::fast_exp(NAN)));
}

}  // namespace

namespace {

TEST(BranchlessF16, MatchesDtypeConversionsBitForBit) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    ASSERT_EQ(std::bit_cast<uint32_t>(cpu::f16_to_f32_branchless(h)), std::bit_cast<uint32_t>(f16_to_f32(h))) << i;
    // Every fp32 pattern within ±64 ulps of each fp16 value, and of the midpoint to the next.
    const uint32_t u = std::bit_cast<uint32_t>(f16_to_f32(h));
    for (uint32_t base : {u, u + 0x1000u}) {
      for (int d = -64; d <= 64; ++d) {
        const float f = std::bit_cast<float>(base + static_cast<uint32_t>(d));
        ASSERT_EQ(cpu::f32_to_f16_branchless(f), f32_to_f16(f)) << std::hex << base + d;
      }
    }
  }
  std::mt19937 rng(3);
  for (int k = 0; k < 1000000; ++k) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    ASSERT_EQ(cpu::f32_to_f16_branchless(f), f32_to_f16(f)) << std::hex << std::bit_cast<uint32_t>(f);
  }
}

// The vectorisable bf16 store equals the reference rounding on every bf16 value, at and around
// every rounding midpoint (ties both ways), on NaNs (quietened) and Inf, and on random patterns.
TEST(Conversions, BranchlessBf16StoreMatchesReference) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint32_t u = i << 16;
    for (uint32_t base : {u, u + 0x8000u}) {
      for (int d = -3; d <= 3; ++d) {
        const float f = std::bit_cast<float>(base + static_cast<uint32_t>(d));
        ASSERT_EQ(cpu::f32_to_bf16_branchless(f), f32_to_bf16(f)) << std::hex << base + d;
      }
    }
  }
  std::mt19937 rng(5);
  for (int k = 0; k < 1000000; ++k) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    ASSERT_EQ(cpu::f32_to_bf16_branchless(f), f32_to_bf16(f)) << std::hex << std::bit_cast<uint32_t>(f);
  }
}

}  // namespace
