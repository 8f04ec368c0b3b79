// The llama family's recipe (llama, mistral, qwen2): its config rules and tensors, and its
// block: pre-RMSNorm, fused q/k/v projection with optional bias, RoPE, causal GQA attention,
// output projection; pre-RMSNorm SwiGLU MLP. Forward and backward written out op by op (llm.c
// style), plus HF's RoPE inverse frequencies and tables.
#include <cmath>
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

void rope(const BlockCtx& c, void* x, int64_t heads, bool backward) {
  const ModelDims& d = *c.dims;
  kernels::RopeArgs r;
  r.dtype = c.dtype;
  r.batch = d.B;
  r.seq = d.T;
  r.heads = heads;
  r.head_dim = d.D;
  r.token_stride = d.QKV;
  r.pos0 = 0;
  r.pos = c.pos;    // documents: each token's position in its own (< T)
  r.max_pos = d.T;  // the model builds cos/sin for positions [0, T)
  r.x = x;
  r.cos = c.rope_cos;
  r.sin = c.rope_sin;
  r.backward = backward;
  if (c.kv) {  // decoding: each new token at its own position (after the cache, less its padding)
    r.pos = c.kv->pos;
    r.max_pos = c.kv->max_pos;
  }
  c.ops->rope(*c.stream, r);
}

void llama_block_forward(const BlockCtx& c, const void* x, const BlockActs& a, void* out) {
  const ModelDims& d = *c.dims;
  const BlockLayout& p = *c.layout;
  kernels::Ops& ops = *c.ops;
  kernels::Stream& s = *c.stream;
  const DType dt = c.dtype;
  const Linear lin{c.ops, c.stream, dt, false, c.accumulate_grads};
  const float eps = static_cast<float>(c.cfg->norm_eps);
  const int64_t R = d.res_rows;  // the residual stream's rows here (N; sequence parallel: this rank's)

  // ln1 (N, C) = rmsnorm(x) (sequence parallel: this rank's rows, then gathered)
  ops.rmsnorm(s, {.dtype = dt, .rows = R, .cols = d.C, .eps = eps, .x = x, .weight = wptr(c, p.ln1_w),
                  .y = own_rows(c, a.ln1, d.C), .rstd = a.rstd1});
  sp_gather(c, a.ln1, d.C);
  // qkv (N, QKV) = ln1 · [Wq; Wk; Wv]ᵀ + b, then RoPE on q (Hq heads) and k (Hkv heads)
  linear_forward(lin, a.ln1, wptr(c, p.qkv_w), wptr(c, p.qkv_b), a.qkv, d.N, d.C, d.QKV);
  lora_forward(c, LoraSlot::qkv, a.ln1, a.qkv, d.QKV);
  rope(c, a.qkv, d.Hq, false);
  rope(c, at(a.qkv, d.Q, dt), d.Hkv, false);
  // att (N, Q) = causal softmax(q·kᵀ/√D)·v, lse (B, Hq, T)
  fused_qkv_attention(c, a);
  // res_mid (R, C) = x + att · Woᵀ (+ bo)
  void* o = row_parallel_forward(lin, c, LoraSlot::o, a.att, wptr(c, p.o_w), wptr(c, p.o_b), c.scratch->tmp_c, d.N,
                                 d.Q, d.C);
  ops.add(s, {.dtype = dt, .n = R * d.C, .a = x, .b = o, .out = a.res_mid});
  // ln2 (N, C) = rmsnorm(res_mid)
  ops.rmsnorm(s, {.dtype = dt, .rows = R, .cols = d.C, .eps = eps, .x = a.res_mid, .weight = wptr(c, p.ln2_w),
                  .y = own_rows(c, a.ln2, d.C), .rstd = a.rstd2});
  sp_gather(c, a.ln2, d.C);
  // fc (N, 2I) = ln2 · [Wgate; Wup]ᵀ ; act (N, I) = silu(gate) · up
  linear_forward(lin, a.ln2, wptr(c, p.fc_w), wptr(c, p.fc_b), a.fc, d.N, d.C, d.FC);
  lora_forward(c, LoraSlot::fc, a.ln2, a.fc, d.FC);
  ops.swiglu(s, {.dtype = dt, .rows = d.N, .cols = d.I, .ld = d.FC, .gate = a.fc, .up = at(a.fc, d.I, dt),
                 .out = a.act});
  // out (R, C) = res_mid + act · Wdownᵀ
  void* down = row_parallel_forward(lin, c, LoraSlot::proj, a.act, wptr(c, p.proj_w), wptr(c, p.proj_b),
                                    c.scratch->tmp_c, d.N, d.I, d.C);
  ops.add(s, {.dtype = dt, .n = R * d.C, .a = a.res_mid, .b = down, .out = out});
}

