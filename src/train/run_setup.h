// A run's options resolved into what they determine before any data or memory: validated
// flags, the model config and where it comes from, precision, placement, the data's shards.
// Shared by the Trainer and `strata plan` (plan_run, estimate_run in trainer.h).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kernels/runtime.h"
#include "src/model/config.h"
#include "src/model/transformer.h"
#include "src/optim/schedule.h"
#include "src/train/options.h"
#include "src/train/run_guard.h"
#include "src/train/tiered_memory.h"

namespace strata {

struct ResolvedRun {
  ModelConfig cfg;
  std::string model_source;
  bool load_weights = false;
  // LoRA: the frozen base is --model's weights (base_weights) or a random init from --seed; a
  // resume loads it from there again and the adapters from the checkpoint.
  bool base_weights = false;
  DType dtype = DType::f32;
  kernels::Backend backend = kernels::Backend::cpu;
  LrSchedule schedule = LrSchedule::cosine;
  Checkpointing ckpt;
  LoraSpec lora;        // --lora-*: rank 0 = full fine-tuning
  Placement placement;  // with this rank's sharding
  std::filesystem::path resume;  // the checkpoint to continue from (empty: a fresh start)
  std::vector<std::filesystem::path> data_files, val_files;  // --data, --val-data shards
  bool documents = false;      // --data has document offsets: rows from documents
  bool val_documents = false;  // --val-data has
};

// `o` with --adapter DIR's adapter_config.json applied: its rank, alpha, rsLoRA and target
// modules become the --lora-* options (a --lora-rank or --lora-targets given too must agree);
// `o` itself without --adapter. Throws naming the file and the field.
TrainOptions with_adapter_config(const TrainOptions& o);

// Resolves `o` (validated: validate_options); throws one line naming the flag and the fix.
// Reads config.json of --model or of the checkpoint --resume names (which must be found already:
// the Trainer locks --checkpoint-dir first). `rank` of `world` sets the placement's sharding.
ResolvedRun resolve_run(const TrainOptions& o, int world, int rank);

// What the run reads (model files, data and held-out shards, the checkpoint it resumes), to be
// kept apart from what it writes (run_guard.h).
RunPaths run_reads(const TrainOptions& o, const ResolvedRun& r);

// Per micro-batch: inputs and targets, and with documents (training or held-out) positions and
// segment starts.
int64_t token_arrays(const ResolvedRun& r);
// The step buffers beside the model: the micro-batches' tokens, then one fp64 per unit.
size_t token_buffer_bytes(const TrainOptions& o, int64_t arrays);
size_t step_buffer_bytes(const TrainOptions& o, const ResolvedRun& r, size_t n_units);

// --speculate auto: speculation's second copy of the master and AdamW state must fit the budgets
// and the RAM next to everything else; where it does not, `pl` runs without it (the update then
// waits for the norm, as with --speculate off). `on` is left as asked: a budget it overflows is
// the error the user sees.
void settle_speculation(const TrainOptions& o, Placement& pl, const Transformer& model, kernels::Backend backend,
                        size_t step_buffers);

}  // namespace strata
