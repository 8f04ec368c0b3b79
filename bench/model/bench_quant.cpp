// Quantization of a frozen base weight (src/model/quant.h) at a Llama-3-8B MLP shape, 4096 x
// 14336, from bf16: quantize throughput as GB/s of bf16 input (NF4 with double quantization,
// int8 per row), and dequantize_rows as a GEMM would call it (256 rows at a time into one bf16
// buffer) as GB/s of bf16 output. The `threads` argument sets the compute pool's threads.
//   build/bin/bench_quant --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/dtype.h"
#include "src/model/init_normal.h"
#include "src/model/quant.h"

using namespace strata;

namespace {

constexpr int64_t kRows = 4096, kCols = 14336, kN = kRows * kCols;
constexpr int64_t kSliceRows = 256;

// N(0, 0.02) weights in bf16, made once.
const std::vector<uint16_t>& weights_bf16() {
  static const std::vector<uint16_t> w = [] {
    std::vector<uint16_t> h(static_cast<size_t>(kN));
    std::vector<float> row(static_cast<size_t>(kCols));
    for (int64_t r = 0; r < kRows; ++r) {
      fill_normal(init_stream_key(1, 0), r * kCols, kCols, 0.02f, row.data());
      for (int64_t j = 0; j < kCols; ++j) h[static_cast<size_t>(r * kCols + j)] = kernels::f32_to_bf16(row[static_cast<size_t>(j)]);
    }
    return h;
  }();
  return w;
}

void BM_Quantize(benchmark::State& state) {
  const auto kind = static_cast<QuantKind>(state.range(0));
  kernels::cpu::set_num_threads(static_cast<int>(state.range(1)));
  const std::vector<uint16_t>& w = weights_bf16();
  std::vector<uint8_t> q(bytes_for(kind, kRows, kCols));
  for (auto _ : state) {
    quantize(kind, w.data(), kernels::DType::bf16, kRows, kCols, q.data());
    benchmark::DoNotOptimize(q.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kN * 2);
  state.SetLabel(std::string(quant_kind_name(kind)) + " from bf16");
}

void BM_DequantizeRows(benchmark::State& state) {
  const auto kind = static_cast<QuantKind>(state.range(0));
  kernels::cpu::set_num_threads(static_cast<int>(state.range(1)));
  const QuantizedTensor q = QuantizedTensor::make(kind, weights_bf16().data(), kernels::DType::bf16, kRows, kCols);
  std::vector<uint16_t> slice(static_cast<size_t>(kSliceRows * kCols));
  for (auto _ : state) {
    for (int64_t r = 0; r < kRows; r += kSliceRows) {
      q.dequantize_rows(r, r + kSliceRows, slice.data(), kernels::DType::bf16);
      benchmark::DoNotOptimize(slice.data());
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kN * 2);
  state.SetLabel(std::string(quant_kind_name(kind)) + " to bf16, 256 rows a call");
}

}  // namespace

// args: kind (2 int8, 3 nf4), threads
BENCHMARK(BM_Quantize)
    ->ArgNames({"kind", "threads"})
    ->ArgsProduct({{static_cast<int64_t>(QuantKind::nf4), static_cast<int64_t>(QuantKind::int8)}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DequantizeRows)
    ->ArgNames({"kind", "threads"})
    ->ArgsProduct({{static_cast<int64_t>(QuantKind::nf4), static_cast<int64_t>(QuantKind::int8)}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
