// Fused softmax + cross-entropy on the CPU backend against float64: losses and dlogits with
// ignored rows, row stride, grad_scale, in place, forward only; dlogits as the finite-difference
// gradient of grad_scale·Σ losses; large logits (~1e4); GPT-2's vocab of 50,257. The
// vocabulary-parallel pair (stats, finish) over 1, 2 and 3 uneven shards against float64 and
// against the fused op on whole rows, and its argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/runtime.h"
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

// ---- vocabulary-parallel cross-entropy ----------------------------------------------------------

// One rank's columns [start, start + vocab) of (rows, full_vocab) logits, with row stride ld.
TypedBuf shard_of(const std::vector<double>& full, int64_t rows, int64_t full_vocab, int64_t start, int64_t vocab,
                  int64_t ld, DType t) {
  TypedBuf b(t, random_vec(rows * ld, 99, -50, 50));  // padding: garbage that must stay as it is
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < vocab; ++c) b.set(r * ld + c, full[r * full_vocab + start + c]);
  return b;
}

// Each shard's stats, then each shard's finish from all of them (what the ranks do around the
// all-gather), for the shard widths `widths`; losses per shard and dlogits concatenated (rows, full_vocab).
struct ShardedCe {
  std::vector<std::vector<float>> losses;  // (parts, rows)
  std::vector<double> dlogits;             // (rows, full_vocab)
};
ShardedCe sharded_ce(DType t, const std::vector<double>& full, int64_t rows, const std::vector<int64_t>& widths,
                     int64_t pad, const std::vector<int32_t>& targets, float grad_scale, bool in_place) {
  int64_t full_vocab = 0;
  for (int64_t w : widths) full_vocab += w;
  const int parts = static_cast<int>(widths.size());
  std::vector<float> all_stats(parts * rows * 3, -7.f);  // (parts, rows, 3)
  std::vector<TypedBuf> logits;
  for (int p = 0, start = 0; p < parts; start += static_cast<int>(widths[p]), ++p) {
    logits.push_back(shard_of(full, rows, full_vocab, start, widths[p], widths[p] + pad, t));
    cpu::cross_entropy_stats({.dtype = t, .rows = rows, .vocab = widths[p], .ld = widths[p] + pad,
                              .vocab_start = start, .full_vocab = full_vocab, .logits = logits[p].data(),
                              .targets = targets.data(), .stats = all_stats.data() + p * rows * 3});
  }
  ShardedCe out{std::vector<std::vector<float>>(parts, std::vector<float>(rows, 123.f)),
                std::vector<double>(rows * full_vocab)};
  for (int p = 0, start = 0; p < parts; start += static_cast<int>(widths[p]), ++p) {
    const int64_t vocab = widths[p], ld = vocab + pad;
    TypedBuf separate(t, rows * ld);
    TypedBuf& d = in_place ? logits[p] : separate;
    const auto before = d.values();
    cpu::cross_entropy_finish({.dtype = t, .rows = rows, .vocab = vocab, .ld = ld, .vocab_start = start,
                               .full_vocab = full_vocab, .parts = parts, .logits = logits[p].data(),
                               .targets = targets.data(), .all_stats = all_stats.data(),
                               .losses = out.losses[p].data(), .dlogits = d.data(), .grad_scale = grad_scale});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < vocab; ++c) out.dlogits[r * full_vocab + start + c] = d.get(r * ld + c);
      for (int64_t c = vocab; c < ld; ++c) {
        if (d.get(r * ld + c) != before[r * ld + c]) ADD_FAILURE() << "padding written at row " << r << " col " << c;
      }
    }
  }
  return out;
}

class VocabParallelCrossEntropyTest : public DtypeIsaTest {};

