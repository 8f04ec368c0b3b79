// The training loop: resolve options, allocate once, then per optimizer step: load the step's
// micro-batches, forward+backward each (grads accumulate, scaled so they are the mean over the
// global batch), global norm, clip, AdamW, and report (progress line, --metrics JSONL).
#include "src/train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <fcntl.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/ops.h"
#include "kernels/runtime.h"
#include "src/checked.h"
#include "src/checkpoint/file_util.h"
#include "src/checkpoint/hf.h"
#include "src/checkpoint/train_checkpoint.h"
#include "src/comm/communicator.h"
#include "src/data/doc_rows.h"
#include "src/data/doc_shards.h"
#include "src/data/token_shards.h"
#include "src/model/transformer.h"
#include "kernels/dtype.h"
#include "offload/size.h"
#include "src/optim/adamw.h"
#include "src/optim/schedule.h"
#include "src/train/corpus.h"
#include "src/train/step_driver.h"
#include "src/train/run_guard.h"
#include "src/train/stop_signal.h"
#include "src/train/tiered_memory.h"

namespace strata {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Fault injection for the multi-rank CLI tests: STRATA_TEST_KILL=R:S kills rank R with SIGKILL
// in the middle of step S (its collectives enqueued, the others waiting in them), as a crashed
// node would.
void kill_if_asked(int rank, int64_t step) {
  const char* spec = std::getenv("STRATA_TEST_KILL");
  if (!spec || !*spec) return;
  int r = -1;
  long long s = -1;
  if (std::sscanf(spec, "%d:%lld", &r, &s) == 2 && r == rank && s == step) std::raise(SIGKILL);
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", b, units[u]);
}

std::string human_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

bool has_weights(const fs::path& dir) {
  if (fs::exists(dir / "model.safetensors") || fs::exists(dir / "model.safetensors.index.json")) return true;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") return true;
  return false;
}

// A weight file of a format strata does not read (PyTorch pickles, GGUF, TF, Flax, ONNX), or
// "" when there is none: a directory holding one must not silently train from random init.
std::string unreadable_weight_file(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::string ext = it->path().extension().string();
    if (ext == ".pt" || ext == ".pth" || ext == ".ckpt" || ext == ".gguf" || ext == ".h5" || ext == ".msgpack" ||
        ext == ".onnx" || (ext == ".bin" && name.rfind("pytorch_model", 0) == 0) ||
        name == "pytorch_model.bin.index.json")
      return name;
  }
  return "";
}

uint64_t parse_size_flag(const std::string& text, const std::string& flag) {
  try {
    const uint64_t v = offload::parse_size(text);
    if (v == 0) throw std::invalid_argument("must be positive");
    // A bare number is bytes: below 1 KiB it is a forgotten unit (no budget is that small).
    if (v < 1024 && text.find_first_not_of("0123456789. ") == std::string::npos)
      throw std::invalid_argument(fmt::format("{} bytes: did you mean {}G?", v, text));
    return v;
  } catch (const std::exception& e) {
    throw std::invalid_argument(flag + " '" + text + "': " + e.what() + " (a size such as 512M, 8G, 1.5T)");
  }
}

// dst (n, dtype) = src (n, fp32), round to nearest even, on the host.
void cast_on_host(const float* src, void* dst, int64_t n, DType dt) {
  if (dt == DType::f32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  kernels::cpu::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) d[i] = dt == DType::bf16 ? kernels::f32_to_bf16(src[i]) : kernels::f32_to_f16(src[i]);
  });
}

// The placement table of the header: each tier's pool and what lives there, the bytes the plan
// moves per step by link, and how long start-up took.
void print_placement(std::FILE* out, const MemoryPlan& p, kernels::Backend backend, double startup_s,
                     double weights_s) {
  static const char* const kTier[3] = {"device", "host", "nvme"};
  fmt::print(out, "  memory     {:<7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}{}\n", "tier", "pool", "weights",
             "master", "adam", "grads", "inputs", "buffers",
             backend == kernels::Backend::cpu ? "   (cpu backend: device and host are both RAM)" : "");
  for (int t = 0; t < 3; ++t) {
    auto cell = [&](size_t role) {
      const uint64_t b = p.homed[static_cast<size_t>(t)][role];
      return b ? human_bytes(static_cast<double>(b)) : std::string("-");
    };
    fmt::print(out, "             {:<7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}\n", kTier[t],
               p.budget[static_cast<size_t>(t)] ? human_bytes(static_cast<double>(p.budget[static_cast<size_t>(t)]))
                                                : std::string("-"),
               cell(0), cell(1), cell(2), cell(3), cell(4), cell(5));
  }
  std::string links;
  for (int l = 0; l < offload::kNumLinks; ++l)
    links += fmt::format("{}{} {}", l ? ", " : "", offload::link_name(static_cast<offload::Link>(l)),
                         human_bytes(static_cast<double>(p.link_bytes[static_cast<size_t>(l)])));
  fmt::print(out, "  moves      per step: {} (plan: {})\n", links, p.policy.empty() ? "none" : p.policy);
  fmt::print(out, "  start-up   {:.1f} s: pools and swap files {:.1f} s, weights into their tiers {:.1f} s\n", startup_s,
             startup_s - weights_s, weights_s);
}

}  // namespace

struct Trainer::Impl {
  TrainOptions o;
  ModelConfig cfg;
  std::string model_source;  // for the header
  std::string data_source;
  DType dtype = DType::f32;
  kernels::Backend backend = kernels::Backend::cpu;
  Placement placement;
  std::unique_ptr<Communicator> comm;  // the job's ranks (local: one rank, no MPI)
  Sharding sh;                         // this rank's part of every unit (ZeRO stage)
  std::unique_ptr<kernels::Runtime> rt;
  std::unique_ptr<kernels::Stream> stream;
  std::unique_ptr<kernels::Stream> comm_stream;  // world > 1: the collectives of a step
  std::unique_ptr<kernels::Runtime> cpu_rt;      // CUDA runs with the optimizer on the CPU
  std::unique_ptr<kernels::Stream> cpu_stream;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<TieredMemory> mem;
  std::unique_ptr<StepDriver> driver;
  AdamWConfig adamw;
  LossScaler scaler{false};
  LrScheduleConfig sched;
  std::unique_ptr<EmbeddedCorpusShard> corpus;
  std::unique_ptr<DataLoader> loader;  // a stream of tokens (llm.c), or
  std::unique_ptr<DocRowLoader> docs;  // rows from documents
  std::unique_ptr<DataLoader> val_loader;  // --val-data: a stream, or
  std::unique_ptr<DocRowLoader> val_docs;  // documents
  // Per micro-batch: inputs, targets, then with documents positions and segment starts (N each).
  int64_t arrays = 2;
  std::vector<int32_t> host_tokens;   // (accum, arrays, N)
  std::vector<float> host_losses;     // (accum, N)
  std::vector<double> host_norm2;     // (units) Σ g² per unit
  int32_t* dev_tokens = nullptr;      // same layout as host_tokens, in the step buffers
  int64_t trained_done = 0;           // trained targets so far (all ranks)
  double* dev_norm2 = nullptr;        // (units)
  UniqueFd metrics;                   // --metrics: closed after a failed write (warned once)
  uint64_t metrics_bytes = 0;         // whole lines written so far
  void write_metrics_line(const std::string& line, int64_t step);
  int64_t steps_done = 0;
  int64_t tokens_done = 0;
  int64_t skipped_steps = 0;          // fp16 overflows: AdamW's step count does not advance
  double startup_s = 0;
  double weights_s = 0;  // of startup_s: initialising or loading the weights into their tiers
  offload::OffloadStats last_stats;   // cumulative, at the end of the previous step
  double last_stall = 0;
  // The last step's optimizer step, carried out inside the next step's forward (or by flush()).
  std::optional<PendingUpdate> pending;
  fs::path resumed_from;              // the checkpoint this run continued (empty: a fresh start)
  std::string run_id;                 // this run's identity (trainer.json): rotation removes only its own
  PathLock checkpoint_lock, out_lock; // rank 0: held for the life of the run (run_guard.h)
  std::vector<std::string> resume_changes;  // flags that differ from the checkpoint's run
  int64_t last_checkpoint_step = -1;

  int64_t N() const { return o.batch * o.seq; }
  kernels::Stream& opt_stream() { return cpu_stream ? *cpu_stream : *stream; }
  double busy_ms() const { return stream->busy_ms() + (cpu_stream ? cpu_stream->busy_ms() : 0); }
  // Communication compute waited for: collectives run on the compute stream itself (outside
  // steps) plus the driver's waits for the comm stream's.
  // Communication: all the comm stream ran (collectives, and the sums and copies that finish a
  // reduce-scatter) plus collectives run on other streams.
  double comm_ms() const {
    const double on_comm = comm_stream ? comm_stream->busy_ms() : 0;
    return on_comm + comm->busy_ms() - (comm_stream ? comm->busy_ms(comm_stream.get()) : 0);
  }
  double exposed_ms() const { return comm->busy_ms(stream.get()) + (driver ? driver->exposed_ms() : 0); }
  void init_weights(bool load_weights);
  void flush();
  // The whole of unit u's `role` block from every rank's shard (elements [offset, offset + S)
  // of each rank's block, S = the shard size), in rank order. Collective: every rank calls it in
  // the same order; rank 0 gets numel elements, the others an empty vector.
  std::vector<float> gather_unit(Role role, int u, int64_t offset);
  nlohmann::json state_json() const;
  void restore_state(const nlohmann::json& manifest);
};

// Applies a pending optimizer step on its own (the run is over, or a checkpoint or save needs
// the updated weights): an aside of the memory manager, outside the step's program.
void Trainer::Impl::flush() {
  if (!pending) return;
  mem->begin_step(TieredMemory::Program::update);
  driver->optimizer(pending->st, pending->apply);
  mem->end_step();
  stream->synchronize();
  opt_stream().synchronize();
  pending.reset();
}

