// Placement: where each kind of a run's state lives (its home tier), the budgets and the ZeRO
// sharding. The unit table (src/zero/unit_table.h), the step program and the tiered memory all
// read it, so it sits in a header of its own.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "offload/tier.h"
#include "src/train/run_memory.h"

namespace strata {

// Where each kind of state lives (home tier), and the budgets.
struct Placement {
  offload::Tier params = offload::Tier::device;      // working weights (compute dtype)
  offload::Tier grads = offload::Tier::device;       // fp32 gradients
  offload::Tier optimizer = offload::Tier::device;   // fp32 master + AdamW m, v
  offload::Tier activations = offload::Tier::device; // kept inputs of checkpointed blocks
  std::vector<std::string> nvme_paths;               // swap directories, one per SSD
  uint64_t device_mem = 0;                           // 0: what the plan needs
  uint64_t host_mem = 0;                             // 0: what the plan needs, within physical RAM
  Sharding sharding;                                 // ZeRO: this rank's part of each unit
  bool norm_free = false;  // nothing waits for the global norm: no clipping, no fp16 loss scaler
  // --speculate: with clipping or fp16, each unit's AdamW still runs in the backward, with clip
  // coefficient 1, into a second copy of its master and AdamW state; once the global norm is
  // known the copies are made current (commit), or the step is rerun from the first copies and
  // its true update left pending (rollback: Trainer::step). Whole gradients only (ZeRO 0-1).
  bool speculate = false;
  // Twin-Flow (--optimizer-on-device): with the optimizer's home off the device, this fraction
  // of the trainable parameters keeps its master and AdamW state on the device and updates there
  // (on the compute stream), the rest next to the optimizer's home on the CPU: the trainable
  // units in forward order (embedding, layers, head; adapters by layer) while their parameters
  // stay within the fraction (UnitTable). 0: none; 1: all. The same math: AdamW's kernels round
  // alike on either side.
  double optimizer_on_device = 0;
  bool uses_nvme() const;
  // Each unit's AdamW runs in the backward, right after its last gradient of the step, instead
  // of inside the next step's forward (StepDriver::forward_backward): where nothing waits for
  // the global norm and a unit's gradient is whole when final (ZeRO stages 2-3 reduce-scatter
  // it into shards).
  bool update_in_backward() const { return (norm_free || speculate) && !sharding.sharded_grads(); }
};

}  // namespace strata
