// Planner: the step simulation (demand, eviction, prefetch) and the minimum-budget search.
#include "offload/planner.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <map>

#include "offload/size.h"

namespace strata::offload {
namespace {

// For each acquire event, the index of the next acquire of the same (block, tier), wrapping
// into the next step (index + size) when the step has no later one; kNever when it has none.
struct NextUse {
  std::vector<int64_t> next;   // [event]
  std::map<std::pair<BlockId, int>, int64_t> first;  // (block, tier) -> first acquire in the step
  // The acquire at event `next` (a copy's next use) only writes: CopyInfo::next_overwrites.
  bool overwrites(const Schedule& s, int64_t next) const {
    return next != kNever && !reads(s.events()[static_cast<size_t>(next % static_cast<int64_t>(s.size()))].mode);
  }
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
  // Past the step's end: the first use, in the next step, of the block this one becomes there.
  for (int64_t i = 0; i < n; ++i)
    if (!ev[i].release && nu.next[i] == kNever) {
      auto it = nu.first.find({s.successor(ev[i].block), index(ev[i].tier)});
      if (it != nu.first.end()) nu.next[i] = it->second + n;
    }
  return nu;
}

// A demand point of the MIN schedule: what Belady evicts and loads when event `event` arrives,
// and the earliest event after which it may be issued instead.
struct Group {
  size_t event;
  std::vector<PlanOp> ops;
  int64_t earliest = -1;  // issue after this event (-1: at the start of the step)
  bool hoistable = true;
};

class Simulation {
 public:
  Simulation(const Residency& start, const Schedule& s, const PlanOptions& opts, std::vector<Group> groups = {})
      : r_(start), s_(s), opts_(opts), nu_(next_uses(s)), groups_(std::move(groups)) {
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
        c.next_overwrites = nu_.overwrites(s_, c.next_use);
        base_ = std::max(base_, c.last_use + 1);
      }
    for (size_t g = 0; g < groups_.size(); ++g) group_at_[groups_[g].event] = g;
  }