// One JSON line, whole or not at all: a single write of the built line; on a failure (disk
// full, I/O error) the partial line is cut off again, one warning names the path and errno,
// and no more metrics are written. Training goes on: metrics are not worth the model.
void Trainer::Impl::write_metrics_line(const std::string& line, int64_t step) {
  if (metrics.get() < 0) return;
  size_t done = 0;
  int err = 0;
  while (done < line.size()) {
    const ssize_t w = ::write(metrics.get(), line.data() + done, line.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      err = w < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(w);
  }
  if (!err) {
    metrics_bytes += done;
    return;
  }
  if (done > 0 && ::ftruncate(metrics.get(), static_cast<off_t>(metrics_bytes)) != 0)
    fmt::print(stderr, "strata: warning: --metrics {}: cannot cut off the partial line of step {}: {}\n", o.metrics,
               step, errno_text());
  fmt::print(stderr,
             "strata: warning: --metrics {}: writing step {} failed: {}; no more metrics are written, training "
             "continues\n",
             o.metrics, step, errno_text(err));
  std::fflush(stderr);
  metrics = UniqueFd();
}

// Every unit's master weights (random init or the checkpoint), its working weights and zeroed
// AdamW state, written unit by unit straight to the tiers they live in. Each block's write home
// starts as soon as it is filled (write_back), so the writes overlap the next units' work; the
// moments of a fresh start are zeroed without writing them (on NVMe: a range the swap file
// records as zeros). Returns once every byte is home.
void Trainer::Impl::init_weights(bool load_weights) {
  std::unique_ptr<HfCheckpoint> ckpt, optim;
  if (!resumed_from.empty()) {
    ckpt = HfCheckpoint::open(resumed_from);
    optim = HfCheckpoint::open_file(resumed_from / "optimizer.safetensors");
  } else if (load_weights) {
    ckpt = HfCheckpoint::open(o.model);
  }
  const bool aliased = mem->master_is_weights();
  // Sharded (stage >= 1): each unit is built whole in `full`, and this rank keeps its shard.
  const bool sharded = sh.sharded_optimizer();
  std::vector<float> full;
  if (sharded) {
    int64_t most = 0;
    for (const Unit& unit : model->units()) most = std::max(most, unit.numel);
    full.resize(static_cast<size_t>(most));
  }
  mem->begin_step(TieredMemory::Program::aside);
  if (!optim)  // first, while no write is in flight (TieredMemory::zero)
    for (size_t u = 0; u < model->units().size(); ++u) mem->zero(Role::adam, static_cast<int>(u));
  for (size_t ui = 0; ui < model->units().size(); ++ui) {
    const int u = static_cast<int>(ui);
    const Unit& unit = model->units()[ui];
    const int64_t n = sharded ? sh.shard(unit.numel) : unit.numel, lo = sharded ? sh.rank * n : 0;
    float* master = static_cast<float*>(mem->acquire(Role::master, u, offload::Mode::write, Side::host));
    float* src = sharded ? full.data() : master;
    if (ckpt)
      model->load_unit(u, *ckpt, src);
    else
      model->init_unit(u, o.seed, src);
    if (!aliased) {  // stage 3: the weights block is this rank's shard
      void* w = mem->acquire(Role::weights, u, offload::Mode::write, Side::host);
      if (sh.sharded_weights())
        cast_on_host(src + lo, w, n, dtype);
      else
        cast_on_host(src, w, unit.numel, dtype);
      mem->release(Role::weights, u);
      mem->write_back(Role::weights, u);
    }
    if (sharded) std::memcpy(master, src + lo, static_cast<size_t>(n) * 4);
    mem->release(Role::master, u);
    mem->write_back(Role::master, u);
    if (!optim) continue;
    // m and v as the unit table lays them out, each over the unit's padded length (sharded:
    // this rank's part of it).
    const AdamLayout al = mem->units()[u].adam_layout();
    void* adam = mem->acquire(Role::adam, u, offload::Mode::write, Side::host);
    std::memset(adam, 0, static_cast<size_t>(al.length()) * 4);
    for (int half = 0; half < 2; ++half) {
      float* dst = static_cast<float*>(adam) + (half == 0 ? al.m_offset() : al.v_offset());
      float* whole = sharded ? full.data() : dst;
      if (sharded) std::fill(full.begin(), full.begin() + unit.numel, 0.f);
      for (int pi : unit.params) {
        const ParamInfo& p = model->params()[static_cast<size_t>(pi)];
        optim->read_into(half == 0 ? exp_avg_name(p.name) : exp_avg_sq_name(p.name), p.shape, whole + p.unit_offset,
                         DType::f32);
      }
      if (sharded) std::memcpy(dst, full.data() + lo, static_cast<size_t>(n) * 4);
    }
    mem->release(Role::adam, u);
    mem->write_back(Role::adam, u);
  }
  mem->end_step();
  mem->drain();  // the start-up includes the writes: the weights are in their tiers
}

namespace {

nlohmann::json options_json(const TrainOptions& o) {
  return {{"model", o.model},
          {"preset", o.preset},
          {"data", o.data},
          {"pack", o.pack},
          {"shuffle", o.shuffle},
          {"epochs", o.epochs},
          {"val_data", o.val_data},
          {"eval_every", o.eval_every},
          {"eval_batches", o.eval_batches},
          {"synthetic_data", o.synthetic_data},
          {"backend", o.backend},
          {"dtype", o.dtype},
          {"batch", o.batch},
          {"seq", o.seq},
          {"grad_accum", o.grad_accum},
          {"steps", o.steps},
          {"lr", o.lr},
          {"lr_schedule", o.lr_schedule},
          {"warmup", o.warmup},
          {"min_lr", o.min_lr},
          {"weight_decay", o.weight_decay},
          {"beta1", o.beta1},
          {"beta2", o.beta2},
          {"eps", o.eps},
          {"grad_clip", o.grad_clip},
          {"loss_scale", o.loss_scale},
          {"seed", o.seed},
          {"offload_params", o.offload_params},
          {"offload_grads", o.offload_grads},
          {"offload_optimizer", o.offload_optimizer},
          {"offload_activations", o.offload_activations},
          {"checkpoint_activations", o.checkpoint_activations},
          {"nvme_path", o.nvme_paths},
          {"device_mem", o.device_mem},
          {"host_mem", o.host_mem},
          {"zero_stage", o.zero_stage}};
}

}  // namespace

// What a checkpoint records besides tensors: enough to continue bit for bit.
nlohmann::json Trainer::Impl::state_json() const {
  nlohmann::json j;
  j["trainer"] = {{"steps_done", steps_done}, {"skipped_steps", skipped_steps}, {"tokens", tokens_done},
                  {"trained_tokens", trained_done}};
  j["loss_scaler"] = {{"enabled", scaler.enabled()}, {"scale", scaler.scale()}, {"good_steps", scaler.good_steps()}};
  if (docs) {
    const DocPosition p = docs->position();
    j["data"] = {{"epoch", p.epoch}, {"document", p.doc}, {"offset", p.offset}, {"documents", docs->n_documents()}};
  } else if (loader)
    j["data"] = {{"shard", loader->shard_index()}, {"position", loader->position()}};
  else
    j["data"] = nullptr;
  j["n_params"] = model->n_params();
  j["flags"] = options_json(o);
  j["run_id"] = run_id;
  return j;
}

void Trainer::Impl::restore_state(const nlohmann::json& man) {
  const std::string where = (resumed_from / "trainer.json").string();
  try {
    const auto& t = man.at("trainer");
    steps_done = t.at("steps_done").get<int64_t>();
    skipped_steps = t.at("skipped_steps").get<int64_t>();
    tokens_done = t.at("tokens").get<int64_t>();
    trained_done = t.value("trained_tokens", int64_t{0});
    if (steps_done < 0 || skipped_steps < 0 || skipped_steps > steps_done || tokens_done < 0)
      throw std::runtime_error("inconsistent step counts");
    const auto& ls = man.at("loss_scaler");
    // The scaler's own invariants: a power of two in [1, 2^99], a non-negative count.
    const double scale = ls.at("scale").get<double>();
    const int64_t good = ls.at("good_steps").get<int64_t>();
    if (!(scale >= 1 && scale <= 0x1p99 && std::exp2(std::round(std::log2(scale))) == scale))
      throw std::runtime_error(fmt::format("loss_scaler.scale {}: must be a power of 2 in [1, 2^99]", scale));
    if (good < 0 || good > INT32_MAX) throw std::runtime_error(fmt::format("loss_scaler.good_steps {}: out of range", good));
    if (ls.at("enabled").get<bool>() == scaler.enabled()) scaler.restore(static_cast<float>(scale), static_cast<int>(good));
    if (man.at("n_params").get<int64_t>() != model->n_params()) throw std::runtime_error("parameter count differs");
    const auto& d = man.at("data");
    if (docs) {
      if (d.is_null() || !d.contains("epoch") || d.at("documents").get<int64_t>() != docs->n_documents())
        throw std::runtime_error(fmt::format(
            "the checkpoint was trained on {}, not on this --data '{}' of {} documents; resume with the --data the "
            "checkpoint was trained on",
            d.is_object() && d.contains("documents")
                ? fmt::format("a data set of {} documents", d["documents"].get<int64_t>())
                : std::string("a token stream"),
            o.data, docs->n_documents()));
      try {
        docs->seek({d.at("epoch").get<int64_t>(), d.at("document").get<int64_t>(), d.at("offset").get<int64_t>()});
      } catch (const std::invalid_argument& e) {
        throw std::runtime_error(std::string(e.what()) + "; resume with the --data and --pack the checkpoint was trained on");
      }
    } else if (loader && !d.is_null()) {
      if (d.contains("epoch"))
        throw std::runtime_error("the checkpoint was trained on documents (rows from NAME.docs), but this --data is a "
                                 "token stream; resume with the --data the checkpoint was trained on");
      const int64_t shard = d.at("shard").get<int64_t>(), position = d.at("position").get<int64_t>();
      try {
        loader->seek(shard, position);
      } catch (const std::invalid_argument&) {
        const auto& f = man.contains("flags") ? man["flags"] : nlohmann::json::object();
        const std::string was = f.is_object() && f.contains("data") && f["data"].is_string()
                                    ? "'" + f["data"].get<std::string>() + "'"
                                    : std::string("its data");
        throw std::runtime_error(fmt::format(
            "the checkpoint stopped at token {} of shard {} of {}, which this run's --data '{}' does not have (a "
            "different dataset?); resume with the --data the checkpoint was trained on",
            position, shard + 1, was, o.data.empty() ? "(embedded corpus)" : o.data));
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(where + ": malformed trainer state: " + e.what());
  } catch (const std::exception& e) {
    throw std::runtime_error(where + ": " + e.what());
  }
  if (steps_done >= o.steps)
    throw std::invalid_argument("--resume " + resumed_from.string() + ": the checkpoint is at step " +
                                std::to_string(steps_done) + " and --steps is " + std::to_string(o.steps) +
                                ": nothing left to train (raise --steps)");
  last_checkpoint_step = steps_done;
  // What the user changed since the checkpoint's run (allowed; shown in the header).
  const nlohmann::json now = options_json(o);
  if (man.contains("flags") && man["flags"].is_object())
    for (const auto& [k, v] : man["flags"].items())
      if (now.contains(k) && now[k] != v) {
        std::string flag = k;
        std::replace(flag.begin(), flag.end(), '_', '-');
        resume_changes.push_back(fmt::format("--{} {} (was {})", flag, now[k].dump(), v.dump()));
      }
}

namespace {

// Everything a run's options determine before any data or memory: validated flags, the model
// config and where it comes from, precision, placement. Shared by the trainer and `strata plan`.
struct ResolvedRun {
  ModelConfig cfg;
  std::string model_source;
  bool load_weights = false;
  DType dtype = DType::f32;
  kernels::Backend backend = kernels::Backend::cpu;
  LrSchedule schedule = LrSchedule::cosine;
  Checkpointing ckpt;
  Placement placement;
  fs::path resume;  // the checkpoint to continue from (empty: a fresh start)
  std::vector<fs::path> data_files, val_files;  // --data, --val-data shards
  bool documents = false;      // --data has document offsets: rows from documents
  bool val_documents = false;  // --val-data has
};

// Which shards make rows from documents; refuses flags that need documents on a stream, and a
// stream whose shards carry loss masks (a mask without document offsets is not what `strata
// data` writes, and training every target of it would ignore the mask).
bool data_has_documents(const std::vector<fs::path>& files, const std::string& flag) {
  const bool docs = shards_have_documents(files);
  if (!docs)
    for (const fs::path& f : files)
      if (fs::exists(shard_mask_path(f)))
        throw std::runtime_error(flag + " " + f.string() + ": has a loss mask (" + shard_mask_path(f).filename().string() +
                                 ") but no document offsets (" + shard_docs_path(f).filename().string() +
                                 "); write the data set with `strata data`");
  return docs;
}

std::string flag_value(double v) { return fmt::format("{:g}", v); }

// Every numeric flag, before anything is read or allocated: non-finite, negative or absurd
// values are one-line errors naming the flag (a NaN learning rate trains to NaN weights; a
// product of sizes that overflows divides by zero later).
void validate_options(const TrainOptions& o) {
  auto positive = [](int64_t v, const char* flag) {
    if (v <= 0) throw std::invalid_argument(std::string(flag) + " must be positive, got " + std::to_string(v));
  };
  positive(o.batch, "--batch");
  positive(o.seq, "--seq");
  positive(o.grad_accum, "--grad-accum");
  if (o.epochs < 0) throw std::invalid_argument("--epochs must not be negative, got " + std::to_string(o.epochs));
  if (o.steps != 0 || o.epochs == 0) positive(o.steps, "--steps");
  if (o.pack != "off" && o.pack != "on")
    throw std::invalid_argument("--pack " + o.pack + ": must be off (one document per row) or on (documents packed "
                                "into rows, attention kept inside each)");
  if (o.eval_every < 0 || o.eval_batches < 0)
    throw std::invalid_argument("--eval-every and --eval-batches must not be negative (0: only at the start and the "
                                "end; 0: the whole held-out set)");
  if ((o.eval_every > 0 || o.eval_batches > 0) && o.val_data.empty())
    throw std::invalid_argument("--eval-every and --eval-batches need --val-data (the held-out shards, e.g. the "
                                "val_*.bin that `strata data --val-docs N` wrote)");
  positive(o.log_every, "--log-every");
  if (o.warmup < 0) throw std::invalid_argument("--warmup must not be negative, got " + std::to_string(o.warmup));
  // Token counts: B·T per micro-batch (int32 positions in the kernels), ·accum per step, ·steps
  // in all, and the step buffers' bytes, each overflow-checked.
  const int64_t bt = checked_mul(o.batch, o.seq, "--batch x --seq");
  if (bt > (int64_t{1} << 31) - 1)
    throw std::invalid_argument(fmt::format("--batch {} x --seq {} = {} tokens per micro-batch is beyond what strata "
                                            "supports (at most 2^31 - 1); use a smaller --batch and --grad-accum",
                                            o.batch, o.seq, bt));
  const int64_t per_step = checked_mul(bt, o.grad_accum, "--batch x --seq x --grad-accum");
  checked_mul(per_step, int64_t{4 * sizeof(int32_t)}, "step token buffer bytes");
  checked_mul(per_step, o.steps, "tokens in the run (--batch x --seq x --grad-accum x --steps)");
  // Learning rates and AdamW: finite, in range. Beyond 1e6 no learning rate means anything (and
  // 1e300 is infinity once it is a float).
  constexpr double kMaxLr = 1e6;
  auto in_range = [](double v, double lo, double hi, const char* flag, const char* range) {
    if (!(std::isfinite(v) && v >= lo && v <= hi))
      throw std::invalid_argument(std::string(flag) + " " + flag_value(v) + ": must be " + range);
  };
  // 0 is allowed (as torch.optim.AdamW does): the weights stay as loaded, decay included, so a
  // run measures loss and grad norm of a checkpoint and --out re-saves it unchanged.
  in_range(o.lr, 0, kMaxLr, "--lr", "a finite number in [0, 1e6]");
  in_range(o.min_lr, 0, kMaxLr, "--min-lr", "a finite number in [0, 1e6]");
  in_range(o.weight_decay, 0, kMaxLr, "--weight-decay", "a finite number in [0, 1e6]");
  if (!(std::isfinite(o.beta1) && o.beta1 >= 0 && o.beta1 < 1))
    throw std::invalid_argument("--beta1 " + flag_value(o.beta1) + ": must be in [0, 1)");
  if (!(std::isfinite(o.beta2) && o.beta2 >= 0 && o.beta2 < 1))
    throw std::invalid_argument("--beta2 " + flag_value(o.beta2) + ": must be in [0, 1)");
  // eps is used as a float: it must stay a positive normal float.
  in_range(o.eps, 1e-30, 1, "--eps", "a finite number in [1e-30, 1] (e.g. 1e-8)");
  in_range(o.grad_clip, 0, 1e30, "--grad-clip", "a number in [0, 1e30] (0 = off)");
  // A power of two keeps scaling and unscaling exact; the scaler never goes below 1.
  if (!(o.loss_scale >= 1 && o.loss_scale <= 1e30 && std::exp2(std::round(std::log2(o.loss_scale))) == o.loss_scale))
    throw std::invalid_argument("--loss-scale " + flag_value(o.loss_scale) + ": must be a power of 2 in [1, 2^99] (e.g. 65536)");
  if (o.zero_stage < 0 || o.zero_stage > 3)
    throw std::invalid_argument(fmt::format("--zero-stage {}: must be 0 (data parallel), 1 (optimizer state sharded), "
                                            "2 (gradients sharded too) or 3 (working weights sharded too)",
                                            o.zero_stage));
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  if (o.threads < 0 || static_cast<unsigned>(o.threads) > 4 * hw)
    throw std::invalid_argument(fmt::format("--threads {}: must be between 0 (all cores) and {} (4 x the {} hardware "
                                            "threads of this machine)",
                                            o.threads, 4 * hw, hw));
}

ResolvedRun resolve_run(const TrainOptions& o) {
  ResolvedRun r;
  validate_options(o);
  r.dtype = kernels::parse_dtype(o.dtype);
  r.backend = kernels::parse_backend(o.backend);
  if (!kernels::backend_trains(r.backend))
    throw std::invalid_argument("--backend " + o.backend +
                                ": the CUDA op set is not built yet (only the CUDA runtime is); use --backend cpu");
  r.schedule = parse_lr_schedule(o.lr_schedule);
  r.ckpt = parse_checkpointing(o.checkpoint_activations);
  Placement& pl = r.placement;
  pl.params = parse_offload(o.offload_params, "--offload-params");
  pl.grads = parse_offload(o.offload_grads, "--offload-grads");
  pl.optimizer = parse_offload(o.offload_optimizer, "--offload-optimizer");
  pl.activations = parse_offload(o.offload_activations, "--offload-activations");
  if (pl.activations != offload::Tier::device && !r.ckpt.any())
    throw std::invalid_argument("--offload-activations " + o.offload_activations +
                                " moves the kept inputs of checkpointed blocks: it needs --checkpoint-activations "
                                "full or every:N");
  pl.nvme_paths = o.nvme_paths;
  pl.norm_free = o.update_in_backward && o.grad_clip <= 0 && r.dtype != DType::f16;
  if (pl.uses_nvme() && pl.nvme_paths.empty())
    throw std::invalid_argument("an --offload-* flag is nvme but no --nvme-path DIR was given (a directory on the SSD "
                                "for swap files)");
  if (!o.device_mem.empty()) pl.device_mem = parse_size_flag(o.device_mem, "--device-mem");
  if (!o.host_mem.empty()) pl.host_mem = parse_size_flag(o.host_mem, "--host-mem");

  // Model config: --model DIR, --preset NAME or the embedded default.
  if (!o.model.empty()) {
    const fs::path dir(o.model);
    std::error_code ec;
    const fs::file_status st = fs::status(dir, ec);
    if (ec == std::errc::too_many_symbolic_link_levels)
      throw std::runtime_error("--model " + o.model + ": a loop of symbolic links; point it at the model directory");
    if (!fs::exists(st)) throw std::runtime_error("--model " + o.model + ": does not exist");
    if (!fs::is_directory(st))
      throw std::runtime_error("--model " + o.model + ": not a directory (a Hugging Face model directory: config.json "
                               "and *.safetensors)");
    if (!fs::exists(dir / "config.json")) throw std::runtime_error("--model " + o.model + ": no config.json in it");
    r.cfg = read_hf_config(dir / "config.json");
    r.load_weights = has_weights(dir);
    if (const std::string other = unreadable_weight_file(dir); !r.load_weights && !other.empty())
      throw std::runtime_error("--model " + o.model + ": its weights are in " + other +
                               ", a format strata does not read (it reads safetensors: model.safetensors, or "
                               "model-0000k-of-0000n.safetensors with model.safetensors.index.json); convert them, "
                               "e.g. with transformers' save_pretrained(dir, safe_serialization=True)");
    r.model_source = o.model + (r.load_weights ? " (safetensors)" : " (config only: random init)");
  } else if (!o.preset.empty()) {
    r.cfg = preset_model_config(o.preset);
    r.model_source = "preset " + o.preset + " (random init)";
  } else {
    r.cfg = default_model_config();
    r.model_source = "embedded default (random init)";
  }
  r.cfg.validate();
  if (o.checkpoint_every < 0) throw std::invalid_argument("--checkpoint-every must be >= 0 (0 = only at the end)");
  if (o.keep < 1) throw std::invalid_argument("--keep must be at least 1");
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty())
    throw std::invalid_argument("--checkpoint-every needs --checkpoint-dir DIR (where to write them)");
  if (!o.resume.empty()) {
    r.resume = find_resume_checkpoint(o.resume, o.checkpoint_dir);
    if (!r.resume.empty()) {
      // The model is the checkpoint's; a --model or --preset given again must describe it.
      ModelConfig saved = read_hf_config(r.resume / "config.json");
      ModelConfig given = r.cfg;
      given.torch_dtype = saved.torch_dtype;
      if ((!o.model.empty() || !o.preset.empty()) && !(given == saved))
        throw std::invalid_argument("--resume " + r.resume.string() + ": the checkpoint's model (config.json) differs from " +
                                    (o.model.empty() ? "--preset " + o.preset : "--model " + o.model) +
                                    "; resume with the model it was trained from");
      r.cfg = saved;
      r.cfg.validate();
      r.load_weights = true;
      r.model_source = r.resume.string() + " (training checkpoint)";
    }
  }
  if (o.seq > r.cfg.max_position_embeddings)
    throw std::invalid_argument("--seq " + std::to_string(o.seq) + " exceeds the model's max_position_embeddings (" +
                                std::to_string(r.cfg.max_position_embeddings) + ")");
  if (!o.data.empty() && !o.synthetic_data) {
    r.data_files = expand_glob(o.data);
    r.documents = data_has_documents(r.data_files, "--data");
  }
  if (!o.val_data.empty()) {
    r.val_files = expand_glob(o.val_data);
    r.val_documents = data_has_documents(r.val_files, "--val-data");
  }
  if (!r.documents && (o.pack != "off" || o.shuffle || o.epochs > 0)) {
    const std::string flag = o.pack != "off" ? "--pack on" : o.shuffle ? "--shuffle" : "--epochs";
    throw std::invalid_argument(flag + " works on documents: " +
                                (o.data.empty() ? std::string("the embedded corpus is a token stream")
                                                : "--data " + o.data + " has no document offsets (NAME.docs)") +
                                "; write the data with `strata data` (it records where each document starts)");
  }
  return r;
}

// Per micro-batch: inputs and targets, and with documents (training or held-out) positions and
// segment starts.
int64_t token_arrays(const ResolvedRun& r) { return r.documents || r.val_documents ? 4 : 2; }
// The step buffers beside the model: the micro-batches' tokens, then one fp64 per unit.
size_t token_buffer_bytes(const TrainOptions& o, int64_t arrays) {
  return (static_cast<size_t>(o.grad_accum * arrays * o.batch * o.seq) * sizeof(int32_t) + 63) / 64 * 64;
}
size_t step_buffer_bytes(const TrainOptions& o, const ResolvedRun& r, size_t n_units) {
  return token_buffer_bytes(o, token_arrays(r)) + n_units * sizeof(double);
}

}  // namespace

uint64_t comm_bytes_per_step(const Transformer& model, const Sharding& sh, int64_t grad_accum) {
  if (sh.world <= 1) return 0;
  const double part = static_cast<double>(sh.world - 1) / sh.world;
  const double esz = static_cast<double>(kernels::dtype_size(model.dtype()));
  double b = 0;
  for (const Unit& u : model.units()) {
    const double n = static_cast<double>(u.numel);
    const double accum = static_cast<double>(grad_accum);
    if (sh.stage <= 1) b += 2 * part * n * 4;                        // grads all-reduced
    if (sh.stage == 1 || sh.stage == 2) b += part * n * esz;         // new weights all-gathered
    if (sh.stage >= 2) b += part * n * 4 * accum;                    // grads reduce-scattered
    if (sh.stage >= 3) b += part * n * esz * accum;                  // gathered for the forward
  }
  // Stage 3 gathers each block again for its backward (the final norm and the head are used
  // once, forward and backward in one phase; a tied head is the embedding, still gathered).
  if (sh.stage >= 3)
    for (int64_t l = 0; l < model.dims().L; ++l)
      b += part * static_cast<double>(model.units()[static_cast<size_t>(model.block_unit(l))].numel) * esz *
           static_cast<double>(grad_accum);
  return static_cast<uint64_t>(b);
}

namespace {
// One rank of a `world`-rank run, sized for planning: its model on a CPU runtime (shapes only, no
// device needed) and its placement with this rank's sharding.
struct SizedRun {
  ResolvedRun r;
  std::unique_ptr<kernels::Runtime> rt = kernels::make_runtime(kernels::Backend::cpu);
  Transformer model;
  size_t step_buffers;
  SizedRun(const TrainOptions& o, int world)
      : r(resolve_run(o)),
        model(r.cfg, r.dtype, o.batch, o.seq, *rt, r.ckpt, kLogitsChunkBytes, world),
        step_buffers(step_buffer_bytes(o, r, model.units().size())) {
    r.placement.sharding = Sharding{o.zero_stage, world, 0};
  }
};
}  // namespace

RunPlan plan_run(const TrainOptions& o, bool minimums, int world) {
  if (world < 1) throw std::invalid_argument("--world must be at least 1, got " + std::to_string(world));
  const SizedRun run(o, world);
  RunPlan p;
  p.memory = TieredMemory::plan(run.model, run.r.backend, run.r.placement, o.grad_accum, run.step_buffers, minimums);
  p.cfg = run.r.cfg;
  p.n_params = run.model.n_params();
  p.tokens_per_step = o.batch * o.seq * o.grad_accum * world;
  p.world = world;
  p.update_in_backward = run.r.placement.update_in_backward();
  p.comm_bytes = comm_bytes_per_step(run.model, run.r.placement.sharding, o.grad_accum);
  return p;
}

offload::StepTimeline estimate_run(const TrainOptions& o, const RunPlan& p, const StepCosts& costs) {
  const SizedRun run(o, p.world);
  return TieredMemory::estimate(run.model, run.r.backend, run.r.placement, o.grad_accum, run.step_buffers,
                                p.memory.budget, costs);
}

Trainer::Trainer(const TrainOptions& opts) : impl_(std::make_unique<Impl>()) {
  const auto t_start = Clock::now();
  Impl& m = *impl_;
  m.o = opts;
  const TrainOptions& o = m.o;
  validate_options(o);
  // The job's ranks (mpirun), then (rank 0) the checkpoint directory locked before the checkpoint
  // to resume is looked for in it: another run rotating it meanwhile would remove that one.
  m.comm = make_communicator(kernels::parse_backend(o.backend));
  if (m.comm->rank() == 0 && !o.checkpoint_dir.empty()) {
    prepare_checkpoint_dir(o.checkpoint_dir);
    m.checkpoint_lock = PathLock::acquire(dir_lock_file(o.checkpoint_dir), "--checkpoint-dir " + o.checkpoint_dir,
                                          /*remove_on_release=*/true);
    remove_dead_checkpoint_temporaries(o.checkpoint_dir);
  }
  ResolvedRun r = resolve_run(o);
  m.cfg = r.cfg;
  m.model_source = r.model_source;
  m.dtype = r.dtype;
  m.backend = r.backend;
  m.placement = r.placement;
  // This rank's shard of every unit.
  m.sh = Sharding{o.zero_stage, m.comm->world(), m.comm->rank()};
  m.placement.sharding = m.sh;
  // Every rank started with the same flags, model and checkpoint: a difference would hang the
  // job or train something else than asked.
  check_ranks_agree(*m.comm, o, m.cfg, r.resume);
  const bool rank0 = m.sh.rank == 0;
  const Placement& pl = m.placement;
  nlohmann::json manifest;
  if (!r.resume.empty()) {  // verified (sizes, checksums) before anything is allocated
    try {
      manifest = verify_train_checkpoint(r.resume);
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string(e.what()) + "; " + older_checkpoint_hint(r.resume));
    }
    m.resumed_from = r.resume;
    if (manifest.contains("run_id") && manifest["run_id"].is_string()) m.run_id = manifest["run_id"].get<std::string>();
  }
  if (m.run_id.empty()) m.run_id = new_run_id();
  // Rank 0 alone writes --out, checkpoints and metrics. Before anything is written: what this run
  // reads is kept apart from what it writes, then --checkpoint-dir and --out are locked for the
  // life of the run, then the checkpoint directory must hold this run's checkpoints only.
  const std::vector<fs::path>& data_files = r.data_files;
  if (rank0) {
    RunPaths reads;
    reads.resume = r.resume;
    if (!o.model.empty()) {
      reads.model_dir = o.model;
      std::error_code ec;
      for (fs::directory_iterator it(o.model, ec), end; !ec && it != end; it.increment(ec))
        reads.model_files.push_back(it->path());
    }
    reads.data_files = data_files;
    reads.data_files.insert(reads.data_files.end(), r.val_files.begin(), r.val_files.end());
    check_run_paths(o, reads);
  }
  if (rank0 && !o.checkpoint_dir.empty()) {
    const std::vector<std::string> others = checkpoints_of_other_runs(o.checkpoint_dir, m.run_id, r.resume.empty());
    if (!others.empty()) {
      std::string list;
      for (size_t i = 0; i < others.size() && i < 3; ++i) list += (i ? ", " : "") + others[i];
      if (others.size() > 3) list += fmt::format(" and {} more", others.size() - 3);
      throw std::runtime_error(
          "--checkpoint-dir " + o.checkpoint_dir + " holds checkpoints of another run (" + list + "); " +
          (r.resume.empty() ? "continue that run with --resume auto, or give this run another --checkpoint-dir"
                            : "give this run a --checkpoint-dir of its own") +
          " (strata never writes over or rotates away another run's checkpoints)");
    }
  }
  if (rank0 && !o.out.empty()) {
    // Locked first (the lock file sits beside --out), then the save's own rules, so a finished
    // run is never lost at the end; they also clear what dead runs left beside it.
    std::error_code ec;
    fs::create_directories(dir_lock_file(o.out).parent_path(), ec);
    m.out_lock = PathLock::acquire(dir_lock_file(o.out), "--out " + o.out, /*remove_on_release=*/true);
    try {
      check_hf_save_target(o.out);
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("--out ") + e.what());  // the messages start with the path
    }
  }
  // Data.
  if (o.synthetic_data) {
    m.data_source = "synthetic (fixed random tokens)";
  } else if (o.data.empty()) {
    if (m.cfg.vocab_size < 256)
      throw std::invalid_argument("the embedded corpus is byte-level (256 token ids) but the model's vocab_size is " +
                                  std::to_string(m.cfg.vocab_size) + "; pass --data");
    m.corpus = std::make_unique<EmbeddedCorpusShard>();
    m.loader = std::make_unique<DataLoader>(std::vector<fs::path>{m.corpus->path()}, o.batch, o.seq, m.sh.rank, m.sh.world,
                                            m.cfg.vocab_size);
    m.data_source = fmt::format("embedded corpus ({} byte-level tokens)", m.corpus->n_tokens());
  } else if (r.documents) {
    DocRowsOptions d{o.batch, o.seq, m.sh.rank, m.sh.world, m.cfg.vocab_size, o.pack == "on", o.shuffle, o.seed,
                     o.epochs};
    m.docs = std::make_unique<DocRowLoader>(data_files, d);
    m.data_source = fmt::format("{} ({} shard{}, {} documents, {} tokens{}): rows from documents, {}{}", o.data,
                                data_files.size(), data_files.size() == 1 ? "" : "s", m.docs->n_documents(),
                                m.docs->n_tokens(), m.docs->has_mask() ? ", loss mask" : "",
                                o.pack == "on" ? "packed (attention inside each document)"
                                               : "one per row (cut to --seq + 1 tokens, padded)",
                                o.shuffle ? ", shuffled each epoch" : "");
    // --epochs: as many steps as the epochs' rows take (the last step's missing rows are
    // padding), or --steps if that ends first.
    if (o.epochs > 0) {
      const int64_t rows = m.docs->rows_for_epochs(o.epochs);
      const int64_t per_step = o.batch * o.grad_accum * m.sh.world;
      const int64_t steps = (rows + per_step - 1) / per_step;
      m.o.steps = o.steps > 0 ? std::min(o.steps, steps) : steps;
      m.data_source += fmt::format("; {} epoch{} = {} rows = {} steps", o.epochs, o.epochs == 1 ? "" : "s", rows, steps);
    }
  } else {
    const auto& shards = data_files;
    m.loader = std::make_unique<DataLoader>(shards, o.batch, o.seq, m.sh.rank, m.sh.world, m.cfg.vocab_size);
    m.data_source = fmt::format("{} ({} shard{})", o.data, shards.size(), shards.size() == 1 ? "" : "s");
  }
  if (r.val_documents) {
    m.val_docs = std::make_unique<DocRowLoader>(
        r.val_files, DocRowsOptions{o.batch, o.seq, m.sh.rank, m.sh.world, m.cfg.vocab_size, o.pack == "on", false, 0, 1});
  } else if (!r.val_files.empty()) {
    m.val_loader =
        std::make_unique<DataLoader>(r.val_files, o.batch, o.seq, m.sh.rank, m.sh.world, m.cfg.vocab_size);
  }
  m.arrays = token_arrays(r);

  // Runtime, model, the tiered memory of its blocks (budgets checked before anything big is
  // allocated), then the weights, written unit by unit to their tiers.
  if (m.backend == kernels::Backend::cpu) kernels::cpu::set_num_threads(o.threads);
  m.rt = kernels::make_runtime(m.backend);
  m.stream = m.rt->create_stream();
  // Collectives get a stream of their own, so they overlap compute (StepDriver).
  if (m.sh.world > 1) m.comm_stream = m.rt->create_stream();
  kernels::Runtime* opt_rt = m.rt.get();
  // AdamW next to its state: on a CPU runtime and stream of its own when the compute device is
  // not the CPU. STRATA_TEST_SEPARATE_OPTIMIZER_RUNTIME=1 does the same on the CPU backend, so
  // the tests here drive the two-runtime code a GPU run takes (events and streams of two
  // runtimes, the optimizer's releases on its own stream) without a GPU.
  static const bool separate_for_tests = [] {
    const char* e = std::getenv("STRATA_TEST_SEPARATE_OPTIMIZER_RUNTIME");
    return e && std::string_view(e) == "1";
  }();
  if ((m.backend != kernels::Backend::cpu || separate_for_tests) && pl.optimizer != offload::Tier::device) {
    kernels::cpu::set_num_threads(o.threads);
    m.cpu_rt = kernels::make_runtime(kernels::Backend::cpu);
    m.cpu_stream = m.cpu_rt->create_stream();
    opt_rt = m.cpu_rt.get();
  }
  m.model = std::make_unique<Transformer>(m.cfg, m.dtype, o.batch, o.seq, *m.rt, r.ckpt, kLogitsChunkBytes, m.sh.world);
  const int64_t n = m.N();
  const size_t n_units = m.model->units().size();
  m.mem = std::make_unique<TieredMemory>(*m.model, *m.rt, *m.stream, *opt_rt, m.opt_stream(), pl, o.grad_accum,
                                         step_buffer_bytes(o, r, n_units), m.comm_stream.get());
  m.dev_tokens = static_cast<int32_t*>(m.mem->extra_device());
  m.dev_norm2 = reinterpret_cast<double*>(static_cast<char*>(m.mem->extra_device()) + token_buffer_bytes(o, m.arrays));
  m.driver = std::make_unique<StepDriver>(*m.model, *m.mem, m.sh, m.comm.get());
  const auto t_weights = Clock::now();
  m.init_weights(r.load_weights);
  m.weights_s = ms_since(t_weights) / 1e3;

  m.adamw.beta1 = static_cast<float>(o.beta1);
  m.adamw.beta2 = static_cast<float>(o.beta2);
  m.adamw.eps = static_cast<float>(o.eps);
  m.adamw.weight_decay = static_cast<float>(o.weight_decay);
  m.scaler = LossScaler(m.dtype == DType::f16, static_cast<float>(o.loss_scale));
  m.sched = LrScheduleConfig{r.schedule, o.lr, o.min_lr, o.warmup, o.steps};

  m.host_tokens.assign(static_cast<size_t>(o.grad_accum * m.arrays * n), 0);
  m.host_losses.assign(static_cast<size_t>(o.grad_accum * n), 0.f);
  m.host_norm2.assign(n_units, 0.0);
  if (o.synthetic_data) {  // fixed tokens, uniform over the vocab, from the seed (and the rank)
    uint64_t s = (o.seed + static_cast<uint64_t>(m.sh.rank) * 0x2545f4914f6cdd1dull) * 0x9e3779b97f4a7c15ull + 1;
    for (int32_t& t : m.host_tokens) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      t = static_cast<int32_t>(s % static_cast<uint64_t>(m.cfg.vocab_size));
    }
  }
  if (!m.resumed_from.empty()) m.restore_state(manifest);
  m.stream->synchronize();
  m.opt_stream().synchronize();
  m.last_stats = m.mem->stats();
  // Last, after every check: a run that fails to start leaves an earlier metrics file intact.
  if (rank0 && !o.metrics.empty()) {
    // Appended to, never truncated: an earlier run's lines stay (check_run_paths made sure the
    // file is a metrics file). One writer at a time.
    // A FIFO or a device (/dev/stdout, `--metrics >(jq ...)`) is a stream: opened for writing
    // only, never locked or cut.
    std::error_code ec;
    const bool regular = !fs::exists(o.metrics, ec) || fs::is_regular_file(o.metrics, ec);
    m.metrics = UniqueFd(::open(o.metrics.c_str(), (regular ? O_RDWR | O_CREAT : O_WRONLY) | O_CLOEXEC | O_APPEND, 0644));
    if (m.metrics.get() < 0)
      throw std::runtime_error("--metrics " + o.metrics + ": cannot open for writing: " + errno_text());
    if (regular && lock_exclusive(m.metrics.get(), "--metrics " + o.metrics) == LockResult::held_elsewhere)
      throw std::runtime_error("--metrics " + o.metrics + ": another strata run is writing it; give this run a "
                               "metrics file of its own");
    const off_t end = ::lseek(m.metrics.get(), 0, SEEK_END);
    m.metrics_bytes = end > 0 ? static_cast<uint64_t>(end) : 0;
    if (regular && m.metrics_bytes > 0) {
      // Cut: a last line without its newline (what a killed writer left, so the next line starts
      // clean) and, in a resumed run, the lines its own earlier part wrote past the checkpoint
      // (killed after its last checkpoint; those steps are about to be trained again): the file's
      // tail of lines of this run id (or of none: written before run ids) with a later step.
      // Another run's lines are never cut. A fresh run reads only the file's end.
      const bool resumed = !m.resumed_from.empty();
      const uint64_t from = resumed ? 0 : m.metrics_bytes - std::min<uint64_t>(m.metrics_bytes, 1 << 20);
      std::string text(m.metrics_bytes - from, '\0');
      if (::pread(m.metrics.get(), text.data(), text.size(), static_cast<off_t>(from)) !=
          static_cast<ssize_t>(text.size()))
        throw std::runtime_error("--metrics " + o.metrics + ": cannot read it: " + errno_text());
      const size_t whole = text.back() == '\n' ? text.size() : text.rfind('\n') + 1;  // npos + 1 == 0
      uint64_t keep = whole == 0 && from > 0 ? m.metrics_bytes : from + whole;  // (no line end in 1 MiB: leave it)
      if (resumed) {
        keep = 0;
        for (size_t at = 0; at < whole;) {
          const size_t eol = text.find('\n', at) + 1;
          const nlohmann::json j = nlohmann::json::parse(text.substr(at, eol - at), nullptr, false);
          const bool ours = j.is_object() && (!j.contains("run_id") || j["run_id"] == m.run_id);
          const bool stale = ours && j.contains("step") && j["step"].is_number_integer() &&
                             j["step"].get<int64_t>() > m.steps_done;
          if (!stale) keep = eol;
          at = eol;
        }
      }
      if (keep < m.metrics_bytes) {
        if (::ftruncate(m.metrics.get(), static_cast<off_t>(keep)) != 0)
          throw std::runtime_error("--metrics " + o.metrics + ": cannot cut its unfinished or stale lines: " +
                                   errno_text());
        m.metrics_bytes = keep;
      }
    }
  }
  m.startup_s = ms_since(t_start) / 1e3;
}

