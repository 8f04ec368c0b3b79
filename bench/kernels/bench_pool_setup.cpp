// How fast a pool of host memory becomes usable (allocated, every page faulted in, zero), as
// TierPool sets its pools up at start-up. `malloc_memset` is the earlier way (aligned_alloc,
// huge-page advice, one thread's memset); `runtime` is the CPU runtime's alloc_pinned (its own
// mapping, populated from every core, zero pages: TierPool adds no memset on CPU).
// bytes_per_second is the rate of pool set-up.
//
// On a VM whose host takes freed guest memory back (free page reporting), memory freed moments
// ago is still backed and faults in fast: each iteration therefore waits (untimed) for the last
// one's memory to be handed back first. Run with --benchmark_filter and compare at equal load.
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "kernels/runtime.h"

using namespace strata::kernels;

namespace {

constexpr auto kSettle = std::chrono::seconds(8);  // > the kernel's 2 s page reporting delay

void BM_PoolSetup_malloc_memset(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) << 20;
  for (auto _ : state) {
    state.PauseTiming();
    std::this_thread::sleep_for(kSettle);
    state.ResumeTiming();
    void* p = std::aligned_alloc(size_t{2} << 20, bytes);
    if (!p) throw std::runtime_error("out of memory");
    madvise(p, bytes, MADV_HUGEPAGE);  // advisory
    std::memset(p, 0, bytes);
    benchmark::DoNotOptimize(p);
    state.PauseTiming();
    std::free(p);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

void BM_PoolSetup_runtime(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) << 20;
  auto rt = make_runtime(Backend::cpu);
  for (auto _ : state) {
    state.PauseTiming();
    std::this_thread::sleep_for(kSettle);
    state.ResumeTiming();
    void* p = rt->alloc_pinned(bytes);
    benchmark::DoNotOptimize(p);
    state.PauseTiming();
    rt->free_pinned(p);
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}

}  // namespace

// args: MiB
BENCHMARK(BM_PoolSetup_malloc_memset)->Arg(2048)->Iterations(3)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PoolSetup_runtime)->Arg(2048)->Iterations(3)->UseRealTime()->Unit(benchmark::kMillisecond);
