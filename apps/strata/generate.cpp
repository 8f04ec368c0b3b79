// `strata generate`: sampling from a model with a KV cache. A prompt as text (the model's
// tokenizer, or bytes for a 256-token byte model), as a chat message (the model's chat
// template) or as ids; streamed to stdout as complete UTF-8, or one JSON object per prompt
// (--json, --batch-file: all prompts of the file decoded together as one batch).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/strata/commands.h"
#include "kernels/cpu/parallel.h"
#include "offload/size.h"
#include "src/checkpoint/hf.h"
#include "src/checkpoint/train_checkpoint.h"
#include "src/data/prepare.h"
#include "src/infer/generate.h"
#include "src/train/tiered_memory.h"

namespace strata::app {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct GenerateOptions {
  std::string model, adapter, prompt, prompt_ids, batch_file;
  bool chat = false, json_out = false;
  int64_t max_new_tokens = 128;
  double temperature = 1.0, top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  std::vector<std::string> stops;
  std::string backend = "cpu", dtype = "fp32";
  int threads = 0;
  std::string offload_params = "none", device_mem, host_mem;
  std::vector<std::string> nvme_paths;
};

// The model directory --model names: an HF directory (or `strata train --out`), one training
// checkpoint (verified: every file's size and checksum), or a checkpoint directory (its latest).
fs::path resolve_model_dir(const std::string& model) {
  if (model.empty()) throw std::invalid_argument("generate: --model DIR is required");
  const fs::path p(model);
  if (!fs::is_directory(p)) throw std::runtime_error("--model " + model + ": no such directory");
  if (!fs::exists(p / "config.json") && (fs::exists(p / "latest") || !fs::is_empty(p))) {
    const fs::path ckpt = find_resume_checkpoint(model, "");
    if (!ckpt.empty()) return resolve_model_dir(ckpt.string());
  }
  if (!fs::exists(p / "config.json"))
    throw std::runtime_error("--model " + model + ": no config.json (expected an HF model directory, a strata train "
                             "--out directory or a training checkpoint)");
  if (is_train_checkpoint(p)) verify_train_checkpoint(p);
  return p;
}

// EOS ids from config.json and generation_config.json (an int or a list each).
void add_eos_ids(const fs::path& file, std::vector<int32_t>& eos) {
  if (!fs::exists(file)) return;
  std::ifstream f(file);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    throw std::runtime_error(file.string() + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("eos_token_id")) return;
  const json& e = j["eos_token_id"];
  for (const json& v : e.is_array() ? e : json::array({e}))
    if (v.is_number_integer()) eos.push_back(v.get<int32_t>());
}

// "1,2,3" -> ids; every one an integer in [0, vocab).
std::vector<int32_t> parse_prompt_ids(const std::string& text, int64_t vocab) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t comma = std::min(text.find(',', i), text.size());
    const std::string item = text.substr(i, comma - i);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || item.find_first_not_of("0123456789 ") != std::string::npos)
      throw std::invalid_argument("--prompt-ids '" + text + "': expected comma-separated token ids, e.g. 1,2,3");
    if (v >= vocab)
      throw std::invalid_argument("--prompt-ids: id " + item + " is outside the vocabulary [0, " +
                                  std::to_string(vocab) + ")");
    ids.push_back(static_cast<int32_t>(v));
    i = comma + 1;
  }
  return ids;
}

// Length of the longest prefix of s that ends on a whole UTF-8 character and not in U+FFFD (a
// tokenizer's stand-in for bytes still to come).
size_t complete_utf8(const std::string& s) {
  size_t n = s.size();
  size_t back = 0;
  while (back < 4 && back < n && (static_cast<unsigned char>(s[n - 1 - back]) & 0xC0) == 0x80) ++back;
  if (back < n) {
    const auto lead = static_cast<unsigned char>(s[n - 1 - back]);
    const size_t need = lead < 0x80 ? 1 : (lead >> 5) == 6 ? 2 : (lead >> 4) == 14 ? 3 : (lead >> 3) == 30 ? 4 : 1;
    if (back + 1 < need) n -= back + 1;
  }
  while (n >= 3 && s.compare(n - 3, 3, "\xEF\xBF\xBD") == 0) n -= 3;
  return n;
}

