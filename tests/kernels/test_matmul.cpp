// cpu::matmul against a float64 reference: every transpose combination, batches with strides,
// padded leading dims, alpha/beta (beta = 1 accumulates), odd sizes, bf16 and fp16 inputs, C in
// the low-precision dtype; the linear layer's backward against finite differences; the Ops
// front door on a stream, including argument validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul.h"
#include "kernels/runtime.h"

using namespace strata::kernels;

namespace {

// A matrix stored in `dtype` (raw bytes), with the fp64 value of every stored element.
struct Buf {
  DType dtype = DType::f32;
  std::vector<uint8_t> bytes;
  std::vector<double> value;
  Buf(DType t, int64_t n, std::mt19937& rng, float lo = -1.f, float hi = 1.f) : dtype(t) {
    bytes.resize(n * dtype_size(t));
    value.resize(n);
    std::uniform_real_distribution<float> d(lo, hi);
    for (int64_t i = 0; i < n; ++i) {
      store_from_f32(bytes.data(), t, i, d(rng));
      value[i] = load_as_f32(bytes.data(), t, i);
    }
  }
  void* data() { return bytes.data(); }
  double at(int64_t i) const { return load_as_f32(bytes.data(), dtype, i); }
};

struct Problem {
  int64_t m, n, k;
  bool ta = false, tb = false;
  int64_t batch = 1;
  int64_t pad_ld = 0;      // added to every leading dim (0 = packed)
  int64_t pad_stride = 0;  // added to every batch stride
  float alpha = 1.f, beta = 0.f;
  DType ab = DType::f32, c = DType::f32;
};

// Runs the problem through cpu::matmul and checks every element of C (and that padding is
// untouched) against alpha·Σ a·b + beta·c0 in float64.
void check(const Problem& p, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "m=" << p.m << " n=" << p.n << " k=" << p.k << " ta=" << p.ta
                                    << " tb=" << p.tb << " batch=" << p.batch << " pad=" << p.pad_ld << "/"
                                    << p.pad_stride << " alpha=" << p.alpha << " beta=" << p.beta << " "
                                    << dtype_name(p.ab) << "->" << dtype_name(p.c));
  std::mt19937 rng(seed);
  const int64_t a_rows = p.ta ? p.k : p.m, a_cols = p.ta ? p.m : p.k;
  const int64_t b_rows = p.tb ? p.n : p.k, b_cols = p.tb ? p.k : p.n;
  const int64_t lda = a_cols + p.pad_ld, ldb = b_cols + p.pad_ld, ldc = p.n + p.pad_ld;
  const int64_t sa = a_rows * lda + p.pad_stride, sb = b_rows * ldb + p.pad_stride, sc = p.m * ldc + p.pad_stride;
  Buf A(p.ab, sa * p.batch, rng), B(p.ab, sb * p.batch, rng), C(p.c, sc * p.batch, rng);
  const std::vector<uint8_t> c_before = C.bytes;

  MatmulArgs args;
  args.a = A.data(), args.b = B.data(), args.c = C.data();
  args.ab_dtype = p.ab, args.c_dtype = p.c;
  args.m = p.m, args.n = p.n, args.k = p.k, args.trans_a = p.ta, args.trans_b = p.tb;
  args.lda = p.pad_ld ? lda : 0, args.ldb = p.pad_ld ? ldb : 0, args.ldc = p.pad_ld ? ldc : 0;
  args.batch = p.batch;
  if (p.pad_stride) args.stride_a = sa, args.stride_b = sb, args.stride_c = sc;
  args.alpha = p.alpha, args.beta = p.beta;
  cpu::matmul(args);

