// TieredMemory: the run's block table, the dry-run schedule, budget choice and checks, and the
// acquire path (host waits only for I/O, counted as stall; streams wait for events).
#include "src/train/tiered_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <functional>
#include <map>
#include <stdexcept>

#include "offload/planner.h"
#include "offload/size.h"
#include "src/train/faults.h"
#include "src/train/memory_remedies.h"
#include "src/train/step_driver.h"
#include "src/zero/step_program.h"

namespace strata {
using offload::BlockId;
using offload::Mode;
using offload::Tier;

bool Placement::uses_nvme() const {
  return params == Tier::nvme || grads == Tier::nvme || optimizer == Tier::nvme || activations == Tier::nvme;
}

offload::Tier parse_offload(const std::string& text, const std::string& flag) {
  if (text == "none") return Tier::device;
  if (text == "cpu") return Tier::host;
  if (text == "nvme") return Tier::nvme;
  throw std::invalid_argument(flag + " '" + text + "': expected none, cpu or nvme");
}

std::string offload_name(offload::Tier t) {
  switch (t) {
    case Tier::device: return "none";
    case Tier::host: return "cpu";
    case Tier::nvme: return "nvme";
  }
  return "?";
}

namespace {

constexpr uint64_t kUnbounded = uint64_t{1} << 60;
const char* const kRoleNames[kNumRoles] = {"params", "master", "adam", "grads", "activations"};

std::string gib(uint64_t b) { return offload::format_size(b); }

// Whether a run's pools (on the CPU backend the device pool is RAM too) fit what the host can
// still give: MemAvailable + free swap, `avail` (0 where it cannot be read: nothing is checked).
bool fits_in_ram(const MemoryPlan& mp, kernels::Backend backend, uint64_t& need, uint64_t& avail) {
  need = mp.budget[1] + (backend == kernels::Backend::cpu ? mp.budget[0] : 0);
  avail = host_memory_available();
  return !avail || need <= avail;
}

// Fault injection for the CLI tests (src/train/faults.h): io-read:N (or io-write:N) fails the
// N-th NVMe piece of that kind with EIO, as a failing disk would; io-flip:N flips one bit in the
// swap file(s) under the N-th written piece once it is on disk, as silent corruption would (the
// checksums, not this hook, must then catch it). `files` is filled in once the swap exists.
io::EngineOptions engine_options(std::shared_ptr<const std::vector<std::string>> files) {
  io::EngineOptions eo;
  const std::string& kind = faults().io;
  if (kind.empty()) return eo;
  const int64_t nth = faults().io_nth;
  auto seen = std::make_shared<std::atomic<int64_t>>(0);
  if (kind == "flip") {
    eo.completion_hook = [nth, seen, files](io::IoOp o, uint64_t offset, uint64_t length, int64_t result) -> int64_t {
      if (o != io::IoOp::write || result != static_cast<int64_t>(length) || ++*seen != nth) return result;
      const auto at = static_cast<off_t>(offset + length / 2);
      for (const std::string& f : *files) {  // the piece's file is not known here: flip it in each
        const int fd = ::open(f.c_str(), O_RDWR | O_CLOEXEC);
        if (fd < 0) continue;
        unsigned char byte = 0;
        if (::pread(fd, &byte, 1, at) == 1) {
          byte ^= 0x10;
          if (::pwrite(fd, &byte, 1, at) == 1) (void)::fdatasync(fd);
        }
        ::close(fd);
      }
      return result;
    };
    return eo;
  }
  const io::IoOp op = kind == "write" ? io::IoOp::write : io::IoOp::read;
  eo.completion_hook = [op, nth, seen](io::IoOp o, uint64_t, uint64_t, int64_t result) -> int64_t {
    if (o == op && ++*seen == nth) return -EIO;
    return result;
  };
  return eo;
}

}  // namespace

constexpr std::array<int, kNumUnitSlots> no_slots() {
  std::array<int, kNumUnitSlots> a{};
  a.fill(-1);
  return a;
}

// The block table: one block per (role, index), registered in this order by every user (the
// planner's simulation and the manager), so block ids agree.
struct TieredMemory::Layout {
  kernels::Backend backend = kernels::Backend::cpu;
  Placement placement;
  UnitTable units;
  bool master_is_weights = false;
  std::vector<offload::BlockSpec> specs;
  std::vector<int> role_of;                   // per block: its role (kNumRoles = a buffer)
  std::array<std::vector<int>, kNumRoles> ids;  // [role][index] -> block (-1: a frozen unit's absent state)
  int workspace = -1, extra = -1;
  std::array<int, kNumUnitSlots> grad_scratch = no_slots();  // stage 2: whole-unit grads (RunMemory::grad_scratch)
  std::array<int, kNumUnitSlots> gathered = no_slots();      // stage 3: whole-unit weights (RunMemory::gathered)
  std::array<int, 2> decoded{-1, -1};  // LoRA --base-dtype: a frozen layer decoded (RunMemory::decoded)
  // The schedules the manager plans: [step] one training step (the previous step's update inside
  // its forward), [update] a pending update on its own (before a save or checkpoint).
  std::array<offload::Schedule, 2 * kNumSchedules> schedules;  // (the second half: speculation's odd parity)
  uint64_t aside_host_bytes = 0;  // host room the asides need (GPU: the host homes + a unit staged through the host)

