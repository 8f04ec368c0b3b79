// `strata data` (text, conversations or instructions -> token shards with loss masks) and
// `strata tokenize` (a tokenizer and chat template checked on a few documents, JSON lines).
#include <unistd.h>

#include <cstdio>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "apps/strata/commands.h"
#include "src/data/prepare.h"
#include "src/train/run_guard.h"
#include "src/train/stop_signal.h"
#include "text/gzip_file.h"

namespace strata::app {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct DataArgs {
  std::string tokenizer, format = "text", out, eos;
  std::vector<std::string> inputs;
  int64_t val_docs = 0, shard_tokens = 100'000'000;
  int threads = 0;
  bool skip_bad = false, json_out = false, quiet = false;
};

std::string human_count(double v) {
  if (v >= 1e9) return fmt::format("{:.2f}G", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

std::string clock_text(double s) {
  const long t = static_cast<long>(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60) : fmt::format("{}:{:02}", t / 60, t % 60);
}

// The progress bar on a terminal (stderr): fraction of input bytes, MB/s, documents, tokens, ETA.
void draw_progress(const PrepareProgress& p) {
  const double frac = p.input_bytes_total ? static_cast<double>(p.input_bytes_done) / static_cast<double>(p.input_bytes_total) : 0;
  const int width = 24, filled = static_cast<int>(frac * width);
  std::string bar(static_cast<size_t>(filled), '=');
  if (filled < width) bar += '>', bar += std::string(static_cast<size_t>(width - filled - 1), ' ');
  const double mbs = p.seconds > 0 ? static_cast<double>(p.input_bytes_done) / 1e6 / p.seconds : 0;
  const double eta = frac > 0 ? p.seconds * (1 - frac) / frac : 0;
  std::fprintf(stderr, "\r[%s] %3.0f%%  %.1f MB/s  %s docs  %s tokens  ETA %s   ", bar.c_str(), frac * 100, mbs,
               human_count(static_cast<double>(p.documents)).c_str(), human_count(static_cast<double>(p.tokens)).c_str(),
               clock_text(eta).c_str());
  std::fflush(stderr);
}

// The command recorded in data.json: what defines the output (not --threads, --json, --quiet),
// so two runs that write the same bytes record the same command.
std::string recorded_command(const DataArgs& a) {
  std::string c = "strata data --tokenizer " + shell_quote(a.tokenizer);
  for (const std::string& i : a.inputs) c += " --in " + shell_quote(i);
  c += " --format " + a.format + " --out " + shell_quote(a.out);
  if (a.val_docs) c += " --val-docs " + std::to_string(a.val_docs);
  c += " --shard-tokens " + std::to_string(a.shard_tokens);
  if (a.skip_bad) c += " --skip-bad";
  if (!a.eos.empty()) c += " --eos " + shell_quote(a.eos);
  return c;
}

int run_data(const DataArgs& a) {
  PrepareOptions o;
  o.tokenizer = a.tokenizer;
  o.inputs = a.inputs;
  o.format = parse_data_format(a.format);
  o.out = a.out;
  o.val_docs = a.val_docs;
  o.shard_tokens = a.shard_tokens;
  o.threads = a.threads;
  o.skip_bad = a.skip_bad;
  o.eos = a.eos;
  o.command = recorded_command(a);
  install_stop_handlers();  // Ctrl-C: the pipeline stops at its next batch and removes its shards
  const bool bar = !a.quiet && !a.json_out && ::isatty(STDERR_FILENO);
  bool drawn = false;
  PrepareSummary s;
  try {
    s = prepare_dataset(o, bar ? std::function<void(const PrepareProgress&)>([&](const PrepareProgress& p) {
      draw_progress(p);
      drawn = true;
    })
                               : nullptr);
  } catch (const PrepareInterrupted& e) {
    if (drawn) std::fputc('\n', stderr);
    std::fprintf(stderr, "strata data: %s\n", e.what());
    return 128 + e.signal;
  } catch (...) {
    if (drawn) std::fputc('\n', stderr);
    throw;
  }
  if (drawn) std::fputc('\n', stderr);
  const int64_t docs = s.train.documents + s.val.documents, tokens = s.train.tokens + s.val.tokens;
  const int64_t trained = s.train.trained_tokens + s.val.trained_tokens;
  const double mbs = s.seconds > 0 ? static_cast<double>(s.input_bytes) / 1e6 / s.seconds : 0;
  if (a.json_out) {
    json j = {{"documents", docs},
              {"tokens", tokens},
              {"trained_tokens", trained},
              {"trained_fraction", tokens ? static_cast<double>(trained) / static_cast<double>(tokens) : 0.0},
              {"train", {{"documents", s.train.documents}, {"tokens", s.train.tokens}, {"shards", s.train.shards}}},
              {"val", {{"documents", s.val.documents}, {"tokens", s.val.tokens}, {"shards", s.val.shards}}},
              {"longest_document", s.longest_document},
              {"skipped_bad", s.skipped_bad},
              {"skipped_empty", s.skipped_empty},
              {"input_bytes", s.input_bytes},
              {"seconds", s.seconds},
              {"input_mb_per_s", mbs},
              {"out", a.out}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    for (const std::string& e : s.bad_examples) std::fprintf(stderr, "skipped: %s\n", e.c_str());
    std::printf("strata data: %lld documents (%lld held out), %lld tokens, %.1f%% trained, longest %lld tokens, "
                "%zu shard(s) in %s, %.1f s (%.1f MB/s)%s%s\n",
                static_cast<long long>(docs), static_cast<long long>(s.val.documents), static_cast<long long>(tokens),
                tokens ? 100.0 * static_cast<double>(trained) / static_cast<double>(tokens) : 0.0,
                static_cast<long long>(s.longest_document), s.train.shards.size() + s.val.shards.size(), a.out.c_str(),
                s.seconds, mbs,
                s.skipped_bad ? fmt::format(", {} malformed record(s) skipped", s.skipped_bad).c_str() : "",
                s.skipped_empty ? fmt::format(", {} empty document(s) skipped", s.skipped_empty).c_str() : "");
  }
  return 0;
}

struct TokenizeArgs {
  std::string tokenizer, eos;
  std::vector<std::string> files;
  bool add_special = false, decode = false, skip_special = false, chat = false;
};

// One JSON line, with invalid UTF-8 (a decode that ends inside a character) shown as U+FFFD.
void print_json_line(const json& j) {
  std::printf("%s\n", j.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
}

int run_tokenize(const TokenizeArgs& a) {
  const TextModel m = load_text_model(a.tokenizer, a.eos);
  if (a.chat && !m.chat.has_template())
    throw std::runtime_error("--chat: " + a.tokenizer + " has no chat template (tokenizer_config.json)");
  for (const std::string& f : a.files) {
    const fs::path path = f;
    const bool whole = input_is_whole_document(path);
    text::LineReader r(path);
    if (whole) {
      if (a.decode || a.chat) throw std::runtime_error(f + ": --decode and --chat read .jsonl files");
      const std::string t = r.read_rest();
      print_json_line(json{{"ids", m.tokenizer.encode(t, a.add_special)}});
      continue;
    }
    std::string line;
    while (r.next(line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string at = f + ":" + std::to_string(r.line_number()) + ": ";
      json j;
      try {
        j = json::parse(line);
      } catch (const json::parse_error& e) {
        throw std::runtime_error(at + "not valid JSON: " + e.what());
      }
      if (!j.is_object()) throw std::runtime_error(at + "the line is not a JSON object");
      try {
        if (a.decode) {
          auto it = j.find("ids");
          if (it == j.end() || !it->is_array()) throw std::invalid_argument("no \"ids\" array");
          std::vector<uint32_t> ids;
          for (const json& v : *it) {
            if (!v.is_number_unsigned() || v.get<uint64_t>() >= m.tokenizer.vocab_size())
              throw std::invalid_argument("\"ids\" holds " + v.dump() + ", not a token id below the vocabulary size " +
                                          std::to_string(m.tokenizer.vocab_size()));
            ids.push_back(v.get<uint32_t>());
          }
          print_json_line(json{{"text", m.tokenizer.decode(ids, a.skip_special)}});
        } else if (a.chat) {
          const Document d = make_document(m, DataFormat::chat, &j, {}, true);
          print_json_line(json{{"text", d.text}, {"ids", d.ids}, {"mask", d.mask}});
        } else {
          auto it = j.find("text");
          if (it == j.end() || !it->is_string()) throw std::invalid_argument("no \"text\" string field");
          print_json_line(json{{"ids", m.tokenizer.encode(it->get_ref<const std::string&>(), a.add_special)}});
        }
      } catch (const std::invalid_argument& e) {
        throw std::runtime_error(at + e.what());
      }
    }
  }
  return 0;
}

}  // namespace

void register_data(CLI::App& app, Run& run) {
  auto a = std::make_shared<DataArgs>();
  CLI::App* cmd = app.add_subcommand(
      "data", "Prepare a data set: text, conversations or instructions -> token shards with loss masks (llm.c format)");
  cmd->option_defaults()->always_capture_default();
  cmd->add_option("--tokenizer", a->tokenizer, "model directory holding tokenizer.json (and tokenizer_config.json)")
      ->required();
  cmd->add_option("--in", a->inputs,
                  "input file or glob (repeat): .txt/.md = one document per file, .jsonl = one per line; .gz of either")
      ->required();
  cmd->add_option("--format", a->format,
                  "text (a \"text\" field) | chat (\"messages\" role/content, or ShareGPT \"conversations\" from/value) "
                  "| instruct (\"instruction\", \"input\", \"output\")");
  cmd->add_option("--out", a->out, "output directory: train_*.bin (+ .mask, .docs), val_*.bin, data.json")->required();
  cmd->add_option("--val-docs", a->val_docs, "hold out the first N documents as val_*.bin");
  cmd->add_option("--shard-tokens", a->shard_tokens, "tokens per shard at most (a longer document gets its own)");
  cmd->add_option("--threads", a->threads, "tokenizer threads (0 = all cores); the output is the same for any count");
  cmd->add_option("--eos", a->eos, "the end-of-text token, instead of tokenizer_config.json's eos_token");
  cmd->add_flag("--skip-bad", a->skip_bad, "count and report malformed records instead of stopping at the first");
  cmd->add_flag("--json", a->json_out, "print the summary as one JSON object (no progress bar)");
  cmd->add_flag("--quiet", a->quiet, "no progress bar");
  cmd->callback([a, &run] { run = [a] { return run_data(*a); }; });
}

void register_tokenize(CLI::App& app, Run& run) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "Tokenize, decode or render conversations with a model's tokenizer (JSON lines on stdout)");
  cmd->add_option("--tokenizer", a->tokenizer, "model directory holding tokenizer.json (and tokenizer_config.json)")
      ->required();
  cmd->add_option("files", a->files,
                  ".txt/.md (one document) or .jsonl ({\"text\"}, with --decode {\"ids\"}, with --chat a conversation)")
      ->required();
  cmd->add_flag("--add-special", a->add_special, "apply the post-processor (BOS/EOS as the tokenizer adds them)");
  cmd->add_flag("--decode", a->decode, "read {\"ids\": [...]} lines and print {\"text\": ...}");
  cmd->add_flag("--skip-special", a->skip_special, "with --decode: leave special tokens out");
  cmd->add_flag("--chat", a->chat,
                "read conversations and print {\"text\": rendered, \"ids\": [...], \"mask\": [...]} (1 = trained)");
  cmd->add_option("--eos", a->eos, "the end-of-text token, instead of tokenizer_config.json's eos_token");
  cmd->get_option("--decode")->excludes(cmd->get_option("--chat"));
  cmd->callback([a, &run] { run = [a] { return run_tokenize(*a); }; });
}

}  // namespace strata::app
