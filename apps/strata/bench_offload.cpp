// `strata bench offload`: replays synthetic training-like schedules through the BlockManager with
// units homed on NVMe and a small pinned host budget, and prints one JSON line per schedule:
// step time against the floor max(compute, NVMe transfer at the measured bandwidth), and bytes
// moved by the planner against plain LRU on the same schedule and budget.
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/strata/commands.h"
#include "io/engine.h"
#include "io/swap_space.h"
#include "kernels/runtime.h"
#include "offload/manager.h"
#include "offload/size.h"
#include "src/checked.h"

namespace strata::app {
namespace {

using Clock = std::chrono::steady_clock;
namespace off = strata::offload;

struct BenchOptions {
  std::vector<std::string> nvme_paths;
  std::string unit_size = "16M";
  int units = 16;
  int host_units = 4;
  double compute_ms = 0;  // per unit access; 0: the NVMe time of one unit read (balanced)
  int steps = 3;
  std::string engine = "auto";
};

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// The compute of one unit: a calibrated busy loop (spins on the clock, so it is exact on a
// loaded machine too; it stands in for a matmul of known duration).
void compute_for(double ms) {
  auto t0 = Clock::now();
  volatile uint64_t x = 0;
  while (ms_since(t0) < ms) x = x + 1;
}

struct Bandwidth {
  double read_gbps = 0, write_gbps = 0;
};

// The NVMe bandwidth this run can expect: whole units written, then read 4 at a time, through
// the same engine and swap path as the manager.
Bandwidth measure_nvme(io::SwapSpace& space, uint64_t unit, int units) {
  io::Extent e = space.allocate(unit * static_cast<uint64_t>(units));
  io::AlignedBuffer buf(unit * 4);
  std::memset(buf.data(), 0x5a, buf.size());
  Bandwidth bw;
  auto pass = [&](bool write) {
    auto t0 = Clock::now();
    std::deque<io::IoHandle> inflight;
    for (int u = 0; u < units; ++u) {
      if (inflight.size() == 4) {
        inflight.front().wait();
        inflight.pop_front();
      }
      char* p = buf.as<char>() + (static_cast<uint64_t>(u) % 4) * unit;
      uint64_t off = static_cast<uint64_t>(u) * unit;
      inflight.push_back(write ? space.write(e, off, unit, p) : space.read(e, off, unit, p));
    }
    for (auto& h : inflight) h.wait();
    return static_cast<double>(unit) * units / (ms_since(t0) * 1e6);
  };
  bw.write_gbps = pass(true);
  bw.read_gbps = pass(false);
  space.free(e);
  return bw;
}

struct Workload {
  std::string name;
  std::vector<off::BlockSpec> blocks;
  off::Schedule schedule;
  uint64_t host_bytes;
  int compute_units;           // unit computations per step
  std::vector<char> computes;  // [event]: a unit of compute runs after this acquire
  void use(off::BlockId b, off::Mode m, bool compute) {
    schedule.use(b, off::Tier::host, m);
    computes.resize(schedule.size());
    computes[schedule.size() - 2] = compute;
  }
  size_t acquire(off::BlockId b, off::Mode m, bool compute) {
    size_t i = schedule.acquire(b, off::Tier::host, m);
    computes.resize(schedule.size());
    computes[i] = compute;
    return i;
  }
  void release(size_t i) {
    schedule.release(i);
    computes.resize(schedule.size());
  }
};

// Forward over units 0..N-1, then backward N-1..0, reading each unit's parameters.
Workload forward_backward(uint64_t unit, int n, int host_units) {
  Workload w{"fwd_bwd_nvme", {}, {}, unit * static_cast<uint64_t>(host_units), 2 * n, {}};
  for (int i = 0; i < n; ++i) w.blocks.push_back({"unit" + std::to_string(i), unit, off::Tier::nvme});
  for (int i = 0; i < n; ++i) w.use(static_cast<off::BlockId>(i), off::Mode::read, true);
  for (int i = n - 1; i >= 0; --i) w.use(static_cast<off::BlockId>(i), off::Mode::read, true);
  return w;
}

// A ZeRO-3 step with everything on NVMe: per unit bf16 params P (S), grads G (S) and fp32
// optimizer states O (2S here: master, m, v shards of a smaller unit). Forward reads P; backward
// reads P and writes G; the optimizer updates O from G and writes the new P.
Workload zero3_mixed(uint64_t unit, int n, int host_units) {
  Workload w{"zero3_mixed_nvme", {}, {}, unit * static_cast<uint64_t>(host_units), 3 * n, {}};
  for (int i = 0; i < n; ++i) {
    w.blocks.push_back({"P" + std::to_string(i), unit, off::Tier::nvme});
    w.blocks.push_back({"G" + std::to_string(i), unit, off::Tier::nvme});
    w.blocks.push_back({"O" + std::to_string(i), 2 * unit, off::Tier::nvme});
  }
  auto P = [](int i) { return static_cast<off::BlockId>(3 * i); };
  auto G = [](int i) { return static_cast<off::BlockId>(3 * i + 1); };
  auto O = [](int i) { return static_cast<off::BlockId>(3 * i + 2); };
  for (int i = 0; i < n; ++i) w.use(P(i), off::Mode::read, true);  // forward
  for (int i = n - 1; i >= 0; --i) {                                  // backward
    size_t p = w.acquire(P(i), off::Mode::read, false);
    size_t g = w.acquire(G(i), off::Mode::write, true);
    w.release(p);
    w.release(g);
  }
  for (int i = 0; i < n; ++i) {  // optimizer: O += f(G), then P = cast(O)
    size_t o = w.acquire(O(i), off::Mode::read_write, false);
    size_t g = w.acquire(G(i), off::Mode::read, true);
    w.release(g);
    size_t p = w.acquire(P(i), off::Mode::write, false);
    w.release(p);
    w.release(o);
  }
  return w;
}

nlohmann::json run_workload(const Workload& w, const BenchOptions& o, io::SwapSpace& space, Bandwidth bw,
                            double unit_read_ms) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  uint64_t nvme_bytes = 0;
  for (const auto& b : w.blocks) nvme_bytes += off::align_up(b.bytes);
  off::ManagerConfig cfg;
  cfg.host_bytes = w.host_bytes;
  off::BlockManager mgr(*rt, cfg, off::make_swap_store(space, nvme_bytes));
  for (const auto& b : w.blocks) mgr.add_block(b.name, b.bytes, b.home);
  // Initial contents: every block written once through host (evictions write them to NVMe).
  mgr.begin_step();
  for (off::BlockId b = 0; b < w.blocks.size(); ++b) {
    off::Handle h = mgr.acquire(b, off::Tier::host, off::Mode::write);
    h.wait();
    std::memset(h.data(), static_cast<int>(b), h.bytes());
    mgr.release(h);
  }
  mgr.end_step();
  mgr.set_schedule(w.schedule);