void llama_block_backward(const BlockCtx& c, const void* x, const BlockActs& a, void* dres) {
  const ModelDims& d = *c.dims;
  const BlockLayout& p = *c.layout;
  kernels::Ops& ops = *c.ops;
  kernels::Stream& s = *c.stream;
  const DType dt = c.dtype;
  const Linear lin{c.ops, c.stream, dt, false, c.accumulate_grads};
  const BlockScratch& sc = *c.scratch;
  const int64_t R = d.res_rows;

  // MLP. dres = d out = d(res_mid) through the residual; d_act (N, I) = dres · Wdown
  const void* dy = sp_whole(c, dres, sc.tmp_c, d.C);
  linear_backward(lin, a.act, wptr(c, p.proj_w), dy, sc.d_act, gptr(c, p.proj_w), gptr(c, p.proj_b), d.N, d.I, d.C);
  lora_backward(c, LoraSlot::proj, a.act, dy, d.C, sc.d_act);
  // d_fc (N, 2I) = [d gate | d up]
  ops.swiglu_backward(s, {.dtype = dt, .rows = d.N, .cols = d.I, .ld = d.FC, .gate = a.fc,
                          .up = at(a.fc, d.I, dt), .dout = sc.d_act, .dgate = sc.d_fc,
                          .dup = at(sc.d_fc, d.I, dt)});
  // d_c (N, C) = d_fc · [Wgate; Wup]
  linear_backward(lin, a.ln2, wptr(c, p.fc_w), sc.d_fc, sc.d_c, gptr(c, p.fc_w), gptr(c, p.fc_b), d.N, d.C, d.FC);
  lora_backward(c, LoraSlot::fc, a.ln2, sc.d_fc, d.FC, sc.d_c);
  const void* d_ln2 = tp_input_grad(c, sc.d_c, d.C);  // column-parallel: each rank had its part of it
  // dres += rmsnorm_backward(res_mid, d_c)  -> d res_mid
  const NormGrads g2 = norm_grads(c, gptr(c, p.ln2_w), nullptr);
  ops.rmsnorm_backward(s, {.dtype = dt, .rows = R, .cols = d.C, .x = a.res_mid, .weight = wptr(c, p.ln2_w),
                           .dy = d_ln2, .rstd = a.rstd2, .dx = dres, .dweight = g2.w, .accumulate = true});
  norm_grads_done(c, gptr(c, p.ln2_w), nullptr);

  // Attention. d_q (N, Q) = dres · Wo
  dy = sp_whole(c, dres, sc.tmp_c, d.C);
  linear_backward(lin, a.att, wptr(c, p.o_w), dy, sc.d_q, gptr(c, p.o_w), gptr(c, p.o_b), d.N, d.Q, d.C);
  lora_backward(c, LoraSlot::o, a.att, dy, d.C, sc.d_q);
  // d_fc (N, QKV) = [dq | dk | dv] (dq, dk still rotated)
  fused_qkv_attention_backward(c, a, sc.d_q, sc.d_fc);
  rope(c, sc.d_fc, d.Hq, true);
  rope(c, at(sc.d_fc, d.Q, dt), d.Hkv, true);
  // d_c (N, C) = d_qkv · [Wq; Wk; Wv]
  linear_backward(lin, a.ln1, wptr(c, p.qkv_w), sc.d_fc, sc.d_c, gptr(c, p.qkv_w), gptr(c, p.qkv_b), d.N, d.C,
                  d.QKV);
  lora_backward(c, LoraSlot::qkv, a.ln1, sc.d_fc, d.QKV, sc.d_c);
  const void* d_ln1 = tp_input_grad(c, sc.d_c, d.C);
  // dres += rmsnorm_backward(x, d_c)  -> d x
  const NormGrads g1 = norm_grads(c, gptr(c, p.ln1_w), nullptr);
  ops.rmsnorm_backward(s, {.dtype = dt, .rows = R, .cols = d.C, .x = x, .weight = wptr(c, p.ln1_w), .dy = d_ln1,
                           .rstd = a.rstd1, .dx = dres, .dweight = g1.w, .accumulate = true});
  norm_grads_done(c, gptr(c, p.ln1_w), nullptr);
}

}  // namespace

