// StepDriver: one training step as a sequence of per-unit phases (DESIGN.md "One training
// step"): embedding forward, block forward × L, head forward+backward (chunked), block backward
// × L, embedding backward — each phase between acquiring the blocks it uses and releasing them
// — then AdamW unit by unit where the optimizer state lives. The same code runs every
// placement and ZeRO stage: RunMemory decides where blocks are (in a dry run it only records
// the acquires), and each unit's ZeRO lifecycle (src/zero/unit_lifecycle.h) how its weights
// and gradients travel between ranks.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <functional>
#include <utility>

#include "src/comm/communicator.h"
#include "src/model/transformer.h"
#include "src/optim/adamw.h"
#include "src/train/run_memory.h"
#include "src/zero/step_program.h"
#include "src/zero/unit_lifecycle.h"

namespace strata {

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
  double exposed_ms() const { return units_.exposed_ms(); }
  // Pipeline parallel: milliseconds compute has waited for the point-to-point transfers (an
  // input or a residual gradient not there yet, a send still reading a buffer compute would
  // overwrite) since this driver was made. Timed on the CPU backend; 0 elsewhere.
  double pipeline_wait_ms() const { return static_cast<double>(pipe_wait_ns_->load()) / 1e6; }

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

  // Pipeline parallel (model.pipeline().on()): one step's micro-batches through this rank's
  // stage in the 1F1B schedule (PipeDream-Flush, Megatron-LM's default): stage s of p runs
  // min(p - s - 1, m) forwards, then alternates one forward and one backward, then the
  // remaining backwards; micro-batch i's activations live in slot i % slots. Activations go to
  // the next stage and their gradients to the one before as point-to-point sends over the
  // pipeline group on the comm stream (Side::comm), ordered against compute by events: compute
  // waits only for an input or a gradient it needs, or for a send still reading a buffer it is
  // about to overwrite (pipeline_wait_ms). grads, norm2 and the first/last micro-batch rules are
  // forward_backward's; no update runs inside (the step's update follows it, optimizer()). A
  // tied head's gradient (the last stage's copy of the embedding) is summed with the first
  // stage's over `embed_group` after the last micro-batch, before either is reduced over the
  // data-parallel ranks, so both copies take the same update.
  struct PipelineInputs {
    int64_t micro_batches = 1;
    // Makes micro-batch i current (documents, dropout key) and returns its (ids, targets).
    std::function<std::pair<const int32_t*, const int32_t*>(int64_t)> select;
    // The last stage: micro-batch i's per-row losses are in model.loss_rows() (stream order).
    std::function<void(int64_t)> losses;
    Communicator* embed_group = nullptr;
  };
  void pipeline_step(const PipelineInputs& in, float grad_scale, double* norm2);
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
  // spent: this pass is the step's last use of the embedding's weights.
  void embed_and_blocks_forward(const int32_t* ids, bool embed_spent);
  void blocks_forward(int64_t first, int64_t end);
  // Pipeline parallel: one micro-batch's forward, and backward, through this stage.
  void stage_forward(int64_t mb, const PipelineInputs& in);
  void stage_backward(int64_t mb, int64_t micro_batches, const PipelineInputs& in, float grad_scale, double* norm2,
                      bool send_grad);
  // The point-to-point halves of the schedule (each a no-op where the stage has no such
  // neighbour): micro-batch mb's input received into its slot; the stage's output sent on
  // (recv_grad_of >= 0: with that micro-batch's residual gradient received back); a residual
  // gradient received; the gradient sent back with micro-batch `next`'s input received.
  void pipe_recv_forward(int64_t mb);
  void pipe_send_forward(int64_t recv_grad_of);
  void pipe_recv_backward();
  void pipe_send_backward_recv_forward(int64_t next);
  size_t pipe_elems() const;  // a residual (res_rows, C) in elements
  void pipe_drain();          // compute waits for every transfer enqueued
  // The stream the transfers run on, and the events that order it against compute (none in a
  // dry run, or where the comm stream is compute's).
  kernels::Stream& pipe_stream() { return mem_.stream(Side::comm); }
  bool pipe_events() const { return pipe_ev_ != nullptr; }
  void comm_after_compute();  // the comm stream waits for what compute has enqueued
  struct PipeEvents;
  using PipeEvent = std::unique_ptr<kernels::Event> PipeEvents::*;
  void compute_waits(PipeEvent ev);  // compute waits for a transfer (timed on the CPU)
  void record_on_comm(PipeEvent ev);
  struct PipeEvents {
    // compute_done: compute's work so far; in_ready / grad_ready: a stage input / a residual
    // gradient received; out_free / grad_free: the send of the stage's output / of the residual
    // gradient has read it; comm_done: everything the comm stream has enqueued.
    std::unique_ptr<kernels::Event> compute_done, in_ready, grad_ready, out_free, grad_free, comm_done;
  };
  std::unique_ptr<PipeEvents> pipe_ev_;
  std::shared_ptr<std::atomic<int64_t>> pipe_wait_ns_ = std::make_shared<std::atomic<int64_t>>(0);
  // The head phase of forward_backward (final norm, LM head, cross-entropy, their backward).
  void head_phase(const int32_t* targets, float grad_scale, bool last);
  // Backward of layers [first, end), from the last down.
  void blocks_backward(int64_t first, int64_t end, bool last);

  Transformer& model_;
  RunMemory& mem_;
  UnitLifecycle units_;
};

}  // namespace strata
