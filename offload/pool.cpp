// TierPool: one allocation per tier, and hazard tracking for reused ranges.
#include "offload/pool.h"

#include <stdexcept>
#include <string>

#include "offload/size.h"

namespace strata::offload {

TierPool::TierPool(kernels::Runtime& rt, Tier tier, uint64_t budget) : tier_(tier), budget_(budget / kAlign * kAlign) {
  if (budget_ == 0 || tier == Tier::nvme) return;
  try {
    if (tier == Tier::device)
      device_ = kernels::DeviceBuffer(rt, budget_);
    else
      pinned_ = kernels::PinnedBuffer(rt, budget_);
  } catch (const std::exception& e) {
    throw std::runtime_error("offload: cannot allocate the " + std::string(tier_name(tier)) + " pool of " +
                             format_size(budget_) + " (--" + std::string(tier_name(tier)) + "-mem): " + e.what());
  }
  // Fault every page in now, not inside the step loop (fresh pages are slow to fault in). The CPU
  // runtime's allocations come back faulted in and zeroed: a memset would only add a pass (~1 s
  // for a 6 GiB pool here).
  if (rt.info().backend == kernels::Backend::cpu) return;
  auto s = rt.create_stream();
  s->memset_async(base(), 0, budget_);
  s->synchronize();
}

void TierPool::add_hazard(uint64_t offset, uint64_t bytes, Fence last_users) {
  last_users.prune();
  if (last_users.empty()) return;
  hazards_.push_back({offset, offset + align_up(bytes), last_users.quiet()});
}

Fence TierPool::take_hazards(uint64_t offset, uint64_t bytes) {
  uint64_t end = offset + align_up(bytes);
  Fence out;
  std::vector<Hazard> kept;
  kept.reserve(hazards_.size());
  for (auto& h : hazards_) {
    bool overlaps = h.offset < end && offset < h.end;
    if (overlaps) out.add(h.users);
    bool covered = offset <= h.offset && h.end <= end;  // the new owner now carries it
    if (covered || h.users.ready()) continue;
    kept.push_back(std::move(h));
  }
  hazards_ = std::move(kept);
  return out;
}

}  // namespace strata::offload
