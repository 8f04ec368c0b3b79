// CPU compute threading. Our own loops run on one oneTBB arena of n threads; oneDNN runs its
// OpenMP team of the same n threads. Both are only ever entered from a stream's worker, one
// op at a time, so the two pools never run at once on the same cores.
#pragma once
#include <cstdint>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

namespace strata::kernels::cpu {

int num_threads();
// Sets the compute threads of both pools (TBB arena and oneDNN's OpenMP team). Call at
// start-up, not while ops are running. n <= 0 means the number of available cores.
void set_num_threads(int n);
tbb::task_arena& arena();

// f(lo, hi) over [begin, end) in chunks of at least `grain`, on the compute arena.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& f) {
  if (end <= begin) return;
  if (end - begin <= grain || num_threads() == 1) {
    f(begin, end);
    return;
  }
  arena().execute([&] {
    tbb::parallel_for(tbb::blocked_range<int64_t>(begin, end, grain),
                      [&](const tbb::blocked_range<int64_t>& r) { f(r.begin(), r.end()); },
                      tbb::static_partitioner());
  });
}

}  // namespace strata::kernels::cpu
