// ModelConfig: parameter counts against hand/HF counts, validation, presets; config.json
// round trips for every family, real HF configs, and errors that name the file and field.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "src/checkpoint/hf.h"
#include "src/model/config.h"

using namespace strata;
namespace fs = std::filesystem;

namespace {

class ConfigDir : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = (fs::path(::testing::TempDir()) / "strata_config_XXXXXX").string();
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A fresh file each time (rewriting one file makes ext4 flush it on close: slow under load).
  fs::path fresh() { return dir_ / ("config" + std::to_string(n_files_++) + ".json"); }
  fs::path write(const std::string& text) {
    fs::path p = fresh();
    std::ofstream(p) << text;
    return p;
  }
  // Expects read_hf_config to throw a runtime_error mentioning the file and each of `needles`.
  void expect_error(const std::string& text, std::initializer_list<const char*> needles) {
    fs::path p = write(text);
    try {
      read_hf_config(p);
      ADD_FAILURE() << "no error for " << text;
    } catch (const std::runtime_error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
      for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    }
  }
  fs::path dir_;
  int n_files_ = 0;
};

ModelConfig small_llama() {
  ModelConfig c;
  c.family = Family::llama;
  c.model_type = "llama";
  c.vocab_size = 10;
  c.hidden_size = 8;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 4;
  c.intermediate_size = 12;
  c.max_position_embeddings = 32;
  return c;
}

const char* kLlama32_1B = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})";

const char* kGpt2 = R"({
  "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
  "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
  "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
  "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null,
  "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
  "summary_use_proj": true, "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
  "vocab_size": 50257})";

const char* kQwen25_05B = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
  "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936})";

}  // namespace

TEST(ModelConfig, Gpt2_124mParamCountMatchesHf) {
  ModelConfig c = preset_model_config("gpt2-124m");
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.n_params(), 124'439'808);  // GPT2LMHeadModel.num_parameters() with the tied head
}

TEST(ModelConfig, LlamaParamCountByHand) {
  ModelConfig c = small_llama();
  // embed 80; per layer q 64 + k 32 + v 32 + o 64 + mlp 3·8·12 = 288 + norms 16 = 496; final norm 8; head 80.
  EXPECT_EQ(c.n_params(), 80 + 2 * 496 + 8 + 80);
  c.tie_word_embeddings = true;
  EXPECT_EQ(c.n_params(), 80 + 2 * 496 + 8);
  c.attention_bias = c.o_bias = true;  // llama attention_bias: q 8 + k 4 + v 4 + o 8
  EXPECT_EQ(c.n_params(), 80 + 2 * (496 + 24) + 8);
  c.mlp_bias = true;  // gate 12 + up 12 + down 8
  EXPECT_EQ(c.n_params(), 80 + 2 * (496 + 24 + 32) + 8);
  ModelConfig q = small_llama();
  q.model_type = "qwen2";
  q.attention_bias = true;  // q/k/v only
  EXPECT_NO_THROW(q.validate());
  EXPECT_EQ(q.n_params(), 80 + 2 * (496 + 16) + 8 + 80);
}

TEST(ModelConfig, Llama32_1BParamCountMatchesHf) {
  fs::path dir = fs::path(::testing::TempDir()) / "strata_cfg_llama32.json";
  std::ofstream(dir) << kLlama32_1B;
  ModelConfig c = read_hf_config(dir);
  fs::remove(dir);
  EXPECT_EQ(c.n_params(), 1'235'814'400);  // Llama-3.2-1B, tied
}

TEST(ModelConfig, DefaultModelIsSmallLlama) {
  ModelConfig c = default_model_config();
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.family, Family::llama);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_GE(c.n_params(), 10'000'000);
  EXPECT_LE(c.n_params(), 30'000'000);
  EXPECT_EQ(c.n_params(), 23'863'808);
  EXPECT_EQ(preset_model_config("default"), c);
}

TEST(ModelConfig, UnknownPresetListsValidOnes) {
  try {
    preset_model_config("gpt3");
    FAIL();
  } catch (const std::invalid_argument& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("gpt3"), std::string::npos);
    EXPECT_NE(msg.find("gpt2-124m"), std::string::npos);
  }
}

