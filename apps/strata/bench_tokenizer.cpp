// `strata bench tokenizer`: encode throughput of a model's tokenizer.json on a JSONL of
// {"text": ...} documents held in memory (reading and JSON parsing are not timed), one JSON line:
// documents, bytes, tokens, seconds (median of --reps), MB/s. bench/text/compare_tokenizers.sh
// runs it side by side with Hugging Face's Rust tokenizers on the same file.
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/strata/commands.h"
#include "src/data/prepare.h"
#include "text/gzip_file.h"
#include "text/tokenizer.h"

namespace strata::app {
namespace {

struct BenchTokenizerOptions {
  std::string tokenizer, in;
  int threads = 1, reps = 3;
  bool add_special = false, chat = false;
};

int run_bench_tokenizer(const BenchTokenizerOptions& o) {
  if (o.reps < 1) throw std::invalid_argument("bench tokenizer --reps must be at least 1");
  const TextModel m = load_text_model(o.tokenizer);
  const std::filesystem::path& json_path = m.tokenizer_json;
  const text::Tokenizer& tok = m.tokenizer;
  std::vector<std::string> docs;
  uint64_t bytes = 0;
  text::LineReader r(o.in);
  std::string line;
  while (r.next(line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    // --chat: the conversation's rendering (untimed), the text `strata data --format chat` tokenizes
    docs.push_back(o.chat ? m.chat.render(text::conversation_messages(j), false) : j.at("text").get<std::string>());
    bytes += docs.back().size();
  }
  if (docs.empty()) throw std::runtime_error(o.in + ": no {\"text\": ...} lines");
  std::vector<std::string_view> views(docs.begin(), docs.end());
  uint64_t tokens = 0;
  auto once = [&] {
    tokens = 0;
    if (o.threads == 1) {
      for (std::string_view d : views) tokens += tok.encode(d, o.add_special).size();
    } else {
      for (const auto& ids : tok.encode_batch(views, o.add_special, o.threads)) tokens += ids.size();
    }
  };
  once();  // warm-up: caches, page faults
  std::vector<double> secs;
  for (int i = 0; i < o.reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    once();
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double s = median(secs);
  const nlohmann::json out = {{"impl", "strata"}, {"tokenizer", json_path.string()}, {"threads", o.threads},
                              {"docs", docs.size()}, {"bytes", bytes}, {"tokens", tokens}, {"seconds", s},
                              {"mb_per_s", static_cast<double>(bytes) / 1e6 / s}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

void register_bench_tokenizer(CLI::App& bench, Run& run) {
  auto o = std::make_shared<BenchTokenizerOptions>();
  CLI::App* cmd = bench.add_subcommand("tokenizer", "Encode throughput of a tokenizer.json on a JSONL of {\"text\"} documents");
  cmd->option_defaults()->always_capture_default();
  cmd->add_option("--tokenizer", o->tokenizer, "model directory holding tokenizer.json, or the file")->required();
  cmd->add_option("--in", o->in, "JSONL (or .jsonl.gz) of {\"text\": ...} documents")->required();
  cmd->add_option("--threads", o->threads, "1 = one thread, encode per document; N = encode_batch on N threads");
  cmd->add_option("--reps", o->reps, "timed passes (the median is printed)");
  cmd->add_flag("--add-special", o->add_special, "apply the post-processor");
  cmd->add_flag("--chat", o->chat,
                "the lines are conversations: time the encoding of their chat-template renderings (rendered untimed)");
  cmd->callback([o, &run] { run = [o] { return run_bench_tokenizer(*o); }; });
}

}  // namespace strata::app
