// BlockManager on the CPU backend (device memory is host memory under the device budget, so
// every path runs): random schedules at random budgets down to the minimum, every acquire's
// bytes checked, budgets never exceeded, plans that move what they simulate, replanning.
#include <gtest/gtest.h>

#include <random>

#include "kernels/runtime.h"
#include "offload/manager.h"
#include "offload/planner.h"
#include "offload_test_util.h"

using namespace strata::offload;
using namespace strata::offload::testing;
namespace kernels = strata::kernels;

namespace {

ManagerConfig budgets(uint64_t device_bytes, uint64_t host_bytes) {
  ManagerConfig cfg;
  cfg.device_bytes = device_bytes;
  cfg.host_bytes = host_bytes;
  return cfg;
}

struct Case {
  std::vector<BlockSpec> blocks;
  Schedule schedule;
  uint64_t device_bytes = 0, host_bytes = 0;
};

// Blocks of random sizes homed on host or device; budgets between the minimum and 1.5x it.
Case random_case(std::mt19937_64& rng, bool nvme_homes, uint64_t nvme_bytes) {
  Case c;
  size_t n = 2 + rng() % 9;
  for (size_t i = 0; i < n; ++i) {
    Tier home = nvme_homes && rng() % 2 ? Tier::nvme : (rng() % 4 == 0 ? Tier::device : Tier::host);
    std::string name = "blk";
    name += std::to_string(i);
    c.blocks.push_back({name, 1 + rng() % (20 * kAlign), home});
  }
  c.schedule = random_schedule(rng, n, 20 + rng() % 60, 1 + static_cast<int>(rng() % 3));
  Residency r({1ull << 30, 1ull << 30, nvme_bytes});
  for (const auto& b : c.blocks) r.add_block(b);
  auto slack = [&](uint64_t min) { return rng() % 3 == 0 ? min : min + (rng() % (min / 2 + 1)) / kAlign * kAlign; };
  c.device_bytes = slack(min_budget(r, c.schedule, Tier::device));
  Residency r2 = r.cold({c.device_bytes, 1ull << 30, nvme_bytes});
  c.host_bytes = slack(min_budget(r2, c.schedule, Tier::host));
  return c;
}

void check_within_budgets(const BlockManager& mgr, const Case& c) {
  OffloadStats st = mgr.stats();
  EXPECT_LE(st.tiers[0].bytes_peak, c.device_bytes);
  EXPECT_LE(st.tiers[1].bytes_peak, c.host_bytes);
  EXPECT_EQ(st.tiers[0].budget_bytes, c.device_bytes);
  EXPECT_EQ(st.tiers[1].budget_bytes, c.host_bytes);
}

}  // namespace

TEST(BlockManager, RandomSchedulesAtRandomBudgetsKeepEveryByte) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  std::mt19937_64 rng(2024);
  size_t acquires = 0, cold_restarts = 0;
  for (int iter = 0; iter < 45; ++iter) {
    Case c = random_case(rng, false, 0);
    BlockManager mgr(*rt, budgets(c.device_bytes, c.host_bytes));
    for (const auto& b : c.blocks) mgr.add_block(b.name, b.bytes, b.home);
    std::vector<uint64_t> versions(c.blocks.size(), 0);
    init_blocks(mgr, versions);
    mgr.set_schedule(c.schedule);  // must not throw: budgets are at or above the minimum
    for (int step = 0; step < 4; ++step) {
      OffloadStats before = mgr.stats();
      run_step(mgr, c.schedule, versions);
      if (::testing::Test::HasFatalFailure()) return;
      mgr.drain();
      OffloadStats after = mgr.stats();
      EXPECT_EQ(after.schedule_changes, 0u);
      // The executor moves exactly the bytes its plan simulated (unless the placement left by the
      // last step forced a flush to the home copies first).
      if (after.cold_restarts == before.cold_restarts) {
        EXPECT_EQ(after.bytes_moved() - before.bytes_moved(), after.planned_bytes)
            << "iteration " << iter << " step " << step;
        if (after.lru_bytes > 0) {
          EXPECT_LE(after.planned_bytes, after.lru_bytes);
        }
      }
      cold_restarts += after.cold_restarts - before.cold_restarts;
      acquires += c.schedule.size() / 2;
    }
    check_within_budgets(mgr, c);
  }
  EXPECT_GT(acquires, 4000u);
  EXPECT_LE(cold_restarts, 10u);  // rare: only where no candidate plan is steady
}