  // fp32 accumulation over k terms of products of inputs in [-1, 1].
  const double rtol_acc = 2e-6 * std::sqrt(static_cast<double>(p.k)) + 1e-6;
  const double rtol_out = p.c == DType::bf16 ? 1.0 / 256 : p.c == DType::f16 ? 1.0 / 2048 : 0.0;
  int bad = 0;
  for (int64_t bi = 0; bi < p.batch; ++bi)
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t j = 0; j < p.n; ++j) {
        double dot = 0, mag = 0;
        for (int64_t l = 0; l < p.k; ++l) {
          const double a = A.value[bi * sa + (p.ta ? l * lda + i : i * lda + l)];
          const double b = B.value[bi * sb + (p.tb ? j * ldb + l : l * ldb + j)];
          dot += a * b;
          mag += std::fabs(a * b);
        }
        const int64_t ci = bi * sc + i * ldc + j;
        const double ref = p.alpha * dot + p.beta * C.value[ci];
        const double tol = rtol_acc * (std::fabs(p.alpha) * mag + std::fabs(p.beta * C.value[ci])) +
                           rtol_out * std::fabs(ref) + 1e-30;
        const double got = C.at(ci);
        if (!(std::fabs(got - ref) <= tol) && bad++ < 5)
          ADD_FAILURE() << "C[" << bi << "," << i << "," << j << "] = " << got << ", want " << ref << " ± " << tol;
      }
  // Padding columns and gaps between batch items are not written.
  const size_t es = dtype_size(p.c);
  for (int64_t bi = 0; bi < p.batch; ++bi)
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t j = p.n; j < ldc; ++j) {
        const size_t off = (bi * sc + i * ldc + j) * es;
        EXPECT_EQ(std::memcmp(&C.bytes[off], &c_before[off], es), 0) << "padding written at " << i << "," << j;
      }
  EXPECT_EQ(bad, 0);
}

const int64_t kOdd[][3] = {{1, 1, 1}, {7, 33, 129}, {33, 7, 1}, {129, 1, 7}, {1, 129, 33}, {64, 48, 96}};

}  // namespace

TEST(Matmul, Fp32AllTransposesOddSizes) {
  uint32_t seed = 1;
  for (const auto& s : kOdd)
    for (int t = 0; t < 4; ++t) check({.m = s[0], .n = s[1], .k = s[2], .ta = (t & 1) != 0, .tb = (t & 2) != 0}, seed++);
}

TEST(Matmul, Fp32BatchedStridesAndPaddedLeadingDims) {
  uint32_t seed = 100;
  for (int t = 0; t < 4; ++t) {
    check({.m = 7, .n = 33, .k = 17, .ta = (t & 1) != 0, .tb = (t & 2) != 0, .batch = 3}, seed++);
    check({.m = 7, .n = 33, .k = 17, .ta = (t & 1) != 0, .tb = (t & 2) != 0, .batch = 3, .pad_ld = 5,
           .pad_stride = 11}, seed++);
    check({.m = 33, .n = 1, .k = 129, .ta = (t & 1) != 0, .tb = (t & 2) != 0, .batch = 1, .pad_ld = 3}, seed++);
  }
}

TEST(Matmul, Fp32AlphaBeta) {
  uint32_t seed = 200;
  for (float beta : {1.f, 0.25f, -1.f})
    for (int t = 0; t < 4; ++t)
      check({.m = 33, .n = 7, .k = 129, .ta = (t & 1) != 0, .tb = (t & 2) != 0, .batch = 2, .pad_ld = 2,
             .alpha = 0.5f, .beta = beta}, seed++);
  check({.m = 1, .n = 1, .k = 7, .alpha = -3.f, .beta = 1.f}, seed++);
}

// Narrow operands (ab) into an fp32 C and into a C of their own dtype, in every layout, batched
// with padded strides, alpha and beta.
static void check_narrow_inputs(DType ab, uint32_t seed) {
  for (DType c : {DType::f32, ab})
    for (int t = 0; t < 4; ++t) {
      const bool ta = (t & 1) != 0, tb = (t & 2) != 0;
      check({.m = 7, .n = 33, .k = 129, .ta = ta, .tb = tb, .ab = ab, .c = c}, seed++);
      check({.m = 33, .n = 17, .k = 64, .ta = ta, .tb = tb, .batch = 3, .pad_ld = 3, .pad_stride = 5,
             .alpha = 0.5f, .beta = 1.f, .ab = ab, .c = c}, seed++);
    }
}

TEST(Matmul, Bf16InputsFp32AndBf16Output) { check_narrow_inputs(DType::bf16, 300); }

