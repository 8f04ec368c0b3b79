// BlockManager: the tiered memory manager. Blocks (named byte ranges with a home tier) are
// acquired on a tier and released; behind that, hard per-tier budgets, async moves between
// device, pinned host and NVMe, and prefetch/eviction planned from the step's schedule —
// declared up front or recorded on the first step, replanned when the schedule changes.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "offload/fence.h"
#include "offload/nvme_store.h"
#include "offload/planner.h"
#include "offload/pool.h"
#include "offload/residency.h"
#include "offload/schedule.h"
#include "offload/stats.h"
#include "offload/transfer.h"

namespace strata::kernels {
class Runtime;
class Stream;
}  // namespace strata::kernels

namespace strata::offload {

struct ManagerConfig {
  uint64_t device_bytes = 0;  // --device-mem: hard budget of the device pool
  uint64_t host_bytes = 0;    // --host-mem: hard budget of the pinned host pool (staging not included)
  TransferConfig transfer;    // staging buffers for device<->NVMe
};

class BlockManager;

// An acquired block: data() is valid from acquire to release; its bytes are current once
// ready() (wait() on the host, or wait_host() and then wait_on() a compute stream).
class Handle {
 public:
  Handle() = default;
  void* data() const { return ptr_; }
  uint64_t bytes() const { return bytes_; }
  BlockId block() const { return block_; }
  Tier tier() const { return tier_; }
  Mode mode() const { return mode_; }
  explicit operator bool() const { return mgr_ != nullptr; }
  bool ready() const { return ready_.ready(); }
  // Host blocks until the bytes are there; the time blocked is counted as stall. Rethrows the
  // error of the move that was to bring them (e.g. an NVMe read error with path and offset).
  void wait();
  // The parts of ready() that are not stream events (NVMe I/O, host-side signals): a stream
  // cannot wait for them without blocking, so the host does (rethrowing their errors), and
  // then wait_on() orders the stream behind the events alone.
  bool host_ready() const { return ready_.host_ready(); }
  void wait_host() const { ready_.wait_host(); }
  void wait_on(kernels::Stream& s) const { ready_.enqueue_wait(s); }

 private:
  friend class BlockManager;
  BlockManager* mgr_ = nullptr;
  BlockId block_ = 0;
  Tier tier_ = Tier::host;
  Mode mode_ = Mode::read;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
  uint32_t event_ = 0;  // the acquire's index in the step
  Fence ready_;
};

// One client thread drives a manager (acquire/release/steps); Handle::wait may be called from
// any thread. After a move fails, the error is rethrown by every wait that depends on it; the
// step should be abandoned (the manager stays consistent, the bytes of that block do not).
class BlockManager {
 public:
  // Allocates the device and host pools (their whole budgets) now. `store` holds the NVMe tier;
  // without one, no block may live on NVMe.
  BlockManager(kernels::Runtime& rt, ManagerConfig cfg, std::unique_ptr<NvmeStore> store = nullptr);
  ~BlockManager();  // waits for every move in flight
  BlockManager(const BlockManager&) = delete;
  BlockManager& operator=(const BlockManager&) = delete;

  // Registers a block and places its home copy (BudgetError when the home tier is full).
  BlockId add_block(const std::string& name, uint64_t bytes, Tier home);
  const BlockSpec& block(BlockId b) const;
  // The home copy's memory of a block homed on device or host: it never moves, so a block that
  // only ever lives there (a workspace) can be used through this pointer at any time.
  void* home_data(BlockId b) const;

  // Declares the step's schedule (schedule 0); validates it and throws BudgetError naming the
  // minimum when a budget is too small to run it. Without one, the first step is recorded
  // (online, LRU) and later steps are planned from the recording.
  void set_schedule(Schedule s) { set_schedule(0, std::move(s)); }
  // Declares schedule p: another fixed access pattern the client runs now and then (e.g. an
  // optimizer pass on its own), planned like the step. Schedules are numbered from 0.
  void set_schedule(int p, Schedule s);
  const Schedule& schedule(int p = 0) const { return schedules_.at(static_cast<size_t>(p)).schedule; }
  static constexpr int kAside = -1;

