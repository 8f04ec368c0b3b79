// `strata plan`: the same flags as `strata train`, nothing trained. Prints what each tier would
// hold (by kind of state), the bytes each link would move per step, each link's floor at its
// measured bandwidth (a few-second probe of the --nvme-path, or --nvme-bw), the compute floor
// (the model's own phases timed on a one-block copy of it, scaled down and extrapolated where
// that copy is too large to time in seconds; or, for --backend cuda with --gpu, a named or
// described GPU modeled from its datasheet), the optimizer's from a short probe, and the
// predicted step time: the largest floor, or on the CPU backend with NVMe the plan replayed
// against a clock with those rates (offload/timeline.h). The same budget check as `strata
// train` runs, so a plan that cannot fit fails the same way.
#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <functional>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <nlohmann/json.hpp>

#include "apps/strata/commands.h"
#include "io/bandwidth.h"
#include "io/engine.h"
#include "io/swap_space.h"
#include "kernels/cpu/parallel.h"
#include "offload/size.h"
#include "src/comm/grid.h"
#include "src/train/auto_placement.h"
#include "src/train/gpu_specs.h"
#include "src/train/perf_model.h"
#include "src/train/trainer.h"
#include "src/zero/unit_table.h"

namespace strata::app {
namespace {

// The largest one-block micro-batch (block and head, forward and backward) the phases are
// timed on as is; above it the probe is scaled (perf_model.h ProbeShape). The probe runs each
// phase at least four times, so on the 2-core development VM (0.2-0.6 TFLOP/s bf16, as loaded)
// a probe at the budget takes 3-10 s: an 8B llama (2.3 TFLOP at 512 tokens, 1.6 of it the
// head) is probed on 1/16 of its vocabulary and 256-token rows; a 1.5B one at 256 tokens (180
// GFLOP) whole, as before. A GPU runs 100 TFLOP in a fraction of a second, and its GEMMs lose
// far more than a CPU's when made small, so on --backend cuda the budget is 200× larger: a
// 1B llama at 8 × 2048 tokens (11 TFLOP) or an 8B one at 2048 is probed whole there, as before.
constexpr double kDefaultProbeGflop = 500, kDefaultProbeGflopCuda = 100000;
// `strata train --offload auto` probes the phases for this long (AdamW half of it) before it
// picks: enough to rank placements, which differ by what they move far more than by noise.
constexpr double kTrainAutoProbeS = 1;

struct PlanOptions {
  TrainOptions train;
  double nvme_bw = 0;      // GB/s, both directions; 0: probe the --nvme-path directories
  double probe_s = 2;      // seconds per probe
  double probe_gflop = 0;  // 0: not given, the backend's default
  // --io-interference COMPUTE,DISK: compute's speed beside the disk's traffic and the disk's
  // beside compute (perf_model.h Interference), instead of the probe's; "": probed with the
  // bandwidth (none where --nvme-bw skips that probe).
  std::string io_interference;
  bool json = false;
  int world = 1;           // plan one rank of a job of this many ranks
  // --backend cuda modeled on a GPU that need not be here: a known one by name, and/or figures.
  std::string gpu;
  double gpu_tflops = 0, gpu_mem_gib = 0, pcie_gbs = 0, gpu_hbm_gbs = 0;
  bool probe_gflop_given = false, tflops_given = false, mem_given = false, pcie_given = false, hbm_given = false;
};

std::string gib(uint64_t b) { return b ? offload::format_size(b) : std::string("-"); }

// Flags of plan's own, checked before anything runs: a bandwidth or probe length outside these
// prints a table of nonsense (1e-9 GB/s: floors of years) or never ends (1e9 s of probing).
constexpr double kMinNvmeGbps = 0.001, kMaxNvmeGbps = 10000;  // 1 MB/s .. 10 TB/s
constexpr double kMinProbeS = 0.01, kMaxProbeS = 60;
constexpr int kMaxWorld = 65536;
constexpr double kMinProbeGflop = 0.001, kMaxProbeGflop = 1e9;

// --io-interference COMPUTE,DISK: two fractions in (0, 1]; "" is none given.
std::optional<Interference> parse_io_interference(const std::string& text) {
  if (text.empty()) return std::nullopt;
  const auto bad = [&] {
    return std::invalid_argument("plan --io-interference " + text +
                                 ": give COMPUTE,DISK, each a fraction in (0, 1]: compute's speed while the disk "
                                 "moves bytes and the disk's while compute runs, each relative to its speed alone "
                                 "(1,1: no interference)");
  };
  const size_t comma = text.find(',');
  if (comma == std::string::npos) throw bad();
  Interference r;
  for (auto [part, out] : {std::pair{text.substr(0, comma), &r.compute}, std::pair{text.substr(comma + 1), &r.disk}}) {
    size_t used = 0;
    try {
      *out = std::stod(part, &used);
    } catch (const std::exception&) {
      throw bad();
    }
    if (used != part.size() || !std::isfinite(*out) || *out <= 0 || *out > 1) throw bad();
  }
  return r;
}

void check_plan_flags(const PlanOptions& po) {
  (void)parse_io_interference(po.io_interference);
  if (!std::isfinite(po.nvme_bw) || (po.nvme_bw != 0 && (po.nvme_bw < kMinNvmeGbps || po.nvme_bw > kMaxNvmeGbps)))
    throw std::invalid_argument(fmt::format("plan --nvme-bw {}: give the NVMe bandwidth in GB/s, between {} and {} "
                                            "(or 0 to probe the --nvme-path directories)",
                                            po.nvme_bw, kMinNvmeGbps, kMaxNvmeGbps));
  if (!std::isfinite(po.probe_s) || po.probe_s < kMinProbeS || po.probe_s > kMaxProbeS)
    throw std::invalid_argument(fmt::format("plan --probe-seconds {}: give the seconds per rate probe, between {} and {}",
                                            po.probe_s, kMinProbeS, kMaxProbeS));
  if (po.world < 1 || po.world > kMaxWorld)
    throw std::invalid_argument(
        fmt::format("plan --world {}: give the number of ranks, between 1 and {}", po.world, kMaxWorld));
  if (po.probe_gflop_given &&
      (!std::isfinite(po.probe_gflop) || po.probe_gflop < kMinProbeGflop || po.probe_gflop > kMaxProbeGflop))
    throw std::invalid_argument(fmt::format("plan --probe-gflop {}: give the largest micro-batch of the one-block "
                                            "probe in GFLOP, between {} and {} (default {} on the CPU, {} on CUDA)",
                                            po.probe_gflop, kMinProbeGflop, kMaxProbeGflop, kDefaultProbeGflop,
                                            kDefaultProbeGflopCuda));
}

// The GPU --backend cuda is modeled on (--gpu NAME and/or --gpu-tflops, --gpu-mem, --pcie-gbs,
// --gpu-hbm-gbs, each figure overriding the named GPU's); none: the GPU present is probed.
std::optional<GpuSpec> modeled_gpu(const PlanOptions& po) {
  struct Figure {
    const char* flag;
    bool given;
    double value, max;
    const char* what;
  };
  const Figure figures[] = {
      {"--gpu-tflops", po.tflops_given, po.gpu_tflops, 1e5, "dense peak in TFLOP/s for the run's --dtype"},
      {"--gpu-mem", po.mem_given, po.gpu_mem_gib, 1e5, "memory in GiB"},
      {"--pcie-gbs", po.pcie_given, po.pcie_gbs, 1e4, "host link in GB/s each way"},
      {"--gpu-hbm-gbs", po.hbm_given, po.gpu_hbm_gbs, 1e6, "memory bandwidth in GB/s"}};
  std::string first = po.gpu.empty() ? "" : "--gpu " + po.gpu;
  for (const Figure& f : figures)
    if (f.given && first.empty()) first = f.flag;
  if (first.empty()) return std::nullopt;
  if (po.train.backend != "cuda")
    throw std::invalid_argument(fmt::format("plan {}: models a GPU for --backend cuda, and this plan is for "
                                            "--backend {}; add --backend cuda, or leave the GPU flags out",
                                            first, po.train.backend));
  for (const Figure& f : figures)
    if (f.given && !(std::isfinite(f.value) && f.value > 0 && f.value <= f.max))
      throw std::invalid_argument(fmt::format("plan {} {}: give the modeled GPU's {}, a number above 0 and at most {}",
                                              f.flag, f.value, f.what, f.max));
  GpuSpec g;
  if (!po.gpu.empty()) {
    const GpuSpec* known = find_gpu(po.gpu);
    if (!known)
      throw std::invalid_argument(fmt::format("plan --gpu {}: not a GPU this plan knows; give one of {}, or "
                                              "describe it with --gpu-tflops, --gpu-mem and --pcie-gbs",
                                              po.gpu, known_gpu_names()));
    g = *known;
  } else {
    std::string missing;
    for (const Figure& f : figures)
      if (!f.given && std::string_view(f.flag) != "--gpu-hbm-gbs") missing += (missing.empty() ? "" : ", ") + std::string(f.flag);
    if (!missing.empty())
      throw std::invalid_argument(fmt::format("plan {}: a GPU described by figures needs all of --gpu-tflops, "
                                              "--gpu-mem and --pcie-gbs (missing: {}), or name one with --gpu {}",
                                              first, missing, known_gpu_names()));
    g.name = "custom";
    g.description = "a GPU described by --gpu-tflops, --gpu-mem and --pcie-gbs";
  }
  if (po.tflops_given) g.bf16_tflops = g.fp32_tflops = po.gpu_tflops;
  if (po.mem_given) g.mem_gib = po.gpu_mem_gib;
  if (po.pcie_given) g.pcie_gbs = po.pcie_gbs;
  if (po.hbm_given) g.hbm_gbs = po.gpu_hbm_gbs;
  if (!po.train.device_mem.empty() && offload::parse_size(po.train.device_mem) > g.mem_bytes())
    throw std::invalid_argument(fmt::format("plan --device-mem {}: more than the modeled {} has ({}); give "
                                            "--device-mem {}G or less",
                                            po.train.device_mem, g.name, offload::format_size(g.mem_bytes()),
                                            static_cast<uint64_t>(g.mem_gib)));
  return g;
}

// A modeled GPU must hold what the run keeps on the device.
void check_fits_gpu(const GpuSpec& g, const MemoryPlan& mp) {
  const uint64_t cap = g.mem_bytes();
  const std::string gpu = fmt::format("the modeled {} ({} of memory)", g.name, offload::format_size(cap));
  if (mp.minimum[0] > cap)
    throw std::runtime_error(fmt::format("plan: the run needs at least {} of device memory and {} has less: offload "
                                         "more (--offload-params, --offload-optimizer, --offload-grads cpu|nvme, "
                                         "--checkpoint-activations full), or model a larger --gpu",
                                         offload::format_size(mp.minimum[0]), gpu));
  if (mp.budget[0] > cap)  // no --device-mem: the budget is what the plan would hold
    throw std::runtime_error(fmt::format("plan: the run would hold {} on the device and {} has less: give "
                                         "--device-mem {}G or less (the run needs at least {}), or offload more",
                                         offload::format_size(mp.budget[0]), gpu,
                                         static_cast<uint64_t>(g.mem_gib), offload::format_size(mp.minimum[0])));
}

// The NVMe bandwidth probe: 32 pieces written four times and read three times (the median of
// each direction's timed passes), 512 MiB in all, less where the --nvme-path directories have
// less than twice that free (the probe takes at most half of the free space, split evenly as
// the swap space stripes it). Below a floor the numbers would say
// more about the page cache than the disk, so it declines. Any failure names the probe and the
// flag that skips it: `strata train` with the same flags never runs it. `beside` then runs in
// the same swap space with the probe's piece size (the compute-beside-I/O probe), unless null.
io::Bandwidth probe_nvme(const std::vector<std::string>& paths,
                         const std::function<void(io::SwapSpace&, uint64_t piece)>& beside) {
  constexpr int kPieces = 32;
  constexpr uint64_t kMaxProbeBytes = 512ull << 20, kMinProbeBytes = 8ull << 20;
  const std::string skip = "; give --nvme-bw GB/s to skip the probe";
  if (paths.empty())
    throw std::invalid_argument("plan: the placement puts state on NVMe but no --nvme-path DIR was given (the "
                                "bandwidth probe needs one)" + skip);
  uint64_t min_free = UINT64_MAX;
  std::string min_path;
  for (const std::string& p : paths) {
    struct statvfs sv {};
    if (::statvfs(p.c_str(), &sv) != 0)
      throw std::runtime_error("plan: NVMe bandwidth probe: --nvme-path " + p + ": " + std::strerror(errno) + skip);
    const uint64_t free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
    if (free_bytes < min_free) min_free = free_bytes, min_path = p;
  }
  const uint64_t room = min_free / 2 * paths.size();
  const uint64_t piece = std::min(kMaxProbeBytes, room) / kPieces / io::kChecksumBlock * io::kChecksumBlock;
  const uint64_t total = piece * kPieces;
  if (total < kMinProbeBytes)
    throw std::runtime_error("plan: cannot probe the NVMe bandwidth: --nvme-path " + min_path + " has " +
                             offload::format_size(min_free) + " free, and the probe needs at least " +
                             offload::format_size(2 * kMinProbeBytes / paths.size()) + " there" + skip);
  try {
    auto engine = io::make_engine();
    io::SwapOptions so;
    so.paths = paths;
    so.allow_buffered = true;
    io::SwapSpace space(so, *engine);
    const io::Bandwidth bw = io::measure_bandwidth(space, piece, kPieces);
    if (beside) beside(space, piece);
    return bw;
  } catch (const std::exception& e) {
    throw std::runtime_error("plan: the NVMe bandwidth probe (" + offload::format_size(total) + " written four times and read three times) failed: " +
                             e.what() + skip);
  }
}

// What one placement's step is predicted to take, and the figures behind it.
struct Prediction {
  StepFloor f;
  double adam_rate = 0, gflops = 0, pcie_ms = 0, window_ms = 0, compute_and_update = 0;
  // Twin-Flow (--optimizer-on-device): AdamW's parts on the CPU and on the device.
  double adamw_cpu_ms = 0, adamw_device_ms = 0, device_params = 0;
  double window_compute_ms = 0;  // the compute AdamW runs beside (the first forward, or the last backward)
  Interference interference;  // compute and the disk beside each other (the replay's; 1, 1: not probed)
  bool twin() const { return adamw_device_ms > 0; }
  std::array<double, offload::kNumLinks> link_gbs{};  // GB/s per link (0: not known)
  io::Bandwidth bw{};
  bool split = false, replayed = false, has_barrier = false, barred = false;
  offload::StepTimeline tl;
  BarrierBound barrier;
};

// Twin-Flow: the parameters of the units --optimizer-on-device keeps on the device (UnitTable's
// rule: the trainable units in forward order within the fraction; "auto" not yet chosen: none).
double twin_device_params(const Transformer& model, const TrainOptions& o) {
  if (o.optimizer_on_device == "auto") return 0;
  std::vector<bool> trains;
  for (const Unit& u : model.units()) trains.push_back(u.trainable);
  const std::vector<bool> on = twin_device_units(model.units(), trains, parse_optimizer_on_device(o.optimizer_on_device));
  double n = 0;
  for (size_t u = 0; u < on.size(); ++u)
    if (on[u]) n += static_cast<double>(model.units()[u].n_real);
  return n;
}

// The rates every placement of a plan is predicted from, measured once: the model's phases (or a
// modeled GPU's), AdamW where it runs (the CPU's or the device's, each probed when first needed)
// and NVMe (probed when a placement first moves bytes there, unless --nvme-bw). `--offload auto`
// predicts every candidate placement from one Predictor.
class Predictor {
 public:
  // cfg, lora: the run's model and adapters (plan_run's), which no placement changes.
  Predictor(const PlanOptions& po, const ModelConfig& cfg, const LoraSpec& lora)
      : po_(po), gpu_(modeled_gpu(po)), backend_(kernels::parse_backend(po.train.backend)),
        dt_(kernels::parse_dtype(po.train.dtype)), cfg_(cfg), lora_(lora), bw_{po.nvme_bw, po.nvme_bw},
        interference_(parse_io_interference(po.io_interference).value_or(Interference{})) {
    const TrainOptions& o = po.train;
    // Rates. Compute and AdamW on this machine's CPU backend (the GPU's when it is the backend,
    // modeled from its figures with --gpu).
    kernels::cpu::set_num_threads(o.threads);
    cpu_ = kernels::make_runtime(kernels::Backend::cpu);
    if (!gpu_) rt_ = kernels::make_runtime(backend_);
    // The model's own phases on a one-block copy (the GEMMs at its shapes and every other op, or
    // a scaled copy's extrapolated), on the backend that will run them.
    probe_gflop_ = po.probe_gflop_given                ? po.probe_gflop
                   : backend_ == kernels::Backend::cuda ? kDefaultProbeGflopCuda
                                                        : kDefaultProbeGflop;
    shape_ = choose_probe_shape(cfg_, o.batch, o.seq, probe_gflop_, o.tp);
    peak_flops_ = !gpu_ ? 0 : (dt_ == DType::f32 ? gpu_->fp32_tflops : gpu_->bf16_tflops) * 1e12;
    hbm_bytes_per_s_ = gpu_ ? gpu_->hbm_gbs * 1e9 * kModeledHbmEfficiency : 0;
    if (gpu_) {
      const Transformer model(cfg_, dt_, o.batch, o.seq, *cpu_, Checkpointing{0}, kLogitsChunkBytes, 1, lora_,
                              tp_part(o));
      phases_ = model_phases(model, peak_flops_ * kModeledMfu, hbm_bytes_per_s_);
    } else {
      phases_ = probe_phases(cfg_, dt_, o.batch, o.seq, *rt_, po.probe_s, lora_, &shape_, o.tp, o.sequence_parallel);
    }
  }

