// Generator: a model's forward for sampling, with a KV cache. The prompt is prefilled in one
// pass (all its tokens through each block), then each step runs one new token per batch item
// against the cache. Weights are units in the tiered BlockManager (offload/), homed where
// --offload-params says (device, pinned host RAM or NVMe) and acquired one unit at a time in a
// declared schedule, so the planner prefetches the next unit and a model larger than RAM still
// generates. Batches of prompts of different lengths are left-padded: pad slots are invisible
// to the real tokens (attention's seg_start) and positions count from each prompt's first token.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/runtime.h"
#include "offload/tier.h"
#include "src/checkpoint/hf.h"
#include "src/model/transformer.h"

namespace strata::io {
class IoEngine;
class SwapSpace;
}  // namespace strata::io
namespace strata::offload {
class BlockManager;
}

namespace strata {

// Where the working weights live and the budgets (as strata train's flags).
struct WeightPlacement {
  offload::Tier params = offload::Tier::device;  // --offload-params none | cpu | nvme
  std::vector<std::string> nvme_paths;           // --nvme-path
  uint64_t device_mem = 0;                       // --device-mem (0: the weights' needs + workspace)
  uint64_t host_mem = 0;                         // --host-mem (0: what the placement needs)
};

// The largest batch the generator serves: prompts of up to max_prompt tokens (the prefill's
// rows), cache room for `capacity` tokens per item (max_prompt + new tokens).
struct GenerateShape {
  int64_t batch = 1, max_prompt = 1, capacity = 1;
};

class Generator {
 public:
  // Registers the weights' units and the workspace (activations of one prefill, the KV cache,
  // the logits) with a BlockManager under `placement` and allocates them. Throws naming the
  // budget (offload::BudgetError) or the shape that does not fit.
  Generator(const ModelConfig& cfg, kernels::DType dtype, kernels::Runtime& rt, kernels::Stream& s,
            const WeightPlacement& placement, GenerateShape shape);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // The working weights, one unit at a time: from a checkpoint (converted to the working dtype),
  // or GPT-2-style random init from `seed` (what strata train starts from).
  // adapter: a PEFT LoRA adapter directory merged into the weights as they load (each adapted
  // weight W + s·B·A in float64, rounded once: the same weights as `strata train
  // --merge-adapter`); throws naming the adapter when it adapts no weight of the model.
  void load(const HfCheckpoint& ckpt, const std::filesystem::path& adapter = {});
  void init_random(uint64_t seed);
  // Unit u's working weights from its fp32 values (host, the unit's numel, padding zeroed).
  void set_unit(int u, const std::vector<float>& master);

  // Starts a batch (1..shape.batch prompts, each 1..max_prompt tokens, each id in the vocab):
  // left-pads to the longest, prefills, and returns the logits (B, V) fp32 of each prompt's
  // last token.
  const std::vector<float>& prefill(const std::vector<std::vector<int32_t>>& prompts);
  // One token per batch item (B of them) appended after what the cache holds; the logits (B, V)
  // of the next token. Throws when the cache is full.
  const std::vector<float>& step(const std::vector<int32_t>& tokens);

  const ModelConfig& config() const { return model_.config(); }
  const Transformer& layout() const { return model_; }  // units and tensors
  int64_t batch() const { return batch_; }
  int64_t cached() const { return past_; }  // cache slots in use per item (padding included)
  uint64_t weight_bytes() const;            // the working weights (padding included)
  double stall_ms() const { return stall_ms_; }  // compute waited for weights (NVMe reads)
  const offload::BlockManager& manager() const { return *mgr_; }

  struct Buffers;  // the workspace (opaque)

 private:
  void fill_units(const std::function<void(int unit, float* master)>& fill);
  const std::vector<float>& forward(const std::vector<int32_t>& ids, int64_t T);
  offload::Tier compute_tier(int unit) const;
  const void* acquire(int unit);
  void release(int unit);

  Transformer model_;  // the units and tensor layout; its training workspace is never bound
  kernels::DType dtype_;
  kernels::Runtime& rt_;
  kernels::Stream& s_;
  GenerateShape shape_;
  WeightPlacement placement_;
  std::unique_ptr<io::IoEngine> engine_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<offload::BlockManager> mgr_;
  std::unique_ptr<Buffers> buf_;
  std::vector<offload::Tier> homes_;  // per unit
  struct Open;
  std::vector<std::unique_ptr<Open>> open_;  // per unit: its handle while acquired
  int64_t batch_ = 0, past_ = 0;
  std::vector<int32_t> pad_;          // per item: left-padding slots
  std::vector<int32_t> host_ids_, host_pos_, host_seg_;
  std::vector<float> logits_;
  double stall_ms_ = 0;
};

}  // namespace strata
