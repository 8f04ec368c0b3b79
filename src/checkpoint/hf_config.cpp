// config.json <-> ModelConfig for the families strata trains (llama, mistral, qwen2, gpt2).
// Field names and defaults are those of HF transformers' LlamaConfig / MistralConfig /
// Qwen2Config / GPT2Config, so a directory strata writes loads with AutoModelForCausalLM.
#include <cmath>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "src/checkpoint/hf.h"
#include "src/checkpoint/file_util.h"
#include "src/checkpoint/safetensors.h"

namespace strata {

namespace {

using nlohmann::json;

// Reads fields of one config.json, turning every problem into an error naming file and field.
class Fields {
 public:
  Fields(const json& j, std::string file) : j_(j), file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& why) const {
    throw std::runtime_error(file_ + ": field '" + field + "': " + why);
  }
  bool has(const char* k) const { return j_.contains(k) && !j_.at(k).is_null(); }
  const json& at(const char* k) const { return j_.at(k); }

  int64_t int_field(const char* k) const {
    if (!j_.contains(k)) fail(k, "missing (required)");
    return as_int(j_.at(k), k);
  }
  int64_t int_field(const char* k, int64_t dflt) const { return has(k) ? as_int(j_.at(k), k) : dflt; }
  double num_field(const char* k) const {
    if (!j_.contains(k)) fail(k, "missing (required)");
    return as_num(j_.at(k), k);
  }
  double num_field(const char* k, double dflt) const { return has(k) ? as_num(j_.at(k), k) : dflt; }
  bool bool_field(const char* k, bool dflt) const {
    if (!has(k)) return dflt;
    if (!j_.at(k).is_boolean()) fail(k, "expected true or false, got " + j_.at(k).dump());
    return j_.at(k).get<bool>();
  }
  std::string str_field(const char* k, const std::string& dflt) const {
    if (!has(k)) return dflt;
    if (!j_.at(k).is_string()) fail(k, "expected a string, got " + j_.at(k).dump());
    return j_.at(k).get<std::string>();
  }

  int64_t as_int(const json& v, const std::string& k) const {
    // HF writes integers; tolerate 4096.0 from hand-written files but nothing fractional.
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) return static_cast<int64_t>(d);
    }
    fail(k, "expected an integer, got " + v.dump());
  }
  double as_num(const json& v, const std::string& k) const {
    if (!v.is_number()) fail(k, "expected a number, got " + v.dump());
    return v.get<double>();
  }

 private:
  const json& j_;
  std::string file_;
};

RopeScaling read_rope_scaling(const Fields& f) {
  RopeScaling rs;
  if (!f.has("rope_scaling")) return rs;
  const json& r = f.at("rope_scaling");
  if (!r.is_object()) f.fail("rope_scaling", "expected null or an object, got " + r.dump());
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    if (r.contains(key) && !r.at(key).is_null()) {
      if (!r.at(key).is_string()) f.fail(std::string("rope_scaling.") + key, "expected a string");
      type = r.at(key).get<std::string>();
      break;
    }
  }
  if (type.empty()) f.fail("rope_scaling.rope_type", "missing");
  if (type == "default") return rs;  // HF's name for unscaled RoPE
  if (type != "llama3")
    f.fail("rope_scaling", "rope type '" + type + "' is not supported (strata supports llama3 scaling only)");
  auto num = [&](const char* k) {
    if (!r.contains(k) || r.at(k).is_null()) f.fail(std::string("rope_scaling.") + k, "missing (required for llama3)");
    if (!r.at(k).is_number()) f.fail(std::string("rope_scaling.") + k, "expected a number, got " + r.at(k).dump());
    return r.at(k).get<double>();
  };
  rs.type = "llama3";
  rs.factor = num("factor");
  rs.low_freq_factor = num("low_freq_factor");
  rs.high_freq_factor = num("high_freq_factor");
  // The integer rule of every other size field: a float like 8192.0 is accepted, but only when it
  // is finite and exact (a fuzzed 1e300 was cast to int64: undefined behaviour).
  (void)num("original_max_position_embeddings");
  rs.original_max_position_embeddings =
      f.as_int(r.at("original_max_position_embeddings"), "rope_scaling.original_max_position_embeddings");
  return rs;
}

