// TieredMemory: a training run's blocks in the tiered BlockManager (offload/). Every unit's
// working weights, fp32 master, AdamW state and grads, and every block's kept input, is a block
// homed where the placement flags say (device / pinned host / NVMe); the model's workspace and
// the step's small buffers are device-homed blocks too, so every byte is inside a budget. The
// step's schedule is recorded by a dry run of the StepDriver before step 1, so the planner
// prefetches and evicts from the program itself, and budgets are checked (and chosen, when not
// given) before anything is allocated.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/engine.h"
#include "io/swap_space.h"
#include "offload/manager.h"
#include "offload/timeline.h"
#include "src/model/transformer.h"
#include "src/train/perf_model.h"
#include "src/train/placement.h"
#include "src/train/run_memory.h"
#include "src/zero/unit_table.h"

namespace strata {

// "none" (the compute device) | "cpu" (pinned host RAM) | "nvme"; `flag` names the option in errors.
offload::Tier parse_offload(const std::string& text, const std::string& flag);
std::string offload_name(offload::Tier t);  // none | cpu | nvme

// What the blocks of a run add up to, per tier, before anything is allocated (strata plan).
struct MemoryPlan {
  std::array<uint64_t, offload::kNumTiers> budget{};   // what each pool will be
  std::array<uint64_t, offload::kNumTiers> minimum{};  // smallest budget that runs (device, host)
  std::array<uint64_t, offload::kNumTiers> working_set{};  // budget above which nothing is evicted
  // bytes homed on each tier, by role (weights, master, adam, grads, inputs) and buffers
  std::array<std::array<uint64_t, kNumRoles + 1>, offload::kNumTiers> homed{};
  offload::LinkBytes link_bytes{};  // moved per step by the plan in use
  std::string policy;
};

// What a step's phases cost on this machine, for TieredMemory::estimate.
struct StepCosts {
  PhaseTimes phases;                // the model's phases on the compute device
  double adamw_params_per_ms = 0;   // AdamW where the optimizer runs
  offload::LinkRates links;         // bytes per ms per link
};

// The norm barrier: a lower bound on the step that no schedule beats. Clipping needs the global
// norm, so no unit updates before the step's last gradient exists, and each unit's update must be
// done before the next forward computes it. So what the update reads from NVMe (the master,
// moments and gradients homed there) and writes back (master, moments, weights) moves inside that
// window, except what RAM holds: read ahead before it, or still dirty after it. Neither can
// exceed `room`, the RAM that working copies of NVMe-homed blocks may use (the host budget less
// its home copies; on a GPU also the device's). Reads and writes share the disk's one queue. The
// window's compute is the first micro-batch's block forwards and, where it shares the cores,
// AdamW; the rest of the step's compute runs outside it. With every optimizer byte on NVMe and a
// small host budget (1.5B, 8 GiB) this bound, not max(compute, bytes ÷ bandwidth), is the step's.
struct BarrierBound {
  uint64_t read_bytes = 0, write_bytes = 0;  // the update's NVMe traffic
  uint64_t room = 0;
  double window_compute_ms = 0, window_io_ms = 0;
  double step_ms = 0;     // rest of compute + max(window compute, window I/O)
  double ms_per_gib = 0;  // what one more GiB of room takes off while the window's I/O bounds it
};
// rest_ms + window_compute_ms: the step's compute (with AdamW); rates in bytes per ms.
BarrierBound barrier_bound(const MemoryPlan& mp, kernels::Backend backend, double window_compute_ms, double rest_ms,
                           const offload::LinkRates& rates);

class TieredMemory final : public RunMemory {
 public:
  // Which schedule a step of the manager follows: a training step's, a pending update's on its
  // own, or none (an aside: initialising, loading, saving, served online).
  // step: a training step as the placement runs it; update: a pending update on its own (a
  // flush); with speculation's two copies, plain: a step whose update waits for the norm (left
  // pending for the next forward), which --speculate auto runs while it backs off, and rerun: a
  // rolled-back step's forward and backward again, its weights restored from the current
  // master in the forward (PendingUpdate::restore), its update left pending.
  enum class Schedule : int { step = 0, update = 1, plain = 2, rerun = 3, aside = -1 };
  static constexpr int kNumSchedules = 4;

  // Registers the blocks of `model` (and `extra_device_bytes` of step buffers) under
  // `placement`, records the step's schedule (grad_accum micro-batches, then the optimizer),
  // checks the budgets (BudgetError naming the smallest that works and what would help),
  // allocates the pools, creates the NVMe swap files, and binds the model's workspace.
  // compute: the model's stream; opt_rt/opt_stream: where AdamW runs (may equal compute's);
  // comm: the collectives' stream of a multi-rank run (on rt; null: compute's).
  TieredMemory(Transformer& model, kernels::Runtime& rt, kernels::Stream& compute, kernels::Runtime& opt_rt,
               kernels::Stream& opt_stream, const Placement& placement, int64_t grad_accum,
               size_t extra_device_bytes, kernels::Stream* comm = nullptr);
  ~TieredMemory() override;