TEST(ModelConfig, ValidateNamesTheField) {
  auto expect_field = [](ModelConfig c, const char* field) {
    try {
      c.validate();
      ADD_FAILURE() << "no error for " << field;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  ModelConfig c = small_llama();
  c.n_kv_heads = 3;
  expect_field(c, "num_key_value_heads");
  c = small_llama();
  c.head_dim = 0;
  c.n_heads = 3;
  c.n_kv_heads = 1;
  expect_field(c, "num_attention_heads");
  c = small_llama();
  c.activation = "gelu";
  expect_field(c, "hidden_act");
  c = small_llama();
  c.rope_scaling.type = "yarn";
  expect_field(c, "rope_scaling");
  c = small_llama();
  c.model_type = "mistral";
  c.attention_bias = true;
  expect_field(c, "attention_bias");
  c = preset_model_config("gpt2-124m");
  c.tie_word_embeddings = false;
  expect_field(c, "tie_word_embeddings");
  c = small_llama();
  c.vocab_size = 0;
  expect_field(c, "vocab_size");
}

// Found by fuzz/fuzz_hf_config: a config.json with hidden_size 4e9 passed validation and its
// parameter count overflowed int64 (undefined behaviour, then nonsense budgets). Sizes from a
// file are now bounded, and the count is computed in 128 bits.
TEST_F(ConfigDir, HugeSizesAreRejectedNotOverflowed) {
  const std::string rest = R"("vocab_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 128, "max_position_embeddings": 64, "hidden_act": "silu")";
  expect_error(R"({"model_type": "llama", "hidden_size": 4000000000, )" + rest + "}", {"hidden_size", "2^31"});
  // Each dimension below 2^31, yet far beyond any model: the per-field bounds name the field.
  expect_error(R"({"model_type": "llama", "hidden_size": 1073741824, "vocab_size": 1073741824, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 64})",
               {"vocab_size", "beyond what strata supports"});
  ModelConfig c = small_llama();
  c.head_dim = 0;
  c.hidden_size = 4'000'000'000;  // attention alone is 4·C² ≈ 6.4e19 parameters
  EXPECT_THROW(c.n_params(), std::exception);  // an overflow is an error, never a wrapped count
  EXPECT_THROW(c.validate(), std::invalid_argument);
}

// Found reviewing what fuzz_hf_config reaches, confirmed under its UBSan build: a llama3
// rope_scaling.original_max_position_embeddings of 1e300 was cast to int64, and a gpt2 n_embd of
// 2^63-1 overflowed the default n_inner (4·n_embd). Both are now errors naming the field.
TEST_F(ConfigDir, OutOfRangeNumbersAreErrorsNotUndefinedBehaviour) {
  const std::string llama = R"("vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 128, "max_position_embeddings": 64)";
  expect_error(R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 1e300}, )" + llama + "}",
               {"rope_scaling.original_max_position_embeddings", "integer"});
  expect_error(R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 4294967296}, )" + llama + "}",
               {"rope_scaling.original_max_position_embeddings", "2^31"});
  EXPECT_NO_THROW(read_hf_config(write(R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3",
      "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32.0}, )" +
                                       llama + "}")));
  for (const char* embd : {"9223372036854775807", "-9223372036854775807", "4000000000"})
    expect_error(std::string(R"({"model_type": "gpt2", "vocab_size": 300, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "n_embd": )") + embd + "}",
                 {"hidden_size"});
}

TEST_F(ConfigDir, RoundTripEveryFamily) {
  std::vector<ModelConfig> configs;
  ModelConfig llama = small_llama();
  llama.rope_theta = 500000.0;
  llama.rope_scaling = {"llama3", 32.0, 1.0, 4.0, 8192};
  llama.attention_bias = llama.o_bias = true;
  llama.mlp_bias = true;
  llama.tie_word_embeddings = true;
  llama.norm_eps = 1e-6;
  llama.torch_dtype = "bfloat16";
  configs.push_back(llama);
  ModelConfig wide_heads = small_llama();
  wide_heads.head_dim = 16;  // head_dim != hidden / heads
  configs.push_back(wide_heads);
  ModelConfig mistral = small_llama();
  mistral.model_type = "mistral";
  configs.push_back(mistral);
  ModelConfig qwen = small_llama();
  qwen.model_type = "qwen2";
  qwen.attention_bias = true;
  qwen.tie_word_embeddings = true;
  configs.push_back(qwen);
  ModelConfig gpt2 = preset_model_config("gpt2-124m");
  configs.push_back(gpt2);
  gpt2.intermediate_size = 1000;  // explicit n_inner
  gpt2.activation = "gelu";
  gpt2.norm_eps = 1e-6;
  configs.push_back(gpt2);
  configs.push_back(default_model_config());
  for (const ModelConfig& c : configs) {
    fs::path p = fresh();
    write_hf_config(c, p);
    ModelConfig back = read_hf_config(p);
    EXPECT_EQ(back, c) << c.model_type << " round trip differs";
    EXPECT_EQ(back.n_params(), c.n_params());
  }
}