ModelConfig read_llama_family(const Fields& f, const std::string& type) {
  ModelConfig c;
  c.family = Family::llama;
  c.model_type = type;
  c.vocab_size = f.int_field("vocab_size");
  c.hidden_size = f.int_field("hidden_size");
  c.n_layers = f.int_field("num_hidden_layers");
  c.n_heads = f.int_field("num_attention_heads");
  c.n_kv_heads = f.int_field("num_key_value_heads", c.n_heads);
  c.intermediate_size = f.int_field("intermediate_size");
  c.max_position_embeddings = f.int_field("max_position_embeddings");
  if (c.n_heads <= 0) f.fail("num_attention_heads", "must be positive, got " + std::to_string(c.n_heads));
  c.head_dim = f.int_field("head_dim", c.hidden_size / c.n_heads);
  c.norm_eps = f.num_field("rms_norm_eps", 1e-6);
  c.rope_theta = f.num_field("rope_theta", 10000.0);
  c.rope_scaling = read_rope_scaling(f);
  c.tie_word_embeddings = f.bool_field("tie_word_embeddings", false);
  c.activation = f.str_field("hidden_act", "silu");
  if (c.activation != "silu") f.fail("hidden_act", "expected silu, got '" + c.activation + "'");
  if (type == "llama") {
    c.attention_bias = f.bool_field("attention_bias", false);
    c.o_bias = c.attention_bias;  // LlamaAttention: bias on q, k, v and o
    c.mlp_bias = f.bool_field("mlp_bias", false);
  } else if (type == "qwen2") {
    c.attention_bias = true;  // Qwen2Attention: q/k/v always have biases, o never
    if (f.bool_field("use_sliding_window", false)) {
      int64_t window = f.int_field("sliding_window", 0);
      if (window > 0 && window < c.max_position_embeddings)
        f.fail("use_sliding_window", "sliding-window attention (window " + std::to_string(window) +
                                         " < max_position_embeddings) is not supported");
    }
  } else {  // mistral
    if (f.has("sliding_window")) {
      int64_t window = f.int_field("sliding_window");
      if (window < c.max_position_embeddings)
        f.fail("sliding_window", "sliding-window attention (window " + std::to_string(window) +
                                     " < max_position_embeddings " + std::to_string(c.max_position_embeddings) +
                                     ") is not supported");
    }
  }
  return c;
}

ModelConfig read_gpt2(const Fields& f) {
  ModelConfig c;
  c.family = Family::gpt2;
  c.model_type = "gpt2";
  c.vocab_size = f.int_field("vocab_size");
  c.hidden_size = f.int_field("n_embd");
  c.n_layers = f.int_field("n_layer");
  c.n_heads = f.int_field("n_head");
  if (c.n_heads <= 0) f.fail("n_head", "must be positive, got " + std::to_string(c.n_heads));
  c.n_kv_heads = c.n_heads;
  c.head_dim = c.hidden_size / c.n_heads;
  // GPT-2's default MLP width, 4·n_embd, only for an n_embd that validate() can accept (a fuzzed
  // n_embd of 2^63-1 overflowed 4·n_embd); any other n_embd is rejected there by name.
  const bool sane_embd = c.hidden_size > 0 && c.hidden_size < (int64_t{1} << 40);
  c.intermediate_size = f.int_field("n_inner", sane_embd ? 4 * c.hidden_size : 1);
  c.max_position_embeddings = f.has("n_positions") ? f.int_field("n_positions") : f.int_field("n_ctx");
  c.norm_eps = f.num_field("layer_norm_epsilon", 1e-5);
  c.activation = f.str_field("activation_function", "gelu_new");
  if (c.activation != "gelu_new" && c.activation != "gelu_pytorch_tanh" && c.activation != "gelu")
    f.fail("activation_function", "expected gelu_new, gelu_pytorch_tanh or gelu, got '" + c.activation + "'");
  c.tie_word_embeddings = f.bool_field("tie_word_embeddings", true);
  if (!c.tie_word_embeddings) f.fail("tie_word_embeddings", "an untied GPT-2 LM head is not supported");
  return c;
}

