// CUDA causal GQA attention against the CPU backend: forward (out, lse) and backward (dq, dk, dv)
// on fused-qkv and padded strided layouts, sequence lengths that are not multiples of the tile,
// head dims on the tensor-core path (64, 128) and off it (40), every dtype, both kernel families
// (STRATA_CUDA_ATTENTION=simt forces the SIMT one), ldmatrix vs plain fragment loads bit for
// bit, and bitwise determinism of the backward (dk/dv are summed over a GQA group's query
// heads); the same with packed documents (seg_start), and KV-cache decoding (kv_seq > seq, spare
// cache capacity, left padding). Skips without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "tests/kernels/attention_test_util.h"
#include "tests/kernels/cuda_test_util.h"

using namespace strata::kernels;
using namespace strata::kernels::cudatest;

namespace {

struct Case {
  int64_t batch, seq, n_heads, n_kv_heads, head_dim;
  bool fused;       // q, k, v inside one (B, T, (Hq + 2·Hkv)·D) buffer
  int64_t pad;      // extra elements per token when not fused
  float scale;      // 0 = 1/sqrt(D)
  int64_t doc_min = 0, doc_max = 0;  // packed documents of these lengths (seg_start); 0 = causal
};

// q, k, v (and their gradients) in one host buffer with the case's layout.
struct Layout {
  int64_t q_stride, k_stride, v_stride, q_off, k_off, v_off, total;
  explicit Layout(const Case& c) {
    const int64_t BT = c.batch * c.seq, qw = c.n_heads * c.head_dim, kw = c.n_kv_heads * c.head_dim;
    if (c.fused) {
      q_stride = k_stride = v_stride = qw + 2 * kw;
      q_off = 0, k_off = qw, v_off = qw + kw, total = BT * q_stride;
    } else {
      q_stride = qw + c.pad, k_stride = kw + c.pad, v_stride = kw + c.pad;
      q_off = 0, k_off = BT * q_stride, v_off = k_off + BT * k_stride, total = v_off + BT * v_stride;
    }
  }
};

// Sets STRATA_CUDA_ATTENTION (the kernel family) for its lifetime; null leaves the default.
class AttentionImpl {
 public:
  explicit AttentionImpl(const char* value) : on_(value != nullptr) {
    if (on_) setenv("STRATA_CUDA_ATTENTION", value, 1);
  }
  ~AttentionImpl() {
    if (on_) unsetenv("STRATA_CUDA_ATTENTION");
  }
  AttentionImpl(const AttentionImpl&) = delete;
  AttentionImpl& operator=(const AttentionImpl&) = delete;

