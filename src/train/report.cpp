// The run's reports: the --metrics file, the progress lines, and the header.
#include "src/train/report.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "kernels/dtype.h"
#include "src/model/family.h"
#include "src/train/trainer_impl.h"

namespace strata {
namespace fs = std::filesystem;

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

void MetricsFile::open(const std::string& path, const std::string& run_id, bool resumed, int64_t steps_done) {
  path_ = path;
  // Appended to, never truncated: an earlier run's lines stay (check_run_paths made sure the
  // file is a metrics file). A FIFO or a device (/dev/stdout, `--metrics >(jq ...)`) is a
  // stream: opened for writing only, never locked or cut.
  std::error_code ec;
  const bool regular = !fs::exists(path, ec) || fs::is_regular_file(path, ec);
  fd_ = UniqueFd(::open(path.c_str(), (regular ? O_RDWR | O_CREAT : O_WRONLY) | O_CLOEXEC | O_APPEND, 0644));
  if (fd_.get() < 0) throw std::runtime_error("--metrics " + path + ": cannot open for writing: " + errno_text());
  if (regular && lock_exclusive(fd_.get(), "--metrics " + path) == LockResult::held_elsewhere)
    throw std::runtime_error("--metrics " + path + ": another strata run is writing it; give this run a metrics file "
                             "of its own");
  const off_t end = ::lseek(fd_.get(), 0, SEEK_END);
  bytes_ = end > 0 ? static_cast<uint64_t>(end) : 0;
  if (!regular || bytes_ == 0) return;
  // A fresh run reads only the file's end; a resumed one the whole file, to find its own tail:
  // the lines of this run id (or of none: written before run ids) with a later step.
  const uint64_t from = resumed ? 0 : bytes_ - std::min<uint64_t>(bytes_, 1 << 20);
  std::string text(bytes_ - from, '\0');
  if (::pread(fd_.get(), text.data(), text.size(), static_cast<off_t>(from)) != static_cast<ssize_t>(text.size()))
    throw std::runtime_error("--metrics " + path + ": cannot read it: " + errno_text());
  const size_t whole = text.back() == '\n' ? text.size() : text.rfind('\n') + 1;  // npos + 1 == 0
  uint64_t keep = whole == 0 && from > 0 ? bytes_ : from + whole;  // (no line end in 1 MiB: leave it)
  if (resumed) {
    keep = 0;
    for (size_t at = 0; at < whole;) {
      const size_t eol = text.find('\n', at) + 1;
      const nlohmann::json j = nlohmann::json::parse(text.substr(at, eol - at), nullptr, false);
      const bool ours = j.is_object() && (!j.contains("run_id") || j["run_id"] == run_id);
      const bool stale =
          ours && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() > steps_done;
      if (!stale) keep = eol;
      at = eol;
    }
  }
  if (keep < bytes_) {
    if (::ftruncate(fd_.get(), static_cast<off_t>(keep)) != 0)
      throw std::runtime_error("--metrics " + path + ": cannot cut its unfinished or stale lines: " + errno_text());
    bytes_ = keep;
  }
}

// A single write of the built line; a failed one is cut off again.
void MetricsFile::write(const nlohmann::json& j, int64_t step) {
  if (fd_.get() < 0) return;
  const std::string line = j.dump() + "\n";
  size_t done = 0;
  int err = 0;
  while (done < line.size()) {
    const ssize_t w = ::write(fd_.get(), line.data() + done, line.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      err = w < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(w);
  }
  if (!err) {
    bytes_ += done;
    return;
  }
  if (done > 0 && ::ftruncate(fd_.get(), static_cast<off_t>(bytes_)) != 0)
    fmt::print(stderr, "strata: warning: --metrics {}: cannot cut off the partial line of step {}: {}\n", path_, step,
               errno_text());
  fmt::print(stderr,
             "strata: warning: --metrics {}: writing step {} failed: {}; no more metrics are written, training "
             "continues\n",
             path_, step, errno_text(err));
  std::fflush(stderr);
  fd_ = UniqueFd();
}

namespace {
nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

// This process's peak resident memory so far (getrusage's ru_maxrss: KiB on Linux).
uint64_t peak_rss_bytes() {
  rusage ru{};
  if (getrusage(RUSAGE_SELF, &ru) != 0)
    throw std::runtime_error("getrusage(RUSAGE_SELF) failed: " + errno_text());
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;
}
}  // namespace

nlohmann::json eval_metrics(const Trainer::EvalStats& ev, const std::string& run_id) {
  nlohmann::json j;
  j["step"] = 0;
  j["val_loss"] = finite_or_null(ev.loss);
  j["val_tokens"] = ev.tokens;
  j["run_id"] = run_id;
  return j;
}

nlohmann::json step_metrics(const StepStats& st, const offload::OffloadStats& os,
                            const std::optional<Trainer::EvalStats>& ev, const std::string& run_id) {
  nlohmann::json j;
  j["step"] = st.step;
  j["loss"] = st.trained_tokens > 0 ? nlohmann::json(st.loss) : nlohmann::json(nullptr);
  j["trained_tokens"] = st.trained_tokens;
  if (ev) {
    j["val_loss"] = finite_or_null(ev->loss);
    j["val_tokens"] = ev->tokens;
  }
  j["grad_norm"] = finite_or_null(st.grad_norm);
  j["speculated"] = st.speculated;
  j["rolled_back"] = st.rolled_back;
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
  j["checksum_ms"] = st.checksum_ms;
  j["stall_ms"] = st.stall_ms;
  j["compute_ms"] = st.compute_ms;
  j["comm_bytes_sent"] = st.comm_bytes;
  j["comm_bytes_received"] = st.comm_bytes;
  j["comm_ms"] = st.comm_ms;
  j["comm_exposed_ms"] = st.comm_exposed_ms;
  if (st.tp_comm_bytes > 0) {  // tensor parallelism
    j["tp_comm_bytes_sent"] = st.tp_comm_bytes;
    j["tp_comm_ms"] = st.tp_comm_ms;
  }
  if (st.pp_comm_bytes > 0) {  // pipeline parallelism
    j["pp_comm_bytes_sent"] = st.pp_comm_bytes;
    j["pp_comm_ms"] = st.pp_comm_ms;
    j["pp_bubble"] = st.pp_bubble;
  }
  j["device_peak_bytes"] = os.tiers[0].bytes_peak;
  j["peak_rss_bytes"] = peak_rss_bytes();
  j["host_peak_bytes"] = os.tiers[1].bytes_peak;
  j["nvme_peak_bytes"] = os.tiers[2].bytes_peak;
  // The offload plan in use, what it expected to move per step, and how often a step left the
  // planned schedule (cumulative): where measured bytes exceed the plan, these say why.
  j["plan_policy"] = os.policy;
  j["planned_bytes"] = os.planned_bytes;
  j["schedule_changes"] = os.schedule_changes;
  j["cold_restarts"] = os.cold_restarts;
  j["run_id"] = run_id;  // which run wrote the line (a metrics file can hold several)
  return j;
}

namespace {
// --speculate auto: the verdict of its trial, on the step that ended it.
std::string trial_note(const StepStats& st) {
  if (!st.speculation_trial) return "";
  const StepStats::TrialVerdict& v = *st.speculation_trial;
  return fmt::format(" | speculate auto: {:.1f} ms/step speculating, {:.1f} waiting for the norm: {}", v.speculating_ms,
                     v.waiting_ms, v.speculate ? "speculates from now on" : "waits for the norm from now on");
}

// The header's word on speculation, after the clip ("" where the run does not speculate).
std::string speculation_note(const TrainOptions& o, const Placement& pl) {
  if (!pl.speculate) return "";
  const std::string trial = o.speculate == "auto" && o.speculate_trial > 0
                                ? fmt::format("; --speculate auto: the first {} steps speculate, the next {} wait for "
                                              "the norm, then the faster way goes on",
                                              o.speculate_trial, o.speculate_trial)
                                : "";
  return " (speculative: each unit updates in the backward as if nothing clips, redone from its first copy when the "
         "norm clips or overflows" + trial + ")";
}
}  // namespace

std::string step_line(const StepStats& st, int64_t steps, bool io, double loss_scale) {
  std::string moved;
  if (io)
    moved = fmt::format(" | compute {:.0f} ms | moved {} | stall {:.0f} ms", st.compute_ms,
                        human_bytes(static_cast<double>(st.bytes_moved())), st.stall_ms);
  return fmt::format("step {:>{}}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.4f} | {:.0f} tok/s | {:.1f} ms{}{}{}{}\n",
                     st.step, std::to_string(steps).size(), steps, st.loss, st.lr, st.grad_norm, st.tokens_per_s,
                     st.step_ms, moved,
                     st.trained_tokens == 0 ? std::string(" | no trained target: skipped")
                     : st.skipped ? fmt::format(" | fp16 overflow: step skipped, loss scale {:g}", loss_scale)
                                  : "",
                     st.rolled_back ? " | speculative update rolled back" : "", trial_note(st));
}

std::string eval_line(const Trainer::EvalStats& ev, int64_t step, int64_t steps) {
  return fmt::format("eval {:>{}}/{} | val loss {:.4f} | ppl {:.2f} | {} tokens in {} batches | {:.1f} ms\n", step,
                     std::to_string(steps).size(), steps, ev.loss, std::exp(ev.loss), ev.tokens, ev.batches, ev.ms);
}

void RunTally::add(const StepStats& st) {
  if (steps++ == 0) first_loss = st.loss;
  else ms_after_first += st.step_ms;
  if (st.trained_tokens > 0) {
    last_loss = st.loss;
    min_loss = std::min(min_loss, st.loss);
  }
  fp16_skipped += st.skipped && st.trained_tokens > 0;
  rolled_back += st.rolled_back;
  no_targets += st.trained_tokens == 0;
  moved += st.bytes_moved();
}

std::string RunTally::done_line(int64_t total_steps, int64_t tokens, int64_t tokens_per_step, double total_s,
                                const std::string& extra) const {
  std::string done = fmt::format("done: {} steps, {} tokens in {:.1f} s", total_steps, tokens, total_s);
  if (steps > 1)
    done += fmt::format(" ({:.0f} tok/s, {:.1f} ms/step after the first)",
                        static_cast<double>(tokens_per_step * (steps - 1)) / (ms_after_first / 1e3),
                        ms_after_first / static_cast<double>(steps - 1));
  done += fmt::format("; loss {:.4f} -> {:.4f} (min {:.4f})", first_loss, last_loss, min_loss);
  if (moved) done += fmt::format("; {} moved between tiers", human_bytes(static_cast<double>(moved)));
  if (fp16_skipped) done += fmt::format("; {} fp16 steps skipped", fp16_skipped);
  if (rolled_back) done += fmt::format("; {} speculative updates rolled back", rolled_back);
  if (no_targets) done += fmt::format("; {} steps had no trained target (skipped)", no_targets);
  return done + extra + "\n";
}

namespace {

// The placement table of the header: each tier's pool and what lives there, the bytes the plan
// moves per step by link, and how long start-up took.
void print_placement(std::FILE* out, const MemoryPlan& p, kernels::Backend backend, double startup_s,
                     double weights_s) {
  static const char* const kTier[3] = {"device", "host", "nvme"};
  fmt::print(out, "  memory     {:<7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>10}{}\n", "tier", "pool", "params",
             "master", "adam", "grads", "activations", "buffers",
             backend == kernels::Backend::cpu ? "   (cpu backend: device and host are both RAM)" : "");
  for (int t = 0; t < 3; ++t) {
    auto cell = [&](size_t role) {
      const uint64_t b = p.homed[static_cast<size_t>(t)][role];
      return b ? human_bytes(static_cast<double>(b)) : std::string("-");
    };
    fmt::print(out, "             {:<7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>10}\n", kTier[t],
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

void Trainer::print_header(std::FILE* out) const {
  const Impl& m = *impl_;
  const TrainOptions& o = m.o;
  const ModelConfig& c = m.cfg;
  const ModelDims& d = m.model->dims();
  fmt::print(out, "strata train\n");
  fmt::print(out, "  model      {}\n", m.model_source);
  fmt::print(out, "             {} ({}): {} layers, hidden {}, {} heads ({} kv) x {}, mlp {}, vocab {}, max pos {}{}\n",
             c.model_type, m.model->recipe().description, d.L, d.C, c.n_heads,
             c.n_kv_heads, d.D, d.I * m.tp().size, d.full_vocab, c.max_position_embeddings,
             m.model->tied_head() ? ", tied head" : ", untied head");
  fmt::print(out, "  params     {} ({} units{})\n", human_count(static_cast<double>(m.model->n_params())),
             m.model->units().size(), m.tp().on() || m.pp().on() ? ", this rank's part" : "");
  if (m.model->lora()) {
    const LoraSpec& l = m.model->lora_spec();
    std::string mods;
    for (const std::string& name : m.model->lora_modules()) mods += (mods.empty() ? "" : ",") + name;
    fmt::print(out, "  LoRA       rank {}, alpha {} (scale {}{}) on {}: {} trainable, the base frozen\n", l.rank,
               l.alpha, l.scale(), l.rslora ? ", rsLoRA" : "", mods,
               human_count(static_cast<double>(m.model->n_trainable_params())));
  }
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
  if (m.tp().on()) {
    const ModelDims& d = m.model->dims();
    fmt::print(out, "  grid       {} ranks: {}; tensor parallel: per rank {} of {} heads, {} of {} kv heads, MLP {} of {}, "
                    "vocabulary rows {}..{} of {}\n",
               m.comm->world(), grid_name(m.groups->shape()), d.Hq, m.cfg.n_heads, d.Hkv, m.cfg.n_kv_heads, d.I,
               d.I * m.tp().size, d.vocab_start, d.vocab_start + d.V - 1, d.full_vocab);
  } else if (m.pp().on()) {
    fmt::print(out, "  grid       {} ranks: {}\n", m.comm->world(), grid_name(m.groups->shape()));
  }
  if (m.pp().on()) {
    const PipelineStage& pp = m.pp();
    std::string layers;
    for (int64_t n : m.pp_layers) {
      if (!layers.empty()) layers += ',';
      layers += std::to_string(n);
    }
    const double p = pp.size, mb = static_cast<double>(o.grad_accum);
    fmt::print(out, "  pipeline   {} stages of {} layers (this rank: stage {}, layers {}..{}{}{}), {} micro-batches in "
                    "1F1B: ideal bubble (p-1)/(m+p-1) = {:.1f}%\n",
               pp.size, layers, pp.rank, pp.first, pp.end - 1, pp.first_stage() ? " and the embedding" : "",
               pp.last_stage() ? " and the head" : "", o.grad_accum, 100 * (p - 1) / (mb + p - 1));
  }
  if (m.sh.world > 1)
    fmt::print(out, "  {}{} ({}), ZeRO stage {}: {}\n", m.tp().on() || m.pp().on() ? "replicas   " : "ranks      ", m.sh.world,
               m.comm->backend() == CommBackend::mpi && m.backend == kernels::Backend::cuda
                   ? "mpi, GPU buffers staged through pinned host memory"
                   : std::string(comm_backend_name(m.comm->backend())),
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
             o.grad_clip > 0 || m.placement.speculate
                 ? fmt::format("{}{}", o.grad_clip > 0 ? fmt::format("{:g}", o.grad_clip) : std::string("off"),
                               speculation_note(o, m.placement))
             : m.placement.update_in_backward()
                 ? std::string("off (so each unit updates in the backward, as soon as its gradient is final)")
                 : std::string("off"));
  fmt::print(out, "  precision  {} weights and activations, fp32 grads, fp32 master{}\n", kernels::dtype_name(m.dtype),
             m.dtype == DType::f16 ? ", dynamic loss scaling" : "");
  fmt::print(out, "  backend    {} ({} threads); activation checkpointing {}\n", kernels::backend_name(m.backend),
             m.rt->info().n_threads, checkpointing_name(m.model->checkpointing()));
  if (const UnitTable& ut = m.mem->units(); m.placement.optimizer_on_device > 0 && m.placement.optimizer != offload::Tier::device) {
    int64_t on = 0, all = 0;
    std::string first, last;
    for (const UnitEntry& e : ut) {
      if (!e.trainable) continue;
      all += e.numel;
      if (e.master.home != offload::Tier::device) continue;
      on += e.numel;
      (first.empty() ? first : last) = e.name;
    }
    fmt::print(out, "  twin-flow  --optimizer-on-device {:g}: AdamW state of {:.1f}% of the parameters ({}) on the "
                    "device, updated there; the rest on {}, updated by the CPU\n",
               m.placement.optimizer_on_device, all ? 100.0 * static_cast<double>(on) / static_cast<double>(all) : 0.0,
               on == 0 ? std::string("no unit fits the fraction")
                       : last.empty() ? first : first + " .. " + last,
               m.placement.optimizer == offload::Tier::nvme ? "NVMe" : "host RAM");
  }
  print_placement(out, m.mem->memory_plan(), m.backend, m.startup_s, m.weights_s);
  // Copy-pasteable: every flag that is set, each value a shell word.
  std::string flags;
  const auto is_bool = [](const std::string& flag) {
    for (const OptionSpec& spec : option_table())
      if (flag == spec.flag) return std::holds_alternative<bool TrainOptions::*>(spec.field);
    return false;
  };
  for (const auto& [flag, value] : option_values(o)) {
    if (is_bool(flag)) {  // a switch: named when on
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

}  // namespace strata
