// `--offload auto`: the placements the planner searches (every --offload-* flag and
// --checkpoint-activations left as "auto"; a flag given by hand stays as given), the budgets a
// pick must fit, and the ranking. What a candidate costs (its pools and predicted step) is a
// callback, so the search is tested on a synthetic cost table and `strata plan`/`train` plug in
// the probed performance model (apps/strata/plan.cpp).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "src/train/options.h"

namespace strata {

// One placement: the values of the five flags.
struct PlacementChoice {
  std::string params, grads, optimizer, activations, checkpointing;
  bool operator==(const PlacementChoice&) const = default;
  // "params none, grads cpu, optimizer nvme, activations none, checkpointing full"
  std::string describe() const;
  void apply(TrainOptions& o) const;
};

// The value that leaves a flag to the search; `--offload auto` sets it on every flag of the
// five not given on the command line.
inline constexpr const char* kAuto = "auto";
bool wants_auto_placement(const TrainOptions& o);  // any of the five flags is "auto"

// Every placement with the fixed flags of o as given and the "auto" ones free: params, grads and
// optimizer none | cpu | nvme (nvme only where nvme_allowed: an --nvme-path was given);
// checkpointing none | full | every:2, activations none | cpu where blocks are checkpointed
// (kept inputs on NVMe are pruned: a few MiB per block, read back every step, never the
// placement that fits where RAM does not). The order is the tie-break: fewer bytes offloaded
// and less recompute first, so with ample memory the pick is all-resident.
std::vector<PlacementChoice> placement_candidates(const TrainOptions& o, bool nvme_allowed);

// What auto must fit. Unset budgets default to what the machine has less kAutoMargin.
struct AutoBudgets {
  uint64_t device = 0, host = 0;
  uint64_t shared = 0;  // > 0: device and host pools are the same RAM (CPU backend): their sum too
};
// The margin left to the OS and everything else: max(10%, 2 GiB) of what the machine has.
uint64_t auto_budget(uint64_t total_bytes);

// A candidate's pools and predicted step, from the probed model (or a test's table).
struct CandidateCost {
  uint64_t device_bytes = 0, host_bytes = 0, nvme_bytes = 0;  // the pools it would allocate
  double predicted_ms = 0;
};
// Evaluates one candidate; throws offload::BudgetError when its plan cannot run within the
// budgets it was given (it is then refused for that tier).
using CandidateCostFn = std::function<CandidateCost(const PlacementChoice&)>;

struct RankedCandidate {
  PlacementChoice choice;
  CandidateCost cost;
};
struct AutoSearch {
  std::vector<RankedCandidate> fitting;  // fastest first; ties in candidate order
  int n_candidates = 0;
  int refused_device = 0, refused_host = 0, refused_shared = 0;  // by the budget each overflowed
  // Of the refused, the one that came closest (smallest device + host, as far as known): for the
  // error when nothing fits.
  std::string closest;
  uint64_t closest_bytes = UINT64_MAX;
};
AutoSearch search_placements(const std::vector<PlacementChoice>& candidates, const AutoBudgets& budgets,
                             const CandidateCostFn& cost);
// The one-line error when nothing fits: the budgets and the smallest footprint found.
std::string no_placement_fits(const AutoSearch& s, const AutoBudgets& budgets);

}  // namespace strata
