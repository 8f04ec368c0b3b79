// Schedule: building, validating and fingerprinting a step's access sequence.
#include "offload/schedule.h"

#include <algorithm>
#include <cassert>
#include <stdexcept>

namespace strata::offload {

size_t Schedule::acquire(BlockId b, Tier t, Mode m) {
  events_.push_back({false, b, t, m, 0});
  return events_.size() - 1;
}

void Schedule::release(size_t acquire_event, bool discard) {
  assert(acquire_event < events_.size() && !events_[acquire_event].release);
  const auto& a = events_[acquire_event];
  events_.push_back({true, a.block, a.tier, a.mode, static_cast<uint32_t>(acquire_event), discard});
}

uint64_t Schedule::fingerprint() const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const auto& e : events_) {
    mix(e.release);
    mix(e.block);
    mix(static_cast<uint64_t>(e.tier));
    mix(static_cast<uint64_t>(e.mode));
    mix(e.acquire_event);
    mix(e.discard);
  }
  for (BlockId b : successor_) mix(b);
  return h;
}

std::string Schedule::describe(size_t i) const {
  if (i >= events_.size()) return "event " + std::to_string(i) + ": end of step";
  const auto& e = events_[i];
  return "event " + std::to_string(i) + ": " + (e.release ? "release" : "acquire") + " block " +
         std::to_string(e.block) + " on " + std::string(tier_name(e.tier)) + " (" + std::string(mode_name(e.mode)) +
         (e.discard ? ", discard" : "") + ")";
}

void Schedule::validate(size_t n_blocks) const {
  if (!successor_.empty() && successor_.size() != n_blocks)
    throw std::invalid_argument("schedule: a successor for " + std::to_string(successor_.size()) + " blocks, not " +
                                std::to_string(n_blocks));
  for (BlockId b : successor_)
    if (b >= n_blocks) throw std::invalid_argument("schedule: successor block " + std::to_string(b) + " out of range");
  std::vector<bool> open(events_.size(), false);
  std::vector<std::vector<size_t>> open_of(n_blocks);  // per block: its open acquires
  size_t n_open = 0;
  std::vector<bool> dead(n_blocks, false);  // discarded and not written since
  for (size_t i = 0; i < events_.size(); ++i) {
    const auto& e = events_[i];
    auto bad = [&](const std::string& why) { return std::invalid_argument("schedule " + describe(i) + ": " + why); };
    if (e.block >= n_blocks) throw bad("no such block (" + std::to_string(n_blocks) + " registered)");
    if (e.tier == Tier::nvme) throw bad("NVMe is storage only; acquire on device or host");
    if (!e.release) {
      if (e.discard) throw bad("only a release discards");
      if (dead[e.block] && reads(e.mode)) throw bad("reads the block after its bytes were discarded");
      if (writes(e.mode)) dead[e.block] = false;
      for (size_t k : open_of[e.block]) {  // open acquires of the same block on another tier
        if (events_[k].tier == e.tier) continue;
        if (writes(e.mode) || writes(events_[k].mode))
          throw bad("the block is acquired on two tiers at once while one of them writes it (" + describe(k) + ")");
      }
      open[i] = true;
      open_of[e.block].push_back(i);
      ++n_open;
      continue;
    }
    if (e.acquire_event >= i || !open[e.acquire_event]) throw bad("releases no open acquire");
    const auto& a = events_[e.acquire_event];
    if (a.block != e.block || a.tier != e.tier || a.mode != e.mode) throw bad("does not match its acquire");
    open[e.acquire_event] = false;
    auto& ob = open_of[e.block];
    ob.erase(std::find(ob.begin(), ob.end(), static_cast<size_t>(e.acquire_event)));
    --n_open;
    if (e.discard) {
      if (!ob.empty()) throw bad("discards the block while it is acquired elsewhere");
      dead[e.block] = true;
    }
  }

  if (n_open != 0)
    for (size_t i = 0; i < events_.size(); ++i)
      if (open[i]) throw std::invalid_argument("schedule " + describe(i) + ": never released within the step");
}

}  // namespace strata::offload
