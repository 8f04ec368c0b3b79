// The training loop: resolve options, allocate once, then per optimizer step: load the step's
// micro-batches, forward+backward each (grads accumulate, scaled so they are the mean over the
// global batch), global norm, clip, AdamW, and report (progress line, --metrics JSONL).
#include "src/train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/ops.h"
#include "kernels/runtime.h"
#include "src/checkpoint/hf.h"
#include "src/data/token_shards.h"
#include "src/model/transformer.h"
#include "src/optim/adamw.h"
#include "src/optim/schedule.h"
#include "src/train/corpus.h"

namespace strata {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

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

}  // namespace

struct Trainer::Impl {
  TrainOptions o;
  ModelConfig cfg;
  std::string model_source;  // for the header
  std::string data_source;
  DType dtype = DType::f32;
  kernels::Backend backend = kernels::Backend::cpu;
  std::unique_ptr<kernels::Runtime> rt;
  std::unique_ptr<kernels::Stream> stream;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<AdamW> adamw;
  std::unique_ptr<GradNorm> grad_norm;
  LossScaler scaler{false};
  LrScheduleConfig sched;
  std::unique_ptr<EmbeddedCorpusShard> corpus;
  std::unique_ptr<DataLoader> loader;
  std::vector<int32_t> host_tokens;   // (accum, 2, N): inputs then targets per micro-batch
  std::vector<float> host_losses;     // (accum, N)
  kernels::DeviceBuffer dev_tokens;   // same layout as host_tokens
  std::ofstream metrics;
  int64_t steps_done = 0;
  int64_t tokens_done = 0;
  size_t extra_bytes = 0;

  int64_t N() const { return o.batch * o.seq; }
};