  // The run's model (no weights) with o's checkpointing: its FLOPs and the compute of its phases.
  // (tensor parallel: tp rank 0's part, sized only)
  Transformer model_of(const TrainOptions& o) const {
    return Transformer(cfg_, dt_, o.batch, o.seq, *cpu_, parse_checkpointing(o.checkpoint_activations),
                       kLogitsChunkBytes, 1, lora_, tp_part(o));
  }
  static TensorParallel tp_part(const TrainOptions& o) { return {o.tp, 0, nullptr, o.sequence_parallel}; }

  Prediction predict(const TrainOptions& o, const RunPlan& p, const Transformer& model) {
    const MemoryPlan& mp = p.memory;
    // The parameters AdamW updates on the device: none on the CPU backend, all where the optimizer
    // is not offloaded, else Twin-Flow's units (--optimizer-on-device).
    const auto n_train = static_cast<double>(model.n_trainable_params());
    const double n_dev = backend_ == kernels::Backend::cpu ? 0
                         : o.offload_optimizer == "none" ? n_train
                                                         : twin_device_params(model, o);
    const bool adam_on_cpu = n_dev < n_train;
    if (gpu_ && n_dev > 0 && gpu_->hbm_gbs <= 0)
      throw std::invalid_argument("plan --gpu-tflops: AdamW runs on the modeled GPU (--offload-optimizer none or "
                                  "--optimizer-on-device), which needs its memory bandwidth: give --gpu-hbm-gbs GB/s, "
                                  "or name a GPU with --gpu");
    Prediction r;
    r.adam_rate = adam_rate(adam_on_cpu, model);
    const uint64_t nvme_moved = mp.link_bytes[2] + mp.link_bytes[3];
    if (!bw_probed_ && po_.nvme_bw <= 0 && nvme_moved > 0) {
      // On the CPU backend the replay also needs what the disk's traffic takes from compute.
      std::function<void(io::SwapSpace&, uint64_t)> beside;
      if (backend_ == kernels::Backend::cpu && po_.io_interference.empty())
        beside = [&](io::SwapSpace& space, uint64_t piece) {
          interference_ = probe_interference(*rt_, dt_, cfg_, o.batch * o.seq, space, piece, po_.probe_s);
        };
      bw_ = probe_nvme(o.nvme_paths, beside), bw_probed_ = true;
    }
    r.bw = bw_;
    // Each link's rate in GB/s (0: not known): PCIe each way from a modeled GPU's figures, NVMe probed.
    r.link_gbs = {gpu_ ? gpu_->pcie_gbs : 0, gpu_ ? gpu_->pcie_gbs : 0, bw_.write_gbps, bw_.read_gbps};
    StepFloor& f = r.f;
    f.compute_ms = step_compute_ms(phases_, model, o.grad_accum);
    r.gflops = step_flops(model) * static_cast<double>(o.grad_accum) / (f.compute_ms * 1e6);  // effective
    // (LoRA: the adapters.) Twin-Flow: the CPU's part at its rate, the device's at its.
    r.adamw_device_ms = adam_on_cpu && n_dev > 0 ? n_dev / adam_rate(false, model) * 1e3 : 0;
    r.adamw_cpu_ms = adam_on_cpu ? (n_train - n_dev) / r.adam_rate * 1e3 : 0;
    r.device_params = n_dev;
    f.adamw_ms = adam_on_cpu ? r.adamw_cpu_ms + r.adamw_device_ms : n_train / r.adam_rate * 1e3;
    for (size_t l = 0; l < r.link_gbs.size(); ++l)
      f.link_ms[l] = r.link_gbs[l] > 0 ? static_cast<double>(mp.link_bytes[l]) / (r.link_gbs[l] * 1e9) * 1e3 : 0;
    f.nvme_ms = f.link_ms[2] + f.link_ms[3];
    r.pcie_ms = std::max(f.link_ms[0], f.link_ms[1]);  // each way on its own lanes
    // On the CPU backend compute and AdamW share the cores and NVMe runs beside them. With a GPU and
    // AdamW on the CPU they run side by side, but only during the first forward: each unit's update
    // runs inside the next step's forward, just before the unit computes, and backward cannot
    // overlap it (the update needs the global norm, so every gradient). So the step is the longer
    // of the update and the first micro-batch's block forwards, plus the rest of the compute
    // (measured on the H200, 1B: 551 vs 574 ms and 637 vs 661 ms; the old max(compute, AdamW)
    // with a cache-resident AdamW probe had said 339 and 415 ms for 589 and 681).
    r.split = backend_ != kernels::Backend::cpu && adam_on_cpu;
    // The compute the updates run beside: the next step's first forward (each unit's update just
    // before it computes), or where each unit updates in the backward as its gradient is final
    // (no clipping, or speculation), the last micro-batch's backward: its blocks' backward and
    // recompute, the CPU's AdamW starting with the last layers' while the GPU goes on.
    r.window_compute_ms = phases_.block_forward_ms * static_cast<double>(model.dims().L);
    if (p.update_in_backward) {
      r.window_compute_ms = 0;
      for (int64_t l = 0; l < model.dims().L; ++l)
        r.window_compute_ms += phases_.block_backward_ms + (model.checkpointing().at(l) ? phases_.block_forward_ms : 0);
    }
    // The window with the updates inside it; the rest of the compute follows. Twin-Flow: the
    // device's share runs on the compute stream (the first units: just before their forward, or
    // last in the backward), the CPU's beside it.
    r.window_ms = r.split ? std::max(r.adamw_cpu_ms, r.window_compute_ms + r.adamw_device_ms)
                          : r.window_compute_ms + f.adamw_ms;
    r.compute_and_update = r.window_ms + f.compute_ms - r.window_compute_ms;
    if (p.pp > 1) {
      // Pipeline parallel: the stages in 1F1B, then each stage's update after its last backward
      // (the largest stage's bounds the step).
      f.compute_ms = pipeline_compute_ms(phases_, model.checkpointing(), p.pp_layers, o.grad_accum);
      f.adamw_ms = static_cast<double>(*std::max_element(p.stage_params.begin(), p.stage_params.end())) /
                   r.adam_rate * 1e3;
      r.split = false;
      r.window_ms = f.adamw_ms;
      r.compute_and_update = f.compute_ms + f.adamw_ms;
    }
    f.predicted_ms = std::max({r.compute_and_update, f.nvme_ms, r.pcie_ms});
    const offload::LinkRates nvme_rates{.nvme_read = bw_.read_gbps * 1e6, .nvme_write = bw_.write_gbps * 1e6,
                                        .compute_beside_nvme = interference_.compute,
                                        .nvme_beside_compute = interference_.disk};
    // CPU backend: the plan replayed against a clock (TieredMemory::estimate). The largest floor
    // assumes compute and I/O overlap throughout; where the budget leaves nothing to move during
    // part of the step, that part adds its compute (1.5B all on NVMe with 8 GiB of host RAM on a
    // 6.5 GB/s disk: floor 4.4 s, measured 8.8-9.5 s).
    r.replayed = backend_ == kernels::Backend::cpu && nvme_moved > 0 && p.pp == 1;
    if (r.replayed) {
      StepCosts c;
      c.phases = phases_;
      c.adamw_params_per_ms = r.adam_rate / 1e3;
      c.links = nvme_rates;
      r.interference = interference_;
      r.tl = estimate_run(o, p, c);
      f.predicted_ms = std::max(f.predicted_ms, r.tl.step_ms);
    }
    // The norm barrier's bound (tiered_memory.h): what no schedule beats with these budgets. With
    // the update in the backward (no clipping) there is no barrier.
    r.barrier = barrier_bound(mp, backend_, r.window_ms, r.compute_and_update - r.window_ms, nvme_rates);
    r.has_barrier = !p.update_in_backward && nvme_moved > 0;
    r.barred = r.has_barrier && r.barrier.window_io_ms > r.barrier.window_compute_ms;
    if (r.barred) f.predicted_ms = std::max(f.predicted_ms, r.barrier.step_ms);
    return r;
  }

