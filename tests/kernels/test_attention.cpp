// CPU causal attention (GQA, strided q/k/v) against a float64 reference: forward out and lse
// against the full seq × seq softmax, backward against central finite differences of
// L = Σ w∘out on small shapes and against the analytic float64 backward on larger ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

using namespace strata::kernels;
using namespace strata::kernels::attntest;

namespace {

// Every test runs on each instruction-set path this CPU has (the others skip).
class Attention : public AttentionIsaTest {};

void check_forward(const Shape& s, DType t, uint32_t seed, double tol_out, double tol_lse) {
  SCOPED_TRACE(::testing::Message() << "B=" << s.batch << " T=" << s.seq << " Hq=" << s.n_heads << " Hkv="
                                    << s.n_kv_heads << " D=" << s.head_dim << " fused=" << s.fused
                                    << " dtype=" << dtype_name(t));
  Problem pr(s, t, seed);
  std::vector<uint8_t> out(pr.out_elems() * dtype_size(t), 0xff);
  std::vector<float> lse(pr.lse_elems(), NAN);
  cpu::attention(pr.forward_args(out.data(), lse.data()));
  std::vector<double> ref_out, ref_lse;
  reference_forward(s, pr.q, pr.k, pr.v, ref_out, ref_lse);
  EXPECT_LT(normalised_error(read_packed(out.data(), t, pr.out_elems()), ref_out), tol_out);
  std::vector<double> got_lse(lse.begin(), lse.end());
  double lse_err = 0;
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    const double d = std::abs(got_lse[i] - ref_lse[i]);
    if (!(d <= lse_err)) lse_err = std::isnan(d) ? INFINITY : d;
  }
  EXPECT_LT(lse_err, tol_lse);
}

}  // namespace

TEST_P(Attention, ForwardMatchesFloat64Reference) {
  const Shape shapes[] = {
      {1, 1, 1, 1, 8, false},    {2, 5, 4, 2, 8, false, 3}, {1, 67, 6, 1, 16, true},
      {2, 130, 4, 4, 64, false}, {1, 200, 4, 2, 64, true},  {1, 129, 2, 1, 128, false, 16},
      {1, 70, 3, 3, 40, true},   {1, 65, 4, 1, 24, false, 1, 0.3f},
  };
  uint32_t seed = 1;
  for (const Shape& s : shapes) check_forward(s, DType::f32, seed++, 2e-6, 2e-5);
}

TEST_P(Attention, ForwardBf16AndF16) {
  check_forward({2, 67, 4, 2, 64, true}, DType::bf16, 11, 1e-2, 2e-5);
  check_forward({1, 130, 6, 2, 16, false}, DType::f16, 12, 2e-3, 2e-5);
}

TEST_P(Attention, ForwardLargeScoresStayFinite) {
  // Scores of ±several hundred: the online softmax must rescale without overflow.
  Shape s{1, 150, 2, 1, 16, false};
  Problem pr(s, DType::f32, 21);
  float* q = reinterpret_cast<float*>(pr.qkv.data());
  for (size_t i = 0; i < pr.q.size(); ++i) pr.q[i] = (q[i] *= 40.f);
  std::vector<float> out(pr.out_elems()), lse(pr.lse_elems());
  cpu::attention(pr.forward_args(out.data(), lse.data()));
  std::vector<double> ref_out, ref_lse;
  reference_forward(s, pr.q, pr.k, pr.v, ref_out, ref_lse);
  EXPECT_LT(normalised_error(std::vector<double>(out.begin(), out.end()), ref_out), 1e-5);
  EXPECT_LT(normalised_error(std::vector<double>(lse.begin(), lse.end()), ref_lse), 1e-5);
}

