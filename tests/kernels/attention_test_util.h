// Shared by the CPU attention tests: a problem (q, k, v stored in a dtype, separate, strided or
// fused, with float64 copies of the stored values), the float64 reference forward and backward
// over each query's key window [seg_start, kv_seq - seq + i], error measures, and the fixture
// that runs a test on every instruction-set path this CPU has.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/dtype.h"
#include "kernels/ops.h"

namespace strata::kernels::attntest {

struct Shape {
  int64_t batch, seq, n_heads, n_kv_heads, head_dim;
  bool fused;          // q, k, v inside one (B, T, (Hq + 2·Hkv)·D) buffer
  int64_t pad = 0;     // extra elements per token when not fused (strided, not packed)
  float scale = 0.f;   // 0 = 1/sqrt(D), as in the op
  int64_t kv_seq = 0;  // keys per batch item (0 = seq); not fused when set
  int64_t kv_cap = 0;  // tokens of k/v storage per batch item (0 = kv_seq): kv_batch_stride
};
inline double scale_of(const Shape& s) {
  return s.scale > 0.f ? s.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
}
inline int64_t kv_seq_of(const Shape& s) { return s.kv_seq ? s.kv_seq : s.seq; }

// One problem: q, k, v stored in `dtype` (separate or fused), plus float64 copies of exactly the
// stored values, which is what the reference sees. Cache rows past kv_seq hold NaN (never read).
struct Problem {
  Shape s;
  DType dtype;
  int64_t q_stride, k_stride, v_stride;  // elements between tokens (never 0 here)
  std::vector<uint8_t> qkv;              // storage of q, k, v
  int64_t q_off, k_off, v_off;           // element offsets of head 0, token 0
  std::vector<double> q, k, v;           // (B, T, Hq, D), (B, kv_seq, Hkv, D) packed, the stored values
  std::vector<int32_t> seg;              // (B, T) seg_start, empty = none

  Problem(Shape shape, DType t, uint32_t seed) : s(shape), dtype(t) {
    const int64_t B = s.batch, T = s.seq, Tk = kv_seq_of(s), cap = s.kv_cap ? s.kv_cap : Tk, D = s.head_dim;
    const int64_t qw = s.n_heads * D, kw = s.n_kv_heads * D;
    if (s.fused) {
      q_stride = k_stride = v_stride = qw + 2 * kw;
      q_off = 0, k_off = qw, v_off = qw + kw;
    } else {
      q_stride = qw + s.pad, k_stride = kw + s.pad, v_stride = kw + s.pad;
      q_off = 0, k_off = B * T * q_stride, v_off = k_off + B * cap * k_stride;
    }
    const int64_t total = s.fused ? B * T * q_stride : v_off + B * cap * v_stride;
    qkv.assign(static_cast<size_t>(total) * dtype_size(t), 0);
    if (cap > Tk)
      for (int64_t i = k_off; i < total; ++i) store_from_f32(qkv.data(), t, static_cast<size_t>(i), NAN);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto fill = [&](std::vector<double>& dst, int64_t off, int64_t stride, int64_t heads, int64_t tokens,
                    int64_t per_batch) {
      dst.resize(static_cast<size_t>(B * tokens * heads * D));
      for (int64_t bt = 0; bt < B * tokens; ++bt)
        for (int64_t c = 0; c < heads * D; ++c) {
          const size_t at = static_cast<size_t>(off + (bt / tokens * per_batch + bt % tokens) * stride + c);
          store_from_f32(qkv.data(), t, at, nd(rng));
          dst[static_cast<size_t>(bt * heads * D + c)] = load_as_f32(qkv.data(), t, at);
        }
    };
    fill(q, q_off, q_stride, s.n_heads, T, T);
    fill(k, k_off, k_stride, s.n_kv_heads, Tk, cap);
    fill(v, v_off, v_stride, s.n_kv_heads, Tk, cap);
  }
  const void* at(int64_t off) const { return qkv.data() + off * dtype_size(dtype); }
  const int32_t* seg_start() const { return seg.empty() ? nullptr : seg.data(); }
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
    a.kv_seq = s.kv_seq;
    a.kv_batch_stride = s.kv_cap ? s.kv_cap * k_stride : 0;
    a.seg_start = seg_start();
    return a;
  }
};

