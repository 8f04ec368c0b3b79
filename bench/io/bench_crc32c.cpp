// crc32c throughput: the SSE4.2 path against the table path, at the sizes SwapSpace checksums
// (whole extents: 64 KiB .. 16 MiB). Tells whether --checksums can keep up with the disk.
#include <benchmark/benchmark.h>

#include <vector>

#include "io/aligned_buffer.h"
#include "io/crc32c.h"

namespace {

void fill(strata::io::AlignedBuffer& b) {
  for (size_t i = 0; i < b.size(); ++i) b.as<unsigned char>()[i] = static_cast<unsigned char>(i * 131 + 7);
}

void BM_crc32c(benchmark::State& state) {
  strata::io::AlignedBuffer b(static_cast<size_t>(state.range(0)));
  fill(b);
  for (auto _ : state) benchmark::DoNotOptimize(strata::io::crc32c(b.data(), b.size()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
  state.SetLabel(strata::io::crc32c_hardware() ? "sse4.2" : "table");
}

void BM_crc32c_table(benchmark::State& state) {
  strata::io::AlignedBuffer b(static_cast<size_t>(state.range(0)));
  fill(b);
  for (auto _ : state) benchmark::DoNotOptimize(strata::io::crc32c_table(b.data(), b.size()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}

BENCHMARK(BM_crc32c)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_crc32c_table)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20);

}  // namespace
