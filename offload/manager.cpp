// BlockManager: executes the plan (or, off-plan, an online LRU policy) against the real pools,
// turning every residency change into a move with the right fences.
#include "offload/manager.h"

#include <cassert>
#include <chrono>
#include <stdexcept>

#include "kernels/runtime.h"
#include "offload/size.h"

namespace strata::offload {

void Handle::wait() {
  if (ready_.ready()) {
    ready_.wait();  // rethrows a failed move
    return;
  }
  auto t0 = std::chrono::steady_clock::now();
  ready_.wait();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard lock(mgr_->stats_mu_);
  mgr_->stats_.ms_stalled += ms;
  ++mgr_->stats_.stalls;
}

namespace {
std::array<uint64_t, kNumTiers> budgets_of(const ManagerConfig& cfg, const NvmeStore* store) {
  return {cfg.device_bytes / kAlign * kAlign, cfg.host_bytes / kAlign * kAlign,
          store ? store->capacity() / kAlign * kAlign : 0};
}
}  // namespace

BlockManager::BlockManager(kernels::Runtime& rt, ManagerConfig cfg, std::unique_ptr<NvmeStore> store)
    : rt_(rt), store_(std::move(store)), res_(budgets_of(cfg, store_.get())) {
  for (int t = 0; t < kNumTiers; ++t) pools_[t] = TierPool(rt, static_cast<Tier>(t), res_.budget(static_cast<Tier>(t)));
  transfer_ = std::make_unique<TransferEngine>(rt, store_.get(), cfg.transfer);
}

BlockManager::~BlockManager() { drain(); }

EventPool& BlockManager::events_for(kernels::Stream& s) {
  kernels::Runtime& r = s.runtime();
  if (&r == &rt_) return transfer_->events();
  for (auto& [rt, pool] : side_pools_)
    if (rt == &r) return *pool;
  side_pools_.emplace_back(&r, std::make_unique<EventPool>(r));
  return *side_pools_.back().second;
}

BlockId BlockManager::add_block(const std::string& name, uint64_t bytes, Tier home) {
  if (in_step_) throw std::logic_error("offload: add_block('" + name + "') inside a step");
  if (home == Tier::nvme && !store_)
    throw std::invalid_argument("offload: block '" + name + "' lives on NVMe but no --nvme-path store was given");
  BlockId b = res_.add_block({name, bytes, home});
  if (home == Tier::nvme) store_->name_range(res_.copy(b, Tier::nvme).offset, align_up(bytes), name);
  copies_.emplace_back();
  open_handles_.push_back(0);
  // The home copy starts with whatever its range held: the client writes it before reading.
  for (Planned& p : schedules_) p.plan.reset();
  return b;
}

const BlockSpec& BlockManager::block(BlockId b) const { return res_.block(b); }

void* BlockManager::home_data(BlockId b) const {
  const BlockSpec& spec = res_.block(b);
  if (spec.home == Tier::nvme) throw std::invalid_argument("offload: block '" + spec.name + "' lives on NVMe");
  return pools_[index(spec.home)].base() + res_.copy(b, spec.home).offset;
}

void BlockManager::set_schedule(int p, Schedule s) {
  if (in_step_) throw std::logic_error("offload: set_schedule inside a step");
  if (p < 0) throw std::invalid_argument("offload: schedule numbers start at 0");
  s.validate(res_.n_blocks());
  check_budgets(res_, s);
  if (schedules_.size() <= static_cast<size_t>(p)) schedules_.resize(static_cast<size_t>(p) + 1);
  schedules_[static_cast<size_t>(p)] = Planned{std::move(s), std::nullopt};
}

uint64_t BlockManager::min_budget(Tier t) const { return offload::min_budget(res_, schedules_[0].schedule, t); }

Place BlockManager::place(BlockId b, Tier t) const {
  const CopyInfo& c = res_.copy(b, t);
  Place p{t};
  if (t == Tier::nvme)
    p.nvme_offset = c.offset;
  else
    p.ptr = pools_[index(t)].base() + c.offset;
  return p;
}

// One move between two copies of a block: waits for the source's bytes (and its users, so a
// released writer's stream work is included), and for whatever last touched the destination.
void BlockManager::issue(const Move& m, bool fresh_dst) {
  RtCopy& src = rt_copy(m.block, m.from);
  RtCopy& dst = rt_copy(m.block, m.to);
  Fence deps;
  deps.add(src.ready);
  deps.add(src.users);
  if (fresh_dst) {
    deps.add(pools_[index(m.to)].take_hazards(m.to_offset, m.bytes));
  } else {  // overwriting a copy (the home): its last users must be done, failed or not
    deps.add(dst.ready.quiet());
    deps.add(dst.users.quiet());
  }
  Fence done = transfer_->move(place(m.block, m.from), place(m.block, m.to), m.bytes, deps);
  dst.ready = done;
  dst.users = done;
  src.users.add(done);
}

void BlockManager::free_ranges(const std::vector<Freed>& freed) {
  for (const Freed& f : freed) {
    RtCopy& c = rt_copy(f.block, f.tier);
    Fence last = c.users;
    last.add(c.ready);
    pools_[index(f.tier)].add_hazard(f.offset, f.bytes, std::move(last));
    c = RtCopy{};
  }
}

void BlockManager::apply(const PlanOp& op) {
  switch (op.kind) {
    case OpKind::load: {
      bool fresh = !res_.copy(op.block, op.tier).present;
      Effects fx = res_.load(op.block, op.tier);
      for (const Move& m : fx.moves) issue(m, fresh);
      break;
    }
    case OpKind::alloc: {
      res_.alloc(op.block, op.tier);
      const CopyInfo& c = res_.copy(op.block, op.tier);
      RtCopy& rc = rt_copy(op.block, op.tier);
      rc.ready = pools_[index(op.tier)].take_hazards(c.offset, res_.block(op.block).bytes);
      rc.users = rc.ready;
      break;
    }
    case OpKind::evict: {
      Effects fx = res_.evict(op.block, op.tier);
      for (const Move& m : fx.moves) issue(m, /*fresh_dst=*/false);  // write-back into the home copy
      free_ranges(fx.freed);
      break;
    }
  }
}

void BlockManager::apply_all(const std::vector<PlanOp>& ops) {
  for (const PlanOp& op : ops) apply(op);
}

void BlockManager::flush_to_cold() {
  for (BlockId b = 0; b < res_.n_blocks(); ++b)
    for (int t = 0; t < kNumTiers; ++t) {
      Tier tier = static_cast<Tier>(t);
      const CopyInfo& c = res_.copy(b, tier);
      if (c.present && c.pins == 0 && res_.block(b).home != tier) apply({OpKind::evict, b, tier});
    }
}

void BlockManager::choose_plan() {
  if (prog().plan && prog().plan->start_fingerprint == res_.fingerprint() && prog().plan->schedule_fingerprint == prog().schedule.fingerprint())
    return;
  auto cands = candidate_plans(res_, prog().schedule);
  if (cands.empty()) {
    // The copies in place are arranged so that no plan fits (fragmentation, or a budget that only
    // a cold start can meet): start from the home copies alone.
    flush_to_cold();
    std::lock_guard lock(stats_mu_);
    ++stats_.cold_restarts;
  }
  if (cands.empty()) cands = candidate_plans(res_, prog().schedule);
  if (cands.empty()) check_budgets(res_, prog().schedule);  // throws, naming the minimum
  if (cands.empty()) throw std::logic_error("offload: no plan runs the schedule, yet every budget passes");
  uint64_t lru = 0;
  for (const Plan& p : cands)
    if (p.options.policy == Policy::lru) lru = p.bytes_moved();
  prog().plan = std::move(cands.front());
  std::lock_guard lock(stats_mu_);
  ++stats_.plans;
  stats_.policy = prog().plan->name();
  stats_.planned_bytes = prog().plan->bytes_moved();
  stats_.lru_bytes = lru;
}

void BlockManager::begin_step(int schedule) {
  if (in_step_) throw std::logic_error("offload: begin_step inside a step");
  if (schedule != kAside && (schedule < 0 || static_cast<size_t>(schedule) >= schedules_.size()))
    throw std::invalid_argument("offload: begin_step of undeclared schedule " + std::to_string(schedule));
  cursor_ = 0;
  recording_.clear();
  aside_ = schedule == kAside;
  current_ = aside_ ? 0 : schedule;
  planned_ = !aside_ && !prog().schedule.empty();
  if (planned_) {
    choose_plan();  // may throw BudgetError: the step has not begun
    apply_all(prog().plan->start);
  } else {
    std::lock_guard lock(stats_mu_);
    stats_.policy = "online-lru";
  }
  in_step_ = true;
}

// The client left the schedule: from here on this step runs online (demand loads, LRU), and
// what it does is recorded to plan the next step. Nothing planned for the old schedule is issued.
void BlockManager::diverge() {
  planned_ = false;
  for (size_t i = 0; i < cursor_; ++i) recording_.push(prog().schedule.events()[i]);
  std::lock_guard lock(stats_mu_);
  ++stats_.schedule_changes;
  stats_.policy = "online-lru";
}

void BlockManager::end_step() {
  if (!in_step_) throw std::logic_error("offload: end_step without begin_step");
  for (BlockId b = 0; b < res_.n_blocks(); ++b)
    if (open_handles_[b] != 0)
      throw std::logic_error("offload: end_step with block '" + res_.block(b).name + "' still acquired");
  if (planned_ && cursor_ != prog().schedule.size()) diverge();  // the step ended early
  if (aside_) {
    recording_ = Schedule{};
  } else if (!planned_) {
    recording_.set_successor(prog().schedule.successors());  // a property of the blocks, not the run
    recording_.validate(res_.n_blocks());
    if (!(recording_ == prog().schedule)) {
      prog().schedule = std::move(recording_);
      prog().plan.reset();
    }
    recording_ = Schedule{};
  }
  in_step_ = false;
  if (aside_) return;
  std::lock_guard lock(stats_mu_);
  ++stats_.steps;
}

void BlockManager::online_demand(BlockId b, Tier t, Mode m) {
  if (!res_.needs_load(b, t, m)) return;
  const BlockSpec& spec = res_.block(b);
  if (!res_.copy(b, t).present) {
    auto victims = res_.choose_victims(t, spec.bytes, Policy::lru, std::numeric_limits<int64_t>::min());
    if (!victims) {
      uint64_t need = res_.pinned_bytes(t) + align_up(spec.bytes);
      throw BudgetError(std::string(tier_name(t)) + " budget " + format_size(res_.budget(t)) + " is exhausted: " +
                            format_size(res_.pinned_bytes(t)) + " are acquired or home when block '" + spec.name +
                            "' (" + format_size(spec.bytes) + ") is acquired; this step needs at least " +
                            format_size(need) + " (" + std::string(budget_remedy(t)) + ")",
                        t, res_.budget(t), need);
    }
    for (BlockId v : *victims) apply({OpKind::evict, v, t});
  }
  apply({reads(m) ? OpKind::load : OpKind::alloc, b, t});
}

Handle BlockManager::finish_acquire(BlockId b, Tier t, Mode m, uint32_t event) {
  Effects fx = res_.acquire(b, t, m);
  free_ranges(fx.freed);  // writing: the other copies are stale now
  CopyInfo& c = res_.copy_mut(b, t);
  c.last_use = clock_++;
  RtCopy& rc = rt_copy(b, t);
  Handle h;
  h.mgr_ = this;
  h.block_ = b;
  h.tier_ = t;
  h.mode_ = m;
  h.bytes_ = res_.block(b).bytes;
  h.ptr_ = pools_[index(t)].base() + c.offset;
  h.event_ = event;
  // Reading: the bytes must have arrived (a failed load is an error here). Writing: nothing may
  // still read or write the range (completion only: the old bytes are being replaced).
  h.ready_ = reads(m) ? rc.ready : rc.ready.quiet();
  if (writes(m)) h.ready_.add(rc.users.quiet());
  ++open_handles_[b];
  return h;
}

Handle BlockManager::acquire(BlockId b, Tier t, Mode m) {
  if (!in_step_) throw std::logic_error("offload: acquire outside begin_step/end_step");
  if (b >= res_.n_blocks()) throw std::out_of_range("offload: acquire of unknown block " + std::to_string(b));
  if (t == Tier::nvme) throw std::invalid_argument("offload: NVMe is storage only; acquire '" + res_.block(b).name + "' on device or host");
  if (planned_) {
    const ScheduleEvent* e = cursor_ < prog().schedule.size() ? &prog().schedule.events()[cursor_] : nullptr;
    if (e && !e->release && e->block == b && e->tier == t && e->mode == m) {
      apply_all(prog().plan->before[cursor_]);
      Handle h = finish_acquire(b, t, m, static_cast<uint32_t>(cursor_));
      apply_all(prog().plan->after[cursor_]);
      ++cursor_;
      return h;
    }
    diverge();
  }
  // Online: the same cross-tier rule the schedule validator enforces.
  for (int s = 0; s < kNumTiers; ++s) {
    const CopyInfo& o = res_.copy(b, static_cast<Tier>(s));
    if (s == index(t) || o.pins == 0) continue;
    if (writes(m) || o.write_pins > 0)
      throw std::invalid_argument("offload: block '" + res_.block(b).name + "' acquired on " + std::string(tier_name(t)) +
                                  " while acquired on " + std::string(tier_name(static_cast<Tier>(s))) +
                                  " and one of them writes it");
  }
  online_demand(b, t, m);
  size_t event = recording_.acquire(b, t, m);
  return finish_acquire(b, t, m, static_cast<uint32_t>(event));
}

void BlockManager::release(Handle& h, kernels::Stream* done_on, bool discard) {
  // Checked in every build: releasing a default or already-released handle would otherwise
  // unpin block 0 and drive its counts negative.
  if (h.mgr_ != this || open_handles_[h.block_] <= 0)
    throw std::logic_error("offload: release of a handle this manager did not hand out (default, or already released)");
  RtCopy& rc = rt_copy(h.block_, h.tier_);
  if (done_on) {
    std::shared_ptr<EventPart> part = events_for(*done_on).take();
    done_on->record(part->event());
    rc.users.add(Fence(part));
    if (writes(h.mode_)) rc.ready.add(Fence(part));  // readers on other streams see the writes
  }
  res_.release(h.block_, h.tier_, h.mode_);
  --open_handles_[h.block_];
  if (discard) res_.discard(h.block_);
  if (planned_) {
    const ScheduleEvent* e = cursor_ < prog().schedule.size() ? &prog().schedule.events()[cursor_] : nullptr;
    if (e && e->release && e->acquire_event == h.event_ && e->discard == discard) {
      apply_all(prog().plan->after[cursor_]);
      ++cursor_;
      h = Handle{};
      return;
    }
    diverge();
  }
  recording_.release(h.event_, discard);
  h = Handle{};
}

void BlockManager::write_back(BlockId b) {
  if (b >= res_.n_blocks()) throw std::out_of_range("offload: write_back of unknown block " + std::to_string(b));
  if (open_handles_[b] != 0)
    throw std::logic_error("offload: write_back of block '" + res_.block(b).name + "' while it is acquired");
  for (Tier t : {Tier::host, Tier::device}) {  // host first: the direct link to NVMe
    Effects fx = res_.write_back(b, t);
    for (const Move& m : fx.moves) issue(m, /*fresh_dst=*/false);
    if (!fx.moves.empty()) return;
  }
}

void BlockManager::discard(BlockId b) {
  if (b >= res_.n_blocks()) throw std::out_of_range("offload: discard of unknown block " + std::to_string(b));
  if (open_handles_[b] != 0)
    throw std::logic_error("offload: discard of block '" + res_.block(b).name + "' while it is acquired");
  res_.discard(b);
}

void BlockManager::zero(BlockId b) {
  if (b >= res_.n_blocks()) throw std::out_of_range("offload: zero of unknown block " + std::to_string(b));
  const BlockSpec& spec = res_.block(b);
  if (spec.home != Tier::nvme)
    throw std::invalid_argument("offload: zero of block '" + spec.name + "': only blocks homed on NVMe");
  for (int t = 0; t < kNumTiers; ++t)
    if (static_cast<Tier>(t) != spec.home && res_.copy(b, static_cast<Tier>(t)).present)
      throw std::logic_error("offload: zero of block '" + spec.name + "' while it has a copy on " +
                             std::string(tier_name(static_cast<Tier>(t))));
  RtCopy& home = rt_copy(b, Tier::nvme);
  // No I/O may be in flight on the range (an earlier write-back, a read): their outcome no
  // longer matters, only that they are done.
  home.ready.quiet().wait();
  home.users.quiet().wait();
  store_->zero(res_.copy(b, Tier::nvme).offset, align_up(spec.bytes));
  home = RtCopy{};
}

OffloadStats BlockManager::stats() const {
  OffloadStats s;
  {
    std::lock_guard lock(stats_mu_);
    s = stats_;
  }
  auto links = transfer_->link_stats();
  for (int i = 0; i < kNumLinks; ++i) s.links[i] = links[i];
  s.nvme_busy_ms = transfer_->nvme_busy_ms();
  for (int t = 0; t < kNumTiers; ++t) {
    const Arena& a = res_.arena(static_cast<Tier>(t));
    s.tiers[t] = {a.capacity(), a.used(), a.peak(), a.fragmentation()};
  }
  return s;
}

void BlockManager::drain() { transfer_->drain(); }

}  // namespace strata::offload
