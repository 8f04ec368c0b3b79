// TransferEngine: moves bytes between tiers. device<->host on two dedicated copy streams ordered
// by events (the host never waits); host<->NVMe through the NvmeStore from an in-order submit
// lane (waits for a move's inputs off the client's thread) and a completion lane; device<->NVMe
// staged through a fixed pool of pinned buffers (registered with the I/O engine), pipelined.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>

#include "offload/fence.h"
#include "offload/nvme_store.h"
#include "offload/stats.h"
#include "offload/tier.h"

namespace strata::kernels {
class Runtime;
}

namespace strata::offload {

// One end of a move: memory for device and host, an offset into the NvmeStore for nvme.
struct Place {
  Tier tier;
  void* ptr = nullptr;
  uint64_t nvme_offset = 0;
};

struct TransferConfig {
  uint64_t staging_bytes = 4ull << 20;  // per staging buffer (device<->NVMe), multiple of 4 KiB
  int n_staging = 2;                    // buffers: one fills while the other drains
};

class TransferEngine {
 public:
  // store may be null when no block lives on NVMe.
  TransferEngine(kernels::Runtime& rt, NvmeStore* store, TransferConfig cfg = {});
  ~TransferEngine();  // waits for everything in flight
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // Copies `bytes` from src to dst once `deps` has completed; the fence completes when dst
  // holds them (or carries the error). Moves touching NVMe transfer align_up(bytes).
  Fence move(const Place& src, const Place& dst, uint64_t bytes, const Fence& deps);
  void drain();  // host waits for every move issued so far (errors are left to their fences)
  std::array<LinkStats, kNumLinks> link_stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::offload
