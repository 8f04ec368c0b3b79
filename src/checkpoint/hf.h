// Hugging Face model directories: config.json plus model.safetensors, or sharded
// model-0000k-of-0000n.safetensors with model.safetensors.index.json. Reading memory-maps
// the files (a multi-GB checkpoint is never read into RAM at once); writing goes to a
// temporary directory that is renamed into place, so a failed save never replaces a good one.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kernels/dtype.h"
#include "src/model/config.h"

namespace strata {

// Parses config.json (llama, mistral, qwen2, gpt2). An unknown model_type or a missing or
// malformed field throws std::runtime_error naming the file and the field.
ModelConfig read_hf_config(const std::filesystem::path& config_json);
// Writes config.json for `cfg` in HF's layout (architectures, model_type, every field HF needs).
void write_hf_config(const ModelConfig& cfg, const std::filesystem::path& config_json);

// One tensor of a checkpoint as stored: HF name, dtype, shape and its bytes (mapped).
struct StoredTensor {
  std::string name;
  kernels::DType dtype = kernels::DType::f32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // valid while the HfCheckpoint lives
  size_t nbytes = 0;
  std::string file;            // which .safetensors file it came from (for error messages)
};

// All tensors of a model directory, memory-mapped. Parsing is hardened: header length bound,
// JSON validated, offsets inside the file and non-overlapping, shape × dtype size equal to the
// byte range, supported dtypes only (F32, BF16, F16); every violation throws naming file and
// tensor.
class HfCheckpoint {
 public:
  static std::unique_ptr<HfCheckpoint> open(const std::filesystem::path& model_dir);
  // One .safetensors file by itself (same validation).
  static std::unique_ptr<HfCheckpoint> open_file(const std::filesystem::path& file);
  virtual ~HfCheckpoint() = default;
  virtual const std::vector<StoredTensor>& tensors() const = 0;
  // Null when absent.
  virtual const StoredTensor* find(const std::string& name) const = 0;
  // Converts the named tensor into `dst` (numel elements of dst_dtype), round-to-nearest-even;
  // throws naming the tensor if it is missing or its shape differs from `expected_shape`.
  virtual void read_into(const std::string& name, const std::vector<int64_t>& expected_shape, void* dst,
                         kernels::DType dst_dtype) const {
    read_range(name, expected_shape, 0, -1, dst, dst_dtype);
  }
  // The same for the elements [begin, end) of the tensor in row-major order (end -1: to its
  // last), so a rank loads its shard without touching the rest of the file: only those
  // elements are converted and checked for non-finite values.
  virtual void read_range(const std::string& name, const std::vector<int64_t>& expected_shape, int64_t begin,
                          int64_t end, void* dst, kernels::DType dst_dtype) const = 0;
};

// A tensor to save: name, shape, dtype and a callback that fills its bytes (so huge models can
// be streamed out from wherever their parameters live). With fill_range the save stages the
// tensor a piece (kSavePieceBytes) at a time, not whole: a vocabulary-sized tensor would
// otherwise be one more copy of itself in the writer (2 GiB for llama-8b's embedding in fp32).
struct TensorToSave {
  std::string name;
  std::vector<int64_t> shape;
  kernels::DType dtype = kernels::DType::f32;
  std::function<void(void* dst)> fill;  // writes numel × dtype_size bytes
  // Writes bytes [offset, offset + n) of the tensor (whole elements) to dst; used where set.
  std::function<void(void* dst, uint64_t offset, uint64_t n)> fill_range = nullptr;
};
// The most bytes of one tensor a save stages at a time where the tensor has a fill_range.
inline constexpr uint64_t kSavePieceBytes = 64ull << 20;

// One safetensors file written from callbacks (one tensor staged at a time), fsynced: its size
// and crc32c (of every byte of the file, as written).
struct WrittenFile {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};
WrittenFile write_safetensors_file(const std::filesystem::path& path, const std::vector<TensorToSave>& tensors);

// Checks, before any work, that save_hf_model can write `out_dir` with the same rules it will
// apply then: a trailing '/' is dropped; an existing out_dir must be a real directory (not a
// file, not a symlink) holding nothing but a saved model's files (config.json,
// model*.safetensors, model.safetensors.index.json), since a save replaces the whole directory;
// ".", "..", the working directory, its parents and "/" are refused; its parent is created and
// a temporary sibling is made and removed there. Temporary siblings left by killed saves
// ("<out>.tmp-<pid>-*", "<out>.old-<pid>-*" of dead pids) are removed. Throws
// std::runtime_error naming the path, the reason and the fix.
void check_hf_save_target(const std::filesystem::path& out_dir);

// Writes config.json and the tensors to `out_dir` in HF layout: one model.safetensors when the
// total is at most `shard_bytes`, else model-0000k-of-0000n.safetensors + index. Writes into
// a sibling temporary directory, fsyncs, then renames over `out_dir` (an existing good
// directory is only replaced once the new one is complete; one holding files a save does not
// write is refused, as in check_hf_save_target). Throws naming the path on failure.
// extra_files: tokenizer files (kTokenizerFiles names) copied beside the weights, so that the
// saved directory tokenizes and chats as the model it was trained from did.
void save_hf_model(const std::filesystem::path& out_dir, const ModelConfig& cfg,
                   const std::vector<TensorToSave>& tensors, uint64_t shard_bytes = 5ull << 30,
                   const std::vector<std::filesystem::path>& extra_files = {});
// A PEFT LoRA adapter in `out_dir` (adapter_config.json + adapter_model.safetensors, PEFT's
// tensor names), written and replaced as save_hf_model does; extra_files: tokenizer files.
void save_peft_adapter(const std::filesystem::path& out_dir, const nlohmann::json& adapter_config,
                       const std::vector<TensorToSave>& tensors, const std::vector<std::filesystem::path>& extra_files);

// The tokenizer's files of a Hugging Face model directory, carried by a save.
inline constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                                  "special_tokens_map.json", "generation_config.json"};

}  // namespace strata