  double compute_ms = o.compute_ms > 0 ? o.compute_ms : unit_read_ms;
  double compute_spent_ms = 0;  // wall time actually spent computing (a loaded machine overshoots)
  auto step = [&] {
    mgr.begin_step();
    std::vector<off::Handle> held(w.schedule.size());
    for (size_t i = 0; i < w.schedule.size(); ++i) {
      const auto& e = w.schedule.events()[i];
      if (e.release) {
        mgr.release(held[e.acquire_event]);
        continue;
      }
      held[i] = mgr.acquire(e.block, e.tier, e.mode);
      held[i].wait();
      if (w.computes[i]) {
        auto c0 = Clock::now();
        compute_for(compute_ms);
        compute_spent_ms += ms_since(c0);
      }
    }
    mgr.end_step();
  };
  step();  // warm-up: the plan settles into its steady state
  mgr.drain();
  off::OffloadStats s0 = mgr.stats();
  compute_spent_ms = 0;
  auto t0 = Clock::now();
  for (int k = 0; k < o.steps; ++k) step();
  mgr.drain();
  double step_ms = ms_since(t0) / o.steps;
  off::OffloadStats s1 = mgr.stats();

  auto per_step = [&](off::Link l) {
    return static_cast<double>(s1.link(l).bytes - s0.link(l).bytes) / o.steps;
  };
  double read_bytes = per_step(off::Link::nvme_to_host), write_bytes = per_step(off::Link::host_to_nvme);
  double io_ms = read_bytes / (bw.read_gbps * 1e6) + write_bytes / (bw.write_gbps * 1e6);
  double total_compute_ms = compute_ms * w.compute_units;