  const std::optional<GpuSpec>& gpu() const { return gpu_; }
  kernels::Backend backend() const { return backend_; }
  const PhaseTimes& phases() const { return phases_; }
  const ProbeShape& shape() const { return shape_; }
  double probe_gflop() const { return probe_gflop_; }
  double peak_flops() const { return peak_flops_; }
  // The dense peak of the device that runs the model, for the dtype: a modeled GPU's, a real
  // GPU's where the table knows it (match_gpu), else 0 (the CPU backend: not reported).
  double device_peak_flops() const {
    if (gpu_) return peak_flops_;
    if (backend_ != kernels::Backend::cuda) return 0;
    const GpuSpec* g = match_gpu(rt_->info().name);
    return g ? (dt_ == DType::f32 ? g->fp32_tflops : g->bf16_tflops) * 1e12 : 0;
  }
  // What the device has: a modeled GPU's memory, else the runtime's (CPU: physical RAM).
  uint64_t device_bytes() const { return gpu_ ? gpu_->mem_bytes() : rt_->info().total_bytes; }
  uint64_t ram_bytes() const { return cpu_->info().total_bytes; }

 private:
  // AdamW over the model's largest unit (at least 8M, at most 64M parameters): its state must
  // not fit a server's last-level cache, as the model's does not (on the H200's host an 8M probe
  // ran from cache at 8 G params/s, the 1B model's update at ~2.7 G/s). On a modeled GPU: its
  // memory bandwidth over the bytes an update moves (fp32 master, m, v, grad read; master, m, v
  // and the working copy written).
  double adam_rate(bool on_cpu, const Transformer& model) {
    double& rate = on_cpu ? adam_cpu_ : adam_device_;
    if (rate > 0) return rate;
    int64_t unit_numel = 0;
    for (const Unit& u : model.units()) unit_numel = std::max(unit_numel, u.numel);
    rate = gpu_ && !on_cpu ? hbm_bytes_per_s_ / (28.0 + static_cast<double>(kernels::dtype_size(dt_)))
                           : probe_adamw_params_per_s(on_cpu ? *cpu_ : *rt_, dt_,
                                                      std::clamp(unit_numel, int64_t{1} << 23, int64_t{1} << 26),
                                                      po_.probe_s / 2);
    return rate;
  }