Trainer::Trainer(const TrainOptions& opts) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.o = opts;
  const TrainOptions& o = m.o;
  if (o.batch <= 0) throw std::invalid_argument("--batch must be positive, got " + std::to_string(o.batch));
  if (o.seq <= 0) throw std::invalid_argument("--seq must be positive, got " + std::to_string(o.seq));
  if (o.grad_accum <= 0) throw std::invalid_argument("--grad-accum must be positive, got " + std::to_string(o.grad_accum));
  if (o.steps <= 0) throw std::invalid_argument("--steps must be positive, got " + std::to_string(o.steps));
  if (o.log_every <= 0) throw std::invalid_argument("--log-every must be positive");
  if (o.warmup < 0) throw std::invalid_argument("--warmup must not be negative");
  // 0 is allowed (as torch.optim.AdamW does): the weights stay as loaded, decay included, so a
  // run measures loss and grad norm of a checkpoint and --out re-saves it unchanged.
  if (!(o.lr >= 0)) throw std::invalid_argument("--lr must be >= 0, got " + std::to_string(o.lr));
  if (!(o.min_lr >= 0)) throw std::invalid_argument("--min-lr must be >= 0, got " + std::to_string(o.min_lr));
  if (o.grad_clip < 0) throw std::invalid_argument("--grad-clip must be >= 0 (0 = off)");
  m.dtype = kernels::parse_dtype(o.dtype);
  m.backend = kernels::parse_backend(o.backend);
  if (!kernels::backend_trains(m.backend))
    throw std::invalid_argument("--backend " + o.backend +
                                ": the CUDA op set is not built yet (only the CUDA runtime is); use --backend cpu");
  const LrSchedule schedule = parse_lr_schedule(o.lr_schedule);

  // Model config: --model DIR, --preset NAME or the embedded default.
  bool load_weights = false;
  if (!o.model.empty()) {
    const fs::path dir(o.model);
    if (!fs::is_directory(dir)) throw std::runtime_error("--model " + o.model + ": not a directory");
    if (!fs::exists(dir / "config.json")) throw std::runtime_error("--model " + o.model + ": no config.json in it");
    m.cfg = read_hf_config(dir / "config.json");
    load_weights = has_weights(dir);
    m.model_source = o.model + (load_weights ? " (safetensors)" : " (config only: random init)");
  } else if (!o.preset.empty()) {
    m.cfg = preset_model_config(o.preset);
    m.model_source = "preset " + o.preset + " (random init)";
  } else {
    m.cfg = default_model_config();
    m.model_source = "embedded default (random init)";
  }
  m.cfg.validate();
  if (o.seq > m.cfg.max_position_embeddings)
    throw std::invalid_argument("--seq " + std::to_string(o.seq) + " exceeds the model's max_position_embeddings (" +
                                std::to_string(m.cfg.max_position_embeddings) + ")");
  if (!o.out.empty()) {  // the save's own rules, so a finished run is never lost at the end
    try {
      check_hf_save_target(o.out);
    } catch (const std::exception& e) {
      throw std::runtime_error("--out " + o.out + ": " + e.what());
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
    m.loader = std::make_unique<DataLoader>(std::vector<fs::path>{m.corpus->path()}, o.batch, o.seq, 0, 1,
                                            m.cfg.vocab_size);
    m.data_source = fmt::format("embedded corpus ({} byte-level tokens)", m.corpus->n_tokens());
  } else {
    const auto shards = expand_glob(o.data);
    m.loader = std::make_unique<DataLoader>(shards, o.batch, o.seq, 0, 1, m.cfg.vocab_size);
    m.data_source = fmt::format("{} ({} shard{})", o.data, shards.size(), shards.size() == 1 ? "" : "s");
  }

  // Runtime, model, optimizer: everything allocated here, once.
  if (m.backend == kernels::Backend::cpu) kernels::cpu::set_num_threads(o.threads);
  m.rt = kernels::make_runtime(m.backend);
  m.stream = m.rt->create_stream();
  m.model = std::make_unique<Transformer>(m.cfg, m.dtype, o.batch, o.seq, *m.rt);
  if (load_weights)
    m.model->load(*HfCheckpoint::open(o.model));
  else
    m.model->init_random(o.seed);
  m.model->sync_weights(*m.stream);
  std::vector<ParamRange> ranges;
  for (const ParamInfo& p : m.model->params()) ranges.push_back({p.offset, p.numel, p.decay});
  AdamWConfig ac;
  ac.beta1 = static_cast<float>(o.beta1);
  ac.beta2 = static_cast<float>(o.beta2);
  ac.eps = static_cast<float>(o.eps);
  ac.weight_decay = static_cast<float>(o.weight_decay);
  m.adamw = std::make_unique<AdamW>(*m.rt, ranges, m.model->n_flat(), ac);
  m.grad_norm = std::make_unique<GradNorm>(*m.rt);
  m.scaler = LossScaler(m.dtype == DType::f16);
  m.sched = LrScheduleConfig{schedule, o.lr, o.min_lr, o.warmup, o.steps};

  const int64_t n = m.N();
  m.host_tokens.assign(static_cast<size_t>(o.grad_accum * 2 * n), 0);
  m.host_losses.assign(static_cast<size_t>(o.grad_accum * n), 0.f);
  m.dev_tokens = kernels::DeviceBuffer(*m.rt, m.host_tokens.size() * sizeof(int32_t));
  m.extra_bytes = m.dev_tokens.bytes() + m.grad_norm->bytes_allocated();
  if (o.synthetic_data) {  // fixed tokens, uniform over the vocab, from the seed
    uint64_t s = o.seed * 0x9e3779b97f4a7c15ull + 1;
    for (int32_t& t : m.host_tokens) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      t = static_cast<int32_t>(s % static_cast<uint64_t>(m.cfg.vocab_size));
    }
  }
  m.stream->synchronize();
  // Last, after every check: a run that fails to start leaves an earlier metrics file intact.
  if (!o.metrics.empty()) {
    m.metrics.open(o.metrics, std::ios::out | std::ios::trunc);
    if (!m.metrics) throw std::runtime_error("--metrics " + o.metrics + ": cannot open for writing");
  }
}

Trainer::~Trainer() = default;