// Packed documents: each batch item's seq tokens cut into documents of lengths drawn from
// [min_len, max_len] (the last one cut short); seg_start of a token = its document's start.
inline std::vector<int32_t> random_segments(int64_t batch, int64_t seq, int64_t min_len, int64_t max_len,
                                            uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> len(min_len, max_len);
  std::vector<int32_t> seg(static_cast<size_t>(batch * seq));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t start = 0; start < seq;) {
      const int64_t end = std::min(seq, start + len(rng));
      for (int64_t t = start; t < end; ++t) seg[static_cast<size_t>(b * seq + t)] = static_cast<int32_t>(start);
      start = end;
    }
  return seg;
}

// The keys [lo, hi] query i of batch b sees (hi = its own position).
struct Window {
  int64_t lo, hi;
};
inline Window window_of(const Shape& s, const int32_t* seg, int64_t b, int64_t i) {
  return {seg ? seg[b * s.seq + i] : 0, kv_seq_of(s) - s.seq + i};
}

// Float64 reference forward: full softmax over each query's window. q (B, T, Hq, D), k, v
// (B, kv_seq, Hkv, D) packed.
inline void reference_forward(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, std::vector<double>& out, std::vector<double>& lse,
                              const int32_t* seg = nullptr) {
  const int64_t B = s.batch, T = s.seq, Tk = kv_seq_of(s), H = s.n_heads, Hkv = s.n_kv_heads, D = s.head_dim,
                G = H / Hkv;
  const double scale = scale_of(s);
  out.assign(static_cast<size_t>(B * T * H * D), 0.0);
  lse.assign(static_cast<size_t>(B * H * T), 0.0);
  std::vector<double> p(static_cast<size_t>(Tk));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const Window w = window_of(s, seg, b, i);
        const double* qi = &q[static_cast<size_t>(((b * T + i) * H + h) * D)];
        double m = -INFINITY;
        for (int64_t j = w.lo; j <= w.hi; ++j) {
          const double* kj = &k[static_cast<size_t>(((b * Tk + j) * Hkv + h / G) * D)];
          double dotp = 0;
          for (int64_t c = 0; c < D; ++c) dotp += qi[c] * kj[c];
          p[j] = dotp * scale;
          m = std::max(m, p[j]);
        }
        double l = 0;
        for (int64_t j = w.lo; j <= w.hi; ++j) l += (p[j] = std::exp(p[j] - m));
        double* oi = &out[static_cast<size_t>(((b * T + i) * H + h) * D)];
        for (int64_t j = w.lo; j <= w.hi; ++j) {
          const double* vj = &v[static_cast<size_t>(((b * Tk + j) * Hkv + h / G) * D)];
          for (int64_t c = 0; c < D; ++c) oi[c] += p[j] / l * vj[c];
        }
        lse[static_cast<size_t>((b * H + h) * T + i)] = m + std::log(l);
      }
}

