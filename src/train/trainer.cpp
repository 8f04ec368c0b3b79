// The training loop: resolve options, allocate once, then per optimizer step: load the step's
// micro-batches, forward+backward each (grads accumulate, scaled so they are the mean over the
// global batch), global norm, clip, AdamW, and report (progress line, --metrics JSONL). State in
// and out is train_state.cpp, the reports report.cpp, the options' resolution run_setup.cpp.
#include "src/train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "src/checkpoint/train_checkpoint.h"
#include "src/train/faults.h"
#include "src/train/perf_model.h"
#include "src/train/run_setup.h"
#include "src/train/stop_signal.h"
#include "src/train/trainer_impl.h"

namespace strata {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// --speculate auto's longest wait after rollbacks in a row: a rollback costs about a step (its
// forward and backward again, and the step back to speculating a flush), so where every step
// clips (early training, a clip below the usual norm) the waits keep that under ~2% of the steps,
// and speculation is tried again at least this often (and, after --speculate auto's trial
// found waiting faster, the trial first runs again after this many steps).
constexpr int64_t kMaxSpeculationBackoff = 128;
// --speculate auto: the longest interval between trials while each finds waiting faster (from
// kMaxSpeculationBackoff, doubling).
constexpr int64_t kMaxTrialInterval = 1024;

// Fault injection for the multi-rank CLI tests (src/train/faults.h): kill:R:S kills rank R with
// SIGKILL in the middle of step S (its collectives enqueued, the others waiting in them), as a
// crashed node would.
void kill_if_asked(int rank, int64_t step) {
  if (faults().kill_rank == rank && faults().kill_step == step) std::raise(SIGKILL);
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

Trainer::Trainer(const TrainOptions& opts) : impl_(std::make_unique<Impl>()) {
  const auto t_start = Clock::now();
  Impl& m = *impl_;
  m.o = with_adapter_config(opts);
  const TrainOptions& o = m.o;
  validate_options(o);  // before anything is started
  // The job's ranks (mpirun), then (rank 0) the checkpoint directory locked before the checkpoint
  // to resume is looked for in it: another run rotating it meanwhile would remove that one.
  m.comm = make_communicator(kernels::parse_backend(o.backend));
  if (m.comm->rank() == 0 && !o.checkpoint_dir.empty()) {
    prepare_checkpoint_dir(o.checkpoint_dir);
    m.checkpoint_lock = PathLock::acquire(dir_lock_file(o.checkpoint_dir), "--checkpoint-dir " + o.checkpoint_dir,
                                          /*remove_on_release=*/true);
    remove_dead_checkpoint_temporaries(o.checkpoint_dir);
  }
  ResolvedRun r = resolve_run(o, m.comm->world(), m.comm->rank());
  m.cfg = r.cfg;
  m.model_source = r.model_source;
  m.dtype = r.dtype;
  m.backend = r.backend;
  // Every rank started with the same flags, model and checkpoint: a difference would hang the
  // job or train something else than asked.
  check_ranks_agree(*m.comm, o, m.cfg, r.resume);
  // Then (every rank with the same --tp, so the splits line up) tensor-parallel groups of --tp
  // consecutive ranks; ZeRO shards each unit over the data-parallel group.
  m.groups = std::make_unique<ProcessGroups>(*m.comm, o.tp, o.pp);
  r.placement.sharding = Sharding{o.zero_stage, m.groups->dp().world(), m.groups->dp().rank()};
  m.placement = r.placement;
  m.sh = m.placement.sharding;  // this rank's shard of every unit
  const bool rank0 = m.rank0();
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
  // Rank 0 alone writes --out, checkpoints and metrics: before anything is written, the run's
  // reads kept apart from its writes, --out locked, --checkpoint-dir holding this run's only.
  if (rank0) m.out_lock = guard_run_outputs(o, run_reads(o, r), m.run_id);
  // Data: the training rows and the held-out ones (make_batch_source picks their kind).
  m.data = make_batch_source(o, r.data_files, r.documents, false, m.sh.rank, m.sh.world, m.cfg.vocab_size);
  if (!r.val_files.empty())
    m.val = make_batch_source(o, r.val_files, r.val_documents, true, m.sh.rank, m.sh.world, m.cfg.vocab_size);
  // --epochs: as many steps as the epochs' rows take (the last step's missing rows are padding),
  // or --steps if that ends first.
  m.data_source = m.data->describe();
  if (r.documents && o.epochs > 0) {
    const int64_t rows = m.data->rows_for_epochs(o.epochs);
    const int64_t per_step = o.batch * o.grad_accum * m.sh.world;
    const int64_t steps = (rows + per_step - 1) / per_step;
    m.o.steps = o.steps > 0 ? std::min(o.steps, steps) : steps;
    m.data_source += fmt::format("; {} epoch{} = {} rows = {} steps", o.epochs, o.epochs == 1 ? "" : "s", rows, steps);
  }
  m.arrays = token_arrays(r);

  // Runtime, model, the tiered memory of its blocks (budgets checked before anything big is
  // allocated), then the weights, written unit by unit to their tiers.
  if (m.backend == kernels::Backend::cpu) kernels::cpu::set_num_threads(o.threads);
  // (nccl: one GPU per rank, the one its communicator was made on; mpi on cuda: the node's ranks
  // spread over its GPUs, several to a GPU)
  const int gpus = m.backend == kernels::Backend::cuda ? std::max(1, kernels::cuda_device_count()) : 1;
  m.rt = kernels::make_runtime(m.backend, m.comm->backend() == CommBackend::nccl ? m.comm->local_rank()
                                                                                 : m.comm->local_rank() % gpus);
  m.stream = m.rt->create_stream();
  // Collectives get a stream of their own, so they overlap compute (StepDriver).
  // (pipeline parallel: the point-to-point transfers too)
  if (m.sh.world > 1 || o.pp > 1) m.comm_stream = m.rt->create_stream();
  kernels::Runtime* opt_rt = m.rt.get();
  // AdamW next to its state: on a CPU runtime and stream of its own when the compute device is
  // not the CPU. The separate-optimizer test hook (src/train/faults.h) does the same on the CPU
  // backend, so the tests here drive the two-runtime code a GPU run takes (events and streams of
  // two runtimes, the optimizer's releases on its own stream) without a GPU.
  const bool separate_for_tests = faults().separate_optimizer;
  if ((m.backend != kernels::Backend::cpu || separate_for_tests) && pl.optimizer != offload::Tier::device) {
    kernels::cpu::set_num_threads(o.threads);
    m.cpu_rt = kernels::make_runtime(kernels::Backend::cpu);
    m.cpu_stream = m.cpu_rt->create_stream();
    opt_rt = m.cpu_rt.get();
  }
  const TensorParallel tp{o.tp, m.groups->coord().tp, &m.groups->tp(), o.sequence_parallel};
  PipelineStage stage;
  if (o.pp > 1) {
    m.pp_layers = pipeline_split(m.cfg, o.batch, o.seq, tp, r.ckpt, o.pp, o.pp_layers);
    stage = pipeline_stage(m.pp_layers, m.groups->coord().pp, o.grad_accum, &m.groups->pp());
    // A tied head: the first and last stage of each (dp, tp) position sum the embedding's grads.
    const GridCoord c = m.groups->coord();
    const bool ends = stage.first_stage() || stage.last_stage();
    const int color = ends ? c.dp * o.tp + c.tp : m.comm->world() + m.comm->rank();
    m.embed_group = m.comm->split(color, stage.rank);
    if (!ends) m.embed_group.reset();
  }
  m.model = std::make_unique<Transformer>(m.cfg, m.dtype, o.batch, o.seq, *m.rt, r.ckpt, kLogitsChunkBytes, m.sh.world,
                                          r.lora, tp, stage);
  const int64_t n = m.N();
  const size_t n_units = m.model->units().size();
  settle_speculation(o, m.placement, *m.model, m.backend, step_buffer_bytes(o, r, n_units));
  if (m.comm->world() > 1) {  // every rank speculates, or none: the step's collectives must line up
    const uint8_t mine = m.placement.speculate;
    std::vector<uint8_t> all(static_cast<size_t>(m.comm->world()));
    m.comm->host_all_gather(&mine, all.data(), 1);
    m.placement.speculate = std::all_of(all.begin(), all.end(), [](uint8_t s) { return s != 0; });
  }
  if (m.placement.speculate && o.speculate == "auto" && o.speculate_trial > 0)
    m.trial.emplace(static_cast<int>(o.speculate_trial));
  m.mem = std::make_unique<TieredMemory>(*m.model, *m.rt, *m.stream, *opt_rt, m.opt_stream(), pl, o.grad_accum,
                                         step_buffer_bytes(o, r, n_units), m.comm_stream.get());
  m.dev_tokens = static_cast<int32_t*>(m.mem->extra_device());
  m.dev_norm2 = reinterpret_cast<double*>(static_cast<char*>(m.mem->extra_device()) + token_buffer_bytes(o, m.arrays));
  m.driver = std::make_unique<StepDriver>(*m.model, *m.mem, m.sh, &m.groups->dp());
  const auto t_weights = Clock::now();
  m.init_weights(r.load_weights, r.base_weights);
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
  if (!m.resumed_from.empty()) m.restore_state(manifest);
  m.stream->synchronize();
  m.opt_stream().synchronize();
  m.last_stats = m.mem->stats();
  // Last, after every check: a run that fails to start leaves an earlier metrics file intact.
  if (rank0 && !o.metrics.empty()) m.metrics.open(o.metrics, m.run_id, !m.resumed_from.empty(), m.steps_done);
  m.startup_s = ms_since(t_start) / 1e3;
}

Trainer::~Trainer() {
  // A failed step can leave streams running ahead of the host (the error came from one of them,
  // or from the host itself): they finish before the driver, the memory and the model they use
  // are freed (Impl's members go in reverse order, the streams last).
  if (!impl_) return;
  for (kernels::Stream* s : {impl_->stream.get(), impl_->comm_stream.get(), impl_->cpu_stream.get()})
    if (s) kernels::settle(*s);
}

const ModelConfig& Trainer::config() const { return impl_->cfg; }
int64_t Trainer::n_params() const { return impl_->model->n_params(); }
int64_t Trainer::tokens_per_step() const { return impl_->N() * impl_->o.grad_accum * impl_->sh.world; }
int Trainer::rank() const { return impl_->comm->rank(); }
int Trainer::world() const { return impl_->comm->world(); }
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
  const double tp_ms0 = m.groups->tp().busy_ms();
  const uint64_t tp_bytes0 = m.groups->tp().sent_bytes();
  // Pipeline parallel: the point-to-point transfers (comm stream) and the tied embedding's sum
  // (compute stream).
  const auto tie_ms = [&m] { return m.embed_group ? m.embed_group->busy_ms() : 0.0; };
  const auto pp_bytes = [&m] {
    return m.groups->pp().sent_bytes() + (m.embed_group ? m.embed_group->sent_bytes() : 0);
  };
  const double p2p_ms0 = m.groups->pp().busy_ms(), tie_ms0 = tie_ms(), pipe_wait0 = m.driver->pipeline_wait_ms();
  const uint64_t pp_bytes0 = pp_bytes();
  const int64_t n = m.N();
  StepStats st;
  st.step = m.steps_done + 1;
  st.lr = lr_at(m.sched, m.steps_done);
  st.loss_scale = m.scaler.scale();

  // The step's micro-batches: (accum) × [inputs (N) | targets (N) (| positions | segments)], and
  // how many targets the global batch trains (every rank computes the same count).
  int64_t trained = 0;
  for (int64_t k = 0; k < o.grad_accum; ++k) {
    int32_t* base = m.host_tokens.data() + k * m.arrays * n;
    trained += m.data->next(RowBatch{base, base + n, base + 2 * n, base + 3 * n});
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
  // With speculation's two copies, this step speculates or waits for the norm (auto backing
  // off); an update a waiting step left pending runs first, on its own.
  if (m.trial && !m.trial->deciding() && !m.trial->verdict() && m.steps_done >= m.trial_again)
    m.trial.emplace(static_cast<int>(o.speculate_trial));
  const bool speculating = m.speculating();
  if (speculating) m.flush();
  m.mem->begin_step(m.placement.speculate && !speculating ? TieredMemory::Schedule::plain
                                                          : TieredMemory::Schedule::step);
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
  // (under speculation, a step that waits for the norm leaves its update pending)
  const bool in_backward = m.placement.update_in_backward() && (speculating || !m.placement.speculate);
  const PendingUpdate* update = in_backward ? nullptr : m.pending ? &*m.pending : &none;
  const AdamWStep this_step = adamw_step(clip_coefficient(0, o.grad_clip));
  // Micro-batch i's inputs made current: its (ids, targets).
  const auto select = [&](int64_t i) {
    const int32_t* ids = m.dev_tokens + i * m.arrays * n;
    if (m.data->documents()) m.model->set_documents(ids + 2 * n, ids + 3 * n);
    // LoRA dropout: masks of this step, micro-batch and rank (a resume draws the same ones).
    if (o.lora_dropout > 0)
      m.model->set_lora_dropout_key((o.seed * 0x100000001b3ull + static_cast<uint64_t>(st.step)) *
                                        0x9e3779b97f4a7c15ull +
                                    static_cast<uint64_t>(i * m.sh.world + m.sh.rank) + 1);
    return std::pair<const int32_t*, const int32_t*>{ids, ids + n};
  };
  const auto losses_of = [&](int64_t i) {
    s.memcpy_async(m.host_losses.data() + i * n, m.model->loss_rows(), static_cast<size_t>(n) * sizeof(float));
  };
  const auto run_micro_batches = [&](bool update_in_backward, const PendingUpdate* pending) {  // the step's program
    for (const MicroBatch& mb : StepProgram(o.grad_accum, update_in_backward)) {
      const auto [ids, targets] = select(mb.index);
      m.driver->micro_batch(mb, ids, targets, grad_scale, m.dev_norm2, pending, &this_step);
      losses_of(mb.index);
    }
  };
  // The schedule's span on the compute stream (pipeline parallel: the bubble's denominator).
  const auto pipe_span = std::make_shared<std::array<Clock::time_point, 2>>();
  if (m.pp().on()) {  // the stage's 1F1B schedule; the update follows the step (flushed below)
    s.host_fn([pipe_span] { (*pipe_span)[0] = Clock::now(); });
    m.driver->pipeline_step({.micro_batches = o.grad_accum, .select = select, .losses = losses_of,
                             .embed_group = m.embed_group.get()},
                            grad_scale, m.dev_norm2);
    s.host_fn([pipe_span] { (*pipe_span)[1] = Clock::now(); });
  } else {
    run_micro_batches(in_backward, update);
  }
  s.memcpy_async(m.host_norm2.data(), m.dev_norm2, m.host_norm2.size() * sizeof(double));
  const int world = m.comm->world();
  if (world > 1) kill_if_asked(m.comm->rank(), st.step);
  s.synchronize();
  double sum = 0;
  // (the ranks of a tensor-parallel group have the same losses: its rank 0 counts them)
  // (pipeline parallel: the last stage's, the one with the head)
  if (m.tp().rank == 0 && m.pp().last_stage())
    for (float l : m.host_losses) sum += l;
  // A tied head's copy on the last stage has the first stage's gradient: counted there only.
  if (m.pp().on() && m.model->tied_head() && !m.pp().first_stage()) m.host_norm2[0] = 0;
  // Pipeline parallel, the measured bubble: 1 − the ranks' mean busy time in the schedule over
  // the longest schedule's span (the first stage's: it starts first and ends last), where a
  // rank's busy time is its schedule's span less what compute waited for the point-to-point
  // transfers (idle until the neighbour's input or gradient came). Durations only: no clock is
  // compared across ranks. Equal stages: Megatron's (p−1)/(m+p−1).
  double waited = 0, span = 0;
  if (m.pp().on()) {
    waited = m.driver->pipeline_wait_ms() - pipe_wait0;
    span = std::chrono::duration<double, std::milli>((*pipe_span)[1] - (*pipe_span)[0]).count();
  }
  if (world > 1) {
    // Every rank's loss sum and per-unit shard Σ g² (and its pipeline wait and span), summed in
    // rank order: the same numbers, bit for bit, on every rank (so every rank decides the same
    // clip, skip or stop).
    const size_t nu = m.host_norm2.size(), k = 3 + nu;
    std::vector<double> mine(k), all(k * static_cast<size_t>(world));
    mine[0] = sum;
    mine[1] = waited;
    mine[2] = span;
    std::copy(m.host_norm2.begin(), m.host_norm2.end(), mine.begin() + 3);
    m.comm->host_all_gather(mine.data(), all.data(), k * sizeof(double));
    sum = 0;
    double busy = 0, longest = 0;
    std::fill(m.host_norm2.begin(), m.host_norm2.end(), 0.0);
    for (int r = 0; r < world; ++r) {
      const double* row = all.data() + static_cast<size_t>(r) * k;
      sum += row[0];
      busy += row[2] - row[1];
      longest = std::max(longest, row[2]);
      for (size_t u = 0; u < nu; ++u) m.host_norm2[u] += row[3 + u];
    }
    if (m.pp().on() && longest > 0) st.pp_bubble = 1 - busy / world / longest;
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
  if (m.pp().on()) m.flush();  // (no stage's forward runs a pending update)
  if (m.placement.speculate && !speculating) {
    m.mem->flip();  // the forward's update (the last step's, or none) wrote the second copies
    --m.plain_left;
  } else if (speculating) {
    // The update ran in the backward as if nothing clipped, into the second copies (master,
    // moments) and the weights. It stands when that is what the norm says (the same AdamWStep,
    // bit for bit): the second copies become current. Else the current copies are still the
    // step's start: the weights are cast again from the master and the step's forward and
    // backward run again (the same grads, bit for bit: they were spent by the update), its
    // update then pending with the true coefficient, as in a step that waits for the norm.
    const AdamWStep truth = adamw_step(apply ? clip_coefficient(norm, o.grad_clip) : 1.f);
    st.speculated = true;
    st.rolled_back = !apply || truth.grad_scale != this_step.grad_scale;
    if (!st.rolled_back) {
      m.mem->flip();
    } else {
      const PendingUpdate restore{.st = {}, .apply = false, .restore = true};
      // (A step not applied, rare: an fp16 overflow, or the run stops, reruns too, to keep to
      // one more recorded program, and leaves its update pending not applied, as a step that
      // waits does. That pending update is needed: the rerun's backward drops each trainable
      // unit's weights at their last use as spent (WholeWeights::drop), on the promise that an
      // update rewrites them before the next read; with none pending, an offloaded run read
      // stale weights back from NVMe.)
      m.mem->begin_step(TieredMemory::Schedule::rerun);
      run_micro_batches(/*update_in_backward=*/false, &restore);
      m.mem->end_step();
      m.pending = PendingUpdate{truth, apply};
    }
    // auto: after a rollback, wait for the norm for a while (a rollback costs the step's
    // forward and backward again); `on` keeps speculating.
    if (o.speculate == "auto") {
      m.plain_left = st.rolled_back ? m.backoff : 0;
      m.backoff = st.rolled_back ? std::min<int64_t>(2 * m.backoff, kMaxSpeculationBackoff) : 1;
    }
  }
  s.synchronize();
  m.opt_stream().synchronize();
  if (st.skipped) ++m.skipped_steps;
  ++m.steps_done;
  m.tokens_done += tokens_per_step();
  m.trained_done += trained;
  st.tokens = m.tokens_done;
  st.step_ms = ms_since(t0);
  st.tokens_per_s = static_cast<double>(tokens_per_step()) / (st.step_ms / 1e3);
  if (m.trial && m.trial->record(st.step_ms)) {
    if (!faults().trial_verdicts.empty()) m.trial->agree(faults().trial_verdict(m.comm->rank()));  // (test hook)
    // Rank 0's times decide for every rank: the step's collectives must line up.
    if (m.comm->world() > 1) {
      uint8_t v = m.trial->verdict();
      m.comm->host_broadcast(&v, 1, 0);
      m.trial->agree(v != 0);
    }
    st.speculation_trial = StepStats::TrialVerdict{m.trial->verdict(), m.trial->speculating_ms(), m.trial->waiting_ms()};
    // A verdict to wait is tried again later: how often the norm clips changes over a run
    // (most often in its first steps, where the trial runs). Each verdict to wait in a row
    // doubles the interval, up to kMaxTrialInterval: where every step clips, a trial (its
    // speculating steps rolled back, and a switch: ~5 steps' worth) then costs ~0.5% of a long run.
    m.trial_interval = m.trial->verdict()       ? 0
                       : m.trial_interval == 0 ? kMaxSpeculationBackoff
                                               : std::min(2 * m.trial_interval, kMaxTrialInterval);
    m.trial_again = m.steps_done + m.trial_interval;
    // The backoff starts afresh from the verdict: the trial's steps went its way, not the backoff's.
    m.plain_left = 0, m.backoff = 1;
  }
  const offload::OffloadStats now = m.mem->stats();
  for (int l = 0; l < offload::kNumLinks; ++l) {
    st.link_bytes[static_cast<size_t>(l)] = now.links[l].bytes - m.last_stats.links[l].bytes;
    st.link_ms[static_cast<size_t>(l)] = now.links[l].ms_busy - m.last_stats.links[l].ms_busy;
  }
  st.nvme_busy_ms = now.nvme_busy_ms - m.last_stats.nvme_busy_ms;
  st.checksum_ms = now.checksum_ms - m.last_stats.checksum_ms;
  st.stall_ms = m.mem->stall_ms() - m.last_stall;
  // (the compute stream's timed waits for collectives are not compute)
  st.tp_comm_ms = m.groups->tp().busy_ms() - tp_ms0;
  st.tp_comm_bytes = m.groups->tp().sent_bytes() - tp_bytes0;
  const double tie = tie_ms() - tie_ms0;
  st.pp_comm_ms = m.groups->pp().busy_ms() - p2p_ms0 + tie;
  st.pp_comm_bytes = pp_bytes() - pp_bytes0;
  // (pipeline parallel: compute's waits for the transfers, and the tied embedding's sum on compute)
  const double pipe_ms = m.driver->pipeline_wait_ms() - pipe_wait0 + tie;
  st.compute_ms = m.busy_ms() - busy0 - (m.driver->exposed_ms() - waited0) - st.tp_comm_ms - pipe_ms;
  st.comm_bytes = comm_bytes_per_step(*m.model, m.sh, o.grad_accum);
  st.comm_ms = m.comm_ms() - comm0;  // every stream is synchronised above
  st.comm_exposed_ms = m.exposed_ms() - exposed0;
  m.last_stats = now;
  m.last_stall = m.mem->stall_ms();
  return st;
}

bool Trainer::has_validation() const { return impl_->val != nullptr; }

// Forward passes over the held-out rows, an aside of the memory manager (outside the planned
// step), in the first micro-batch's step buffers: nothing the next step reads is changed (a
// pending update is applied first, as a checkpoint would; the math is the same either way).
Trainer::EvalStats Trainer::evaluate() {
  Impl& m = *impl_;
  const TrainOptions& o = m.o;
  if (!has_validation()) throw std::logic_error("Trainer::evaluate: no --val-data");
  m.model->set_lora_dropout_key(0);  // validation: no dropout
  const auto t0 = Clock::now();
  const int64_t n = m.N();
  kernels::Stream& s = *m.stream;
  m.flush();
  BatchSource& val = *m.val;
  val.rewind();
  const int64_t batches = o.eval_batches > 0 ? o.eval_batches : val.batches_per_pass();
  std::vector<int32_t> host(static_cast<size_t>(m.arrays * n));
  std::vector<float> losses(static_cast<size_t>(n));
  EvalStats ev;
  double sum = 0;
  m.mem->begin_step(TieredMemory::Schedule::aside);
  for (int64_t b = 0; b < batches; ++b) {
    int32_t* base = host.data();
    if (val.done()) break;  // one pass of documents: --eval-batches beyond it ends there
    ev.tokens += val.next(RowBatch{base, base + n, base + 2 * n, base + 3 * n});
    s.memcpy_async(m.dev_tokens, host.data(), host.size() * sizeof(int32_t));
    m.model->set_documents(val.documents() ? m.dev_tokens + 2 * n : nullptr, val.documents() ? m.dev_tokens + 3 * n : nullptr);
    m.driver->forward(m.dev_tokens, m.dev_tokens + n);
    s.memcpy_async(losses.data(), m.model->loss_rows(), losses.size() * sizeof(float));
    s.synchronize();
    if (m.tp().rank == 0 && m.pp().last_stage())
      for (float l : losses) sum += l;
    ++ev.batches;
  }
  m.mem->end_step();
  s.synchronize();
  m.model->set_documents(nullptr, nullptr);
  if (m.comm->world() > 1) {  // every rank's sum, added in rank order
    std::vector<double> all(static_cast<size_t>(m.comm->world()));
    m.comm->host_all_gather(&sum, all.data(), sizeof(double));
    sum = 0;
    for (double v : all) sum += v;
  }
  ev.loss = ev.tokens > 0 ? sum / static_cast<double>(ev.tokens) : std::nan("");
  ev.ms = ms_since(t0);
  return ev;
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