  Tier tier_of(int block, Side side) const {
    const Tier home = specs[static_cast<size_t>(block)].home;
    if (backend == kernels::Backend::cpu) return home == Tier::nvme ? Tier::host : home;  // the CPU reads host memory
    if (side == Side::host) return Tier::host;
    if (side == Side::compute || side == Side::comm) return Tier::device;
    return placement.optimizer == Tier::device ? Tier::device : Tier::host;  // AdamW on the GPU or on the CPU
  }
  // Speculative updates (Placement::speculate): the master and AdamW state have two copies
  // each; `parity` says which is current. Index u names unit u's current copy, u + n_units
  // (n_units = units.size()) its other copy, which an update writes and a flip makes current.
  bool two_copies() const { return units.two_copies(); }
  std::array<std::vector<int>, 2> other;  // [0] master, [1] adam: the second copies' blocks
  int block(Role r, int index, int parity = 0) const {
    if (two_copies() && (r == Role::master || r == Role::adam)) {
      const int n = static_cast<int>(units.size());
      const bool next = index >= n;
      const int u = next ? index - n : index;
      if (next != (parity != 0)) return other[r == Role::master ? 0 : 1].at(static_cast<size_t>(u));
      index = u;
    }
    const int b = ids[static_cast<size_t>(r)].at(static_cast<size_t>(index));
    if (b < 0)
      throw std::logic_error("TieredMemory: unit " + units[index].name + " has no " + kRoleNames[static_cast<int>(r)] +
                             " block (a frozen unit)");
    return b;
  }
  int add(std::string name, uint64_t bytes, Tier home, int role) {
    specs.push_back({std::move(name), std::max<uint64_t>(bytes, offload::kAlign), home});
    role_of.push_back(role);
    return static_cast<int>(specs.size() - 1);
  }
};

namespace {

// A dry RunMemory: the driver's acquires and releases become the step's schedule.
class ScheduleRecorder final : public RunMemory {
 public:
  ScheduleRecorder(const TieredMemory::Layout& layout, offload::Schedule& out, int parity = 0)
      : l_(layout), out_(out), parity_(parity) {}
  bool dry() const override { return true; }
  void* acquire(Role r, int index, Mode m, Side side) override {
    const int b = l_.block(r, index, parity_);
    open_[b] = out_.acquire(static_cast<BlockId>(b), l_.tier_of(b, side), m);
    return nullptr;
  }
  void release(Role r, int index) override { end(r, index, false); }
  void release_discard(Role r, int index) override { end(r, index, true); }
  bool master_is_weights() const override { return l_.master_is_weights; }
  const UnitTable& units() const override { return l_.units; }
  kernels::Stream& stream(Side) override { throw std::logic_error("dry run: no stream"); }
  kernels::Ops& ops(Side) override { throw std::logic_error("dry run: no ops"); }