// The model's text side: its tokenizer (optional for byte models) and chat template.
struct TextSide {
  std::optional<TextModel> text;
  int64_t vocab = 0;

  std::vector<int32_t> encode(const std::string& prompt, bool chat) const {
    std::string s = prompt;
    if (chat) {
      if (!text || !text->chat.has_template())
        throw std::invalid_argument("--chat needs the model's chat template (tokenizer.json and tokenizer_config.json "
                                    "with chat_template in the model directory)");
      s = text->chat.render(json::array({{{"role", "user"}, {"content", prompt}}}), true);
    }
    std::vector<int32_t> ids;
    if (text) {
      for (uint32_t id : text->tokenizer.encode(s, !chat)) ids.push_back(static_cast<int32_t>(id));
    } else if (vocab == 256) {
      for (char c : s) ids.push_back(static_cast<unsigned char>(c));
    } else {
      throw std::invalid_argument("the model directory has no tokenizer.json and its vocabulary (" +
                                  std::to_string(vocab) + ") is not bytes: use --prompt-ids, or put the "
                                  "model's tokenizer.json next to its config.json");
    }
    if (ids.empty()) throw std::invalid_argument("the prompt has no tokens");
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const {
    if (text) {
      std::vector<uint32_t> u(ids.begin(), ids.end());
      return text->tokenizer.decode(u, true);
    }
    if (vocab == 256) return std::string(ids.begin(), ids.end());
    return {};  // no tokenizer: ids only
  }
};

// The first stop text in `text`, or npos.
size_t find_stop(const std::string& text, const std::vector<std::string>& stops) {
  size_t at = std::string::npos;
  for (const std::string& s : stops)
    if (!s.empty()) at = std::min(at, text.find(s));
  return at;
}

int run_generate(const GenerateOptions& o) {
  SamplingParams sp{o.temperature, o.top_k, o.top_p, o.seed};
  sp.validate();
  if (o.max_new_tokens < 0) throw std::invalid_argument("--max-new-tokens must be >= 0");
  const int given = !o.prompt.empty() + !o.prompt_ids.empty() + !o.batch_file.empty();
  if (given != 1) throw std::invalid_argument("give exactly one of --prompt, --prompt-ids, --batch-file");
  const fs::path dir = resolve_model_dir(o.model);
  const ModelConfig cfg = read_hf_config(dir / "config.json");
  TextSide side;
  side.vocab = cfg.vocab_size;
  if (fs::exists(dir / "tokenizer.json")) side.text = load_text_model(dir);
  std::vector<int32_t> eos;
  add_eos_ids(dir / "config.json", eos);
  add_eos_ids(dir / "generation_config.json", eos);
  if (side.text && side.text->eos_id) eos.push_back(static_cast<int32_t>(*side.text->eos_id));
  // A --stop that is a special token (a chat template's end of turn, e.g. <|im_end|>) ends the
  // item when that token is sampled: the printed text skips special tokens, so it would never
  // contain the stop text.
  if (side.text)
    for (const std::string& s : o.stops)
      if (const auto id = side.text->tokenizer.token_to_id(s); id && side.text->tokenizer.is_special(*id))
        eos.push_back(static_cast<int32_t>(*id));

  // The requests: one prompt, or one per line of --batch-file.
  std::vector<GenRequest> reqs;
  if (!o.batch_file.empty()) {
    std::ifstream f(o.batch_file);
    if (!f) throw std::runtime_error("--batch-file " + o.batch_file + ": cannot open");
    std::string line;
    for (int64_t n = 1; std::getline(f, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = o.batch_file + ":" + std::to_string(n);
      json j;
      try {
        j = json::parse(line);
      } catch (const json::exception&) {
        throw std::invalid_argument(where + ": not a JSON object");
      }
      GenRequest r;
      r.max_new_tokens = o.max_new_tokens;
      if (j.contains("max_new_tokens")) {
        if (!j["max_new_tokens"].is_number_integer() || j["max_new_tokens"].get<int64_t>() < 0)
          throw std::invalid_argument(where + ": max_new_tokens must be an integer >= 0");
        r.max_new_tokens = j["max_new_tokens"].get<int64_t>();
      }
      if (j.contains("prompt") && j["prompt"].is_string()) {
        r.prompt = side.encode(j["prompt"].get<std::string>(), o.chat);
      } else if (j.contains("prompt_ids") && j["prompt_ids"].is_array() && !j["prompt_ids"].empty()) {
        for (const json& v : j["prompt_ids"]) {
          if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= cfg.vocab_size)
            throw std::invalid_argument(where + ": prompt_ids must be token ids in [0, " +
                                        std::to_string(cfg.vocab_size) + ")");
          r.prompt.push_back(v.get<int32_t>());
        }
      } else {
        throw std::invalid_argument(where + ": expected {\"prompt\": \"...\"} or {\"prompt_ids\": [...]}");
      }
      reqs.push_back(std::move(r));
    }
    if (reqs.empty()) throw std::invalid_argument("--batch-file " + o.batch_file + ": no prompts");
  } else {
    GenRequest r;
    r.max_new_tokens = o.max_new_tokens;
    r.prompt = o.prompt_ids.empty() ? side.encode(o.prompt, o.chat) : parse_prompt_ids(o.prompt_ids, cfg.vocab_size);
    reqs.push_back(std::move(r));
  }

  if (o.threads > 0) kernels::cpu::set_num_threads(o.threads);
  auto rt = kernels::make_runtime(kernels::parse_backend(o.backend));
  auto stream = rt->create_stream();
  const WeightPlacement pl = weight_placement(o.offload_params, o.nvme_paths, o.device_mem, o.host_mem);
  GenerateShape shape;
  shape.batch = static_cast<int64_t>(reqs.size());
  for (const GenRequest& r : reqs) {
    shape.max_prompt = std::max<int64_t>(shape.max_prompt, static_cast<int64_t>(r.prompt.size()));
    shape.capacity = std::max<int64_t>(shape.capacity, r.max_new_tokens);
  }
  shape.capacity += shape.max_prompt;
  Generator gen(cfg, kernels::parse_dtype(o.dtype), *rt, *stream, pl, shape);
  gen.load(*HfCheckpoint::open(dir), o.adapter);

  // Stops: each item's decoded text is checked as it grows; a single streamed prompt prints
  // what can no longer turn into a stop text, in whole UTF-8 characters.
  const bool stream_out = o.batch_file.empty() && !o.json_out;
  size_t hold = 0;
  for (const std::string& s : o.stops) hold = std::max(hold, s.size());
  std::vector<std::vector<int32_t>> so_far(reqs.size());
  std::vector<std::string> texts(reqs.size());
  size_t printed = 0;
  auto on_token = [&](size_t i, int32_t tok) {
    so_far[i].push_back(tok);
    if (o.stops.empty() && !stream_out) return true;
    std::string text = side.decode(so_far[i]);
    const size_t stop = find_stop(text, o.stops);
    if (stop != std::string::npos) text.resize(stop);
    if (stream_out) {
      size_t upto = stop != std::string::npos ? text.size() : complete_utf8(text);
      if (stop == std::string::npos && hold > 0) upto = std::min(upto, text.size() >= hold - 1 ? text.size() - (hold - 1) : 0);
      upto = complete_utf8(text.substr(0, upto));
      if (upto > printed) {
        std::fwrite(text.data() + printed, 1, upto - printed, stdout);
        std::fflush(stdout);
        printed = upto;
      }
    }
    texts[i] = text;
    return stop == std::string::npos;
  };
  GenTimes times;
  const std::vector<GenResult> res = generate(gen, reqs, sp, eos, on_token, &times);
  for (size_t i = 0; i < reqs.size(); ++i)
    if (res[i].finish != "stop") texts[i] = side.decode(res[i].ids);
  if (stream_out) {
    if (texts[0].size() > printed) std::fwrite(texts[0].data() + printed, 1, texts[0].size() - printed, stdout);
    std::printf("\n");
    return 0;
  }
  const double decode_tps = times.decode_ms > 0 ? static_cast<double>(times.decode_steps) / (times.decode_ms / 1e3) : 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    json j;
    j["ids"] = res[i].ids;
    j["text"] = texts[i];
    j["finish_reason"] = res[i].finish;
    j["prompt_tokens"] = reqs[i].prompt.size();
    j["prefill_ms"] = times.prefill_ms;
    j["decode_ms"] = times.decode_ms;
    j["decode_tokens_per_s"] = decode_tps;
    std::printf("%s\n", j.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  }
  return 0;
}

}  // namespace