  const PlanOptions& po_;
  std::optional<GpuSpec> gpu_;
  kernels::Backend backend_;
  DType dt_;
  ModelConfig cfg_;
  LoraSpec lora_;
  std::unique_ptr<kernels::Runtime> cpu_, rt_;
  double probe_gflop_ = 0, peak_flops_ = 0, hbm_bytes_per_s_ = 0;
  ProbeShape shape_;
  PhaseTimes phases_;
  double adam_cpu_ = 0, adam_device_ = 0;
  io::Bandwidth bw_;
  bool bw_probed_ = false;
  Interference interference_;  // --io-interference, or probed with the bandwidth (else none: --nvme-bw)
};

// `--offload auto` resolved: the search, its budgets, and the options with the pick applied.
struct AutoPick {
  AutoSearch search;
  AutoBudgets budgets;
  TrainOptions resolved;  // the pick's flags; budgets not given: the pick's pools
  double search_s = 0;
};

// Every candidate placement predicted from one probe (Predictor), the fastest that fits the
// budgets picked. Budgets not given: what the device and the host have, less auto_budget's margin;
// on the CPU backend both pools are one RAM, so their sum must fit it too.
AutoPick choose_placement(const PlanOptions& po, Predictor& pred) {
  const TrainOptions& o = po.train;
  const auto t0 = std::chrono::steady_clock::now();
  AutoPick a;
  AutoBudgets& b = a.budgets;
  b.device = o.device_mem.empty() ? auto_budget(pred.device_bytes()) : offload::parse_size(o.device_mem);
  b.host = o.host_mem.empty() ? auto_budget(pred.ram_bytes()) : offload::parse_size(o.host_mem);
  if (pred.backend() == kernels::Backend::cpu) b.shared = auto_budget(pred.ram_bytes());
  const std::vector<PlacementChoice> candidates = placement_candidates(o, !o.nvme_paths.empty());
  a.search = search_placements(candidates, b, [&](const PlacementChoice& c) {
    TrainOptions oc = o;
    c.apply(oc);
    if (oc.offload_optimizer == "none") oc.optimizer_on_device = "0";  // (a split needs the optimizer off the device)
    oc.device_mem = std::to_string(b.device);
    oc.host_mem = std::to_string(b.host);
    const RunPlan p = plan_run(oc, /*minimums=*/false, po.world);
    const Transformer model = pred.model_of(oc);
    const Prediction r = pred.predict(oc, p, model);
    return CandidateCost{p.memory.budget[0], p.memory.budget[1], p.memory.budget[2], r.f.predicted_ms};
  });
  if (a.search.fitting.empty()) throw std::runtime_error(no_placement_fits(a.search, b));
  const RankedCandidate& best = a.search.fitting.front();
  a.resolved = o;
  best.choice.apply(a.resolved);
  if (a.resolved.offload_optimizer == "none") a.resolved.optimizer_on_device = "0";
  // The budgets the pick was predicted under: a run without them would size its pools by itself.
  // (An empty pool stays unset: the run sizes it to nothing by itself.)
  if (o.device_mem.empty() && best.cost.device_bytes > 0) a.resolved.device_mem = std::to_string(best.cost.device_bytes);
  if (o.host_mem.empty() && best.cost.host_bytes > 0) a.resolved.host_mem = std::to_string(best.cost.host_bytes);
  a.search_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return a;
}

std::string budgets_text(const AutoBudgets& b, const TrainOptions& o) {
  return fmt::format("device {}{}, host {}{}{}", offload::format_size(b.device),
                     o.device_mem.empty() ? " (what it has less max(10%, 2 GiB))" : " (--device-mem)",
                     offload::format_size(b.host), o.host_mem.empty() ? " (RAM less max(10%, 2 GiB))" : " (--host-mem)",
                     b.shared ? "; one RAM on the CPU backend: together at most " + offload::format_size(b.shared)
                              : std::string());
}

std::string choice_line(const RankedCandidate& c) {
  const double ms = c.cost.predicted_ms;
  return fmt::format("{} ({} ms/step)", c.choice.describe(), ms < 100 ? fmt::format("{:.3g}", ms) : fmt::format("{:.0f}", ms));
}

// The model's config and adapters (no placement changes them), from the all-resident plan.
RunPlan placement_free_plan(TrainOptions o, int world) {
  PlacementChoice{"none", "none", "none", "none", "none"}.apply(o);
  o.optimizer_on_device = "0";
  o.device_mem.clear();
  o.host_mem.clear();
  return plan_run(o, /*minimums=*/false, world);
}

nlohmann::json candidate_json(const RankedCandidate& c) {
  return {{"params", c.choice.params},
          {"grads", c.choice.grads},
          {"optimizer", c.choice.optimizer},
          {"activations", c.choice.activations},
          {"checkpointing", c.choice.checkpointing},
          {"predicted_step_ms", c.cost.predicted_ms},
          {"device_bytes", c.cost.device_bytes},
          {"host_bytes", c.cost.host_bytes},
          {"nvme_bytes", c.cost.nvme_bytes}};
}

// `plan --offload auto --json`: the search, every fitting candidate fastest first (the first is
// the pick, whose plan the rest of the object is).
nlohmann::json auto_json(const AutoPick& a) {
  nlohmann::json ranked = nlohmann::json::array();
  for (const RankedCandidate& c : a.search.fitting) ranked.push_back(candidate_json(c));
  return {{"candidates", a.search.n_candidates},
          {"fitting", ranked},
          {"refused_device", a.search.refused_device},
          {"refused_host", a.search.refused_host},
          {"refused_shared", a.search.refused_shared},
          {"device_budget_bytes", a.budgets.device},
          {"host_budget_bytes", a.budgets.host},
          {"shared_budget_bytes", a.budgets.shared},
          {"search_s", a.search_s}};
}

// `plan --offload auto`: the ten fastest placements that fit, and what was refused.
void print_auto_table(const AutoPick& a, const TrainOptions& given) {
  const AutoSearch& s = a.search;
  fmt::print("offload auto: {} placements predicted in {:.1f} s from one probe; {} fit the budgets ({}); refused: "
             "{} by the device budget, {} by the host budget{}\n",
             s.n_candidates, a.search_s, s.fitting.size(), budgets_text(a.budgets, given), s.refused_device,
             s.refused_host, a.budgets.shared ? fmt::format(", {} by their sum in RAM", s.refused_shared) : "");
  fmt::print("{:<6}{:>12}{:>12}{:>12}{:>12}  {}\n", "rank", "step", "device", "host", "nvme", "placement");
  for (size_t i = 0; i < std::min<size_t>(10, s.fitting.size()); ++i) {
    const RankedCandidate& c = s.fitting[i];
    fmt::print("{:<6}{:>12}{:>12}{:>12}{:>12}  {}\n", i + 1, fmt::format("{:.0f} ms", c.cost.predicted_ms),
               gib(c.cost.device_bytes), gib(c.cost.host_bytes), gib(c.cost.nvme_bytes), c.choice.describe());
  }
  fmt::print("chose rank 1; its plan:\n\n");
}

// `--optimizer-on-device auto` (Twin-Flow): each split of the trainable units at a unit boundary
// predicted from the one probe, the fastest whose pools fit the device budget picked (ties: fewer
// parameters on the device). On the CPU backend, or with the optimizer on the device, nothing to
// choose.
struct TwinRow {
  std::string fraction;   // the --optimizer-on-device value that selects this split
  double share = 0;       // of the trainable parameters, on the device
  uint64_t device_bytes = 0;
  double predicted_ms = 0;
  bool fits = false;
};
struct TwinPick {
  std::vector<TwinRow> rows;
  size_t best = 0;
  uint64_t budget = 0;
  std::string fixed;  // why nothing was searched ("" when it was)
};

// Why there is nothing to choose ("" where there is).
std::string twin_fixed(const TrainOptions& o, kernels::Backend backend) {
  if (o.offload_optimizer == "none") return "the optimizer is on the device already (--offload-optimizer none)";
  if (backend == kernels::Backend::cpu) return "on the CPU backend AdamW runs on the same cores wherever its state lives";
  return "";
}

TwinPick choose_twin(const PlanOptions& po, Predictor& pred, TrainOptions& o) {
  TwinPick t;
  t.fixed = twin_fixed(o, pred.backend());
  if (!t.fixed.empty()) {
    o.optimizer_on_device = "0";
    return t;
  }
  t.budget = o.device_mem.empty() ? auto_budget(pred.device_bytes()) : offload::parse_size(o.device_mem);
  const Transformer model = pred.model_of(o);
  int64_t total = 0;
  std::vector<int64_t> prefix{0};
  for (const Unit& u : model.units())
    if (u.trainable) prefix.push_back(prefix.back() + u.numel), total += u.numel;
  const double params = std::max(1.0, static_cast<double>(model.n_trainable_params()));
  for (size_t k = 0; k < prefix.size(); ++k) {
    // The shortest value between boundaries k and k + 1: the prefix rule takes exactly k units.
    TwinRow row;
    row.fraction = k == 0 ? "0" : k + 1 == prefix.size() ? "1" : "";
    const auto n = static_cast<double>(total);
    for (int digits = 2; row.fraction.empty(); ++digits) {
      const double mid = (static_cast<double>(prefix[k]) + static_cast<double>(prefix[k + 1])) / 2 / n;
      const std::string v = fmt::format("{:.{}g}", mid, digits);
      const double limit = std::stod(v) * n;
      if ((static_cast<double>(prefix[k]) <= limit && limit < static_cast<double>(prefix[k + 1])) || digits >= 17)
        row.fraction = v;
    }
    TrainOptions oc = o;
    oc.optimizer_on_device = row.fraction;
    row.share = twin_device_params(model, oc) / params;
    try {
      const RunPlan p = plan_run(oc, /*minimums=*/false, po.world);
      row.device_bytes = p.memory.budget[0];
      row.predicted_ms = pred.predict(oc, p, model).f.predicted_ms;
      row.fits = row.device_bytes <= t.budget;
    } catch (const offload::BudgetError&) {
      row.fits = false;
    }
    t.rows.push_back(row);
  }
  t.best = t.rows.size();
  for (size_t k = 0; k < t.rows.size(); ++k)
    if (t.rows[k].fits && (t.best == t.rows.size() || t.rows[k].predicted_ms < t.rows[t.best].predicted_ms)) t.best = k;
  if (t.best == t.rows.size())
    throw std::runtime_error(fmt::format("--optimizer-on-device auto: not even the whole optimizer on --offload-optimizer "
                                         "{} fits the device budget of {}; raise --device-mem or offload more",
                                         o.offload_optimizer, offload::format_size(t.budget)));
  o.optimizer_on_device = t.rows[t.best].fraction;
  return t;
}

std::string twin_line(const TwinPick& t) {
  if (!t.fixed.empty()) return "optimizer on device auto: 0 (" + t.fixed + ")";
  const TwinRow& b = t.rows[t.best];
  const TwinRow& none = t.rows.front();
  return fmt::format("optimizer on device auto: {:.1f}% of the parameters (--optimizer-on-device {}), predicted {:.0f} "
                     "ms/step against {:.0f} ms with all of AdamW on the CPU; device pool {} of the {} budget",
                     100 * b.share, b.fraction, b.predicted_ms, none.predicted_ms, offload::format_size(b.device_bytes),
                     offload::format_size(t.budget));
}

int run_plan(const PlanOptions& po) {
  check_plan_flags(po);
  const std::optional<GpuSpec> gpu = modeled_gpu(po);
  const kernels::Backend backend = kernels::parse_backend(po.train.backend);
  const bool auto_placement = wants_auto_placement(po.train);
  if (backend == kernels::Backend::cuda && !gpu && !kernels::cuda_available())
    throw std::invalid_argument(fmt::format("plan --backend cuda: no CUDA device here to probe; name the GPU to model "
                                            "with --gpu {}, or describe it with --gpu-tflops, --gpu-mem and --pcie-gbs",
                                            known_gpu_names()));
  if (gpu && !auto_placement && po.train.offload_optimizer == "none" && gpu->hbm_gbs <= 0)
    throw std::invalid_argument("plan --gpu-tflops: AdamW runs on the modeled GPU (--offload-optimizer none), which "
                                "needs its memory bandwidth: give --gpu-hbm-gbs GB/s, or name a GPU with --gpu");
  RunPlan p = auto_placement ? placement_free_plan(po.train, po.world) : plan_run(po.train, /*minimums=*/true, po.world);
  if (gpu && !auto_placement) check_fits_gpu(*gpu, p.memory);
  Predictor pred(po, p.cfg, p.lora);
  std::optional<AutoPick> pick;
  if (auto_placement) {
    pick = choose_placement(po, pred);
    p = plan_run(pick->resolved, /*minimums=*/true, po.world);
  }
  TrainOptions o = pick ? pick->resolved : po.train;
  std::optional<TwinPick> twin;
  if (o.optimizer_on_device == "auto") {
    twin = choose_twin(po, pred, o);
    p = plan_run(o, /*minimums=*/true, po.world);
  }
  const MemoryPlan& mp = p.memory;
  const DType dt = kernels::parse_dtype(o.dtype);
  const Transformer model = pred.model_of(o);
  const Prediction r = pred.predict(o, p, model);
  const StepFloor& f = r.f;
  const PhaseTimes& phases = pred.phases();
  const ProbeShape& shape = pred.shape();
  const double peak_flops = pred.peak_flops(), probe_gflop = pred.probe_gflop();
  const auto& link_gbs = r.link_gbs;
  const io::Bandwidth& bw = r.bw;
  const double gflops = r.gflops, adam_rate = r.adam_rate, pcie_ms = r.pcie_ms;
  const double compute_and_update = r.compute_and_update;
  const bool adam_on_cpu = backend == kernels::Backend::cpu || o.offload_optimizer != "none";
  const bool split = r.split, replayed = r.replayed, has_barrier = r.has_barrier, barred = r.barred;
  const offload::StepTimeline& tl = r.tl;
  const BarrierBound& barrier = r.barrier;
  // Each phase's achieved rate (its FLOPs over its probed or modeled time), for --json and the
  // phases line; its share of the device's peak where that is known.
  struct PhaseRate {
    const char* key;
    const char* label;
    double ms, flops_per_s;
  };
  const PhaseFlops pf = phase_flops(model);
  const auto at = [](double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) : 0.0; };
  const PhaseRate phase_rates[] = {
      {"block_forward", "block forward", phases.block_forward_ms, at(pf.block_forward, phases.block_forward_ms)},
      {"block_backward", "block backward", phases.block_backward_ms, at(pf.block_backward, phases.block_backward_ms)},
      {"edge", "head fwd+bwd", phases.edge_ms, at(pf.edge, phases.edge_ms)}};
  const double peak = pred.device_peak_flops();