TEST(BlockManager, RecordedScheduleIsPlannedAndAChangeIsReplanned) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  std::mt19937_64 rng(5);
  Case c = random_case(rng, false, 0);
  Schedule other = random_schedule(rng, c.blocks.size(), 40, 2);
  BlockManager mgr(*rt, budgets(c.device_bytes + 64 * kAlign, c.host_bytes + 64 * kAlign));
  for (const auto& b : c.blocks) mgr.add_block(b.name, b.bytes, b.home);
  std::vector<uint64_t> versions(c.blocks.size(), 0);
  init_blocks(mgr, versions);
  run_step(mgr, c.schedule, versions);  // recorded (online)
  EXPECT_EQ(mgr.schedule(), c.schedule);
  run_step(mgr, c.schedule, versions);  // planned
  EXPECT_NE(mgr.stats().policy, "online-lru");
  EXPECT_LE(mgr.stats().planned_bytes, mgr.stats().lru_bytes);  // Belady vs LRU on the recording
  uint64_t changes = mgr.stats().schedule_changes;
  run_step(mgr, other, versions);  // departs from the plan: detected, run online, recorded
  EXPECT_EQ(mgr.stats().schedule_changes, changes + 1);
  EXPECT_EQ(mgr.schedule(), other);
  run_step(mgr, other, versions);  // replanned
  EXPECT_EQ(mgr.stats().schedule_changes, changes + 1);
  EXPECT_NE(mgr.stats().policy, "online-lru");
  // A step that stops early is a change too.
  Schedule prefix;
  for (size_t i = 0; i < other.size() && prefix.size() < 6; ++i) {
    const auto& e = other.events()[i];
    if (!e.release) prefix.use(e.block, e.tier, e.mode);
  }
  run_step(mgr, prefix, versions);
  EXPECT_EQ(mgr.stats().schedule_changes, changes + 2);
}

TEST(BlockManager, BudgetBelowMinimumIsAnErrorNamingIt) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  Schedule s;  // three blocks of 3 pages held at once on device: 9 pages needed
  size_t a = s.acquire(0, Tier::device, Mode::read), b = s.acquire(1, Tier::device, Mode::read);
  size_t c = s.acquire(2, Tier::device, Mode::read);
  s.release(a);
  s.release(b);
  s.release(c);
  BlockManager mgr(*rt, budgets(8 * kAlign, 64 * kAlign));
  for (const char* name : {"w0", "w1", "w2"}) mgr.add_block(name, 3 * kAlign, Tier::host);
  try {
    mgr.set_schedule(s);
    FAIL() << "accepted a device budget below the minimum";
  } catch (const BudgetError& e) {
    EXPECT_EQ(e.minimum(), 9 * kAlign);
    EXPECT_NE(std::string(e.what()).find("device budget"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("minimum 36.00 KiB"), std::string::npos) << e.what();
  }
  // Online (recording) the same shortage is an error naming the tier at the acquire; its minimum
  // is what the acquire needed.
  mgr.begin_step();
  Handle h0 = mgr.acquire(0, Tier::device, Mode::read), h1 = mgr.acquire(1, Tier::device, Mode::read);
  try {
    mgr.acquire(2, Tier::device, Mode::read);
    FAIL() << "acquire past the device budget";
  } catch (const BudgetError& e) {
    EXPECT_EQ(e.minimum(), 9 * kAlign);
    EXPECT_NE(std::string(e.what()).find("raise --device-mem"), std::string::npos) << e.what();
  }
  mgr.release(h0);
  mgr.release(h1);
}

