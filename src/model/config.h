// ModelConfig: the architecture of a decoder-only transformer, as read from (and written back
// to) a Hugging Face config.json. One struct for every family strata trains; `family` says
// which layer recipe applies.
#pragma once
#include <cstdint>
#include <string>

namespace strata {

enum class Family : uint8_t {
  llama,  // llama, mistral, qwen2: RMSNorm, RoPE, GQA, SwiGLU MLP, no biases (qwen2: q/k/v bias)
  gpt2,   // LayerNorm, learned positions, gelu_new MLP, fused c_attn, biases, tied head
};

struct RopeScaling {
  std::string type;  // "" = none, "llama3" (Llama 3.1/3.2), others rejected with a clear error
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  bool operator==(const RopeScaling&) const = default;
};

struct ModelConfig {
  Family family = Family::llama;
  std::string model_type = "llama";     // as in config.json: llama, mistral, qwen2, gpt2
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;              // C
  int64_t n_layers = 0;                 // L
  int64_t n_heads = 0;                  // attention (query) heads
  int64_t n_kv_heads = 0;               // = n_heads unless GQA
  int64_t head_dim = 0;                 // hidden_size / n_heads unless given
  int64_t intermediate_size = 0;        // MLP width (gpt2: n_inner or 4·C)
  int64_t max_position_embeddings = 0;
  double norm_eps = 1e-5;               // rms_norm_eps / layer_norm_epsilon
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;     // gpt2: always true
  bool attention_bias = false;          // q/k/v (and o for llama "attention_bias") biases; qwen2: q/k/v only
  bool o_bias = false;                  // output projection bias (llama attention_bias=true)
  bool mlp_bias = false;
  std::string activation = "silu";      // llama: silu (SwiGLU); gpt2: gelu_new / gelu
  std::string torch_dtype = "float32";  // written back to config.json

  // Token ids are int32 and shards store uint32: a vocabulary beyond this is a config typo.
  static constexpr int64_t kMaxVocab = int64_t{1} << 24;
  // Number of parameters (embeddings and head counted once when tied). Throws
  // std::invalid_argument if the count overflows int64.
  int64_t n_params() const;
  // Throws std::invalid_argument naming the field when the config is inconsistent
  // (e.g. n_heads not dividing hidden_size without head_dim, n_heads % n_kv_heads != 0), or
  // a size is beyond its sane upper bound (num_hidden_layers 1e9, vocab_size 2^62).
  void validate() const;
  // head_dim when given, else hidden_size / n_heads (HF's default for every family).
  int64_t effective_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / n_heads; }
  bool operator==(const ModelConfig&) const = default;
};

// The embedded default model: a small llama-style config (about 10–30M parameters) with a
// byte-level vocabulary, used when `strata train` is run without --model.
ModelConfig default_model_config();
// Presets for benches: "gpt2-124m" (12 layers, 768 wide, 12 heads, vocab 50257, 1024 positions).
ModelConfig preset_model_config(const std::string& name);

}  // namespace strata
