// Residency: where every block's copies are — per tier a range in that tier's arena, valid or
// stale, pinned or not — and the state changes that move them. Pure bookkeeping with no memory
// and no time, so the planner simulates a step on a copy of it and the manager drives the real
// one with the same calls: the same sequence of calls gives the same offsets in both.
#pragma once
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "offload/arena.h"
#include "offload/schedule.h"
#include "offload/tier.h"

namespace strata::offload {

// A budget that cannot hold what must be resident at once. Names the tier and, when the
// planner could compute it, the smallest budget that works.
class BudgetError : public std::runtime_error {
 public:
  BudgetError(const std::string& what, Tier tier, uint64_t budget, uint64_t minimum)
      : std::runtime_error(what), tier_(tier), budget_(budget), minimum_(minimum) {}
  Tier tier() const { return tier_; }
  uint64_t budget() const { return budget_; }
  uint64_t minimum() const { return minimum_; }  // 0 when unknown

 private:
  Tier tier_;
  uint64_t budget_, minimum_;
};

struct BlockSpec {
  std::string name;
  uint64_t bytes = 0;
  Tier home = Tier::host;  // the copy that always exists; every other copy is a cache of it
};

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

struct CopyInfo {
  bool present = false;  // holds a range in its tier (a home copy always does)
  bool valid = false;    // holds the block's current bytes (non-home: present implies valid)
  uint64_t offset = 0;   // in the tier's arena
  int pins = 0;          // open acquires
  int write_pins = 0;    // ... of them in a writing mode
  int64_t next_use = kNever;  // planner: event index of the next acquire (cyclic)
  bool next_overwrites = false;  // planner: ... which writes every byte without reading any
  int64_t last_use = -1;      // LRU: event index of the last acquire
};

// A copy of bytes between two copies of one block (bytes = the block's size).
struct Move {
  BlockId block;
  Tier from, to;
  uint64_t from_offset, to_offset, bytes;
};
// A range given back to a tier's arena.
struct Freed {
  BlockId block;
  Tier tier;
  uint64_t offset, bytes;
};
// What a state change implies, in the order it must be carried out.
struct Effects {
  std::vector<Move> moves;
  std::vector<Freed> freed;
};

enum class Policy : uint8_t { belady, lru };

class Residency {
 public:
  explicit Residency(std::array<uint64_t, kNumTiers> budgets);

  // Registers a block and places its home copy; throws BudgetError when the home tier is full.
  BlockId add_block(const BlockSpec& spec);

  // Non-home copy absent -> allocated and filled from the best valid copy; stale home -> refilled.
  Effects load(BlockId b, Tier t);
  // Non-home copy absent -> allocated, not filled (the client will overwrite it).
  void alloc(BlockId b, Tier t);
  // Drops a non-home copy; writes it back home first when it holds the only current bytes.
  Effects evict(BlockId b, Tier t);
  // Copies a non-home copy that holds the only current bytes (valid, unpinned, home stale)
  // back home and keeps it: evicting it later moves nothing. Nothing to do otherwise.
  Effects write_back(BlockId b, Tier t);
  // An acquire: pins the copy; a writing mode makes every other copy stale (non-home ones freed).
  Effects acquire(BlockId b, Tier t, Mode m);
  void release(BlockId b, Tier t, Mode m);
  // The block's bytes are dead until its next writing acquire (a step's gradients once the
  // optimizer has read them): every copy counts as current, so evicting one writes nothing
  // home. A reader before that write gets whichever stale bytes a copy holds (the update
  // that applies nothing acquires the grads without using them). Throws std::logic_error
  // while the block is acquired.
  void discard(BlockId b);

  // Victims (in eviction order) that make room for `bytes` in t, chosen by policy among unpinned
  // non-home copies whose next use is later than `after` (Belady) — nullopt if none suffice.
  std::optional<std::vector<BlockId>> choose_victims(Tier t, uint64_t bytes, Policy p, int64_t after) const;
  // Bytes that must be resident in t right now: home copies and pinned copies.
  uint64_t pinned_bytes(Tier t) const;

  bool needs_load(BlockId b, Tier t, Mode m) const;  // the acquire cannot proceed as things are
  std::optional<Tier> best_source(BlockId b, Tier t) const;

  const CopyInfo& copy(BlockId b, Tier t) const { return copies_[b][index(t)]; }
  CopyInfo& copy_mut(BlockId b, Tier t) { return copies_[b][index(t)]; }
  const BlockSpec& block(BlockId b) const { return blocks_[b]; }
  size_t n_blocks() const { return blocks_.size(); }
  const Arena& arena(Tier t) const { return arenas_[index(t)]; }
  uint64_t budget(Tier t) const { return budgets_[index(t)]; }
  // A hash of where every copy is and whether it is current: equal states plan alike.
  uint64_t fingerprint() const;
  // The same blocks with only their home copies, under other budgets (planner: cold starts and
  // the search for the minimum budget). Throws BudgetError when the home copies do not fit.
  Residency cold(std::array<uint64_t, kNumTiers> budgets) const;
  const std::vector<BlockSpec>& blocks() const { return blocks_; }

 private:
  std::array<uint64_t, kNumTiers> budgets_;
  std::array<Arena, kNumTiers> arenas_;
  std::vector<BlockSpec> blocks_;
  std::vector<std::array<CopyInfo, kNumTiers>> copies_;
};

}  // namespace strata::offload