TEST_F(ConfigDir, WritesHfFieldNames) {
  fs::path p = fresh();
  write_hf_config(preset_model_config("gpt2-124m"), p);
  nlohmann::json j = nlohmann::json::parse(std::ifstream(p));
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"GPT2LMHeadModel"}));
  EXPECT_EQ(j["model_type"], "gpt2");
  EXPECT_EQ(j["n_embd"], 768);
  EXPECT_EQ(j["n_layer"], 12);
  EXPECT_EQ(j["n_head"], 12);
  EXPECT_EQ(j["n_positions"], 1024);
  EXPECT_TRUE(j["n_inner"].is_null());
  EXPECT_EQ(j["activation_function"], "gelu_new");
  EXPECT_EQ(j["torch_dtype"], "float32");

  ModelConfig q = small_llama();
  q.model_type = "qwen2";
  q.attention_bias = true;
  write_hf_config(q, p = fresh());
  j = nlohmann::json::parse(std::ifstream(p));
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"Qwen2ForCausalLM"}));
  for (const char* k : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "intermediate_size", "max_position_embeddings", "rms_norm_eps",
                        "rope_theta", "hidden_act", "tie_word_embeddings"})
    EXPECT_TRUE(j.contains(k)) << k;
  ModelConfig m = small_llama();
  m.model_type = "mistral";
  write_hf_config(m, p = fresh());
  j = nlohmann::json::parse(std::ifstream(p));
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"MistralForCausalLM"}));
  write_hf_config(small_llama(), p = fresh());
  j = nlohmann::json::parse(std::ifstream(p));
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
}

TEST_F(ConfigDir, ReadsRealHfConfigs) {
  ModelConfig c = read_hf_config(write(kLlama32_1B));
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.n_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, "bfloat16");

  c = read_hf_config(write(kGpt2));
  EXPECT_EQ(c, preset_model_config("gpt2-124m"));

  c = read_hf_config(write(kQwen25_05B));
  EXPECT_EQ(c.family, Family::llama);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.n_params(), 494'032'768);  // Qwen2.5-0.5B, tied

  // Mistral v0.3: sliding_window null is accepted.
  c = read_hf_config(write(R"({"model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
      "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
      "sliding_window": null, "hidden_act": "silu", "tie_word_embeddings": false})"));
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_EQ(c.n_params(), 7'248'023'552);  // Mistral-7B-v0.3
}

TEST_F(ConfigDir, ErrorsNameFileAndField) {
  const std::string base = R"("vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
      "intermediate_size": 12, "max_position_embeddings": 32)";
  // Sanity: the base is valid.
  EXPECT_NO_THROW(read_hf_config(write(R"({"model_type": "llama", )" + base + "}")));
  expect_error(R"({"model_type": "falcon", )" + base + "}", {"model_type", "falcon"});
  expect_error(R"({"vocab_size": 10})", {"model_type", "missing"});
  expect_error(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
      "num_attention_heads": 2, "max_position_embeddings": 32})",
               {"intermediate_size", "missing"});
  expect_error(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": "8", "num_hidden_layers": 2,
      "num_attention_heads": 2, "intermediate_size": 12, "max_position_embeddings": 32})",
               {"hidden_size", "integer"});
  expect_error(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2.5,
      "num_attention_heads": 2, "intermediate_size": 12, "max_position_embeddings": 32})",
               {"num_hidden_layers", "integer"});
  expect_error(R"({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, )" + base + "}",
               {"rope_scaling", "yarn"});
  expect_error(R"({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}, )" + base + "}",
               {"rope_scaling", "linear"});
  expect_error(R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}, )" + base + "}",
               {"rope_scaling.high_freq_factor"});
  expect_error(R"({"model_type": "llama", "rope_scaling": "llama3", )" + base + "}", {"rope_scaling"});
  expect_error(R"({"model_type": "llama", "hidden_act": "gelu", )" + base + "}", {"hidden_act", "gelu"});
  expect_error(R"({"model_type": "llama", "num_key_value_heads": 3, )" + base + "}", {"num_key_value_heads"});
  expect_error(R"({"model_type": "mistral", "sliding_window": 4, )" + base + "}", {"sliding_window"});
  EXPECT_NO_THROW(read_hf_config(write(R"({"model_type": "mistral", "sliding_window": 32, )" + base + "}")));
  expect_error(R"({"model_type": "gpt2", "vocab_size": 10, "n_embd": 8, "n_layer": 1, "n_head": 2,
      "n_positions": 16, "activation_function": "relu"})",
               {"activation_function", "relu"});
  expect_error(R"({"model_type": "gpt2", "vocab_size": 10, "n_layer": 1, "n_head": 2, "n_positions": 16})",
               {"n_embd"});
  expect_error("{not json", {"JSON"});
  expect_error(R"({"model_type": "llama", "x": )" + std::string(100000, '[') + std::string(100000, ']') + "}",
               {"nests too deeply"});
}

TEST_F(ConfigDir, MissingFileNamesIt) {
  EXPECT_THROW(read_hf_config(dir_ / "nope.json"), std::runtime_error);
  try {
    read_hf_config(dir_ / "nope.json");
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.json"), std::string::npos);
  }
}
