// CPU attention with key windows: packed documents (seg_start, block-diagonal causal) forward and
// backward against float64 on every instruction-set path and both backward schedules, the
// independence of documents (bitwise), KV-cache decoding (kv_seq > seq, a cache with capacity
// beyond kv_seq, left padding) against the last rows of the full-length forward, and validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/ops.h"
#include "kernels/runtime.h"
#include "tests/kernels/attention_test_util.h"
#include "tests/kernels/layer_test_util.h"

using namespace strata::kernels;
using namespace strata::kernels::attntest;
using strata::kernels::test::finite_diff;

namespace {

class AttentionWindows : public AttentionIsaTest {};

Problem packed(const Shape& s, DType t, uint32_t seed, int64_t min_len, int64_t max_len) {
  Problem pr(s, t, seed);
  pr.seg = random_segments(s.batch, s.seq, min_len, max_len, seed + 1000);
  return pr;
}

struct Forward {
  std::vector<double> out, lse;
};
Forward run_forward(const Problem& pr) {
  std::vector<uint8_t> out(pr.out_elems() * dtype_size(pr.dtype), 0xff);
  std::vector<float> lse(pr.lse_elems(), NAN);
  cpu::attention(pr.forward_args(out.data(), lse.data()));
  return {read_packed(out.data(), pr.dtype, pr.out_elems()), std::vector<double>(lse.begin(), lse.end())};
}

void expect_forward_close(const Problem& pr, double tol_out, double tol_lse) {
  const Forward got = run_forward(pr);
  std::vector<double> out, lse;
  reference_forward(pr.s, pr.q, pr.k, pr.v, out, lse, pr.seg_start());
  EXPECT_LT(normalised_error(got.out, out), tol_out);
  double lse_err = 0;
  for (size_t i = 0; i < lse.size(); ++i) lse_err = std::max(lse_err, std::isnan(got.lse[i]) ? INFINITY : std::abs(got.lse[i] - lse[i]));
  EXPECT_LT(lse_err, tol_lse);
}

void expect_backward_close(const Problem& pr, uint32_t seed, double tol) {
  const std::vector<double> w = random_vector(pr.out_elems(), seed, pr.dtype);
  const BackwardResult got = run_backward(pr, w);
  std::vector<double> dq, dk, dv;
  reference_backward(pr.s, pr.q, pr.k, pr.v, w, dq, dk, dv, pr.seg_start());
  EXPECT_LT(normalised_error(got.dq, dq), tol);
  EXPECT_LT(normalised_error(got.dk, dk), tol);
  EXPECT_LT(normalised_error(got.dv, dv), tol);
  const BackwardResult again = run_backward(pr, w);
  EXPECT_EQ(got.dq, again.dq);
  EXPECT_EQ(got.dk, again.dk);
  EXPECT_EQ(got.dv, again.dv);
}

// Runs f once per backward schedule, then restores the automatic choice.
template <class F>
void for_each_schedule(F&& f) {
  for (auto schedule : {cpu::AttentionSchedule::fused, cpu::AttentionSchedule::split}) {
    SCOPED_TRACE(schedule == cpu::AttentionSchedule::fused ? "fused" : "split");
    cpu::set_attention_backward_schedule(schedule);
    f();
  }
  cpu::set_attention_backward_schedule(cpu::AttentionSchedule::automatic);
}

}  // namespace

TEST_P(AttentionWindows, PackedDocumentsForwardMatchesFloat64) {
  struct Case {
    Shape s;
    int64_t min_len, max_len;
  };
  const Case cases[] = {
      {{2, 200, 4, 2, 32, true}, 5, 70},     // documents within and across 64-blocks
      {{1, 300, 2, 1, 64, false, 3}, 1, 130},  // single-token documents too
      {{1, 130, 3, 3, 16, false}, 30, 600},  // one document: plain causal
      {{2, 77, 4, 1, 40, true, 0, 0.3f}, 2, 20},
  };
  uint32_t seed = 1;
  for (const Case& c : cases)
    for (DType t : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE(::testing::Message() << "T=" << c.s.seq << " D=" << c.s.head_dim << " " << dtype_name(t));
      const double tol = t == DType::f32 ? 2e-6 : t == DType::bf16 ? 1e-2 : 2e-3;
      expect_forward_close(packed(c.s, t, seed++, c.min_len, c.max_len), tol, 2e-5);
    }
}

