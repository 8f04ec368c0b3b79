// ModelConfig arithmetic and checks: parameter counts per family (matching what HF's
// `model.num_parameters()` reports), consistency validation, the embedded default model and
// the named presets used by benches.
#include "src/model/config.h"

#include "src/checked.h"

#include <cmath>
#include <limits>
#include <utility>
#include <stdexcept>
#include <string>

namespace strata {

namespace {

void require(bool ok, const char* field, const std::string& why) {
  if (!ok) throw std::invalid_argument(std::string("model config: ") + field + ": " + why);
}

// Every size field of a config is below 2^31 before any arithmetic on it.
constexpr int64_t kMaxDim = int64_t{1} << 31;

// Over 2^40 (1.1 trillion) parameters is no model strata can hold on one machine.
void check_param_count(int64_t n) {
  require(n <= (int64_t{1} << 40), "parameters",
          std::to_string(n) + " parameters is beyond what strata supports (at most 2^40); check the sizes in "
          "config.json");
}

}  // namespace

int64_t ModelConfig::n_params() const {
  // Checked: the fields come from config.json, and a count that wraps would size buffers wrong.
  auto mul = [](int64_t a, int64_t b) { return checked_mul(a, b, "model config: parameter count"); };
  auto add = [](int64_t a, int64_t b) { return checked_add(a, b, "model config: parameter count"); };
  const int64_t V = vocab_size, C = hidden_size, L = n_layers, F = intermediate_size;
  if (family == Family::gpt2) {
    // wte, wpe; per block ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj; ln_f; head tied to wte.
    int64_t per_layer = add(mul(mul(C, 3), C), mul(3, C));  // c_attn
    per_layer = add(per_layer, add(mul(C, C), C));          // attn.c_proj
    per_layer = add(per_layer, add(mul(C, F), F));          // c_fc
    per_layer = add(per_layer, add(mul(F, C), C));          // mlp.c_proj
    per_layer = add(per_layer, mul(4, C));                  // ln_1, ln_2
    return add(add(add(mul(V, C), mul(max_position_embeddings, C)), mul(L, per_layer)), mul(2, C));
  }
  const int64_t D = effective_head_dim();
  const int64_t q = mul(n_heads, D), kv = mul(n_kv_heads, D);
  int64_t attn = add(add(mul(C, q), mul(mul(2, C), kv)), mul(q, C));
  if (attention_bias) attn = add(attn, add(q, mul(2, kv)));
  if (o_bias) attn = add(attn, C);
  int64_t mlp = mul(mul(3, C), F);
  if (mlp_bias) mlp = add(mlp, add(mul(2, F), C));
  const int64_t per_layer = add(add(attn, mlp), mul(2, C));  // + input_layernorm, post_attention_layernorm
  return add(add(add(mul(V, C), mul(L, per_layer)), C), tie_word_embeddings ? 0 : mul(V, C));
}

void ModelConfig::validate() const {
  // Sizes from a file are bounded before any arithmetic on them (a fuzzed config.json had
  // hidden_size 4e9, whose parameter count overflowed int64).
  const std::pair<const char*, int64_t> dims[] = {
      {"vocab_size", vocab_size}, {"hidden_size", hidden_size}, {"num_hidden_layers", n_layers},
      {"num_attention_heads", n_heads}, {"num_key_value_heads", n_kv_heads}, {"head_dim", head_dim},
      {"intermediate_size", intermediate_size}, {"max_position_embeddings", max_position_embeddings},
      {"rope_scaling.original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
  for (const auto& [field, v] : dims)
    require(v < kMaxDim, field, std::to_string(v) + " is not below 2^31 (corrupt config?)");
  require(vocab_size > 0, "vocab_size", "must be positive, got " + std::to_string(vocab_size));
  require(hidden_size > 0, "hidden_size", "must be positive, got " + std::to_string(hidden_size));
  require(n_layers > 0, "num_hidden_layers", "must be positive, got " + std::to_string(n_layers));
  require(n_heads > 0, "num_attention_heads", "must be positive, got " + std::to_string(n_heads));
  require(n_kv_heads > 0, "num_key_value_heads", "must be positive, got " + std::to_string(n_kv_heads));
  require(n_heads % n_kv_heads == 0, "num_key_value_heads",
          std::to_string(n_kv_heads) + " does not divide num_attention_heads " + std::to_string(n_heads));
  require(head_dim >= 0, "head_dim", "must not be negative, got " + std::to_string(head_dim));
  if (head_dim == 0)
    require(hidden_size % n_heads == 0, "num_attention_heads",
            std::to_string(n_heads) + " does not divide hidden_size " + std::to_string(hidden_size) +
                " and no head_dim is given");
  require(intermediate_size > 0, "intermediate_size", "must be positive, got " + std::to_string(intermediate_size));
  require(max_position_embeddings > 0, "max_position_embeddings",
          "must be positive, got " + std::to_string(max_position_embeddings));
  require(norm_eps > 0 && std::isfinite(norm_eps), "norm_eps", "must be positive and finite");
  // Upper bounds far beyond any real model, so a typo (or a hostile file) is an error here
  // rather than an overflow or a machine swapping itself to death later.
  auto at_most = [](int64_t v, int64_t limit, const char* field) {
    require(v <= limit, field, std::to_string(v) + " is beyond what strata supports (at most " +
                                   std::to_string(limit) + "); check config.json");
  };
  at_most(vocab_size, kMaxVocab, "vocab_size");
  at_most(hidden_size, int64_t{1} << 18, "hidden_size");
  at_most(n_layers, int64_t{1} << 14, "num_hidden_layers");
  at_most(n_heads, int64_t{1} << 14, "num_attention_heads");
  at_most(head_dim, int64_t{1} << 14, "head_dim");
  at_most(intermediate_size, int64_t{1} << 20, "intermediate_size");
  at_most(max_position_embeddings, int64_t{1} << 24, "max_position_embeddings");

  if (family == Family::gpt2) {
    require(model_type == "gpt2", "model_type", "family gpt2 needs model_type gpt2, got '" + model_type + "'");
    require(activation == "gelu_new" || activation == "gelu_pytorch_tanh" || activation == "gelu",
            "activation_function", "expected gelu_new, gelu_pytorch_tanh or gelu, got '" + activation + "'");
    require(n_kv_heads == n_heads, "n_head", "gpt2 has no grouped-query attention");
    require(effective_head_dim() * n_heads == hidden_size, "head_dim", "gpt2 needs n_embd / n_head");
    require(tie_word_embeddings, "tie_word_embeddings", "gpt2's LM head is always tied to wte");
    require(rope_scaling.type.empty(), "rope_scaling", "gpt2 has no rotary embeddings");
    check_param_count(n_params());
    return;
  }

  require(model_type == "llama" || model_type == "mistral" || model_type == "qwen2", "model_type",
          "family llama needs model_type llama, mistral or qwen2, got '" + model_type + "'");
  require(activation == "silu", "hidden_act", "expected silu, got '" + activation + "'");
  require(rope_theta > 0 && std::isfinite(rope_theta), "rope_theta", "must be positive and finite");
  require(effective_head_dim() % 2 == 0, "head_dim", "rotary embeddings need an even head_dim");
  if (model_type == "llama") {
    require(o_bias == attention_bias, "attention_bias", "llama puts biases on q, k, v and o together");
  } else if (model_type == "qwen2") {
    require(attention_bias && !o_bias, "attention_bias", "qwen2 has q/k/v biases and no o bias");
    require(!mlp_bias, "mlp_bias", "qwen2 has no MLP biases");
  } else {  // mistral
    require(!attention_bias && !o_bias, "attention_bias", "mistral has no attention biases");
    require(!mlp_bias, "mlp_bias", "mistral has no MLP biases");
  }
  const RopeScaling& rs = rope_scaling;
  if (!rs.type.empty()) {
    require(rs.type == "llama3", "rope_scaling", "type '" + rs.type + "' is not supported (only llama3)");
    require(rs.factor > 0 && std::isfinite(rs.factor), "rope_scaling.factor", "must be positive and finite");
    require(rs.low_freq_factor > 0 && rs.high_freq_factor > rs.low_freq_factor && std::isfinite(rs.high_freq_factor),
            "rope_scaling.high_freq_factor", "must be finite and greater than low_freq_factor > 0");
    require(rs.original_max_position_embeddings > 0, "rope_scaling.original_max_position_embeddings",
            "must be positive");
  }
  check_param_count(n_params());
}

ModelConfig default_model_config() {
  // Byte-level llama: 8 layers, 512 wide, 8 heads of 64 (4 KV heads), SwiGLU 1408 ≈ 8/3·C rounded
  // to 128. 23,863,808 parameters (untied 256-row embedding and head are a rounding error).
  ModelConfig c;
  c.family = Family::llama;
  c.model_type = "llama";
  c.vocab_size = 256;
  c.hidden_size = 512;
  c.n_layers = 8;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.head_dim = 64;
  c.intermediate_size = 1408;
  c.max_position_embeddings = 1024;
  c.norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = false;
  c.activation = "silu";
  c.torch_dtype = "float32";
  return c;
}

ModelConfig preset_model_config(const std::string& name) {
  if (name == "gpt2-124m") {
    ModelConfig c;
    c.family = Family::gpt2;
    c.model_type = "gpt2";
    c.vocab_size = 50257;
    c.hidden_size = 768;
    c.n_layers = 12;
    c.n_heads = 12;
    c.n_kv_heads = 12;
    c.head_dim = 64;
    c.intermediate_size = 4 * 768;
    c.max_position_embeddings = 1024;
    c.norm_eps = 1e-5;
    c.tie_word_embeddings = true;
    c.activation = "gelu_new";
    c.torch_dtype = "float32";
    return c;
  }
  if (name == "default") return default_model_config();
  // Llama shapes for the offload and GPU benchmarks (random init; vocab 32000 as Llama 2).
  auto llama = [](int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv, int64_t vocab) {
    ModelConfig c;
    c.family = Family::llama;
    c.model_type = "llama";
    c.vocab_size = vocab;
    c.hidden_size = hidden;
    c.n_layers = layers;
    c.n_heads = heads;
    c.n_kv_heads = kv;
    c.intermediate_size = inter;
    c.max_position_embeddings = 4096;
    c.norm_eps = 1e-5;
    c.tie_word_embeddings = false;
    return c;
  };
  if (name == "llama-350m") return llama(1024, 2816, 24, 16, 16, 32000);   // 373M
  if (name == "llama-1b") return llama(2048, 5632, 22, 32, 4, 32000);      // 1.10B (TinyLlama's shape)
  if (name == "llama-1.5b") return llama(2048, 5632, 24, 16, 16, 32000);   // 1.53B
  if (name == "llama-8b") {                                                 // 8.03B (Llama 3 8B's shape)
    ModelConfig c = llama(4096, 14336, 32, 32, 8, 128256);
    c.rope_theta = 500000.0;
    c.max_position_embeddings = 8192;
    return c;
  }
  throw std::invalid_argument("unknown model preset '" + name +
                              "' (valid presets: default, gpt2-124m, llama-350m, llama-1b, llama-1.5b, llama-8b)");
}

}  // namespace strata