// When the host is the tier that is too small, the error names the host (not the device, whose
// budget 0 is fine for a host-only schedule) and a real minimum.
TEST(BlockManager, HostTooSmallIsNamedWithItsMinimum) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  Schedule s;  // three NVMe-homed blocks of 2 pages held at once on host: 6 pages needed
  size_t a = s.acquire(0, Tier::host, Mode::read), b = s.acquire(1, Tier::host, Mode::read);
  size_t c = s.acquire(2, Tier::host, Mode::read);
  s.release(a);
  s.release(b);
  s.release(c);
  ManagerConfig cfg;
  cfg.device_bytes = 0;
  cfg.host_bytes = 5 * kAlign;
  BlockManager mgr(*rt, cfg, std::make_unique<MemStore>(64 * kAlign));
  for (const char* name : {"w0", "w1", "w2"}) mgr.add_block(name, 2 * kAlign, Tier::nvme);
  try {
    mgr.set_schedule(s);
    FAIL() << "accepted a host budget below the minimum";
  } catch (const BudgetError& e) {
    EXPECT_EQ(e.tier(), Tier::host);
    EXPECT_EQ(e.minimum(), 6 * kAlign);
    const std::string m = e.what();
    EXPECT_NE(m.find("host budget 20.00 KiB is below the minimum 24.00 KiB"), std::string::npos) << m;
    EXPECT_NE(m.find("raise --host-mem"), std::string::npos) << m;
    EXPECT_EQ(m.find("device budget"), std::string::npos) << m;
  }
}

TEST(BlockManager, WritesOnOneTierAreSeenOnTheOther) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  BlockManager mgr(*rt, budgets(4 * kAlign, 16 * kAlign));
  BlockId x = mgr.add_block("x", 5000, Tier::host);
  BlockId y = mgr.add_block("y", 3 * kAlign, Tier::host);
  std::vector<uint64_t> versions(2, 0);
  init_blocks(mgr, versions);
  Schedule s;
  s.use(x, Tier::device, Mode::read_write);  // dirty on device
  s.use(y, Tier::device, Mode::read);        // evicts x: written back to host first
  s.use(x, Tier::host, Mode::read);
  s.use(x, Tier::device, Mode::write);
  s.use(x, Tier::host, Mode::read);          // refreshed from device
  mgr.set_schedule(s);
  for (int step = 0; step < 3; ++step) run_step(mgr, s, versions);
  EXPECT_EQ(versions[x], 1u + 2 * 3);
  OffloadStats st = mgr.stats();
  EXPECT_GT(st.link(Link::d2h).bytes, 0u);
  EXPECT_GT(st.link(Link::h2d).bytes, 0u);
}

// Releasing a default or an already-released handle is an error in every build, and leaves the
// block's pins as they were (the block can still be acquired and released normally).
TEST(BlockManager, ReleasingAHandleTwiceIsAnError) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  BlockManager mgr(*rt, budgets(4 * kAlign, 16 * kAlign));
  BlockId x = mgr.add_block("x", kAlign, Tier::host);
  mgr.begin_step();
  Handle none;
  EXPECT_THROW(mgr.release(none), std::logic_error);
  Handle h = mgr.acquire(x, Tier::host, Mode::read);
  h.wait();
  mgr.release(h);
  EXPECT_FALSE(h);
  EXPECT_THROW(mgr.release(h), std::logic_error);
  Handle again = mgr.acquire(x, Tier::host, Mode::read);
  again.wait();
  mgr.release(again);
  EXPECT_NO_THROW(mgr.end_step());
}

// Compute on a stream, release with that stream: the write-back waits for the kernel, not the host.
void expect_release_orders_later_moves(kernels::Runtime& rt, kernels::Stream& compute) {
  BlockManager mgr(rt, budgets(2 * kAlign, 8 * kAlign));
  BlockId a = mgr.add_block("a", 2 * kAlign, Tier::host), b = mgr.add_block("b", 2 * kAlign, Tier::host);
  std::vector<uint64_t> versions(2, 0);
  init_blocks(mgr, versions);
  for (int step = 0; step < 3; ++step) {
    mgr.begin_step();
    Handle h = mgr.acquire(a, Tier::device, Mode::read_write);
    h.wait_on(compute);
    uint64_t v = ++versions[a];
    void* p = h.data();
    uint64_t n = h.bytes();
    compute.host_fn([p, n, a, v] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a slow kernel
      fill_pattern(p, n, a, v);
    });
    ASSERT_NO_THROW(mgr.release(h, &compute));
    Handle hb = mgr.acquire(b, Tier::device, Mode::read);  // evicts a: write-back after the kernel
    hb.wait();
    mgr.release(hb);
    Handle ha = mgr.acquire(a, Tier::host, Mode::read);
    ha.wait();
    EXPECT_EQ(checksum(ha.data(), ha.bytes()), expected_checksum(ha.bytes(), a, v));
    mgr.release(ha);
    mgr.end_step();
  }
  compute.synchronize();
}