TEST_P(AttentionWindows, PackedDocumentsBackwardMatchesFloat64) {
  for_each_schedule([&] {
    expect_backward_close(packed({2, 200, 6, 2, 32, true}, DType::f32, 20, 5, 90), 21, 5e-6);
    expect_backward_close(packed({1, 150, 2, 1, 64, false, 5}, DType::f32, 22, 1, 40), 23, 5e-6);
    expect_backward_close(packed({2, 100, 4, 2, 64, true}, DType::bf16, 24, 10, 50), 25, 1e-2);
    expect_backward_close(packed({1, 90, 2, 2, 16, false}, DType::f16, 26, 10, 50), 27, 2e-3);
  });
}

TEST_P(AttentionWindows, PackedDocumentsBackwardMatchesFiniteDifferences) {
  const Shape s{1, 9, 2, 1, 8, false};
  Problem pr(s, DType::f32, 30);
  pr.seg = {0, 0, 0, 3, 3, 5, 5, 5, 5};
  const std::vector<double> w = random_vector(pr.out_elems(), 31, DType::f32);
  for_each_schedule([&] {
    const BackwardResult got = run_backward(pr, w);
    auto loss = [&](const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v) {
      std::vector<double> out, lse;
      reference_forward(s, q, k, v, out, lse, pr.seg_start());
      double l = 0;
      for (size_t i = 0; i < out.size(); ++i) l += w[i] * out[i];
      return l;
    };
    const auto fd_q = finite_diff(pr.q, [&](const auto& x) { return loss(x, pr.k, pr.v); }, 1e-5);
    const auto fd_k = finite_diff(pr.k, [&](const auto& x) { return loss(pr.q, x, pr.v); }, 1e-5);
    const auto fd_v = finite_diff(pr.v, [&](const auto& x) { return loss(pr.q, pr.k, x); }, 1e-5);
    EXPECT_LT(normalised_error(got.dq, fd_q), 1e-5);
    EXPECT_LT(normalised_error(got.dk, fd_k), 1e-5);
    EXPECT_LT(normalised_error(got.dv, fd_v), 1e-5);
  });
}