Trainer::~Trainer() = default;

const ModelConfig& Trainer::config() const { return impl_->cfg; }
int64_t Trainer::n_params() const { return impl_->model->n_params(); }
int64_t Trainer::tokens_per_step() const { return impl_->N() * impl_->o.grad_accum * impl_->sh.world; }
int Trainer::rank() const { return impl_->sh.rank; }
int Trainer::world() const { return impl_->sh.world; }
size_t Trainer::device_bytes() const { return impl_->mem->memory_plan().budget[0]; }
size_t Trainer::host_bytes() const { return impl_->mem->memory_plan().budget[1]; }
size_t Trainer::nvme_bytes() const { return impl_->mem->memory_plan().budget[2]; }

StepStats Trainer::step() {
  Impl& m = *impl_;
  const TrainOptions& o = m.o;
  kernels::Stream& s = *m.stream;
  const auto t0 = Clock::now();
  const double busy0 = m.busy_ms();
  const double comm0 = m.comm_ms(), exposed0 = m.exposed_ms(), waited0 = m.driver->exposed_ms();
  const int64_t n = m.N();
  StepStats st;
  st.step = m.steps_done + 1;
  st.lr = lr_at(m.sched, m.steps_done);
  st.loss_scale = m.scaler.scale();

  // The step's micro-batches: (accum) × [inputs (N) | targets (N) (| positions | segments)], and
  // how many targets the global batch trains (every rank computes the same count).
  int64_t trained = n * o.grad_accum * m.sh.world;
  if (m.loader)
    for (int64_t k = 0; k < o.grad_accum; ++k) {
      int32_t* base = m.host_tokens.data() + k * m.arrays * n;
      m.loader->next(base, base + n);
    }
  if (m.docs) {
    trained = 0;
    for (int64_t k = 0; k < o.grad_accum; ++k) {
      int32_t* base = m.host_tokens.data() + k * m.arrays * n;
      trained += m.docs->next(RowBatch{base, base + n, base + 2 * n, base + 3 * n});
    }
  }
  st.trained_tokens = trained;
  if (trained == 0) {
    // Nothing to learn from (every target masked or padding): no forward, no update; a pending
    // update stays pending. AdamW's step count does not advance, as for an fp16 overflow.
    st.skipped = true;
    st.loss = std::nan("");
    ++m.skipped_steps;
    ++m.steps_done;
    m.tokens_done += tokens_per_step();
    st.tokens = m.tokens_done;
    st.step_ms = ms_since(t0);
    return st;
  }
  m.mem->begin_step();
  s.memcpy_async(m.dev_tokens, m.host_tokens.data(), m.host_tokens.size() * sizeof(int32_t));
  s.memset_async(m.dev_norm2, 0, m.host_norm2.size() * sizeof(double));
  // d(mean loss over the global batch's trained targets) = Σ rows' CE / their count (N · accum
  // · ranks when every target is trained), times the fp16 loss scale: transformers'
  // num_items_in_batch. The first micro-batch overwrites the grads (no zeroing pass), the others
  // add to them. Each rank scales by the global count, and the fixed-order sum across ranks
  // makes the grads the global mean.
  const float grad_scale = m.scaler.scale() / static_cast<float>(trained);
  // The previous step's update runs inside this forward (none yet: the same blocks, no change),
  // or, where nothing waits for the norm, this step's inside its backward: the AdamWStep the
  // end of the step would have made (clip coefficient 1, no loss scale), bit for bit.
  // AdamW sees grads · clip / loss_scale (clipped, unscaled); its step count advances only over
  // applied steps.
  const auto adamw_step = [&](float clip) {
    return AdamWStep{m.adamw, m.steps_done + 1 - m.skipped_steps, static_cast<float>(st.lr),
                     clip / static_cast<float>(st.loss_scale)};
  };
  const PendingUpdate none;
  const bool in_backward = m.placement.update_in_backward();
  const PendingUpdate* update = in_backward ? nullptr : m.pending ? &*m.pending : &none;
  const AdamWStep this_step = adamw_step(clip_coefficient(0, o.grad_clip));
  for (const MicroBatch& mb : StepProgram(o.grad_accum, m.placement)) {
    const int32_t* ids = m.dev_tokens + mb.index * m.arrays * n;
    if (m.docs) m.model->set_documents(ids + 2 * n, ids + 3 * n);
    m.driver->micro_batch(mb, ids, ids + n, grad_scale, m.dev_norm2, update, &this_step);
    s.memcpy_async(m.host_losses.data() + mb.index * n, m.model->loss_rows(), static_cast<size_t>(n) * sizeof(float));
  }
  s.memcpy_async(m.host_norm2.data(), m.dev_norm2, m.host_norm2.size() * sizeof(double));
  if (m.sh.world > 1) kill_if_asked(m.sh.rank, st.step);
  s.synchronize();
  double sum = 0;
  for (float l : m.host_losses) sum += l;
  if (m.sh.world > 1) {
    // Every rank's loss sum and per-unit shard Σ g², summed in rank order: the same numbers,
    // bit for bit, on every rank (so every rank decides the same clip, skip or stop).
    const size_t k = 1 + m.host_norm2.size();
    std::vector<double> mine(k), all(k * static_cast<size_t>(m.sh.world));
    mine[0] = sum;
    std::copy(m.host_norm2.begin(), m.host_norm2.end(), mine.begin() + 1);
    m.comm->host_all_gather(mine.data(), all.data(), k * sizeof(double));
    sum = 0;
    std::fill(m.host_norm2.begin(), m.host_norm2.end(), 0.0);
    for (int r = 0; r < m.sh.world; ++r) {
      const double* row = all.data() + static_cast<size_t>(r) * k;
      sum += row[0];
      for (size_t u = 0; u + 1 < k; ++u) m.host_norm2[u] += row[1 + u];
    }
  }
  st.loss = sum / static_cast<double>(trained);
  // The global norm: the units' sums of squares, added in unit order (a fixed order, whatever
  // the placement), then unscaled.
  double norm2 = 0;
  for (double u : m.host_norm2) norm2 += u;
  const double norm = std::sqrt(norm2) / m.scaler.scale();
  st.grad_norm = norm;
  // Divergence: a non-finite loss, or a non-finite norm that is not an fp16 overflow (which the
  // loss scaler handles by skipping the step). Nothing is applied: the weights stay those of
  // the last good step (with the update in the backward, it already ran), and run() stops.
  st.diverged = !std::isfinite(st.loss) || (!m.scaler.enabled() && !std::isfinite(norm));
  const bool apply = !st.diverged && m.scaler.update(std::isfinite(norm));
  st.skipped = !apply && !st.diverged;
  m.mem->end_step();
  // This step's update, applied inside the next step's forward.
  if (!in_backward) m.pending = PendingUpdate{adamw_step(apply ? clip_coefficient(norm, o.grad_clip) : 1.f), apply};
  s.synchronize();
  m.opt_stream().synchronize();
  if (st.skipped) ++m.skipped_steps;
  ++m.steps_done;
  m.tokens_done += tokens_per_step();
  m.trained_done += trained;
  st.tokens = m.tokens_done;
  st.step_ms = ms_since(t0);
  st.tokens_per_s = static_cast<double>(tokens_per_step()) / (st.step_ms / 1e3);
  const offload::OffloadStats now = m.mem->stats();
  for (int l = 0; l < offload::kNumLinks; ++l) {
    st.link_bytes[static_cast<size_t>(l)] = now.links[l].bytes - m.last_stats.links[l].bytes;
    st.link_ms[static_cast<size_t>(l)] = now.links[l].ms_busy - m.last_stats.links[l].ms_busy;
  }
  st.nvme_busy_ms = now.nvme_busy_ms - m.last_stats.nvme_busy_ms;
  st.stall_ms = m.mem->stall_ms() - m.last_stall;
  // (the compute stream's timed waits for collectives are not compute)
  st.compute_ms = m.busy_ms() - busy0 - (m.driver->exposed_ms() - waited0);
  st.comm_bytes = comm_bytes_per_step(*m.model, m.sh, o.grad_accum);
  st.comm_ms = m.comm_ms() - comm0;  // every stream is synchronised above
  st.comm_exposed_ms = m.exposed_ms() - exposed0;
  m.last_stats = now;
  m.last_stall = m.mem->stall_ms();
  return st;
}

