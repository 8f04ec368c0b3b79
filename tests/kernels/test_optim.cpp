// cpu::adamw against a float64 implementation of torch.optim.AdamW over several steps (fp32
// and low-precision grads, param copies, tails); sum_squares against fp64; scale; cast for
// every dtype pair including NaN, Inf, subnormals and rounding ties.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"
#include "kernels/runtime.h"

using namespace strata::kernels;

namespace {

// Runs body once on the AVX-512 path (when the CPU has it) and once on the portable path.
template <class F>
void on_both_paths(F&& body) {
  for (bool simd : {true, false}) {
    SCOPED_TRACE(simd ? "avx512 path" : "portable path");
    cpu::set_avx512_enabled(simd);
    body();
  }
  cpu::set_avx512_enabled(true);
}

// torch.optim.AdamW (single-tensor path) in float64.
struct RefAdam {
  std::vector<double> p, m, v;
  void step(const std::vector<double>& grad, double lr, double b1, double b2, double eps, double wd, int64_t t,
            double grad_scale) {
    const double bc1 = 1 - std::pow(b1, double(t)), bc2 = 1 - std::pow(b2, double(t));
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = grad[i] * grad_scale;
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + eps;
      p[i] -= lr / bc1 * m[i] / denom;
    }
  }
};

void run_adamw(int64_t n, DType grad_dtype, bool with_copy, DType copy_dtype, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " grad=" << dtype_name(grad_dtype)
                                    << " copy=" << (with_copy ? dtype_name(copy_dtype) : "none"));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> p(n), m(n, 0.f), v(n, 0.f);
  for (float& x : p) x = d(rng);
  RefAdam ref{std::vector<double>(p.begin(), p.end()), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  std::vector<uint16_t> copy(n + 1, 0xbeef), grad_lp(n);  // one extra element guards the tail
  std::vector<float> grad32(n), copy32(n + 1, -7.f);
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
  for (int64_t t = 1; t <= 5; ++t) {
    std::vector<double> g(n);
    for (int64_t i = 0; i < n; ++i) {
      // Some tiny gradients so eps matters; the rest O(1).
      const float x = (i % 7 == 0) ? d(rng) * 1e-7f : d(rng) * 2.f;
      grad32[i] = x;
      if (grad_dtype != DType::f32) store_from_f32(grad_lp.data(), grad_dtype, i, x);
      g[i] = grad_dtype == DType::f32 ? x : load_as_f32(grad_lp.data(), grad_dtype, i);
    }
    AdamWArgs a;
    a.n = n, a.param = p.data(), a.m = m.data(), a.v = v.data();
    a.grad = grad_dtype == DType::f32 ? static_cast<const void*>(grad32.data()) : grad_lp.data();
    a.grad_dtype = grad_dtype;
    if (with_copy) {
      a.param_copy = copy_dtype == DType::f32 ? static_cast<void*>(copy32.data()) : copy.data();
      a.copy_dtype = copy_dtype;
    }
    a.lr = lr, a.beta1 = b1, a.beta2 = b2, a.eps = eps, a.weight_decay = wd, a.step = t, a.grad_scale = gs;
    cpu::adamw(a);
    ref.step(g, lr, b1, b2, eps, wd, t, gs);
  }
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = std::fabs(p[i] - ref.p[i]) <= 2e-6 + 2e-6 * std::fabs(ref.p[i]) &&
                    std::fabs(m[i] - ref.m[i]) <= 1e-6 * (1 + std::fabs(ref.m[i])) &&
                    std::fabs(v[i] - ref.v[i]) <= 1e-6 * (1e-6 + std::fabs(ref.v[i]));
    if (!ok && bad++ < 5)
      ADD_FAILURE() << "i=" << i << " p " << p[i] << " vs " << ref.p[i] << ", m " << m[i] << " vs " << ref.m[i]
                    << ", v " << v[i] << " vs " << ref.v[i];
    if (with_copy) {
      if (copy_dtype == DType::f32) EXPECT_EQ(copy32[i], p[i]);
      else EXPECT_EQ(copy[i], copy_dtype == DType::bf16 ? f32_to_bf16(p[i]) : f32_to_f16(p[i])) << i;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(copy[n], 0xbeef);  // nothing written past n
  EXPECT_EQ(copy32[n], -7.f);
}

}  // namespace