// Float64 analytic backward of out given dout (packed like out); keys are the queries.
inline void reference_backward(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
                               const std::vector<double>& v, const std::vector<double>& dout, std::vector<double>& dq,
                               std::vector<double>& dk, std::vector<double>& dv, const int32_t* seg = nullptr) {
  const int64_t B = s.batch, T = s.seq, H = s.n_heads, Hkv = s.n_kv_heads, D = s.head_dim, G = H / Hkv;
  const double scale = scale_of(s);
  dq.assign(q.size(), 0.0), dk.assign(k.size(), 0.0), dv.assign(v.size(), 0.0);
  std::vector<double> p(static_cast<size_t>(T)), dp(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const Window w = window_of(s, seg, b, i);
        const size_t qi = static_cast<size_t>(((b * T + i) * H + h) * D);
        double m = -INFINITY;
        for (int64_t j = w.lo; j <= w.hi; ++j) {
          const size_t kj = static_cast<size_t>(((b * T + j) * Hkv + h / G) * D);
          double dotp = 0, dpj = 0;
          for (int64_t c = 0; c < D; ++c) dotp += q[qi + c] * k[kj + c], dpj += dout[qi + c] * v[kj + c];
          p[j] = dotp * scale, dp[j] = dpj;
          m = std::max(m, p[j]);
        }
        double l = 0;
        for (int64_t j = w.lo; j <= w.hi; ++j) l += (p[j] = std::exp(p[j] - m));
        double delta = 0;
        for (int64_t j = w.lo; j <= w.hi; ++j) delta += (p[j] /= l) * dp[j];
        for (int64_t j = w.lo; j <= w.hi; ++j) {
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
inline double normalised_error(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0, mag = 1e-3;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::abs(got[i] - want[i]);
    if (!(d <= err)) err = std::isnan(d) ? INFINITY : d;  // a NaN (e.g. an unwritten element) must fail
    mag = std::max(mag, std::abs(want[i]));
  }
  return err / mag;
}

inline std::vector<double> read_packed(const void* p, DType t, size_t n) {
  std::vector<double> r(n);
  for (size_t i = 0; i < n; ++i) r[i] = load_as_f32(p, t, i);
  return r;
}
// Reads (B, T, heads, D) out of a strided buffer at element offset `off`.
inline std::vector<double> read_strided(const void* p, DType t, int64_t off, int64_t stride, int64_t bt,
                                        int64_t width) {
  std::vector<double> r(static_cast<size_t>(bt * width));
  for (int64_t i = 0; i < bt; ++i)
    for (int64_t c = 0; c < width; ++c)
      r[static_cast<size_t>(i * width + c)] = load_as_f32(p, t, static_cast<size_t>(off + i * stride + c));
  return r;
}

struct BackwardResult {
  std::vector<double> dq, dk, dv;
};
// Runs the kernel forward then backward with dout = w (stored in the problem's dtype).
inline BackwardResult run_backward(const Problem& pr, const std::vector<double>& w) {
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
  a.seg_start = pr.seg_start();
  cpu::attention_backward(a);
  const Shape& s = pr.s;
  const int64_t bt = s.batch * s.seq;
  return {read_strided(a.dq, t, 0, pr.q_stride, bt, s.n_heads * s.head_dim),
          read_strided(a.dk, t, 0, pr.k_stride, bt, s.n_kv_heads * s.head_dim),
          read_strided(a.dv, t, 0, pr.v_stride, bt, s.n_kv_heads * s.head_dim)};
}

inline std::vector<double> random_vector(size_t n, uint32_t seed, DType t) {
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

// Runs each test on one instruction-set path (skipped where this CPU lacks it).
class AttentionIsaTest : public ::testing::TestWithParam<cpu::AttentionIsa> {
 protected:
  void SetUp() override {
    if (!cpu::attention_isa_available(GetParam())) GTEST_SKIP() << "this CPU lacks the instruction set";
    cpu::set_attention_isa(GetParam());
  }
  void TearDown() override { cpu::set_attention_isa(cpu::AttentionIsa::best); }
};
inline auto attention_isa_values() {
  return ::testing::Values(cpu::AttentionIsa::portable, cpu::AttentionIsa::avx2, cpu::AttentionIsa::avx512);
}
inline std::string attention_isa_name(const ::testing::TestParamInfo<cpu::AttentionIsa>& i) {
  switch (i.param) {
    case cpu::AttentionIsa::portable: return "Portable";
    case cpu::AttentionIsa::avx2: return "Avx2";
    case cpu::AttentionIsa::avx512: return "Avx512";
    default: return "Best";
  }
}

}  // namespace strata::kernels::attntest