bool Trainer::has_validation() const { return impl_->val_docs || impl_->val_loader; }

// Forward passes over the held-out rows, an aside of the memory manager (outside the planned
// step), in the first micro-batch's step buffers: nothing the next step reads is changed (a
// pending update is applied first, as a checkpoint would; the math is the same either way).
Trainer::EvalStats Trainer::evaluate() {
  Impl& m = *impl_;
  const TrainOptions& o = m.o;
  if (!has_validation()) throw std::logic_error("Trainer::evaluate: no --val-data");
  const auto t0 = Clock::now();
  const int64_t n = m.N();
  kernels::Stream& s = *m.stream;
  m.flush();
  if (m.val_docs) m.val_docs->seek({});
  if (m.val_loader) m.val_loader->reset();
  const int64_t batches = o.eval_batches > 0 ? o.eval_batches : m.val_docs ? INT64_MAX : m.val_loader->windows_per_pass();
  std::vector<int32_t> host(static_cast<size_t>(m.arrays * n));
  std::vector<float> losses(static_cast<size_t>(n));
  EvalStats ev;
  double sum = 0;
  m.mem->begin_step(TieredMemory::Program::aside);
  for (int64_t b = 0; b < batches; ++b) {
    int32_t* base = host.data();
    if (m.val_docs) {
      if (m.val_docs->done()) break;  // one pass: --eval-batches beyond it ends there
      ev.tokens += m.val_docs->next(RowBatch{base, base + n, base + 2 * n, base + 3 * n});
    } else {
      m.val_loader->next(base, base + n);
      ev.tokens += n * m.sh.world;
    }
    s.memcpy_async(m.dev_tokens, host.data(), host.size() * sizeof(int32_t));
    m.model->set_documents(m.val_docs ? m.dev_tokens + 2 * n : nullptr, m.val_docs ? m.dev_tokens + 3 * n : nullptr);
    m.driver->forward(m.dev_tokens, m.dev_tokens + n);
    s.memcpy_async(losses.data(), m.model->loss_rows(), losses.size() * sizeof(float));
    s.synchronize();
    for (float l : losses) sum += l;
    ++ev.batches;
  }
  m.mem->end_step();
  s.synchronize();
  m.model->set_documents(nullptr, nullptr);
  if (m.sh.world > 1) {  // every rank's sum, added in rank order
    std::vector<double> all(static_cast<size_t>(m.sh.world));
    m.comm->host_all_gather(&sum, all.data(), sizeof(double));
    sum = 0;
    for (double v : all) sum += v;
  }
  ev.loss = ev.tokens > 0 ? sum / static_cast<double>(ev.tokens) : std::nan("");
  ev.ms = ms_since(t0);
  return ev;
}

