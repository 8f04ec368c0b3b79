// What offload/ did, as a plain struct the trainer copies into its metrics: bytes and busy time
// per link, time compute waited on blocks, and per-tier budget, use and peak.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "offload/tier.h"

namespace strata::offload {

// The physical links. A device<->NVMe move is staged through pinned host buffers, so it counts
// on both of its links (d2h + host_to_nvme, or nvme_to_host + h2d).
enum class Link : uint8_t { h2d = 0, d2h = 1, host_to_nvme = 2, nvme_to_host = 3 };
constexpr int kNumLinks = 4;
inline std::string_view link_name(Link l) {
  constexpr std::string_view names[kNumLinks] = {"h2d", "d2h", "host_to_nvme", "nvme_to_host"};
  return names[static_cast<int>(l)];
}

using LinkBytes = std::array<uint64_t, kNumLinks>;

// Bytes one move of `bytes` from one tier to another puts on each link. NVMe moves whole 4 KiB
// sectors (O_DIRECT), so they count the aligned size.
inline void add_move_bytes(LinkBytes& links, Tier from, Tier to, uint64_t bytes) {
  auto at = [&](Link l) -> uint64_t& { return links[static_cast<int>(l)]; };
  if (from == Tier::nvme) at(Link::nvme_to_host) += align_up(bytes);
  if (to == Tier::nvme) at(Link::host_to_nvme) += align_up(bytes);
  if (to == Tier::device) at(Link::h2d) += bytes;
  if (from == Tier::device) at(Link::d2h) += bytes;
}
inline uint64_t total(const LinkBytes& l) { return l[0] + l[1] + l[2] + l[3]; }

struct LinkStats {
  uint64_t bytes = 0;
  uint64_t transfers = 0;
  double ms_busy = 0;  // wall time with at least one transfer in flight on the link
};

struct TierStats {
  uint64_t budget_bytes = 0;
  uint64_t bytes_in_use = 0;  // allocated ranges (home copies included)
  uint64_t bytes_peak = 0;
  double fragmentation = 0;   // 1 - largest hole / free bytes
};

struct OffloadStats {
  std::array<LinkStats, kNumLinks> links;
  std::array<TierStats, kNumTiers> tiers;
  double nvme_busy_ms = 0;      // wall time with any NVMe I/O in flight (either direction)
  double checksum_ms = 0;       // time in the swap's checksums, summed over threads (filled by the swap's owner)
  double ms_stalled = 0;        // client time blocked in Handle::wait
  uint64_t stalls = 0;          // waits that found the block not yet ready
  uint64_t steps = 0;
  uint64_t plans = 0;           // plans computed (a reused plan is not counted)
  uint64_t schedule_changes = 0;  // steps that departed from the planned schedule (replanned)
  uint64_t cold_restarts = 0;   // caches flushed because the current placement could not run the plan
  std::string policy;           // of the plan in use: "belady+prefetch", "belady", "lru", "online-lru"
  uint64_t planned_bytes = 0;   // bytes the plan in use moves per step (simulated)
  uint64_t lru_bytes = 0;       // what plain LRU would move on the same schedule and budgets

  const LinkStats& link(Link l) const { return links[static_cast<int>(l)]; }
  uint64_t bytes_moved() const {
    uint64_t s = 0;
    for (const auto& l : links) s += l.bytes;
    return s;
  }
};

}  // namespace strata::offload
