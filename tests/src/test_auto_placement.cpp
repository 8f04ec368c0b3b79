// `--offload auto`'s search (src/train/auto_placement.h) over a synthetic cost table: it never
// picks a placement above a budget, picks all-resident when memory is ample, keeps every flag
// given by hand, and is never slower than the hand placement when that fits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "offload/residency.h"
#include "src/train/auto_placement.h"

using namespace strata;

namespace {

constexpr uint64_t GiB = uint64_t{1} << 30;

TrainOptions all_auto() {
  TrainOptions o;
  o.offload = "auto";
  o.offload_params = o.offload_grads = o.offload_optimizer = o.offload_activations = o.checkpoint_activations = kAuto;
  return o;
}

// A toy model of a 1B run: params 2 GiB, grads 4, optimizer 12, activations 6 (none kept when
// checkpointed: 1). What is off the device costs time (cpu a little, nvme more), recompute too.
CandidateCost toy_cost(const PlacementChoice& c) {
  CandidateCost k;
  const auto put = [&](const std::string& tier, uint64_t bytes, double cpu_ms, double nvme_ms) {
    if (tier == "none") k.device_bytes += bytes;
    else if (tier == "cpu") k.host_bytes += bytes, k.predicted_ms += cpu_ms;
    else k.nvme_bytes += bytes, k.host_bytes += bytes / 8, k.predicted_ms += nvme_ms;  // staging
  };
  k.predicted_ms = 1000;
  put(c.params, 2 * GiB, 40, 400);
  put(c.grads, 4 * GiB, 30, 300);
  put(c.optimizer, 12 * GiB, 20, 900);
  if (c.checkpointing == "none") {
    k.device_bytes += 6 * GiB;
  } else {
    k.predicted_ms += c.checkpointing == "full" ? 330 : 170;
    put(c.activations, (c.checkpointing == "full" ? 1 : 3) * GiB, 5, 50);
  }
  return k;
}

bool fits(const CandidateCost& k, const AutoBudgets& b) {
  return k.device_bytes <= b.device && k.host_bytes <= b.host && (b.shared == 0 || k.device_bytes + k.host_bytes <= b.shared);
}

TEST(AutoPlacement, CandidatesCoverEveryFreeFlagAndNoNvmeWithoutAPath) {
  const auto with_nvme = placement_candidates(all_auto(), true);
  const auto without = placement_candidates(all_auto(), false);
  // 3 tiers for params, grads, optimizer; checkpointing none (activations none), every:2 and full
  // (activations none | cpu).
  EXPECT_EQ(with_nvme.size(), 27u * 5u);
  EXPECT_EQ(without.size(), 8u * 5u);
  for (const PlacementChoice& c : without)
    EXPECT_TRUE(c.params != "nvme" && c.grads != "nvme" && c.optimizer != "nvme" && c.activations != "nvme")
        << c.describe();
  for (const PlacementChoice& c : with_nvme)
    if (c.checkpointing == "none") {
      EXPECT_EQ(c.activations, "none") << c.describe();
    }
  EXPECT_EQ(with_nvme.front(), (PlacementChoice{"none", "none", "none", "none", "none"}));
}

TEST(AutoPlacement, NeverExceedsABudget) {
  const auto cands = placement_candidates(all_auto(), true);
  for (const AutoBudgets b : {AutoBudgets{30 * GiB, 30 * GiB, 0}, AutoBudgets{8 * GiB, 6 * GiB, 0},
                              AutoBudgets{3 * GiB, 8 * GiB, 0}, AutoBudgets{20 * GiB, 20 * GiB, 22 * GiB},
                              AutoBudgets{10 * GiB, 16 * GiB, 20 * GiB}}) {
    const AutoSearch s = search_placements(cands, b, toy_cost);
    ASSERT_FALSE(s.fitting.empty());
    for (const RankedCandidate& r : s.fitting) EXPECT_TRUE(fits(r.cost, b)) << r.choice.describe();
    EXPECT_EQ(s.fitting.size() + static_cast<size_t>(s.refused_device + s.refused_host + s.refused_shared),
              cands.size());
    // Ranked fastest first, and the pick is the fastest of all that fit.
    EXPECT_TRUE(std::is_sorted(s.fitting.begin(), s.fitting.end(), [](const auto& x, const auto& y) {
      return x.cost.predicted_ms < y.cost.predicted_ms;
    }));
    for (const PlacementChoice& c : cands)
      if (fits(toy_cost(c), b)) {
        EXPECT_LE(s.fitting.front().cost.predicted_ms, toy_cost(c).predicted_ms);
      }
  }
}

TEST(AutoPlacement, AmpleMemoryPicksAllResident) {
  const AutoSearch s = search_placements(placement_candidates(all_auto(), true), {64 * GiB, 64 * GiB, 0}, toy_cost);
  ASSERT_FALSE(s.fitting.empty());
  EXPECT_EQ(s.fitting.front().choice, (PlacementChoice{"none", "none", "none", "none", "none"}));
  // Ties (the CPU backend, where none and cpu are the same RAM at the same speed) go to the
  // placement that offloads less.
  const AutoSearch tie = search_placements(placement_candidates(all_auto(), false), {64 * GiB, 64 * GiB, 0},
                                           [](const PlacementChoice&) { return CandidateCost{GiB, GiB, 0, 100}; });
  EXPECT_EQ(tie.fitting.front().choice, (PlacementChoice{"none", "none", "none", "none", "none"}));
}

TEST(AutoPlacement, NeverSlowerThanTheHandPlacementThatFits) {
  // The hand placement of the 1.5B recipe (everything on NVMe, full checkpointing) is a
  // candidate, so the pick's prediction, from the same costs, is at most its.
  const PlacementChoice hand{"nvme", "nvme", "nvme", "none", "full"};
  const AutoBudgets b{3 * GiB, 8 * GiB, 0};
  ASSERT_TRUE(fits(toy_cost(hand), b));
  const AutoSearch s = search_placements(placement_candidates(all_auto(), true), b, toy_cost);
  ASSERT_FALSE(s.fitting.empty());
  EXPECT_LE(s.fitting.front().cost.predicted_ms, toy_cost(hand).predicted_ms);
}

TEST(AutoPlacement, ExplicitFlagsWinFlagByFlag) {
  TrainOptions o = all_auto();
  o.offload_params = "nvme";
  o.checkpoint_activations = "full";
  const auto cands = placement_candidates(o, true);
  ASSERT_FALSE(cands.empty());
  for (const PlacementChoice& c : cands) {
    EXPECT_EQ(c.params, "nvme");
    EXPECT_EQ(c.checkpointing, "full");
  }
  const AutoSearch s = search_placements(cands, {64 * GiB, 64 * GiB, 0}, toy_cost);
  EXPECT_EQ(s.fitting.front().choice, (PlacementChoice{"nvme", "none", "none", "none", "full"}));
  // Nothing free: the one candidate is the hand placement.
  TrainOptions fixed;
  EXPECT_EQ(placement_candidates(fixed, true), (std::vector<PlacementChoice>{{"none", "none", "none", "none", "none"}}));
}

TEST(AutoPlacement, NothingFitsNamesTheBudgetsAndTheClosest) {
  const AutoBudgets b{1 * GiB, 1 * GiB, 0};
  const AutoSearch s = search_placements(placement_candidates(all_auto(), true), b, toy_cost);
  EXPECT_TRUE(s.fitting.empty());
  const std::string msg = no_placement_fits(s, b);
  EXPECT_NE(msg.find("1.00 GiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("closest"), std::string::npos) << msg;
  // A plan that throws BudgetError is refused for its tier, with its minimum as the near miss.
  const AutoSearch t = search_placements({{"none", "none", "none", "none", "none"}}, b, [](const PlacementChoice&) -> CandidateCost {
    throw offload::BudgetError("too small", offload::Tier::host, GiB, 5 * GiB);
  });
  EXPECT_EQ(t.refused_host, 1);
  EXPECT_NE(t.closest.find("5.00 GiB"), std::string::npos) << t.closest;
}

TEST(AutoPlacement, AutoBudgetLeavesAMargin) {
  EXPECT_EQ(auto_budget(100 * GiB), 90 * GiB);
  EXPECT_EQ(auto_budget(16 * GiB), 14 * GiB);  // 2 GiB is more than 10%
  EXPECT_EQ(auto_budget(GiB), 0u);
}

}  // namespace
