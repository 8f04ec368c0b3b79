// Schedule: the accesses of one training step, in program order — every acquire of a block on a
// tier (with how it is used) and the matching release. A step is a fixed program, so the same
// schedule repeats every step; the planner turns it into prefetches and evictions.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "offload/tier.h"

namespace strata::offload {

using BlockId = uint32_t;

struct ScheduleEvent {
  bool release = false;  // false: acquire
  BlockId block = 0;
  Tier tier = Tier::device;
  Mode mode = Mode::read;
  uint32_t acquire_event = 0;  // release: index of the acquire it ends
  bool discard = false;        // release: the block's bytes are dead from here (Residency::discard)
  bool operator==(const ScheduleEvent&) const = default;
};

class Schedule {
 public:
  // Appends an acquire; returns its event index (pass it to release).
  size_t acquire(BlockId b, Tier t, Mode m);
  void release(size_t acquire_event, bool discard = false);
  void use(BlockId b, Tier t, Mode m) { release(acquire(b, t, m)); }
  void push(const ScheduleEvent& e) { events_.push_back(e); }

  const std::vector<ScheduleEvent>& events() const { return events_; }
  size_t size() const { return events_.size(); }
  bool empty() const { return events_.empty(); }
  void clear() { events_.clear(); }
  bool operator==(const Schedule& o) const { return events_ == o.events_ && successor_ == o.successor_; }
  uint64_t fingerprint() const;
  // The block that each block is in the step after this one, where that step is this one with
  // blocks trading roles (two copies of a state taking turns being current): a copy's next use
  // past the step's end is its successor's first use. Empty (default): the same block.
  void set_successor(std::vector<BlockId> successor) { successor_ = std::move(successor); }
  BlockId successor(BlockId b) const { return successor_.empty() ? b : successor_.at(b); }
  const std::vector<BlockId>& successors() const { return successor_; }
  // Throws std::invalid_argument naming the event when a block id is out of range, an acquire is
  // never released, a release ends no open acquire, or NVMe is acquired (it is storage only).
  void validate(size_t n_blocks) const;
  std::string describe(size_t event) const;  // "event 12: acquire block 3 on device (read)"

 private:
  std::vector<ScheduleEvent> events_;
  std::vector<BlockId> successor_;
};

}  // namespace strata::offload