  Plan run(Residency* end = nullptr) {
    const auto& ev = s_.events();
    hoist(-1);
    for (size_t i = 0; i < ev.size(); ++i) {
      const ScheduleEvent& e = ev[i];
      if (e.release) {
        r_.release(e.block, e.tier, e.mode);
        if (e.discard) r_.discard(e.block);
      } else {
        force_group(i);
        demand(i, e);
        r_.acquire(e.block, e.tier, e.mode);
        CopyInfo& c = r_.copy_mut(e.block, e.tier);
        c.next_use = nu_.next[i];
        c.next_overwrites = nu_.overwrites(s_, c.next_use);
        c.last_use = base_ + static_cast<int64_t>(i);
      }
      hoist(static_cast<int64_t>(i));
    }
    plan_.end_fingerprint = r_.fingerprint();
    if (end) *end = r_;
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

  // Evictions of a group whose copy is still there and free to go (as MIN found it).
  std::vector<BlockId> live_victims(const Group& g) const {
    std::vector<BlockId> v;
    for (const PlanOp& op : g.ops) {
      if (op.kind != OpKind::evict) continue;
      const CopyInfo& c = r_.copy(op.block, op.tier);
      if (c.present && c.pins == 0) v.push_back(op.block);
    }
    return v;
  }

  // Event i has arrived: its MIN group (if not issued early) goes now, before the demand.
  void force_group(size_t i) {
    auto it = group_at_.find(i);
    if (it == group_at_.end() || it->second < next_group_) return;
    assert(it->second == next_group_);
    const Group& g = groups_[next_group_++];
    if (g.ops.empty()) return;
    evict_all(live_victims(g), g.ops.front().tier, plan_.before[i]);
  }

  // Cao et al.'s conservative prefetching: MIN's fetches, in MIN's order, each issued as soon as
  // its victims are no longer used before it and its bytes are final — so it moves what MIN
  // moves, only earlier. Stops at the first group that cannot go yet (order is kept).
  // An allocation (a write-only acquire: speculation's second copies, a step's first grads) goes
  // early the same way: its victims' write-backs then run ahead of the writer instead of in
  // front of it, and the fetches after it in MIN's order are no longer held back until it.
  void hoist(int64_t i) {
    if (!opts_.prefetch) return;
    auto& ops = i < 0 ? plan_.start : plan_.after[static_cast<size_t>(i)];
    while (next_group_ < groups_.size()) {
      const Group& g = groups_[next_group_];
      if (!g.hoistable || g.earliest > i || static_cast<int64_t>(g.event) <= i) return;
      const PlanOp& op = g.ops.back();
      const bool load = op.kind == OpKind::load;
      assert(load || op.kind == OpKind::alloc);
      Tier t = op.tier;
      const CopyInfo& c = r_.copy(op.block, t);
      // Already there (placement differed from MIN's): nothing to do. (A write needs only room.)
      if (load ? c.valid : c.present) {
        ++next_group_;
        continue;
      }
      if (c.present || any_writer(op.block)) return;
      std::vector<BlockId> victims = live_victims(g);
      Arena a = r_.arena(t);
      for (BlockId v : victims) a.free(r_.copy(v, t).offset, r_.block(v).bytes);
      if (!a.can_alloc(r_.block(op.block).bytes)) return;  // placement differs: wait for the demand
      evict_all(victims, t, ops);
      if (load) {
        count(r_.load(op.block, t));
      } else {
        r_.alloc(op.block, t);
      }
      ops.push_back(op);
      r_.copy_mut(op.block, t).next_use = static_cast<int64_t>(g.event);
      r_.copy_mut(op.block, t).next_overwrites = !load;  // loaded to be read, or allocated to be written
      ++next_group_;
    }
  }

  bool any_writer(BlockId b) const {
    for (int t = 0; t < kNumTiers; ++t)
      if (r_.copy(b, static_cast<Tier>(t)).write_pins > 0) return true;
    return false;
  }

  Residency r_;
  const Schedule& s_;
  PlanOptions opts_;
  NextUse nu_;
  std::vector<Group> groups_;
  std::map<size_t, size_t> group_at_;  // event -> group
  size_t next_group_ = 0;
  Plan plan_;
  int64_t base_ = 0;
};

// MIN's demand points, with the earliest event after which each may be issued: after the last
// use of every victim (on that tier), after the last write of the block it loads, and after
// every earlier event of the block it allocates (so nothing touches that copy, which holds no
// bytes yet, before its writer).
std::vector<Group> min_groups(const Plan& min, const Schedule& s) {
  const auto& ev = s.events();
  std::vector<Group> groups;
  for (size_t j = 0; j < ev.size(); ++j) {
    if (min.before[j].empty()) continue;
    Group g{j, min.before[j]};
    auto last_before = [&](auto pred) {
      for (size_t k = j; k-- > 0;)
        if (pred(ev[k])) return static_cast<int64_t>(k);
      return int64_t{-1};
    };
    for (const PlanOp& op : g.ops) {
      if (op.kind == OpKind::alloc)
        g.earliest = std::max(g.earliest, last_before([&](const ScheduleEvent& e) { return e.block == op.block; }));
      if (op.kind == OpKind::evict)
        g.earliest = std::max(g.earliest, last_before([&](const ScheduleEvent& e) {
                                return e.block == op.block && e.tier == op.tier;
                              }));
      if (op.kind == OpKind::load)
        g.earliest = std::max(g.earliest, last_before([&](const ScheduleEvent& e) {
                                return e.block == op.block && writes(e.mode);
                              }));
    }
    if (g.ops.back().kind == OpKind::evict) g.hoistable = false;
    groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace

std::string Plan::name() const {
  if (options.policy == Policy::lru) return options.prefetch ? "lru+prefetch" : "lru";
  return options.prefetch ? "belady+prefetch" : "belady";
}

Plan simulate(const Residency& start, const Schedule& s, const PlanOptions& opts, Residency* end) {
  if (!opts.prefetch || opts.policy != Policy::belady) return Simulation(start, s, {opts.policy, false}).run(end);
  Plan min = Simulation(start, s, {Policy::belady, false}).run();
  return Simulation(start, s, opts, min_groups(min, s)).run(end);
}

std::vector<Plan> candidate_plans(const Residency& start, const Schedule& s) {
  std::vector<Plan> out;
  const PlanOptions cands[] = {{Policy::belady, true}, {Policy::belady, false}, {Policy::lru, false}};
  for (const auto& o : cands) {
    Residency end = start;
    try {
      out.push_back(simulate(start, s, o, &end));
    } catch (const BudgetError&) {
      continue;
    }
    try {  // steady: the plan can follow itself (its end state runs the next step)
      simulate(end, s, o);
      out.back().steady = true;
    } catch (const BudgetError&) {
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Plan& a, const Plan& b) {
    if (a.steady != b.steady) return a.steady;
    return a.bytes_moved() < b.bytes_moved();
  });
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
// Does `s` run from a cold start with these budgets?
bool runs(const Residency& state, const Schedule& s, const std::array<uint64_t, kNumTiers>& budgets) {
  try {
    Residency cold = state.cold(budgets);
    return !candidate_plans(cold, s).empty();
  } catch (const BudgetError&) {
    return false;
  }
}
std::array<uint64_t, kNumTiers> budgets_of(const Residency& state) {
  std::array<uint64_t, kNumTiers> b;
  for (int k = 0; k < kNumTiers; ++k) b[k] = state.budget(static_cast<Tier>(k));
  return b;
}
}  // namespace

uint64_t working_set_bytes(const Residency& state, const Schedule& s, Tier t) {
  std::vector<bool> touched(state.n_blocks(), false);
  for (const auto& e : s.events())
    if (e.tier == t) touched[e.block] = true;
  uint64_t bytes = 0;
  for (BlockId b = 0; b < state.n_blocks(); ++b)
    if (touched[b] || state.block(b).home == t) bytes += align_up(state.block(b).bytes);
  return bytes;
}

uint64_t min_budget(const Residency& state, const Schedule& s, Tier t) {
  std::array<uint64_t, kNumTiers> budgets = budgets_of(state);
  auto runs_at = [&](uint64_t b) {
    budgets[index(t)] = b;
    return runs(state, s, budgets);
  };
  uint64_t lo = peak_pinned_bytes(state, s, t);
  uint64_t hi = working_set_bytes(state, s, t);
  if (runs_at(lo)) return lo;
  if (!runs_at(hi))  // another tier is what is too small: no budget of t alone makes it run
    throw BudgetError("offload: no " + std::string(tier_name(t)) + " budget runs this schedule with the other " +
                          "tiers' budgets as they are",
                      t, state.budget(t), 0);
  // Invariant: hi runs, lo does not.
  while (hi - lo > kAlign) {
    uint64_t mid = (lo + (hi - lo) / 2) / kAlign * kAlign;
    if (mid <= lo) mid = lo + kAlign;
    (runs_at(mid) ? hi : lo) = mid;
  }
  return hi;
}

uint64_t min_budget(const Residency& state, std::span<const Schedule> programs, Tier t) {
  uint64_t need = 0;
  for (const Schedule& s : programs) need = std::max(need, min_budget(state, s, t));
  std::array<uint64_t, kNumTiers> budgets = budgets_of(state);
  budgets[index(t)] = need;
  bool all = true;
  for (const Schedule& s : programs) all = all && runs(state, s, budgets);
  if (all) return need;
  for (const Schedule& s : programs) need = std::max(need, working_set_bytes(state, s, t));
  return need;
}

void check_budgets(const Residency& state, const Schedule& s) {
  check_budgets(state, budgets_of(state), std::span<const Schedule>(&s, 1));
}

void check_budgets(const Residency& blocks, const std::array<uint64_t, kNumTiers>& budgets,
                   std::span<const Schedule> programs) {
  auto runs_all = [&](const std::array<uint64_t, kNumTiers>& b) {
    for (const Schedule& s : programs)
      if (!runs(blocks, s, b)) return false;
    return true;
  };
  if (runs_all(budgets)) return;
  // Name each tier that is too small on its own: its minimum with the other tiers roomy enough
  // that they evict nothing (so the blame is never put on a tier that is not short).
  std::array<uint64_t, kNumTiers> roomy = budgets;
  for (int k = 0; k < kNumTiers; ++k)
    for (const Schedule& s : programs)
      roomy[k] = std::max(roomy[k], working_set_bytes(blocks, s, static_cast<Tier>(k)));
  const Residency at_roomy = blocks.cold(roomy);
  std::string what;
  Tier first = Tier::device;
  uint64_t first_need = 0;
  for (int k = 0; k < kNumTiers; ++k) {
    const Tier t = static_cast<Tier>(k);
    std::array<uint64_t, kNumTiers> b = roomy;
    b[k] = budgets[k];
    if (runs_all(b)) continue;
    const uint64_t need = min_budget(at_roomy, programs, t);
    if (what.empty()) first = t, first_need = need;
    what += (what.empty() ? "" : "; ") + std::string(tier_name(t)) + " budget " + format_size(budgets[k]) +
            " is below the minimum " + format_size(need) + " (" + std::to_string(need) +
            " bytes) at which this step's schedule can run: " + std::string(budget_remedy(t)) + " to at least that";
  }
  if (what.empty())  // each tier suffices alone, not together
    what = "the device, host and NVMe budgets together are too small for this step's schedule (each would do if "
           "the others were larger); raise --device-mem or --host-mem";
  throw BudgetError(what, first, budgets[index(first)], first_need);
}

}  // namespace strata::offload
