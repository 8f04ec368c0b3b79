// Planner: the step simulation (demand, eviction, prefetch) and the minimum-budget search.
#include "offload/planner.h"

#include <algorithm>
#include <cassert>
#include <map>
#include <unordered_set>

#include "offload/size.h"

namespace strata::offload {
namespace {

// For each acquire event, the index of the next acquire of the same (block, tier), wrapping
// into the next step (index + size) when the step has no later one; kNever when it has none.
struct NextUse {
  std::vector<int64_t> next;   // [event]
  std::map<std::pair<BlockId, int>, int64_t> first;  // (block, tier) -> first acquire in the step
};

NextUse next_uses(const Schedule& s) {
  const auto& ev = s.events();
  int64_t n = static_cast<int64_t>(ev.size());
  NextUse nu;
  nu.next.assign(ev.size(), kNever);
  std::map<std::pair<BlockId, int>, int64_t> later;
  for (int64_t i = n - 1; i >= 0; --i) {
    if (ev[i].release) continue;
    auto key = std::make_pair(ev[i].block, index(ev[i].tier));
    auto it = later.find(key);
    if (it != later.end()) nu.next[i] = it->second;
    later[key] = i;
  }
  nu.first = later;
  for (int64_t i = 0; i < n; ++i)
    if (!ev[i].release && nu.next[i] == kNever) nu.next[i] = nu.first[{ev[i].block, index(ev[i].tier)}] + n;
  return nu;
}

class Simulation {
 public:
  Simulation(const Residency& start, const Schedule& s, const PlanOptions& opts)
      : r_(start), s_(s), opts_(opts), nu_(next_uses(s)) {
    plan_.options = opts;
    plan_.before.resize(s.size());
    plan_.after.resize(s.size());
    plan_.schedule_fingerprint = s.fingerprint();
    plan_.start_fingerprint = start.fingerprint();
    // Copies carried over from the last step: next use is their first acquire in this step.
    for (BlockId b = 0; b < r_.n_blocks(); ++b)
      for (int t = 0; t < kNumTiers; ++t) {
        CopyInfo& c = r_.copy_mut(b, static_cast<Tier>(t));
        if (!c.present) continue;
        auto it = nu_.first.find({b, t});
        c.next_use = it == nu_.first.end() ? kNever : it->second;
        base_ = std::max(base_, c.last_use + 1);
      }
  }

  Plan run() {
    const auto& ev = s_.events();
    if (opts_.prefetch) prefetch(-1);
    for (size_t i = 0; i < ev.size(); ++i) {
      const ScheduleEvent& e = ev[i];
      if (e.release) {
        r_.release(e.block, e.tier, e.mode);
      } else {
        demand(i, e);
        r_.acquire(e.block, e.tier, e.mode);
        CopyInfo& c = r_.copy_mut(e.block, e.tier);
        c.next_use = nu_.next[i];
        c.last_use = base_ + static_cast<int64_t>(i);
      }
      if (opts_.prefetch) prefetch(static_cast<int64_t>(i));
    }
    plan_.end_fingerprint = r_.fingerprint();
    return std::move(plan_);
  }

 private:
  void count(const Effects& fx) {
    for (const Move& m : fx.moves) add_move_bytes(plan_.link_bytes, m.from, m.to, m.bytes);
  }

  void evict_all(const std::vector<BlockId>& victims, Tier t, std::vector<PlanOp>& ops) {
    for (BlockId v : victims) {
      count(r_.evict(v, t));
      ops.push_back({OpKind::evict, v, t});
    }
  }

  void demand(size_t i, const ScheduleEvent& e) {
    if (!r_.needs_load(e.block, e.tier, e.mode)) return;
    auto& ops = plan_.before[i];
    const CopyInfo& c = r_.copy(e.block, e.tier);
    uint64_t bytes = r_.block(e.block).bytes;
    if (!c.present) {
      auto victims = r_.choose_victims(e.tier, bytes, opts_.policy, std::numeric_limits<int64_t>::min());
      if (!victims) {
        throw BudgetError(std::string(tier_name(e.tier)) + " budget " + format_size(r_.budget(e.tier)) +
                              " cannot run the schedule: at " + s_.describe(i) + " (" + format_size(bytes) +
                              ") " + format_size(r_.pinned_bytes(e.tier)) + " are pinned or home",
                          e.tier, r_.budget(e.tier), 0);
      }
      evict_all(*victims, e.tier, ops);
    }
    if (reads(e.mode)) {
      count(r_.load(e.block, e.tier));
      ops.push_back({OpKind::load, e.block, e.tier});
    } else {
      r_.alloc(e.block, e.tier);
      ops.push_back({OpKind::alloc, e.block, e.tier});
    }
  }