TEST_P(VocabParallelCrossEntropyTest, ShardsMatchFloat64AndTheFusedOp) {
  const DType t = dtype();
  const double g_rtol = t == DType::f32 ? 2e-5 : (t == DType::bf16 ? 1e-2 : 2e-3);
  // Against the fused op, which rounds the same fp32 values: fp32 to ~1e-6; bf16/fp16 dlogits
  // may land an ulp of the dtype apart.
  const double fused_rtol = t == DType::f32 ? 1e-6 : (t == DType::bf16 ? 8e-3 : 1e-3);
  const int64_t rows = 7, full_vocab = 1000;
  // Targets on the shard edges (333, 400, 750) and in every shard of each split; rows 1 and 5 ignored.
  const std::vector<int32_t> targets = {5, -1, 333, 999, 750, -1, 400};
  const float grad_scale = 1.f / 5;
  const TypedBuf stored(t, random_vec(rows * full_vocab, 31, -6, 6));
  const auto full = stored.values();
  const CeRef ref = ce_ref(full, rows, full_vocab, full_vocab, targets, grad_scale);
  std::vector<float> fused_losses(rows);
  TypedBuf fused_d(t, rows * full_vocab);
  cpu::cross_entropy({.dtype = t, .rows = rows, .vocab = full_vocab, .logits = stored.data(),
                      .targets = targets.data(), .losses = fused_losses.data(), .dlogits = fused_d.data(),
                      .grad_scale = grad_scale});
  const std::vector<double> fused_l(fused_losses.begin(), fused_losses.end());

  for (const std::vector<int64_t>& widths : {std::vector<int64_t>{1000}, {333, 667}, {400, 350, 250}}) {
    for (int64_t pad : {0, 3}) {
      const std::string what = std::to_string(widths.size()) + " shards, pad " + std::to_string(pad);
      const ShardedCe got = sharded_ce(t, full, rows, widths, pad, targets, grad_scale, false);
      for (size_t p = 1; p < got.losses.size(); ++p) EXPECT_EQ(got.losses[p], got.losses[0]) << what << " rank " << p;
      const std::vector<double> losses(got.losses[0].begin(), got.losses[0].end());
      expect_close(losses, ref.losses, 1e-5, 1e-5, what + " losses vs float64");
      expect_close(got.dlogits, ref.dlogits, 1e-7, g_rtol, what + " dlogits vs float64");
      expect_close(losses, fused_l, 1e-7, 1e-6, what + " losses vs cross_entropy");
      expect_close(got.dlogits, fused_d.values(), 1e-9, fused_rtol, what + " dlogits vs cross_entropy");

      // In place (dlogits aliases each shard's logits): the same values.
      const ShardedCe inplace = sharded_ce(t, full, rows, widths, pad, targets, grad_scale, true);
      EXPECT_EQ(inplace.losses, got.losses) << what;
      expect_close(inplace.dlogits, got.dlogits, 0, 0, what + " in place");
    }
  }
}

TEST_P(VocabParallelCrossEntropyTest, ForwardOnlyAndNullLosses) {
  const DType t = dtype();
  const int64_t rows = 7, full_vocab = 1000, start = 400, vocab = 350, ld = 360;
  const std::vector<int32_t> targets = {5, -1, 333, 999, 750, -1, 400};
  const std::vector<int64_t> widths = {400, 350, 250};
  const TypedBuf stored(t, random_vec(rows * full_vocab, 32, -6, 6));
  const auto full = stored.values();
  const ShardedCe both = sharded_ce(t, full, rows, widths, ld - vocab, targets, 0.5f, false);
  // Stats of all three shards again, then shard 1's finish twice: losses only (no logits needed),
  // then dlogits only.
  std::vector<float> all_stats(3 * rows * 3);
  std::vector<TypedBuf> logits;
  for (int p = 0, s0 = 0; p < 3; s0 += static_cast<int>(widths[p]), ++p) {
    logits.push_back(shard_of(full, rows, full_vocab, s0, widths[p], widths[p] + ld - vocab, t));
    cpu::cross_entropy_stats({.dtype = t, .rows = rows, .vocab = widths[p], .ld = widths[p] + ld - vocab,
                              .vocab_start = s0, .full_vocab = full_vocab, .logits = logits[p].data(),
                              .targets = targets.data(), .stats = all_stats.data() + p * rows * 3});
  }
  for (int64_t r : {1, 5}) {
    for (int p = 0; p < 3; ++p) {
      for (int k = 0; k < 3; ++k) EXPECT_EQ(all_stats[(p * rows + r) * 3 + k], 0.f) << "ignored row " << r;
    }
  }
  std::vector<float> losses(rows, 123.f);
  cpu::cross_entropy_finish({.dtype = t, .rows = rows, .vocab = vocab, .ld = ld, .vocab_start = start,
                             .full_vocab = full_vocab, .parts = 3, .targets = targets.data(),
                             .all_stats = all_stats.data(), .losses = losses.data()});
  EXPECT_EQ(losses, both.losses[1]);
  TypedBuf d(t, rows * ld);
  cpu::cross_entropy_finish({.dtype = t, .rows = rows, .vocab = vocab, .ld = ld, .vocab_start = start,
                             .full_vocab = full_vocab, .parts = 3, .logits = logits[1].data(),
                             .targets = targets.data(), .all_stats = all_stats.data(), .dlogits = d.data(),
                             .grad_scale = 0.5f});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < vocab; ++c) ASSERT_EQ(d.get(r * ld + c), both.dlogits[r * full_vocab + start + c]);
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, VocabParallelCrossEntropyTest, dtype_isa_values(), dtype_isa_name);

