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

using namespace strata::kernels;

namespace {

struct Shape {
  int64_t batch, seq, n_heads, n_kv_heads, head_dim;
  bool fused;          // q, k, v inside one (B, T, (Hq + 2·Hkv)·D) buffer
  int64_t pad = 0;     // extra elements per token when not fused (strided, not packed)
  float scale = 0.f;   // 0 = 1/sqrt(D), as in the op
};
double scale_of(const Shape& s) { return s.scale > 0.f ? s.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim)); }

// One problem: q, k, v stored in `dtype` (separate or fused), plus float64 copies of exactly the
// stored values, which is what the reference sees.
struct Problem {
  Shape s;
  DType dtype;
  int64_t q_stride, k_stride, v_stride;  // elements between tokens (never 0 here)
  std::vector<uint8_t> qkv;              // storage of q, k, v
  int64_t q_off, k_off, v_off;           // element offsets of head 0, token 0
  std::vector<double> q, k, v;           // (B, T, H, D) packed, the stored values

  Problem(Shape shape, DType t, uint32_t seed) : s(shape), dtype(t) {
    const int64_t B = s.batch, T = s.seq, D = s.head_dim;
    const int64_t qw = s.n_heads * D, kw = s.n_kv_heads * D;
    if (s.fused) {
      q_stride = k_stride = v_stride = qw + 2 * kw;
      q_off = 0, k_off = qw, v_off = qw + kw;
    } else {
      q_stride = qw + s.pad, k_stride = kw + s.pad, v_stride = kw + s.pad;
      q_off = 0, k_off = B * T * q_stride, v_off = k_off + B * T * k_stride;
    }
    const int64_t total = s.fused ? B * T * q_stride : v_off + B * T * v_stride;
    qkv.assign(static_cast<size_t>(total) * dtype_size(t), 0);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto fill = [&](std::vector<double>& dst, int64_t off, int64_t stride, int64_t heads) {
      dst.resize(static_cast<size_t>(B * T * heads * D));
      for (int64_t bt = 0; bt < B * T; ++bt)
        for (int64_t c = 0; c < heads * D; ++c) {
          const size_t at = static_cast<size_t>(off + bt * stride + c);
          store_from_f32(qkv.data(), t, at, nd(rng));
          dst[static_cast<size_t>(bt * heads * D + c)] = load_as_f32(qkv.data(), t, at);
        }
    };
    fill(q, q_off, q_stride, s.n_heads);
    fill(k, k_off, k_stride, s.n_kv_heads);
    fill(v, v_off, v_stride, s.n_kv_heads);
  }
  const void* at(int64_t off) const { return qkv.data() + off * dtype_size(dtype); }
  size_t out_elems() const { return static_cast<size_t>(s.batch * s.seq * s.n_heads * s.head_dim); }
  size_t lse_elems() const { return static_cast<size_t>(s.batch * s.n_heads * s.seq); }

  AttentionArgs forward_args(void* out, float* lse) const {
    AttentionArgs a;
    a.dtype = dtype;
    a.batch = s.batch, a.seq = s.seq, a.n_heads = s.n_heads, a.n_kv_heads = s.n_kv_heads, a.head_dim = s.head_dim;
    a.q = at(q_off), a.k = at(k_off), a.v = at(v_off);
    a.q_stride = q_stride, a.k_stride = k_stride, a.v_stride = v_stride;
    a.scale = s.scale;
    a.out = out, a.lse = lse;
    return a;
  }
};

// Float64 reference forward: full softmax over keys j <= i. q, k, v packed (B, T, H, D).
void reference_forward(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
                       const std::vector<double>& v, std::vector<double>& out, std::vector<double>& lse) {
  const int64_t B = s.batch, T = s.seq, H = s.n_heads, Hkv = s.n_kv_heads, D = s.head_dim, G = H / Hkv;
  const double scale = scale_of(s);
  out.assign(static_cast<size_t>(B * T * H * D), 0.0);
  lse.assign(static_cast<size_t>(B * H * T), 0.0);
  std::vector<double> p(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const double* qi = &q[static_cast<size_t>(((b * T + i) * H + h) * D)];
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const double* kj = &k[static_cast<size_t>(((b * T + j) * Hkv + h / G) * D)];
          double dotp = 0;
          for (int64_t c = 0; c < D; ++c) dotp += qi[c] * kj[c];
          p[j] = dotp * scale;
          m = std::max(m, p[j]);
        }
        double l = 0;
        for (int64_t j = 0; j <= i; ++j) l += (p[j] = std::exp(p[j] - m));
        double* oi = &out[static_cast<size_t>(((b * T + i) * H + h) * D)];
        for (int64_t j = 0; j <= i; ++j) {
          const double* vj = &v[static_cast<size_t>(((b * T + j) * Hkv + h / G) * D)];
          for (int64_t c = 0; c < D; ++c) oi[c] += p[j] / l * vj[c];
        }
        lse[static_cast<size_t>((b * H + h) * T + i)] = m + std::log(l);
      }
}

