// A training run's configuration: TrainOptions, and the one table of its options that every
// use reads — the `strata train`/`strata plan` flags (apps/strata/train.cpp), the flags a
// checkpoint records and a resume compares (options_json), the flags every rank of a job must
// agree on and the header prints (option_values), and their validation. A new option is one
// field here and one row in options.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace strata {

// Every knob of a training run; each is a `strata train` flag of the same name.
// The defaults are the demo: the embedded model on the embedded corpus for about a minute.
struct TrainOptions {
  std::string model;           // HF model directory ("" = the embedded default config)
  std::string preset;          // named config instead of --model (benches): gpt2-124m, default
  std::string data;            // token-shard glob ("" = the embedded byte-level corpus)
  // Shards with document offsets (NAME.docs, from `strata data`) make rows from documents
  // (src/data/doc_rows.h): one per row, cut to seq + 1 tokens and padded ("off"), or packed
  // first-fit with attention kept inside each document ("on"). Their loss masks (NAME.mask)
  // decide which targets are trained. Shards without them are a stream, cut as llm.c does.
  std::string pack = "off";    // off | on
  bool shuffle = false;        // documents permuted from --seed once per epoch
  int64_t epochs = 0;          // > 0: stop after this many passes over the documents (or --steps)
  std::string val_data;        // held-out shards: mean masked loss ("" = no validation)
  int64_t eval_every = 0;      // validate every n steps (0: at the start and the end only)
  int64_t eval_batches = 0;    // micro-batches per validation (0: the whole held-out set)
  bool synthetic_data = false; // benches: fixed random tokens instead of data
  std::string backend = "cpu";
  std::string dtype = "fp32";  // working weights/activations: fp32 | bf16 | fp16
  int64_t batch = 4;           // B: sequences per micro-batch
  int64_t seq = 128;           // T: tokens per sequence
  int64_t grad_accum = 1;      // micro-batches per optimizer step
  int64_t steps = 100;         // optimizer steps (0 with --epochs: as many as the epochs take)
  double lr = 2e-3;            // peak learning rate
  std::string lr_schedule = "cosine";  // constant | cosine
  int64_t warmup = 5;          // linear warmup steps
  double min_lr = 2e-4;        // cosine floor
  double weight_decay = 0.1;   // AdamW, 2-D tensors only
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;      // global L2 norm; 0 = off
  // Where nothing waits for the global norm (grad_clip 0, no fp16 loss scaler; stages 0-1), run
  // each unit's AdamW in the backward as its gradient becomes final (Placement::
  // update_in_backward()). The same math either way; false keeps the update in the next forward.
  bool update_in_backward = true;
  // With clipping or fp16: on = each unit's AdamW runs in the backward as if nothing clips, into
  // a second copy of its master and AdamW state, committed or redone once the norm is known
  // (Placement::speculate); auto = where the optimizer state lives on NVMe and both copies fit,
  // the first steps time both ways (speculate_trial steps each, SpeculationTrial) and the run
  // keeps the faster, waiting for the norm for a while after each rollback; off = the update
  // waits for the norm. Off by default: a fine-tune whose steps often clip pays a rerun for
  // each rollback.
  std::string speculate = "off";
  // --speculate auto: steps run each way before it picks (the first of each not timed; a verdict
  // to wait is tried again 128 steps later, then 256 ... up to every 1024); 0: no trial, it
  // speculates from the start (and backs off after rollbacks).
  int64_t speculate_trial = 3;
  double loss_scale = 65536;   // fp16: the dynamic loss scaler's starting scale
  uint64_t seed = 1337;        // random init (models without weights) and synthetic data
  std::string metrics;         // JSONL file, one object per optimizer step ("" = none)
  std::string out;             // save the final model here, HF layout ("" = don't)
  bool overwrite_model = false;  // --out may be the input --model (replaced by the trained one)
  int64_t log_every = 1;       // progress line every n steps (and the first and last)
  int threads = 0;             // CPU compute threads (0 = all available cores)
  // Placement (DESIGN.md "One training step"): none = the compute device, cpu = pinned host
  // RAM, nvme = swap files under --nvme-path. Budgets "" = what the plan needs.
  std::string offload_params = "none";      // working weights (compute dtype)
  std::string offload_grads = "none";       // fp32 gradients
  std::string offload_optimizer = "none";   // fp32 master + AdamW m, v
  // With --offload-optimizer cpu|nvme: the fraction of the trainable parameters whose master and
  // AdamW state stay on the device and update there (Twin-Flow, DeepSpeed ZeRO-Offload++): the
  // first units in forward order (Placement::optimizer_on_device). "auto": the planner's pick.
  std::string optimizer_on_device = "0";
  std::string offload_activations = "none"; // kept inputs of checkpointed blocks
  std::string checkpoint_activations = "none";  // none | full | every:N
  // "auto": every --offload-* flag and --checkpoint-activations not given is chosen by the planner
  // (the fastest predicted placement that fits the budgets; src/train/auto_placement.h). Each of
  // the five also takes "auto" itself; a run resolves them before anything is sized.
  std::string offload;
  std::vector<std::string> nvme_paths;      // swap directories (one per SSD)
  std::string device_mem;                   // device budget, e.g. 24G
  std::string host_mem;                     // pinned host budget
  // Training checkpoints (src/checkpoint/train_checkpoint.h): every n steps, at the end and
  // when a signal stops the run; the newest `keep` are kept. resume: a checkpoint, a
  // checkpoint directory, or "auto" (the newest under checkpoint_dir; a fresh start if none).
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;             // 0 = only at the end and on SIGINT/SIGTERM
  int64_t keep = 2;
  std::string resume;
  // ZeRO stage across the ranks of an mpirun job (src/train/run_memory.h Sharding): 0 = data
  // parallel (grads all-reduced), 1 = optimizer state sharded, 2 = grads sharded too, 3 = working
  // weights sharded too (gathered per unit when used).
  int zero_stage = 0;
  // Tensor parallelism (src/comm/grid.h): groups of tp consecutive ranks each hold one part of
  // every layer; the job's world is tp × the data-parallel replicas ZeRO shards over.
  int tp = 1;
  bool sequence_parallel = false;  // with tp: the residual stream split by rows too (Megatron-LM)
  // Pipeline parallelism: pp stages of contiguous layers (pp_layers: the layers per stage,
  // "8,8,7,9"; empty = the FLOP-balanced split, pipeline_split), the step's grad_accum
  // micro-batches in the 1F1B schedule;
  // the world is tp × pp × the data-parallel replicas.
  int pp = 1;
  std::string pp_layers;
  // LoRA (src/model/lora.h): rank 0 = full fine-tuning; otherwise the base is frozen and each
  // layer's adapters train (PEFT's defaults: alpha 8, targets q_proj,v_proj / c_attn).
  int64_t lora_rank = 0;
  double lora_alpha = 8;
  bool lora_rslora = false;        // scale alpha / sqrt(rank) instead of alpha / rank
  double lora_dropout = 0;
  std::string lora_targets;        // "" = the family's PEFT default; "all-linear"
  std::string adapter;             // start from this PEFT adapter (its config sets the --lora-* shape)
  std::string base_dtype;          // the frozen base's storage: "" (= --dtype) | bf16 | fp16 | int8 | nf4
  bool merge_adapter = false;      // --out: the merged model (W + s·B·A), not the adapter
};

