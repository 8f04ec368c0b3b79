// libFuzzer: a training checkpoint's manifest (trainer.json, src/checkpoint/train_checkpoint.cpp)
// on arbitrary bytes, next to three small fixed files. verify_train_checkpoint must either
// return a manifest whose every listed file it checked, or throw std::runtime_error naming the
// problem — never crash, hang or read outside the checkpoint directory.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "src/checkpoint/train_checkpoint.h"

namespace fs = std::filesystem;

namespace {
// The checkpoint directory: config.json, model.safetensors and optimizer.safetensors with fixed
// contents ("c", "m", "o"; the seed manifests list their sizes and crc32c), and trainer.json.
const fs::path& checkpoint_dir() {
  static const fs::path dir = [] {
    std::string t = (fs::temp_directory_path() / "strata-fuzz-manifest-XXXXXX").string();
    if (!::mkdtemp(t.data())) std::abort();
    for (const auto& [name, text] : {std::pair<const char*, const char*>{"config.json", "c"},
                                     {"model.safetensors", "m"}, {"optimizer.safetensors", "o"}})
      std::ofstream(fs::path(t) / name) << text;
    return fs::path(t);
  }();
  return dir;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path& dir = checkpoint_dir();
  {
    std::ofstream f(dir / "trainer.json", std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    const nlohmann::json m = strata::verify_train_checkpoint(dir);
    // Accepted: it must name the three files and a non-negative step.
    if (!m.is_object() || m.at("step").get<int64_t>() < 0 || !m.at("files").is_array()) std::abort();
  } catch (const std::runtime_error&) {
  }
  return 0;
}
