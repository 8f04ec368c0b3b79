// The vocabulary of offload/: the three memory tiers, how an access uses a block, and the
// alignment every tier's ranges share (O_DIRECT's 4 KiB, also fine for device copies).
#pragma once
#include <cstdint>
#include <string_view>

namespace strata::offload {

enum class Tier : uint8_t { device = 0, host = 1, nvme = 2 };
constexpr int kNumTiers = 3;
constexpr uint64_t kAlign = 4096;  // every range in every tier starts and ends on this

// read: the bytes must be current; write: the client overwrites every byte (nothing is loaded);
// read_write: loaded, then modified. write and read_write make every other copy stale.
enum class Mode : uint8_t { read = 0, write = 1, read_write = 2 };

inline int index(Tier t) { return static_cast<int>(t); }
inline std::string_view tier_name(Tier t) {
  switch (t) {
    case Tier::device: return "device";
    case Tier::host: return "host";
    case Tier::nvme: return "nvme";
  }
  return "?";
}
// How a user raises tier t's budget, for budget errors: the DESIGN.md flags for device and
// host; NVMe is bounded by the swap directories' disks, not by a flag.
inline std::string_view budget_remedy(Tier t) {
  switch (t) {
    case Tier::device: return "raise --device-mem";
    case Tier::host: return "raise --host-mem";
    case Tier::nvme: return "give the NVMe swap more room (a larger disk or another --nvme-path)";
  }
  return "?";
}
inline std::string_view mode_name(Mode m) {
  switch (m) {
    case Mode::read: return "read";
    case Mode::write: return "write";
    case Mode::read_write: return "read_write";
  }
  return "?";
}
inline bool writes(Mode m) { return m != Mode::read; }
inline bool reads(Mode m) { return m != Mode::write; }
inline uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

}  // namespace strata::offload
