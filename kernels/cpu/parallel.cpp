// The compute arena shared by every CPU op.
#include "kernels/cpu/parallel.h"

#include <omp.h>
#include <sched.h>

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
  std::mutex mu;
  int n = 0;
  std::unique_ptr<tbb::task_arena> arena;
  void ensure() {
    if (!arena) set(0);
  }
  void set(int want) {
    n = want > 0 ? want : available_cores();
    arena = std::make_unique<tbb::task_arena>(n);
    omp_set_num_threads(n);
  }
};
State& state() {
  static State s;
  return s;
}

}  // namespace

int num_threads() {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.ensure();
  return s.n;
}

void set_num_threads(int n) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.set(n);
}

tbb::task_arena& arena() {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.ensure();
  return *s.arena;
}

}  // namespace strata::kernels::cpu
