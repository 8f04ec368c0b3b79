// Fused softmax + cross-entropy on the CPU backend against float64: losses and dlogits with
// ignored rows, row stride, grad_scale, in place, forward only; dlogits as the finite-difference
// gradient of grad_scale·Σ losses; large logits (~1e4); GPT-2's vocab of 50,257.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

#include "kernels/cpu/cpu_ops.h"
#include "layer_test_util.h"

using namespace strata::kernels;
using namespace strata::kernels::test;

namespace {

// Float64 losses (rows) and dlogits (rows, vocab) packed, from logits with row stride ld.
struct CeRef {
  std::vector<double> losses, dlogits;
};
CeRef ce_ref(const std::vector<double>& logits, int64_t rows, int64_t vocab, int64_t ld,
             const std::vector<int32_t>& targets, double grad_scale) {
  CeRef r{std::vector<double>(rows, 0.0), std::vector<double>(rows * vocab, 0.0)};
  for (int64_t i = 0; i < rows; ++i) {
    if (targets[i] < 0) continue;
    const double* x = logits.data() + i * ld;
    double m = -INFINITY, s = 0;
    for (int64_t c = 0; c < vocab; ++c) m = std::max(m, x[c]);
    for (int64_t c = 0; c < vocab; ++c) s += std::exp(x[c] - m);
    r.losses[i] = m + std::log(s) - x[targets[i]];
    for (int64_t c = 0; c < vocab; ++c)
      r.dlogits[i * vocab + c] = grad_scale * (std::exp(x[c] - m) / s - (c == targets[i] ? 1.0 : 0.0));
  }
  return r;
}

std::vector<int32_t> make_targets(int64_t rows, int64_t vocab, uint32_t seed, bool with_ignored) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(rows);
  for (int64_t i = 0; i < rows; ++i) t[i] = static_cast<int32_t>(rng() % vocab);
  if (with_ignored && rows > 2) t[1] = t[rows - 1] = -1;
  return t;
}

// dlogits of row-strided storage, packed as (rows, vocab) doubles.
std::vector<double> packed(const TypedBuf& buf, int64_t rows, int64_t vocab, int64_t ld) {
  std::vector<double> v(rows * vocab);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < vocab; ++c) v[r * vocab + c] = buf.get(r * ld + c);
  return v;
}

class CrossEntropyTest : public DtypeIsaTest {};

TEST_P(CrossEntropyTest, LossesAndGradientsMatchFloat64) {
  const DType t = dtype();
  const double g_rtol = t == DType::f32 ? 2e-5 : (t == DType::bf16 ? 1e-2 : 2e-3);
  uint32_t seed = 1;
  for (int64_t vocab : {1, 3, 17, 129, 3000}) {  // 3000 spans two of the kernel's chunks
    for (int64_t pad : {0, 5}) {
      const int64_t rows = 6, ld = vocab + pad;
      const std::string what = "ce vocab " + std::to_string(vocab) + " ld " + std::to_string(ld);
      const auto targets = make_targets(rows, vocab, seed++, true);
      TypedBuf logits(t, random_vec(rows * ld, seed++, -6, 6));
      const auto lv = logits.values();
      const double grad_scale = 1.0 / 4;  // 4 non-ignored rows
      const CeRef ref = ce_ref(lv, rows, vocab, ld, targets, grad_scale);

      std::vector<float> losses(rows, 123.f);
      TypedBuf dlogits(t, rows * ld);
      cpu::cross_entropy({.dtype = t, .rows = rows, .vocab = vocab, .ld = ld, .logits = logits.data(),
                          .targets = targets.data(), .losses = losses.data(), .dlogits = dlogits.data(),
                          .grad_scale = static_cast<float>(grad_scale)});
      expect_close(std::vector<double>(losses.begin(), losses.end()), ref.losses, 1e-5, 1e-5, what + " losses");
      expect_close(packed(dlogits, rows, vocab, ld), ref.dlogits, 1e-7, g_rtol, what + " dlogits");

      // dlogits is the gradient of grad_scale · Σ losses (finite differences on small vocabs).
      if (vocab <= 129) {
        const auto fd = finite_diff(lv, [&](const auto& v) {
          double l = 0;
          for (double x : ce_ref(v, rows, vocab, ld, targets, grad_scale).losses) l += x;
          return grad_scale * l;
        });
        std::vector<double> fd_packed(rows * vocab);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < vocab; ++c) fd_packed[r * vocab + c] = fd[r * ld + c];
        expect_close(packed(dlogits, rows, vocab, ld), fd_packed, 1e-6, g_rtol, what + " dlogits vs fd");
      }

      // In place: dlogits aliases logits; the padding between rows is left alone.
      TypedBuf inplace(t, lv);
      std::vector<float> losses2(rows);
      cpu::cross_entropy({.dtype = t, .rows = rows, .vocab = vocab, .ld = ld, .logits = inplace.data(),
                          .targets = targets.data(), .losses = losses2.data(), .dlogits = inplace.data(),
                          .grad_scale = static_cast<float>(grad_scale)});
      EXPECT_EQ(losses, losses2) << what;
      expect_close(packed(inplace, rows, vocab, ld), packed(dlogits, rows, vocab, ld), 0, 0, what + " in place");
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = vocab; c < ld; ++c) ASSERT_EQ(inplace.get(r * ld + c), lv[r * ld + c]) << what;

      // Forward only.
      std::vector<float> losses3(rows);
      cpu::cross_entropy({.dtype = t, .rows = rows, .vocab = vocab, .ld = ld, .logits = logits.data(),
                          .targets = targets.data(), .losses = losses3.data()});
      EXPECT_EQ(losses, losses3) << what;
    }
  }
}

