// RoPE on the CPU backend: the rotate-half formula in float64 (theta = 10000, table built here),
// in place on q and k inside a fused qkv buffer (token_stride) with pos0 > 0, the backward as
// the finite-difference gradient of L = Σ w·rope(x), and forward∘backward = identity; per-token
// positions (pos) equal to pos0 + t bit for bit, and restarting per packed document.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/runtime.h"
#include "layer_test_util.h"

using namespace strata::kernels;
using namespace strata::kernels::test;

namespace {

constexpr double kTheta = 10000.0;

struct Table {
  std::vector<float> cos, sin;  // (max_pos, head_dim/2)
};
Table make_table(int64_t max_pos, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  Table t{std::vector<float>(max_pos * half), std::vector<float>(max_pos * half)};
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * std::pow(kTheta, -2.0 * static_cast<double>(i) / head_dim);
      t.cos[p * half + i] = static_cast<float>(std::cos(angle));
      t.sin[p * half + i] = static_cast<float>(std::sin(angle));
    }
  return t;
}

struct Layout {
  int64_t batch, seq, heads, head_dim, token_stride, offset, pos0;
};

// Float64 reference over the whole fused buffer: rotates the `heads` heads at `offset` of each
// token (position pos0 + s, or pos[b·seq + s]), leaves every other element alone.
std::vector<double> rope_ref(const Layout& l, std::vector<double> x, bool backward, const int32_t* pos = nullptr) {
  const int64_t half = l.head_dim / 2;
  for (int64_t b = 0; b < l.batch; ++b)
    for (int64_t s = 0; s < l.seq; ++s)
      for (int64_t h = 0; h < l.heads; ++h) {
        double* v = x.data() + (b * l.seq + s) * l.token_stride + l.offset + h * l.head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const double angle = static_cast<double>(pos ? pos[b * l.seq + s] : l.pos0 + s) *
                               std::pow(kTheta, -2.0 * static_cast<double>(i) / l.head_dim) * (backward ? -1 : 1);
          const double x1 = v[i], x2 = v[i + half];
          v[i] = x1 * std::cos(angle) - x2 * std::sin(angle);
          v[i + half] = x2 * std::cos(angle) + x1 * std::sin(angle);
        }
      }
  return x;
}

class RopeTest : public DtypeIsaTest {};

TEST_P(RopeTest, FusedQkvForwardBackwardAndRoundTrip) {
  const DType t = dtype();
  const double rtol = t == DType::f32 ? 1e-6 : (t == DType::bf16 ? 1e-2 : 2e-3);
  uint32_t seed = 1;
  for (int64_t head_dim : {2, 6, 64}) {
    const int64_t batch = 2, seq = 5, n_heads = 3, n_kv = 1, max_pos = 40, pos0 = 7;
    const int64_t token_stride = (n_heads + 2 * n_kv) * head_dim;  // [q | k | v] per token
    const int64_t n = batch * seq * token_stride;
    const Table table = make_table(max_pos, head_dim);
    const std::string what = "rope head_dim " + std::to_string(head_dim) + " " + std::string(dtype_name(t));
    TypedBuf qkv(t, random_vec(n, seed++, -3, 3));
    const auto x0 = qkv.values();
    const Layout lq{batch, seq, n_heads, head_dim, token_stride, 0, pos0};
    const Layout lk{batch, seq, n_kv, head_dim, token_stride, n_heads * head_dim, pos0};
    auto run = [&](TypedBuf& buf, const Layout& l, bool backward) {
      char* base = static_cast<char*>(buf.data()) + l.offset * dtype_size(t);
      cpu::rope({.dtype = t, .batch = l.batch, .seq = l.seq, .heads = l.heads, .head_dim = l.head_dim,
                 .token_stride = l.token_stride, .pos0 = l.pos0, .max_pos = max_pos, .x = base,
                 .cos = table.cos.data(), .sin = table.sin.data(), .backward = backward});
    };
    run(qkv, lq, false);
    run(qkv, lk, false);
    const auto want = rope_ref(lk, rope_ref(lq, x0, false), false);  // v untouched by both
    expect_close(qkv.values(), want, 1e-6, rtol, what + " forward");

    // Backward of L = Σ w·rope(x) is the inverse rotation of w.
    TypedBuf w(t, random_vec(n, seed++));
    const auto wv = w.values();
    const auto fd = finite_diff(x0, [&](const auto& v) { return dot(wv, rope_ref(lq, v, false)); });
    run(w, lq, true);
    expect_close(w.values(), fd, 1e-6, rtol, what + " backward");

    // Round trip: forward then backward returns the input (exactly up to fp32 rounding).
    if (t == DType::f32) {
      run(qkv, lq, true);
      run(qkv, lk, true);
      expect_close(qkv.values(), x0, 1e-6, 1e-6, what + " round trip");
    }
  }
}

