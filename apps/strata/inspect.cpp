// `strata inspect PATH`: what a model directory, a training checkpoint, a checkpoint directory
// or a .safetensors file holds: tensors (name, dtype, shape), parameter count, whether every
// value is finite, and for a training checkpoint its step, flags and verified checksums.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "apps/strata/commands.h"
#include "kernels/dtype.h"
#include "src/checkpoint/hf.h"
#include "src/checkpoint/train_checkpoint.h"
#include "src/model/lora.h"

namespace strata::app {
namespace {
namespace fs = std::filesystem;

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// Non-finite values of one stored tensor (read through the map, no copy).
int64_t count_non_finite(const StoredTensor& t) {
  const size_t es = kernels::dtype_size(t.dtype);
  const int64_t n = static_cast<int64_t>(t.nbytes / es);
  const auto* b = static_cast<const unsigned char*>(t.data);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    float x;
    if (t.dtype == kernels::DType::f32) {
      std::memcpy(&x, b + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b + 2 * i, 2);
      x = t.dtype == kernels::DType::bf16 ? kernels::bf16_to_f32(h) : kernels::f16_to_f32(h);
    }
    bad += !std::isfinite(x);
  }
  return bad;
}

// Returns the number of tensors holding non-finite values.
int print_tensors(const HfCheckpoint& ck, bool list) {
  int64_t params = 0;
  int bad_tensors = 0;
  for (const StoredTensor& t : ck.tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    params += n;
    const int64_t bad = count_non_finite(t);
    if (bad) ++bad_tensors;
    if (list || bad)
      fmt::print("    {:<48} {:<5} {:<18}{}\n", t.name, kernels::dtype_name(t.dtype), shape_text(t.shape),
                 bad ? fmt::format("  {} non-finite values", bad) : "");
  }
  fmt::print("  tensors    {} ({} values), {}\n", ck.tensors().size(), params,
             bad_tensors ? fmt::format("{} tensors hold non-finite values", bad_tensors) : std::string("all finite"));
  return bad_tensors;
}

void print_config(const fs::path& config_json) {
  const ModelConfig c = read_hf_config(config_json);
  fmt::print("  model      {}: {} layers, hidden {}, {} heads ({} kv), mlp {}, vocab {}, max pos {}, {} params{}\n",
             c.model_type, c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.intermediate_size, c.vocab_size,
             c.max_position_embeddings, c.n_params(), c.tie_word_embeddings ? ", tied head" : "");
}

std::string file_type_name(fs::file_type t) {
  switch (t) {
    case fs::file_type::fifo: return "FIFO";
    case fs::file_type::character: return "character device";
    case fs::file_type::block: return "block device";
    case fs::file_type::socket: return "socket";
    default: return "special file";
  }
}

int inspect(const std::string& path_text, bool list) {
  const fs::path path(path_text);
  const std::string expected = "expected a model directory (config.json), a training checkpoint, a checkpoint "
                               "directory, a PEFT adapter directory or a .safetensors file";
  // The file type from stat, before anything opens the path: a FIFO would block the open.
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) throw std::runtime_error("inspect " + path_text + ": does not exist; " + expected);
  if (fs::is_regular_file(st)) {
    const auto file = HfCheckpoint::open_file(path);  // throws naming what is wrong with it
    fmt::print("{}: safetensors file\n", path_text);
    return print_tensors(*file, list) ? 1 : 0;
  }
  if (!fs::is_directory(st))
    throw std::runtime_error("inspect " + path_text + ": is a " + file_type_name(st.type()) + "; " + expected);
  if (fs::exists(path / "adapter_config.json", ec)) {  // a PEFT LoRA adapter (strata train --lora-rank --out)
    const LoraSpec l = read_peft_config(path);
    std::string targets;
    for (const std::string& t : l.targets) targets += (targets.empty() ? "" : ",") + t;
    fmt::print("{}: PEFT LoRA adapter\n", path_text);
    fmt::print("  lora       rank {}, alpha {} (scale {}{}) on {}\n", l.rank, l.alpha, peft_scale(l),
               l.rslora ? ", rsLoRA" : "", targets);
    return print_tensors(*HfCheckpoint::open_file(path / "adapter_model.safetensors"), list) ? 1 : 0;
  }
  fs::path ckpt = path;
  if (!is_train_checkpoint(path) && !fs::exists(path / "config.json", ec)) {
    ckpt = find_resume_checkpoint("auto", path_text);  // a checkpoint directory: its newest (empty: none)
    if (ckpt.empty())
      throw std::runtime_error("inspect " + path_text + ": a directory with no config.json, no training "
                               "checkpoint and no step-N checkpoint in it; " + expected);
    fmt::print("{}: checkpoint directory; newest complete checkpoint {}\n", path_text, ckpt.string());
  }
  if (is_train_checkpoint(ckpt)) {
    const nlohmann::json m = verify_train_checkpoint(ckpt);  // throws naming a bad file
    fmt::print("{}: training checkpoint (format {} v{})\n", ckpt.string(), m.value("format", ""), m.value("version", 0));
    const auto& t = m.at("trainer");
    fmt::print("  step       {} ({} fp16 steps skipped), {} tokens trained\n", m.at("step").get<int64_t>(),
               t.value("skipped_steps", int64_t{0}), t.value("tokens", int64_t{0}));
    if (m.contains("loss_scaler") && m["loss_scaler"].value("enabled", false))
      fmt::print("  loss scale {}\n", m["loss_scaler"].value("scale", 0.0));
    if (m.contains("data") && m["data"].is_object())
      fmt::print("  data       next window: shard {}, token {}\n", m["data"].value("shard", int64_t{0}),
                 m["data"].value("position", int64_t{0}));
    std::string flags;
    if (m.contains("flags") && m["flags"].is_object())
      for (const auto& [k, v] : m["flags"].items()) {
        std::string f = k;
        for (char& ch : f)
          if (ch == '_') ch = '-';
        flags += fmt::format(" --{} {}", f, v.is_string() ? v.get<std::string>() : v.dump());
      }
    fmt::print("  flags     {}\n", flags);
    for (const auto& f : m.at("files"))
      fmt::print("  file       {:<24} {:>14} bytes  crc32c {}  OK\n", f.at("name").get<std::string>(),
                 f.at("bytes").get<uint64_t>(), f.at("crc32c").get<std::string>());
    print_config(ckpt / "config.json");
    int bad = print_tensors(*HfCheckpoint::open(ckpt), list);
    fmt::print("  optimizer\n");
    bad += print_tensors(*HfCheckpoint::open_file(ckpt / "optimizer.safetensors"), false);
    return bad ? 1 : 0;
  }
  fmt::print("{}: model directory (HF layout)\n", path_text);
  print_config(path / "config.json");
  return print_tensors(*HfCheckpoint::open(path), list) ? 1 : 0;
}

}  // namespace

void register_inspect(CLI::App& app, Run& run) {
  auto path = std::make_shared<std::string>();
  auto list = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Summarise a model directory, a training checkpoint (checksums verified) or a .safetensors file");
  cmd->add_option("path", *path, "model directory, training checkpoint, --checkpoint-dir, or .safetensors file")
      ->required();
  cmd->add_flag("--tensors", *list, "list every tensor (name, dtype, shape)");
  cmd->callback([&run, path, list] { run = [path, list] { return inspect(*path, *list); }; });
}

}  // namespace strata::app