TEST(BlockManager, ReleaseOnAStreamOrdersLaterMoves) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto compute = rt->create_stream();
  expect_release_orders_later_moves(*rt, *compute);
}

// The same with the stream of another runtime (a CUDA run's optimizer works on a CPU runtime of
// its own and releases on its stream): the release event must come from that stream's runtime
// (an event of the manager's runtime cannot be recorded there; the first GPU run failed so).
TEST(BlockManager, ReleaseOnAnotherRuntimesStreamOrdersLaterMoves) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto other = kernels::make_runtime(kernels::Backend::cpu);
  auto side = other->create_stream();
  expect_release_orders_later_moves(*rt, *side);
}

// A pinned block (a handle still held) is never evicted, whatever the policy would pick: here
// it is the least recently used block on a device with room for two, and two others are loaded
// past it while it is held. Were it evicted, another block's bytes would land in its range
// (seen through the held pointer) or the move would fail; its own writes must survive too.
TEST(BlockManager, HeldBlockIsNeverEvictedItsBytesStay) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  BlockManager mgr(*rt, budgets(2 * kAlign, 16 * kAlign));
  const BlockId a = mgr.add_block("a", kAlign, Tier::host), b = mgr.add_block("b", kAlign, Tier::host),
                c = mgr.add_block("c", kAlign, Tier::host);
  std::vector<uint64_t> versions(3, 0);
  init_blocks(mgr, versions);
  Schedule s;
  const size_t held = s.acquire(a, Tier::device, Mode::read_write);
  s.use(b, Tier::device, Mode::read);
  s.use(c, Tier::device, Mode::read);  // needs room: b or a must go, and a is pinned
  s.use(b, Tier::device, Mode::read);
  s.release(held);
  s.use(a, Tier::host, Mode::read);
  for (int step = 0; step < 3; ++step) {  // step 0 online (LRU), then planned (Belady)
    if (step == 1) mgr.set_schedule(s);
    mgr.begin_step();
    Handle ha = mgr.acquire(a, Tier::device, Mode::read_write);
    ha.wait();
    ASSERT_EQ(checksum(ha.data(), ha.bytes()), expected_checksum(ha.bytes(), a, versions[a])) << "step " << step;
    const uint64_t v = ++versions[a];
    fill_pattern(ha.data(), ha.bytes(), a, v);
    for (BlockId x : {b, c, b}) {
      Handle hx = mgr.acquire(x, Tier::device, Mode::read);
      hx.wait();
      EXPECT_EQ(checksum(hx.data(), hx.bytes()), expected_checksum(hx.bytes(), x, versions[x]))
          << "block " << x << " step " << step;
      EXPECT_NE(hx.data(), ha.data()) << "block " << x << " placed over the held block";
      mgr.release(hx);
      // The held block's bytes are untouched by the loads around it.
      EXPECT_EQ(checksum(ha.data(), ha.bytes()), expected_checksum(ha.bytes(), a, v)) << "step " << step;
    }
    mgr.release(ha);
    Handle back = mgr.acquire(a, Tier::host, Mode::read);  // the write reaches home
    back.wait();
    EXPECT_EQ(checksum(back.data(), back.bytes()), expected_checksum(back.bytes(), a, v)) << "step " << step;
    mgr.release(back);
    mgr.end_step();
  }
}