TEST(AdamW, MatchesTorchFormulaFp32GradsOddSizes) {
  on_both_paths([&] {
    uint32_t seed = 1;
    for (int64_t n : {1, 15, 16, 17, 1013, 100003}) run_adamw(n, DType::f32, false, DType::bf16, seed++);
  });
}

TEST(AdamW, LowPrecisionGradsAndParamCopies) {
  on_both_paths([&] {
    uint32_t seed = 50;
    for (DType g : {DType::bf16, DType::f16})
      for (int64_t n : {7, 1013, 70001}) run_adamw(n, g, true, DType::bf16, seed++);
    run_adamw(1013, DType::f32, true, DType::f16, seed++);
    run_adamw(33, DType::bf16, true, DType::f32, seed++);
  });
}

TEST(AdamW, ThroughOpsOnAStream) {
  auto rt = make_runtime(Backend::cpu);
  auto s = rt->create_stream();
  std::vector<float> p{1.f, -2.f, 3.f}, g{0.5f, 0.5f, -0.5f}, m(3, 0.f), v(3, 0.f);
  AdamWArgs a;
  a.n = 3, a.param = p.data(), a.grad = g.data(), a.m = m.data(), a.v = v.data(), a.lr = 0.1f;
  rt->ops().adamw(*s, a);
  s->synchronize();
  // Step 1 without decay moves every parameter by lr against the gradient's sign.
  EXPECT_NEAR(p[0], 0.9f, 1e-6);
  EXPECT_NEAR(p[1], -2.1f, 1e-6);
  EXPECT_NEAR(p[2], 3.1f, 1e-6);
  a.step = 0;
  EXPECT_THROW(rt->ops().adamw(*s, a), std::invalid_argument);
  // Out of place: an input apart from its output, or equal to it, runs; a partial overlap is refused.
  a.step = 1;
  std::vector<float> q(4, 0.f);
  a.param_in = q.data();
  rt->ops().adamw(*s, a);
  a.param_in = p.data();
  rt->ops().adamw(*s, a);
  a.param_in = p.data() + 1;
  EXPECT_THROW(rt->ops().adamw(*s, a), std::invalid_argument);
  s->synchronize();
}

TEST(SumSquares, MatchesFp64AndAccumulates) {
  on_both_paths([&] {
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.f, 3.f);
    for (DType t : {DType::f32, DType::bf16, DType::f16})
      for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{4099}, (int64_t{1} << 20) + 3}) {
        std::vector<uint8_t> x(n * dtype_size(t));
        double ref = 0;
        for (int64_t i = 0; i < n; ++i) {
          store_from_f32(x.data(), t, i, d(rng));
          const double v = load_as_f32(x.data(), t, i);
          ref += v * v;
        }
        double out = 1.5;  // accumulates onto what is there
        cpu::sum_squares({t, n, x.data(), &out});
        EXPECT_NEAR(out, 1.5 + ref, 1e-12 * ref) << dtype_name(t) << " n=" << n;
      }
  });
}

TEST(SumSquares, LargeSumIsAccurateAndThreadCountIndependent) {
  // 2^24 + 1 ones then many small values: a float accumulator would stall at 2^24.
  const int64_t n = (int64_t{1} << 24) + 1000;
  std::vector<float> x(n, 1.f);
  for (int64_t i = 0; i < 1000; ++i) x[(int64_t{1} << 24) + i] = 0.25f;
  double one = 0, two = 0;
  const int threads = cpu::num_threads();
  cpu::set_num_threads(1);
  cpu::sum_squares({DType::f32, n, x.data(), &one});
  cpu::set_num_threads(2);
  cpu::sum_squares({DType::f32, n, x.data(), &two});
  cpu::set_num_threads(threads);
  EXPECT_EQ(one, double(int64_t{1} << 24) + 1000 * 0.0625);
  EXPECT_EQ(one, two);
}

TEST(Scale, AllDtypes) {
  on_both_paths([&] {
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> d(-4.f, 4.f);
    for (DType t : {DType::f32, DType::bf16, DType::f16})
      for (int64_t n : {1, 31, 70001}) {
        std::vector<uint8_t> x(n * dtype_size(t)), want(n * dtype_size(t));
        for (int64_t i = 0; i < n; ++i) {
          store_from_f32(x.data(), t, i, d(rng));
          store_from_f32(want.data(), t, i, load_as_f32(x.data(), t, i) * 0.3f);
        }
        cpu::scale({t, n, x.data(), 0.3f});
        EXPECT_EQ(x, want) << dtype_name(t) << " n=" << n;
      }
    float one = 2.f;
    cpu::scale({DType::f32, 1, &one, -0.5f});
    EXPECT_EQ(one, -1.f);
  });
}

