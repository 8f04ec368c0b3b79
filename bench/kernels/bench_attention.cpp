// CPU causal attention throughput at model shapes (GPT-2 124M, a Llama-style GQA layer), forward
// and backward, fp32 and bf16, the best path against the portable and AVX2 ones. FLOP/s counts the useful
// causal work: forward 2 matmuls (2·B·H·T²·D), backward 5 (5·B·H·T²·D; FA2 recomputes S). And
// packed documents (seg_start) against dense causal attention at T = 2048, forward + backward.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/dtype.h"

using namespace strata::kernels;

namespace {

struct Setup {
  int64_t batch, seq, n_heads, n_kv_heads, head_dim;
};
constexpr Setup kShapes[] = {
    {4, 256, 12, 12, 64},   // GPT-2 124M, T = 256
    {4, 1024, 12, 12, 64},  // GPT-2 124M, T = 1024
    {1, 1024, 32, 8, 128},  // Llama-3-8B-like layer, GQA 4:1
};

// A fused qkv buffer (random), its gradient, out, dout and lse, and the op arguments over them.
struct Problem {
  std::vector<uint8_t> qkv, dqkv, out, dout;
  std::vector<float> lse;
  AttentionArgs f;
  AttentionBackwardArgs b;
  Problem(const Setup& s, DType t);
};

Problem::Problem(const Setup& s, DType t) {
  const int64_t width = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim;  // fused qkv row
  const size_t esz = dtype_size(t);
  const size_t n_qkv = static_cast<size_t>(s.batch * s.seq * width);
  const size_t n_out = static_cast<size_t>(s.batch * s.seq * s.n_heads * s.head_dim);
  qkv.resize(n_qkv * esz), dqkv.resize(n_qkv * esz), out.resize(n_out * esz), dout.resize(n_out * esz);
  lse.resize(static_cast<size_t>(s.batch * s.n_heads * s.seq));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t i = 0; i < n_qkv; ++i) store_from_f32(qkv.data(), t, i, nd(rng));
  for (size_t i = 0; i < n_out; ++i) store_from_f32(dout.data(), t, i, nd(rng));

  f.dtype = t, f.batch = s.batch, f.seq = s.seq, f.n_heads = s.n_heads, f.n_kv_heads = s.n_kv_heads;
  f.head_dim = s.head_dim;
  f.q = qkv.data(), f.k = qkv.data() + s.n_heads * s.head_dim * esz;
  f.v = qkv.data() + (s.n_heads + s.n_kv_heads) * s.head_dim * esz;
  f.q_stride = f.k_stride = f.v_stride = width;
  f.out = out.data(), f.lse = lse.data();
  b.dtype = t, b.batch = f.batch, b.seq = f.seq, b.n_heads = f.n_heads, b.n_kv_heads = f.n_kv_heads;
  b.head_dim = f.head_dim, b.q = f.q, b.k = f.k, b.v = f.v;
  b.q_stride = b.k_stride = b.v_stride = width;
  b.out = out.data(), b.dout = dout.data(), b.lse = lse.data();
  b.dq = dqkv.data(), b.dk = dqkv.data() + s.n_heads * s.head_dim * esz;
  b.dv = dqkv.data() + (s.n_heads + s.n_kv_heads) * s.head_dim * esz;
}

// State args: shape index, dtype (0 = fp32, 1 = bf16), isa (0 = best, 1 = portable, 2 = avx2).
void run(benchmark::State& state, bool backward) {
  const Setup s = kShapes[state.range(0)];
  const DType t = state.range(1) == 0 ? DType::f32 : DType::bf16;
  const cpu::AttentionIsa isas[] = {cpu::AttentionIsa::best, cpu::AttentionIsa::portable, cpu::AttentionIsa::avx2};
  if (!cpu::attention_isa_available(isas[state.range(2)])) {
    state.SkipWithError("this CPU lacks the instruction set");
    return;
  }
  cpu::set_attention_isa(isas[state.range(2)]);
  Problem p(s, t);
  const AttentionArgs& f = p.f;
  const AttentionBackwardArgs& b = p.b;
  cpu::attention(f);
  for (auto _ : state) {
    if (backward)
      cpu::attention_backward(b);
    else
      cpu::attention(f);
    benchmark::ClobberMemory();
  }
  const double causal = static_cast<double>(s.batch * s.n_heads) * static_cast<double>(s.seq * s.seq) * s.head_dim;
  state.counters["FLOP/s"] = benchmark::Counter((backward ? 5.0 : 2.0) * causal * state.iterations(),
                                                benchmark::Counter::kIsRate);
  cpu::set_attention_isa(cpu::AttentionIsa::best);
}

void BM_AttentionForward(benchmark::State& state) { run(state, false); }
void BM_AttentionBackward(benchmark::State& state) { run(state, true); }

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "bf16", "isa"});
  for (int64_t shape = 0; shape < 3; ++shape)
    for (int64_t dt = 0; dt < 2; ++dt)
      for (int64_t isa = 0; isa < 3; ++isa) b->Args({shape, dt, isa});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

// seg_start of documents with lengths uniform in [lo, hi] packed into seq tokens (the last cut short).
std::vector<int32_t> pack_documents(int64_t seq, int64_t lo, int64_t hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> length(lo, hi);
  std::vector<int32_t> seg;
  while (static_cast<int64_t>(seg.size()) < seq) {
    const auto start = static_cast<int64_t>(seg.size());
    seg.resize(static_cast<size_t>(std::min(seq, start + length(rng))), static_cast<int32_t>(start));
  }
  return seg;
}

// Forward + backward at T = 2048 (GPT-2 heads: 12 × 64), dense causal (docs 0) or documents of
// 30–600 tokens (docs 1, seed 7), fp32 or bf16, the best path. FLOP/s counts dense causal work
// in both, so it shows the speed-up; "seen" is the fraction of causal (query, key) pairs attended.
void BM_AttentionDocuments(benchmark::State& state) {
  const Setup s{1, 2048, 12, 12, 64};
  Problem p(s, state.range(0) == 0 ? DType::f32 : DType::bf16);
  const std::vector<int32_t> seg = pack_documents(s.seq, 30, 600, 7);
  if (state.range(1)) p.f.seg_start = p.b.seg_start = seg.data();
  double seen = 0;
  for (int64_t t = 0; t < s.seq; ++t)
    seen += static_cast<double>(t + 1 - (state.range(1) ? seg[static_cast<size_t>(t)] : 0));
  for (auto _ : state) {
    cpu::attention(p.f);
    cpu::attention_backward(p.b);
    benchmark::ClobberMemory();
  }
  const double causal = static_cast<double>(s.batch * s.n_heads) * static_cast<double>(s.seq * s.seq) * s.head_dim;
  state.counters["FLOP/s"] = benchmark::Counter(7.0 * causal * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["seen"] = seen / (static_cast<double>(s.seq) * static_cast<double>(s.seq + 1) / 2);
}

}  // namespace

BENCHMARK(BM_AttentionForward)->Apply(shapes);
BENCHMARK(BM_AttentionBackward)->Apply(shapes);
BENCHMARK(BM_AttentionDocuments)
    ->ArgNames({"bf16", "docs"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
