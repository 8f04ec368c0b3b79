// UnitLifecycle: the ZeRO side of a training step, one unit at a time (FSDP2's per-unit
// lifecycle). Before a phase computes with a unit its weights are made ready (its pending
// update, and at stage 3 the all-gather of its shards into a whole-unit slot), then used and
// released; after the unit's backward its gradient is summed across ranks (all-reduce, or
// reduce-scatter from a scratch slot) and, where the step program says so, the unit updated.
// It owns the slots' events, the comm stream's ordering against compute and the collectives;
// StepDriver (src/train/step_driver.h) only sequences the phases. A stage picks how weights and
// gradients travel once (WeightPath, GradPath), and every transition checks the unit's state: a
// call out of order throws std::logic_error naming the unit and its states.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

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
  // Speculation rolled back (TieredMemory's two copies): the working weights only, cast again
  // from the current master, as they were before the speculative update overwrote them.
  bool restore = false;
};

// One pass over the units: a forward, or the forward and backward of one micro-batch.
struct UnitPass {
  bool backward = false;
  bool first = false;  // the step's first micro-batch: its backward overwrites the grads
  bool last = false;   // the step's last: grads are final; each unit's Σ g² is added to norm2[u]
  double* norm2 = nullptr;                 // (n_units) fp64 in compute memory
  const PendingUpdate* update = nullptr;   // the previous step's, just before each unit's first use
  const AdamWStep* update_now = nullptr;   // this step's, as each unit's gradient is final
};

// Work enqueued on `stream` from now on waits for `ev`. timed (a CPU stream): the wait is a host
// function on the stream that adds the nanoseconds it waited to *waited_ns and rethrows what the
// awaited work failed with; otherwise the stream's own wait (not timed).
void wait_on_stream(kernels::Stream& stream, kernels::Event& ev, bool timed,
                    const std::shared_ptr<std::atomic<int64_t>>& waited_ns);

class UnitLifecycle {
 public:
  // Weights: resting (in their block, nothing computing with them) -> in_use (a phase computes
  // with them) -> resting. Grads: idle -> writing (a backward writes them) -> written (the
  // backward is enqueued) -> idle (summed across ranks, spent by an update in the backward).
  enum class Weights : uint8_t { resting, in_use };
  enum class Grads : uint8_t { idle, writing, written };

  // With sharding world > 1, comm is the job's communicator (null in a dry run).
  UnitLifecycle(Transformer& model, RunMemory& mem, Communicator* comm);
  ~UnitLifecycle();
  // Milliseconds compute has waited for collectives (CPU backend; 0 elsewhere).
  double exposed_ms() const { return static_cast<double>(exposed_ns_->load()) / 1e6; }

  void begin_pass(const UnitPass& pass);
  // Every unit is back at rest; compute waits for what the comm stream has enqueued.
  void end_pass();

  // Gather -> use -> release. The unit's working weights for a compute phase until
  // drop_weights(u): its weights block, or (stage 3) the whole unit gathered into a slot.
  // spent: the step's last use of the weights (an offloaded copy is dropped, not written home).
  const void* use_weights(int u);
  void drop_weights(int u, bool spent = false);
  // The head's: a tied head is the embedding (kept gathered from its forward, stage 3).
  const void* use_head_weights();
  void drop_head_weights(bool spent = false);

  // Write -> reduce -> update. Where unit u's backward writes its gradient (from now until
  // close_grads); it overwrites (overwrites()) or adds to what is there. finish_grads runs
  // after the phase has released its other blocks.
  float* open_grads(int u);
  bool overwrites() const;
  void close_grads(int u);
  void finish_grads(int u);
  // The head phase's two units, the final norm and the head (a tied head: the embedding, whose
  // own backward then adds to what the head wrote and reduces the sum).
  std::pair<float*, float*> open_head_grads();
  void close_head_grads();
  void finish_head_grads();

  // AdamW over every unit, on the optimizer side (apply false: the same blocks, no change).
  void optimizer(const AdamWStep& st, bool apply);

  class WeightPath;
  class GradPath;

