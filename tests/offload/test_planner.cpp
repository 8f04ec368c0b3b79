// Planner: Belady vs LRU, the minimum budget (runs there, names it below), next use across the
// step boundary, and plans that move exactly what they simulate.
#include <gtest/gtest.h>

#include <random>

#include "offload/planner.h"
#include "offload_test_util.h"

using namespace strata::offload;
using strata::offload::testing::random_schedule;

namespace {
constexpr uint64_t kBig = 1ull << 30;

Residency blocks_on_host(const std::vector<uint64_t>& sizes, uint64_t device_budget) {
  Residency r({device_budget, kBig, 0});
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::string name = "b";
    name += std::to_string(i);
    r.add_block({name, sizes[i], Tier::host});
  }
  return r;
}
}  // namespace

// The textbook case: a cyclic scan over 5 equal blocks with room for 4. LRU misses every time;
// Belady keeps 3 of them and loads 2 per pass.
TEST(Planner, BeladyBeatsLruOnCyclicScan) {
  Residency r = blocks_on_host({kAlign, kAlign, kAlign, kAlign, kAlign}, 4 * kAlign);
  Schedule s;
  for (int pass = 0; pass < 4; ++pass)
    for (BlockId b = 0; b < 5; ++b) s.use(b, Tier::device, Mode::read);
  Plan lru = simulate(r, s, {Policy::lru, false});
  Plan bel = simulate(r, s, {Policy::belady, false});
  EXPECT_EQ(lru.bytes_moved(), 20 * kAlign);
  EXPECT_LT(bel.bytes_moved(), lru.bytes_moved());
  EXPECT_EQ(bel.bytes_moved(), 8 * kAlign);  // 5 cold, then one miss every 4 accesses
  Plan pre = simulate(r, s, {Policy::belady, true});
  EXPECT_EQ(pre.bytes_moved(), bel.bytes_moved());  // the same fetches, earlier
  size_t early = pre.start.size();
  for (const auto& ops : pre.after) early += ops.size();
  EXPECT_GT(early, 0u);
}

TEST(Planner, MinimumBudgetRunsAndBelowItIsAnErrorNamingIt) {
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 40; ++iter) {
    std::vector<uint64_t> sizes;
    size_t n = 3 + rng() % 10;
    for (size_t i = 0; i < n; ++i) sizes.push_back(1 + rng() % (12 * kAlign));
    Residency r = blocks_on_host(sizes, kBig);
    Schedule s = random_schedule(rng, n, 30 + rng() % 40, 1 + static_cast<int>(rng() % 4));
    s.validate(n);
    uint64_t lower = peak_pinned_bytes(r, s, Tier::device);
    uint64_t min = min_budget(r, s, Tier::device);
    EXPECT_GE(min, lower);
    Residency at_min = r.cold({min, kBig, 0});
    EXPECT_NO_THROW(check_budgets(at_min, s));
    auto plans = candidate_plans(at_min, s);
    ASSERT_FALSE(plans.empty());
    // The planner never moves more than LRU on the same schedule and budget (where LRU runs).
    // (Among plans that can follow themselves; a non-steady one pays a cache flush every step.)
    for (const Plan& p : plans)
      if (p.steady == plans.front().steady) {
        EXPECT_LE(plans.front().bytes_moved(), p.bytes_moved());
      }
    // Prefetching moves what MIN moves, when placement lets it (equal sizes: always).
    try {
      Plan bel = simulate(at_min, s, {Policy::belady, false});
      Plan pre = simulate(at_min, s, {Policy::belady, true});
      EXPECT_LE(pre.bytes_moved(), bel.bytes_moved() + bel.bytes_moved() / 4) << "prefetch costs bytes";
    } catch (const BudgetError&) {
    }
    if (min > lower) {
      Residency below = r.cold({min - kAlign, kBig, 0});
      try {
        check_budgets(below, s);
        ADD_FAILURE() << "a budget below the minimum ran";
      } catch (const BudgetError& e) {
        EXPECT_EQ(e.minimum(), min);
        EXPECT_EQ(e.tier(), Tier::device);
        EXPECT_NE(std::string(e.what()).find("minimum"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(std::to_string(min)), std::string::npos) << e.what();
      }
    }
  }
}