// Changing one document's q, k and v must leave every other token's out, lse and gradients
// bitwise unchanged: masked keys get probability exactly 0.
TEST_P(AttentionWindows, DocumentsAreIndependentBitForBit) {
  const Shape s{2, 260, 4, 2, 32, false, 2};
  for (DType t : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(t));
    Problem pr = packed(s, t, 40, 20, 90);
    const int64_t b = 0, t0 = pr.seg[130], t1 = [&] {  // the document holding token 130 of batch 0
      int64_t e = 130;
      while (e < s.seq && pr.seg[static_cast<size_t>(e)] == t0) ++e;
      return e;
    }();
    const std::vector<double> w = random_vector(pr.out_elems(), 41, t);
    Problem changed = pr;
    std::mt19937 rng(42);
    std::normal_distribution<float> nd(0.f, 3.f);
    for (int64_t tok = t0; tok < t1; ++tok) {
      auto perturb = [&](int64_t off, int64_t stride, int64_t width) {
        for (int64_t c = 0; c < width; ++c)
          store_from_f32(changed.qkv.data(), t, static_cast<size_t>(off + (b * s.seq + tok) * stride + c), nd(rng));
      };
      perturb(pr.q_off, pr.q_stride, s.n_heads * s.head_dim);
      perturb(pr.k_off, pr.k_stride, s.n_kv_heads * s.head_dim);
      perturb(pr.v_off, pr.v_stride, s.n_kv_heads * s.head_dim);
    }
    auto outside = [&](int64_t bb, int64_t tok) { return bb != b || tok < t0 || tok >= t1; };
    // Rows (B·T tokens of `width` values) outside the changed document must match exactly.
    auto expect_rows_equal = [&](const std::vector<double>& x, const std::vector<double>& y, int64_t width,
                                 const char* what) {
      int64_t differ = 0;
      for (int64_t bt = 0; bt < s.batch * s.seq; ++bt)
        if (outside(bt / s.seq, bt % s.seq))
          differ += std::memcmp(&x[static_cast<size_t>(bt * width)], &y[static_cast<size_t>(bt * width)],
                                static_cast<size_t>(width) * sizeof(double)) != 0;
      EXPECT_EQ(differ, 0) << what << ": tokens outside the changed document differ";
    };
    const Forward f1 = run_forward(pr), f2 = run_forward(changed);
    expect_rows_equal(f1.out, f2.out, s.n_heads * s.head_dim, "out");
    int64_t lse_differ = 0;
    for (int64_t bh = 0; bh < s.batch * s.n_heads; ++bh)
      for (int64_t tok = 0; tok < s.seq; ++tok)
        if (outside(bh / s.n_heads, tok))
          lse_differ += f1.lse[static_cast<size_t>(bh * s.seq + tok)] != f2.lse[static_cast<size_t>(bh * s.seq + tok)];
    EXPECT_EQ(lse_differ, 0) << "lse";
    EXPECT_NE(f1.out, f2.out) << "the change did not reach the document itself";
    for_each_schedule([&] {
      const BackwardResult g1 = run_backward(pr, w), g2 = run_backward(changed, w);
      expect_rows_equal(g1.dq, g2.dq, s.n_heads * s.head_dim, "dq");
      expect_rows_equal(g1.dk, g2.dk, s.n_kv_heads * s.head_dim, "dk");
      expect_rows_equal(g1.dv, g2.dv, s.n_kv_heads * s.head_dim, "dv");
    });
  }
}

TEST_P(AttentionWindows, ResultsDoNotDependOnThreadCount) {
  const Problem pr = packed({2, 200, 4, 2, 32, true}, DType::f32, 50, 10, 120);
  const std::vector<double> w = random_vector(pr.out_elems(), 51, DType::f32);
  for_each_schedule([&] {
    cpu::set_num_threads(1);
    const Forward f1 = run_forward(pr);
    const BackwardResult one = run_backward(pr, w);
    cpu::set_num_threads(3);
    const Forward f3 = run_forward(pr);
    const BackwardResult three = run_backward(pr, w);
    cpu::set_num_threads(0);
    EXPECT_EQ(f1.out, f3.out);
    EXPECT_EQ(f1.lse, f3.lse);
    EXPECT_EQ(one.dq, three.dq);
    EXPECT_EQ(one.dk, three.dk);
    EXPECT_EQ(one.dv, three.dv);
  });
}

namespace {

// The decoding problem of `full` (seq = kv_seq = full.s.seq): its last n_new queries against all
// its keys, k and v in a cache of capacity `cap` tokens (0 = packed). Values copied exactly.
Problem decode_of(const Problem& full, int64_t n_new, int64_t cap) {
  Shape s = full.s;
  s.seq = n_new, s.kv_seq = full.s.seq, s.kv_cap = cap;
  Problem pr(s, full.dtype, 0);
  const int64_t B = s.batch, Tf = full.s.seq, Tk = kv_seq_of(s), capk = cap ? cap : Tk;
  const int64_t qw = s.n_heads * s.head_dim, kw = s.n_kv_heads * s.head_dim;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n_new; ++i)
      for (int64_t c = 0; c < qw; ++c) {
        const double x = full.q[static_cast<size_t>((b * Tf + Tf - n_new + i) * qw + c)];
        pr.q[static_cast<size_t>((b * n_new + i) * qw + c)] = x;
        store_from_f32(pr.qkv.data(), pr.dtype, static_cast<size_t>(pr.q_off + (b * n_new + i) * pr.q_stride + c),
                       static_cast<float>(x));
      }
    for (int64_t j = 0; j < Tk; ++j)
      for (int64_t c = 0; c < kw; ++c) {
        const size_t at = static_cast<size_t>((b * Tk + j) * kw + c);
        pr.k[at] = full.k[at], pr.v[at] = full.v[at];
        store_from_f32(pr.qkv.data(), pr.dtype, static_cast<size_t>(pr.k_off + (b * capk + j) * pr.k_stride + c),
                       static_cast<float>(full.k[at]));
        store_from_f32(pr.qkv.data(), pr.dtype, static_cast<size_t>(pr.v_off + (b * capk + j) * pr.v_stride + c),
                       static_cast<float>(full.v[at]));
      }
  }
  return pr;
}

}  // namespace

