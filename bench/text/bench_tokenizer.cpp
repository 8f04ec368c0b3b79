// Encode throughput of strata's tokenizer per family (one thread, and encode_batch on all cores),
// on the fixture corpus or $STRATA_BENCH_CORPUS (a .jsonl[.gz] of {"text": ...}). Compare with
// bench/text/rust_tokenizers.js (Hugging Face's Rust library) on the same input.
//   build/bin/bench_tokenizer --benchmark_filter=OneThread
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "text/gzip_file.h"
#include "tests/text/text_fixtures.h"
#include "text/tokenizer.h"

namespace fs = std::filesystem;
using strata::text::Tokenizer;

namespace {

const fs::path kFixtures = strata::test::kTextFixtures;
using strata::test::read_json;
using strata::test::tokenizer_json;

const std::vector<std::string>& docs() {
  static const std::vector<std::string> d = [] {
    const char* env = std::getenv("STRATA_BENCH_CORPUS");
    const fs::path p = env ? fs::path(env) : kFixtures / "corpus/mixed.jsonl.gz";
    strata::text::LineReader r(p);
    std::vector<std::string> out;
    std::string line;
    while (r.next(line)) {
      if (!line.empty()) out.push_back(nlohmann::json::parse(line).at("text").get<std::string>());
    }
    return out;
  }();
  return d;
}

const Tokenizer& tokenizer(const std::string& name) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, Tokenizer::from_json(tokenizer_json(name), name)).first;
  return it->second;
}

void OneThread(benchmark::State& state, std::string name) {
  const Tokenizer& t = tokenizer(name);
  const auto& d = docs();
  size_t bytes = 0, tokens = 0;
  for (const auto& s : d) bytes += s.size();
  for (auto _ : state) {
    tokens = 0;
    for (const auto& s : d) tokens += t.encode(s).size();
    benchmark::DoNotOptimize(tokens);
  }
  state.SetBytesProcessed(int64_t(state.iterations() * bytes));
  state.counters["tokens"] = double(tokens);
}

void AllCores(benchmark::State& state, std::string name) {
  const Tokenizer& t = tokenizer(name);
  const auto& d = docs();
  std::vector<std::string_view> views(d.begin(), d.end());
  size_t bytes = 0;
  for (const auto& s : d) bytes += s.size();
  for (auto _ : state) benchmark::DoNotOptimize(t.encode_batch(views, false, 0));
  state.SetBytesProcessed(int64_t(state.iterations() * bytes));
}

const int registered = [] {
  for (const char* name : {"llama3", "llama3_1", "qwen3", "deepseek_v3", "gpt4o", "llama2", "gemma3", "gpt2style",
                           "digits", "nfkc", "metaspace", "llama3_nomerge"}) {
    benchmark::RegisterBenchmark((std::string("OneThread/") + name).c_str(), OneThread, std::string(name))
        ->Unit(benchmark::kMillisecond)->UseRealTime();
    benchmark::RegisterBenchmark((std::string("AllCores/") + name).c_str(), AllCores, std::string(name))
        ->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  return 0;
}();

}  // namespace