 private:
  bool on_;
};

HostBuf normal(DType t, size_t n, uint32_t seed) {
  HostBuf b(t, n);
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  for (size_t i = 0; i < n; ++i) b.set(i, d(rng));
  return b;
}

// Runs forward and backward on the GPU (impl: STRATA_CUDA_ATTENTION or null) and checks them
// against the CPU; returns the GPU's out and gradients for cross-implementation comparisons.
std::pair<HostBuf, HostBuf> check_case(DType t, const Case& c, const char* impl) {
  Gpu gpu;
  AttentionImpl use(impl);
  const Layout L(c);
  const size_t es = dtype_size(t);
  const int64_t BT = c.batch * c.seq, o_elems = BT * c.n_heads * c.head_dim;
  const std::string what = std::string(dtype_name(t)) + " B=" + std::to_string(c.batch) + " T=" +
                           std::to_string(c.seq) + " Hq=" + std::to_string(c.n_heads) + " Hkv=" +
                           std::to_string(c.n_kv_heads) + " D=" + std::to_string(c.head_dim) +
                           (c.fused ? " fused" : " strided") + (impl ? std::string(" ") + impl : "") +
                           (c.doc_max ? " documents" : "");
  HostBuf qkv = normal(t, static_cast<size_t>(L.total), 11);
  const std::vector<int32_t> seg =
      c.doc_max ? attntest::random_segments(c.batch, c.seq, c.doc_min, c.doc_max, 13) : std::vector<int32_t>{};
  DeviceBuffer dseg = gpu.up_bytes(seg.data(), seg.size() * sizeof(int32_t));
  const int32_t* cseg = seg.empty() ? nullptr : seg.data();
  const int32_t* gseg = seg.empty() ? nullptr : dseg.as<int32_t>();
  HostBuf out(t, o_elems), lse(DType::f32, c.batch * c.n_heads * c.seq);
  DeviceBuffer dqkv_in = gpu.up(qkv), dout_ = gpu.up(out), dlse = gpu.up(lse);

  auto fill = [&](auto& a, void* base, void* o, float* l, const int32_t* sg) {
    a.dtype = t, a.batch = c.batch, a.seq = c.seq, a.n_heads = c.n_heads, a.n_kv_heads = c.n_kv_heads,
    a.head_dim = c.head_dim, a.scale = c.scale;
    a.q = static_cast<char*>(base) + L.q_off * es, a.k = static_cast<char*>(base) + L.k_off * es,
    a.v = static_cast<char*>(base) + L.v_off * es;
    a.q_stride = L.q_stride, a.k_stride = L.k_stride, a.v_stride = L.v_stride;
    a.out = o, a.lse = l;
    a.seg_start = sg;
  };
  AttentionArgs ca, ga;
  fill(ca, qkv.data(), out.data(), lse.as<float>(), cseg);
  fill(ga, dqkv_in.data(), dout_.data(), dlse.as<float>(), gseg);
  cpu::attention(ca);
  gpu.ops().attention(gpu.stream(), ga);
  const double out_bound = t == DType::f32 ? 1e-10 : t == DType::f16 ? 2e-5 : 2e-4;
  const HostBuf gpu_out = gpu.down(dout_, out);
  EXPECT_NMSE(gpu_out, out, out_bound, "attention out " + what);
  EXPECT_NMSE(gpu.down(dlse, lse), lse, 1e-9, "attention lse " + what);

  // Backward from the CPU's out and lse on both sides, so only the backward is compared.
  HostBuf dout = normal(t, static_cast<size_t>(o_elems), 12);
  HostBuf grads(t, static_cast<size_t>(L.total));  // dq, dk, dv in the same layout, zero elsewhere
  DeviceBuffer d_o = gpu.up(out), d_lse = gpu.up(lse), d_do = gpu.up(dout), d_g = gpu.up(grads), d_g2 = gpu.up(grads);
  auto fill_b = [&](AttentionBackwardArgs& a, void* base, const void* o, const void* d_o_, const float* l, void* g,
                    const int32_t* sg) {
    AttentionArgs f;
    fill(f, base, nullptr, nullptr, sg);
    a.dtype = f.dtype, a.batch = f.batch, a.seq = f.seq, a.n_heads = f.n_heads, a.n_kv_heads = f.n_kv_heads,
    a.head_dim = f.head_dim, a.scale = f.scale, a.q = f.q, a.k = f.k, a.v = f.v, a.q_stride = f.q_stride,
    a.k_stride = f.k_stride, a.v_stride = f.v_stride, a.seg_start = f.seg_start;
    a.out = o, a.dout = d_o_, a.lse = l;
    a.dq = static_cast<char*>(g) + L.q_off * es, a.dk = static_cast<char*>(g) + L.k_off * es,
    a.dv = static_cast<char*>(g) + L.v_off * es;
  };
  AttentionBackwardArgs cb, gb, gb2;
  fill_b(cb, qkv.data(), out.data(), dout.data(), lse.as<float>(), grads.data(), cseg);
  fill_b(gb, dqkv_in.data(), d_o.data(), d_do.data(), d_lse.as<float>(), d_g.data(), gseg);
  fill_b(gb2, dqkv_in.data(), d_o.data(), d_do.data(), d_lse.as<float>(), d_g2.data(), gseg);
  cpu::attention_backward(cb);
  gpu.ops().attention_backward(gpu.stream(), gb);
  gpu.ops().attention_backward(gpu.stream(), gb2);
  const HostBuf got = gpu.down(d_g, grads);
  const double grad_bound = t == DType::f32 ? 1e-9 : t == DType::f16 ? 1e-4 : 1e-3;
  EXPECT_NMSE(got, grads, grad_bound, "attention dq/dk/dv " + what);
  EXPECT_TRUE(bitwise_equal(gpu.down(d_g2, grads), got)) << "attention backward is not bitwise reproducible: " << what;
  return {gpu_out, got};
}

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {2, 77, 4, 2, 64, true, 0, 0.f},      // tensor cores: tail tile, GQA 2, fused qkv
      {1, 130, 4, 1, 128, false, 8, 0.f},   // tensor cores: GQA 4 (MQA), padded strides
      {1, 64, 2, 2, 128, true, 0, 0.3f},    // exactly one tile, explicit scale
      {2, 33, 3, 3, 40, true, 0, 0.f},      // SIMT: head_dim off the tensor-core path
      {1, 200, 2, 1, 64, false, 0, 0.f},    // several query tiles per key tile, packed views
      // Packed documents: tiles skipped, partial tiles masked, single-token documents.
      {2, 300, 4, 2, 64, true, 0, 0.f, 5, 90},
      {1, 260, 4, 1, 128, false, 8, 0.f, 1, 140},
      {2, 77, 3, 3, 40, true, 0, 0.f, 2, 30},  // SIMT
  };
  return c;
}