// Decoding with a KV cache (kv_seq > seq) gives, bit for bit, the last rows of the full-length
// forward: with a packed cache, a cache with spare capacity (kv_batch_stride), and left padding.
TEST_P(AttentionWindows, KvCacheForwardEqualsLastRowsOfFullForward) {
  for (DType t : {DType::f32, DType::bf16}) {
    const Shape s{2, 150, 4, 2, 32, false, 3};
    for (bool left_pad : {false, true}) {
      Problem full(s, t, 60);
      const int64_t pad[2] = {0, 37};  // batch 1 is left-padded by 37 tokens
      if (left_pad) {
        full.seg.resize(static_cast<size_t>(s.batch * s.seq));
        for (int64_t b = 0; b < s.batch; ++b)
          for (int64_t tok = 0; tok < s.seq; ++tok)
            full.seg[static_cast<size_t>(b * s.seq + tok)] = static_cast<int32_t>(tok < pad[b] ? tok : pad[b]);
      }
      const Forward whole = run_forward(full);
      for (int64_t n_new : {1, 5, 70, 150})
        for (int64_t cap : {0, 200}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(t) << " new=" << n_new << " cap=" << cap
                                            << " left_pad=" << left_pad);
          Problem dec = decode_of(full, n_new, cap);
          if (left_pad)
            for (int64_t b = 0; b < s.batch; ++b)
              for (int64_t i = 0; i < n_new; ++i)
                dec.seg.push_back(full.seg[static_cast<size_t>(b * s.seq + s.seq - n_new + i)]);
          const Forward got = run_forward(dec);
          const int64_t qw = s.n_heads * s.head_dim;
          std::vector<double> want_out, want_lse;
          for (int64_t b = 0; b < s.batch; ++b)
            want_out.insert(want_out.end(), whole.out.begin() + (b * s.seq + s.seq - n_new) * qw,
                            whole.out.begin() + (b + 1) * s.seq * qw);
          for (int64_t bh = 0; bh < s.batch * s.n_heads; ++bh)
            want_lse.insert(want_lse.end(), whole.lse.begin() + bh * s.seq + s.seq - n_new,
                            whole.lse.begin() + (bh + 1) * s.seq);
          EXPECT_EQ(got.out, want_out);
          EXPECT_EQ(got.lse, want_lse);
          if (t == DType::f32) expect_forward_close(dec, 2e-6, 2e-5);
        }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, AttentionWindows, attention_isa_values(), attention_isa_name);

TEST(AttentionWindowsOps, ValidationNamesOpAndField) {
  auto rt = make_runtime(Backend::cpu);
  auto stream = rt->create_stream();
  Problem pr({1, 8, 2, 1, 8, false}, DType::f32, 70);
  std::vector<float> out(pr.out_elems()), lse(pr.lse_elems());
  auto expect_error = [&](const AttentionArgs& a, const std::string& field) {
    try {
      rt->ops().attention(*stream, a);
      ADD_FAILURE() << "no error for " << field;
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("attention: ", 0), 0u) << msg;
      EXPECT_NE(msg.find(field), std::string::npos) << msg;
    }
  };
  AttentionArgs a = pr.forward_args(out.data(), lse.data());
  a.kv_seq = 4;  // < seq
  expect_error(a, "kv_seq");
  a.kv_seq = 8, a.kv_batch_stride = 8 * pr.k_stride - 1;  // rows of batch items would overlap
  expect_error(a, "kv_batch_stride");
  a.kv_batch_stride = 0;
  EXPECT_NO_THROW(rt->ops().attention(*stream, a));
  stream->synchronize();
}