TEST_P(CrossEntropyTest, Gpt2VocabOnAFewRows) {
  const DType t = dtype();
  const int64_t rows = 3, vocab = 50257;
  const auto targets = make_targets(rows, vocab, 77, false);
  auto lv0 = random_vec(rows * vocab, 78, -8, 8);
  lv0[targets[0]] = 12.0;  // one confident row
  TypedBuf logits(t, lv0);
  const auto lv = logits.values();
  const CeRef ref = ce_ref(lv, rows, vocab, vocab, targets, 1.0 / rows);
  std::vector<float> losses(rows);
  cpu::cross_entropy({.dtype = t, .rows = rows, .vocab = vocab, .logits = logits.data(), .targets = targets.data(),
                      .losses = losses.data(), .dlogits = logits.data(), .grad_scale = 1.f / rows});
  expect_close(std::vector<double>(losses.begin(), losses.end()), ref.losses, 1e-5, 1e-5, "losses V=50257");
  const double g_rtol = t == DType::f32 ? 2e-5 : (t == DType::bf16 ? 1e-2 : 2e-3);
  // fp16 stores these ~1e-7 probabilities as subnormals: half a subnormal step of absolute error.
  expect_close(logits.values(), ref.dlogits, t == DType::f16 ? 3e-8 : 1e-9, g_rtol, "dlogits V=50257");
}

INSTANTIATE_TEST_SUITE_P(DTypes, CrossEntropyTest, dtype_isa_values(), dtype_isa_name);

TEST(CrossEntropyOps, LargeLogitsAreStable) {
  const int64_t rows = 4, vocab = 1000;
  const auto targets = make_targets(rows, vocab, 5, false);
  auto lv = random_vec(rows * vocab, 6, -20, 20);
  for (int64_t i = 0; i < rows * vocab; ++i) lv[i] += (i / vocab % 2 ? -1e4 : 1e4);  // rows around ±1e4
  std::vector<float> logits(lv.begin(), lv.end()), losses(rows), dlogits(rows * vocab);
  const std::vector<double> stored(logits.begin(), logits.end());
  const CeRef ref = ce_ref(stored, rows, vocab, vocab, targets, 0.5);
  cpu::cross_entropy({.rows = rows, .vocab = vocab, .logits = logits.data(), .targets = targets.data(),
                      .losses = losses.data(), .dlogits = dlogits.data(), .grad_scale = 0.5f});
  for (float v : dlogits) ASSERT_TRUE(std::isfinite(v));
  expect_close(std::vector<double>(losses.begin(), losses.end()), ref.losses, 1e-4, 1e-5, "losses at 1e4");
  expect_close(std::vector<double>(dlogits.begin(), dlogits.end()), ref.dlogits, 1e-7, 2e-5, "dlogits at 1e4");
}