 private:
  class WholeWeights;
  class GatheredWeights;
  class WholeGrads;
  class ScatteredGrads;

  template <class F>
  void compute(F&& fn) {
    if (!mem_.dry()) fn();
  }
  std::string name(int u) const;
  bool trains(int u) const;  // false: a frozen unit (weights only)
  [[noreturn]] void out_of_order(int u, const char* call) const;
  // The whole-unit slot (RunMemory's) of unit u's next use: unit_slot's, the units of a pair
  // taking turns (turn: per slot, the uses so far).
  int gather_slot(int u, std::array<int, kNumUnitSlots>& turn) const;
  // The pending update and (stage 3) the gather of use i, once.
  void prepare(size_t i);
  // AdamW over one unit; returns the event compute waits on before using the new weights
  // (stages 1-2 with overlap: the all-gather's), else null.
  // restore: PendingUpdate::restore (only the master is read, only the weights written).
  kernels::Event* update_unit(int u, const AdamWStep& st, bool apply, bool restore = false);
  // World > 1, stages 0-1: all-reduce unit u's grads `g` on the comm stream (with this rank's
  // Σ g² there) and release them from there.
  void reduce_grads_async(int u, float* g, double* norm2);
  // Stages 2-3: reduce-scatter the scratch slot on the comm stream into the shard grads block.
  void reduce_scatter_async(int u, int slot);
  void shard_grads(kernels::Stream& s, int u, float* whole, float* shard, double* norm2);
  float* scratch_for(int slot);  // compute waits until the slot's previous reduce-scatter read it
  int next_scratch_slot(int u);
  void order(Side from, Side to);  // work on `to` waits for what `from` has enqueued so far
  void await_on_compute(kernels::Event& ev);  // CPU: timed, as exposed communication
  bool overlap() const { return sh_.world > 1; }

  // The weight uses of one pass that need preparing: a pending update (and its all-gather,
  // stages 1-2), or a gather (stage 3). use_weights() takes them in order.
  struct Use {
    int unit = 0;
    int slot = -1;        // stage 3: the gathered slot
    bool update = false;  // run the pending update first
    bool gather = false;  // stage 3: all-gather the unit into `slot`
    bool prepared = false;
    kernels::Event* ready = nullptr;  // compute waits on it before using the weights
  };

  Transformer& model_;
  RunMemory& mem_;
  Sharding sh_;
  Communicator* comm_;
  std::unique_ptr<WeightPath> weights_path_;
  std::unique_ptr<GradPath> grads_path_;
  UnitPass pass_;
  std::vector<Weights> weights_;  // per unit
  std::vector<Grads> grads_;      // per unit
  std::vector<float*> open_;      // per unit: where its open grads are
  std::vector<int> scratch_of_;   // per unit: its grads' scratch slot (stages 2-3)
  std::vector<Use> uses_;
  size_t cursor_ = 0;  // the next use
  std::vector<std::pair<int, int>> held_;  // stage 3: (unit, slot) gathered and in use
  bool held_head_ = false;                 // ... the embedding's kept for a tied head's phase
  int next_decoded_ = 0;                   // LoRA --base-dtype: the decoded slot the next layer takes
  std::array<int, kNumUnitSlots> scratch_turn_{};  // per slot pair: the grads' scratch slots taken so far
  // Events (created when not dry and world > 1): per whole-unit slot, the gather into it is
  // done (comm) / compute is done with it; per scratch slot, the reduce-scatter read it (comm);
  // a ring for prepared weights; one per side for plain ordering.
  std::array<std::unique_ptr<kernels::Event>, kNumUnitSlots> gathered_ev_, slot_free_ev_, scratch_read_ev_;
  std::array<std::unique_ptr<kernels::Event>, 4> ready_ev_;
  size_t next_ready_ = 0;
  std::array<std::unique_ptr<kernels::Event>, 4> order_ev_;  // per Side: what that side's stream has enqueued
  bool timed_waits_ = false;  // compute is a CPU stream: waits are host functions, timed
  std::shared_ptr<std::atomic<int64_t>> exposed_ns_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace strata
