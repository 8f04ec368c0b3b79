// StepDriver: one training step as a sequence of per-unit phases (DESIGN.md "One training
// step"): embedding forward, block forward × L, head forward+backward (chunked), block backward
// × L, embedding backward — each phase between acquiring the blocks it uses and releasing them
// — then AdamW unit by unit where the optimizer state lives. The same code runs every
// placement: RunMemory decides where blocks are; in a dry run it only records the acquires.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "src/comm/communicator.h"
#include "src/model/transformer.h"
#include "src/optim/adamw.h"
#include "src/train/run_memory.h"
#include "src/zero/step_program.h"

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

// Communication overlap (world > 1). Collectives run on the memory's comm stream, ordered
// against compute by events, never on the compute stream itself:
//  - a unit's gradient is summed across ranks (all-reduce, or reduce-scatter from whole-unit
//    scratch slots that take turns) as soon as its backward is done, while the next unit's
//    backward computes;
//  - the weights a unit needs next are made ready one unit ahead: its pending update (and the
//    all-gather of the new weights, stages 1-2) or its gather into a whole-unit slot (stage 3,
//    two slots taking turns) is issued before the current unit's compute.
// Compute waits only where it needs a collective's result; those waits are the exposed
// communication (exposed_ms). Every public call ends with compute waiting for the comm stream,
// so synchronising the compute stream afterwards covers the collectives too.
class StepDriver {
 public:
  // With sh.world > 1, comm is the job's communicator (null in a dry run: it only records). sh
  // is the memory's (its unit table's) sharding.
  StepDriver(Transformer& model, RunMemory& mem, Sharding sh = {}, Communicator* comm = nullptr);
  // Milliseconds compute has waited for collectives since this driver was made (CPU backend;
  // 0 elsewhere). Read after synchronising the compute stream.
  double exposed_ms() const { return static_cast<double>(exposed_ns_->load()) / 1e6; }

  // Forward and backward of one micro-batch (ids, targets: (N) int32 in compute memory).
  // first: the step's first micro-batch (grads are overwritten, not added to). last: the
  // step's last: each unit's Σ g² is added to norm2[u] (n_units fp64 in compute memory) as
  // soon as its gradient is final, so the global norm needs no second pass over the grads.
  // The per-row losses are in model.loss_rows() when the compute stream reaches the end.
  // With `update`, each unit's pending optimizer step runs just before its forward (units the
  // forward does not use before the head — the final norm, the head — just before the head);
  // with world > 1 one unit earlier, so its all-gather overlaps the previous unit's compute.
  // With `update_now` (the last micro-batch, nothing waiting for the global norm, whole grads:
  // stages 0-1), each unit's optimizer step runs in this backward instead, as soon as its
  // gradient is final (with world > 1 once summed across ranks, on the comm stream's order):
  // the gradient is spent at once, and the optimizer's I/O overlaps the rest of the backward.
  void forward_backward(const int32_t* ids, const int32_t* targets, float grad_scale, bool first, bool last,
                        double* norm2, const PendingUpdate* update = nullptr, const AdamWStep* update_now = nullptr);
  // One micro-batch of a step's program: forward_backward with the updates the program puts in
  // it, `pending` (the previous step's) where mb.pending_update and `now` (this step's) where
  // mb.update_in_backward. Either may be null where the program does not ask for it.
  void micro_batch(const MicroBatch& mb, const int32_t* ids, const int32_t* targets, float grad_scale, double* norm2,
                   const PendingUpdate* pending, const AdamWStep* now);
  // Forward only: the per-row losses.
  void forward(const int32_t* ids, const int32_t* targets);
  // AdamW over every unit, from the embedding to the head, on the optimizer side. With apply
  // false (an fp16 step skipped for overflow) the same blocks are visited, the state is left as
  // it is and the working weights are rewritten from the master: the step's program (what the
  // offload planner planned) is the same either way.
  void optimizer(const AdamWStep& st, bool apply = true);