class CudaAttentionTest : public ::testing::TestWithParam<DType> {};
INSTANTIATE_TEST_SUITE_P(DTypes, CudaAttentionTest, ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         dtype_param_name);

TEST_P(CudaAttentionTest, ForwardBackwardMatchCpuAndBackwardIsDeterministic) {
  STRATA_SKIP_WITHOUT_CUDA();
  for (const Case& c : cases()) check_case(GetParam(), c, nullptr);
}

TEST_P(CudaAttentionTest, SimtKernelsMatchCpu) {
  STRATA_SKIP_WITHOUT_CUDA();
  if (GetParam() == DType::f32) GTEST_SKIP() << "fp32 always runs the SIMT kernels (covered above)";
  for (const Case& c : cases()) check_case(GetParam(), c, "simt");
}

// The tensor-core kernels load fragments with ldmatrix by default; with plain shared loads
// (mma_plain) the fragments, hence every output bit, must be the same.
TEST_P(CudaAttentionTest, LdmatrixFragmentsMatchPlainLoadsBitForBit) {
  STRATA_SKIP_WITHOUT_CUDA();
  if (GetParam() == DType::f32) GTEST_SKIP() << "fp32 has no tensor-core path";
  for (const Case& c : cases()) {
    if (c.head_dim != 64 && c.head_dim != 128) continue;
    const auto [out_ldm, grads_ldm] = check_case(GetParam(), c, nullptr);
    const auto [out_plain, grads_plain] = check_case(GetParam(), c, "mma_plain");
    EXPECT_TRUE(bitwise_equal(out_ldm, out_plain)) << "forward: ldmatrix and plain loads differ, D=" << c.head_dim;
    EXPECT_TRUE(bitwise_equal(grads_ldm, grads_plain)) << "backward: ldmatrix and plain loads differ, D=" << c.head_dim;
  }
}

// A longer causal sequence over several key tiles, where the online softmax rescales often.
TEST(CudaAttention, LongSequenceBf16) {
  STRATA_SKIP_WITHOUT_CUDA();
  check_case(DType::bf16, {1, 700, 4, 2, 128, true, 0, 0.f}, nullptr);
}

// KV-cache decoding (kv_seq > seq) on the GPU against the CPU: packed and spare-capacity caches
// (kv_batch_stride; rows past kv_seq hold NaN and must never be read), left padding (seg_start),
// one new token and a chunk of new tokens, both kernel families.
TEST_P(CudaAttentionTest, KvCacheDecodingMatchesCpu) {
  STRATA_SKIP_WITHOUT_CUDA();
  const DType t = GetParam();
  for (const char* impl : {static_cast<const char*>(nullptr), "simt"})
    for (int64_t n_new : {1, 37})
      for (int64_t cap : {0, 136})
        for (int64_t head_dim : {64, 40}) {
          Gpu gpu;
          AttentionImpl use(impl);
          const attntest::Shape s{3, n_new, 4, 2, head_dim, false, 0, 0.f, 120, cap};
          attntest::Problem pr(s, t, 21);
          for (int64_t b = 0; b < s.batch; ++b)  // batch item b is left-padded by 25·b tokens
            for (int64_t i = 0; i < n_new; ++i) pr.seg.push_back(static_cast<int32_t>(25 * b));
          const std::string what = std::string(dtype_name(t)) + " decode new=" + std::to_string(n_new) +
                                   " cap=" + std::to_string(cap) + " D=" + std::to_string(head_dim) +
                                   (impl ? " simt" : "");
          HostBuf out(t, pr.out_elems()), lse(DType::f32, pr.lse_elems());
          cpu::attention(pr.forward_args(out.data(), lse.as<float>()));
          DeviceBuffer dqkv = gpu.up_bytes(pr.qkv.data(), pr.qkv.size()), dout = gpu.up(out), dlse = gpu.up(lse);
          DeviceBuffer dseg = gpu.up_bytes(pr.seg.data(), pr.seg.size() * sizeof(int32_t));
          AttentionArgs a = pr.forward_args(dout.data(), dlse.as<float>());
          const size_t es = dtype_size(t);
          a.q = static_cast<char*>(dqkv.data()) + pr.q_off * es, a.k = static_cast<char*>(dqkv.data()) + pr.k_off * es,
          a.v = static_cast<char*>(dqkv.data()) + pr.v_off * es, a.seg_start = dseg.as<int32_t>();
          gpu.ops().attention(gpu.stream(), a);
          const double out_bound = t == DType::f32 ? 1e-10 : t == DType::f16 ? 2e-5 : 2e-4;
          EXPECT_NMSE(gpu.down(dout, out), out, out_bound, "attention out " + what);
          EXPECT_NMSE(gpu.down(dlse, lse), lse, 1e-9, "attention lse " + what);
        }
}

}  // namespace
