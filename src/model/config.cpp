// ModelConfig arithmetic and checks: parameter counts (each family's recipe matches what HF's
// `model.num_parameters()` reports), consistency validation shared by every family before the
// recipe's own, the embedded default model and the named presets used by benches.
#include "src/model/config.h"

#include "src/model/family.h"

#include <cmath>
#include <limits>
#include <utility>
#include <stdexcept>
#include <string>

namespace strata {

void require_config(bool ok, const char* field, const std::string& why) {
  if (!ok) throw std::invalid_argument(std::string("model config: ") + field + ": " + why);
}

namespace {

// Every size field of a config is below 2^31 before any arithmetic on it.
constexpr int64_t kMaxDim = int64_t{1} << 31;

// Over 2^40 (1.1 trillion) parameters is no model strata can hold on one machine.
void check_param_count(int64_t n) {
  require_config(n <= (int64_t{1} << 40), "parameters",
                 std::to_string(n) + " parameters is beyond what strata supports (at most 2^40); check the sizes in "
                 "config.json");
}

}  // namespace

int64_t ModelConfig::n_params() const { return family_recipe(family).n_params(*this); }

void ModelConfig::validate() const {
  // Sizes from a file are bounded before any arithmetic on them (a fuzzed config.json had
  // hidden_size 4e9, whose parameter count overflowed int64).
  const std::pair<const char*, int64_t> dims[] = {
      {"vocab_size", vocab_size}, {"hidden_size", hidden_size}, {"num_hidden_layers", n_layers},
      {"num_attention_heads", n_heads}, {"num_key_value_heads", n_kv_heads}, {"head_dim", head_dim},
      {"intermediate_size", intermediate_size}, {"max_position_embeddings", max_position_embeddings},
      {"rope_scaling.original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
  for (const auto& [field, v] : dims)
    require_config(v < kMaxDim, field, std::to_string(v) + " is not below 2^31 (corrupt config?)");
  require_config(vocab_size > 0, "vocab_size", "must be positive, got " + std::to_string(vocab_size));
  require_config(hidden_size > 0, "hidden_size", "must be positive, got " + std::to_string(hidden_size));
  require_config(n_layers > 0, "num_hidden_layers", "must be positive, got " + std::to_string(n_layers));
  require_config(n_heads > 0, "num_attention_heads", "must be positive, got " + std::to_string(n_heads));
  require_config(n_kv_heads > 0, "num_key_value_heads", "must be positive, got " + std::to_string(n_kv_heads));
  require_config(n_heads % n_kv_heads == 0, "num_key_value_heads",
                 std::to_string(n_kv_heads) + " does not divide num_attention_heads " + std::to_string(n_heads));
  require_config(head_dim >= 0, "head_dim", "must not be negative, got " + std::to_string(head_dim));
  if (head_dim == 0)
    require_config(hidden_size % n_heads == 0, "num_attention_heads",
                   std::to_string(n_heads) + " does not divide hidden_size " + std::to_string(hidden_size) +
                       " and no head_dim is given");
  require_config(intermediate_size > 0, "intermediate_size",
                 "must be positive, got " + std::to_string(intermediate_size));
  require_config(max_position_embeddings > 0, "max_position_embeddings",
                 "must be positive, got " + std::to_string(max_position_embeddings));
  require_config(norm_eps > 0 && std::isfinite(norm_eps), "norm_eps", "must be positive and finite");
  // Upper bounds far beyond any real model, so a typo (or a hostile file) is an error here
  // rather than an overflow or a machine swapping itself to death later.
  auto at_most = [](int64_t v, int64_t limit, const char* field) {
    require_config(v <= limit, field, std::to_string(v) + " is beyond what strata supports (at most " +
                                          std::to_string(limit) + "); check config.json");
  };
  at_most(vocab_size, kMaxVocab, "vocab_size");
  at_most(hidden_size, int64_t{1} << 18, "hidden_size");
  at_most(n_layers, int64_t{1} << 14, "num_hidden_layers");
  at_most(n_heads, int64_t{1} << 14, "num_attention_heads");
  at_most(head_dim, int64_t{1} << 14, "head_dim");
  at_most(intermediate_size, int64_t{1} << 20, "intermediate_size");
  at_most(max_position_embeddings, int64_t{1} << 24, "max_position_embeddings");

  family_recipe(family).validate(*this);
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