// Where oneDNN has no bf16 kernels (an AVX2-only CPU) bf16 operands are widened to fp32, as
// fp16 ones are: the same problems through that path, on any CPU, a long k across its tiles too.
TEST(Matmul, Bf16WidenedToFp32WhereOneDnnHasNoBf16Kernels) {
  cpu::widen_bf16_for_tests(true);
  ASSERT_TRUE(cpu::bf16_widened());
  check_narrow_inputs(DType::bf16, 350);
  check({.m = 2, .n = 1, .k = (int64_t{1} << 21) + 5, .ta = true, .beta = 0.5f, .ab = DType::bf16, .c = DType::bf16}, 370);
  cpu::widen_bf16_for_tests(false);
}

TEST(Matmul, Fp16InputsFp32AndFp16Output) { check_narrow_inputs(DType::f16, 400); }

// fp16 inputs are widened in k-tiles of at most 4M floats of A and B: a long k takes several
// tiles, the later ones accumulating (beta = 1) onto the first.
TEST(Matmul, Fp16LongKSpansSeveralTiles) {
  check({.m = 1, .n = 2, .k = (int64_t{1} << 21) + 5, .tb = true, .beta = 0.5f, .ab = DType::f16}, 500);
  check({.m = 2, .n = 1, .k = (int64_t{1} << 21) + 5, .ta = true, .ab = DType::f16, .c = DType::f16}, 501);
}

// Repeating a problem is served from the primitive cache (built once, whatever the buffers)
// and gives bit-identical results; a new alpha or beta is a new primitive.
// A huge m or k (the LM head's V) is run in blocks (m split, k accumulated through fp32): the
// result is still alpha·A·B + beta·C in every layout, with padded leading dims, and a bf16 C
// is rounded once.
TEST(Matmul, HugeMAndKAreSplitIntoBlocks) {
  uint32_t seed = 40;
  for (DType ab : {DType::f32, DType::bf16})
    for (DType c : {DType::f32, DType::bf16}) {
      if (ab == DType::f32 && c == DType::bf16) continue;
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (const auto& [m, n, k] : {std::tuple{16500, 3, 5}, std::tuple{3, 5, 16500}}) {
            Problem p{m, n, k, ta, tb};
            p.ab = ab, p.c = c;
            p.pad_ld = (m + k) % 2 ? 3 : 0;
            p.alpha = 2.f, p.beta = ta ? 0.5f : 0.f;
            check(p, ++seed);
          }
    }
}

TEST(Matmul, RepeatedCallsReuseOnePrimitiveAndAreDeterministic) {
  std::mt19937 rng(7);
  Buf A(DType::f32, 65 * 31, rng), B(DType::f32, 31 * 47, rng);
  std::vector<float> c1(65 * 47), c2(65 * 47);
  MatmulArgs args;
  args.a = A.data(), args.b = B.data(), args.m = 65, args.n = 47, args.k = 31;
  args.c = c1.data();
  cpu::matmul(args);
  const size_t built = cpu::matmul_primitives_built();
  args.c = c2.data();
  for (int i = 0; i < 3; ++i) cpu::matmul(args);
  EXPECT_EQ(cpu::matmul_primitives_built(), built);
  EXPECT_EQ(c1, c2);
  args.beta = 1.f;
  cpu::matmul(args);
  cpu::matmul(args);
  EXPECT_EQ(cpu::matmul_primitives_built(), built + 1);
}

