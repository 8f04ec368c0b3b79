// The compute pool shared by every CPU op: the caller's OpenMP team (see parallel.h for why
// not oneTBB), sized by set_num_threads; plus a oneTBB arena of the same size for task code.
#include "kernels/cpu/parallel.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>
#include <exception>
#include <memory>
#include <mutex>

namespace strata::kernels::cpu {
namespace {

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
  return 1;
}

struct State {
  std::mutex mu;  // guards arena and writes of n
  std::atomic<int> n{0};  // 0 until first set; read without the lock on every parallel_for
  std::unique_ptr<tbb::task_arena> arena;
  void ensure() {
    if (!arena) set(0);
  }
  void set(int want) {
    const int threads = want > 0 ? want : available_cores();
    arena = std::make_unique<tbb::task_arena>(threads);
    omp_set_num_threads(threads);
    n.store(threads, std::memory_order_release);
  }
};
State& state() {
  static State s;
  return s;
}

}  // namespace

int num_threads() {
  State& s = state();
  if (int n = s.n.load(std::memory_order_acquire)) return n;  // the hot path: no lock
  std::lock_guard lock(s.mu);
  s.ensure();
  return s.n.load(std::memory_order_relaxed);
}

void set_num_threads(int n) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.set(n);
}

namespace {
// STRATA_CPU_POOL=tbb selects the oneTBB pool at start-up (for comparisons); default OpenMP.
Pool initial_pool() {
  const char* e = std::getenv("STRATA_CPU_POOL");
  return e && std::string_view(e) == "tbb" ? Pool::tbb : Pool::openmp;
}
std::atomic<Pool> g_pool{initial_pool()};
}  // namespace

void set_pool(Pool p) { g_pool.store(p); }
Pool pool() { return g_pool.load(std::memory_order_relaxed); }

int thread_index() {
  if (pool() == Pool::tbb) {
    const int i = tbb::this_task_arena::current_thread_index();
    return i == tbb::task_arena::not_initialized ? 0 : i;
  }
  return omp_get_thread_num();
}

namespace detail {

void run_parallel(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, void* ctx) {
  if (pool() == Pool::tbb) {
    arena().execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(begin, end, grain),
                        [&](const tbb::blocked_range<int64_t>& r) { fn(ctx, r.begin(), r.end()); },
                        tbb::static_partitioner());
    });
    return;
  }
  const int64_t n = end - begin;
  const int chunks = static_cast<int>(std::min<int64_t>(num_threads(), std::max<int64_t>(1, n / grain)));
  std::exception_ptr error;
  std::once_flag error_once;
#pragma omp parallel num_threads(chunks)
  {
    // Exceptions must not leave an OpenMP region: keep the first, rethrow after it.
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    try {
      fn(ctx, begin + n * t / nt, begin + n * (t + 1) / nt);
    } catch (...) {
      std::call_once(error_once, [&] { error = std::current_exception(); });
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace detail

tbb::task_arena& arena() {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.ensure();
  return *s.arena;
}

}  // namespace strata::kernels::cpu
