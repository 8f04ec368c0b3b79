// Google Benchmarks of the CPU op set at GPT-2-124M shapes, each next to its reference:
// cpu::matmul vs a bare oneDNN primitive (GFLOP/s), cpu::adamw vs the plain OpenMP loop built
// with -march=native (params/s), plus attention, cross-entropy and the memory-bound ops.
// Ops not implemented in this build report SkipWithError instead of failing the run.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <random>
#include <vector>

#include "bench/reference/reference.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"

using namespace strata::kernels;

namespace {

// GPT-2-124M at 256 tokens: qkv, mlp up, mlp down projections; (m, k, n).
constexpr int64_t kShapes[][3] = {{256, 768, 2304}, {256, 768, 3072}, {256, 3072, 768}};

std::vector<uint16_t> random_bits(int64_t n, DType t, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<uint16_t> v(n * dtype_size(t) / 2);
  for (int64_t i = 0; i < n; ++i) store_from_f32(v.data(), t, i, d(rng));
  return v;
}

// Runs fn in the benchmark loop; an op that throws (not implemented yet) skips the case.
template <class F>
void run_guarded(benchmark::State& state, F&& fn) {
  for (auto _ : state) {
    try {
      fn();
    } catch (const std::exception& e) {
      state.SkipWithError(e.what());
      break;
    }
  }
}

void set_flops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iter * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

// args: shape index, bf16 (0/1), strata (1) or bare oneDNN (0).
void BM_Matmul(benchmark::State& state) {
  const auto& s = kShapes[state.range(0)];
  const int64_t m = s[0], k = s[1], n = s[2];
  const DType t = state.range(1) ? DType::bf16 : DType::f32;
  auto a = random_bits(m * k, t, 1), b = random_bits(k * n, t, 2);
  std::vector<float> c(m * n);
  if (state.range(2)) {
    MatmulArgs args;
    args.a = a.data(), args.b = b.data(), args.c = c.data(), args.ab_dtype = t, args.m = m, args.n = n, args.k = k;
    cpu::matmul(args);  // build the primitive outside the timed loop
    run_guarded(state, [&] { cpu::matmul(args); });
  } else {
    strata::bench_ref::OnednnMatmul ref(m, n, k, t == DType::bf16);
    ref.run(a.data(), b.data(), c.data());
    state.SetLabel(ref.impl());
    run_guarded(state, [&] { ref.run(a.data(), b.data(), c.data()); });
  }
  set_flops(state, 2.0 * m * n * k);
}
BENCHMARK(BM_Matmul)
    ->ArgNames({"shape", "bf16", "strata"})
    ->ArgsProduct({{0, 1, 2}, {0, 1}, {1, 0}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// 100M fp32 params with m, v (and a grad), allocated and touched once for all AdamW cases.
struct AdamState {
  static constexpr int64_t n = 100'000'000;
  std::vector<float> p, g, m, v;
  std::vector<uint16_t> g_bf16;
  AdamState() : p(n, 0.5f), g(n, 1e-3f), m(n, 0.f), v(n, 0.f), g_bf16(n, f32_to_bf16(1e-3f)) {}
  static AdamState& get() {
    static AdamState s;
    return s;
  }
};

// args: bf16 grads (0/1), strata (1) or plain OpenMP loop (0).
void BM_AdamW100M(benchmark::State& state) {
  AdamState& s = AdamState::get();
  const bool bf16 = state.range(0) != 0;
  int64_t step = 1;
  if (state.range(1)) {
    AdamWArgs a;
    a.n = s.n, a.param = s.p.data(), a.m = s.m.data(), a.v = s.v.data(), a.weight_decay = 0.1f;
    a.grad = bf16 ? static_cast<const void*>(s.g_bf16.data()) : s.g.data();
    a.grad_dtype = bf16 ? DType::bf16 : DType::f32;
    run_guarded(state, [&] {
      a.step = step++;
      cpu::adamw(a);
    });
  } else {
    const void* g = bf16 ? static_cast<const void*>(s.g_bf16.data()) : s.g.data();
    run_guarded(state, [&] {
      strata::bench_ref::adamw_plain_omp(s.n, s.p.data(), g, bf16, s.m.data(), s.v.data(), 1e-3f, 0.9f, 0.999f,
                                         1e-8f, 0.1f, step++, cpu::num_threads());
    });
  }
  state.counters["params/s"] =
      benchmark::Counter(double(s.n) * double(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AdamW100M)
    ->ArgNames({"bf16grad", "strata"})
    ->ArgsProduct({{0, 1}, {1, 0}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(2.0);

// Memory-bound ops over 16M elements.
void BM_Cast(benchmark::State& state) {
  const int64_t n = int64_t{1} << 24;
  const DType s = static_cast<DType>(state.range(0)), d = static_cast<DType>(state.range(1));
  auto src = random_bits(n, s, 3);
  std::vector<uint16_t> dst(n * dtype_size(d) / 2);
  CastArgs a{n, src.data(), s, dst.data(), d};
  run_guarded(state, [&] { cpu::cast(a); });
  state.SetBytesProcessed(int64_t(state.iterations()) * n * int64_t(dtype_size(s) + dtype_size(d)));
}
BENCHMARK(BM_Cast)
    ->ArgNames({"src", "dst"})
    ->Args({0, 1})
    ->Args({1, 0})
    ->Args({0, 2})
    ->Args({2, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_SumSquares(benchmark::State& state) {
  const int64_t n = int64_t{1} << 24;
  auto x = random_bits(n, DType::f32, 4);
  double out = 0;
  run_guarded(state, [&] { cpu::sum_squares({DType::f32, n, x.data(), &out}); });
  benchmark::DoNotOptimize(out);
  state.SetBytesProcessed(int64_t(state.iterations()) * n * 4);
}
BENCHMARK(BM_SumSquares)->Unit(benchmark::kMillisecond)->UseRealTime();

// Causal attention, GPT-2 heads: B=4, T=256, 12 heads of 64; fp32.
void BM_Attention(benchmark::State& state) {
  const int64_t B = 4, T = 256, H = 12, D = 64;
  auto q = random_bits(B * T * H * D, DType::f32, 5), k = random_bits(B * T * H * D, DType::f32, 6),
       v = random_bits(B * T * H * D, DType::f32, 7);
  std::vector<float> out(B * T * H * D), lse(B * H * T);
  AttentionArgs a;
  a.batch = B, a.seq = T, a.n_heads = H, a.n_kv_heads = H, a.head_dim = D;
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out.data(), a.lse = lse.data();
  run_guarded(state, [&] { cpu::attention(a); });
  set_flops(state, 2.0 * B * H * T * T * D);  // QKᵀ and PV, causal half
}
BENCHMARK(BM_Attention)->Unit(benchmark::kMillisecond)->UseRealTime();

// Fused softmax-cross-entropy, forward and backward in place, 256 rows of 50,257 fp32 logits.
void BM_CrossEntropy(benchmark::State& state) {
  const int64_t rows = 256, vocab = 50257;
  auto logits = random_bits(rows * vocab, DType::f32, 8);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>((r * 7919) % vocab);
  std::vector<float> losses(rows);
  CrossEntropyArgs a;
  a.rows = rows, a.vocab = vocab, a.logits = logits.data(), a.targets = targets.data(), a.losses = losses.data();
  a.dlogits = logits.data(), a.grad_scale = 1.f / rows;
  run_guarded(state, [&] { cpu::cross_entropy(a); });
  state.SetBytesProcessed(int64_t(state.iterations()) * rows * vocab * 8);
}
BENCHMARK(BM_CrossEntropy)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