namespace {

// Values that exercise every conversion edge: NaN (both signs), ±Inf, ±0, subnormals of each
// format, overflow to Inf in fp16, and exact ties for bf16 and fp16 rounding.
std::vector<float> edge_values() {
  std::vector<uint32_t> bits = {
      0x7fc00000u, 0xffc00001u, 0x7f800001u,  // NaNs (quiet, negative, signalling)
      0x7f800000u, 0xff800000u, 0x00000000u, 0x80000000u,
      0x00000001u, 0x807fffffu,               // fp32 subnormals
      0x3f808000u, 0x3f818000u, 0xbf808000u,  // bf16 ties: to even 0x3f80, 0x3f82, 0xbf80
      0x3f808001u, 0x7f7fffffu,               // above a tie; FLT_MAX rounds to Inf in bf16
      0x3f801000u, 0x3f803000u,               // fp16 ties (1 + 2^-11, 1 + 3·2^-11)
      0x477ff000u, 0x477fe000u,               // 65520 -> Inf in fp16; 65504 is fp16 max
      0x33000000u, 0x33000001u, 0x38800000u, 0x387fe000u,  // fp16 subnormal range edges
  };
  std::vector<float> v;
  for (uint32_t b : bits) v.push_back(std::bit_cast<float>(b));
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> d(-70000.f, 70000.f);
  while (v.size() < 16 * 5 + 3) v.push_back(d(rng));  // vector body plus a tail
  return v;
}

}  // namespace

TEST(Cast, AllPairsMatchScalarConversions) {
  on_both_paths([&] {
    const std::vector<float> vals = edge_values();
    const int64_t n = static_cast<int64_t>(vals.size());
    for (DType s : {DType::f32, DType::bf16, DType::f16})
      for (DType t : {DType::f32, DType::bf16, DType::f16}) {
        std::vector<uint8_t> src(n * dtype_size(s)), dst((n + 1) * dtype_size(t), 0xab), want(dst);
        for (int64_t i = 0; i < n; ++i) store_from_f32(src.data(), s, i, vals[i]);
        for (int64_t i = 0; i < n; ++i) store_from_f32(want.data(), t, i, load_as_f32(src.data(), s, i));
        cpu::cast({n, src.data(), s, dst.data(), t});
        EXPECT_EQ(dst, want) << dtype_name(s) << " -> " << dtype_name(t);  // incl. the untouched guard element
      }
  });
}

TEST(Cast, RoundingTiesAndSpecialValuesKnownAnswers) {
  on_both_paths([&] {
    const std::vector<float> in = {std::bit_cast<float>(0x3f808000u), std::bit_cast<float>(0x3f818000u),
                                   std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                                   65520.f, 1.f + 1.f / 2048, 1.f + 3.f / 2048, -0.f};
    std::vector<uint16_t> bf(in.size()), hf(in.size());
    cpu::cast({int64_t(in.size()), in.data(), DType::f32, bf.data(), DType::bf16});
    cpu::cast({int64_t(in.size()), in.data(), DType::f32, hf.data(), DType::f16});
    EXPECT_EQ(bf[0], 0x3f80);  // tie, down to even
    EXPECT_EQ(bf[1], 0x3f82);  // tie, up to even
    EXPECT_EQ(bf[2], 0x7f80);
    EXPECT_EQ(bf[3] & 0x7fc0, 0x7fc0);  // still a quiet NaN
    EXPECT_EQ(hf[4], 0x7c00);  // 65520 overflows to Inf
    EXPECT_EQ(hf[5], 0x3c00);  // 1 + 2^-11: tie, down to even
    EXPECT_EQ(hf[6], 0x3c02);  // 1 + 3·2^-11: tie, up to even
    EXPECT_EQ(hf[7], 0x8000);
    EXPECT_EQ(bf[7], 0x8000);
    std::vector<float> back(in.size());
    cpu::cast({int64_t(in.size()), hf.data(), DType::f16, back.data(), DType::f32});
    EXPECT_TRUE(std::isinf(back[4]));
    EXPECT_EQ(back[6], 1.f + 2.f / 1024);
  });
}