TEST(VocabParallelCrossEntropyOps, BadArgumentsAndTargetsThrow) {
  const int64_t rows = 2, vocab = 5, full_vocab = 10;
  std::vector<float> logits(rows * vocab, 0.f), stats(rows * 3), losses(rows);
  const std::vector<int32_t> ok_targets = {9, -1};
  auto rt = make_runtime(Backend::cpu);
  auto stream = rt->create_stream();
  const CrossEntropyStatsArgs st{.rows = rows, .vocab = vocab, .vocab_start = 5, .full_vocab = full_vocab,
                                 .logits = logits.data(), .targets = ok_targets.data(), .stats = stats.data()};
  rt->ops().cross_entropy_stats(*stream, st);
  stream->synchronize();
  const CrossEntropyFinishArgs fin{.rows = rows, .vocab = vocab, .vocab_start = 5, .full_vocab = full_vocab,
                                   .parts = 1, .logits = logits.data(), .targets = ok_targets.data(),
                                   .all_stats = stats.data(), .losses = losses.data()};
  rt->ops().cross_entropy_finish(*stream, fin);
  stream->synchronize();

  // The shard must lie inside the vocabulary.
  auto expect_invalid = [&](auto args, const char* field, auto call) {
    try {
      call(args);
      ADD_FAILURE() << field << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  auto stats_op = [&](const CrossEntropyStatsArgs& a) { rt->ops().cross_entropy_stats(*stream, a); };
  auto finish_op = [&](const CrossEntropyFinishArgs& a) { rt->ops().cross_entropy_finish(*stream, a); };
  auto s = st;
  s.vocab_start = 6;  // 6 + 5 > 10
  expect_invalid(s, "vocab_start", stats_op);
  s = st, s.vocab_start = -1;
  expect_invalid(s, "vocab_start", stats_op);
  s = st, s.full_vocab = 0;
  expect_invalid(s, "full_vocab", stats_op);
  s = st, s.ld = 4;
  expect_invalid(s, "ld", stats_op);
  s = st, s.rows = -1;
  expect_invalid(s, "rows", stats_op);
  s = st, s.stats = nullptr;
  expect_invalid(s, "stats", stats_op);
  auto f = fin;
  f.vocab_start = 6;
  expect_invalid(f, "vocab_start", finish_op);
  f = fin, f.parts = 0;
  expect_invalid(f, "parts", finish_op);
  f = fin, f.all_stats = nullptr;
  expect_invalid(f, "all_stats", finish_op);
  f = fin, f.losses = nullptr;  // nothing to compute
  expect_invalid(f, "nothing to compute", finish_op);
  f = fin, f.dlogits = logits.data(), f.logits = nullptr;
  expect_invalid(f, "logits", finish_op);

  // A target outside [-1, full_vocab) is an error (thrown by the CPU functions, at synchronize
  // through Ops), before anything is written.
  for (int32_t bad : {10, -2}) {
    const std::vector<int32_t> targets = {0, bad};
    std::vector<float> st_out(rows * 3, 5.f), l_out(rows, 5.f);
    auto sa = st;
    sa.targets = targets.data(), sa.stats = st_out.data();
    EXPECT_THROW(cpu::cross_entropy_stats(sa), std::out_of_range);
    auto fa = fin;
    fa.targets = targets.data(), fa.losses = l_out.data();
    try {
      cpu::cross_entropy_finish(fa);
      ADD_FAILURE() << "target " << bad << " accepted";
    } catch (const std::out_of_range& e) {
      EXPECT_NE(std::string(e.what()).find("cross_entropy_finish: row 1"), std::string::npos) << e.what();
    }
    for (float v : st_out) EXPECT_EQ(v, 5.f);
    for (float v : l_out) EXPECT_EQ(v, 5.f);
    rt->ops().cross_entropy_stats(*stream, sa);
    EXPECT_THROW(stream->synchronize(), std::out_of_range);
  }

  // No rows: nothing to do, no pointers needed but the outputs' choice.
  rt->ops().cross_entropy_stats(*stream, {.vocab = vocab, .full_vocab = full_vocab});
  rt->ops().cross_entropy_finish(*stream, {.vocab = vocab, .full_vocab = full_vocab, .losses = losses.data()});
  stream->synchronize();
}

}  // namespace