// A block released with discard (the optimizer's spent gradients) is never written home for
// those bytes: here block 0 is written on the device each step and then has to make room for
// block 2. Without the discard its eviction writes it back (d2h) every step; with it, nothing
// does, and the other blocks' bytes stay intact. The schedule says so, so the plan agrees.
TEST(BlockManager, DiscardedBlockIsDroppedNotWrittenHome) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto run = [&](bool discard) {
    Schedule s;
    s.use(1, Tier::device, Mode::read);
    s.release(s.acquire(0, Tier::device, Mode::write), discard);
    s.use(2, Tier::device, Mode::read);
    BlockManager mgr(*rt, budgets(2 * kAlign, 16 * kAlign));
    for (const char* name : {"g", "w1", "w2"}) mgr.add_block(name, kAlign, Tier::host);
    std::vector<uint64_t> versions(3, 0);
    init_blocks(mgr, versions);
    mgr.set_schedule(s);
    for (int step = 0; step < 4; ++step) {
      const OffloadStats before = mgr.stats();
      run_step(mgr, s, versions);
      if (::testing::Test::HasFatalFailure()) return uint64_t{0};
      mgr.drain();
      const OffloadStats after = mgr.stats();
      // The planner simulated the discard too: the step moves what its plan said.
      if (after.cold_restarts == before.cold_restarts) {
        EXPECT_EQ(after.bytes_moved() - before.bytes_moved(), after.planned_bytes) << "step " << step;
      }
    }
    const OffloadStats st = mgr.stats();
    EXPECT_EQ(st.schedule_changes, 0u);
    return st.links[static_cast<int>(Link::d2h)].bytes;
  };
  EXPECT_GT(run(false), 0u);
  EXPECT_EQ(run(true), 0u);
}

// BlockManager::discard between steps (speculation's old copies after a flip): block 0, written
// whole on the device each step and dirty at the step's end, has to make room for block 1 at the
// next step's start. Without the discard that eviction writes it back (d2h); with it, nothing
// does, and block 1's bytes stay intact.
TEST(BlockManager, DiscardBetweenStepsDropsADirtyCopy) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto run = [&](bool discard) {
    Schedule s;
    s.use(1, Tier::device, Mode::read);
    s.use(0, Tier::device, Mode::write);
    BlockManager mgr(*rt, budgets(kAlign, 16 * kAlign));
    for (const char* name : {"old", "w"}) mgr.add_block(name, kAlign, Tier::host);
    std::vector<uint64_t> versions(2, 0);
    init_blocks(mgr, versions);
    mgr.set_schedule(s);
    for (int step = 0; step < 4; ++step) {
      run_step(mgr, s, versions);
      if (::testing::Test::HasFatalFailure()) return uint64_t{0};
      if (discard) mgr.discard(0);
    }
    mgr.drain();
    return mgr.stats().links[static_cast<int>(Link::d2h)].bytes;
  };
  EXPECT_GT(run(false), 0u);
  EXPECT_EQ(run(true), 0u);
}

TEST(Schedule, DiscardIsValidatedAndFingerprinted) {
  Schedule a, b;
  a.release(a.acquire(0, Tier::host, Mode::write));
  b.release(b.acquire(0, Tier::host, Mode::write), true);
  EXPECT_NE(a.fingerprint(), b.fingerprint());
  EXPECT_NE(b.describe(1).find("discard"), std::string::npos) << b.describe(1);
  EXPECT_NO_THROW(b.validate(1));
  Schedule read_after;  // nothing reads discarded bytes before writing them again
  read_after.release(read_after.acquire(0, Tier::host, Mode::read), true);
  read_after.use(0, Tier::device, Mode::read);
  EXPECT_THROW(read_after.validate(1), std::invalid_argument);
  Schedule rewritten;
  rewritten.release(rewritten.acquire(0, Tier::host, Mode::read), true);
  rewritten.use(0, Tier::device, Mode::write);
  rewritten.use(0, Tier::host, Mode::read);
  EXPECT_NO_THROW(rewritten.validate(1));
  Schedule held;  // discarded while another tier still holds it
  const size_t h = held.acquire(0, Tier::host, Mode::read);
  held.release(held.acquire(0, Tier::device, Mode::read), true);
  held.release(h);
  EXPECT_THROW(held.validate(1), std::invalid_argument);
}