const ModelConfig& Trainer::config() const { return impl_->cfg; }
int64_t Trainer::n_params() const { return impl_->model->n_params(); }
int64_t Trainer::tokens_per_step() const { return impl_->N() * impl_->o.grad_accum; }
size_t Trainer::device_bytes() const {
  return impl_->model->bytes_allocated() + impl_->adamw->bytes_allocated() + impl_->extra_bytes;
}

StepStats Trainer::step() {
  Impl& m = *impl_;
  const TrainOptions& o = m.o;
  kernels::Stream& s = *m.stream;
  const auto t0 = Clock::now();
  const int64_t n = m.N();
  StepStats st;
  st.step = m.steps_done + 1;
  st.lr = lr_at(m.sched, m.steps_done);
  st.loss_scale = m.scaler.scale();

  // The step's micro-batches: (accum) × [inputs (N) | targets (N)].
  if (m.loader)
    for (int64_t k = 0; k < o.grad_accum; ++k) {
      int32_t* base = m.host_tokens.data() + k * 2 * n;
      m.loader->next(base, base + n);
    }
  s.memcpy_async(m.dev_tokens.data(), m.host_tokens.data(), m.host_tokens.size() * sizeof(int32_t));
  // d(mean loss over the global batch) = Σ rows' CE / (N · accum), times the fp16 loss scale.
  // The first micro-batch overwrites the grads (no zeroing pass), the others add to them.
  const float grad_scale = m.scaler.scale() / static_cast<float>(n * o.grad_accum);
  for (int64_t k = 0; k < o.grad_accum; ++k) {
    const int32_t* ids = m.dev_tokens.as<int32_t>() + k * 2 * n;
    m.model->forward_backward(s, ids, ids + n, grad_scale, /*accumulate=*/k > 0);
    s.memcpy_async(m.host_losses.data() + k * n, m.model->loss_rows(), static_cast<size_t>(n) * sizeof(float));
  }
  const double norm = m.grad_norm->compute(s, m.model->grads(), m.model->n_flat()) / m.scaler.scale();
  st.grad_norm = norm;
  const bool apply = m.scaler.update(std::isfinite(norm));
  st.skipped = !apply;
  if (apply) {
    // AdamW sees grads · clip / loss_scale: clipped, unscaled.
    const float clip = clip_coefficient(norm, o.grad_clip);
    m.adamw->step(s, m.model->master(), m.model->grads(),
                  m.dtype == DType::f32 ? nullptr : m.model->weights(), m.dtype, static_cast<float>(st.lr),
                  clip / static_cast<float>(st.loss_scale));
  }
  s.synchronize();
  double sum = 0;
  for (float l : m.host_losses) sum += l;
  st.loss = sum / static_cast<double>(m.host_losses.size());
  ++m.steps_done;
  m.tokens_done += n * o.grad_accum;
  st.tokens = m.tokens_done;
  st.step_ms = ms_since(t0);
  st.tokens_per_s = static_cast<double>(n * o.grad_accum) / (st.step_ms / 1e3);
  return st;
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
  fmt::print(out, "  batch      {} x {} tokens x {} micro-batches = {} tokens/step, {} steps\n", o.batch, o.seq,
             o.grad_accum, tokens_per_step(), o.steps);
  fmt::print(out, "  optimizer  AdamW lr {:g} ({}, warmup {}, min {:g}), betas ({:g}, {:g}), eps {:g}, "
                  "weight decay {:g} (2-D only), clip {}\n",
             o.lr, o.lr_schedule, o.warmup, o.min_lr, o.beta1, o.beta2, o.eps, o.weight_decay,
             o.grad_clip > 0 ? fmt::format("{:g}", o.grad_clip) : std::string("off"));
  fmt::print(out, "  precision  {} weights and activations, fp32 grads, fp32 master{}\n", kernels::dtype_name(m.dtype),
             m.dtype == DType::f16 ? ", dynamic loss scaling" : "");
  fmt::print(out, "  backend    {} ({} threads), {} allocated at start-up\n", kernels::backend_name(m.backend),
             m.rt->info().n_threads, human_bytes(static_cast<double>(device_bytes())));
  fmt::print(out,
             "  flags      --model '{}' --data '{}' --backend {} --dtype {} --batch {} --seq {} --grad-accum {} "
             "--steps {} --lr {:g} --lr-schedule {} --warmup {} --min-lr {:g} --weight-decay {:g} --beta1 {:g} "
             "--beta2 {:g} --eps {:g} --grad-clip {:g} --seed {} --metrics '{}' --out '{}' --log-every {} "
             "--threads {}\n",
             o.model, o.data, o.backend, o.dtype, o.batch, o.seq, o.grad_accum, o.steps, o.lr, o.lr_schedule, o.warmup,
             o.min_lr, o.weight_decay, o.beta1, o.beta2, o.eps, o.grad_clip, o.seed, o.metrics, o.out, o.log_every,
             o.threads);
  std::fflush(out);
}