// Linear layer C = A·B with L = Σ W∘C: dA = dC·Bᵀ and dB = Aᵀ·dC (dC = W) computed by matmul
// calls (dB accumulated onto an existing gradient with beta = 1) match float64 central
// differences of L.
TEST(Matmul, LinearBackwardMatchesFiniteDifferences) {
  for (auto [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{5, 7, 6}, {1, 9, 3}, {11, 3, 1}}) {
    SCOPED_TRACE(::testing::Message() << "m=" << m << " k=" << k << " n=" << n);
    std::mt19937 rng(static_cast<uint32_t>(m * 100 + k * 10 + n));
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    std::vector<float> A(m * k), B(k * n), W(m * n), dA(m * k), dB0(k * n), dB(k * n);
    for (auto* v : {&A, &B, &W, &dB0})
      for (float& x : *v) x = d(rng);
    dB = dB0;

    MatmulArgs ga;  // dA (m, k) = dC (m, n) · Bᵀ, B stored (k, n)
    ga.a = W.data(), ga.b = B.data(), ga.c = dA.data(), ga.m = m, ga.n = k, ga.k = n, ga.trans_b = true;
    cpu::matmul(ga);
    MatmulArgs gb;  // dB (k, n) += Aᵀ · dC, A stored (m, k)
    gb.a = A.data(), gb.b = W.data(), gb.c = dB.data(), gb.m = k, gb.n = n, gb.k = m, gb.trans_a = true, gb.beta = 1.f;
    cpu::matmul(gb);

    auto loss = [&](const std::vector<double>& a, const std::vector<double>& b) {
      double l = 0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double c = 0;
          for (int64_t t = 0; t < k; ++t) c += a[i * k + t] * b[t * n + j];
          l += W[i * n + j] * c;
        }
      return l;
    };
    std::vector<double> a64(A.begin(), A.end()), b64(B.begin(), B.end());
    const double h = 1e-3;
    for (int64_t i = 0; i < m * k; ++i) {
      const double x = a64[i];
      a64[i] = x + h;
      const double lp = loss(a64, b64);
      a64[i] = x - h;
      const double lm = loss(a64, b64);
      a64[i] = x;
      EXPECT_NEAR(dA[i], (lp - lm) / (2 * h), 1e-5) << "dA[" << i << "]";
    }
    for (int64_t i = 0; i < k * n; ++i) {
      const double x = b64[i];
      b64[i] = x + h;
      const double lp = loss(a64, b64);
      b64[i] = x - h;
      const double lm = loss(a64, b64);
      b64[i] = x;
      EXPECT_NEAR(dB[i] - dB0[i], (lp - lm) / (2 * h), 1e-5) << "dB[" << i << "]";
    }
  }
}

TEST(Matmul, ThroughOpsOnAStream) {
  auto rt = make_runtime(Backend::cpu);
  auto s = rt->create_stream();
  const int64_t m = 9, n = 13, k = 21;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> A(m * k), B(n * k), C(m * n, 0.f);
  for (float& x : A) x = d(rng);
  for (float& x : B) x = d(rng);
  MatmulArgs args;
  args.a = A.data(), args.b = B.data(), args.c = C.data(), args.m = m, args.n = n, args.k = k, args.trans_b = true;
  rt->ops().matmul(*s, args);
  s->synchronize();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0;
      for (int64_t t = 0; t < k; ++t) ref += double(A[i * k + t]) * B[j * k + t];
      EXPECT_NEAR(C[i * n + j], ref, 1e-5);
    }
}

TEST(Matmul, BadArgumentsThrowBeforeEnqueueing) {
  auto rt = make_runtime(Backend::cpu);
  auto s = rt->create_stream();
  std::vector<float> buf(64);
  MatmulArgs ok;
  ok.a = ok.b = buf.data(), ok.c = buf.data(), ok.m = 4, ok.n = 4, ok.k = 4;
  auto expect_bad = [&](MatmulArgs a) { EXPECT_THROW(rt->ops().matmul(*s, a), std::invalid_argument); };
  { MatmulArgs a = ok; a.m = 0; expect_bad(a); }
  { MatmulArgs a = ok; a.k = -3; expect_bad(a); }
  { MatmulArgs a = ok; a.batch = 0; expect_bad(a); }
  { MatmulArgs a = ok; a.lda = 3; expect_bad(a); }             // lda < k
  { MatmulArgs a = ok; a.trans_b = true; a.ldb = 2; expect_bad(a); }
  { MatmulArgs a = ok; a.ldc = 3; expect_bad(a); }             // ldc < n
  { MatmulArgs a = ok; a.c_dtype = DType::bf16; expect_bad(a); }  // bf16 C from fp32 inputs
  { MatmulArgs a = ok; a.b = nullptr; expect_bad(a); }
  { MatmulArgs a = ok; a.stride_c = -1; a.batch = 2; expect_bad(a); }
  rt->ops().matmul(*s, ok);
  s->synchronize();
}
