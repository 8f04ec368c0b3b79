// RunMemory: where a training step's blocks live, as the step driver sees them. Each unit has
// the blocks its UnitTable entry lists (src/zero/unit_table.h: working weights, fp32 master,
// AdamW state, fp32 grads); each block layer has its kept input x_l.
// The driver acquires a block before a phase uses it and releases it after; the memory decides
// the tier, waits for the bytes (in stream order) and accounts for it. Implementations: the
// tiered BlockManager (src/train/tiered_memory.h), a schedule recorder (a dry run that only
// notes the acquires, so the declared schedule is the driver's own), and flat test buffers.
#pragma once
#include <cstdint>

#include "kernels/ops.h"
#include "kernels/runtime.h"
#include "offload/tier.h"

namespace strata {

class UnitTable;

// ZeRO sharding across the ranks of a data-parallel job (DESIGN.md "Distributed"). Every unit
// is padded to a multiple of world × kUnitAlignElems elements, so it splits into `world`
// equal contiguous shards, shard r belonging to rank r:
//     unit [0, numel) = shard 0 [0, S) | shard 1 [S, 2S) | ... ,  S = numel / world.
// stage 0: every rank holds everything; grads are all-reduced (a fixed-order sum).
// stage 1: master weights and AdamW state are shard-sized; after the update the new working
//          weights are all-gathered.
// stage 2: as 1, and grads are reduce-scattered: the grads block holds only the shard.
// stage 3: as 2, and the working weights block holds only the shard too: before a phase uses a
//          unit it is all-gathered into a whole-unit buffer (RunMemory::gathered), used, and
//          the buffer reused by the next unit; AdamW writes only this rank's shard (no gather).
// The reductions are the same fixed-order sums in every stage, and the norm is always the sum
// over ranks (in rank order) of each shard's Σ g², so every stage gives bitwise the same run.
struct Sharding {
  int stage = 0;
  int world = 1;
  int rank = 0;
  bool sharded_optimizer() const { return world > 1 && stage >= 1; }
  bool sharded_grads() const { return world > 1 && stage >= 2; }
  bool sharded_weights() const { return world > 1 && stage >= 3; }
  int64_t shard(int64_t numel) const { return numel / world; }  // elements per rank
};

// Whole-unit buffers of grad_scratch() and gathered() (see there): 0 the embedding and the
// head (an untied head's phase comes after the embedding's forward and before its backward, so
// the two share one buffer: the vocabulary-sized units are the largest), 1 and 2 every other
// unit of the base, 3 and 4 LoRA's adapter units (a layer uses its block and its adapters at
// once). unit_slot (src/zero/unit_table.h) is a unit's first slot; the units of slots 1 and 3
// take turns with the slot after it.
constexpr int kNumUnitSlots = 5;

// A unit's states, named as the --offload-* flags name them: params (the working weights the
// model computes with), master (fp32 copy for AdamW), adam (m and v), grads, activations (the
// kept inputs of checkpointed blocks).
enum class Role : uint8_t { params = 0, master = 1, adam = 2, grads = 3, activations = 4 };
constexpr int kNumRoles = 5;
// Who uses an acquired block: the model's compute, the optimizer (which may run elsewhere: on
// the CPU next to host-resident state while the model runs on the GPU), host code
// (initialising, loading, saving: host-visible memory, waited for on the host), or the
// collectives of a multi-rank run, on their own stream beside compute's (same memory as compute).
enum class Side : uint8_t { compute = 0, optimizer = 1, host = 2, comm = 3 };

class RunMemory {
 public:
  virtual ~RunMemory() = default;
  // A dry run records acquires without memory: pointers are null and nothing may compute.
  virtual bool dry() const { return false; }
  // The block's bytes for `side`, usable by work enqueued on stream(side) from now until
  // release. Mode write: every byte will be overwritten (nothing is loaded).
  virtual void* acquire(Role r, int index, offload::Mode m, Side side) = 0;
  virtual void release(Role r, int index) = 0;
  // release, and the block's bytes are dead until its next writing acquire (nothing reads them
  // before): an offloaded copy is then dropped, never written home. The optimizer's gradients.
  virtual void release_discard(Role r, int index) { release(r, index); }
  // True when the master weights are the working weights (one block, fp32).
  virtual bool master_is_weights() const = 0;
  // What each unit holds: its blocks' sizes, shards and homes (the table the memory was laid
  // out from).
  virtual const UnitTable& units() const = 0;
  virtual kernels::Stream& stream(Side side) = 0;
  virtual kernels::Ops& ops(Side side) = 0;
  // The runtime of side's stream (events that order the sides); null in a dry run.
  virtual kernels::Runtime* runtime(Side /*side*/) { return nullptr; }
  // An acquired block changes hands: its release is ordered on `to`'s stream from now on. The
  // caller has already made `to`'s stream wait for the work enqueued on the block so far.
  virtual void handoff(Role /*r*/, int /*index*/, Side /*to*/) {}
  // ZeRO stage 2: whole-unit fp32 grads on the compute side, into which a unit's backward
  // writes before the reduce-scatter keeps this rank's shard. Slot 0: the embedding (with a
  // tied head, written by the head phase and added to by the embedding's backward) and an
  // untied head (reduce-scattered before the embedding's backward writes the slot), 1 and 2:
  // every other unit, taking turns (one is reduce-scattered while the next unit's backward
  // writes the other), 3 and 4 the same for LoRA's adapter units. Sized by the trainable units
  // of each slot. Null in a dry run and below stage 2.
  virtual float* grad_scratch(int /*slot*/) { return nullptr; }
  // ZeRO stage 3: whole-unit working weights on the compute side, into which a unit's shards
  // are all-gathered before a phase uses it. Slots as grad_scratch's: 0 the embedding (a tied
  // head's too, across the head phase) and an untied head (gathered once the embedding's
  // forward is done with the slot), 1 and 2 every other unit, taking turns (the next unit is
  // gathered into one while the current one computes from the other), 3 and 4 the same for
  // LoRA's adapter units (gathered beside their layer's block). Null in a dry run and below
  // stage 3.
  virtual void* gathered(int /*slot*/) { return nullptr; }
  // LoRA --base-dtype: a frozen layer decoded to the working dtype for the phase that uses it
  // (Transformer::decode_unit), taking turns between two whole-unit slots. Null in a dry run
  // and without a stored base.
  virtual void* decoded(int /*slot*/) { return nullptr; }
};

}  // namespace strata