// HF transformers' ROPE_INIT_FUNCTIONS["default"] and ["llama3"], in fp32 as torch computes them.
std::vector<float> rope_inv_freq(const ModelConfig& cfg) {
  const int64_t D = cfg.effective_head_dim();
  const float base = static_cast<float>(cfg.rope_theta);
  std::vector<float> inv(static_cast<size_t>(D / 2));
  for (int64_t i = 0; i < D / 2; ++i) {
    // 1.0 / (base ** (arange(0, dim, 2).float() / dim)): the exponent and the power in fp32.
    const float expo = static_cast<float>(2 * i) / static_cast<float>(D);
    const float pw = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(expo)));
    inv[static_cast<size_t>(i)] = 1.0f / pw;
  }
  const RopeScaling& rs = cfg.rope_scaling;
  if (rs.type.empty() || rs.type == "default") return inv;
  if (rs.type != "llama3")
    throw std::invalid_argument("rope_scaling: type '" + rs.type + "' is not supported (supported: llama3)");
  // _compute_llama3_parameters: factor, low/high_freq_factor, original_max_position_embeddings.
  const float factor = static_cast<float>(rs.factor);
  const float low = static_cast<float>(rs.low_freq_factor), high = static_cast<float>(rs.high_freq_factor);
  const float old_ctx = static_cast<float>(rs.original_max_position_embeddings);
  const double low_freq_wavelen = static_cast<double>(old_ctx) / rs.low_freq_factor;  // python floats
  const double high_freq_wavelen = static_cast<double>(old_ctx) / rs.high_freq_factor;
  for (float& f : inv) {
    const float wavelen = static_cast<float>(2.0 * M_PI) / f;  // tensor (fp32) from 2·math.pi / inv_freq
    float scaled = static_cast<double>(wavelen) > low_freq_wavelen ? f / factor : f;
    const float smooth = (old_ctx / wavelen - low) / (high - low);
    const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
    const bool medium = !(static_cast<double>(wavelen) < high_freq_wavelen) &&
                        !(static_cast<double>(wavelen) > low_freq_wavelen);
    if (medium) scaled = smoothed;
    f = scaled;
  }
  return inv;
}

