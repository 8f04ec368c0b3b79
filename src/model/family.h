// FamilyRecipe: everything that differs between model families, one constant table per family
// (src/model/family_<name>.cpp), so the config checks, the Transformer and the Generator call
// through a recipe instead of testing which family they run.
//
// A new family is one new file, family_<name>.cpp defining its recipe (plus any kernels its
// block needs), and three existing files:
//   src/model/config.h            its Family enumerator
//   src/model/family.cpp          its registry entry (family_recipe)
//   src/checkpoint/hf_config.cpp  reading and writing its config.json
// Internal to src/model/ and src/infer/.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "src/model/block_common.h"
#include "src/model/config.h"
#include "src/model/lora.h"
#include "src/model/transformer.h"

namespace strata {

enum class NormKind : uint8_t {
  rms,    // RMSNorm: weight only, saves rstd
  layer,  // LayerNorm: weight and bias, saves mean and rstd
};

enum class PositionKind : uint8_t {
  rope,     // rotary tables (2, T, D/2) in the workspace, read by the blocks
  learned,  // a wpe table in the embedding unit, indexed by position ids (N) in the workspace
};

// How random init starts a tensor (Transformer::init_unit): matrices ~ N(0, 0.02), gains 1, biases 0.
enum class InitKind : uint8_t { normal, ones, zeros };

// Adds one tensor (HF name and HF shape) to the unit being built; returns its offset in the unit.
using AddTensor = std::function<int64_t(const std::string& name, std::vector<int64_t> shape, InitKind init)>;

// x (N, C) -> out (N, C), saving `acts`; backward: dres (N, C) holds d out on entry and d x on
// exit; parameter grads accumulate into ctx.g (see BlockCtx::accumulate_grads).
using BlockFn = void (*)(const BlockCtx& ctx, const void* x, const BlockActs& acts, void* out_or_dres);

struct FamilyRecipe {
  std::string_view description;  // the run header's one-liner: "RMSNorm, RoPE, SwiGLU"
  NormKind norm;                 // every norm of the model, the final one included
  PositionKind positions;
  // Checkpoints that store every name without this prefix load too ("" = none): gpt2 ones on
  // the Hub often omit "transformer.".
  std::string_view optional_prefix;

  // The family's part of ModelConfig::validate (after the checks every family shares); throws
  // std::invalid_argument naming the field.
  void (*validate)(const ModelConfig& cfg);
  // ModelConfig::n_params: parameters as HF counts them (a tied head once), overflow checked.
  int64_t (*n_params)(const ModelConfig& cfg);
  // Sets d.Hkv and d.FC from cfg (d.Hq, D, Q and I are set); throws std::invalid_argument when
  // the shapes do not fit the family.
  void (*dims)(const ModelConfig& cfg, ModelDims& d);
  // Whether the LM head is the embedding table; an untied head is one (V, C) tensor, head_name,
  // in its own unit.
  bool (*tied_head)(const ModelConfig& cfg);
  std::string_view head_name;
  // Each unit's tensors in HF's names and layouts, in unit order; they fill the offsets of o
  // they own and return a block's layout (the same for every layer, relative to its unit).
  void (*embed_tensors)(const ModelConfig& cfg, const ModelDims& d, const AddTensor& add, OuterLayout& o);
  BlockLayout (*block_tensors)(const ModelConfig& cfg, const ModelDims& d, int64_t layer, const AddTensor& add);
  void (*final_norm_tensors)(const ModelConfig& cfg, const ModelDims& d, const AddTensor& add, OuterLayout& o);
  BlockFn block_forward;
  BlockFn block_backward;
  // Tensor parallelism: how a block or final-norm tensor (by HF name) is split over the tp
  // ranks: Megatron's column-parallel layers by their output features, row-parallel ones by
  // their input features, the rest whole (the embedding and head are split by vocabulary rows
  // whatever the family). The blocks sum over the group after each row-parallel layer and each
  // column-parallel input gradient (block_common.h).
  TpSplit (*tp_split)(std::string_view name);

  // LoRA: a layer's tensors are named layer_prefix + layer + "." + module; its linear modules
  // (the columns of the fused slots they write), and PEFT's default --lora-targets.
  std::string_view layer_prefix;
  std::vector<LinearModule> (*linear_modules)(const ModelDims& d);
  std::string_view lora_default_targets;

  // One block's activations for dims d in dtype dt, carved from cv (a layer norm's means too).
  BlockActs carve_acts(model_detail::Carver& cv, const ModelDims& d, DType dt) const;
  // The family's norm (the final norm of the head, for the Transformer and the Generator).
  void norm_forward(kernels::Ops& ops, kernels::Stream& s, const kernels::NormArgs& a) const;
  void norm_backward(kernels::Ops& ops, kernels::Stream& s, const kernels::NormBackwardArgs& a) const;
};

// The recipe of a family (the registry in family.cpp).
const FamilyRecipe& family_recipe(Family family);

// ModelConfig's checks, for the families' validate: throws std::invalid_argument
// "model config: <field>: <why>" unless ok (config.cpp).
void require_config(bool ok, const char* field, const std::string& why);

}  // namespace strata
