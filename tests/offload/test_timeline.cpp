// Timeline: a planned step replayed against a clock — compute alone, NVMe alone, the two
// overlapped by prefetching, and serialised where the budget leaves no room to prefetch.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "offload/timeline.h"

using namespace strata::offload;

namespace {
constexpr uint64_t kMiB = 1ull << 20;

// n blocks of `bytes` homed on NVMe, a host budget of `slots` of them.
Residency on_nvme(int n, uint64_t bytes, int slots) {
  Residency r({0, slots * bytes, n * bytes});
  for (int i = 0; i < n; ++i) {
    std::string name = "b";  // (not "b" + to_string: GCC 12's -Wrestrict false positive)
    name += std::to_string(i);
    r.add_block({name, bytes, Tier::nvme});
  }
  return r;
}

// Each block read once per step on the host, `ms` of compute while it is held.
Schedule scan(int n, std::vector<double>& cost, double ms) {
  Schedule s;
  for (int i = 0; i < n; ++i) {
    s.acquire(static_cast<BlockId>(i), Tier::host, Mode::read);
    s.release(s.size() - 1);
  }
  cost.assign(s.size(), 0.0);
  for (size_t i = 0; i < s.size(); i += 2) cost[i] = ms;
  return s;
}
}  // namespace

TEST(Timeline, ResidentStepIsItsCompute) {
  std::vector<double> cost;
  const Schedule s = scan(4, cost, 10);
  const StepTimeline t = estimate_step(on_nvme(4, kMiB, 4), s, cost, {.nvme_read = 1.0 * kMiB, .nvme_write = 1.0 * kMiB});
  EXPECT_DOUBLE_EQ(t.step_ms, 40);  // every block stays in host RAM after the first step
  EXPECT_DOUBLE_EQ(t.compute_ms, 40);
  EXPECT_DOUBLE_EQ(t.stall_ms, 0);
  EXPECT_DOUBLE_EQ(t.nvme_busy_ms, 0);
}

// Each NVMe block read (1 ms of NVMe), then `ms` of compute on a block homed in host RAM: the
// next block's read is issued once the one before is done with, so it runs beside that
// compute, and the step is the longer of compute and I/O (give or take the step's edges).
TEST(Timeline, PrefetchOverlapsComputeAndIo) {
  for (double ms : {0.25, 4.0}) {
    Residency r({0, 3 * kMiB, 6 * kMiB});
    for (int i = 0; i < 6; ++i) {
      std::string name = "n";
      name += std::to_string(i);
      r.add_block({name, kMiB, Tier::nvme});
    }
    r.add_block({"resident", kMiB, Tier::host});
    Schedule s;
    std::vector<double> cost;
    for (BlockId i = 0; i < 6; ++i) {
      s.use(i, Tier::host, Mode::read);
      s.use(6, Tier::host, Mode::read);
    }
    cost.assign(s.size(), 0.0);
    for (size_t i = 2; i < s.size(); i += 4) cost[i] = ms;  // after each acquire of the resident block
    const StepTimeline t = estimate_step(r, s, cost, {.nvme_read = 1.0 * kMiB, .nvme_write = 1.0 * kMiB});
    const double compute = 6 * ms, io = t.nvme_busy_ms;
    EXPECT_DOUBLE_EQ(t.compute_ms, compute);
    EXPECT_DOUBLE_EQ(io, 4);  // Belady keeps two of the six in host RAM from one step to the next
    EXPECT_GE(t.step_ms, std::max(compute, io) - 1e-9) << ms;
    EXPECT_LE(t.step_ms, std::max(compute, io) + 2 * ms + 1e-9) << ms;  // at most two computes unhidden
    EXPECT_NEAR(t.step_ms, t.compute_ms + t.stall_ms, 1e-9) << ms;
  }
}

// One host slot: a block's read can only start once compute is done with the one before, so
// nothing overlaps and the step is compute plus I/O.
TEST(Timeline, NoRoomToPrefetchSerialisesComputeAndIo) {
  std::vector<double> cost;
  const Schedule s = scan(4, cost, 3);
  const StepTimeline t = estimate_step(on_nvme(4, kMiB, 1), s, cost, {.nvme_read = 1.0 * kMiB, .nvme_write = 1.0 * kMiB});
  EXPECT_DOUBLE_EQ(t.nvme_busy_ms, 4);
  EXPECT_DOUBLE_EQ(t.step_ms, 4 * 3 + 4 * 1);
  EXPECT_DOUBLE_EQ(t.stall_ms, 4);
}
