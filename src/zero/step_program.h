// StepProgram: where a training step's optimizer updates run, micro-batch by micro-batch,
// written once. The trainer runs it, the dry run that records the offload schedule runs it and
// the tests run it: were they to drift apart, the offload manager would plan a step that never
// runs and fall back to online LRU.
#pragma once
#include <cstdint>
#include <vector>

#include "src/train/placement.h"

namespace strata {

// One micro-batch of a step: its forward and backward, and the updates that run inside them.
struct MicroBatch {
  int64_t index = 0;
  bool first = false;  // the step's first: it overwrites the grads
  bool last = false;   // the step's last: the grads are final, their norms are taken
  // The previous step's update (PendingUpdate) runs unit by unit inside this forward.
  bool pending_update = false;
  // This step's update runs unit by unit inside this backward, as each gradient is final.
  bool update_in_backward = false;
};

class StepProgram {
 public:
  // grad_accum micro-batches. Where nothing waits for the global norm and the gradients are
  // whole (Placement::update_in_backward()), the step's update runs in the last backward;
  // else it is left pending, for the next step's first forward or a flush (before a save or
  // a checkpoint, as a program of its own: TieredMemory::Schedule::update).
  StepProgram(int64_t grad_accum, const Placement& pl) : StepProgram(grad_accum, pl.update_in_backward()) {}
  // The same with the choice made: update_in_backward, or left pending (speculation decides per
  // step whether a step speculates: Trainer::step).
  StepProgram(int64_t grad_accum, bool update_in_backward) : update_pending_(!update_in_backward) {
    for (int64_t k = 0; k < grad_accum; ++k)
      mbs_.push_back({.index = k,
                      .first = k == 0,
                      .last = k + 1 == grad_accum,
                      .pending_update = k == 0 && update_pending_,
                      .update_in_backward = k + 1 == grad_accum && !update_pending_});
  }
  // This step's update is left pending (not run inside the step).
  bool update_pending() const { return update_pending_; }
  auto begin() const { return mbs_.begin(); }
  auto end() const { return mbs_.end(); }
  size_t size() const { return mbs_.size(); }

 private:
  bool update_pending_;
  std::vector<MicroBatch> mbs_;
};

}  // namespace strata
