// Planner: turns one step's schedule into the loads, allocations and evictions to issue around
// each event, by simulating the step on a copy of the residency state. Eviction by next-use
// distance (Belady's MIN; exact because the step repeats, so next use wraps into the next step),
// prefetch as early as the budget allows (MIN's own fetches, hoisted: no extra bytes), and the
// smallest budget at which a schedule runs.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "offload/residency.h"
#include "offload/schedule.h"
#include "offload/stats.h"

namespace strata::offload {

enum class OpKind : uint8_t { load, alloc, evict };
struct PlanOp {
  OpKind kind;
  BlockId block;
  Tier tier;
  bool operator==(const PlanOp&) const = default;
};

struct PlanOptions {
  Policy policy = Policy::belady;
  bool prefetch = true;  // Belady only: issue MIN's fetches early (Cao's conservative prefetching)
};

struct Plan {
  PlanOptions options;
  std::vector<PlanOp> start;                // prefetches at the start of the step
  std::vector<std::vector<PlanOp>> before;  // [event]: demand ops, issued when the event arrives
  std::vector<std::vector<PlanOp>> after;   // [event]: prefetches (and the evictions they need)
  LinkBytes link_bytes{};                   // moved per step, by link
  uint64_t schedule_fingerprint = 0;
  uint64_t start_fingerprint = 0;  // residency state the plan starts from
  uint64_t end_fingerprint = 0;    // ... and leaves behind
  bool steady = false;             // candidate_plans: the next step runs from where this one ends
  uint64_t bytes_moved() const { return total(link_bytes); }
  std::string name() const;  // "belady+prefetch", "belady", "lru"
};

// Simulates one step of `s` from `start` (and leaves the state it ends in in *end). Throws
// BudgetError (minimum 0: unknown) when a demand cannot be met even after evicting everything
// unpinned.
Plan simulate(const Residency& start, const Schedule& s, const PlanOptions& opts, Residency* end = nullptr);

// The candidates (Belady with prefetch, Belady on demand, LRU on demand) that run from `start`:
// steady ones first (their end state runs the next step: no cache flush between steps), then
// cheapest in bytes moved (ties: the earlier candidate). Empty when none runs.
std::vector<Plan> candidate_plans(const Residency& start, const Schedule& s);

// Smallest budget for tier t (the other tiers as in `state`) at which `s` runs from a cold start
// (home copies only). Searched by bisection between the bytes that must be resident at once
// and the bytes of every copy the schedule touches; fragmentation can make feasibility
// non-monotone, so the answer is a budget that was verified to run.
uint64_t min_budget(const Residency& state, const Schedule& s, Tier t);
// The same for several programs that must all run under one budget: the largest of their
// minimums (each verified on its own), or, where fragmentation makes that one fail another
// program, every copy the programs touch in t (which runs them all).
uint64_t min_budget(const Residency& state, std::span<const Schedule> programs, Tier t);
// Bytes that must be resident in t at the busiest event (home copies + pinned copies): a lower
// bound of min_budget.
uint64_t peak_pinned_bytes(const Residency& state, const Schedule& s, Tier t);

// Tier t's budget at which nothing need ever be evicted from it: every home copy there plus
// every copy the schedule touches there. Budgets above it buy nothing.
uint64_t working_set_bytes(const Residency& state, const Schedule& s, Tier t);

// Throws BudgetError naming the tier, its budget and the minimum when no candidate runs `s`
// from a cold start under the budgets of `state`.
void check_budgets(const Residency& state, const Schedule& s);
// The same for several programs under `budgets` rather than the budgets of `blocks` (only its
// blocks are used): a budget that cannot even hold its tier's home copies is named with the
// minimum at which every program runs, not the home copies that overflow it.
void check_budgets(const Residency& blocks, const std::array<uint64_t, kNumTiers>& budgets,
                   std::span<const Schedule> programs);

}  // namespace strata::offload