void Trainer::print_header(std::FILE* out) const {
  const Impl& m = *impl_;
  const TrainOptions& o = m.o;
  const ModelConfig& c = m.cfg;
  const ModelDims& d = m.model->dims();
  const bool gpt2 = c.family == Family::gpt2;
  fmt::print(out, "strata train\n");
  fmt::print(out, "  model      {}\n", m.model_source);
  fmt::print(out, "             {} ({}): {} layers, hidden {}, {} heads ({} kv) x {}, mlp {}, vocab {}, max pos {}{}\n",
             c.model_type, gpt2 ? "LayerNorm, learned positions, GELU" : "RMSNorm, RoPE, SwiGLU", d.L, d.C, d.Hq,
             d.Hkv, d.D, d.I, d.V, c.max_position_embeddings,
             gpt2 || c.tie_word_embeddings ? ", tied head" : ", untied head");
  fmt::print(out, "  params     {} ({} units)\n", human_count(static_cast<double>(m.model->n_params())),
             m.model->units().size());
  fmt::print(out, "  data       {}\n", m.data_source);
  if (!m.resumed_from.empty()) {
    fmt::print(out, "  resumed    from {} at step {} of {}\n", m.resumed_from.string(), m.steps_done, o.steps);
    for (const std::string& c : m.resume_changes) fmt::print(out, "             changed since the checkpoint: {}\n", c);
  }
  if (!o.checkpoint_dir.empty())
    fmt::print(out, "  checkpoints {} ({}, keep {}; run id {})\n", o.checkpoint_dir,
               o.checkpoint_every > 0 ? fmt::format("every {} steps and at the end", o.checkpoint_every)
                                      : std::string("at the end and on SIGINT/SIGTERM"),
               o.keep, m.run_id);
  if (m.sh.world > 1)
    fmt::print(out, "  ranks      {} ({}), ZeRO stage {}: {}\n", m.sh.world, comm_backend_name(m.comm->backend()),
               m.sh.stage,
               m.sh.stage == 0   ? "grads all-reduced, every rank holds everything"
               : m.sh.stage == 1 ? "master weights and AdamW state sharded, grads all-reduced"
               : m.sh.stage == 2 ? "master weights, AdamW state and grads sharded, grads reduce-scattered per unit"
                                 : "working weights sharded too, all-gathered per unit for forward and for backward");
  fmt::print(out, "  batch      {} x {} tokens x {} micro-batches{} = {} tokens/step, {} steps\n", o.batch, o.seq,
             o.grad_accum, m.sh.world > 1 ? fmt::format(" x {} ranks", m.sh.world) : std::string(), tokens_per_step(),
             o.steps);
  fmt::print(out, "  optimizer  AdamW lr {:g} ({}, warmup {}, min {:g}), betas ({:g}, {:g}), eps {:g}, "
                  "weight decay {:g} (2-D only), clip {}\n",
             o.lr, o.lr_schedule, o.warmup, o.min_lr, o.beta1, o.beta2, o.eps, o.weight_decay,
             o.grad_clip > 0 ? fmt::format("{:g}", o.grad_clip)
             : m.placement.update_in_backward()
                 ? std::string("off (so each unit updates in the backward, as soon as its gradient is final)")
                 : std::string("off"));
  fmt::print(out, "  precision  {} weights and activations, fp32 grads, fp32 master{}\n", kernels::dtype_name(m.dtype),
             m.dtype == DType::f16 ? ", dynamic loss scaling" : "");
  fmt::print(out, "  backend    {} ({} threads); activation checkpointing {}\n", kernels::backend_name(m.backend),
             m.rt->info().n_threads, checkpointing_name(m.model->checkpointing()));
  print_placement(out, m.mem->memory_plan(), m.backend, m.startup_s, m.weights_s);
  // Copy-pasteable: every flag that is set, each value a shell word.
  std::string flags;
  for (const auto& [flag, value] : option_values(o)) {
    if (flag == "--overwrite-model" || flag == "--shuffle") {
      if (value == "true") flags += " " + flag;
      continue;
    }
    if ((flag == "--keep" || flag == "--checkpoint-every") && o.checkpoint_dir.empty()) continue;
    if (!value.empty()) flags += " " + flag + " " + shell_quote(value);
  }
  flags += " --threads " + std::to_string(o.threads);
  for (const auto& p : o.nvme_paths) flags += " --nvme-path " + shell_quote(p);
  fmt::print(out, "  flags     {}\n", flags);
  std::fflush(out);
}