 private:
  // Runs fn unless this is a dry run (acquire/release still happen).
  template <class F>
  void compute(F&& fn) {
    if (!mem_.dry()) fn();
  }
  // The unit's working weights for a compute phase, until drop_weights(u): the weights block
  // itself, or (stage 3) every rank's shard all-gathered into mem_.gathered(slot_of(u)).
  const void* use_weights(int u);
  // last: the step's last use of the unit's weights (its last micro-batch, unsharded weights
  // apart from the master): they are spent until the next update rewrites them, so an
  // offloaded copy is dropped, not written home (RunMemory::release_discard).
  void drop_weights(int u, bool last = false);
  // The head's: use_weights(head), except that a tied head (stage 3) keeps the embedding
  // gathered by the embedding's forward.
  const void* use_head_weights();
  void drop_head_weights(bool last = false);
  int slot_of(int u) const;  // RunMemory's slots: 0 embedding, 1 untied head, 2 the rest
  void embed_and_blocks_forward(const int32_t* ids);
  // Stage 2: a unit's whole grads of this micro-batch (in `whole`, a scratch) are summed across
  // ranks into this rank's shard (reduce-scatter, in place), which is stored in (first) or
  // added to the shard grads block; on the last micro-batch the shard's Σ g² goes to *norm2.
  void shard_grads(kernels::Stream& s, int u, float* whole, float* shard, bool first, bool last, double* norm2);
  // World > 1: unit u's backward has written its grads `g` (acquired on compute): all-reduce
  // them on the comm stream (and take this rank's Σ g² there) and release them from there.
  void reduce_grads_async(int u, float* g, double* norm2);
  // Stages 2-3: the backward of unit u writes whole grads into a scratch slot (returned; compute
  // has waited until the slot's previous reduce-scatter read it); reduce_scatter_async then
  // reduce-scatters it on the comm stream into the shard grads block.
  float* scratch_for(int slot);
  void reduce_scatter_async(int u, int slot, offload::Mode gmode, bool first, bool last, double* norm2);
  int next_scratch_slot(int u);
  // AdamW over one unit (as optimizer() does); returns the event compute waits on before using the new weights (stages
  // 1-2 with overlap: the all-gather's), else null.
  kernels::Event* update_unit(int u, const AdamWStep& st, bool apply);

  // The weight uses of one pass whose weights need preparing: a pending update (and its
  // all-gather, stages 1-2), or a gather (stage 3). use_weights() takes them in order.
  struct Use {
    int unit = 0;
    int slot = -1;        // stage 3: the gathered slot
    bool update = false;  // run the pending update first
    bool gather = false;  // stage 3: all-gather the unit into `slot`
    bool prepared = false;
    kernels::Event* ready = nullptr;  // compute waits on it before using the weights
  };
  void begin_pass(const PendingUpdate* update, bool backward);
  void end_pass();
  void prepare(size_t i);
  // Work on `to` waits for what `from` has enqueued so far.
  void order(Side from, Side to);
  // Compute waits for ev (CPU: timed, as exposed communication).
  void await_on_compute(kernels::Event& ev);
  bool overlap() const { return sh_.world > 1; }

  Transformer& model_;
  RunMemory& mem_;
  Sharding sh_;
  Communicator* comm_;
  std::vector<Use> uses_;
  size_t cursor_ = 0;  // the next use
  const PendingUpdate* update_ = nullptr;
  std::vector<std::pair<int, int>> held_;  // stage 3: (unit, slot) gathered and in use
  bool held_head_ = false;                 // ... the embedding's kept for a tied head's phase
  int rest_slot_ = 3;                      // the slot the last "other" unit's grads used
  bool last_pass_ = false;                 // this pass is the step's last micro-batch (forward_backward)
  // Events (created when not dry and world > 1): per whole-unit slot, the gather into it is
  // done (comm) / compute is done with it; per scratch slot, the backward wrote it (compute) /
  // the reduce-scatter read it (comm); a ring for prepared weights; one for plain ordering.
  std::array<std::unique_ptr<kernels::Event>, kNumUnitSlots> gathered_ev_, slot_free_ev_, scratch_written_ev_,
      scratch_read_ev_;
  std::array<std::unique_ptr<kernels::Event>, 4> ready_ev_;
  size_t next_ready_ = 0;
  std::array<std::unique_ptr<kernels::Event>, 4> order_ev_;  // per Side: what that side's stream has enqueued
  bool timed_waits_ = false;  // compute is a CPU stream: waits are host functions, timed
  std::shared_ptr<std::atomic<int64_t>> exposed_ns_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace strata