  // A step of schedule p (declared, or recorded from its first step). begin_step(kAside) starts
  // an aside instead — accesses outside any schedule (initialising, loading or saving the
  // blocks): served online (demand loads, LRU), not recorded, so no schedule or plan changes.
  void begin_step(int schedule = 0);
  void end_step();  // every handle must have been released
  Handle acquire(BlockId b, Tier t, Mode m);
  // done_on: the stream whose enqueued work uses the block (null: the host is done with it).
  // discard: the block's bytes are dead until its next writing acquire (Residency::discard), so
  // no copy of it is ever written home for them.
  void release(Handle& h, kernels::Stream* done_on = nullptr, bool discard = false);

  // Asides (initialising, loading) use these two to write a block once, to its home:
  // write_back starts copying a released block's current bytes home now and keeps the copy, so
  // the writes overlap what the client does next and a later eviction moves nothing (a no-op
  // when home is current). zero sets a block homed on NVMe to zeros without writing it (the
  // store records its range as zeros); only its home copy may exist, not acquired.
  void write_back(BlockId b);
  void zero(BlockId b);
  // The block's bytes are dead until it is next written whole (Residency::discard): no copy of
  // it is written home from here. Outside an acquire of it.
  void discard(BlockId b);

  // Smallest budget of tier t at which the current schedule runs (others as configured).
  uint64_t min_budget(Tier t) const;
  OffloadStats stats() const;
  const Residency& residency() const { return res_; }
  void drain();  // host waits for every move issued so far

 private:
  struct RtCopy {
    Fence ready;  // the bytes are current after this
    Fence users;  // work that reads or writes the range (moves, released clients)
  };
  void apply(const PlanOp& op);
  void apply_all(const std::vector<PlanOp>& ops);
  void issue(const Move& m, bool fresh_dst);
  void free_ranges(const std::vector<Freed>& freed);
  Handle finish_acquire(BlockId b, Tier t, Mode m, uint32_t event);
  void online_demand(BlockId b, Tier t, Mode m);
  void diverge();
  void choose_plan();
  void flush_to_cold();
  Place place(BlockId b, Tier t) const;
  RtCopy& rt_copy(BlockId b, Tier t) { return copies_[b][index(t)]; }

  kernels::Runtime& rt_;
  std::unique_ptr<NvmeStore> store_;
  std::array<TierPool, kNumTiers> pools_;
  Residency res_;
  std::vector<std::array<RtCopy, kNumTiers>> copies_;
  // Events for releases on streams of another runtime (the optimizer's CPU stream next to a
  // CUDA compute stream): an event is recorded only on a stream of the runtime that made it.
  std::vector<std::pair<kernels::Runtime*, std::unique_ptr<EventPool>>> side_pools_;
  EventPool& events_for(kernels::Stream& s);
  std::unique_ptr<TransferEngine> transfer_;  // after the pools: destroyed (drained) first

  struct Planned {
    Schedule schedule;             // declared or recorded
    std::optional<Plan> plan;      // for schedule from the residency state it starts at
  };
  Planned& prog() { return schedules_[static_cast<size_t>(current_)]; }
  std::vector<Planned> schedules_{1};
  int current_ = 0;                // the schedule of the current (or last) step
  bool in_step_ = false;
  bool aside_ = false;             // this "step" is an aside: online and not recorded
  bool planned_ = false;           // this step follows plan_ (else online, recording)
  size_t cursor_ = 0;              // next event of schedule_ expected
  Schedule recording_;             // online: what the client did this step
  std::vector<int> open_handles_;  // per block: handles not yet released
  int64_t clock_ = 0;              // LRU time across steps

  mutable std::mutex stats_mu_;
  OffloadStats stats_;             // counters kept here (links come from transfer_)
  friend class Handle;
};

}  // namespace strata::offload
