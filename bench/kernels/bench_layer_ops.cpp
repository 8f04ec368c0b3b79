// Throughput of the CPU layer ops that are memory-bound at model sizes: the fused cross-entropy
// over GPT-2's 50,257-way vocab (in place, the training configuration), RMSNorm/LayerNorm
// forward+backward, and SwiGLU. bytes_per_second counts the bytes each op must move once.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/dtype.h"

using namespace strata::kernels;

namespace {

std::vector<uint16_t> random_bits(DType t, size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<uint16_t> v(n * dtype_size(t) / 2);
  for (size_t i = 0; i < n; ++i) store_from_f32(v.data(), t, i, d(rng));
  return v;
}

// args: rows, dtype (0 fp32, 1 bf16). In place: reads the row, writes dlogits over it.
void BM_CrossEntropyGpt2Vocab(benchmark::State& state) {
  const int64_t rows = state.range(0), vocab = 50257;
  const DType t = static_cast<DType>(state.range(1));
  auto logits = random_bits(t, rows * vocab, 1, -10.f, 10.f);
  const auto fresh = logits;
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>((r * 7919) % vocab);
  std::vector<float> losses(rows);
  for (auto _ : state) {
    cpu::cross_entropy({.dtype = t, .rows = rows, .vocab = vocab, .logits = logits.data(), .targets = targets.data(),
                        .losses = losses.data(), .dlogits = logits.data(), .grad_scale = 1.f / rows});
    state.PauseTiming();
    logits = fresh;
    state.ResumeTiming();
  }
  state.SetBytesProcessed(state.iterations() * rows * vocab * static_cast<int64_t>(dtype_size(t)) * 2);
  state.SetItemsProcessed(state.iterations() * rows);
}
BENCHMARK(BM_CrossEntropyGpt2Vocab)->Args({64, 0})->Args({64, 1})->Unit(benchmark::kMillisecond)->UseRealTime();

// args: rows, cols, dtype, layernorm.
void BM_NormForwardBackward(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const DType t = static_cast<DType>(state.range(2));
  const bool layernorm = state.range(3) != 0;
  auto x = random_bits(t, rows * cols, 1, -2.f, 2.f), w = random_bits(t, cols, 2, 0.5f, 1.5f);
  auto dy = random_bits(t, rows * cols, 3, -1.f, 1.f);
  auto y = x, dx = x, b = w;
  std::vector<float> mean(rows), rstd(rows), dw(cols), db(cols);
  for (auto _ : state) {
    NormArgs f{.dtype = t, .rows = rows, .cols = cols, .x = x.data(), .weight = w.data(),
               .bias = layernorm ? b.data() : nullptr, .y = y.data(), .mean = mean.data(), .rstd = rstd.data()};
    NormBackwardArgs g{.dtype = t, .rows = rows, .cols = cols, .x = x.data(), .weight = w.data(), .dy = dy.data(),
                       .mean = mean.data(), .rstd = rstd.data(), .dx = dx.data(), .dweight = dw.data(),
                       .dbias = layernorm ? db.data() : nullptr};
    if (layernorm) cpu::layernorm(f), cpu::layernorm_backward(g);
    else cpu::rmsnorm(f), cpu::rmsnorm_backward(g);
  }
  // forward: read x, write y; backward: read x and dy, write dx.
  state.SetBytesProcessed(state.iterations() * rows * cols * static_cast<int64_t>(dtype_size(t)) * 5);
}
BENCHMARK(BM_NormForwardBackward)
    ->Args({4096, 768, 0, 1})
    ->Args({4096, 2048, 1, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_Swiglu(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const DType t = static_cast<DType>(state.range(2));
  auto fused = random_bits(t, rows * 2 * cols, 1, -4.f, 4.f);
  auto out = random_bits(t, rows * cols, 2, 0.f, 1.f);
  const size_t half = cols * dtype_size(t);
  const char* base = reinterpret_cast<const char*>(fused.data());
  for (auto _ : state)
    cpu::swiglu({.dtype = t, .rows = rows, .cols = cols, .ld = 2 * cols, .gate = base, .up = base + half,
                 .out = out.data()});
  state.SetBytesProcessed(state.iterations() * rows * cols * static_cast<int64_t>(dtype_size(t)) * 3);
}
BENCHMARK(BM_Swiglu)->Args({1024, 5632, 1})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