  // After event i (-1: at the start of the step): load the copies the next acquires read, in order, while room can be made by
  // evicting only copies needed later than the one being loaded. Stops at the first that does
  // not fit, so prefetches never overtake each other.
  void prefetch(int64_t i) {
    const auto& ev = s_.events();
    size_t n = ev.size();
    std::unordered_set<BlockId> written;  // blocks written between i and the candidate
    size_t horizon = std::min(n, opts_.lookahead);
    for (size_t k = 1; k <= horizon; ++k) {
      int64_t j = i + static_cast<int64_t>(k);
      const ScheduleEvent& e = ev[j % n];
      if (e.release) continue;
      BlockId b = e.block;
      bool stale_first = written.count(b) > 0;  // a prefetched copy would go stale before its use
      if (writes(e.mode)) written.insert(b);
      if (!reads(e.mode) || stale_first) continue;
      CopyInfo& c = r_.copy_mut(b, e.tier);
      if (c.valid) continue;
      if (being_written(b)) continue;  // its current bytes are still being produced
      if (c.present || e.tier == r_.block(b).home) continue;  // stale home: refreshed on demand
      uint64_t bytes = r_.block(b).bytes;
      auto victims = r_.choose_victims(e.tier, bytes, Policy::belady, j);
      if (!victims) return;
      auto& ops = i < 0 ? plan_.start : plan_.after[static_cast<size_t>(i)];
      evict_all(*victims, e.tier, ops);
      count(r_.load(b, e.tier));
      ops.push_back({OpKind::load, b, e.tier});
      r_.copy_mut(b, e.tier).next_use = j;
    }
  }

  // A copy of b is acquired in a writing mode right now: its bytes are still being produced.
  bool being_written(BlockId b) const {
    for (int t = 0; t < kNumTiers; ++t)
      if (r_.copy(b, static_cast<Tier>(t)).write_pins > 0) return true;
    return false;
  }

  Residency r_;
  const Schedule& s_;
  PlanOptions opts_;
  NextUse nu_;
  Plan plan_;
  int64_t base_ = 0;
};

}  // namespace

std::string Plan::name() const {
  if (options.policy == Policy::lru) return options.prefetch ? "lru+prefetch" : "lru";
  return options.prefetch ? "belady+prefetch" : "belady";
}

Plan simulate(const Residency& start, const Schedule& s, const PlanOptions& opts) {
  return Simulation(start, s, opts).run();
}

std::vector<Plan> candidate_plans(const Residency& start, const Schedule& s) {
  std::vector<Plan> out;
  const PlanOptions cands[] = {{Policy::belady, true}, {Policy::belady, false}, {Policy::lru, false}};
  for (const auto& o : cands) {
    try {
      out.push_back(simulate(start, s, o));
    } catch (const BudgetError&) {
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Plan& a, const Plan& b) { return a.bytes_moved() < b.bytes_moved(); });
  return out;
}

uint64_t peak_pinned_bytes(const Residency& state, const Schedule& s, Tier t) {
  uint64_t home = 0;
  for (const auto& b : state.blocks())
    if (b.home == t) home += align_up(b.bytes);
  std::map<BlockId, int> pins;  // non-home copies pinned in t
  uint64_t pinned = 0, peak = 0;
  for (const auto& e : s.events()) {
    if (e.tier != t || state.block(e.block).home == t) continue;
    uint64_t bytes = align_up(state.block(e.block).bytes);
    if (!e.release) {
      if (pins[e.block]++ == 0) pinned += bytes;
    } else if (--pins[e.block] == 0) {
      pinned -= bytes;
    }
    peak = std::max(peak, pinned);
  }
  return home + peak;
}

namespace {
bool runs(const Residency& state, const Schedule& s, Tier t, uint64_t budget) {
  std::array<uint64_t, kNumTiers> budgets;
  for (int k = 0; k < kNumTiers; ++k) budgets[k] = state.budget(static_cast<Tier>(k));
  budgets[index(t)] = budget;
  try {
    Residency cold = state.cold(budgets);
    return !candidate_plans(cold, s).empty();
  } catch (const BudgetError&) {
    return false;
  }
}
}  // namespace

uint64_t min_budget(const Residency& state, const Schedule& s, Tier t) {
  uint64_t lo = peak_pinned_bytes(state, s, t);
  uint64_t hi = 0;  // every home copy plus every copy the schedule touches: nothing is evicted
  std::vector<bool> touched(state.n_blocks(), false);
  for (const auto& e : s.events())
    if (e.tier == t) touched[e.block] = true;
  for (BlockId b = 0; b < state.n_blocks(); ++b)
    if (touched[b] || state.block(b).home == t) hi += align_up(state.block(b).bytes);
  if (runs(state, s, t, lo)) return lo;
  assert(runs(state, s, t, hi));
  // Invariant: hi runs, lo does not.
  while (hi - lo > kAlign) {
    uint64_t mid = (lo + (hi - lo) / 2) / kAlign * kAlign;
    if (mid <= lo) mid = lo + kAlign;
    (runs(state, s, t, mid) ? hi : lo) = mid;
  }
  return hi;
}

void check_budgets(const Residency& state, const Schedule& s) {
  for (int k = 0; k < kNumTiers; ++k) {
    Tier t = static_cast<Tier>(k);
    if (runs(state, s, t, state.budget(t))) continue;
    uint64_t need = min_budget(state, s, t);
    throw BudgetError(std::string(tier_name(t)) + " budget " + format_size(state.budget(t)) +
                          " is below the minimum " + format_size(need) + " (" + std::to_string(need) +
                          " bytes) at which this step's schedule can run; raise --" + std::string(tier_name(t)) +
                          "-mem to at least that",
                      t, state.budget(t), need);
  }
}

}  // namespace strata::offload