// One row of the option table: the flag, its help text, the field it sets and where it goes.
struct OptionSpec {
  // What each use of the table takes from a row.
  enum Use : unsigned {
    cli = 1,        // a `strata train` / `strata plan` flag
    recorded = 2,   // in a checkpoint's flags (options_json); a resume names what changed
    agreed = 4,     // every rank of a job must give the same value (option_values; the header)
  };
  const char* flag;  // "--grad-accum"; its JSON key is the name with '_' for '-' ("grad_accum")
  const char* help;
  std::variant<std::string TrainOptions::*, bool TrainOptions::*, int TrainOptions::*, int64_t TrainOptions::*,
               uint64_t TrainOptions::*, double TrainOptions::*, std::vector<std::string> TrainOptions::*>
      field;
  unsigned uses;
  std::string key() const;  // the JSON key
};
// Every option, in the order `strata train --help` lists them.
const std::vector<OptionSpec>& option_table();

// The options a checkpoint records (trainer.json "flags"), by JSON key.
nlohmann::json options_json(const TrainOptions& o);
// Every flag whose value must agree across the ranks of a job, by name, as the value would be
// typed ("--steps", "100"). The same list prints the header's copy-pasteable flags line.
std::vector<std::pair<std::string, std::string>> option_values(const TrainOptions& o);
// Every numeric flag and every choice, before anything is read or allocated: one line naming the
// flag and what it accepts.
void validate_options(const TrainOptions& o);
// --optimizer-on-device as a fraction in [0, 1] (not "auto": that is the planner's, resolved
// before a run is sized); throws naming the flag otherwise.
double parse_optimizer_on_device(const std::string& v);

}  // namespace strata
