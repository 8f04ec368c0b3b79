// The option table and what reads it: options_json, option_values, validate_options.
#include "src/train/options.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "src/checked.h"

namespace strata {

std::string OptionSpec::key() const {
  std::string k(flag + 2);
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

const std::vector<OptionSpec>& option_table() {
  using O = TrainOptions;
  constexpr unsigned all = OptionSpec::cli | OptionSpec::recorded | OptionSpec::agreed;
  constexpr unsigned cli_agreed = OptionSpec::cli | OptionSpec::agreed;
  static const std::vector<OptionSpec> table = {
      {"--model",
       "HF model directory (config.json + *.safetensors); config.json alone = random init from --seed; empty = the "
       "embedded default model",
       &O::model, all},
      {"--preset", "a named config instead of --model: gpt2-124m | default | llama-1b | llama-1.5b | llama-350m | llama-8b",
       &O::preset, all},
      {"--data",
       "token-shard glob (llm.c format; with the NAME.docs/NAME.mask that `strata data` writes, rows are built from "
       "documents and masked targets are not trained); empty = the embedded byte-level corpus",
       &O::data, all},
      {"--pack",
       "documents: off = one per row (cut to --seq + 1 tokens, padded); on = packed first-fit, attention and positions "
       "restart at each document",
       &O::pack, all},
      {"--shuffle", "documents: a new order each epoch, drawn from --seed", &O::shuffle, all},
      {"--epochs", "documents: passes over the data (0 = until --steps); without --steps, as many steps as they take",
       &O::epochs, all},
      {"--val-data",
       "held-out token shards (e.g. the val_*.bin of `strata data --val-docs`): mean masked loss and perplexity at the "
       "start, every --eval-every steps and at the end",
       &O::val_data, all},
      {"--eval-every", "steps between validations (0 = only at the start and the end)", &O::eval_every, all},
      {"--eval-batches", "micro-batches per validation (0 = the whole held-out set)", &O::eval_batches, all},
      {"--synthetic-data", "benches: fixed random tokens instead of data", &O::synthetic_data, OptionSpec::recorded},
      {"--backend", "cpu | cuda", &O::backend, all},
      {"--dtype", "working weights/activations: fp32 | bf16 | fp16 (fp32 master and grads)", &O::dtype, all},
      {"--batch", "sequences per micro-batch (B)", &O::batch, all},
      {"--seq", "tokens per sequence (T), at most max_position_embeddings", &O::seq, all},
      {"--grad-accum", "micro-batches per optimizer step (gradient = their mean)", &O::grad_accum, all},
      {"--steps", "optimizer steps", &O::steps, all},
      {"--lr", "peak learning rate", &O::lr, all},
      {"--lr-schedule", "constant | cosine (to --min-lr at the last step)", &O::lr_schedule, all},
      {"--warmup", "linear warmup steps", &O::warmup, all},
      {"--min-lr", "final learning rate of the cosine schedule", &O::min_lr, all},
      {"--weight-decay", "AdamW decoupled weight decay (2-D tensors only)", &O::weight_decay, all},
      {"--beta1", "AdamW beta1", &O::beta1, all},
      {"--beta2", "AdamW beta2", &O::beta2, all},
      {"--eps", "AdamW epsilon", &O::eps, all},
      {"--speculate",
       "auto | on | off: with clipping (or fp16), run each unit's AdamW in the backward as if nothing clips, then keep "
       "it or redo it once the global norm is known (bitwise the same run; a second copy of the optimizer state on its "
       "tier; ZeRO stages 0-1); auto: where the optimizer state is on NVMe and both copies fit, the first steps time "
       "both ways (--speculate-trial) and the run keeps the faster, waiting for the norm for 1, 2, 4 ... 128 steps "
       "after each rollback",
       &O::speculate, OptionSpec::cli | OptionSpec::agreed},
      {"--speculate-trial",
       "--speculate auto: steps run speculating, then as many waiting for the norm, before it keeps the faster way "
       "(the first step of each way is not timed; rank 0's times decide for every rank; a verdict to wait is tried "
       "again 128 steps later, then 256 ... up to every 1024); 0: no trial, speculate from the start",
       &O::speculate_trial, OptionSpec::cli | OptionSpec::agreed},
      {"--grad-clip",
       "clip the global gradient L2 norm to this (0 = off: then, bf16 or fp32 at ZeRO stage 0-1, each unit updates in "
       "the backward as soon as its gradient is final)",
       &O::grad_clip, all},
      {"--loss-scale", "fp16: the dynamic loss scaler's starting scale (a power of 2)", &O::loss_scale, all},
      {"--seed", "seed of the random init (0 to 2^64-1)", &O::seed, all},
      {"--metrics", "write one JSON object per optimizer step to this file", &O::metrics, cli_agreed},
      {"--out", "save the final model here (HF layout: config.json + safetensors)", &O::out, cli_agreed},
      {"--overwrite-model", "let --out be the input --model directory, replacing the model the run started from",
       &O::overwrite_model, cli_agreed},
      {"--log-every", "print a progress line every n steps", &O::log_every, cli_agreed},
      // A rank's cores and disks are its own: --threads and --nvme-path may differ across ranks.
      {"--threads", "CPU compute threads (0 = all available cores)", &O::threads, OptionSpec::cli},
      {"--offload-params", "where the working weights live: none (the compute device) | cpu (pinned host RAM) | nvme | auto",
       &O::offload_params, all},
      {"--offload-grads", "where the fp32 gradients live: none | cpu | nvme | auto", &O::offload_grads, all},
      {"--offload-optimizer",
       "where the fp32 master weights and AdamW state live (AdamW runs next to them): none | cpu | nvme | auto",
       &O::offload_optimizer, all},
      {"--optimizer-on-device",
       "with --offload-optimizer cpu|nvme: this fraction of the parameters (the first units in forward order, 0 to "
       "1) keeps its master and AdamW state on the device and updates there while the CPU updates the rest "
       "(DeepSpeed's Twin-Flow); auto: the fraction the planner predicts fastest within --device-mem",
       &O::optimizer_on_device, OptionSpec::cli | OptionSpec::agreed},
      {"--offload-activations", "where checkpointed blocks' kept inputs live: none | cpu | nvme | auto",
       &O::offload_activations, all},
      {"--checkpoint-activations",
       "none | full (every block keeps only its input and recomputes in backward) | every:N (blocks 0, N, 2N, ...) | auto",
       &O::checkpoint_activations, all},
      {"--offload",
       "auto: the planner picks every --offload-* flag and --checkpoint-activations not given (the fastest "
       "predicted placement within --device-mem and --host-mem, default what the machine has less max(10%, 2 GiB); "
       "NVMe only with --nvme-path); each of those flags also takes auto",
       &O::offload, all},
      {"--nvme-path", "directory for NVMe swap files (repeat: one per SSD, striped)", &O::nvme_paths,
       OptionSpec::cli | OptionSpec::recorded},
      {"--device-mem", "device memory budget, e.g. 24G (empty: what the plan needs)", &O::device_mem, all},
      {"--host-mem", "pinned host memory budget, e.g. 64G (empty: what the plan needs, within physical RAM)",
       &O::host_mem, all},
      {"--checkpoint-dir",
       "write training checkpoints here (step-N directories and 'latest'): every --checkpoint-every steps, at the "
       "end, and when SIGINT/SIGTERM stops the run",
       &O::checkpoint_dir, cli_agreed},
      {"--checkpoint-every", "steps between checkpoints (0 = only at the end and on a signal)", &O::checkpoint_every,
       cli_agreed},
      {"--keep", "how many of the newest checkpoints to keep", &O::keep, cli_agreed},
      {"--resume",
       "continue from a checkpoint: its path, a --checkpoint-dir (its newest), or auto (the newest under "
       "--checkpoint-dir; a fresh start when there is none)",
       &O::resume, cli_agreed},
      {"--zero-stage",
       "ZeRO stage across the ranks of an mpirun job: 0 = data parallel (grads all-reduced), 1 = master weights and "
       "AdamW state sharded across ranks, 2 = grads reduce-scattered and sharded too, 3 = working weights sharded too "
       "(each unit all-gathered before forward and before backward)",
       &O::zero_stage, all},
      {"--tp",
       "tensor parallelism (Megatron-LM) across the ranks of an mpirun job: each layer's attention heads and MLP, "
       "and the vocabulary of the embedding and head, split over groups of this many consecutive ranks; the job's "
       "ranks are --tp × data-parallel replicas (ZeRO over the replicas)",
       &O::tp, all},
      {"--sequence-parallel",
       "with --tp: Megatron-LM's sequence parallelism: the residual stream, norms and row-parallel outputs hold "
       "each rank's 1/tp of a micro-batch's rows (reduce-scatter and all-gather instead of all-reduce), so the "
       "activations a checkpointed block keeps shrink by --tp",
       &O::sequence_parallel, all},
      {"--pp",
       "pipeline parallelism (Megatron-LM) across the ranks of an mpirun job: the layers split into this many "
       "stages of contiguous layers (the embedding with the first, the head with the last), the step's --grad-accum "
       "micro-batches flowing through them in the 1F1B schedule; the job's ranks are --tp × --pp × data-parallel "
       "replicas",
       &O::pp, all},
      {"--pp-layers",
       "with --pp: the layers of each stage, e.g. 9,3 (empty: the split that balances the stages' FLOPs, the head "
       "counted on the last)",
       &O::pp_layers, all},
      {"--lora-rank", "LoRA: train rank-R adapters on a frozen base (0 = full fine-tuning)", &O::lora_rank, all},
      {"--lora-alpha", "LoRA: the adapters' scale is alpha / rank", &O::lora_alpha, all},
      {"--lora-rslora", "LoRA: scale alpha / sqrt(rank) (rsLoRA)", &O::lora_rslora, all},
      {"--lora-dropout", "LoRA: dropout on each adapter's input, a mask per target module",
       &O::lora_dropout, all},
      {"--lora-targets",
       "LoRA: the linear modules given adapters, by Hugging Face name or suffix (q_proj,k_proj,v_proj,o_proj,"
       "gate_proj,up_proj,down_proj; gpt2: c_attn,c_proj,c_fc) or all-linear; empty = PEFT's default (q_proj,v_proj; "
       "gpt2: c_attn). The embedding and the LM head stay frozen",
       &O::lora_targets, all},
      {"--adapter",
       "LoRA: start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors); its config "
       "sets the rank, alpha, rsLoRA and targets",
       &O::adapter, all},
      {"--base-dtype",
       "LoRA: store the frozen layers' matrices as bf16 | fp16 | int8 (per row) | nf4 (QLoRA's, double-quantized), "
       "decoded one layer at a time (empty = --dtype; the embedding and LM head stay in --dtype)",
       &O::base_dtype, all},
      {"--merge-adapter", "LoRA: --out writes the merged model (W + s·B·A, HF layout) instead of the adapter",
       &O::merge_adapter, cli_agreed},
  };
  return table;
}

nlohmann::json options_json(const TrainOptions& o) {
  nlohmann::json j = nlohmann::json::object();
  for (const OptionSpec& spec : option_table())
    if (spec.uses & OptionSpec::recorded)
      std::visit([&](auto field) { j[spec.key()] = o.*field; }, spec.field);
  return j;
}

std::vector<std::pair<std::string, std::string>> option_values(const TrainOptions& o) {
  std::vector<std::pair<std::string, std::string>> values;
  for (const OptionSpec& spec : option_table()) {
    if (!(spec.uses & OptionSpec::agreed)) continue;
    std::string text = std::visit(
        [&](auto field) -> std::string {
          const auto& v = o.*field;
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, std::string>) return v;
          else if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
          // Doubles as the shortest text that reads back as the same double: two ranks given
          // 1e-3 and 0.001 agree, 1e-3 and 1.0000001e-3 do not.
          else if constexpr (std::is_same_v<T, double>) return fmt::format("{}", v);
          else if constexpr (std::is_integral_v<T>) return std::to_string(v);
          else return fmt::format("{}", fmt::join(v, ","));
        },
        spec.field);
    values.emplace_back(spec.flag, std::move(text));
  }
  return values;
}

namespace {
std::string flag_value(double v) { return fmt::format("{:g}", v); }
}  // namespace

double parse_optimizer_on_device(const std::string& v) {
  size_t used = 0;
  double f = -1;
  try {
    f = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (v.empty() || used != v.size() || !(f >= 0 && f <= 1))
    throw std::invalid_argument("--optimizer-on-device " + v +
                                ": must be auto or a fraction from 0 (all of the optimizer on --offload-optimizer's "
                                "tier) to 1 (all on the device), e.g. 0.25");
  return f;
}

// Non-finite, negative or absurd values are one-line errors naming the flag (a NaN learning rate
// trains to NaN weights; a product of sizes that overflows divides by zero later).
void validate_options(const TrainOptions& o) {
  auto positive = [](int64_t v, const char* flag) {
    if (v <= 0) throw std::invalid_argument(std::string(flag) + " must be positive, got " + std::to_string(v));
  };
  positive(o.batch, "--batch");
  positive(o.seq, "--seq");
  positive(o.grad_accum, "--grad-accum");
  if (o.epochs < 0) throw std::invalid_argument("--epochs must not be negative, got " + std::to_string(o.epochs));
  if (o.steps != 0 || o.epochs == 0) positive(o.steps, "--steps");
  if (o.speculate != "auto" && o.speculate != "on" && o.speculate != "off")
    throw std::invalid_argument("--speculate " + o.speculate + ": must be auto, on or off");
  if (o.speculate_trial < 0 || o.speculate_trial == 1 || o.speculate_trial > 1000)
    throw std::invalid_argument("--speculate-trial " + std::to_string(o.speculate_trial) +
                                ": give 0 (no trial) or the steps to run each way, 2 to 1000 (the first of each is "
                                "not timed)");
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
  if (o.tp < 1 || o.tp > 4096)
    throw std::invalid_argument(fmt::format("--tp {}: must be 1 (no tensor parallelism) to 4096", o.tp));
  if (o.sequence_parallel && o.tp < 2)
    throw std::invalid_argument("--sequence-parallel splits rows over the tensor-parallel group: it needs --tp 2 or "
                                "more");
  if (o.pp < 1 || o.pp > 4096)
    throw std::invalid_argument(fmt::format("--pp {}: must be 1 (no pipeline parallelism) to 4096", o.pp));
  if (!o.pp_layers.empty() && o.pp < 2) throw std::invalid_argument("--pp-layers needs --pp 2 or more (the stages)");
  if (o.pp > 1) {
    // What the pipeline schedule does not run yet, refused by name.
    if (o.zero_stage >= 2)
      throw std::invalid_argument(fmt::format(
          "--zero-stage {} with --pp: a stage's gradients are reduce-scattered and its weights gathered per unit in "
          "a step that runs one micro-batch at a time; the 1F1B schedule interleaves them (DeepSpeed's pipeline "
          "engine refuses them too), so use --zero-stage 0 or 1 with --pp (the optimizer state is sharded over the "
          "data-parallel ranks at stage 1)",
          o.zero_stage));
    if (o.lora_rank > 0 || !o.adapter.empty())
      throw std::invalid_argument("--lora-rank/--adapter with --pp: adapters are not split into pipeline stages "
                                  "yet; train LoRA with --tp or data parallelism");
    if (o.speculate == "on")
      throw std::invalid_argument("--speculate on with --pp: the pipeline's update runs after the step's last "
                                  "backward; use --speculate auto or off");
  }
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  if (o.threads < 0 || static_cast<unsigned>(o.threads) > 4 * hw)
    throw std::invalid_argument(fmt::format("--threads {}: must be between 0 (all cores) and {} (4 x the {} hardware "
                                            "threads of this machine)",
                                            o.threads, 4 * hw, hw));
  if (o.lora_rank < 0 || o.lora_rank > 65536)
    throw std::invalid_argument(fmt::format("--lora-rank {}: must be 0 (full fine-tuning) to 65536", o.lora_rank));
  in_range(o.lora_alpha, 1e-30, 1e30, "--lora-alpha", "a positive finite number");
  if (!(o.lora_dropout >= 0 && o.lora_dropout < 1))
    throw std::invalid_argument("--lora-dropout " + flag_value(o.lora_dropout) + ": must be in [0, 1)");
  if (o.lora_rank > 0) {
  } else if (!o.lora_targets.empty() || o.lora_rslora || o.merge_adapter) {
    throw std::invalid_argument("--lora-targets/--lora-rslora/--merge-adapter need --lora-rank R (> 0) or --adapter DIR");
  }
  if (!o.base_dtype.empty()) {
    if (o.lora_rank == 0) throw std::invalid_argument("--base-dtype needs --lora-rank R (> 0) or --adapter DIR (a frozen base)");
    if (o.base_dtype != o.dtype && o.base_dtype != "bf16" && o.base_dtype != "fp16" && o.base_dtype != "int8" &&
        o.base_dtype != "nf4")
      throw std::invalid_argument("--base-dtype " + o.base_dtype + ": expected bf16, fp16, int8 or nf4");
    if (o.base_dtype != o.dtype && o.zero_stage == 3)
      throw std::invalid_argument("--base-dtype " + o.base_dtype +
                                  " with --zero-stage 3: a stored base is not sharded across ranks yet; use stage 0-2 "
                                  "(the base is then whole on every rank) or --base-dtype " + o.dtype);
  }
  if (o.merge_adapter && o.out.empty()) throw std::invalid_argument("--merge-adapter needs --out DIR (where the merged model goes)");
  if (!o.offload.empty() && o.offload != "auto")
    throw std::invalid_argument("--offload " + o.offload + ": the one value is auto (the planner picks the placement "
                                "flags not given); or give --offload-params/-grads/-optimizer/-activations by hand");
  if (o.optimizer_on_device != "auto") parse_optimizer_on_device(o.optimizer_on_device);
  if (o.checkpoint_every < 0) throw std::invalid_argument("--checkpoint-every must be >= 0 (0 = only at the end)");
  if (o.keep < 1) throw std::invalid_argument("--keep must be at least 1");
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty())
    throw std::invalid_argument("--checkpoint-every needs --checkpoint-dir DIR (where to write them)");
}

}  // namespace strata