TEST(Cast, LargeBuffersAndSameDtypeCopy) {
  const int64_t n = 300007;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i) * 0.37f - 5000.f;
  std::vector<uint16_t> b(n);
  std::vector<float> y(n), z(n);
  cpu::cast({n, x.data(), DType::f32, b.data(), DType::bf16});
  cpu::cast({n, b.data(), DType::bf16, y.data(), DType::f32});
  for (int64_t i = 0; i < n; i += 997) EXPECT_EQ(y[i], bf16_to_f32(f32_to_bf16(x[i])));
  cpu::cast({n, x.data(), DType::f32, z.data(), DType::f32});
  EXPECT_EQ(x, z);
}

namespace {

// The portable path does the AVX-512 path's operations (and the CUDA kernel's), rounding for
// rounding: AdamW gives the same bits on any of them, so where it runs never changes a loss.
TEST(AdamW, PortableAndAvx512PathsAreBitwiseEqual) {
  cpu::set_avx512_enabled(true);
  if (!cpu::use_avx512()) GTEST_SKIP() << "this CPU has no AVX-512: only the portable path runs";
  const int64_t n = 1003;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> p0(n);
  for (float& x : p0) x = d(rng);
  std::vector<float> p[2], m[2], v[2];
  std::vector<uint16_t> copy[2];
  for (int k = 0; k < 2; ++k) p[k] = p0, m[k].assign(n, 0.f), v[k].assign(n, 0.f), copy[k].assign(n, 0);
  for (int64_t t = 1; t <= 4; ++t) {
    std::vector<float> g(n);
    for (int64_t i = 0; i < n; ++i) g[i] = (i % 5 == 0) ? d(rng) * 1e-7f : d(rng) * 3.f;
    for (int k = 0; k < 2; ++k) {
      cpu::set_avx512_enabled(k == 0);
      AdamWArgs a;
      a.n = n, a.param = p[k].data(), a.m = m[k].data(), a.v = v[k].data(), a.grad = g.data();
      a.grad_dtype = DType::f32, a.param_copy = copy[k].data(), a.copy_dtype = DType::bf16;
      a.lr = 3e-3f, a.weight_decay = 0.1f, a.step = t, a.grad_scale = 0.5f;
      cpu::adamw(a);
    }
  }
  cpu::set_avx512_enabled(true);
  EXPECT_EQ(0, std::memcmp(p[0].data(), p[1].data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(m[0].data(), m[1].data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(v[0].data(), v[1].data(), n * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(copy[0].data(), copy[1].data(), n * sizeof(uint16_t)));
}

// Out of place (AdamWArgs::param_in, m_in, v_in): the bits of the in-place step, the inputs
// left as they were, on both paths, with a tail.
TEST(AdamW, OutOfPlaceIsTheInPlaceStep) {
  on_both_paths([] {
    const int64_t n = 1003;
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    std::vector<float> p(n), m(n), v(n), g(n);
    for (int64_t i = 0; i < n; ++i) p[i] = d(rng), m[i] = d(rng) * 0.1f, v[i] = std::abs(d(rng)) * 0.01f, g[i] = d(rng);
    std::vector<float> p_in = p, m_in = m, v_in = v;  // the current copies, kept
    std::vector<float> q(n, 7.f), mq(n, 7.f), vq(n, 7.f);  // the other copies: stale
    std::vector<uint16_t> copy_in(n), copy_out(n);
    AdamWArgs a;
    a.n = n, a.grad = g.data(), a.grad_dtype = DType::f32, a.copy_dtype = DType::bf16;
    a.lr = 3e-3f, a.weight_decay = 0.1f, a.step = 3, a.grad_scale = 0.5f;
    AdamWArgs in_place = a, out = a;
    in_place.param = p.data(), in_place.m = m.data(), in_place.v = v.data(), in_place.param_copy = copy_in.data();
    out.param = q.data(), out.m = mq.data(), out.v = vq.data(), out.param_copy = copy_out.data();
    out.param_in = p_in.data(), out.m_in = m_in.data(), out.v_in = v_in.data();
    const std::vector<float> p0 = p_in, m0 = m_in, v0 = v_in;
    cpu::adamw(in_place);
    cpu::adamw(out);
    EXPECT_EQ(0, std::memcmp(p.data(), q.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(m.data(), mq.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(v.data(), vq.data(), n * sizeof(float)));
    EXPECT_EQ(copy_in, copy_out);
    EXPECT_EQ(p_in, p0);
    EXPECT_EQ(m_in, m0);
    EXPECT_EQ(v_in, v0);
  });
}

}  // namespace
