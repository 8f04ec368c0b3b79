// The family registry, and what every recipe does the same way given its norm kind: the
// activation carve-up and the final norm.
#include "src/model/family.h"

#include <stdexcept>
#include <string>

namespace strata {

// The recipes, one per family_<name>.cpp.
extern const FamilyRecipe kLlamaRecipe;
extern const FamilyRecipe kGpt2Recipe;

const FamilyRecipe& family_recipe(Family family) {
  switch (family) {
    case Family::llama: return kLlamaRecipe;
    case Family::gpt2: return kGpt2Recipe;
  }
  throw std::invalid_argument("model config: unknown family " + std::to_string(static_cast<int>(family)));
}

BlockActs FamilyRecipe::carve_acts(model_detail::Carver& cv, const ModelDims& d, DType dt) const {
  const bool means = norm == NormKind::layer;
  BlockActs a;
  a.ln1 = cv.take_dt(d.N * d.C, dt);
  if (means) a.mean1 = cv.take_f32(d.N);
  a.rstd1 = cv.take_f32(d.N);
  a.qkv = cv.take_dt(d.N * d.QKV, dt);
  a.att = cv.take_dt(d.N * d.Q, dt);
  a.lse = cv.take_f32(d.B * d.Hq * d.T);
  a.res_mid = cv.take_dt(d.N * d.C, dt);
  a.ln2 = cv.take_dt(d.N * d.C, dt);
  if (means) a.mean2 = cv.take_f32(d.N);
  a.rstd2 = cv.take_f32(d.N);
  a.fc = cv.take_dt(d.N * d.FC, dt);
  a.act = cv.take_dt(d.N * d.I, dt);
  return a;
}

void FamilyRecipe::norm_forward(kernels::Ops& ops, kernels::Stream& s, const kernels::NormArgs& a) const {
  if (norm == NormKind::layer)
    ops.layernorm(s, a);
  else
    ops.rmsnorm(s, a);
}

void FamilyRecipe::norm_backward(kernels::Ops& ops, kernels::Stream& s, const kernels::NormBackwardArgs& a) const {
  if (norm == NormKind::layer)
    ops.layernorm_backward(s, a);
  else
    ops.rmsnorm_backward(s, a);
}

}  // namespace strata
