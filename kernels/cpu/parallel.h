// CPU compute threading. Every CPU op — our loops and oneDNN's primitives — runs on ONE pool:
// the calling thread's OpenMP team of num_threads() threads. oneDNN (Debian's build) only has
// the OpenMP runtime, and after each primitive libgomp's workers spin-wait (GOMP_SPINCOUNT,
// ~5 ms of CPU on this machine) for the next parallel region; with a second pool (oneTBB) the
// loop that follows a matmul shared its cores with those spinning threads (matmul + AdamW back
// to back ran 20-60 % slower than alone; bench/RESULTS.md). On the same team the spinning
// threads simply pick up the next loop.
#pragma once
#include <cstdint>
#include <type_traits>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

namespace strata::kernels::cpu {

int num_threads();
// Sets the compute threads (our loops and oneDNN's OpenMP team). Call at start-up, not while
// ops are running. n <= 0 means the number of available cores.
void set_num_threads(int n);
// A oneTBB arena of num_threads() threads, for code that needs task parallelism rather than
// loops; ops should use parallel_for, which does not run on it.
tbb::task_arena& arena();

// Which pool parallel_for runs on. OpenMP (the default) is the one above; oneTBB is kept only
// so `strata bench ops` can measure the two side by side (or STRATA_CPU_POOL=tbb at start-up).
// Switch only while no op runs.
enum class Pool : uint8_t { openmp, tbb };
void set_pool(Pool p);
Pool pool();

// Index of the calling thread inside a running parallel_for body, in [0, num_threads()), on
// either pool (use it for per-thread scratch); 0 outside one.
int thread_index();

namespace detail {
using ChunkFn = void (*)(void* ctx, int64_t lo, int64_t hi);
// Splits [begin, end) into at most num_threads() contiguous chunks of at least `grain` and
// runs fn on them on the OpenMP team; rethrows the first exception a chunk threw.
void run_parallel(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, void* ctx);
}  // namespace detail

// f(lo, hi) over [begin, end) in contiguous chunks of at least `grain` (one per thread, so a
// streaming loop reads each thread's part front to back). Nested calls run serially.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& f) {
  if (end <= begin) return;
  if (grain < 1) grain = 1;
  if (end - begin <= grain || num_threads() == 1) {
    f(begin, end);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  detail::run_parallel(
      begin, end, grain, [](void* ctx, int64_t lo, int64_t hi) { (*static_cast<Fn*>(ctx))(lo, hi); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace strata::kernels::cpu
