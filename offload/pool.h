// TierPool: the memory behind one tier's arena — one region of exactly the tier's budget,
// allocated once at start-up and faulted in (device: Runtime::alloc_device; host: alloc_pinned, i.e.
// cudaHostAlloc, or on CPU huge-page advised, faulted in from every core and mlock-ed) and never
// per block —
// plus the hazards of ranges given back while transfers or kernels may still touch them.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/runtime.h"
#include "offload/fence.h"
#include "offload/tier.h"

namespace strata::offload {

class TierPool {
 public:
  TierPool() = default;
  // device/host: allocates `budget` bytes now (throws naming the tier and size if it cannot);
  // nvme: no memory (the NvmeStore holds the region).
  TierPool(kernels::Runtime& rt, Tier tier, uint64_t budget);
  TierPool(TierPool&&) noexcept = default;
  TierPool& operator=(TierPool&&) noexcept = default;

  char* base() const { return static_cast<char*>(device_.data() ? device_.data() : pinned_.data()); }
  uint64_t budget() const { return budget_; }

  // A range given back: work in `last_users` may still read or write it. Only its completion
  // matters to the next owner, not its errors (those stay with the copies they concerned).
  void add_hazard(uint64_t offset, uint64_t bytes, Fence last_users);
  // What a new owner of [offset, offset+bytes) must wait for before touching it.
  Fence take_hazards(uint64_t offset, uint64_t bytes);

 private:
  struct Hazard {
    uint64_t offset, end;
    Fence users;
  };
  Tier tier_ = Tier::host;
  uint64_t budget_ = 0;
  kernels::DeviceBuffer device_;
  kernels::PinnedBuffer pinned_;
  std::vector<Hazard> hazards_;
};

}  // namespace strata::offload