// Float64 analytic backward of out given dout (packed like out).
void reference_backward(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
                        const std::vector<double>& v, const std::vector<double>& dout, std::vector<double>& dq,
                        std::vector<double>& dk, std::vector<double>& dv) {
  const int64_t B = s.batch, T = s.seq, H = s.n_heads, Hkv = s.n_kv_heads, D = s.head_dim, G = H / Hkv;
  const double scale = scale_of(s);
  dq.assign(q.size(), 0.0), dk.assign(k.size(), 0.0), dv.assign(v.size(), 0.0);
  std::vector<double> p(static_cast<size_t>(T)), dp(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const size_t qi = static_cast<size_t>(((b * T + i) * H + h) * D);
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const size_t kj = static_cast<size_t>(((b * T + j) * Hkv + h / G) * D);
          double dotp = 0, dpj = 0;
          for (int64_t c = 0; c < D; ++c) dotp += q[qi + c] * k[kj + c], dpj += dout[qi + c] * v[kj + c];
          p[j] = dotp * scale, dp[j] = dpj;
          m = std::max(m, p[j]);
        }
        double l = 0;
        for (int64_t j = 0; j <= i; ++j) l += (p[j] = std::exp(p[j] - m));
        double delta = 0;
        for (int64_t j = 0; j <= i; ++j) delta += (p[j] /= l) * dp[j];
        for (int64_t j = 0; j <= i; ++j) {
          const size_t kj = static_cast<size_t>(((b * T + j) * Hkv + h / G) * D);
          const double ds = p[j] * (dp[j] - delta);
          for (int64_t c = 0; c < D; ++c) {
            dq[qi + c] += scale * ds * k[kj + c];
            dk[kj + c] += scale * ds * q[qi + c];
            dv[kj + c] += p[j] * dout[qi + c];
          }
        }
      }
}

// max |got - want| / max(max |want|, 1e-3): an error normalised by the tensor's magnitude.
double normalised_error(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0, mag = 1e-3;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::abs(got[i] - want[i]);
    if (!(d <= err)) err = std::isnan(d) ? INFINITY : d;  // a NaN (e.g. an unwritten element) must fail
    mag = std::max(mag, std::abs(want[i]));
  }
  return err / mag;
}

std::vector<double> read_packed(const void* p, DType t, size_t n) {
  std::vector<double> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = load_as_f32(p, t, i);
  return r;
}
// Reads (B, T, heads, D) out of a strided buffer at element offset `off`.
std::vector<double> read_strided(const void* p, DType t, int64_t off, int64_t stride, int64_t bt, int64_t width) {
  std::vector<double> r(static_cast<size_t>(bt * width));
  for (int64_t i = 0; i < bt; ++i)
    for (int64_t c = 0; c < width; ++c) r[static_cast<size_t>(i * width + c)] = load_as_f32(p, t, static_cast<size_t>(off + i * stride + c));
  return r;
}

struct BackwardResult {
  std::vector<double> dq, dk, dv;
};
// Runs the kernel forward then backward with dout = w (stored in the problem's dtype).
BackwardResult run_backward(const Problem& pr, const std::vector<double>& w) {
  const DType t = pr.dtype;
  const size_t esz = dtype_size(t);
  std::vector<uint8_t> out(pr.out_elems() * esz), dout(pr.out_elems() * esz), grads(pr.qkv.size(), 0xff);
  std::vector<float> lse(pr.lse_elems());
  for (size_t i = 0; i < w.size(); ++i) store_from_f32(dout.data(), t, i, static_cast<float>(w[i]));
  cpu::attention(pr.forward_args(out.data(), lse.data()));
  AttentionBackwardArgs a;
  const AttentionArgs f = pr.forward_args(out.data(), lse.data());
  a.dtype = t, a.batch = f.batch, a.seq = f.seq, a.n_heads = f.n_heads, a.n_kv_heads = f.n_kv_heads, a.head_dim = f.head_dim;
  a.q = f.q, a.k = f.k, a.v = f.v, a.q_stride = f.q_stride, a.k_stride = f.k_stride, a.v_stride = f.v_stride;
  a.scale = f.scale;
  a.out = out.data(), a.dout = dout.data(), a.lse = lse.data();
  a.dq = grads.data() + pr.q_off * esz, a.dk = grads.data() + pr.k_off * esz, a.dv = grads.data() + pr.v_off * esz;
  cpu::attention_backward(a);
  const Shape& s = pr.s;
  const int64_t bt = s.batch * s.seq;
  return {read_strided(a.dq, t, 0, pr.q_stride, bt, s.n_heads * s.head_dim),
          read_strided(a.dk, t, 0, pr.k_stride, bt, s.n_kv_heads * s.head_dim),
          read_strided(a.dv, t, 0, pr.v_stride, bt, s.n_kv_heads * s.head_dim)};
}

std::vector<double> random_vector(size_t n, uint32_t seed, DType t) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<double> r(n);
  float tmp = 0.f;  // room for one element of any dtype
  for (auto& x : r) {
    store_from_f32(&tmp, t, 0, nd(rng));
    x = load_as_f32(&tmp, t, 0);
  }
  return r;
}

// Every test runs on each instruction-set path this CPU has (the others skip).
class Attention : public ::testing::TestWithParam<cpu::AttentionIsa> {
 protected:
  void SetUp() override {
    if (!cpu::attention_isa_available(GetParam())) GTEST_SKIP() << "this CPU lacks the instruction set";
    cpu::set_attention_isa(GetParam());
  }
  void TearDown() override { cpu::set_attention_isa(cpu::AttentionIsa::best); }
};

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

INSTANTIATE_TEST_SUITE_P(Cpu, Attention,
                         ::testing::Values(cpu::AttentionIsa::portable, cpu::AttentionIsa::avx2, cpu::AttentionIsa::avx512),
                         [](const ::testing::TestParamInfo<cpu::AttentionIsa>& i) {
                           switch (i.param) {
                             case cpu::AttentionIsa::portable: return std::string("Portable");
                             case cpu::AttentionIsa::avx2: return std::string("Avx2");
                             case cpu::AttentionIsa::avx512: return std::string("Avx512");
                             default: return std::string("Best");
                           }
                         });

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