std::vector<float> rope_tables(const ModelConfig& cfg, int64_t positions) {
  const std::vector<float> inv = rope_inv_freq(cfg);
  const auto half = static_cast<int64_t>(inv.size());
  std::vector<float> table(static_cast<size_t>(2 * positions * half));
  for (int64_t t = 0; t < positions; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(t) * inv[static_cast<size_t>(i)];
      table[static_cast<size_t>(t * half + i)] = static_cast<float>(std::cos(static_cast<double>(angle)));
      table[static_cast<size_t>((positions + t) * half + i)] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  return table;
}

namespace {

void validate(const ModelConfig& c) {
  require_config(c.model_type == "llama" || c.model_type == "mistral" || c.model_type == "qwen2", "model_type",
                 "family llama needs model_type llama, mistral or qwen2, got '" + c.model_type + "'");
  require_config(c.activation == "silu", "hidden_act", "expected silu, got '" + c.activation + "'");
  require_config(c.rope_theta > 0 && std::isfinite(c.rope_theta), "rope_theta", "must be positive and finite");
  require_config(c.effective_head_dim() % 2 == 0, "head_dim", "rotary embeddings need an even head_dim");
  if (c.model_type == "llama") {
    require_config(c.o_bias == c.attention_bias, "attention_bias", "llama puts biases on q, k, v and o together");
  } else if (c.model_type == "qwen2") {
    require_config(c.attention_bias && !c.o_bias, "attention_bias", "qwen2 has q/k/v biases and no o bias");
    require_config(!c.mlp_bias, "mlp_bias", "qwen2 has no MLP biases");
  } else {  // mistral
    require_config(!c.attention_bias && !c.o_bias, "attention_bias", "mistral has no attention biases");
    require_config(!c.mlp_bias, "mlp_bias", "mistral has no MLP biases");
  }
  const RopeScaling& rs = c.rope_scaling;
  if (!rs.type.empty()) {
    require_config(rs.type == "llama3", "rope_scaling", "type '" + rs.type + "' is not supported (only llama3)");
    require_config(rs.factor > 0 && std::isfinite(rs.factor), "rope_scaling.factor", "must be positive and finite");
    require_config(rs.low_freq_factor > 0 && rs.high_freq_factor > rs.low_freq_factor &&
                       std::isfinite(rs.high_freq_factor),
                   "rope_scaling.high_freq_factor", "must be finite and greater than low_freq_factor > 0");
    require_config(rs.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings",
                   "must be positive");
  }
}

int64_t n_params(const ModelConfig& c) {
  // Checked: the fields come from config.json, and a count that wraps would size buffers wrong.
  auto mul = [](int64_t a, int64_t b) { return checked_mul(a, b, "model config: parameter count"); };
  auto add = [](int64_t a, int64_t b) { return checked_add(a, b, "model config: parameter count"); };
  const int64_t V = c.vocab_size, C = c.hidden_size, L = c.n_layers, F = c.intermediate_size;
  const int64_t D = c.effective_head_dim();
  const int64_t q = mul(c.n_heads, D), kv = mul(c.n_kv_heads, D);
  int64_t attn = add(add(mul(C, q), mul(mul(2, C), kv)), mul(q, C));
  if (c.attention_bias) attn = add(attn, add(q, mul(2, kv)));
  if (c.o_bias) attn = add(attn, C);
  int64_t mlp = mul(mul(3, C), F);
  if (c.mlp_bias) mlp = add(mlp, add(mul(2, F), C));
  const int64_t per_layer = add(add(attn, mlp), mul(2, C));  // + input_layernorm, post_attention_layernorm
  return add(add(add(mul(V, C), mul(L, per_layer)), C), c.tie_word_embeddings ? 0 : mul(V, C));
}

// GQA: Hkv key/value heads; fc is gate and up stacked.
void dims(const ModelConfig& c, ModelDims& d) {
  d.Hkv = c.n_kv_heads;
  d.FC = 2 * d.I;
}

bool tied_head(const ModelConfig& c) { return c.tie_word_embeddings; }

void embed_tensors(const ModelConfig&, const ModelDims& d, const AddTensor& add, OuterLayout& o) {
  o.wte = add("model.embed_tokens.weight", {d.V, d.C}, InitKind::normal);
}

// All (out, in). qkv_w is q_proj, k_proj, v_proj stacked ((Hq+2·Hkv)·D, C); fc_w is gate_proj
// then up_proj (2·I, C); proj_w is down_proj (C, I).
BlockLayout block_tensors(const ModelConfig& c, const ModelDims& d, int64_t layer, const AddTensor& add) {
  const std::string h = "model.layers." + std::to_string(layer) + ".";
  const int64_t kv = d.Hkv * d.D;
  BlockLayout b;
  b.ln1_w = add(h + "input_layernorm.weight", {d.C}, InitKind::ones);
  b.qkv_w = add(h + "self_attn.q_proj.weight", {d.Q, d.C}, InitKind::normal);  // q, k, v stacked = fused qkv
  add(h + "self_attn.k_proj.weight", {kv, d.C}, InitKind::normal);
  add(h + "self_attn.v_proj.weight", {kv, d.C}, InitKind::normal);
  if (c.attention_bias) {
    b.qkv_b = add(h + "self_attn.q_proj.bias", {d.Q}, InitKind::zeros);
    add(h + "self_attn.k_proj.bias", {kv}, InitKind::zeros);
    add(h + "self_attn.v_proj.bias", {kv}, InitKind::zeros);
  }
  b.o_w = add(h + "self_attn.o_proj.weight", {d.C, d.Q}, InitKind::normal);
  if (c.o_bias) b.o_b = add(h + "self_attn.o_proj.bias", {d.C}, InitKind::zeros);
  b.ln2_w = add(h + "post_attention_layernorm.weight", {d.C}, InitKind::ones);
  b.fc_w = add(h + "mlp.gate_proj.weight", {d.I, d.C}, InitKind::normal);  // gate, up stacked = fused (2I, C)
  add(h + "mlp.up_proj.weight", {d.I, d.C}, InitKind::normal);
  if (c.mlp_bias) {
    b.fc_b = add(h + "mlp.gate_proj.bias", {d.I}, InitKind::zeros);
    add(h + "mlp.up_proj.bias", {d.I}, InitKind::zeros);
  }
  b.proj_w = add(h + "mlp.down_proj.weight", {d.C, d.I}, InitKind::normal);
  if (c.mlp_bias) b.proj_b = add(h + "mlp.down_proj.bias", {d.C}, InitKind::zeros);
  return b;
}

void final_norm_tensors(const ModelConfig&, const ModelDims& d, const AddTensor& add, OuterLayout& o) {
  o.lnf_w = add("model.norm.weight", {d.C}, InitKind::ones);
}

std::vector<LinearModule> linear_modules(const ModelDims& d) {
  const int64_t kv = d.Hkv * d.D;
  return {{"self_attn.q_proj", LoraSlot::qkv, 0, d.C, d.Q},      {"self_attn.k_proj", LoraSlot::qkv, d.Q, d.C, kv},
          {"self_attn.v_proj", LoraSlot::qkv, d.Q + kv, d.C, kv}, {"self_attn.o_proj", LoraSlot::o, 0, d.Q, d.C},
          {"mlp.gate_proj", LoraSlot::fc, 0, d.C, d.I},           {"mlp.up_proj", LoraSlot::fc, d.I, d.C, d.I},
          {"mlp.down_proj", LoraSlot::proj, 0, d.I, d.C}};
}

// Megatron's split (HF's (out, in) weights): q, k, v, gate and up column-parallel (their output
// rows, and biases, split), o and down row-parallel (their input columns split); norms and the
// o/down biases whole.
TpSplit tp_split(std::string_view name) {
  for (std::string_view m : {"q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj."})
    if (name.find(m) != std::string_view::npos) return {0, 1};
  for (std::string_view m : {"o_proj.weight", "down_proj.weight"})
    if (name.ends_with(m)) return {1, 1};
  return {};
}

}  // namespace

// extern: the registry (family.cpp) names it; a namespace-scope const is file-local otherwise.
extern const FamilyRecipe kLlamaRecipe;
const FamilyRecipe kLlamaRecipe{
    .description = "RMSNorm, RoPE, SwiGLU",
    .norm = NormKind::rms,
    .positions = PositionKind::rope,
    .optional_prefix = "",
    .validate = validate,
    .n_params = n_params,
    .dims = dims,
    .tied_head = tied_head,
    .head_name = "lm_head.weight",
    .embed_tensors = embed_tensors,
    .block_tensors = block_tensors,
    .final_norm_tensors = final_norm_tensors,
    .block_forward = llama_block_forward,
    .block_backward = llama_block_backward,
    .tp_split = tp_split,
    .layer_prefix = "model.layers.",
    .linear_modules = linear_modules,
    .lora_default_targets = "q_proj,v_proj",
};

}  // namespace strata