namespace {
const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGPIPE: return "a write error on stdout";
    case SIGUSR2: return "SIGUSR2 (a stop relayed by the launcher)";
    default: return "a signal";
  }
}
}  // namespace

int Trainer::run(std::FILE* rank0_out) {
  Impl& m = *impl_;
  const TrainOptions& o = m.o;
  // Rank 0 alone prints; the others run the same program (every collective matched).
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> null_out(nullptr, &std::fclose);
  if (m.sh.rank != 0) {
    null_out.reset(std::fopen("/dev/null", "w"));
    if (!null_out) throw std::runtime_error("cannot open /dev/null: " + errno_text());
  }
  std::FILE* out = m.sh.rank == 0 ? rank0_out : null_out.get();
  // Output that cannot be written (a closed pipe: `strata train | head`, a full disk) stops the
  // run as SIGTERM would, checkpoint included, instead of killing it or going on blind; what it
  // would have said then goes to stderr.
  bool out_ok = true;
  const auto lose_stdout = [&](int err) {
    out_ok = false;
    request_stop(SIGPIPE);
    fmt::print(stderr, "strata: cannot write to stdout ({}): stopping after this step\n", errno_text(err));
  };
  const auto print = [&](const std::string& text) {
    if (out_ok && (std::fputs(text.c_str(), out) < 0 || std::fflush(out) != 0)) lose_stdout(errno);
  };
  // Every rank leaves together: mpirun takes the job down when the first rank exits non-zero,
  // which must not happen while rank 0 still writes the checkpoint.
  const auto all_ranks_done = [&] {
    if (m.sh.world <= 1) return;
    int mine = 1;
    std::vector<int> all(static_cast<size_t>(m.sh.world));
    m.comm->host_all_gather(&mine, all.data(), sizeof(int));
  };
  try {
    print_header(out);
  } catch (const std::system_error& e) {  // fmt reports a failed write as system_error
    lose_stdout(e.code().value());
  }
  const auto t_start = Clock::now();
  double first_loss = NAN, last_loss = NAN, min_loss = INFINITY, ms_after_first = 0;
  int64_t skipped = 0, no_targets = 0;
  uint64_t moved_total = 0;
  const int64_t first_step = m.steps_done;
  // Validation at the start, every --eval-every steps and at the end: a line, and val_loss in
  // the metrics line of that step (a line of its own for step 0).
  int64_t last_eval = -1;
  double last_val = NAN;
  const auto validate = [&] {
    const EvalStats ev = evaluate();
    last_eval = m.steps_done;
    last_val = ev.loss;
    return ev;
  };
  const auto print_eval = [&](const EvalStats& ev) {
    print(fmt::format("eval {:>{}}/{} | val loss {:.4f} | ppl {:.2f} | {} tokens in {} batches | {:.1f} ms\n",
                      last_eval, std::to_string(o.steps).size(), o.steps, ev.loss, std::exp(ev.loss), ev.tokens,
                      ev.batches, ev.ms));
  };
  if (has_validation()) {
    const EvalStats ev = validate();
    print_eval(ev);
    if (m.metrics.get() >= 0 && m.steps_done == 0) {
      nlohmann::json j;
      j["step"] = 0;
      j["val_loss"] = std::isfinite(ev.loss) ? nlohmann::json(ev.loss) : nlohmann::json(nullptr);
      j["val_tokens"] = ev.tokens;
      j["run_id"] = m.run_id;
      m.write_metrics_line(j.dump() + "\n", 0);
    }
  }
  for (int64_t i = first_step; i < o.steps; ++i) {
    // A stop (SIGINT, SIGTERM, SIGHUP, stdout gone) and a checkpoint request (SIGUSR1), agreed by
    // every rank: a signal may reach one rank first, and each must stop after the same step.
    int req[2] = {stop_requested(), take_checkpoint_request() ? 1 : 0};
    if (m.sh.world > 1) {
      std::vector<int> all(2 * static_cast<size_t>(m.sh.world));
      m.comm->host_all_gather(req, all.data(), sizeof(req));
      for (size_t r = 0; r < all.size(); r += 2) {
        req[0] = req[0] ? req[0] : all[r];
        req[1] = req[1] | all[r + 1];
      }
    }
    if (req[1] && !req[0] && m.steps_done > 0) {
      if (o.checkpoint_dir.empty()) {
        if (m.sh.rank == 0) fmt::print(stderr, "strata: SIGUSR1 asked for a checkpoint, but there is no --checkpoint-dir; going on\n");
      } else if (m.last_checkpoint_step != m.steps_done) {
        const std::string path = save_checkpoint();
        print(fmt::format("checkpoint {} (asked by SIGUSR1)\n", path));
      }
    }
    if (const int sig = req[0]) {  // stop between steps
      std::string saved = "nothing saved to --out (the run did not finish)";
      if (!o.checkpoint_dir.empty() && m.steps_done > 0)
        saved = "checkpoint " +
                (m.last_checkpoint_step == m.steps_done
                     ? (fs::path(o.checkpoint_dir) / checkpoint_name(m.steps_done)).string()
                     : save_checkpoint()) +
                " (continue with --resume auto)";
      else if (o.checkpoint_dir.empty())
        saved += "; --checkpoint-dir DIR makes runs resumable";
      const std::string line =
          fmt::format("stopped by {} after step {} of {}; {}\n", signal_name(sig), m.steps_done, o.steps, saved);
      print(line);
      if (!out_ok && m.sh.rank == 0) fmt::print(stderr, "strata: {}", line);
      all_ranks_done();
      return 128 + sig;
    }
    const StepStats st = step();
    const bool evaluate_now = has_validation() && !st.diverged &&
                              ((o.eval_every > 0 && st.step % o.eval_every == 0) || st.step == o.steps);
    if (st.trained_tokens == 0) {
      ++no_targets;
      if (m.sh.rank == 0)
        fmt::print(stderr, "strata: warning: step {}: no trained target in the global batch (every target masked or "
                           "padding): skipped, nothing applied\n", st.step);
    }
    std::optional<EvalStats> ev;
    if (evaluate_now) ev = validate();
    // A diverged step is never checkpointed (below, the run stops): with the update in the
    // backward its units have already updated.
    if (o.checkpoint_every > 0 && st.step % o.checkpoint_every == 0 && st.step < o.steps && !st.diverged) {
      const std::string path = save_checkpoint();
      print(fmt::format("checkpoint {}\n", path));
    }
    if (i == first_step) first_loss = st.loss;
    else ms_after_first += st.step_ms;
    if (st.trained_tokens > 0) {
      last_loss = st.loss;
      min_loss = std::min(min_loss, st.loss);
    }
    skipped += st.skipped && st.trained_tokens > 0;
    moved_total += st.bytes_moved();
    const offload::OffloadStats& os = m.last_stats;
    if (m.metrics.get() >= 0) {
      nlohmann::json j;
      j["step"] = st.step;
      j["loss"] = st.trained_tokens > 0 ? nlohmann::json(st.loss) : nlohmann::json(nullptr);
      j["trained_tokens"] = st.trained_tokens;
      if (ev) {
        j["val_loss"] = std::isfinite(ev->loss) ? nlohmann::json(ev->loss) : nlohmann::json(nullptr);
        j["val_tokens"] = ev->tokens;
      }
      j["grad_norm"] = std::isfinite(st.grad_norm) ? nlohmann::json(st.grad_norm) : nlohmann::json(nullptr);
      j["lr"] = st.lr;
      j["tokens"] = st.tokens;
      j["step_ms"] = st.step_ms;
      j["tokens_per_s"] = st.tokens_per_s;
      // Bytes in use per tier (the pools are allocated once: their budgets), moved this step.
      j["device_bytes"] = os.tiers[0].bytes_in_use;
      j["host_bytes"] = os.tiers[1].bytes_in_use;
      j["nvme_bytes"] = os.tiers[2].bytes_in_use;
      j["bytes_moved"] = st.bytes_moved();
      for (int l = 0; l < offload::kNumLinks; ++l) {
        const std::string name(offload::link_name(static_cast<offload::Link>(l)));
        j[name + "_bytes"] = st.link_bytes[static_cast<size_t>(l)];
      }
      j["io_ms"] = st.link_ms[2] + st.link_ms[3];
      j["nvme_busy_ms"] = st.nvme_busy_ms;
      j["stall_ms"] = st.stall_ms;
      j["compute_ms"] = st.compute_ms;
      j["comm_bytes_sent"] = st.comm_bytes;
      j["comm_bytes_received"] = st.comm_bytes;
      j["comm_ms"] = st.comm_ms;
      j["comm_exposed_ms"] = st.comm_exposed_ms;
      j["device_peak_bytes"] = os.tiers[0].bytes_peak;
      j["host_peak_bytes"] = os.tiers[1].bytes_peak;
      j["nvme_peak_bytes"] = os.tiers[2].bytes_peak;
      // The offload plan in use, what it expected to move per step, and how often a step left
      // the planned schedule (cumulative): where measured bytes exceed the plan, these say why.
      j["plan_policy"] = os.policy;
      j["planned_bytes"] = os.planned_bytes;
      j["schedule_changes"] = os.schedule_changes;
      j["cold_restarts"] = os.cold_restarts;
      j["run_id"] = m.run_id;  // which run wrote the line (a metrics file can hold several)
      m.write_metrics_line(j.dump() + "\n", st.step);
    }
    if (st.step == 1 || st.step == o.steps || st.step % o.log_every == 0) {
      std::string io;
      if (m.placement.uses_nvme() || st.bytes_moved() > 0)
        io = fmt::format(" | compute {:.0f} ms | moved {} | stall {:.0f} ms", st.compute_ms,
                         human_bytes(static_cast<double>(st.bytes_moved())), st.stall_ms);
      print(fmt::format("step {:>{}}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.4f} | {:.0f} tok/s | {:.1f} ms{}{}\n",
                        st.step, std::to_string(o.steps).size(), o.steps, st.loss, st.lr, st.grad_norm,
                        st.tokens_per_s, st.step_ms, io,
                        st.trained_tokens == 0 ? std::string(" | no trained target: skipped")
                        : st.skipped ? fmt::format(" | fp16 overflow: step skipped, loss scale {:g}", m.scaler.scale())
                                     : ""));
    }
    if (ev) print_eval(*ev);
    if (st.diverged)
      throw std::runtime_error(fmt::format(
          "step {}: loss {} and grad norm {}: the run diverged (not finite); {}nothing was saved to --out; lower "
          "--lr, add --warmup or set --grad-clip",
          st.step, st.loss, st.grad_norm,
          // In the backward, each unit's update ran as its gradient became final.
          m.placement.update_in_backward() ? "" : "the step was not applied and "));
  }
  m.flush();  // the last step's update
  if (has_validation() && last_eval != m.steps_done) print_eval(validate());  // (not reached in the loop)
  if (!o.checkpoint_dir.empty() && m.last_checkpoint_step != m.steps_done) {
    const std::string path = save_checkpoint();
    print(fmt::format("checkpoint {}\n", path));
  }
  const double total_s = ms_since(t_start) / 1e3;
  std::string done = fmt::format("done: {} steps, {} tokens in {:.1f} s", o.steps, m.tokens_done, total_s);
  const int64_t ran = o.steps - first_step;
  if (ran > 1)
    done += fmt::format(" ({:.0f} tok/s, {:.1f} ms/step after the first)",
                        static_cast<double>(tokens_per_step() * (ran - 1)) / (ms_after_first / 1e3),
                        ms_after_first / static_cast<double>(ran - 1));
  done += fmt::format("; loss {:.4f} -> {:.4f} (min {:.4f})", first_loss, last_loss, min_loss);
  if (moved_total) done += fmt::format("; {} moved between tiers", human_bytes(static_cast<double>(moved_total)));
  if (skipped) done += fmt::format("; {} fp16 steps skipped", skipped);
  if (no_targets) done += fmt::format("; {} steps had no trained target (skipped)", no_targets);
  if (m.docs) {
    done += fmt::format("; {} trained targets", m.trained_done);
    if (m.docs->truncated_documents() > 0)
      done += fmt::format("; {} documents longer than --seq + 1 = {} tokens were cut ({} tokens not trained; --pack on "
                          "keeps them)",
                          m.docs->truncated_documents(), o.seq + 1, m.docs->truncated_tokens());
  }
  if (std::isfinite(last_val)) done += fmt::format("; val loss {:.4f} (ppl {:.2f})", last_val, std::exp(last_val));
  print(done + "\n");
  if (!o.out.empty()) {
    save(o.out);
    print(fmt::format("saved the model to {} (HF layout)\n", o.out));
  }
  // A signal during the last step: the run is complete and saved (status 0), say so.
  if (const int sig = stop_requested(); sig && sig != SIGPIPE)
    print(fmt::format("{} came during the last step: the run finished and was saved\n", signal_name(sig)));
  return 0;
}