TEST(CrossEntropyOps, MaxRisingAcrossChunksAndHugeVocab) {
  // Row 0: each 2048-logit chunk sits 12 above the previous one, so the running max (and the
  // saved per-chunk shifts) change at every chunk; row 1 is ignored. A 530,000-way vocab takes
  // the larger-chunk path (more than 256 chunks of 2048).
  struct Case {
    int64_t vocab;
    DType t;
  };
  for (const Case cs : {Case{9000, DType::f32}, Case{9000, DType::bf16}, Case{530000, DType::bf16}}) {
    {
      const int64_t vocab = cs.vocab, rows = 2;
      const DType t = cs.t;
      auto lv0 = random_vec(rows * vocab, 11, -2, 2);
      for (int64_t c = 0; c < vocab; ++c) lv0[c] += 12.0 * static_cast<double>(c / 2048 % 8);
      const std::vector<int32_t> targets = {static_cast<int32_t>(vocab / 3), -1};
      TypedBuf logits(t, lv0);
      const auto lv = logits.values();
      const CeRef ref = ce_ref(lv, rows, vocab, vocab, targets, 1.0);
      std::vector<float> losses(rows), losses_fwd(rows);
      TypedBuf dlogits(t, rows * vocab);
      cpu::cross_entropy({.dtype = t, .rows = rows, .vocab = vocab, .logits = logits.data(), .targets = targets.data(),
                          .losses = losses_fwd.data()});
      cpu::cross_entropy({.dtype = t, .rows = rows, .vocab = vocab, .logits = logits.data(), .targets = targets.data(),
                          .losses = losses.data(), .dlogits = dlogits.data()});
      const std::string what = "vocab " + std::to_string(vocab) + " " + std::string(dtype_name(t));
      expect_close(std::vector<double>(losses.begin(), losses.end()), ref.losses, 1e-5, 1e-5, what + " losses");
      expect_close(std::vector<double>(losses_fwd.begin(), losses_fwd.end()), ref.losses, 1e-5, 1e-5,
                   what + " forward-only losses");
      expect_close(dlogits.values(), ref.dlogits, 1e-9, t == DType::f32 ? 2e-5 : 1e-2, what + " dlogits");
    }
  }
}

TEST(CrossEntropyOps, GradScaleIsLinear) {
  const int64_t rows = 2, vocab = 33;
  const std::vector<int32_t> targets = {4, 30};
  const auto lv = random_vec(rows * vocab, 9, -3, 3);
  std::vector<float> logits(lv.begin(), lv.end()), d1(rows * vocab), d3(rows * vocab);
  cpu::cross_entropy({.rows = rows, .vocab = vocab, .logits = logits.data(), .targets = targets.data(),
                      .dlogits = d1.data(), .grad_scale = 1.f});
  cpu::cross_entropy({.rows = rows, .vocab = vocab, .logits = logits.data(), .targets = targets.data(),
                      .dlogits = d3.data(), .grad_scale = 3.f});
  for (int64_t i = 0; i < rows * vocab; ++i) EXPECT_NEAR(d3[i], 3 * d1[i], 1e-6) << i;
  // Each row of softmax - onehot sums to zero.
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t c = 0; c < vocab; ++c) s += d1[r * vocab + c];
    EXPECT_NEAR(s, 0.0, 1e-6);
  }
}

TEST(CrossEntropyOps, BadTargetIsAnError) {
  std::vector<float> logits(2 * 5, 0.f), losses(2);
  for (int32_t bad : {5, -2}) {
    const std::vector<int32_t> targets = {0, bad};
    EXPECT_THROW(cpu::cross_entropy({.rows = 2, .vocab = 5, .logits = logits.data(), .targets = targets.data(),
                                     .losses = losses.data()}),
                 std::out_of_range);
  }
}

}  // namespace
