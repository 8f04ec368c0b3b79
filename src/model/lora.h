// LoRA adapters (Hu et al. 2021, with Hugging Face PEFT's conventions): beside a frozen linear
// layer y = W x, a trained low-rank path y += s · B (A x), A (r, in) and B (out, r), s = alpha / r
// (rsLoRA: alpha / √r). Each layer's adapters are one unit of their own ("block.L.lora"), so the
// base units are frozen (weights only: no grads, master or AdamW state) and the adapters train
// like any other unit, on any tier.
#pragma once
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kernels/dtype.h"

namespace strata {

struct BlockCtx;

// The fused linear layers of a block, whose outputs a module writes columns of: the q|k|v
// projection, the attention output, the MLP's first (gate|up, or c_fc) and second.
enum class LoraSlot : uint8_t { qkv = 0, o = 1, fc = 2, proj = 3 };
constexpr int kLoraSlots = 4;

// One of a family's linear modules, by its Hugging Face name inside a layer
// ("self_attn.q_proj", "attn.c_attn"): the columns [col, col + out) of its slot's output.
struct LinearModule {
  std::string name;
  LoraSlot slot = LoraSlot::qkv;
  int64_t col = 0, in = 0, out = 0;
};

// --lora-* flags.
struct LoraSpec {
  int64_t rank = 0;  // 0: full fine-tuning
  double alpha = 16;
  bool rslora = false;
  std::vector<std::string> targets;  // module names or suffixes ("q_proj", "c_proj"), or {"all-linear"}
  // --base-dtype: the frozen layers' matrices stored as bf16, fp16, int8 (per row, absmax) or
  // NF4 (QLoRA's, double-quantized), decoded to the working dtype one layer at a time when used;
  // "" = the working dtype itself. The embedding and the LM head stay in the working dtype.
  std::string base_dtype;
  // PEFT's lora_dropout: each target's own mask on its adapter input (x ⊙ m / (1 - p)), drawn
  // from a counter-based stream keyed by the micro-batch (Transformer::set_lora_dropout_key),
  // so a recomputed forward and the backward see the same mask. CPU backend only.
  double dropout = 0;
  bool on() const { return rank > 0; }
  float scale() const;
};

// "q_proj,v_proj" | "all-linear" -> names; throws std::invalid_argument naming the flag.
std::vector<std::string> parse_lora_targets(const std::string& text);
// The modules of `modules` that `targets` name (PEFT's rule: the whole name, or its last
// components after a '.'); throws naming a target that matches none and the modules there are.
std::vector<LinearModule> match_lora_targets(const std::vector<LinearModule>& modules,
                                             const std::vector<std::string>& targets);

// Where a layer's adapters live in its adapter unit (elements from the unit's start), by slot:
// the A matrices of a slot's targets stacked ((k·r, in): one GEMM gives every target's A x), then
// each target's B (out, r) writing columns [col, col + out) of the slot's output.
struct LoraTargetLayout {
  int64_t col = 0, out = 0, b = -1;
};
struct LoraSlotLayout {
  int64_t in = 0, a = -1, kr = 0;  // kr: rows of the stacked A (targets × rank)
  std::vector<LoraTargetLayout> targets;
};
struct LoraLayout {
  int64_t rank = 0;
  float scale = 0;
  float dropout = 0;   // p
  int64_t max_in = 0;  // the widest adapter input (dropout's (N, max_in) scratch)
  int64_t max_kr = 0;  // the widest slot: the (N, max_kr) scratch its GEMMs use
  std::array<LoraSlotLayout, kLoraSlots> slots;
};

// A PEFT adapter directory's adapter_config.json (peft_type LORA): its rank, alpha, rsLoRA and
// target modules (a list, or "all-linear"); throws std::invalid_argument naming the file.
LoraSpec read_peft_config(const std::filesystem::path& dir);
// The adapter's scale in float64, as PEFT's `scaling` (a Python float): alpha / r or alpha / √r.
double peft_scale(const LoraSpec& spec);
// w += s·B·A in float64, rounded once per element: A (r, in), B (out, r); w (out, in), or
// (in, out) where the base stores its weight transposed (HF Conv1D).
void add_lora_delta(float* w, const float* A, const float* B, int64_t r, int64_t in, int64_t out, double s,
                    bool w_in_out);

// Dropout's mask element i of the stream `key`: kept with probability 1 - p (the top 24 bits of
// SplitMix64 output i as a uniform in [0, 1), kept when >= p).
bool lora_dropout_keeps(uint64_t key, int64_t i, float p);

namespace model_detail {
// y[:, col..] (rows N, row stride ldy) += s · (x A_tᵀ) B_tᵀ for each of the slot's targets.
void lora_forward(const BlockCtx& c, LoraSlot slot, const void* x, void* y, int64_t ldy);
// With dy (N, ldy) the gradient of the slot's output: the adapters' grads (c.lora_g; written
// or accumulated as c.accumulate_grads says) and dx (N, in) += the adapters' part of d x.
void lora_backward(const BlockCtx& c, LoraSlot slot, const void* x, const void* dy, int64_t ldy, void* dx);
}  // namespace model_detail

}  // namespace strata