int Trainer::run(std::FILE* out) {
  Impl& m = *impl_;
  const TrainOptions& o = m.o;
  print_header(out);
  const auto t_start = Clock::now();
  double first_loss = 0, last_loss = 0, min_loss = INFINITY, ms_after_first = 0;
  int64_t skipped = 0;
  const double mem = static_cast<double>(device_bytes());
  for (int64_t i = 0; i < o.steps; ++i) {
    const StepStats st = step();
    if (i == 0) first_loss = st.loss;
    else ms_after_first += st.step_ms;
    last_loss = st.loss;
    min_loss = std::min(min_loss, st.loss);
    skipped += st.skipped;
    if (m.metrics.is_open()) {
      nlohmann::json j;
      j["step"] = st.step;
      j["loss"] = st.loss;
      j["grad_norm"] = std::isfinite(st.grad_norm) ? nlohmann::json(st.grad_norm) : nlohmann::json(nullptr);
      j["lr"] = st.lr;
      j["tokens"] = st.tokens;
      j["step_ms"] = st.step_ms;
      j["tokens_per_s"] = st.tokens_per_s;
      j["device_bytes"] = device_bytes();  // bytes in use per tier (CPU backend: the device is host RAM)
      j["host_bytes"] = 0;                 // pinned host tier (no offload yet)
      j["nvme_bytes"] = 0;                 // NVMe tier
      j["bytes_moved"] = 0;                // bytes moved between tiers this step
      m.metrics << j.dump() << '\n';
      m.metrics.flush();
      if (!m.metrics) throw std::runtime_error("--metrics " + o.metrics + ": write failed");
    }
    if (st.step == 1 || st.step == o.steps || st.step % o.log_every == 0) {
      fmt::print(out, "step {:>{}}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.4f} | {:.0f} tok/s | {:.1f} ms | mem {}{}\n",
                 st.step, std::to_string(o.steps).size(), o.steps, st.loss, st.lr, st.grad_norm, st.tokens_per_s,
                 st.step_ms, human_bytes(mem),
                 st.skipped ? fmt::format(" | fp16 overflow: step skipped, loss scale {:g}", m.scaler.scale()) : "");
      std::fflush(out);
    }
  }
  const double total_s = ms_since(t_start) / 1e3;
  fmt::print(out, "done: {} steps, {} tokens in {:.1f} s", o.steps, m.tokens_done, total_s);
  if (o.steps > 1)
    fmt::print(out, " ({:.0f} tok/s, {:.1f} ms/step after step 1)",
               static_cast<double>(tokens_per_step() * (o.steps - 1)) / (ms_after_first / 1e3),
               ms_after_first / static_cast<double>(o.steps - 1));
  fmt::print(out, "; loss {:.4f} -> {:.4f} (min {:.4f})", first_loss, last_loss, min_loss);
  if (skipped) fmt::print(out, "; {} fp16 steps skipped", skipped);
  fmt::print(out, "\n");
  if (!o.out.empty()) {
    save(o.out);
    fmt::print(out, "saved the model to {} (HF layout)\n", o.out);
  }
  std::fflush(out);
  return 0;
}

void Trainer::save(const std::string& out_dir) const {
  ModelConfig c = impl_->cfg;
  c.torch_dtype = "float32";
  impl_->stream->synchronize();
  save_hf_model(out_dir, c, impl_->model->tensors_to_save());
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