std::vector<float> Trainer::Impl::gather_unit(Role role, int u, int64_t offset) {
  const Unit& unit = model->units()[static_cast<size_t>(u)];
  const int64_t n = sh.shard(unit.numel);
  std::vector<float> whole(static_cast<size_t>(unit.numel));
  const float* src = static_cast<const float*>(mem->acquire(role, u, offload::Mode::read, Side::host));
  comm->all_gather(src + offset, whole.data(), static_cast<size_t>(n), DType::f32, *stream);
  stream->synchronize();
  mem->release(role, u);
  if (sh.rank != 0) std::vector<float>().swap(whole);
  return whole;
}

namespace {

// A tensor's fp32 bytes, checked finite on the way: a last update can overflow (a diverging
// run whose loss was still finite), and such weights never become a save or a checkpoint.
void copy_finite(void* dst, const float* src, size_t bytes, const std::string& what) {
  std::memcpy(dst, src, bytes);
  const float* f = static_cast<const float*>(dst);
  for (size_t i = 0; i < bytes / 4; ++i)
    if (!std::isfinite(f[i])) throw std::runtime_error(what + " (element " + std::to_string(i) + ")");
}

// A save callback for one tensor: `bytes` from element `offset` of a unit's `role` block,
// acquired on the host side of an aside for the copy only, non-finite values refused (`what`).
std::function<void(void*)> fill_from_block(TieredMemory* mem, Role role, int unit, int64_t offset, size_t bytes,
                                           std::string what) {
  return [mem, role, unit, offset, bytes, what = std::move(what)](void* dst) {
    const float* src = static_cast<const float*>(mem->acquire(role, unit, offload::Mode::read, Side::host));
    try {
      copy_finite(dst, src + offset, bytes, what);
    } catch (...) {
      mem->release(role, unit);
      throw;
    }
    mem->release(role, unit);
  };
}

// The same from host memory that outlives the save (a unit gathered from every rank's shard).
std::function<void(void*)> fill_from_host(const float* src, size_t bytes, std::string what) {
  return [src, bytes, what = std::move(what)](void* dst) { copy_finite(dst, src, bytes, what); };
}

}  // namespace

