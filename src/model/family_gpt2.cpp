// The GPT-2 family's recipe: its config rules and tensors, and its block: pre-LayerNorm, fused
// c_attn (q|k|v) with bias, causal multi-head attention, c_proj; pre-LayerNorm MLP c_fc -> GELU
// (gelu_new = tanh approximation) -> c_proj. Weights keep HF's Conv1D (in, out) layout, so
// matmuls use the transpose flags instead of a copy on load.
#include <stdexcept>
#include <string>

#include "src/checked.h"
#include "src/model/block_common.h"
#include "src/model/family.h"
#include "src/model/linear.h"
#include "src/model/transformer.h"

namespace strata {
using model_detail::at;
using model_detail::fused_qkv_attention;
using model_detail::fused_qkv_attention_backward;
using model_detail::gptr;
using model_detail::Linear;
using model_detail::linear_backward;
using model_detail::linear_forward;
using model_detail::lora_backward;
using model_detail::lora_forward;
using model_detail::norm_grads;
using model_detail::norm_grads_done;
using model_detail::NormGrads;
using model_detail::own_rows;
using model_detail::row_parallel_forward;
using model_detail::sp_gather;
using model_detail::sp_whole;
using model_detail::tp_input_grad;
using model_detail::wptr;

namespace {

bool tanh_gelu(const BlockCtx& c) { return c.cfg->activation != "gelu"; }  // gelu_new, gelu_pytorch_tanh

void gpt2_block_forward(const BlockCtx& c, const void* x, const BlockActs& a, void* out) {
  const ModelDims& d = *c.dims;
  const BlockLayout& p = *c.layout;
  kernels::Ops& ops = *c.ops;
  kernels::Stream& s = *c.stream;
  const DType dt = c.dtype;
  const Linear lin{c.ops, c.stream, dt, true, c.accumulate_grads};
  const float eps = static_cast<float>(c.cfg->norm_eps);
  const int64_t R = d.res_rows;  // the residual stream's rows here (N; sequence parallel: this rank's)

  // ln1 (N, C) = layernorm(x) (sequence parallel: this rank's rows, then gathered)
  ops.layernorm(s, {.dtype = dt, .rows = R, .cols = d.C, .eps = eps, .x = x, .weight = wptr(c, p.ln1_w),
                    .bias = wptr(c, p.ln1_b), .y = own_rows(c, a.ln1, d.C), .mean = a.mean1, .rstd = a.rstd1});
  sp_gather(c, a.ln1, d.C);
  // qkv (N, 3C) = ln1 · c_attn + b
  linear_forward(lin, a.ln1, wptr(c, p.qkv_w), wptr(c, p.qkv_b), a.qkv, d.N, d.C, d.QKV);
  lora_forward(c, LoraSlot::qkv, a.ln1, a.qkv, d.QKV);
  // att (N, C) = causal softmax(q·kᵀ/√D)·v, lse (B, H, T)
  fused_qkv_attention(c, a);
  // res_mid (R, C) = x + att · c_proj + b
  void* o = row_parallel_forward(lin, c, LoraSlot::o, a.att, wptr(c, p.o_w), wptr(c, p.o_b), c.scratch->tmp_c, d.N,
                                 d.Q, d.C);
  ops.add(s, {.dtype = dt, .n = R * d.C, .a = x, .b = o, .out = a.res_mid});
  // ln2 (N, C) = layernorm(res_mid)
  ops.layernorm(s, {.dtype = dt, .rows = R, .cols = d.C, .eps = eps, .x = a.res_mid, .weight = wptr(c, p.ln2_w),
                    .bias = wptr(c, p.ln2_b), .y = own_rows(c, a.ln2, d.C), .mean = a.mean2, .rstd = a.rstd2});
  sp_gather(c, a.ln2, d.C);
  // fc (N, I) = ln2 · c_fc + b; act (N, I) = gelu(fc)
  linear_forward(lin, a.ln2, wptr(c, p.fc_w), wptr(c, p.fc_b), a.fc, d.N, d.C, d.I);
  lora_forward(c, LoraSlot::fc, a.ln2, a.fc, d.I);
  ops.gelu(s, {.dtype = dt, .n = d.N * d.I, .tanh_approx = tanh_gelu(c), .x = a.fc, .y = a.act});
  // out (R, C) = res_mid + act · mlp.c_proj + b
  void* proj = row_parallel_forward(lin, c, LoraSlot::proj, a.act, wptr(c, p.proj_w), wptr(c, p.proj_b),
                                    c.scratch->tmp_c, d.N, d.I, d.C);
  ops.add(s, {.dtype = dt, .n = R * d.C, .a = a.res_mid, .b = proj, .out = out});
}

void gpt2_block_backward(const BlockCtx& c, const void* x, const BlockActs& a, void* dres) {
  const ModelDims& d = *c.dims;
  const BlockLayout& p = *c.layout;
  kernels::Ops& ops = *c.ops;
  kernels::Stream& s = *c.stream;
  const DType dt = c.dtype;
  const Linear lin{c.ops, c.stream, dt, true, c.accumulate_grads};
  const BlockScratch& sc = *c.scratch;
  const int64_t R = d.res_rows;

  // MLP. d_act (N, I) = dres · mlp.c_projᵀ
  const void* dy = sp_whole(c, dres, sc.tmp_c, d.C);
  linear_backward(lin, a.act, wptr(c, p.proj_w), dy, sc.d_act, gptr(c, p.proj_w), gptr(c, p.proj_b), d.N, d.I, d.C);
  lora_backward(c, LoraSlot::proj, a.act, dy, d.C, sc.d_act);
  // d_fc (N, I) = gelu'(fc) · d_act
  ops.gelu_backward(s, {.dtype = dt, .n = d.N * d.I, .tanh_approx = tanh_gelu(c), .x = a.fc, .dy = sc.d_act,
                        .dx = sc.d_fc});
  // d_c (N, C) = d_fc · c_fcᵀ
  linear_backward(lin, a.ln2, wptr(c, p.fc_w), sc.d_fc, sc.d_c, gptr(c, p.fc_w), gptr(c, p.fc_b), d.N, d.C, d.I);
  lora_backward(c, LoraSlot::fc, a.ln2, sc.d_fc, d.I, sc.d_c);
  const void* d_ln2 = tp_input_grad(c, sc.d_c, d.C);  // column-parallel: each rank had its part of it
  // dres += layernorm_backward(res_mid, d_c) -> d res_mid
  const NormGrads g2 = norm_grads(c, gptr(c, p.ln2_w), gptr(c, p.ln2_b));
  ops.layernorm_backward(s, {.dtype = dt, .rows = R, .cols = d.C, .x = a.res_mid, .weight = wptr(c, p.ln2_w),
                             .dy = d_ln2, .mean = a.mean2, .rstd = a.rstd2, .dx = dres, .dweight = g2.w,
                             .dbias = g2.b, .accumulate = true});
  norm_grads_done(c, gptr(c, p.ln2_w), gptr(c, p.ln2_b));

  // Attention. d_q (N, C) = dres · c_projᵀ
  dy = sp_whole(c, dres, sc.tmp_c, d.C);
  linear_backward(lin, a.att, wptr(c, p.o_w), dy, sc.d_q, gptr(c, p.o_w), gptr(c, p.o_b), d.N, d.Q, d.C);
  lora_backward(c, LoraSlot::o, a.att, dy, d.C, sc.d_q);
  // d_fc (N, 3C) = [dq | dk | dv]
  fused_qkv_attention_backward(c, a, sc.d_q, sc.d_fc);
  // d_c (N, C) = d_qkv · c_attnᵀ
  linear_backward(lin, a.ln1, wptr(c, p.qkv_w), sc.d_fc, sc.d_c, gptr(c, p.qkv_w), gptr(c, p.qkv_b), d.N, d.C,
                  d.QKV);
  lora_backward(c, LoraSlot::qkv, a.ln1, sc.d_fc, d.QKV, sc.d_c);
  const void* d_ln1 = tp_input_grad(c, sc.d_c, d.C);
  // dres += layernorm_backward(x, d_c) -> d x
  const NormGrads g1 = norm_grads(c, gptr(c, p.ln1_w), gptr(c, p.ln1_b));
  ops.layernorm_backward(s, {.dtype = dt, .rows = R, .cols = d.C, .x = x, .weight = wptr(c, p.ln1_w), .dy = d_ln1,
                             .mean = a.mean1, .rstd = a.rstd1, .dx = dres, .dweight = g1.w, .dbias = g1.b,
                             .accumulate = true});
  norm_grads_done(c, gptr(c, p.ln1_w), gptr(c, p.ln1_b));
}

void validate(const ModelConfig& c) {
  require_config(c.model_type == "gpt2", "model_type", "family gpt2 needs model_type gpt2, got '" + c.model_type + "'");
  require_config(c.activation == "gelu_new" || c.activation == "gelu_pytorch_tanh" || c.activation == "gelu",
                 "activation_function", "expected gelu_new, gelu_pytorch_tanh or gelu, got '" + c.activation + "'");
  require_config(c.n_kv_heads == c.n_heads, "n_head", "gpt2 has no grouped-query attention");
  require_config(c.effective_head_dim() * c.n_heads == c.hidden_size, "head_dim", "gpt2 needs n_embd / n_head");
  require_config(c.tie_word_embeddings, "tie_word_embeddings", "gpt2's LM head is always tied to wte");
  require_config(c.rope_scaling.type.empty(), "rope_scaling", "gpt2 has no rotary embeddings");
}

int64_t n_params(const ModelConfig& c) {
  // Checked: the fields come from config.json, and a count that wraps would size buffers wrong.
  auto mul = [](int64_t a, int64_t b) { return checked_mul(a, b, "model config: parameter count"); };
  auto add = [](int64_t a, int64_t b) { return checked_add(a, b, "model config: parameter count"); };
  const int64_t V = c.vocab_size, C = c.hidden_size, L = c.n_layers, F = c.intermediate_size;
  // wte, wpe; per block ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj; ln_f; head tied to wte.
  int64_t per_layer = add(mul(mul(C, 3), C), mul(3, C));  // c_attn
  per_layer = add(per_layer, add(mul(C, C), C));          // attn.c_proj
  per_layer = add(per_layer, add(mul(C, F), F));          // c_fc
  per_layer = add(per_layer, add(mul(F, C), C));          // mlp.c_proj
  per_layer = add(per_layer, mul(4, C));                  // ln_1, ln_2
  return add(add(add(mul(V, C), mul(c.max_position_embeddings, C)), mul(L, per_layer)), mul(2, C));
}

// Multi-head attention (every head has its own k and v); fc is c_fc alone.
void dims(const ModelConfig& c, ModelDims& d) {
  d.Hkv = c.n_heads;
  d.FC = d.I;
  if (d.Q != d.C) throw std::invalid_argument("gpt2: n_head must divide n_embd (head_dim is not configurable)");
}

bool tied_head(const ModelConfig&) { return true; }

void embed_tensors(const ModelConfig& c, const ModelDims& d, const AddTensor& add, OuterLayout& o) {
  o.wte = add("transformer.wte.weight", {d.V, d.C}, InitKind::normal);
  o.wpe = add("transformer.wpe.weight", {c.max_position_embeddings, d.C}, InitKind::normal);
}

// HF's Conv1D layouts, (in, out): c_attn (C, 3C), c_proj (C, C), c_fc (C, 4C), mlp.c_proj (4C, C).
BlockLayout block_tensors(const ModelConfig&, const ModelDims& d, int64_t layer, const AddTensor& add) {
  const std::string h = "transformer.h." + std::to_string(layer) + ".";
  BlockLayout b;
  b.ln1_w = add(h + "ln_1.weight", {d.C}, InitKind::ones);
  b.ln1_b = add(h + "ln_1.bias", {d.C}, InitKind::zeros);
  b.qkv_w = add(h + "attn.c_attn.weight", {d.C, d.QKV}, InitKind::normal);
  b.qkv_b = add(h + "attn.c_attn.bias", {d.QKV}, InitKind::zeros);
  b.o_w = add(h + "attn.c_proj.weight", {d.Q, d.C}, InitKind::normal);
  b.o_b = add(h + "attn.c_proj.bias", {d.C}, InitKind::zeros);
  b.ln2_w = add(h + "ln_2.weight", {d.C}, InitKind::ones);
  b.ln2_b = add(h + "ln_2.bias", {d.C}, InitKind::zeros);
  b.fc_w = add(h + "mlp.c_fc.weight", {d.C, d.I}, InitKind::normal);
  b.fc_b = add(h + "mlp.c_fc.bias", {d.I}, InitKind::zeros);
  b.proj_w = add(h + "mlp.c_proj.weight", {d.I, d.C}, InitKind::normal);
  b.proj_b = add(h + "mlp.c_proj.bias", {d.C}, InitKind::zeros);
  return b;
}

void final_norm_tensors(const ModelConfig&, const ModelDims& d, const AddTensor& add, OuterLayout& o) {
  o.lnf_w = add("transformer.ln_f.weight", {d.C}, InitKind::ones);
  o.lnf_b = add("transformer.ln_f.bias", {d.C}, InitKind::zeros);
}

std::vector<LinearModule> linear_modules(const ModelDims& d) {
  return {{"attn.c_attn", LoraSlot::qkv, 0, d.C, d.QKV},
          {"attn.c_proj", LoraSlot::o, 0, d.Q, d.C},
          {"mlp.c_fc", LoraSlot::fc, 0, d.C, d.I},
          {"mlp.c_proj", LoraSlot::proj, 0, d.I, d.C}};
}

// Megatron's split (HF Conv1D's (in, out) weights): c_attn and c_fc column-parallel (their
// output columns split: c_attn's q, k and v each, as three segments), the projections
// row-parallel (their input rows split); norms and the projections' biases whole.
TpSplit tp_split(std::string_view name) {
  if (name.ends_with("attn.c_attn.weight")) return {1, 3};
  if (name.ends_with("attn.c_attn.bias")) return {0, 3};
  if (name.ends_with("mlp.c_fc.weight")) return {1, 1};
  if (name.ends_with("mlp.c_fc.bias")) return {0, 1};
  if (name.ends_with("c_proj.weight")) return {0, 1};
  return {};
}

}  // namespace

// extern: the registry (family.cpp) names it; a namespace-scope const is file-local otherwise.
extern const FamilyRecipe kGpt2Recipe;
const FamilyRecipe kGpt2Recipe{
    .description = "LayerNorm, learned positions, GELU",
    .norm = NormKind::layer,
    .positions = PositionKind::learned,
    .optional_prefix = "transformer.",
    .validate = validate,
    .n_params = n_params,
    .dims = dims,
    .tied_head = tied_head,
    .head_name = "",
    .embed_tensors = embed_tensors,
    .block_tensors = block_tensors,
    .final_norm_tensors = final_norm_tensors,
    .block_forward = gpt2_block_forward,
    .block_backward = gpt2_block_backward,
    .tp_split = tp_split,
    .layer_prefix = "transformer.h.",
    .linear_modules = linear_modules,
    .lora_default_targets = "c_attn",
};

}  // namespace strata
