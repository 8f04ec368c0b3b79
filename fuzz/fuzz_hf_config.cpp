// libFuzzer: config.json parsing (src/checkpoint/hf_config.cpp, ModelConfig::validate in
// src/model/config.cpp) on arbitrary bytes. Errors are std::runtime_error naming the field;
// a config that parses must also survive what the trainer does with it first (n_params) and
// round-trip through write_hf_config.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>

#include "fuzz/fuzz_util.h"
#include "src/checkpoint/hf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  fuzz::MemFile f(data, size);
  ModelConfig c;
  try {
    c = read_hf_config(f.path());
  } catch (const std::runtime_error&) {
    return 0;
  }
  (void)c.n_params();
  (void)c.effective_head_dim();
  static const std::filesystem::path out =
      std::filesystem::temp_directory_path() / ("strata-fuzz-config-" + std::to_string(::getpid()) + ".json");
  write_hf_config(c, out);
  const ModelConfig back = read_hf_config(out);
  if (back.hidden_size != c.hidden_size || back.n_layers != c.n_layers || back.n_heads != c.n_heads ||
      back.n_kv_heads != c.n_kv_heads || back.vocab_size != c.vocab_size ||
      back.intermediate_size != c.intermediate_size || back.n_params() != c.n_params())
    std::abort();
  return 0;
}