WeightPlacement weight_placement(const std::string& offload_params, const std::vector<std::string>& nvme_paths,
                                 const std::string& device_mem, const std::string& host_mem) {
  WeightPlacement pl;
  pl.params = parse_offload(offload_params, "--offload-params");
  pl.nvme_paths = nvme_paths;
  if (!device_mem.empty()) pl.device_mem = offload::parse_size(device_mem);
  if (!host_mem.empty()) pl.host_mem = offload::parse_size(host_mem);
  return pl;
}

void register_generate(CLI::App& app, Run& run) {
  auto opts = std::make_shared<GenerateOptions>();
  GenerateOptions& o = *opts;
  CLI::App* cmd = app.add_subcommand("generate", "Sample text from a model (KV cache; batched with --batch-file)");
  cmd->option_defaults()->always_capture_default();
  cmd->add_option("--model", o.model, "HF model directory, strata train --out directory or training checkpoint");
  cmd->add_option("--adapter", o.adapter,
                  "a PEFT LoRA adapter (strata train --lora-rank --out DIR) merged into --model's weights as they load");
  cmd->add_option("--prompt", o.prompt, "prompt text (the model's tokenizer.json; bytes for a 256-token model)");
  cmd->add_flag("--chat", o.chat, "the prompt is a user message, rendered with the model's chat template");
  cmd->add_option("--prompt-ids", o.prompt_ids, "prompt as token ids, e.g. 1,2,3 (no tokenizer needed)");
  cmd->add_option("--batch-file", o.batch_file,
                  "JSONL of {\"prompt\": ...} or {\"prompt_ids\": [...]} (optional \"max_new_tokens\"): one batch, "
                  "one JSON line out per prompt, in order");
  cmd->add_option("--max-new-tokens", o.max_new_tokens, "tokens to generate at most");
  cmd->add_option("--temperature", o.temperature, "0 = greedy");
  cmd->add_option("--top-k", o.top_k, "keep the k most likely tokens (0 = off)");
  cmd->add_option("--top-p", o.top_p, "nucleus: keep the most likely tokens up to this mass, (0, 1]");
  cmd->add_option("--seed", o.seed, "sampling seed (same seed, same tokens)");
  cmd->add_option("--stop", o.stops, "stop when the text contains this (repeatable; not printed)");
  cmd->add_flag("--json", o.json_out, "print {ids, text, prompt_tokens, prefill_ms, decode_ms, decode_tokens_per_s}");
  cmd->add_option("--backend", o.backend, "cpu | cuda");
  cmd->add_option("--dtype", o.dtype, "working weights and activations: fp32 | bf16");
  cmd->add_option("--threads", o.threads, "CPU compute threads (0 = all available cores)");
  cmd->add_option("--offload-params", o.offload_params, "where the weights live: none | cpu | nvme");
  cmd->add_option("--nvme-path", o.nvme_paths, "directory for the NVMe swap file (with --offload-params nvme)");
  cmd->add_option("--device-mem", o.device_mem, "device memory budget, e.g. 8G (empty: what the placement needs)");
  cmd->add_option("--host-mem", o.host_mem, "pinned host memory budget (empty: what the placement needs)");
  cmd->callback([&run, opts] { run = [opts] { return run_generate(*opts); }; });
}

}  // namespace strata::app