  // Sizes and checks without allocating anything (what `strata plan` prints). With
  // minimums, also searches the smallest device and host budgets that run (slower: a
  // bisection of simulated steps).
  static MemoryPlan plan(const Transformer& model, kernels::Backend backend, const Placement& placement,
                         int64_t grad_accum, size_t extra_device_bytes, bool minimums = false);
  // Whether `placement` runs within its budgets and the RAM this host has available (what the
  // constructor checks before allocating), without throwing.
  static bool fits(const Transformer& model, kernels::Backend backend, const Placement& placement, int64_t grad_accum,
                   size_t extra_device_bytes);

  // The step's time on this machine (CPU backend: compute and AdamW on one stream): the step's
  // plan under `budget` (plan()'s MemoryPlan::budget) replayed against a clock
  // (offload/timeline.h) with each phase's cost.
  static offload::StepTimeline estimate(const Transformer& model, kernels::Backend backend, const Placement& placement,
                                        int64_t grad_accum, size_t extra_device_bytes,
                                        const std::array<uint64_t, offload::kNumTiers>& budget, const StepCosts& costs);

  void begin_step(Schedule p = Schedule::step);
  // Speculation (Placement::speculate): the master and AdamW copies an update wrote become
  // current. Between begin_step and end_step nothing may be acquired across a flip.
  void flip();
  void end_step() { mgr_->end_step(); }
  void* acquire(Role r, int index, offload::Mode m, Side side) override;
  void release(Role r, int index) override;
  void release_discard(Role r, int index) override;
  bool master_is_weights() const override { return master_is_weights_; }
  const UnitTable& units() const override;
  kernels::Stream& stream(Side side) override {
    return side == Side::optimizer ? opt_stream_ : side == Side::comm && comm_ ? *comm_ : compute_;
  }
  kernels::Ops& ops(Side side) override { return side == Side::optimizer ? opt_rt_.ops() : rt_.ops(); }
  kernels::Runtime* runtime(Side side) override { return side == Side::optimizer ? &opt_rt_ : &rt_; }
  void handoff(Role r, int index, Side to) override;
  float* grad_scratch(int slot) override { return grad_scratch_[static_cast<size_t>(slot)]; }
  void* gathered(int slot) override { return gathered_[static_cast<size_t>(slot)]; }
  void* decoded(int slot) override { return decoded_[static_cast<size_t>(slot)]; }

  // Initialising and loading (asides). write_back starts writing a released block to its home
  // now, so the write overlaps what the caller does next and evicting the block later writes
  // nothing (BlockManager::write_back). zero sets a block to zeros: one homed on NVMe without
  // writing it (BlockManager::zero; call it before writes are in flight: ext4 zeroes a range only
  // once the file's pending direct I/O is done), any other through the host. drain waits for
  // every move issued so far.
  void write_back(Role r, int index);
  void zero(Role r, int index);
  void drain() { mgr_->drain(); }

  void* extra_device() const { return extra_; }  // the step buffers (extra_device_bytes)
  const MemoryPlan& memory_plan() const { return plan_; }
  offload::OffloadStats stats() const;  // the manager's, and the swap's checksum time
  double stall_ms() const { return stall_ms_; }  // compute waited for blocks (all steps)
  std::vector<std::string> swap_files() const;
  // A block's tier on `side` (compute or optimizer).
  offload::Tier tier_of(Role r, int index, Side side) const;

  struct Layout;  // the block table (opaque)

 private:
  void end(Role r, int index, bool discard);  // release, then (discard) the bytes are dead
  static std::unique_ptr<Layout> build_layout(const Transformer& model, kernels::Backend backend,
                                              const Placement& pl, int64_t grad_accum, size_t extra_bytes);

  Transformer& model_;
  kernels::Runtime& rt_;
  kernels::Stream& compute_;
  kernels::Runtime& opt_rt_;
  kernels::Stream& opt_stream_;
  kernels::Stream* comm_;
  Placement placement_;
  std::unique_ptr<Layout> layout_;
  bool master_is_weights_ = false;
  MemoryPlan plan_;
  std::unique_ptr<io::IoEngine> engine_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<offload::BlockManager> mgr_;
  std::vector<offload::Handle> open_;  // per block: its open handle (one at a time)
  std::vector<Side> open_side_;        // ... and the side whose stream uses it
  void* extra_ = nullptr;
  std::array<float*, kNumUnitSlots> grad_scratch_{};
  std::array<void*, kNumUnitSlots> gathered_{};
  std::array<void*, 2> decoded_{};
  double stall_ms_ = 0;
  int parity_ = 0;  // speculation: which master/AdamW copies are current
};

}  // namespace strata