const char* architecture(const std::string& model_type) {
  if (model_type == "llama") return "LlamaForCausalLM";
  if (model_type == "mistral") return "MistralForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "gpt2") return "GPT2LMHeadModel";
  throw std::invalid_argument("write_hf_config: unknown model_type '" + model_type + "'");
}

}  // namespace

ModelConfig read_hf_config(const std::filesystem::path& config_json) {
  const std::string file = config_json.string();
  const json j = safetensors::read_json_file(config_json);
  if (!j.is_object()) throw std::runtime_error(file + ": expected a JSON object at top level");
  Fields f(j, file);
  if (!j.contains("model_type")) f.fail("model_type", "missing (required)");
  if (!j.at("model_type").is_string()) f.fail("model_type", "expected a string, got " + j.at("model_type").dump());
  const std::string type = j.at("model_type").get<std::string>();
  ModelConfig c;
  if (type == "llama" || type == "mistral" || type == "qwen2") {
    c = read_llama_family(f, type);
  } else if (type == "gpt2") {
    c = read_gpt2(f);
  } else {
    f.fail("model_type", "unknown model_type '" + type + "' (supported: llama, mistral, qwen2, gpt2)");
  }
  std::string dtype = f.str_field("torch_dtype", f.str_field("dtype", "float32"));
  c.torch_dtype = dtype;
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(file + ": " + e.what());
  }
  return c;
}

void write_hf_config(const ModelConfig& cfg, const std::filesystem::path& config_json) {
  cfg.validate();
  json j;
  j["architectures"] = json::array({architecture(cfg.model_type)});
  j["model_type"] = cfg.model_type;
  j["vocab_size"] = cfg.vocab_size;
  j["torch_dtype"] = cfg.torch_dtype;
  j["tie_word_embeddings"] = cfg.tie_word_embeddings;
  if (cfg.family == Family::gpt2) {
    j["n_embd"] = cfg.hidden_size;
    j["n_layer"] = cfg.n_layers;
    j["n_head"] = cfg.n_heads;
    j["n_positions"] = cfg.max_position_embeddings;
    j["n_ctx"] = cfg.max_position_embeddings;  // older transformers releases read n_ctx
    j["n_inner"] = cfg.intermediate_size == 4 * cfg.hidden_size ? json(nullptr) : json(cfg.intermediate_size);
    j["layer_norm_epsilon"] = cfg.norm_eps;
    j["activation_function"] = cfg.activation;
    if (cfg.vocab_size == 50257) {  // GPT-2's tokenizer: <|endoftext|> is both
      j["bos_token_id"] = 50256;
      j["eos_token_id"] = 50256;
    }
  } else {
    j["hidden_size"] = cfg.hidden_size;
    j["num_hidden_layers"] = cfg.n_layers;
    j["num_attention_heads"] = cfg.n_heads;
    j["num_key_value_heads"] = cfg.n_kv_heads;
    j["head_dim"] = cfg.effective_head_dim();
    j["intermediate_size"] = cfg.intermediate_size;
    j["max_position_embeddings"] = cfg.max_position_embeddings;
    j["rms_norm_eps"] = cfg.norm_eps;
    j["rope_theta"] = cfg.rope_theta;
    j["hidden_act"] = cfg.activation;
    if (cfg.rope_scaling.type.empty()) {
      j["rope_scaling"] = nullptr;
    } else {
      const RopeScaling& rs = cfg.rope_scaling;
      j["rope_scaling"] = {{"rope_type", rs.type},
                           {"factor", rs.factor},
                           {"low_freq_factor", rs.low_freq_factor},
                           {"high_freq_factor", rs.high_freq_factor},
                           {"original_max_position_embeddings", rs.original_max_position_embeddings}};
    }
    if (cfg.model_type == "llama") {
      j["attention_bias"] = cfg.attention_bias;
      j["mlp_bias"] = cfg.mlp_bias;
    } else if (cfg.model_type == "mistral") {
      j["sliding_window"] = nullptr;
    } else if (cfg.model_type == "qwen2") {
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
    }
  }
  write_file_synced(config_json, j.dump(2) + "\n");
}

}  // namespace strata
