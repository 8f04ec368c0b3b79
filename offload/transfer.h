// TransferEngine: moves bytes between tiers. device<->host on two dedicated copy streams ordered
// by events (a copy whose inputs are still on their way from NVMe is issued by a lane thread
// once they are there: no stream ever waits on host work); host<->NVMe through the NvmeStore
// from an in-order submit lane and a completion lane; device<->NVMe staged through a pool of
// pinned chunks (registered with the I/O engine) on a lane of its own, several chunks in flight,
// so it never holds up host<->NVMe moves. Events come from a pool.
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
  bool device_nvme = true;              // false: no block moves device<->NVMe (no staging is allocated)
  uint64_t staging_bytes = 4ull << 20;  // per staging chunk (device<->NVMe), multiple of 4 KiB
  int n_staging = 8;                    // chunks: up to n-1 NVMe I/Os in flight beside one PCIe copy
  uint64_t staging_total() const { return device_nvme ? staging_bytes * static_cast<uint64_t>(n_staging) : 0; }
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
  // Wall time with any NVMe I/O in flight (reads or writes): the disk's busy time.
  double nvme_busy_ms() const;
  EventPool& events();  // the engine's event pool (the manager records releases with it too)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::offload
