// crc32c throughput, every path this CPU has (table, SSE4.2, VPCLMULQDQ folding in
// 256- and 512-bit registers), at the sizes
// SwapSpace checksums: whole buffers (64 KiB .. 16 MiB, mostly in cache) and 4 KiB blocks over
// 512 MiB (as a read from the disk leaves them: in no cache). Tells whether checksums keep up
// with the disk and what share of a core they take.
#include <benchmark/benchmark.h>

#include <vector>

#include "io/aligned_buffer.h"
#include "io/crc32c.h"

namespace {

using strata::io::Crc32cPath;

void fill(strata::io::AlignedBuffer& b) {
  for (size_t i = 0; i < b.size(); ++i) b.as<unsigned char>()[i] = static_cast<unsigned char>(i * 131 + 7);
}

Crc32cPath path_of(const benchmark::State& state) { return static_cast<Crc32cPath>(state.range(0)); }

void BM_crc32c(benchmark::State& state) {
  const Crc32cPath path = path_of(state);
  if (!strata::io::crc32c_supported(path)) {
    state.SkipWithError("not on this CPU");
    return;
  }
  strata::io::AlignedBuffer b(static_cast<size_t>(state.range(1)));
  fill(b);
  for (auto _ : state) benchmark::DoNotOptimize(strata::io::crc32c_with(path, b.data(), b.size()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(1));
  state.SetLabel(strata::io::crc32c_name(path));
}

// 4 KiB blocks over a buffer far larger than the caches: what a SwapSpace read's verification
// costs, where the data came from the disk by DMA.
void BM_crc32c_blocks_cold(benchmark::State& state) {
  const Crc32cPath path = path_of(state);
  if (!strata::io::crc32c_supported(path)) {
    state.SkipWithError("not on this CPU");
    return;
  }
  constexpr size_t kBytes = size_t{512} << 20, kBlock = 4096;
  strata::io::AlignedBuffer b(kBytes);
  fill(b);
  std::vector<uint32_t> out(kBytes / kBlock);
  for (auto _ : state) {
    strata::io::crc32c_blocks_with(path, b.data(), out.size(), kBlock, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.SetLabel(strata::io::crc32c_name(path));
}

constexpr int kTable = static_cast<int>(Crc32cPath::table), kSse = static_cast<int>(Crc32cPath::sse42),
              kAvx2 = static_cast<int>(Crc32cPath::vpclmulqdq_avx2), kAvx512 = static_cast<int>(Crc32cPath::vpclmulqdq_avx512);
BENCHMARK(BM_crc32c)->ArgsProduct({{kTable, kSse, kAvx2, kAvx512}, {64 << 10, 1 << 20, 16 << 20}});
BENCHMARK(BM_crc32c_blocks_cold)->Arg(kSse)->Arg(kAvx2)->Arg(kAvx512)->Unit(benchmark::kMillisecond);

}  // namespace