TEST_P(RopeTest, PerTokenPositions) {
  const DType t = dtype();
  const double rtol = t == DType::f32 ? 1e-6 : (t == DType::bf16 ? 1e-2 : 2e-3);
  const int64_t batch = 2, seq = 11, heads = 3, head_dim = 16, max_pos = 40, token_stride = 4 * head_dim;
  const Table table = make_table(max_pos, head_dim);
  const auto x0 = random_vec(batch * seq * token_stride, 5, -3, 3);
  auto run = [&](TypedBuf& buf, int64_t pos0, const int32_t* pos, bool backward) {
    cpu::rope({.dtype = t, .batch = batch, .seq = seq, .heads = heads, .head_dim = head_dim,
               .token_stride = token_stride, .pos0 = pos0, .max_pos = max_pos, .x = buf.data(),
               .cos = table.cos.data(), .sin = table.sin.data(), .backward = backward, .pos = pos});
  };
  for (bool backward : {false, true}) {
    // pos = pos0 + t: the same bits as the pos0 path.
    const int64_t pos0 = 9;
    std::vector<int32_t> pos(batch * seq);
    for (int64_t i = 0; i < batch * seq; ++i) pos[i] = static_cast<int32_t>(pos0 + i % seq);
    TypedBuf by_pos0(t, x0), by_pos(t, x0);
    run(by_pos0, pos0, nullptr, backward);
    run(by_pos, 0, pos.data(), backward);
    EXPECT_EQ(by_pos0.values(), by_pos.values()) << "backward " << backward;

    // Packed documents: positions restart at 0 at each document's first token.
    const std::vector<int32_t> docs = {0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0,    // batch 0: lengths 3, 2, 5, 1
                                       0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2};  // batch 1: lengths 8, 3
    TypedBuf buf(t, x0);
    run(buf, 0, docs.data(), backward);
    const Layout l{batch, seq, heads, head_dim, token_stride, 0, 0};
    std::string what = "per-document rope ";
    what += dtype_name(t);
    what += backward ? " backward" : " forward";
    expect_close(buf.values(), rope_ref(l, TypedBuf(t, x0).values(), backward, docs.data()), 1e-6, rtol, what);
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, RopeTest, dtype_isa_values(), dtype_isa_name);

TEST(RopeOps, PositionsWithPos0IsAnError) {
  auto rt = make_runtime(Backend::cpu);
  auto stream = rt->create_stream();
  const Table table = make_table(8, 4);
  std::vector<float> x(2 * 4);
  const std::vector<int32_t> pos = {0, 1};
  try {
    rt->ops().rope(*stream, {.batch = 1, .seq = 2, .heads = 1, .head_dim = 4, .pos0 = 1, .max_pos = 8, .x = x.data(),
                             .cos = table.cos.data(), .sin = table.sin.data(), .pos = pos.data()});
    ADD_FAILURE() << "no error for pos with pos0 != 0";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("rope: ", 0), 0u) << msg;
    EXPECT_NE(msg.find("pos0"), std::string::npos) << msg;
  }
  stream->synchronize();
}

TEST(RopeOps, PackedLayoutAtPositionZeroIsIdentityOnFirstToken) {
  // token_stride 0 (packed): the first token (position 0, angle 0) is unchanged; the second moves.
  const int64_t heads = 2, head_dim = 8, seq = 2;
  const Table table = make_table(4, head_dim);
  auto x = random_vec(seq * heads * head_dim, 3);
  std::vector<float> xf(x.begin(), x.end()), orig = xf;
  cpu::rope({.batch = 1, .seq = seq, .heads = heads, .head_dim = head_dim, .max_pos = 4, .x = xf.data(),
             .cos = table.cos.data(), .sin = table.sin.data()});
  for (int64_t i = 0; i < heads * head_dim; ++i) EXPECT_EQ(xf[i], orig[i]) << i;
  EXPECT_NE(xf[heads * head_dim], orig[heads * head_dim]);
}

}  // namespace