  // Planner vs plain LRU on the same schedule, budget and starting placement (the steady state):
  // the manager simulates both when it plans.

  nlohmann::json j;
  j["bench"] = "offload";
  j["name"] = w.name;
  j["units"] = o.units;
  j["unit_bytes"] = w.blocks.front().bytes;
  j["host_budget_bytes"] = w.host_bytes;
  j["step_ms"] = step_ms;
  j["compute_ms"] = total_compute_ms;
  j["io_ms"] = io_ms;
  j["floor_ms"] = std::max(total_compute_ms, io_ms);
  j["over_floor"] = step_ms / std::max(total_compute_ms, io_ms);
  // The same against the compute time the busy loop really took (preemption on a shared machine).
  double spent = compute_spent_ms / o.steps;
  j["compute_spent_ms"] = spent;
  j["over_floor_spent"] = step_ms / std::max(spent, io_ms);
  j["stall_ms"] = (s1.ms_stalled - s0.ms_stalled) / o.steps;
  j["nvme_read_bytes"] = read_bytes;
  j["nvme_write_bytes"] = write_bytes;
  j["nvme_read_gbps"] = bw.read_gbps;
  j["nvme_write_gbps"] = bw.write_gbps;
  j["policy"] = s1.policy;
  j["planner_bytes"] = s1.planned_bytes;
  j["lru_bytes"] = s1.lru_bytes;
  j["measured_bytes"] = (s1.bytes_moved() - s0.bytes_moved()) / static_cast<uint64_t>(o.steps);
  j["host_peak_bytes"] = s1.tiers[1].bytes_peak;
  j["cold_restarts"] = s1.cold_restarts;
  j["plans_computed"] = s1.plans;  // a steady step reuses its plan (same start placement)
  j["engine"] = io::to_string(space.engine().kind());
  return j;
}

// The most bytes a workload's schedule holds in host memory at once, in units (rounded up): the
// smallest --host-units at which it can run.
int peak_units_held(const Workload& w, uint64_t unit) {
  uint64_t held = 0, peak = 0;
  const auto& ev = w.schedule.events();
  for (const auto& e : ev) {
    const uint64_t bytes = off::align_up(w.blocks[e.block].bytes);
    if (e.release) {
      held -= bytes;
    } else {
      held += bytes;
      peak = std::max(peak, held);
    }
  }
  return static_cast<int>((peak + unit - 1) / unit);
}

int run_bench(const BenchOptions& o) {
  if (o.nvme_paths.empty()) throw std::invalid_argument("bench offload: --nvme-path DIR is required");
  if (o.units < 1 || o.units > (1 << 20))
    throw std::invalid_argument("bench offload: --units " + std::to_string(o.units) + ": give 1 to 1048576 units");
  if (o.steps < 1 || o.steps > 1000000)
    throw std::invalid_argument("bench offload: --steps " + std::to_string(o.steps) + ": must be in [1, 1000000]");
  if (!(std::isfinite(o.compute_ms) && o.compute_ms >= 0 && o.compute_ms <= 60000))
    throw std::invalid_argument("bench offload: --compute-ms " + std::to_string(o.compute_ms) +
                                ": must be a finite number of milliseconds in [0, 60000]");
  uint64_t unit = 0;
  try {
    unit = off::parse_size(o.unit_size);
  } catch (const std::exception& e) {
    throw std::invalid_argument(std::string("bench offload: --unit-size: ") + e.what());
  }
  if (unit == 0 || unit > (uint64_t{1} << 50))
    throw std::invalid_argument("bench offload: --unit-size " + o.unit_size + ": must be between 1 byte and 1P");
  unit = off::align_up(unit);
  // Every workload must run at the --host-units given: its schedule's peak, checked here (the
  // manager would only fail in the middle of the run, naming a budget flag this bench lacks).
  int min_host_units = 1;
  for (const Workload& w : {forward_backward(unit, o.units, 1), zero3_mixed(unit, o.units, 1)})
    min_host_units = std::max(min_host_units, peak_units_held(w, unit));
  if (o.host_units < min_host_units || o.host_units > (1 << 20))
    throw std::invalid_argument("bench offload: --host-units " + std::to_string(o.host_units) + ": give at least " +
                                std::to_string(min_host_units) +
                                " (the zero3_mixed_nvme schedule holds a unit's optimizer state, 2 units, and its "
                                "parameters at once)");
  if (o.units < o.host_units + 1)
    throw std::invalid_argument("bench offload: --units " + std::to_string(o.units) + " must exceed --host-units " +
                                std::to_string(o.host_units) + " (else nothing is read from NVMe)");
  // The largest schedule (zero3_mixed) homes 4 units' bytes per unit on NVMe: check it fits the
  // free space of the swap directories before allocating anything.
  const uint64_t need = checked_mul(checked_mul(unit, static_cast<uint64_t>(o.units), "bench offload: swap bytes"),
                                    uint64_t{4}, "bench offload: swap bytes");
  uint64_t free_bytes = 0;
  for (const std::string& p : o.nvme_paths) {
    struct statvfs sv {};
    if (::statvfs(p.c_str(), &sv) != 0)
      throw std::runtime_error("bench offload: --nvme-path " + p + ": " + std::strerror(errno));
    free_bytes += static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
  }
  if (need > free_bytes)
    throw std::invalid_argument("bench offload: --units " + std::to_string(o.units) + " x --unit-size " +
                                o.unit_size + " needs " + off::format_size(need) +
                                " of swap (4 unit sizes per unit), but the --nvme-path directories have " +
                                off::format_size(free_bytes) + " free; use fewer or smaller units");
  io::EngineOptions eo;
  eo.kind = io::parse_engine_kind(o.engine);
  auto engine = io::make_engine(eo);
  io::SwapOptions so;
  so.paths = o.nvme_paths;
  io::SwapSpace space(so, *engine);
  Bandwidth bw = measure_nvme(space, unit, o.units);
  double unit_read_ms = static_cast<double>(unit) / (bw.read_gbps * 1e6);
  for (const Workload& w : {forward_backward(unit, o.units, o.host_units), zero3_mixed(unit, o.units, o.host_units)}) {
    std::printf("%s\n", run_workload(w, o, space, bw, unit_read_ms).dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

void register_bench_offload(CLI::App& bench, Run& run) {
  auto opts = std::make_shared<BenchOptions>();
  CLI::App* cmd = bench.add_subcommand("offload", "Replay training-like schedules through the tiered memory manager (NVMe homes)");
  cmd->add_option("--nvme-path", opts->nvme_paths, "Directory for swap files (one per SSD; repeatable)")->required();
  cmd->add_option("--unit-size", opts->unit_size, "Bytes per unit, e.g. 16M")->capture_default_str();
  cmd->add_option("--units", opts->units, "Units (transformer blocks) per step")->capture_default_str();
  cmd->add_option("--host-units", opts->host_units, "Pinned host budget, in units")->capture_default_str();
  cmd->add_option("--compute-ms", opts->compute_ms, "Compute per unit access (0: one unit's NVMe read time)")
      ->capture_default_str();
  cmd->add_option("--steps", opts->steps, "Timed steps (after one warm-up step)")->capture_default_str();
  cmd->add_option("--engine", opts->engine, "I/O engine: auto, uring, threads")->capture_default_str();
  cmd->callback([&run, opts] { run = [opts] { return run_bench(*opts); }; });
}

}  // namespace strata::app
