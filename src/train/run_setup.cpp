// Options into a resolved run, and the plan of a run that is never allocated (`strata plan`).
#include "src/train/run_setup.h"

#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "offload/size.h"
#include "src/comm/grid.h"
#include "src/checkpoint/hf.h"
#include "src/checkpoint/safetensors.h"
#include "src/checkpoint/train_checkpoint.h"
#include "src/data/doc_rows.h"
#include "src/data/doc_shards.h"
#include "src/data/token_shards.h"
#include "src/train/perf_model.h"
#include "src/train/trainer.h"

namespace strata {
namespace fs = std::filesystem;

namespace {

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

}  // namespace

TrainOptions with_adapter_config(const TrainOptions& in) {
  if (in.adapter.empty()) return in;
  TrainOptions o = in;
  LoraSpec l;
  try {
    l = read_peft_config(o.adapter);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("--adapter " + o.adapter + ": " + e.what());
  }
  const std::string file = (fs::path(o.adapter) / "adapter_config.json").string();
  if (o.lora_rank != 0 && o.lora_rank != l.rank)
    throw std::invalid_argument(file + ": r is " + std::to_string(l.rank) + " but --lora-rank is " +
                                std::to_string(o.lora_rank) + " (drop --lora-rank: the adapter sets it)");
  std::string joined;
  for (const std::string& n : l.targets) joined += (joined.empty() ? "" : ",") + n;
  if (!o.lora_targets.empty() && parse_lora_targets(o.lora_targets) != l.targets)
    throw std::invalid_argument(file + ": target_modules is " + joined + " but --lora-targets is " + o.lora_targets +
                                " (drop --lora-targets: the adapter sets it)");
  o.lora_rank = l.rank;
  o.lora_alpha = l.alpha;
  o.lora_rslora = l.rslora;
  o.lora_targets = joined;
  return o;
}

ResolvedRun resolve_run(const TrainOptions& o, int world, int rank) {
  ResolvedRun r;
  r.dtype = kernels::parse_dtype(o.dtype);
  r.backend = kernels::parse_backend(o.backend);
  if (!kernels::backend_trains(r.backend))
    throw std::invalid_argument("--backend " + o.backend +
                                ": the CUDA op set is not built yet (only the CUDA runtime is); use --backend cpu");
  r.schedule = parse_lr_schedule(o.lr_schedule);
  r.ckpt = parse_checkpointing(o.checkpoint_activations);
  r.lora.rank = o.lora_rank;
  r.lora.alpha = o.lora_alpha;
  r.lora.rslora = o.lora_rslora;
  r.lora.dropout = o.lora_dropout;
  r.lora.base_dtype = o.base_dtype == o.dtype ? "" : o.base_dtype;
  if (!o.lora_targets.empty()) r.lora.targets = parse_lora_targets(o.lora_targets);
  Placement& pl = r.placement;
  pl.params = parse_offload(o.offload_params, "--offload-params");
  pl.grads = parse_offload(o.offload_grads, "--offload-grads");
  pl.optimizer = parse_offload(o.offload_optimizer, "--offload-optimizer");
  pl.activations = parse_offload(o.offload_activations, "--offload-activations");
  // ("auto" not resolved yet by the planner (strata train, plan) counts as none on the device.)
  pl.optimizer_on_device = o.optimizer_on_device == "auto" ? 0 : parse_optimizer_on_device(o.optimizer_on_device);
  if (pl.optimizer == offload::Tier::device && pl.optimizer_on_device > 0 && pl.optimizer_on_device < 1)
    throw std::invalid_argument("--optimizer-on-device " + o.optimizer_on_device +
                                " splits the optimizer state between the device and --offload-optimizer's tier, but "
                                "--offload-optimizer is none (all of it on the device already): give "
                                "--offload-optimizer cpu or nvme");
  if (pl.activations != offload::Tier::device && !r.ckpt.any())
    throw std::invalid_argument("--offload-activations " + o.offload_activations +
                                " moves the kept inputs of checkpointed blocks: it needs --checkpoint-activations "
                                "full or every:N");
  pl.sharding = Sharding{o.zero_stage, world, rank};
  pl.nvme_paths = o.nvme_paths;
  // (Pipeline parallel: the update follows the step's last backward, on every stage.)
  pl.norm_free = o.update_in_backward && o.grad_clip <= 0 && r.dtype != DType::f16 && o.pp == 1;
  // Speculation: only where something waits for the norm, and with whole gradients.
  if (o.speculate == "on" && pl.sharding.sharded_grads())
    throw std::invalid_argument("--speculate on needs whole gradients: ZeRO stage 0 or 1 (this job is stage " +
                                std::to_string(o.zero_stage) + " on " + std::to_string(world) +
                                " ranks); use --zero-stage 1 or --speculate off");
  pl.speculate = o.update_in_backward && !pl.norm_free && !pl.sharding.sharded_grads() && o.pp == 1 &&
                 (o.speculate == "on" || (o.speculate == "auto" && pl.optimizer == offload::Tier::nvme));
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
    r.base_weights = r.load_weights;
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

RunPaths run_reads(const TrainOptions& o, const ResolvedRun& r) {
  RunPaths reads;
  reads.resume = r.resume;
  if (!o.model.empty()) {
    reads.model_dir = o.model;
    std::error_code ec;
    for (fs::directory_iterator it(o.model, ec), end; !ec && it != end; it.increment(ec))
      reads.model_files.push_back(it->path());
  }
  if (!o.adapter.empty())  // read at start-up, like --model's files
    for (const char* f : {"adapter_config.json", "adapter_model.safetensors"})
      reads.model_files.push_back(fs::path(o.adapter) / f);
  reads.data_files = r.data_files;
  reads.data_files.insert(reads.data_files.end(), r.val_files.begin(), r.val_files.end());
  return reads;
}

int64_t token_arrays(const ResolvedRun& r) { return r.documents || r.val_documents ? 4 : 2; }
size_t token_buffer_bytes(const TrainOptions& o, int64_t arrays) {
  return (static_cast<size_t>(o.grad_accum * arrays * o.batch * o.seq) * sizeof(int32_t) + 63) / 64 * 64;
}
size_t step_buffer_bytes(const TrainOptions& o, const ResolvedRun& r, size_t n_units) {
  return token_buffer_bytes(o, token_arrays(r)) + n_units * sizeof(double);
}

uint64_t comm_bytes_per_step(const Transformer& model, const Sharding& sh, int64_t grad_accum) {
  if (sh.world <= 1) return 0;
  const double part = static_cast<double>(sh.world - 1) / sh.world;
  const double esz = static_cast<double>(kernels::dtype_size(model.dtype()));
  double b = 0;
  const double accum = static_cast<double>(grad_accum);
  for (const Unit& u : model.units()) {
    const double n = static_cast<double>(u.numel);
    if (u.trainable) {  // a frozen unit (LoRA's base) has no grads and is never updated
      if (sh.stage <= 1) b += 2 * part * n * 4;                 // grads all-reduced
      if (sh.stage == 1 || sh.stage == 2) b += part * n * esz;  // new weights all-gathered
      if (sh.stage >= 2) b += part * n * 4 * accum;             // grads reduce-scattered
    }
    if (sh.stage >= 3) b += part * n * esz * accum;  // gathered for the forward
  }
  // Stage 3 gathers each block (and its adapters) again for its backward (the final norm and the
  // head are used once, forward and backward in one phase; a tied head is the embedding, still
  // gathered).
  if (sh.stage >= 3)
    for (int64_t l = 0; l < model.dims().L; ++l)
      for (int u : {model.block_unit(l), model.lora_unit(l)})
        if (u >= 0) b += part * static_cast<double>(model.units()[static_cast<size_t>(u)].numel) * esz * accum;
  return static_cast<uint64_t>(b);
}

uint64_t tp_comm_bytes_per_step(const Transformer& model, int64_t grad_accum) {
  const TensorParallel& tp = model.tensor_parallel();
  if (!tp.on()) return 0;
  const ModelDims& d = model.dims();
  const auto t = static_cast<uint64_t>(tp.size);
  const auto act = static_cast<uint64_t>(d.N * d.C) * kernels::dtype_size(model.dtype());
  const uint64_t per_all_reduce = 2 * act * (t - 1) / t;  // = an all-gather and a reduce-scatter of it (sequence parallel)
  uint64_t recomputed = 0;
  for (int64_t l = 0; l < d.L; ++l) recomputed += model.checkpointing().at(l) ? 1 : 0;
  // Per layer 2 in the forward (again when recomputed) and 2 in the backward; the embedding's
  // rows and the head's input gradient; the cross-entropy's 3 floats a row to every other rank.
  uint64_t b = (4 * static_cast<uint64_t>(d.L) + 2 * recomputed + 2) * per_all_reduce +
               static_cast<uint64_t>(3 * d.N * 4) * (t - 1);
  if (tp.sequence) {  // the norms' grads, from each rank's rows, all-reduced (fp32)
    // (a LayerNorm has a bias: its final norm's lnf_b)
    const uint64_t per_norm = (model.outer_layout().lnf_b >= 0 ? 2 : 1) * static_cast<uint64_t>(d.C) * 4;
    b += (2 * static_cast<uint64_t>(d.L) + 1) * (2 * per_norm * (t - 1) / t);
  }
  return b * static_cast<uint64_t>(grad_accum);
}

uint64_t pp_comm_bytes_per_step(const Transformer& model, int64_t grad_accum) {
  const PipelineStage& pp = model.pipeline();
  if (!pp.on()) return 0;
  const ModelDims& d = model.dims();
  const auto act = static_cast<uint64_t>(d.res_rows * d.C) * kernels::dtype_size(model.dtype());
  const uint64_t neighbours = (pp.first_stage() ? 0 : 1) + (pp.last_stage() ? 0 : 1);
  const bool tie = model.tied_head() && (pp.first_stage() || pp.last_stage());
  return neighbours * act * static_cast<uint64_t>(grad_accum) +
         (tie ? static_cast<uint64_t>(model.units()[static_cast<size_t>(model.embed_unit())].n_real) * 4 : 0);
}

void settle_speculation(const TrainOptions& o, Placement& pl, const Transformer& model, kernels::Backend backend,
                        size_t step_buffers) {
  if (!pl.speculate || o.speculate != "auto") return;
  pl.speculate = TieredMemory::fits(model, backend, pl, o.grad_accum, step_buffers);
}

namespace {
// One rank of a `world`-rank run, sized for planning: its model on a CPU runtime (shapes only, no
// device needed) and its placement with this rank's sharding.
struct SizedRun {
  TrainOptions o;  // an --adapter's config applied (read once)
  int dp;          // the data-parallel replicas (world / --tp)
  ResolvedRun r;
  std::unique_ptr<kernels::Runtime> rt = kernels::make_runtime(kernels::Backend::cpu);
  Transformer model;
  size_t step_buffers;
  // world: the job's ranks; with --tp and --pp, the data-parallel replicas ZeRO shards over are
  // world / (tp · pp), and the model is tp rank 0's part (its vocabulary rows are the largest)
  // of pipeline stage `stage`.
  SizedRun(const TrainOptions& given, int world, int stage = 0)
      : o(with_adapter_config(given)),
        dp((validate_options(o), grid_shape(world, o.tp, o.pp).dp)),
        r(resolve_run(o, dp, 0)),
        model(r.cfg, r.dtype, o.batch, o.seq, *rt, r.ckpt, kLogitsChunkBytes, dp, r.lora,
              TensorParallel{o.tp, 0, nullptr, o.sequence_parallel}, stage_of(o, r.cfg, stage)),
        step_buffers(step_buffer_bytes(o, r, model.units().size())) {
    settle_speculation(o, r.placement, model, r.backend, step_buffers);
  }
  // Pipeline stage `stage` of o's split of cfg's layers (sized only: no group).
  static PipelineStage stage_of(const TrainOptions& o, const ModelConfig& cfg, int stage) {
    if (o.pp < 2) return {};
    return pipeline_stage(pipeline_split(cfg, o.batch, o.seq, TensorParallel{o.tp, 0, nullptr, o.sequence_parallel},
                                         parse_checkpointing(o.checkpoint_activations), o.pp, o.pp_layers),
                          stage, o.grad_accum);
  }
};
}  // namespace

RunPlan plan_run(const TrainOptions& o, bool minimums, int world) {
  if (world < 1) throw std::invalid_argument("--world must be at least 1, got " + std::to_string(world));
  const SizedRun run(o, world);
  RunPlan p;
  p.memory = TieredMemory::plan(run.model, run.r.backend, run.r.placement, o.grad_accum, run.step_buffers, minimums);
  if (o.pp > 1) {  // every stage planned (stage 0 is `run`); the tiers shown are the one that holds the most
    p.pp = o.pp;
    p.pp_layers = pipeline_split(run.r.cfg, o.batch, o.seq, TensorParallel{o.tp, 0, nullptr, o.sequence_parallel},
                                 run.r.ckpt, o.pp, o.pp_layers);
    p.pp_bubble = static_cast<double>(o.pp - 1) / static_cast<double>(o.grad_accum + o.pp - 1);
    uint64_t most = 0;
    const auto add_stage = [&](int s, const SizedRun& st, MemoryPlan plan) {
      p.stage_params.push_back(st.model.n_trainable_params());
      p.pp_comm_bytes = std::max(p.pp_comm_bytes, pp_comm_bytes_per_step(st.model, o.grad_accum));
      const auto& b = plan.budget;
      if (s == 0 || b[0] + b[1] + b[2] > most) {
        most = b[0] + b[1] + b[2];
        p.stage = s;
      }
      p.stage_memory.push_back(std::move(plan));
    };
    add_stage(0, run, p.memory);
    for (int s = 1; s < o.pp; ++s) {
      const SizedRun st(o, world, s);
      add_stage(s, st, TieredMemory::plan(st.model, st.r.backend, st.r.placement, o.grad_accum, st.step_buffers, minimums));
    }
    p.memory = p.stage_memory[static_cast<size_t>(p.stage)];
  }
  if (minimums && run.r.placement.speculate && run.o.speculate == "auto") {
    // Below what speculation needs, auto runs without it: the minimums are those of that run.
    Placement plain = run.r.placement;
    plain.speculate = false;
    p.memory.minimum =
        TieredMemory::plan(run.model, run.r.backend, plain, o.grad_accum, run.step_buffers, true).minimum;
  }
  p.speculate = run.r.placement.speculate;
  p.cfg = run.r.cfg;
  p.lora = run.r.lora;
  p.n_params = run.model.n_model_params();
  p.tokens_per_step = o.batch * o.seq * o.grad_accum * run.dp;
  p.world = world;
  p.tp = o.tp;
  p.tp_comm_bytes = tp_comm_bytes_per_step(run.model, o.grad_accum);
  p.update_in_backward = run.r.placement.update_in_backward();
  p.comm_bytes = comm_bytes_per_step(run.model, run.r.placement.sharding, o.grad_accum);
  return p;
}

offload::StepTimeline estimate_run(const TrainOptions& o, const RunPlan& p, const StepCosts& costs) {
  const SizedRun run(o, p.world);
  return TieredMemory::estimate(run.model, run.r.backend, run.r.placement, o.grad_accum, run.step_buffers,
                                p.memory.budget, costs);
}

}  // namespace strata