 private:
  void end(Role r, int index, bool discard) {
    const int b = l_.block(r, index, parity_);
    out_.release(open_.at(b), discard);
    open_.erase(b);
  }
  const TieredMemory::Layout& l_;
  offload::Schedule& out_;
  int parity_;
  std::map<int, size_t> open_;
};

}  // namespace

namespace {

uint64_t homed_sum(const TieredMemory::Layout& l, Tier t) {
  uint64_t s = 0;
  for (const auto& b : l.specs)
    if (b.home == t) s += offload::align_up(b.bytes);
  return s;
}

}  // namespace

// The block table, and one step's schedule recorded by a dry run of the driver.
std::unique_ptr<TieredMemory::Layout> TieredMemory::build_layout(const Transformer& model, kernels::Backend backend,
                                                                 const Placement& pl, int64_t grad_accum,
                                                                 size_t extra_bytes) {
  auto l = std::make_unique<TieredMemory::Layout>();
  l->backend = backend;
  l->placement = pl;
  const Sharding& sh = pl.sharding;
  l->units = UnitTable(model, pl);
  const UnitTable& ut = l->units;
  l->master_is_weights = ut.master_is_weights();
  const size_t esz = kernels::dtype_size(model.dtype());
  for (auto& v : l->ids) v.clear();
  // Per unit, the blocks its entry lists, in the order weights, master (unless it is the
  // weights), adam, grads.
  for (int u = 0; u < static_cast<int>(ut.size()); ++u) {
    const UnitEntry& e = ut[u];
    for (Role r : {Role::params, Role::master, Role::adam, Role::grads}) {
      const UnitBlock& b = e.block(r);
      int id = -1;
      if (r == Role::master && e.master_is_weights)
        id = l->ids[static_cast<int>(Role::params)].back();
      else if (b.exists)
        id = l->add(e.name + "." + kRoleNames[static_cast<int>(r)], ut.bytes(r, u), b.home, static_cast<int>(r));
      l->ids[static_cast<int>(r)].push_back(id);
    }
  }
  // Speculation: a second master and AdamW block per trainable unit, on the same tier.
  if (l->two_copies())
    for (int u = 0; u < static_cast<int>(ut.size()); ++u)
      for (Role r : {Role::master, Role::adam}) {
        const UnitBlock& b = ut[u].block(r);
        l->other[r == Role::master ? 0 : 1].push_back(
            b.exists ? l->add(ut[u].name + "." + kRoleNames[static_cast<int>(r)] + ".next", ut.bytes(r, u), b.home,
                              static_cast<int>(r))
                     : -1);
      }
  // Each layer's kept input, per micro-batch slot (pipeline parallel: the stage's layers, in
  // each of the micro-batches in flight at once; RunMemory index slot · L + layer).
  const PipelineStage& stage = model.pipeline();
  for (int64_t slot = 0; slot < stage.slots; ++slot)
    for (int64_t layer = 0; layer < model.dims().L; ++layer)
      l->ids[static_cast<int>(Role::activations)].push_back(
          !model.holds_layer(layer)
              ? -1
              : l->add("input." + (slot > 0 ? std::to_string(slot) + "." : std::string()) + std::to_string(layer),
                       model.input_bytes(), model.checkpointing().at(layer) ? pl.activations : Tier::device,
                       static_cast<int>(Role::activations)));
  l->workspace = l->add("workspace", model.workspace_bytes(), Tier::device, kNumRoles);
  l->extra = l->add("step_buffers", extra_bytes, Tier::device, kNumRoles);
  // Buffers without a home of their own, in the device budget: one whole unit per slot (0 the
  // larger of the embedding and an untied head, 1 and 2 the largest other unit, 3 and 4 the
  // largest adapter unit), for the grads of the trainable units (stage 2) and the gathered
  // weights (stage 3).
  std::array<int64_t, kNumUnitSlots> most{}, most_trained{};
  for (size_t u = 0; u < model.units().size(); ++u) {
    const auto slot = static_cast<size_t>(unit_slot(model, static_cast<int>(u)));
    for (size_t s : {slot, slot == 1 || slot == 3 ? slot + 1 : slot}) {
      most[s] = std::max(most[s], model.units()[u].numel);
      if (ut[static_cast<int>(u)].trainable) most_trained[s] = std::max(most_trained[s], model.units()[u].numel);
    }
  }
  int64_t most_stored = 0;
  for (size_t u = 0; u < model.units().size(); ++u)
    if (model.stored_unit(static_cast<int>(u))) most_stored = std::max(most_stored, model.units()[u].numel);
  if (most_stored > 0)
    for (size_t slot = 0; slot < 2; ++slot)
      l->decoded[slot] = l->add("decoded." + std::to_string(slot), static_cast<uint64_t>(most_stored) * esz, Tier::device,
                                kNumRoles);
  for (size_t slot = 0; slot < kNumUnitSlots; ++slot) {
    if (sh.sharded_grads() && most_trained[slot] > 0)
      l->grad_scratch[slot] = l->add("grad_scratch." + std::to_string(slot),
                                     static_cast<uint64_t>(most_trained[slot]) * 4, Tier::device, kNumRoles);
    if (sh.sharded_weights() && most[slot] > 0)
      l->gathered[slot] = l->add("gathered." + std::to_string(slot), static_cast<uint64_t>(most[slot]) * esz,
                                 Tier::device, kNumRoles);
  }

  // The step's program, as the driver will run it: grad_accum micro-batches, the first with the
  // previous step's AdamW inside its forward (src/train/step_driver.h PendingUpdate), or the
  // last with this step's inside its backward (Placement::update_in_backward()).
  // With speculation, each schedule twice: the copies take turns being current (schedules
  // kNumSchedules + p run while the second copies are current).
  for (int parity = 0; parity < (l->two_copies() ? 2 : 1); ++parity) {
    const size_t at = parity ? kNumSchedules : 0;
    {
      ScheduleRecorder rec(*l, l->schedules[at + static_cast<size_t>(Schedule::step)], parity);
      StepDriver driver(const_cast<Transformer&>(model), rec, sh);
      const PendingUpdate update;
      const AdamWStep now;
      if (model.pipeline().on())  // the stage's 1F1B order, its update after it (Schedule::update)
        driver.pipeline_step({.micro_batches = grad_accum, .select = {}, .losses = {}, .embed_group = nullptr}, 1.f,
                             nullptr);
      else
        for (const MicroBatch& mb : StepProgram(grad_accum, pl))
          driver.micro_batch(mb, nullptr, nullptr, 1.f, nullptr, &update, &now);
    }
    {
      ScheduleRecorder rec(*l, l->schedules[at + static_cast<size_t>(Schedule::update)], parity);
      StepDriver(const_cast<Transformer&>(model), rec, sh).optimizer(AdamWStep{});
    }
    if (l->two_copies())  // the step that waits for the norm, and the rerun, over the same two copies
      for (Schedule which : {Schedule::plain, Schedule::rerun}) {
        ScheduleRecorder rec(*l, l->schedules[at + static_cast<size_t>(which)], parity);
        StepDriver driver(const_cast<Transformer&>(model), rec, sh);
        const PendingUpdate update{.st = {}, .apply = false, .restore = which == Schedule::rerun};
        for (const MicroBatch& mb : StepProgram(grad_accum, /*update_in_backward=*/false))
          driver.micro_batch(mb, nullptr, nullptr, 1.f, nullptr, &update, nullptr);
      }
  }
  // With two copies, a step that ends in a flip (a step, a flush, a step that waits) is followed
  // by one where the copies have traded roles: the planner keeps the copy that will be read.
  if (l->two_copies()) {
    std::vector<offload::BlockId> swap(l->specs.size());
    for (size_t b = 0; b < swap.size(); ++b) swap[b] = static_cast<offload::BlockId>(b);
    for (int k = 0; k < 2; ++k) {
      const auto& now = l->ids[static_cast<size_t>(k == 0 ? Role::master : Role::adam)];
      for (size_t u = 0; u < now.size(); ++u)
        if (const int other = l->other[static_cast<size_t>(k)][u]; other >= 0 && now[u] >= 0) {
          swap[static_cast<size_t>(now[u])] = static_cast<offload::BlockId>(other);
          swap[static_cast<size_t>(other)] = static_cast<offload::BlockId>(now[u]);
        }
    }
    for (size_t at : {size_t{0}, size_t{kNumSchedules}})
      for (Schedule which : {Schedule::step, Schedule::update, Schedule::plain})
        l->schedules[at + static_cast<size_t>(which)].set_successor(swap);
  }
  for (const auto& p : l->schedules) p.validate(l->specs.size());
  // Initialising and saving stage one unit's master, weights and AdamW state through host memory
  // (on the CPU backend the device memory is host memory already): the host holds its home
  // copies and, next to them, the unit's blocks that live elsewhere (the GPU's first offloaded
  // run failed when the budget was only the homes).
  if (backend != kernels::Backend::cpu) {
    uint64_t staged = 0;
    for (size_t u = 0; u < model.units().size(); ++u) {
      uint64_t b = 0;
      for (Role r : {Role::params, Role::master, Role::adam}) {
        const int id = l->ids[static_cast<int>(r)][u];
        if (id < 0) continue;  // a frozen unit's
        const auto& spec = l->specs[static_cast<size_t>(id)];
        if (spec.home != Tier::host) b += offload::align_up(spec.bytes);
      }
      staged = std::max(staged, b);
    }
    l->aside_host_bytes = homed_sum(*l, Tier::host) + staged;
  }
  return l;
}

MemoryPlan TieredMemory::plan(const Transformer& model, kernels::Backend backend, const Placement& pl,
                              int64_t grad_accum, size_t extra_device_bytes, bool minimums) {
  auto l = build_layout(model, backend, pl, grad_accum, extra_device_bytes);
  MemoryPlan mp;
  for (size_t b = 0; b < l->specs.size(); ++b)
    mp.homed[offload::index(l->specs[b].home)][static_cast<size_t>(l->role_of[b])] +=
        offload::align_up(l->specs[b].bytes);
  // Working sets with nothing bounded: the budgets above which nothing is ever evicted.
  const uint64_t nvme = homed_sum(*l, Tier::nvme);
  offload::Residency roomy({kUnbounded, kUnbounded, nvme});
  for (const auto& spec : l->specs) roomy.add_block(spec);
  for (int t = 0; t < offload::kNumTiers; ++t)
    for (const auto& p : l->schedules)
      mp.working_set[t] = std::max(mp.working_set[t], offload::working_set_bytes(roomy, p, static_cast<Tier>(t)));
  mp.working_set[1] = std::max(mp.working_set[1], l->aside_host_bytes);

  // Budgets: as given, else the working set (on the CPU backend both pools are RAM: the host
  // pool takes at most what RAM has left after the device pool, minus a quarter for the OS).
  auto& budget = mp.budget;
  const uint64_t align = offload::kAlign;
  budget[0] = pl.device_mem ? pl.device_mem / align * align : mp.working_set[0];
  if (pl.host_mem) {
    budget[1] = pl.host_mem / align * align;
  } else {
    budget[1] = mp.working_set[1];
    const uint64_t ram = physical_ram() / 4 * 3;
    const uint64_t used = backend == kernels::Backend::cpu ? budget[0] : 0;
    if (ram > used && budget[1] > ram - used) budget[1] = (ram - used) / align * align;
  }
  budget[0] = std::min(budget[0], mp.working_set[0]);  // a pool is never larger than its use
  budget[1] = std::min(budget[1], mp.working_set[1]);
  budget[2] = nvme;

  // A tier too small is named with the smallest budget at which every schedule runs (the other
  // tiers roomy), also when it cannot even hold its home copies: naming only the home copy that
  // overflows it would name a budget that fails again at the next.
  const bool checkpointing = model.checkpointing().any();
  const auto hints = [&](Tier t) {
    return remedies(mp.homed[offload::index(t)], std::string(offload::tier_name(t)) + " memory", checkpointing,
                    moves_off(t, pl, checkpointing));
  };
  if (budget[1] < l->aside_host_bytes) {
    const uint64_t need = std::max(
        l->aside_host_bytes, offload::min_budget(roomy.cold(mp.working_set), l->schedules, Tier::host));
    throw offload::BudgetError("the placement does not fit: host budget " + offload::format_size(budget[1]) +
                                   " cannot hold its home copies and stage one unit next to them (" +
                                   offload::format_size(l->aside_host_bytes) +
                                   ") to initialise, load or save it; raise --host-mem to at least " +
                                   offload::format_size(need) + " (" + std::to_string(need) + " bytes)" +
                                   hints(Tier::host),
                               Tier::host, budget[1], need);
  }
  try {
    offload::check_budgets(roomy, budget, l->schedules);
  } catch (const offload::BudgetError& e) {
    throw offload::BudgetError(std::string("the placement does not fit: ") + e.what() + hints(e.tier()),
                               e.tier(), e.budget(), e.minimum());
  }
  const offload::Residency cold = roomy.cold(budget);
  // What a step moves once the run is under way: the first step starts cold (home copies only),
  // every later one from where the previous ended, so plan a second step from the first's end
  // state (the first alone under-counts by ~10% on NVMe-heavy placements).
  const offload::Schedule& step = l->schedules[static_cast<int>(Schedule::step)];
  auto cands = offload::candidate_plans(cold, step);
  if (!cands.empty()) {
    offload::Residency end = cold;
    offload::simulate(cold, step, cands.front().options, &end);
    auto steady = offload::candidate_plans(end, step);
    const offload::Plan& pick = steady.empty() ? cands.front() : steady.front();
    mp.link_bytes = pick.link_bytes;
    mp.policy = pick.name();
  }
  if (minimums)  // each with the other tier at its budget; every schedule must run
    for (Tier t : {Tier::device, Tier::host}) mp.minimum[offload::index(t)] = offload::min_budget(cold, l->schedules, t);
  mp.minimum[1] = std::max(mp.minimum[1], l->aside_host_bytes);
  return mp;
}

bool TieredMemory::fits(const Transformer& model, kernels::Backend backend, const Placement& placement,
                        int64_t grad_accum, size_t extra_device_bytes) {
  MemoryPlan mp;
  try {
    mp = plan(model, backend, placement, grad_accum, extra_device_bytes);
  } catch (const offload::BudgetError&) {
    return false;
  }
  uint64_t need = 0, avail = 0;
  return fits_in_ram(mp, backend, need, avail);
}

BarrierBound barrier_bound(const MemoryPlan& mp, kernels::Backend backend, double window_compute_ms, double rest_ms,
                           const offload::LinkRates& rates) {
  BarrierBound b;
  const auto& nvme = mp.homed[offload::index(Tier::nvme)];
  const auto role = [&](Role r) { return nvme[static_cast<size_t>(r)]; };
  b.read_bytes = role(Role::master) + role(Role::adam) + role(Role::grads);
  b.write_bytes = role(Role::master) + role(Role::adam) + role(Role::params);
  const auto free_of_homes = [&](Tier t) {
    uint64_t homed = 0;
    for (uint64_t x : mp.homed[offload::index(t)]) homed += x;
    const uint64_t budget = mp.budget[offload::index(t)];
    return budget > homed ? budget - homed : 0;
  };
  // On the CPU backend an NVMe-homed block is only ever copied to the host tier.
  b.room = free_of_homes(Tier::host) + (backend == kernels::Backend::cpu ? 0 : free_of_homes(Tier::device));
  const auto ms = [](uint64_t bytes, double per_ms) { return per_ms > 0 ? static_cast<double>(bytes) / per_ms : 0.0; };
  const uint64_t reads = b.read_bytes > b.room ? b.read_bytes - b.room : 0;
  const uint64_t writes = b.write_bytes > b.room ? b.write_bytes - b.room : 0;
  b.window_compute_ms = window_compute_ms;
  b.window_io_ms = ms(reads, rates.nvme_read) + ms(writes, rates.nvme_write);
  b.step_ms = rest_ms + std::max(window_compute_ms, b.window_io_ms);
  if (b.window_io_ms > window_compute_ms)
    b.ms_per_gib = (reads ? ms(1ull << 30, rates.nvme_read) : 0) + (writes ? ms(1ull << 30, rates.nvme_write) : 0);
  return b;
}

offload::StepTimeline TieredMemory::estimate(const Transformer& model, kernels::Backend backend, const Placement& pl,
                                             int64_t grad_accum, size_t extra_device_bytes,
                                             const std::array<uint64_t, offload::kNumTiers>& budget, const StepCosts& c) {
  auto l = build_layout(model, backend, pl, grad_accum, extra_device_bytes);
  offload::Residency state(budget);
  for (const auto& spec : l->specs) state.add_block(spec);
  // Each phase's compute runs where the driver turns from acquiring its blocks to releasing
  // them; what it is follows from the blocks it holds.
  const offload::Schedule& step = l->schedules[static_cast<int>(Schedule::step)];
  const auto& ev = step.events();
  std::vector<int> unit_of(l->specs.size(), -1);
  for (int r : {static_cast<int>(Role::params), static_cast<int>(Role::grads), static_cast<int>(Role::adam)})
    for (size_t u = 0; u < l->ids[static_cast<size_t>(r)].size(); ++u)
      if (const int id = l->ids[static_cast<size_t>(r)][u]; id >= 0)
        unit_of[static_cast<size_t>(id)] = static_cast<int>(u);
  for (size_t u = 0; u < l->other[1].size(); ++u)
    if (const int id = l->other[1][u]; id >= 0) unit_of[static_cast<size_t>(id)] = static_cast<int>(u);
  std::vector<int> layer_of(model.units().size(), -1);
  for (int64_t layer = 0; layer < model.dims().L; ++layer) {
    layer_of[static_cast<size_t>(model.block_unit(layer))] = static_cast<int>(layer);
    if (model.lora()) layer_of[static_cast<size_t>(model.lora_unit(layer))] = static_cast<int>(layer);
  }
  const PhaseTimes& t = c.phases;
  std::vector<double> cost(ev.size(), 0.0);
  std::vector<offload::BlockId> open;
  for (size_t i = 0; i < ev.size(); ++i) {
    if (ev[i].release) {
      open.erase(std::find(open.begin(), open.end(), ev[i].block));
      continue;
    }
    open.push_back(ev[i].block);
    if (i + 1 < ev.size() && !ev[i + 1].release) continue;
    double ms = 0;
    bool adam = false, grads = false, weights = false, head = false;
    int layer = -1;
    for (offload::BlockId b : open) {
      const int role = l->role_of[b], u = unit_of[b];
      // The head phase (under LoRA the final norm and head are frozen: no grads open there).
      if (role == static_cast<int>(Role::params) && u == model.final_norm_unit()) head = true;
      if (role == static_cast<int>(Role::adam)) {
        adam = true;
        ms += static_cast<double>(l->specs[b].bytes / 8) / std::max(c.adamw_params_per_ms, 1e-9);
      }
      if (role == static_cast<int>(Role::grads)) grads = true;
      if (role == static_cast<int>(Role::params)) weights = true;
      if (u >= 0 && layer_of[static_cast<size_t>(u)] >= 0) layer = layer_of[static_cast<size_t>(u)];
    }
    if (!adam && layer >= 0 && grads)  // a block's backward, its forward first when checkpointed
      ms = t.block_backward_ms + (model.checkpointing().at(layer) ? t.block_forward_ms : 0) +
           t.sum_squares_ms / static_cast<double>(grad_accum);
    else if (!adam && layer >= 0 && weights)
      ms = t.block_forward_ms;
    else if (!adam && layer < 0 && (grads || head) && open.size() > 1)  // the head (with the edges' share)
      ms = t.edge_ms + t.edge_sum_squares_ms / static_cast<double>(grad_accum);
    cost[i] = ms;
  }
  return offload::estimate_step(state, step, cost, c.links);
}

TieredMemory::TieredMemory(Transformer& model, kernels::Runtime& rt, kernels::Stream& compute,
                           kernels::Runtime& opt_rt, kernels::Stream& opt_stream, const Placement& placement,
                           int64_t grad_accum, size_t extra_device_bytes, kernels::Stream* comm)
    : model_(model),
      rt_(rt),
      compute_(compute),
      opt_rt_(opt_rt),
      opt_stream_(opt_stream),
      comm_(comm),
      placement_(placement) {
  plan_ = plan(model, rt.info().backend, placement, grad_accum, extra_device_bytes);
  // The pools in RAM (on the CPU backend the device pool is RAM too) must fit what the host
  // has, checked before anything is allocated: past it the run would swap the machine to a
  // standstill or be killed by the OOM killer with no message.
  const bool cpu = rt.info().backend == kernels::Backend::cpu;
  if (uint64_t ram_need = 0, avail = 0; !fits_in_ram(plan_, rt.info().backend, ram_need, avail)) {
    // What the RAM holds, by kind: the remedy depends on which is largest.
    Homed in_ram = plan_.homed[offload::index(Tier::host)];
    if (cpu)
      for (size_t r = 0; r < in_ram.size(); ++r) in_ram[r] += plan_.homed[offload::index(Tier::device)][r];
    const bool checkpointing = model.checkpointing().any();
    std::vector<std::string> to_disk;
    for (auto [flag, tier] : {std::pair{"--offload-optimizer", placement.optimizer},
                              std::pair{"--offload-grads", placement.grads}, std::pair{"--offload-params", placement.params}})
      if (tier != Tier::nvme) to_disk.push_back(std::string(flag) + " nvme");
    if (checkpointing && placement.activations != Tier::nvme) to_disk.push_back("--offload-activations nvme");
    if (!checkpointing) to_disk.push_back("--checkpoint-activations full");
    throw std::runtime_error(
        "the run does not fit in host memory: " + std::to_string(model.n_params()) + " parameters and their " +
        "activations need " + gib(ram_need) + " of RAM (" +
        (cpu ? "device pool " + gib(plan_.budget[0]) + " + " : std::string()) + "host pool " +
        gib(plan_.budget[1]) + "), but this machine has " + gib(avail) + " available (MemAvailable + free swap)" +
        remedies(in_ram, "it", checkpointing, to_disk) + (to_disk.empty() ? "" : " (with --nvme-path DIR)") +
        "; or use a smaller model");
  }
  layout_ = build_layout(model, rt.info().backend, placement, grad_accum, extra_device_bytes);
  master_is_weights_ = layout_->master_is_weights;

  std::unique_ptr<offload::NvmeStore> store;
  if (plan_.budget[2] > 0) {
    if (placement.nvme_paths.empty())
      throw std::invalid_argument("an --offload-* flag puts state on NVMe but no --nvme-path DIR was given");
    auto files = std::make_shared<std::vector<std::string>>();
    engine_ = io::make_engine(engine_options(files));
    io::SwapOptions so;
    so.paths = placement.nvme_paths;
    so.allow_buffered = true;  // a filesystem without O_DIRECT (tmpfs) still works, with a warning
    so.checksums = true;       // every NVMe read is verified: corrupt state is an error, not training data
    swap_ = std::make_unique<io::SwapSpace>(so, *engine_);
    *files = swap_->files();
    store = offload::make_swap_store(*swap_, plan_.budget[2]);
  }
  offload::ManagerConfig mc;
  mc.device_bytes = plan_.budget[0];
  mc.host_bytes = plan_.budget[1];
  mgr_ = std::make_unique<offload::BlockManager>(rt, mc, std::move(store));
  for (const auto& spec : layout_->specs) mgr_->add_block(spec.name, spec.bytes, spec.home);
  for (int p = 0; p < (layout_->two_copies() ? 2 : 1) * kNumSchedules; ++p)
    if (!layout_->schedules[static_cast<size_t>(p)].empty())
      mgr_->set_schedule(p, layout_->schedules[static_cast<size_t>(p)]);
  open_.resize(layout_->specs.size());
  open_side_.assign(layout_->specs.size(), Side::compute);
  model.bind_workspace(compute, mgr_->home_data(static_cast<BlockId>(layout_->workspace)));
  extra_ = mgr_->home_data(static_cast<BlockId>(layout_->extra));
  for (size_t slot = 0; slot < kNumUnitSlots; ++slot) {
    if (layout_->grad_scratch[slot] >= 0)
      grad_scratch_[slot] = static_cast<float*>(mgr_->home_data(static_cast<BlockId>(layout_->grad_scratch[slot])));
    if (layout_->gathered[slot] >= 0) gathered_[slot] = mgr_->home_data(static_cast<BlockId>(layout_->gathered[slot]));
  }
  for (size_t slot = 0; slot < 2; ++slot)
    if (layout_->decoded[slot] >= 0) decoded_[slot] = mgr_->home_data(static_cast<BlockId>(layout_->decoded[slot]));
  compute.synchronize();
}

TieredMemory::~TieredMemory() {
  // A step that failed on the host (an NVMe read error, say) can leave the streams running
  // ahead, with kernels queued that write into these pools: they finish first.
  kernels::settle(compute_);
  kernels::settle(opt_stream_);
  if (comm_) kernels::settle(*comm_);
  if (mgr_) mgr_->drain();
}

offload::Tier TieredMemory::tier_of(Role r, int index, Side side) const {
  return layout_->tier_of(layout_->block(r, index, parity_), side);
}

void* TieredMemory::acquire(Role r, int index, Mode m, Side side) {
  const int b = layout_->block(r, index, parity_);
  if (open_[static_cast<size_t>(b)])
    throw std::logic_error(std::string("TieredMemory: ") + kRoleNames[static_cast<int>(r)] + " " +
                           std::to_string(index) + " acquired twice");
  offload::Handle h = mgr_->acquire(static_cast<BlockId>(b), layout_->tier_of(b, side), m);
  if (side == Side::host) {
    h.wait();  // host code touches it next
    void* p = h.data();
    open_[static_cast<size_t>(b)] = std::move(h);
    open_side_[static_cast<size_t>(b)] = side;
    return p;
  }
  kernels::Stream& s = stream(side);
  if (!h.host_ready()) {
    // The bytes are still coming from NVMe: let the stream finish what it has, so the wait
    // from here is time compute really waits (stall), not run-ahead.
    s.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    h.wait_host();
    stall_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  } else {
    h.wait_host();  // completed: rethrows a failed move
  }
  h.wait_on(s);
  void* p = h.data();
  open_[static_cast<size_t>(b)] = std::move(h);
  open_side_[static_cast<size_t>(b)] = side;
  return p;
}

void TieredMemory::write_back(Role r, int index) {
  mgr_->write_back(static_cast<BlockId>(layout_->block(r, index, parity_)));
}

void TieredMemory::zero(Role r, int index) {
  const auto b = static_cast<BlockId>(layout_->block(r, index, parity_));
  bool only_home = true;
  for (Tier t : {Tier::device, Tier::host}) only_home = only_home && !mgr_->residency().copy(b, t).present;
  if (mgr_->block(b).home == Tier::nvme && only_home) return mgr_->zero(b);
  void* p = acquire(r, index, Mode::write, Side::host);
  std::memset(p, 0, mgr_->block(b).bytes);
  release(r, index);
  write_back(r, index);
}

void TieredMemory::release(Role r, int index) { end(r, index, false); }
void TieredMemory::release_discard(Role r, int index) { end(r, index, true); }

void TieredMemory::end(Role r, int index, bool discard) {
  const int b = layout_->block(r, index, parity_);
  offload::Handle& h = open_[static_cast<size_t>(b)];
  const Side side = open_side_[static_cast<size_t>(b)];
  mgr_->release(h, side == Side::host ? nullptr : &stream(side), discard);
}

void TieredMemory::handoff(Role r, int index, Side to) {
  const int b = layout_->block(r, index, parity_);
  if (!open_[static_cast<size_t>(b)])
    throw std::logic_error(std::string("TieredMemory: handoff of ") + kRoleNames[static_cast<int>(r)] + " " +
                           std::to_string(index) + ", which is not acquired");
  if (to == Side::host) throw std::logic_error("TieredMemory: a block is handed to a stream, not to the host");
  open_side_[static_cast<size_t>(b)] = to;
}

const UnitTable& TieredMemory::units() const { return layout_->units; }

void TieredMemory::begin_step(Schedule p) {
  const int at = p == Schedule::aside ? offload::BlockManager::kAside
                                      : static_cast<int>(p) + (parity_ ? kNumSchedules : 0);
  mgr_->begin_step(at);
}

void TieredMemory::flip() {
  if (!layout_->two_copies()) throw std::logic_error("TieredMemory::flip: no second copies (speculation is off)");
  parity_ ^= 1;
  // The copies that were current are dead now: the next update writes them whole before
  // anything reads them (a rollback, a flush, a save read the current ones). A dirty copy of
  // theirs still in memory is dropped, not written home.
  const int n = static_cast<int>(layout_->units.size());
  for (int k = 0; k < 2; ++k)
    for (int u = 0; u < n; ++u)
      if (layout_->other[static_cast<size_t>(k)].at(static_cast<size_t>(u)) >= 0)
        mgr_->discard(static_cast<BlockId>(layout_->block(k == 0 ? Role::master : Role::adam, u + n, parity_)));
}

offload::OffloadStats TieredMemory::stats() const {
  offload::OffloadStats s = mgr_->stats();
  if (swap_) s.checksum_ms = swap_->stats().checksum_ms;
  return s;
}

std::vector<std::string> TieredMemory::swap_files() const { return swap_ ? swap_->files() : std::vector<std::string>{}; }

}  // namespace strata
