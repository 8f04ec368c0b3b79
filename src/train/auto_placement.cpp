// `--offload auto`'s search: candidates, budgets, ranking (auto_placement.h).
#include "src/train/auto_placement.h"

#include <fmt/format.h>

#include <algorithm>

#include "offload/residency.h"
#include "offload/size.h"

namespace strata {

std::string PlacementChoice::describe() const {
  return fmt::format("params {}, grads {}, optimizer {}, activations {}, checkpointing {}", params, grads, optimizer,
                     activations, checkpointing);
}

void PlacementChoice::apply(TrainOptions& o) const {
  o.offload_params = params;
  o.offload_grads = grads;
  o.offload_optimizer = optimizer;
  o.offload_activations = activations;
  o.checkpoint_activations = checkpointing;
}

bool wants_auto_placement(const TrainOptions& o) {
  for (const std::string* v : {&o.offload_params, &o.offload_grads, &o.offload_optimizer, &o.offload_activations,
                               &o.checkpoint_activations})
    if (*v == kAuto) return true;
  return false;
}

std::vector<PlacementChoice> placement_candidates(const TrainOptions& o, bool nvme_allowed) {
  const auto tiers = [&](const std::string& given, std::vector<std::string> free) {
    return given == kAuto ? free : std::vector<std::string>{given};
  };
  std::vector<std::string> state_tiers{"none", "cpu"};
  if (nvme_allowed) state_tiers.push_back("nvme");
  const std::vector<std::string> params = tiers(o.offload_params, state_tiers);
  const std::vector<std::string> grads = tiers(o.offload_grads, state_tiers);
  const std::vector<std::string> optimizer = tiers(o.offload_optimizer, state_tiers);
  const std::vector<std::string> ckpts = tiers(o.checkpoint_activations, {"none", "every:2", "full"});
  std::vector<PlacementChoice> out;
  for (const std::string& c : ckpts)
    for (const std::string& a : tiers(o.offload_activations, c == "none" ? std::vector<std::string>{"none"}
                                                                         : std::vector<std::string>{"none", "cpu"})) {
      if (c == "none" && a != "none") continue;  // kept inputs exist only for checkpointed blocks
      for (const std::string& p : params)
        for (const std::string& g : grads)
          for (const std::string& opt : optimizer) out.push_back({p, g, opt, a, c});
    }
  // Ties go to the candidate that offloads less: fewer states off the device, nearer tiers.
  const auto rank = [](const std::string& t) { return t == "none" ? 0 : t == "cpu" ? 1 : 2; };
  std::stable_sort(out.begin(), out.end(), [&](const PlacementChoice& a, const PlacementChoice& b) {
    const auto key = [&](const PlacementChoice& c) {
      return rank(c.params) + rank(c.grads) + rank(c.optimizer) + rank(c.activations);
    };
    return key(a) < key(b);
  });
  return out;
}

uint64_t auto_budget(uint64_t total_bytes) {
  const uint64_t margin = std::max(total_bytes / 10, uint64_t{2} << 30);
  return total_bytes > margin ? total_bytes - margin : 0;
}

AutoSearch search_placements(const std::vector<PlacementChoice>& candidates, const AutoBudgets& b,
                             const CandidateCostFn& cost) {
  AutoSearch s;
  s.n_candidates = static_cast<int>(candidates.size());
  const auto near_miss = [&](const PlacementChoice& c, uint64_t bytes, const std::string& what) {
    if (bytes < s.closest_bytes) s.closest_bytes = bytes, s.closest = c.describe() + " (" + what + ")";
  };
  for (const PlacementChoice& c : candidates) {
    CandidateCost k;
    try {
      k = cost(c);
    } catch (const offload::BudgetError& e) {
      (e.tier() == offload::Tier::device ? s.refused_device : s.refused_host) += 1;
      if (e.minimum() > 0)
        near_miss(c, e.minimum(), fmt::format("needs {} of {} memory", offload::format_size(e.minimum()),
                                              offload::tier_name(e.tier())));
      continue;
    }
    // Budgets are hard: a pool above its budget is refused even if the cost model sized it so.
    const std::string footprint = fmt::format("device {}, host {}", offload::format_size(k.device_bytes),
                                              offload::format_size(k.host_bytes));
    if (k.device_bytes > b.device || k.host_bytes > b.host || (b.shared > 0 && k.device_bytes + k.host_bytes > b.shared)) {
      (k.device_bytes > b.device ? s.refused_device : k.host_bytes > b.host ? s.refused_host : s.refused_shared) += 1;
      near_miss(c, k.device_bytes + k.host_bytes, footprint);
      continue;
    }
    s.fitting.push_back({c, k});
  }
  std::stable_sort(s.fitting.begin(), s.fitting.end(), [](const RankedCandidate& a, const RankedCandidate& b) {
    return a.cost.predicted_ms < b.cost.predicted_ms;
  });
  return s;
}

std::string no_placement_fits(const AutoSearch& s, const AutoBudgets& b) {
  return fmt::format("--offload auto: none of the {} placements fits device memory {} and host memory {}{} ({} refused "
                     "by the device budget, {} by the host budget{}); the closest: {}. Raise --device-mem or "
                     "--host-mem, or give an --nvme-path so state can live on NVMe",
                     s.n_candidates, offload::format_size(b.device), offload::format_size(b.host),
                     b.shared ? ", together at most " + offload::format_size(b.shared) + " of the one RAM" : "",
                     s.refused_device, s.refused_host,
                     s.refused_shared ? fmt::format(", {} by their sum in RAM", s.refused_shared) : "",
                     s.closest.empty() ? "none sized" : s.closest);
}

}  // namespace strata
