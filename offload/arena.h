// Arena: first-fit sub-allocation of one fixed region of `capacity` bytes, in kAlign units. It
// knows offsets only, so the planner can simulate it and the pools can back it with memory; the
// capacity is the tier's hard budget and can never be exceeded.
#pragma once
#include <cstdint>
#include <map>
#include <optional>

namespace strata::offload {

class Arena {
 public:
  Arena() = default;
  explicit Arena(uint64_t capacity);  // capacity is rounded down to kAlign

  // Lowest-offset hole that fits align_up(bytes); nullopt when none does.
  std::optional<uint64_t> alloc(uint64_t bytes);
  void free(uint64_t offset, uint64_t bytes);  // bytes as passed to alloc
  bool can_alloc(uint64_t bytes) const;

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t peak() const { return peak_; }
  uint64_t largest_free() const;
  // 1 - largest hole / free bytes: 0 when the free space is one hole, near 1 when it is dust.
  double fragmentation() const;

 private:
  void check() const;
  uint64_t capacity_ = 0;
  uint64_t used_ = 0;
  uint64_t peak_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset -> length of each hole, coalesced
};

}  // namespace strata::offload