// Next use wraps into the next step: at the end of a forward pass the blocks the next step
// starts with are the ones kept.
TEST(Planner, NextUseWrapsAcrossSteps) {
  Residency r = blocks_on_host({kAlign, kAlign, kAlign, kAlign}, 3 * kAlign);
  Schedule s;
  for (BlockId b = 0; b < 4; ++b) s.use(b, Tier::device, Mode::read);
  Plan p1 = simulate(r, s, {Policy::belady, false});
  // Replay the plan's effect, then plan the next step from there: block 0 (first use next step)
  // must have survived the evictions at the end of the first step.
  Residency after = r;
  for (size_t i = 0; i < s.size(); ++i) {
    const auto& e = s.events()[i];
    for (const auto& op : p1.before[i]) {
      if (op.kind == OpKind::evict) after.evict(op.block, op.tier);
      if (op.kind == OpKind::load) after.load(op.block, op.tier);
    }
    if (e.release)
      after.release(e.block, e.tier, e.mode);
    else
      after.acquire(e.block, e.tier, e.mode);
  }
  EXPECT_TRUE(after.copy(0, Tier::device).valid);
  EXPECT_EQ(after.fingerprint(), p1.end_fingerprint);
}

TEST(Schedule, ValidateRejectsBadPrograms) {
  Schedule s;
  s.acquire(0, Tier::device, Mode::read);
  EXPECT_THROW(s.validate(1), std::invalid_argument);  // never released
  Schedule w;
  size_t a = w.acquire(0, Tier::device, Mode::read);
  w.acquire(0, Tier::host, Mode::write);
  w.release(a);
  EXPECT_THROW(w.validate(1), std::invalid_argument);  // written on host while read on device
  Schedule n;
  n.use(0, Tier::nvme, Mode::read);
  EXPECT_THROW(n.validate(1), std::invalid_argument);
  Schedule ok;
  ok.use(0, Tier::device, Mode::read);
  EXPECT_THROW(ok.validate(0), std::invalid_argument);
  EXPECT_NO_THROW(ok.validate(1));
}

// Belady's tie-break: among victims whose next use is equally far (here: none in the step),
// a clean copy goes before a dirty one, which would cost a write-back. In both block orders, so
// neither flipping nor dropping the tie-break passes.
TEST(Planner, CleanCopyIsEvictedBeforeDirtyOnATie) {
  for (BlockId dirty : {BlockId{0}, BlockId{1}}) {
    const BlockId clean = 1 - dirty;
    Residency r = blocks_on_host({kAlign, kAlign, kAlign}, 2 * kAlign);
    r.alloc(dirty, Tier::device);
    r.acquire(dirty, Tier::device, Mode::write);  // the home copy is stale now
    r.release(dirty, Tier::device, Mode::write);
    r.load(clean, Tier::device);
    ASSERT_FALSE(r.copy(dirty, Tier::host).valid);
    ASSERT_TRUE(r.copy(clean, Tier::host).valid);
    Schedule s;
    s.use(2, Tier::device, Mode::read);  // needs one of the two slots
    const Plan p = simulate(r, s, {Policy::belady, false});
    EXPECT_EQ(p.link_bytes[static_cast<size_t>(Link::d2h)], 0u) << "dirty block " << dirty << " written back";
    EXPECT_EQ(p.link_bytes[static_cast<size_t>(Link::h2d)], kAlign);
    EXPECT_EQ(p.bytes_moved(), kAlign);
  }
}

// A release that discards (the optimizer's spent gradients): the simulation knows the bytes are
// dead, so evicting the copy later writes nothing home; without the discard the same schedule
// pays a write-back.
TEST(Planner, DiscardedCopyIsEvictedWithoutAWriteBack) {
  for (bool discard : {false, true}) {
    Residency r = blocks_on_host({kAlign, kAlign, kAlign}, 2 * kAlign);
    Schedule s;
    s.use(1, Tier::device, Mode::read);
    s.release(s.acquire(0, Tier::device, Mode::write), discard);
    s.use(2, Tier::device, Mode::read);  // needs block 0's slot: its next use is the farthest
    const Plan p = simulate(r, s, {Policy::belady, false});
    EXPECT_EQ(p.link_bytes[static_cast<size_t>(Link::d2h)], discard ? 0u : kAlign) << "discard " << discard;
    EXPECT_EQ(p.link_bytes[static_cast<size_t>(Link::h2d)], 2 * kAlign) << "discard " << discard;
  }
}