  if (po.json) {
    nlohmann::json j;
    j["params"] = p.n_params;
    j["tokens_per_step"] = p.tokens_per_step;
    for (int t = 0; t < 3; ++t) {
      const std::string name(offload::tier_name(static_cast<offload::Tier>(t)));
      j[name + "_budget_bytes"] = mp.budget[static_cast<size_t>(t)];
      j[name + "_minimum_bytes"] = mp.minimum[static_cast<size_t>(t)];
      j[name + "_working_set_bytes"] = mp.working_set[static_cast<size_t>(t)];
    }
    for (int l = 0; l < offload::kNumLinks; ++l)
      j[std::string(offload::link_name(static_cast<offload::Link>(l))) + "_bytes"] = mp.link_bytes[static_cast<size_t>(l)];
    if (gpu)
      j["device"] = {{"modeled", true},
                     {"name", gpu->name},
                     {"description", gpu->description},
                     {"peak_tflops", peak_flops / 1e12},
                     {"efficiency", kModeledMfu},
                     {"effective_tflops", peak_flops * kModeledMfu / 1e12},
                     {"memory_gib", gpu->mem_gib},
                     {"pcie_gbs", gpu->pcie_gbs},
                     {"hbm_gbs", gpu->hbm_gbs}};
    else
      j["device"] = {{"modeled", false}, {"backend", o.backend}};
    if (!gpu)
      j["probe"] = {{"extrapolated", shape.scaled()}, {"batch", shape.batch},       {"seq", shape.seq},
                    {"width_div", shape.width_div},    {"vocab", shape.vocab},       {"gflop", shape.gflop},
                    {"model_gflop", shape.model_gflop}};
    j["h2d_gbps"] = link_gbs[0];
    j["d2h_gbps"] = link_gbs[1];
    j["pcie_ms"] = pcie_ms;
    j["nvme_read_gbps"] = bw.read_gbps;
    j["nvme_write_gbps"] = bw.write_gbps;
    j["effective_gflops"] = gflops;
    j["block_forward_ms"] = phases.block_forward_ms;
    j["block_backward_ms"] = phases.block_backward_ms;
    j["edge_ms"] = phases.edge_ms;
    j["adamw_params_per_s"] = adam_rate;
    j["compute_ms"] = f.compute_ms;
    j["adamw_ms"] = f.adamw_ms;
    j["nvme_ms"] = f.nvme_ms;
    j["predicted_step_ms"] = f.predicted_ms;
    j["speculate"] = p.speculate;
    if (replayed) {
      j["replayed_step_ms"] = tl.step_ms;
      j["replayed_stall_ms"] = tl.stall_ms;
      j["replayed_nvme_busy_ms"] = tl.nvme_busy_ms;
      j["replayed_compute_ms"] = tl.compute_ms;
      j["replayed_slowed_ms"] = tl.slowed_ms;
      j["compute_beside_nvme"] = r.interference.compute;
      j["nvme_beside_compute"] = r.interference.disk;
      j["replayed_nvme_overlapped"] = tl.nvme_overlapped;
    }
    if (has_barrier)
      j.update({{"barrier_step_ms", barrier.step_ms},
                {"barrier_window_compute_ms", barrier.window_compute_ms},
                {"barrier_window_io_ms", barrier.window_io_ms},
                {"barrier_read_bytes", barrier.read_bytes},
                {"barrier_write_bytes", barrier.write_bytes},
                {"barrier_room_bytes", barrier.room},
                {"barrier_ms_per_gib", barrier.ms_per_gib}});
    j["update_in_backward"] = p.update_in_backward;
    j["world"] = p.world;
    j["zero_stage"] = o.zero_stage;
    // Per rank, over every tier: what each role's blocks hold (ZeRO stages shard them).
    static const char* const kRoles[] = {"params", "master", "adam", "grads", "activations", "buffers"};
    for (size_t r = 0; r < std::size(kRoles); ++r) {
      uint64_t sum = 0;
      for (const auto& h : mp.homed) sum += h[r];
      j[std::string(kRoles[r]) + "_bytes"] = sum;
    }
    j["comm_bytes_sent_per_rank"] = p.comm_bytes;
    j["comm_bytes_received_per_rank"] = p.comm_bytes;
    j["tp"] = p.tp;
    j["sequence_parallel"] = o.sequence_parallel;
    j["tp_comm_bytes_sent_per_rank"] = p.tp_comm_bytes;
    j["pp"] = p.pp;
    if (p.pp > 1) {
      j["pp_layers"] = p.pp_layers;
      j["pp_stage_shown"] = p.stage;
      j["pp_comm_bytes_sent_per_rank"] = p.pp_comm_bytes;
      j["pp_bubble"] = p.pp_bubble;
      const std::vector<int64_t> balanced =
          balanced_pipeline_layers(phases, model.checkpointing(), model.dims().L, p.pp);
      j["pp_layers_balanced"] = balanced;
      j["pp_compute_ms_balanced"] = pipeline_compute_ms(phases, model.checkpointing(), balanced, o.grad_accum);
      nlohmann::json stages = nlohmann::json::array();
      for (size_t s = 0; s < p.stage_memory.size(); ++s) {
        nlohmann::json st = {{"layers", p.pp_layers[s]}, {"trainable_params", p.stage_params[s]}};
        for (int t = 0; t < 3; ++t)
          st[std::string(offload::tier_name(static_cast<offload::Tier>(t))) + "_budget_bytes"] =
              p.stage_memory[s].budget[static_cast<size_t>(t)];
        stages.push_back(st);
      }
      j["pp_stages"] = stages;
    }
    if (pick) j["auto"] = auto_json(*pick);
    j["optimizer_on_device"] = o.optimizer_on_device;
    j["adamw_cpu_ms"] = r.adamw_cpu_ms;
    j["adamw_device_ms"] = r.adamw_device_ms;
    j["adamw_window_compute_ms"] = r.window_compute_ms;
    nlohmann::json rate, share;  // each phase's achieved rate, and its share of the peak where known
    for (const PhaseRate& ph : phase_rates) {
      rate[ph.key] = ph.flops_per_s / 1e12;
      if (peak > 0) share[ph.key] = ph.flops_per_s / peak;
    }
    j["phase_tflops"] = rate;
    if (peak > 0) {
      j["phase_peak_fraction"] = share;
      j["device_peak_tflops"] = peak / 1e12;
    }
    if (twin) {
      nlohmann::json rows = nlohmann::json::array();
      for (const TwinRow& t : twin->rows)
        rows.push_back({{"optimizer_on_device", t.fraction},
                        {"share", t.share},
                        {"device_bytes", t.device_bytes},
                        {"predicted_step_ms", t.predicted_ms},
                        {"fits", t.fits}});
      j["twin"] = {{"rows", rows}, {"device_budget_bytes", twin->budget}, {"fixed", twin->fixed}};
    }
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print("strata plan: {} params, {} tokens/step ({} x {} x {} micro-batches), {} on {}\n", p.n_params,
             p.tokens_per_step, o.batch, o.seq, o.grad_accum, o.dtype, o.backend);
  if (pick) print_auto_table(*pick, po.train);
  if (twin) {
    if (twin->fixed.empty()) {
      fmt::print("{:<24}{:>10}{:>12}{:>12}\n", "--optimizer-on-device", "on device", "device", "step");
      for (const TwinRow& t : twin->rows)
        fmt::print("{:<24}{:>9.1f}%{:>12}{:>12}\n", t.fraction, 100 * t.share, gib(t.device_bytes),
                   t.fits ? fmt::format("{:.0f} ms", t.predicted_ms) : std::string("over budget"));
    }
    fmt::print("{}\n", twin_line(*twin));
  }
  fmt::print("placement: params {}, grads {}, optimizer {}, activations {} (checkpointing {}); AdamW {}\n",
             o.offload_params, o.offload_grads, o.offload_optimizer, o.offload_activations, o.checkpoint_activations,
             p.pp > 1               ? "after each stage's last backward (pipeline parallel)"
             : p.speculate && o.speculate == "auto"
                 ? "in the backward, speculative (--speculate auto: predicted speculating; the run's first steps time "
                   "both ways and it keeps the faster)"
             : p.speculate          ? "in the backward, speculative (--speculate: redone once the norm clips)"
             : p.update_in_backward ? "in the backward (no clipping)"
                                    : "in the next step's forward");
  if (p.pp > 1) {
    // The split the probed phase times balance best (the head's stage takes fewer layers).
    const std::vector<int64_t> balanced = balanced_pipeline_layers(phases, model.checkpointing(), model.dims().L, p.pp);
    std::string split;
    for (size_t s = 0; s < balanced.size(); ++s) split += (s ? "," : "") + std::to_string(balanced[s]);
    const std::string better =
        balanced == p.pp_layers
            ? std::string(" (the balanced split for these phase times)")
            : fmt::format(" (--pp-layers {} balances the stages better: compute {:.0f} ms instead of {:.0f})", split,
                          pipeline_compute_ms(phases, model.checkpointing(), balanced, o.grad_accum), f.compute_ms);
    std::string layers, pools;
    for (size_t s = 0; s < p.pp_layers.size(); ++s) {
      layers += (s ? "," : "") + std::to_string(p.pp_layers[s]);
      pools += fmt::format("{}stage {}: {}", s ? "; " : "", s,
                           gib(p.stage_memory[s].budget[0] + p.stage_memory[s].budget[1] + p.stage_memory[s].budget[2]));
    }
    fmt::print("pipeline: {} stages of {} layers{}, {} micro-batches in 1F1B: ideal bubble (p-1)/(m+p-1) = {:.1f}%, in "
               "the compute below ((m-1) x the slowest stage's micro-batch + every stage's one). The tiers below are "
               "stage {}'s, the one that holds the most (all tiers: {}). Per step the busiest rank sends {} to its "
               "neighbour stages (2 x B x T x hidden per micro-batch per boundary; its time is not in the "
               "prediction: --metrics pp_comm_ms measures it)\n",
               p.pp, layers, better, o.grad_accum, 100 * p.pp_bubble, p.stage, pools, gib(p.pp_comm_bytes));
  }
  if (p.world > 1 && p.tp == 1 && p.pp == 1)
    fmt::print("ranks: {}, ZeRO stage {}: the tiers below are per rank; each rank sends {} and receives {} per step\n",
               p.world, o.zero_stage, gib(p.comm_bytes), gib(p.comm_bytes));
  if (p.tp > 1)
    fmt::print("ranks: {} ({}{}), ZeRO stage {} over the data-parallel replicas: the tiers below are tp rank 0's "
               "part; per step each rank sends {} over its tp group (Megatron's count; its time is the group's "
               "link's and not in the prediction below: --metrics tp_comm_ms measures it) and {} over its "
               "data-parallel group\n",
               p.world, grid_name(grid_shape(p.world, p.tp, p.pp)), o.sequence_parallel ? ", sequence parallel" : "",
               o.zero_stage, gib(p.tp_comm_bytes), gib(p.comm_bytes));
  else if (p.pp > 1)
    fmt::print("ranks: {} ({}), ZeRO stage {} over the data-parallel replicas: each rank sends {} per step over its "
               "data-parallel group\n",
               p.world, grid_name(grid_shape(p.world, p.tp, p.pp)), o.zero_stage, gib(p.comm_bytes));
  if (gpu)
    fmt::print("device: modeled, not measured: {} ({}): {} peak {:.4g} TFLOP/s dense x {:.1f}% (the MFU measured on "
               "an H200, llama-1b, bench/RESULTS.md) = {:.4g} TFLOP/s over the step's FLOPs; {:.4g} GiB; PCIe {:.3g} "
               "GB/s each way; HBM {}. {}\n",
               gpu->name, gpu->description, dt == DType::f32 ? "fp32" : "bf16", peak_flops / 1e12, kModeledMfu * 100,
               peak_flops * kModeledMfu / 1e12, gpu->mem_gib, gpu->pcie_gbs,
               gpu->hbm_gbs > 0 ? fmt::format("{:.4g} GB/s x {:.0f}%", gpu->hbm_gbs, kModeledHbmEfficiency * 100)
                                : std::string("not given"),
               r.twin() ? "AdamW runs partly on the GPU (--optimizer-on-device), modeled at its memory bandwidth, "
                        "and partly on the CPU: the CPU's rate, and the disk's, are this machine's."
               : adam_on_cpu ? "AdamW runs on the CPU: its rate, and the disk's, are this machine's."
                           : "AdamW runs on the GPU, modeled at its memory bandwidth; the disk's rate is this machine's.");
  else if (shape.scaled())
    fmt::print("compute: extrapolated: the phases timed on a scaled one-block copy (batch {}, seq {}, width 1/{}, "
               "vocab {} of {}: {:.4g} of the model's {:.4g} GFLOP a micro-batch; --probe-gflop {:g}), each "
               "scaled to the model's shape by its FLOPs\n",
               shape.batch, shape.seq, shape.width_div, shape.vocab, p.cfg.vocab_size, shape.gflop,
               shape.model_gflop, probe_gflop);
  else
    fmt::print("compute: the phases timed on a one-block copy at the model's shape{} ({:.4g} GFLOP a micro-batch)\n",
               p.tp > 1 ? " (one tp rank's part, its collectives not run)" : "", shape.model_gflop);
  {  // Per phase: time, achieved rate and, where the device's peak is known, the share of it.
    std::string line;
    for (const PhaseRate& ph : phase_rates)
      line += fmt::format("{}{} {:.3g} ms ({:.4g} TFLOP/s{})", line.empty() ? "" : "; ", ph.label, ph.ms,
                          ph.flops_per_s / 1e12,
                          peak > 0 ? fmt::format(", {:.1f}% of peak", 100 * ph.flops_per_s / peak) : std::string());
    fmt::print("phases: {}{}\n", line,
               peak > 0 ? fmt::format(" (peak {:.4g} TFLOP/s dense {}{})", peak / 1e12, dt == DType::f32 ? "fp32" : "bf16",
                                      gpu ? ", modeled" : "")
                        : std::string());
  }
  fmt::print("\n");
  fmt::print("{:<8}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}\n", "tier", "budget", "minimum", "params",
             "master", "adam", "grads", "activations", "buffers", "no-evict");
  for (int t = 0; t < 3; ++t) {
    const auto& h = mp.homed[static_cast<size_t>(t)];
    fmt::print("{:<8}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}\n",
               offload::tier_name(static_cast<offload::Tier>(t)), gib(mp.budget[static_cast<size_t>(t)]),
               t < 2 ? gib(mp.minimum[static_cast<size_t>(t)]) : "-", gib(h[0]), gib(h[1]), gib(h[2]), gib(h[3]),
               gib(h[4]), gib(h[5]), gib(mp.working_set[static_cast<size_t>(t)]));
  }
  fmt::print("\n{:<14}{:>14}{:>16}{:>12}\n", "per step", "bytes", "rate", "floor");
  for (int l = 0; l < offload::kNumLinks; ++l) {
    const uint64_t b = mp.link_bytes[static_cast<size_t>(l)];
    const double rate = link_gbs[static_cast<size_t>(l)];
    fmt::print("{:<14}{:>14}{:>16}{:>12}\n", offload::link_name(static_cast<offload::Link>(l)), gib(b),
               rate > 0 ? fmt::format("{:.3g} GB/s", rate) : "-",
               f.link_ms[static_cast<size_t>(l)] > 0 ? fmt::format("{:.0f} ms", f.link_ms[static_cast<size_t>(l)]) : "-");
  }
  fmt::print("{:<14}{:>14}{:>16}{:>12}\n", "compute", fmt::format("{:.3g} TFLOP", step_flops(model) * o.grad_accum / 1e12),
             fmt::format("{:.0f} GFLOP/s", gflops), fmt::format("{:.0f} ms", f.compute_ms));
  const int64_t updated = p.pp > 1 ? *std::max_element(p.stage_params.begin(), p.stage_params.end())  // the largest stage's
                                   : model.n_trainable_params();
  if (r.twin()) {  // Twin-Flow: the two parts side by side
    const double on_dev = r.device_params;
    fmt::print("{:<14}{:>14}{:>16}{:>12}\n", "adamw cpu", fmt::format("{:.0f} params", static_cast<double>(updated) - on_dev),
               fmt::format("{:.3g} G/s", adam_rate / 1e9), fmt::format("{:.0f} ms", r.adamw_cpu_ms));
    fmt::print("{:<14}{:>14}{:>16}{:>12}\n", "adamw device", fmt::format("{:.0f} params", on_dev),
               fmt::format("{:.3g} G/s", on_dev / r.adamw_device_ms / 1e6), fmt::format("{:.0f} ms", r.adamw_device_ms));
  } else {
    fmt::print("{:<14}{:>14}{:>16}{:>12}\n", "adamw", fmt::format("{} params", updated),
               fmt::format("{:.3g} G/s", adam_rate / 1e9), fmt::format("{:.0f} ms", f.adamw_ms));
  }
  const auto print_barrier = [&] {
    if (!barred) return;
    fmt::print("norm barrier: no schedule runs this step in under {:.0f} ms with these budgets. The update reads {} "
               "and writes {} on NVMe between the step's last gradient (clipping needs the global norm) and the "
               "next forward, and RAM holds at most {} of either side: {:.0f} ms of I/O in a window of {:.0f} ms "
               "of compute. Each GiB more --host-mem takes up to {:.0f} ms off.\n",
               barrier.step_ms, gib(barrier.read_bytes), gib(barrier.write_bytes), gib(barrier.room),
               barrier.window_io_ms, barrier.window_compute_ms, barrier.ms_per_gib);
  };
  if (replayed) {
    const std::string slowed =
        tl.slowed_ms > 0 ? fmt::format(" ({:.0f} ms of it the disk's traffic taking the cores: compute runs at "
                                       "{:.0f}% beside the disk and the disk at {:.0f}% beside compute ({}), which "
                                       "overlaps {:.0f}% of its busy time)",
                                       tl.slowed_ms, 100 * r.interference.compute, 100 * r.interference.disk,
                                       po.io_interference.empty() ? "probed" : "--io-interference",
                                       100 * tl.nvme_overlapped)
                         : "";
    fmt::print("\npredicted step: {:.0f} ms (the plan replayed: {:.0f} ms, of which compute {:.0f} ms{}, waiting for "
               "blocks {:.0f} ms, NVMe busy {:.0f} ms; the largest floor {:.0f} ms; offload plan {})\n",
               f.predicted_ms, tl.step_ms, tl.compute_ms, slowed, tl.stall_ms, tl.nvme_busy_ms,
               std::max(compute_and_update, f.nvme_ms), mp.policy.empty() ? "none" : mp.policy);
    print_barrier();
    return 0;
  }
  fmt::print("\npredicted step: {:.0f} ms ({}; offload plan {})\n", f.predicted_ms,
             barred && barrier.step_ms >= std::max(compute_and_update, f.nvme_ms)
                 ? "the norm barrier's bound, below"
             : pcie_ms > std::max(compute_and_update, f.nvme_ms) ? "the largest floor: PCIe"
             : f.nvme_ms > compute_and_update ? "the largest floor: NVMe reads + writes"
             : split ? (p.update_in_backward ? "the largest floor: AdamW on the CPU beside the last backward, and the rest of compute"
                                             : "the largest floor: AdamW on the CPU beside the first forward, then the rest of compute")
                     : "the largest floor: compute + AdamW",
             mp.policy.empty() ? "none" : mp.policy);
  print_barrier();
  return 0;
}

}  // namespace

std::string resolve_optimizer_on_device(TrainOptions& o) {
  validate_options(o);
  PlanOptions po;
  po.train = o;
  po.probe_s = kTrainAutoProbeS;
  TwinPick t;
  t.fixed = twin_fixed(o, kernels::parse_backend(o.backend));
  if (!t.fixed.empty()) {  // nothing to choose: no probe
    o.optimizer_on_device = "0";
    return twin_line(t);
  }
  const RunPlan p = plan_run(o, /*minimums=*/false, 1);
  Predictor pred(po, p.cfg, p.lora);
  t = choose_twin(po, pred, o);
  return twin_line(t) + fmt::format(" (from a {:g} s probe)", kTrainAutoProbeS);
}

std::string resolve_offload_auto(TrainOptions& o) {
  validate_options(o);
  PlanOptions po;
  po.train = o;
  po.probe_s = kTrainAutoProbeS;
  const RunPlan p = placement_free_plan(o, 1);
  Predictor pred(po, p.cfg, p.lora);
  const AutoPick a = choose_placement(po, pred);
  o = a.resolved;
  const std::vector<RankedCandidate>& f = a.search.fitting;
  return fmt::format("offload auto: chose {}; runner-up {}; {} of {} placements fit ({}; predicted from a {:g} s "
                     "probe, searched in {:.1f} s)",
                     choice_line(f[0]), f.size() > 1 ? choice_line(f[1]) : std::string("none"), f.size(),
                     a.search.n_candidates, budgets_text(a.budgets, po.train), kTrainAutoProbeS, a.search_s);
}

void register_plan(CLI::App& app, Run& run) {
  auto opts = std::make_shared<PlanOptions>();
  CLI::App* cmd =
      app.add_subcommand("plan", "What a train command would hold per tier and move per step, and its predicted step time");
  add_train_flags(cmd, opts->train);
  // A train command line runs as a plan unchanged, but what only a run writes or reads back
  // (outputs, checkpoints, resume) does not change the plan: accepted, not listed in --help.
  for (const char* flag : {"--metrics", "--out", "--overwrite-model", "--log-every", "--checkpoint-dir",
                           "--checkpoint-every", "--keep", "--resume"})
    cmd->get_option(flag)->group("");
  cmd->add_option("--nvme-bw", opts->nvme_bw, "NVMe bandwidth in GB/s (0: probe the --nvme-path directories, up to 512 MiB written four times and read three times)");
  cmd->add_option("--probe-seconds", opts->probe_s, "seconds per rate probe (the model's phases, AdamW)");
  cmd->add_option("--io-interference", opts->io_interference,
                  "COMPUTE,DISK: compute's speed while the disk moves bytes and the disk's while compute runs, "
                  "each a fraction of its speed alone, instead of probing them with the bandwidth (CPU backend; "
                  "none where --nvme-bw skips the probe)");
  cmd->add_option("--probe-gflop", opts->probe_gflop,
                  fmt::format("the largest one-block micro-batch (GFLOP, forward and backward, with the head) timed "
                              "as is; a larger one is timed scaled down and extrapolated (default {:g}; {:g} on "
                              "--backend cuda)",
                              kDefaultProbeGflop, kDefaultProbeGflopCuda))
      ->default_str("");
  cmd->add_option("--gpu", opts->gpu,
                  "--backend cuda: model this GPU (" + known_gpu_names() +
                      ") from its datasheet instead of probing one; it need not be here");
  cmd->add_option("--gpu-tflops", opts->gpu_tflops, "the modeled GPU's dense peak TFLOP/s for the run's --dtype")->default_str("");
  cmd->add_option("--gpu-mem", opts->gpu_mem_gib, "the modeled GPU's memory in GiB")->default_str("");
  cmd->add_option("--pcie-gbs", opts->pcie_gbs, "the modeled GPU's host link in GB/s each way")->default_str("");
  cmd->add_option("--gpu-hbm-gbs", opts->gpu_hbm_gbs,
                  "the modeled GPU's memory bandwidth in GB/s (needed where AdamW runs on it)")->default_str("");
  cmd->add_flag("--json", opts->json, "one JSON object instead of the tables");
  cmd->add_option("--world", opts->world, "plan one rank of an mpirun job of this many ranks (with --zero-stage)");
  cmd->callback([&run, opts, cmd] {
    apply_offload_auto(*cmd, opts->train);
    opts->probe_gflop_given = cmd->count("--probe-gflop") > 0;
    opts->tflops_given = cmd->count("--gpu-tflops") > 0;
    opts->mem_given = cmd->count("--gpu-mem") > 0;
    opts->pcie_given = cmd->count("--pcie-gbs") > 0;
    opts->hbm_given = cmd->count("--gpu-hbm-gbs") > 0;
    run = [opts]() -> int { return run_plan(*opts); };
  });
}

}  // namespace strata::app