TEST_P(Attention, BackwardMatchesFiniteDifferences) {
  const Shape shapes[] = {{1, 5, 4, 2, 8, false}, {2, 3, 2, 2, 8, true}, {1, 7, 3, 1, 16, false, 2, 0.7f}};
  uint32_t seed = 100;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "T=" << s.seq << " Hq=" << s.n_heads << " Hkv=" << s.n_kv_heads);
    Problem pr(s, DType::f32, seed++);
    const std::vector<double> w = random_vector(pr.out_elems(), seed++, DType::f32);
    const BackwardResult got = run_backward(pr, w);
    auto loss = [&](const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v) {
      std::vector<double> out, lse;
      reference_forward(s, q, k, v, out, lse);
      double l = 0;
      for (size_t i = 0; i < out.size(); ++i) l += w[i] * out[i];
      return l;
    };
    const double eps = 1e-5;
    auto fd = [&](int which) {
      std::vector<double> q = pr.q, k = pr.k, v = pr.v;
      std::vector<double>& x = which == 0 ? q : which == 1 ? k : v;
      std::vector<double> g(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        const double x0 = x[i];
        x[i] = x0 + eps;
        const double lp = loss(q, k, v);
        x[i] = x0 - eps;
        const double lm = loss(q, k, v);
        x[i] = x0;
        g[i] = (lp - lm) / (2 * eps);
      }
      return g;
    };
    EXPECT_LT(normalised_error(got.dq, fd(0)), 1e-5);
    EXPECT_LT(normalised_error(got.dk, fd(1)), 1e-5);
    EXPECT_LT(normalised_error(got.dv, fd(2)), 1e-5);
  }
}

TEST_P(Attention, BackwardMatchesAnalyticFloat64) {
  const Shape shapes[] = {{2, 130, 4, 2, 64, true},
                          {1, 200, 6, 1, 16, false, 5},
                          {1, 67, 2, 2, 128, false},
                          {1, 90, 2, 1, 40, true, 0, 0.2f}};
  uint32_t seed = 200;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "T=" << s.seq << " Hq=" << s.n_heads << " Hkv=" << s.n_kv_heads
                                      << " D=" << s.head_dim);
    Problem pr(s, DType::f32, seed++);
    const std::vector<double> w = random_vector(pr.out_elems(), seed++, DType::f32);
    const BackwardResult got = run_backward(pr, w);
    std::vector<double> dq, dk, dv;
    reference_backward(s, pr.q, pr.k, pr.v, w, dq, dk, dv);
    EXPECT_LT(normalised_error(got.dq, dq), 5e-6);
    EXPECT_LT(normalised_error(got.dk, dk), 5e-6);
    EXPECT_LT(normalised_error(got.dv, dv), 5e-6);
  }
}

TEST_P(Attention, BackwardSchedulesAgree) {
  // Fused (per kv head) and split (per key block, then per query block) schedules: both against
  // float64, and each deterministic.
  const Shape s{2, 150, 6, 2, 32, true};
  Problem pr(s, DType::f32, 250);
  const std::vector<double> w = random_vector(pr.out_elems(), 251, DType::f32);
  std::vector<double> dq, dk, dv;
  reference_backward(s, pr.q, pr.k, pr.v, w, dq, dk, dv);
  for (auto schedule : {cpu::AttentionSchedule::fused, cpu::AttentionSchedule::split}) {
    SCOPED_TRACE(schedule == cpu::AttentionSchedule::fused ? "fused" : "split");
    cpu::set_attention_backward_schedule(schedule);
    const BackwardResult got = run_backward(pr, w), again = run_backward(pr, w);
    EXPECT_LT(normalised_error(got.dq, dq), 5e-6);
    EXPECT_LT(normalised_error(got.dk, dk), 5e-6);
    EXPECT_LT(normalised_error(got.dv, dv), 5e-6);
    EXPECT_EQ(got.dq, again.dq);
    EXPECT_EQ(got.dk, again.dk);
    EXPECT_EQ(got.dv, again.dv);
  }
  cpu::set_attention_backward_schedule(cpu::AttentionSchedule::automatic);
}

TEST_P(Attention, ResultsDoNotDependOnThreadCount) {
  // Each output element has one owner and a fixed summation order, whatever the partitioning.
  const Shape s{2, 200, 4, 2, 32, true};
  Problem pr(s, DType::f32, 260);
  const std::vector<double> w = random_vector(pr.out_elems(), 261, DType::f32);
  for (auto schedule : {cpu::AttentionSchedule::fused, cpu::AttentionSchedule::split}) {
    cpu::set_attention_backward_schedule(schedule);
    cpu::set_num_threads(1);
    const BackwardResult one = run_backward(pr, w);
    cpu::set_num_threads(3);
    const BackwardResult three = run_backward(pr, w);
    cpu::set_num_threads(0);
    EXPECT_EQ(one.dq, three.dq);
    EXPECT_EQ(one.dk, three.dk);
    EXPECT_EQ(one.dv, three.dv);
  }
  cpu::set_attention_backward_schedule(cpu::AttentionSchedule::automatic);
}

