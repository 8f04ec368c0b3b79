// Timeline: a planned step replayed against a clock — compute alone, NVMe alone, the two
// overlapped by prefetching, and serialised where the budget leaves no room to prefetch; and
// compute and the disk slowing each other where they overlap (LinkRates' interference).
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

namespace {
// Each NVMe block read (1 ms of NVMe), then `ms` of compute on a block homed in host RAM: the
// next block's read is issued once the one before is done with, so it runs beside that
// compute, and the step is the longer of compute and I/O (give or take the step's edges).
StepTimeline prefetched(double ms, LinkRates rates) {
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
  rates.nvme_read = rates.nvme_write = 1.0 * kMiB;
  return estimate_step(r, s, cost, rates);
}
}  // namespace

TEST(Timeline, PrefetchOverlapsComputeAndIo) {
  for (double ms : {0.25, 4.0}) {
    const StepTimeline t = prefetched(ms, {});
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


// The I/O's own CPU work slows compute while the disk moves bytes (compute_beside_nvme): in each
// ms of read beside it compute at half speed does half a ms of its work, and nothing else slows.
TEST(Timeline, ComputeBesideTheDiskRunsSlower) {
  const StepTimeline alone = prefetched(4, {});
  const StepTimeline slowed = prefetched(4, {.compute_beside_nvme = 0.5});
  EXPECT_DOUBLE_EQ(alone.slowed_ms, 0);
  // Every 1 ms read runs inside a 4 ms compute here, so each one costs half a ms more.
  EXPECT_DOUBLE_EQ(slowed.nvme_busy_ms, alone.nvme_busy_ms);
  EXPECT_NEAR(slowed.slowed_ms, alone.nvme_busy_ms * 0.5, 1e-9);
  EXPECT_NEAR(slowed.compute_ms, alone.compute_ms + slowed.slowed_ms, 1e-9);
  EXPECT_NEAR(slowed.step_ms, slowed.compute_ms + slowed.stall_ms, 1e-9);
  EXPECT_NEAR(slowed.step_ms, alone.step_ms + slowed.slowed_ms, 1e-9);
}

// Where nothing overlaps (one host slot: each read waits for the compute before it), the disk's
// traffic slows nothing.
TEST(Timeline, SerialisedComputeIsNotSlowedByTheDisk) {
  std::vector<double> cost;
  const Schedule s = scan(4, cost, 3);
  const StepTimeline t = estimate_step(on_nvme(4, kMiB, 1), s, cost,
                                       {.nvme_read = 1.0 * kMiB, .nvme_write = 1.0 * kMiB,
                                        .compute_beside_nvme = 0.5, .nvme_beside_compute = 0.5});
  EXPECT_DOUBLE_EQ(t.slowed_ms, 0);
  EXPECT_DOUBLE_EQ(t.nvme_overlapped, 0);
  EXPECT_DOUBLE_EQ(t.step_ms, 4 * 3 + 4 * 1);
}

// The disk beside compute (nvme_beside_compute): replayed until the share of its busy time that
// compute overlaps settles, its rate lowered by that share. An I/O-bound step gets longer, and
// its busy time is the bytes at the lowered rate.
TEST(Timeline, TheDiskBesideComputeSlowsByTheShareComputeOverlaps) {
  const StepTimeline alone = prefetched(0.5, {});
  const StepTimeline t = prefetched(0.5, {.compute_beside_nvme = 0.9, .nvme_beside_compute = 0.5});
  EXPECT_GT(t.nvme_overlapped, 0.1);
  EXPECT_LE(t.nvme_overlapped, 1.0);
  // The busy time is the bytes (4 ms at full speed) at the settled share's rate, within the
  // share's settling tolerance.
  EXPECT_NEAR(t.nvme_busy_ms * (1 - t.nvme_overlapped * 0.5), alone.nvme_busy_ms, 0.05 * alone.nvme_busy_ms);
  EXPECT_GT(t.nvme_busy_ms, alone.nvme_busy_ms);
  EXPECT_GT(t.step_ms, alone.step_ms);
}
