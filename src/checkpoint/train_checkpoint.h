// Training checkpoints: everything a run needs to continue bit for bit, written crash-safely.
//
//   DIR/step-00000010/            one checkpoint (a complete directory or none at all)
//     config.json                 the model (HF layout: the directory also loads as --model)
//     model.safetensors           fp32 master weights, HF tensor names
//     optimizer.safetensors       AdamW state: "<name>.exp_avg", "<name>.exp_avg_sq" (fp32)
//     trainer.json                the manifest, written last: format, step, loss scaler, data
//                                 position, flags, and each file's size and crc32c
//   DIR/latest                    "step-00000010\n": the newest complete checkpoint
//
// Tensors are stored unsharded by name, so a checkpoint is independent of placement, padding
// and (later) world size. Writing: a temporary directory DIR/.tmp-<pid>-XXXXXX, every file and
// the directory fsynced, renamed to step-N, DIR fsynced, then `latest` replaced by rename. A
// checkpoint is complete exactly when its step-N directory exists; `latest` only ever names a
// complete one. Loading verifies every file's size and checksum first and names the one that
// fails.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "src/checkpoint/hf.h"
#include "src/model/config.h"

namespace strata {

inline constexpr const char* kTrainCheckpointFormat = "strata-train-checkpoint";
inline constexpr int kTrainCheckpointVersion = 1;

struct TrainCheckpointContent {
  ModelConfig cfg;
  std::vector<TensorToSave> model;      // fp32 master weights
  std::vector<TensorToSave> optimizer;  // AdamW m and v
  nlohmann::json state;                 // trainer state (step, scaler, data, flags, ...)
};

// Writes DIR/step-<step> as described above, points `latest` at it and removes the oldest
// complete checkpoints of the same run (content.state["run_id"]) beyond `keep` (keep >= 1). Returns the checkpoint's path. Throws naming
// the path on failure; a failed write leaves DIR as it was (its temporary directory removed).
std::filesystem::path write_train_checkpoint(const std::filesystem::path& dir, int64_t step,
                                             const TrainCheckpointContent& content, int keep);

// Checks before training that DIR can hold checkpoints (created if missing, writable).
void prepare_checkpoint_dir(const std::filesystem::path& dir);
// Removes the temporary directories that killed runs left in DIR (their pid gone); called with
// DIR locked, so a live run's temporary is never taken for a dead one's.
void remove_dead_checkpoint_temporaries(const std::filesystem::path& dir);

// Reads and verifies a checkpoint (format, version, every file's size and crc32c): the manifest.
// Throws std::runtime_error naming the checkpoint and the file that fails.
nlohmann::json verify_train_checkpoint(const std::filesystem::path& ckpt);

// True when `path` is one checkpoint (holds trainer.json).
bool is_train_checkpoint(const std::filesystem::path& path);

// The checkpoint to resume from: `resume` is a checkpoint, a checkpoint directory (its
// `latest`, else its newest step-N), or "auto" (the same under checkpoint_dir; empty only when
// the directory holds no checkpoint at all: a fresh start). A damaged one (`latest` unreadable
// or naming no complete checkpoint, a step-N without trainer.json) throws, naming it and the
// newest complete checkpoint as the way out.
std::filesystem::path find_resume_checkpoint(const std::string& resume, const std::string& checkpoint_dir);

// For an error about checkpoint `ckpt` (corrupt, unreadable): the sentence naming the newest
// complete checkpoint older than it in the same directory as the way out.
std::string older_checkpoint_hint(const std::filesystem::path& ckpt);

// The step-N checkpoints in `dir` that belong to another run than `run_id` (by the run id in
// their trainer.json; for a fresh run, every one). Checkpoints without a readable run id
// (written before run ids, or damaged) count as another run's only for a fresh run.
std::vector<std::string> checkpoints_of_other_runs(const std::filesystem::path& dir, const std::string& run_id,
                                                   bool fresh);

// "step-00000010": the directory name of step 10's checkpoint.
std::string checkpoint_name(int64_t step);

// The optimizer state's tensor names for a parameter.
inline std::string exp_avg_name(const std::string& param) { return param + ".exp_avg"; }
inline std::string exp_avg_sq_name(const std::string& param) { return param + ".exp_avg_sq"; }

}  // namespace strata