TEST_P(Attention, BackwardBf16) {
  const Shape s{2, 100, 4, 2, 64, true};
  Problem pr(s, DType::bf16, 300);
  const std::vector<double> w = random_vector(pr.out_elems(), 301, DType::bf16);
  const BackwardResult got = run_backward(pr, w);
  std::vector<double> dq, dk, dv;
  reference_backward(s, pr.q, pr.k, pr.v, w, dq, dk, dv);
  EXPECT_LT(normalised_error(got.dq, dq), 1e-2);
  EXPECT_LT(normalised_error(got.dk, dk), 1e-2);
  EXPECT_LT(normalised_error(got.dv, dv), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Cpu, Attention, attention_isa_values(), attention_isa_name);

TEST(AttentionOps, RunsOnCpuStreamAndValidates) {
  auto rt = make_runtime(Backend::cpu);
  auto stream = rt->create_stream();
  const Shape s{2, 70, 4, 2, 16, true};
  Problem pr(s, DType::f32, 500);
  std::vector<float> out(pr.out_elems()), lse(pr.lse_elems()), out_direct(pr.out_elems()), lse_direct(pr.lse_elems());
  rt->ops().attention(*stream, pr.forward_args(out.data(), lse.data()));
  stream->synchronize();
  cpu::attention(pr.forward_args(out_direct.data(), lse_direct.data()));
  EXPECT_EQ(out, out_direct);
  EXPECT_EQ(lse, lse_direct);
  std::vector<double> ref_out, ref_lse;
  reference_forward(s, pr.q, pr.k, pr.v, ref_out, ref_lse);
  EXPECT_LT(normalised_error(std::vector<double>(out.begin(), out.end()), ref_out), 2e-6);

  AttentionBackwardArgs bwd;
  bwd.batch = s.batch, bwd.seq = s.seq, bwd.n_heads = s.n_heads, bwd.n_kv_heads = s.n_kv_heads, bwd.head_dim = s.head_dim;
  const AttentionArgs f = pr.forward_args(out.data(), lse.data());
  bwd.q = f.q, bwd.k = f.k, bwd.v = f.v, bwd.q_stride = f.q_stride, bwd.k_stride = f.k_stride, bwd.v_stride = f.v_stride;
  const std::vector<double> w = random_vector(pr.out_elems(), 501, DType::f32);
  std::vector<float> dout(w.begin(), w.end()), grads(pr.qkv.size() / 4), grads_direct(grads.size());
  bwd.out = out.data(), bwd.dout = dout.data(), bwd.lse = lse.data();
  auto set_grads = [&](std::vector<float>& gbuf) {
    bwd.dq = gbuf.data() + pr.q_off, bwd.dk = gbuf.data() + pr.k_off, bwd.dv = gbuf.data() + pr.v_off;
  };
  set_grads(grads);
  rt->ops().attention_backward(*stream, bwd);
  stream->synchronize();
  set_grads(grads_direct);
  cpu::attention_backward(bwd);
  EXPECT_EQ(grads, grads_direct);
  std::vector<double> dq, dk, dv;
  reference_backward(s, pr.q, pr.k, pr.v, w, dq, dk, dv);
  EXPECT_LT(normalised_error(read_strided(grads.data(), DType::f32, pr.q_off, pr.q_stride, s.batch * s.seq,
                                          s.n_heads * s.head_dim), dq), 5e-6);

  AttentionArgs bad = pr.forward_args(out.data(), lse.data());
  bad.n_heads = 6, bad.n_kv_heads = 4;
  EXPECT_THROW(rt->ops().attention(*stream, bad), std::invalid_argument);
  EXPECT_THROW(cpu::attention(bad), std::invalid_argument);
  AttentionBackwardArgs bad_bwd;
  bad_bwd.batch = 1, bad_bwd.seq = 4, bad_bwd.n_heads = 3, bad_bwd.n_kv_heads = 2, bad_bwd.head_dim = 8;
  EXPECT_THROW(rt->ops().attention_backward(*stream, bad_bwd), std::invalid_argument);
  stream->synchronize();
}
