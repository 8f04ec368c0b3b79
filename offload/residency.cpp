// Residency: the copy-state machine shared by the planner's simulation and the manager.
#include "offload/residency.h"

#include <algorithm>
#include <cassert>

#include "offload/size.h"

namespace strata::offload {

Residency::Residency(std::array<uint64_t, kNumTiers> budgets) : budgets_(budgets) {
  for (int t = 0; t < kNumTiers; ++t) arenas_[t] = Arena(budgets[t]);
}

BlockId Residency::add_block(const BlockSpec& spec) {
  if (spec.bytes == 0) throw std::invalid_argument("offload: block '" + spec.name + "' has zero bytes");
  auto off = arenas_[index(spec.home)].alloc(spec.bytes);
  if (!off) {
    uint64_t used = arenas_[index(spec.home)].used();
    throw BudgetError(std::string(tier_name(spec.home)) + " budget " + format_size(budget(spec.home)) +
                          " cannot hold the home copy of block '" + spec.name + "' (" + format_size(spec.bytes) +
                          ") after " + format_size(used) + " of other home copies; " +
                          std::string(budget_remedy(spec.home)) + " to at least " +
                          format_size(used + align_up(spec.bytes)),
                      spec.home, budget(spec.home), used + align_up(spec.bytes));
  }
  blocks_.push_back(spec);
  copies_.emplace_back();
  CopyInfo& home = copies_.back()[index(spec.home)];
  home.present = home.valid = true;
  home.offset = *off;
  return static_cast<BlockId>(blocks_.size() - 1);
}

Residency Residency::cold(std::array<uint64_t, kNumTiers> budgets) const {
  Residency r(budgets);
  for (const auto& b : blocks_) r.add_block(b);
  return r;
}

std::optional<Tier> Residency::best_source(BlockId b, Tier t) const {
  // Cheapest link first: PCIe before NVMe, NVMe reads through host staging.
  static constexpr Tier kOrder[kNumTiers][kNumTiers - 1] = {
      {Tier::host, Tier::nvme}, {Tier::device, Tier::nvme}, {Tier::host, Tier::device}};
  for (Tier s : kOrder[index(t)])
    if (copies_[b][index(s)].valid) return s;
  return std::nullopt;
}

bool Residency::needs_load(BlockId b, Tier t, Mode m) const {
  const CopyInfo& c = copy(b, t);
  return reads(m) ? !c.valid : !c.present;
}

Effects Residency::load(BlockId b, Tier t) {
  Effects fx;
  CopyInfo& c = copy_mut(b, t);
  assert(!c.valid);
  auto src = best_source(b, t);
  assert(src && "offload: a block with no valid copy");
  if (!c.present) {
    auto off = arenas_[index(t)].alloc(blocks_[b].bytes);
    if (!off) throw std::logic_error("offload: load of block '" + blocks_[b].name + "' without room (planner bug)");
    c.present = true;
    c.offset = *off;
  }
  c.valid = true;
  fx.moves.push_back({b, *src, t, copy(b, *src).offset, c.offset, blocks_[b].bytes});
  return fx;
}

void Residency::alloc(BlockId b, Tier t) {
  CopyInfo& c = copy_mut(b, t);
  assert(!c.present && t != blocks_[b].home);
  auto off = arenas_[index(t)].alloc(blocks_[b].bytes);
  if (!off) throw std::logic_error("offload: allocation of block '" + blocks_[b].name + "' without room (planner bug)");
  c.present = true;
  c.valid = false;  // becomes current when the writer acquires it
  c.offset = *off;
}

Effects Residency::evict(BlockId b, Tier t) {
  Effects fx;
  const BlockSpec& spec = blocks_[b];
  CopyInfo& c = copy_mut(b, t);
  assert(c.present && c.pins == 0 && t != spec.home);
  CopyInfo& home = copy_mut(b, spec.home);
  if (c.valid && !home.valid) {
    bool other = false;  // another non-home copy still holds the current bytes
    for (int s = 0; s < kNumTiers; ++s)
      if (s != index(t) && s != index(spec.home) && copies_[b][s].valid) other = true;
    if (!other) {
      fx.moves.push_back({b, t, spec.home, c.offset, home.offset, spec.bytes});
      home.valid = true;
    }
  }
  arenas_[index(t)].free(c.offset, spec.bytes);
  fx.freed.push_back({b, t, c.offset, spec.bytes});
  c.present = c.valid = false;
  c.next_use = kNever;
  c.next_overwrites = false;
  return fx;
}

Effects Residency::write_back(BlockId b, Tier t) {
  Effects fx;
  const BlockSpec& spec = blocks_[b];
  const CopyInfo& c = copy(b, t);
  CopyInfo& home = copy_mut(b, spec.home);
  if (t == spec.home || !c.valid || c.pins > 0 || home.valid) return fx;
  fx.moves.push_back({b, t, spec.home, c.offset, home.offset, spec.bytes});
  home.valid = true;
  return fx;
}

Effects Residency::acquire(BlockId b, Tier t, Mode m) {
  Effects fx;
  CopyInfo& c = copy_mut(b, t);
  assert(c.present && (c.valid || !reads(m)));
  ++c.pins;
  if (!writes(m)) return fx;
  ++c.write_pins;
  c.valid = true;
  const BlockSpec& spec = blocks_[b];
  for (int s = 0; s < kNumTiers; ++s) {
    if (s == index(t)) continue;
    CopyInfo& o = copies_[b][s];
    if (static_cast<Tier>(s) == spec.home) {
      o.valid = false;
      continue;
    }
    if (!o.present) continue;
    assert(o.pins == 0 && "offload: a block written on one tier while acquired on another");
    arenas_[s].free(o.offset, spec.bytes);
    fx.freed.push_back({b, static_cast<Tier>(s), o.offset, spec.bytes});
    o.present = o.valid = false;
    o.next_use = kNever;
    o.next_overwrites = false;
  }
  return fx;
}

void Residency::release(BlockId b, Tier t, Mode m) {
  CopyInfo& c = copy_mut(b, t);
  assert(c.pins > 0);
  --c.pins;
  if (writes(m)) --c.write_pins;
}

void Residency::discard(BlockId b) {
  for (CopyInfo& c : copies_[b])
    if (c.pins > 0) throw std::logic_error("offload: discard of block '" + blocks_[b].name + "' while it is acquired");
  for (CopyInfo& c : copies_[b])
    if (c.present) c.valid = true;
}

std::optional<std::vector<BlockId>> Residency::choose_victims(Tier t, uint64_t bytes, Policy p, int64_t after) const {
  struct Cand {
    BlockId b;
    int64_t key;  // larger evicts first
    bool dirty;
  };
  std::vector<Cand> cands;
  for (BlockId b = 0; b < blocks_.size(); ++b) {
    const CopyInfo& c = copies_[b][index(t)];
    if (!c.present || c.pins > 0 || blocks_[b].home == t) continue;
    if (p == Policy::belady && c.next_use <= after) continue;
    bool dirty = c.valid && !copies_[b][index(blocks_[b].home)].valid;
    int64_t key = p == Policy::belady ? c.next_use : -c.last_use;
    // A clean copy that its next use overwrites whole is worth nothing until then: evicting it
    // moves no byte, and keeping it only holds room (a discarded gradient between its update and
    // the next backward). A dirty one keeps its place: evicting it would write it home.
    if (p == Policy::belady && c.next_overwrites && !dirty) key = kNever;
    cands.push_back({b, key, dirty});
  }
  // Belady: farthest next use first, clean before dirty at equal distance (no write-back).
  // LRU: least recently used first.
  std::stable_sort(cands.begin(), cands.end(), [](const Cand& x, const Cand& y) {
    if (x.key != y.key) return x.key > y.key;
    return !x.dirty && y.dirty;
  });
  Arena a = arenas_[index(t)];
  std::vector<BlockId> victims;
  for (const Cand& c : cands) {
    if (a.can_alloc(bytes)) break;
    a.free(copies_[c.b][index(t)].offset, blocks_[c.b].bytes);
    victims.push_back(c.b);
  }
  if (!a.can_alloc(bytes)) return std::nullopt;
  return victims;
}

uint64_t Residency::pinned_bytes(Tier t) const {
  uint64_t sum = 0;
  for (BlockId b = 0; b < blocks_.size(); ++b) {
    const CopyInfo& c = copies_[b][index(t)];
    if (c.present && (c.pins > 0 || blocks_[b].home == t)) sum += align_up(blocks_[b].bytes);
  }
  return sum;
}

uint64_t Residency::fingerprint() const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (BlockId b = 0; b < blocks_.size(); ++b)
    for (int t = 0; t < kNumTiers; ++t) {
      const CopyInfo& c = copies_[b][t];
      mix(b * 8 + t);
      mix(c.present | (c.valid << 1));
      mix(c.present ? c.offset : 0);
      mix(static_cast<uint64_t>(c.pins));
    }
  for (int t = 0; t < kNumTiers; ++t) mix(budgets_[t]);
  return h;
}

}  // namespace strata::offload
