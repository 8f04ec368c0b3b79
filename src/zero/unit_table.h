// UnitTable: what each unit of a run holds, written down once: which states it has, how it is
// sharded across the ranks, where each state lives, whether the fp32 master is the working
// weights, and where AdamW's m and v sit in their block. The tiered memory registers its blocks
// from it, the flat test memory lays out its buffers by it, and the step driver and the
// checkpoint code take their sizes and offsets from it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "offload/tier.h"
#include "src/model/transformer.h"
#include "src/train/placement.h"
#include "src/train/run_memory.h"

namespace strata {

// One axis of a unit's sharding: the padded unit [0, numel) splits into equal contiguous
// shards of `shard` elements, shard r belonging to rank r (run_memory.h Sharding). Unsharded:
// one shard, the whole unit.
struct ShardAxis {
  int64_t numel = 0;   // the whole unit along this axis
  int64_t shard = 0;   // elements per rank
  int64_t offset = 0;  // this rank's first element (rank × shard)
};

// How a unit is cut across ranks: along the data-parallel axis (ZeRO) today; a tensor-parallel
// axis, cutting the unit's tensors before ZeRO shards them, joins it here.
struct UnitShards {
  ShardAxis dp;  // dp.shard: what ZeRO gives each rank, whatever the stage shards
};

// One state's block of a unit: the elements [lo, lo + n) of the unit that it holds (the whole
// unit, or this rank's shard), and its home tier. A state the unit lacks has exists = false.
struct UnitBlock {
  bool exists = false;
  int64_t lo = 0;
  int64_t n = 0;
  offload::Tier home = offload::Tier::device;
};

// The AdamW state of a unit, one fp32 block over the master's elements: m then v, n each.
struct AdamLayout {
  int64_t n = 0;
  int64_t m_offset() const { return 0; }
  int64_t v_offset() const { return n; }
  int64_t length() const { return 2 * n; }  // elements of the block
};

struct UnitEntry {
  std::string name;    // the model's unit ("embed", "block.3", ...)
  int64_t numel = 0;   // the whole unit, padded
  int64_t n_real = 0;  // its parameters (no padding)
  // A frozen unit (trainable = false) holds working weights only: no grads, master or AdamW.
  bool trainable = true;
  // Pipeline parallel: false for another stage's unit (Unit::held): no blocks at all.
  bool held = true;
  UnitShards shards;
  // adam covers the master's elements; its block is laid out as adam_layout() says.
  UnitBlock params, master, adam, grads;  // params: the working weights
  bool master_is_weights = false;  // master and weights are one fp32 block (the weights')
  // LoRA --base-dtype: the params block holds the weights' stored form, this many bytes
  // (Transformer::stored_unit); 0: the working dtype, params.n elements.
  uint64_t stored_bytes = 0;

  AdamLayout adam_layout() const { return {adam.n}; }
  // The block of state r (Role::activations is a layer's, not a unit's: logic_error).
  const UnitBlock& block(Role r) const;
  // The update writes only its own elements of a whole weights block: every rank's new part
  // then comes by all-gather (ZeRO stages 1-2).
  bool gathers_after_update() const { return trainable && !master_is_weights && params.n > master.n; }
};

// Twin-Flow: of the held trainable units (one flag per unit, as Unit::trainable or a LoRA run's
// adapters), those in forward order whose parameters (Unit::numel) together stay within
// `fraction` of all of theirs; every one at fraction 1. The same units on every rank.
std::vector<bool> twin_device_units(const std::vector<Unit>& units, const std::vector<bool>& trainable,
                                    double fraction);

class UnitTable {
 public:
  UnitTable() = default;
  // trainable: one flag per unit (empty: the model's, Unit::trainable).
  UnitTable(const Transformer& model, const Placement& pl, const std::vector<bool>& trainable = {});

  const UnitEntry& operator[](int u) const { return units_.at(static_cast<size_t>(u)); }
  size_t size() const { return units_.size(); }
  auto begin() const { return units_.begin(); }
  auto end() const { return units_.end(); }
  const Sharding& sharding() const { return sh_; }
  DType dtype() const { return dtype_; }
  // One fp32 block serves as master and working weights: an fp32 run that homes params and
  // optimizer on one tier with an unsharded master (a sharded master is never the whole weights).
  bool master_is_weights() const { return master_is_weights_; }
  // Speculation (Placement::speculate): each trainable unit's master and AdamW state have a
  // second copy, RunMemory index u + size(); an update reads the current copy and writes the
  // other, which the memory then makes current (TieredMemory::flip).
  bool two_copies() const { return two_copies_; }
  // Bytes of unit u's block of state r (0 where the unit lacks it).
  uint64_t bytes(Role r, int u) const;

 private:
  std::vector<UnitEntry> units_;
  Sharding sh_;
  DType dtype_ = DType::f32;
  bool master_is_weights_ = false;
  bool two_copies_ = false;
};

// The whole-unit slot (kNumUnitSlots) unit u's gathered weights and scratch grads take: 0 the
// embedding and the head, 3 a LoRA adapter unit, 1 any other (1 and 3: first of a pair).
int unit_slot(const Transformer& m, int u);

}  // namespace strata