// The master weights, unit by unit from wherever they live, through the save's per-tensor
// callbacks: no more than one tensor's bytes are staged at once. Sharded (stage >= 1): every
// rank sends its shards and rank 0 holds the whole model's master weights for the save (so
// rank 0 needs 4 bytes per parameter of host RAM beyond its pools). Collective: every rank
// calls it; rank 0 alone writes.
void Trainer::save(const std::string& out_dir) const {
  Impl& m = *impl_;
  ModelConfig c = m.cfg;
  c.torch_dtype = "float32";
  m.flush();  // a pending update belongs to the weights being saved
  m.stream->synchronize();
  m.opt_stream().synchronize();
  std::vector<std::vector<float>> whole;  // [unit] the gathered master (sharded runs, rank 0)
  if (m.sh.sharded_optimizer()) {
    m.mem->begin_step(TieredMemory::Program::aside);
    for (size_t u = 0; u < m.model->units().size(); ++u) whole.push_back(m.gather_unit(Role::master, static_cast<int>(u), 0));
    m.mem->end_step();
  }
  if (m.sh.rank != 0) return;
  std::vector<TensorToSave> tensors;
  TieredMemory* mem = m.mem.get();
  const std::string diverged = "the weights are not finite: the run diverged; nothing was saved";
  for (const ParamInfo& p : m.model->params()) {
    const size_t bytes = static_cast<size_t>(p.numel) * 4;
    const int unit = p.unit;
    const int64_t off = p.unit_offset;
    tensors.push_back({p.name, p.shape, DType::f32,
                       whole.empty() ? fill_from_block(mem, Role::master, unit, off, bytes, diverged)
                                     : fill_from_host(whole[static_cast<size_t>(unit)].data() + off, bytes, diverged)});
  }
  m.mem->begin_step(TieredMemory::Program::aside);
  try {
    // The tokenizer of --model goes along: `strata generate` and `strata data` read the saved
    // directory as they read the one it was trained from. (Read before the save replaces
    // anything, so --out may be --model with --overwrite-model.)
    std::vector<fs::path> tokenizer;
    if (!m.o.model.empty())
      for (const char* name : kTokenizerFiles)
        if (fs::is_regular_file(fs::path(m.o.model) / name)) tokenizer.push_back(fs::path(m.o.model) / name);
    save_hf_model(out_dir, c, tensors, 5ull << 30, tokenizer);
  } catch (...) {
    m.mem->end_step();  // every fill releases what it acquired
    throw;
  }
  m.mem->end_step();
}

int64_t Trainer::steps_done() const { return impl_->steps_done; }

// The whole training state after the last step (its pending update applied first), each
// tensor streamed from wherever its unit lives: at most one unit's block is staged at a time.
// Sharded (stage >= 1): rank 0 gathers every unit's master, m and v first (12 bytes per
// parameter of host RAM) and writes them unsharded by name, so a checkpoint does not depend on
// the world size it was written at. Collective: every rank calls it; rank 0 alone writes (the
// others return "").
std::string Trainer::save_checkpoint() {
  Impl& m = *impl_;
  if (m.o.checkpoint_dir.empty()) throw std::logic_error("save_checkpoint without --checkpoint-dir");
  m.flush();
  std::vector<std::array<std::vector<float>, 3>> whole;  // [unit] {master, m, v} (sharded, rank 0)
  if (m.sh.sharded_optimizer()) {
    m.mem->begin_step(TieredMemory::Program::aside);
    for (size_t ui = 0; ui < m.model->units().size(); ++ui) {
      const int u = static_cast<int>(ui);
      const AdamLayout al = m.mem->units()[u].adam_layout();
      std::array<std::vector<float>, 3> parts;
      parts[0] = m.gather_unit(Role::master, u, 0);
      parts[1] = m.gather_unit(Role::adam, u, al.m_offset());
      parts[2] = m.gather_unit(Role::adam, u, al.v_offset());
      whole.push_back(std::move(parts));
    }
    m.mem->end_step();
  }
  if (m.sh.rank != 0) {
    m.last_checkpoint_step = m.steps_done;
    return "";
  }
  TrainCheckpointContent c;
  c.cfg = m.cfg;
  c.cfg.torch_dtype = "float32";
  c.state = m.state_json();
  TieredMemory* mem = m.mem.get();
  for (const ParamInfo& p : m.model->params()) {
    const size_t bytes = static_cast<size_t>(p.numel) * 4;
    const int unit = p.unit;
    const int64_t off = p.unit_offset;
    const AdamLayout al = m.mem->units()[unit].adam_layout();
    // A last update that overflowed never becomes a checkpoint (rotation would then drop the
    // good ones): the run stops instead, the previous checkpoint kept.
    const std::string diverged =
        "'" + p.name + "' is not finite: the run diverged; no checkpoint written, the previous one is kept";
    auto from = [&](Role role, int64_t offset, int part) {
      return whole.empty() ? fill_from_block(mem, role, unit, offset, bytes, diverged)
                           : fill_from_host(whole[static_cast<size_t>(unit)][static_cast<size_t>(part)].data() + off,
                                            bytes, diverged);
    };
    c.model.push_back({p.name, p.shape, DType::f32, from(Role::master, off, 0)});
    c.optimizer.push_back({exp_avg_name(p.name), p.shape, DType::f32, from(Role::adam, al.m_offset() + off, 1)});
    c.optimizer.push_back({exp_avg_sq_name(p.name), p.shape, DType::f32, from(Role::adam, al.v_offset() + off, 2)});
  }
  m.mem->begin_step(TieredMemory::Program::aside);
  fs::path path;
  try {
    path = write_train_checkpoint(m.o.checkpoint_dir, m.steps_done, c, static_cast<int>(std::min<int64_t>(m.o.keep, 1 << 30)));
  } catch (...) {
    m.mem->end_step();
    throw;
  }
  m.mem->end_step();
  m.last_checkpoint_step = m.steps_done;
  return path.string();
}

double Trainer::matmul_gflops_probe(int64_t mm, int64_t nn, int64_t kk, int reps) {
  Impl& m = *impl_;
  kernels::DeviceBuffer a(*m.rt, static_cast<size_t>(mm * kk) * 4), b(*m.rt, static_cast<size_t>(kk * nn) * 4),
      c(*m.rt, static_cast<size_t>(mm * nn) * 4);
  kernels::Stream& s = *m.stream;
  s.memset_async(a.data(), 0, a.bytes());
  s.memset_async(b.data(), 0, b.bytes());
  kernels::MatmulArgs args;
  args.a = a.data();
  args.b = b.data();
  args.c = c.data();
  args.m = mm;
  args.n = nn;
  args.k = kk;
  m.rt->ops().matmul(s, args);  // warm-up (primitive creation)
  s.synchronize();
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) m.rt->ops().matmul(s, args);
  s.synchronize();
  const double sec = ms_since(t0) / 1e3;
  return 2.0 * static_cast<double>(mm * nn * kk) * reps / sec / 1e9;
}

}  // namespace strata