// A clean copy whose next use overwrites it whole (a gradient after its update, before the next
// backward) is worth nothing until then: it is evicted before a copy that is read again, even
// one read later than that overwrite. Counting the overwrite as a use kept such copies and
// reloaded the other.
TEST(Planner, CleanCopyOverwrittenNextGoesBeforeOneReadLater) {
  for (bool discard : {false, true}) {
    Residency r = blocks_on_host({kAlign, kAlign, kAlign}, 2 * kAlign);
    Schedule s;
    s.use(0, Tier::device, Mode::read);                                      // A
    s.use(1, Tier::device, Mode::write);                                     // G written...
    s.release(s.acquire(1, Tier::device, Mode::read), discard);              // ...read, dead if discarded
    const size_t b = s.acquire(2, Tier::device, Mode::read);                 // B: room for one of A, G
    s.release(b);
    s.use(1, Tier::device, Mode::write);                                     // G overwritten
    s.release(s.acquire(1, Tier::device, Mode::read), discard);
    s.use(0, Tier::device, Mode::read);                                      // A read again
    const Plan p = simulate(r, s, {Policy::belady, false});
    // Discarded, G is clean and goes first; written and not discarded, evicting it would write
    // it home, so Belady's order stands (A, read later than G's overwrite, goes).
    const PlanOp victim{OpKind::evict, discard ? BlockId{1} : BlockId{0}, Tier::device};
    ASSERT_FALSE(p.before[b].empty());
    EXPECT_EQ(p.before[b].front(), victim) << "discard " << discard;
    if (discard) {
      EXPECT_EQ(p.link_bytes[static_cast<size_t>(Link::d2h)], 0u);
      EXPECT_EQ(p.link_bytes[static_cast<size_t>(Link::h2d)], 2 * kAlign);  // A and B, once each
    }
  }
}

// Two copies taking turns (speculation's flip): this step reads A and writes B, the next reads B
// and writes A. Told so (Schedule::set_successor), Belady keeps B, the copy read next, and drops
// A, clean and overwritten next; not told, it assumes the step repeats and keeps A.
TEST(Planner, SuccessorKeepsTheCopyTheNextStepReads) {
  for (bool told : {false, true}) {
    Residency r = blocks_on_host({kAlign, kAlign, kAlign}, 2 * kAlign);
    Schedule s;
    s.use(0, Tier::device, Mode::read);   // A: the current copy
    s.use(1, Tier::device, Mode::write);  // B: the other, written
    const size_t c = s.acquire(2, Tier::device, Mode::read);  // C: room for one of A, B
    s.release(c);
    if (told) s.set_successor({1, 0, 2});
    s.validate(3);
    const Plan p = simulate(r, s, {Policy::belady, false});
    ASSERT_FALSE(p.before[c].empty());
    const PlanOp victim{OpKind::evict, told ? BlockId{0} : BlockId{1}, Tier::device};
    EXPECT_EQ(p.before[c].front(), victim) << "told " << told;
  }
  Schedule bad;
  bad.use(0, Tier::device, Mode::read);
  bad.set_successor({0, 1});
  EXPECT_THROW(bad.validate(3), std::invalid_argument);
}

// A write-only acquire (speculation's second copy, a step's first gradients) needs only room.
// Prefetching issues it early like a fetch: its victim's write-back then runs ahead of the
// writer, and a fetch after it in MIN's order is no longer held back until the writer arrives
// (it was: allocations stayed at their demand and every later fetch waited behind them).
TEST(Planner, AllocationGoesEarlyAndDoesNotHoldBackLaterFetches) {
  Residency r = blocks_on_host({kAlign, kAlign, kAlign, kAlign}, 2 * kAlign);
  Schedule s;
  s.use(0, Tier::device, Mode::read);                        // A
  s.use(1, Tier::device, Mode::read);                        // B, not read again this step
  const size_t c = s.acquire(2, Tier::device, Mode::write);  // C written whole: MIN evicts B
  s.release(c);
  const size_t d = s.acquire(3, Tier::device, Mode::read);  // D: MIN evicts A (read later than C)
  s.release(d);
  s.use(2, Tier::device, Mode::read);
  s.use(0, Tier::device, Mode::read);
  s.validate(4);
  const Plan min = simulate(r, s, {Policy::belady, false});
  const Plan pre = simulate(r, s, {Policy::belady, true});
  EXPECT_EQ(pre.bytes_moved(), min.bytes_moved());  // the same moves, earlier
  const PlanOp alloc{OpKind::alloc, 2, Tier::device}, load{OpKind::load, 3, Tier::device};
  ASSERT_FALSE(min.before[c].empty());
  EXPECT_EQ(min.before[c].back(), alloc);
  EXPECT_TRUE(pre.before[c].empty()) << "the allocation waited for its writer";
  // Both go once their victims are spent (B's last use, then A's), before C's writer arrives.
  bool alloc_early = false, load_early = false;
  for (size_t i = 0; i < c; ++i)
    for (const PlanOp& op : pre.after[i]) {
      alloc_early = alloc_early || op == alloc;
      load_early = load_early || op == load;
    }
  EXPECT_TRUE(alloc_early);
  EXPECT_TRUE(load_early) << "the fetch after the allocation was held back until its writer";
}
