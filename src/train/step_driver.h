// StepDriver: one training step as a sequence of per-unit phases (DESIGN.md "One training
// step"): embedding forward, block forward × L, head forward+backward (chunked), block backward
// × L, embedding backward — each phase between acquiring the blocks it uses and releasing them
// — then AdamW unit by unit where the optimizer state lives. The same code runs every
// placement: RunMemory decides where blocks are; in a dry run it only records the acquires.
#pragma once
#include <cstdint>

#include "src/comm/communicator.h"
#include "src/model/transformer.h"
#include "src/optim/adamw.h"
#include "src/train/run_memory.h"

namespace strata {

// An optimizer step decided at the end of one step's backward (its global norm known) and
// carried out inside the next step's forward, unit by unit just before the unit is used: the
// optimizer's I/O (master and AdamW state streaming from NVMe) overlaps the forward's compute,
// and the math is the same as updating every unit before the forward. apply = false (the very
// first step, an fp16 step skipped for overflow) visits the same blocks and changes nothing.
struct PendingUpdate {
  AdamWStep st;
  bool apply = false;
};

class StepDriver {
 public:
  // With sh.world > 1, comm is the job's communicator (null in a dry run: it only records).
  StepDriver(Transformer& model, RunMemory& mem, Sharding sh = {}, Communicator* comm = nullptr)
      : model_(model), mem_(mem), sh_(sh), comm_(comm) {}

  // Forward and backward of one micro-batch (ids, targets: (N) int32 in compute memory).
  // first: the step's first micro-batch (grads are overwritten, not added to). last: the
  // step's last: each unit's Σ g² is added to norm2[u] (n_units fp64 in compute memory) as
  // soon as its gradient is final, so the global norm needs no second pass over the grads.
  // The per-row losses are in model.loss_rows() when the compute stream reaches the end.
  // With `update`, each unit's pending optimizer step runs just before its forward (units the
  // forward does not use before the head — the final norm, the head — just before the head).
  void forward_backward(const int32_t* ids, const int32_t* targets, float grad_scale, bool first, bool last,
                        double* norm2, const PendingUpdate* update = nullptr);
  // Forward only: the per-row losses.
  void forward(const int32_t* ids, const int32_t* targets);
  // AdamW over every unit, from the embedding to the head, on the optimizer side. With apply
  // false (an fp16 step skipped for overflow) the same blocks are visited, the state is left as
  // it is and the working weights are rewritten from the master: the step's program (what the
  // offload planner planned) is the same either way.
  void optimizer(const AdamWStep& st, bool apply = true);
  // The same for one unit.
  void optimizer_unit(int u, const AdamWStep& st, bool apply);

 private:
  // Runs fn unless this is a dry run (acquire/release still happen).
  template <class F>
  void compute(F&& fn) {
    if (!mem_.dry()) fn();
  }
  // The unit's working weights for a compute phase, until drop_weights(u): the weights block
  // itself, or (stage 3) every rank's shard all-gathered into mem_.gathered(slot_of(u)).
  const void* use_weights(int u);
  void drop_weights(int u);
  // The head's: use_weights(head), except that a tied head (stage 3) keeps the embedding
  // gathered by the embedding's forward.
  const void* use_head_weights();
  void drop_head_weights();
  int slot_of(int u) const;  // RunMemory's slots: 0 embedding, 1 untied head, 2 the rest
  void embed_and_blocks_forward(const int32_t* ids, const PendingUpdate* update);
  // A unit's grads are final (the step's last micro-batch): sum them across ranks and add this
  // rank's shard's Σ g² to *norm2 (compute stream; part of compute()).
  void finish_grads(kernels::Stream& s, int u, float* g, double* norm2);
  // Stage 2: a unit's whole grads of this micro-batch (in `whole`, a scratch) are summed across
  // ranks into this rank's shard (reduce-scatter, in place), which is stored in (first) or
  // added to the shard grads block; on the last micro-batch the shard's Σ g² goes to *norm2.
  void shard_grads(kernels::Stream& s, int u, float* whole, float* shard, bool first, bool last, double* norm2);

  Transformer& model_;
  RunMemory& mem_;
  Sharding sh_;
  Communicator* comm_;
};

}  // namespace strata
