// `strata generate` end to end on a model saved by `strata train --out` (the embedded default,
// trained a few steps): --prompt-ids greedy, the --json shape, streaming = the JSON text, --stop,
// --chat with the byte-level fixture tokenizer (ChatML), --batch-file in input order, a
// training checkpoint as --model, and bad input as one clear line with a non-zero status.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/apps/cli_test_util.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace strata::test {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kBytes = fs::path(STRATA_SOURCE_DIR) / "tests/text/fixtures/tokenizers/bytes";

class GenerateCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new fs::path(make_scratch_dir("generate_cli"));
    const CliResult r = run_strata(*scratch_, "train --batch 4 --seq 64 --steps 20 --lr 3e-3 --warmup 5 --out " +
                                                  (*scratch_ / "model").string() + " --checkpoint-dir " +
                                                  (*scratch_ / "ckpt").string() + " --checkpoint-every 20");
    ASSERT_EQ(r.status, 0) << r.err;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*scratch_);
    delete scratch_;
  }
  static CliResult gen(const std::string& args) { return run_strata(*scratch_, "generate " + args); }
  static std::string model() { return (*scratch_ / "model").string(); }
  static fs::path* scratch_;
};
fs::path* GenerateCli::scratch_ = nullptr;

// One line of JSON (the last line of stdout).
json last_json(const std::string& out) {
  std::string s = out;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return json::parse(s.substr(s.rfind('\n') == std::string::npos ? 0 : s.rfind('\n') + 1));
}

TEST_F(GenerateCli, PromptIdsGreedyJsonAndStream) {
  const CliResult r = gen("--model " + model() + " --prompt-ids 84,104,101,32 --temperature 0 --max-new-tokens 12 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const json j = last_json(r.out);
  for (const char* k : {"ids", "text", "prompt_tokens", "prefill_ms", "decode_ms", "decode_tokens_per_s", "finish_reason"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["prompt_tokens"], 4);
  ASSERT_EQ(j["ids"].size(), 12u);  // the default model has no EOS: it runs to the limit
  EXPECT_EQ(j["finish_reason"], "length");
  std::string bytes;
  for (const json& id : j["ids"]) bytes += static_cast<char>(id.get<int>());
  EXPECT_EQ(j["text"], bytes);  // a 256-token model without tokenizer.json decodes bytes
  // Deterministic, and the same tokens as the --prompt text "The " streamed to stdout.
  EXPECT_EQ(last_json(gen("--model " + model() + " --prompt-ids 84,104,101,32 --temperature 0 --max-new-tokens 12 "
                          "--json").out)["ids"], j["ids"]);
  const CliResult s = gen("--model " + model() + " --prompt 'The ' --temperature 0 --max-new-tokens 12");
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_EQ(s.out, bytes + "\n");
}

TEST_F(GenerateCli, StopTextEndsTheOutput) {
  const std::string base = "--model " + model() + " --prompt-ids 84,104,101,32 --temperature 0 --max-new-tokens 16";
  const std::string full = last_json(gen(base + " --json").out)["text"];
  ASSERT_GE(full.size(), 4u);
  const std::string stop = full.substr(1, 3);
  const std::string want = full.substr(0, full.find(stop));
  std::ofstream(*scratch_ / "stop.txt") << stop;
  const std::string flag = " --stop \"$(cat " + (*scratch_ / "stop.txt").string() + ")\" --stop never-there";
  const json j = last_json(gen(base + flag + " --json").out);
  EXPECT_EQ(j["text"], want);
  EXPECT_EQ(j["finish_reason"], "stop");
  EXPECT_EQ(gen(base + flag).out, want + "\n");  // streamed: the stop text itself never printed
}

TEST_F(GenerateCli, ChatRendersTheTemplate) {
  const fs::path dir = *scratch_ / "chat_model";
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(*scratch_ / "model" / f, dir / f, fs::copy_options::overwrite_existing);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) fs::copy_file(kBytes / f, dir / f, fs::copy_options::overwrite_existing);
  const CliResult r = gen("--model " + dir.string() + " --chat --prompt hi --temperature 0 --max-new-tokens 5 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const text::ChatTemplate chat = text::ChatTemplate::from_model_dir(dir);
  const std::string rendered = chat.render(json::array({{{"role", "user"}, {"content", "hi"}}}), true);
  EXPECT_EQ(rendered, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  const auto ids = text::Tokenizer::from_file(dir / "tokenizer.json").encode(rendered, false);
  EXPECT_EQ(last_json(r.out)["prompt_tokens"], ids.size());
  // Without a template --chat is refused, naming what is missing.
  const CliResult no = gen("--model " + model() + " --chat --prompt hi");
  EXPECT_NE(no.status, 0);
  EXPECT_NE(no.err.find("chat template"), std::string::npos) << no.err;
}

TEST_F(GenerateCli, BatchFileInInputOrderEqualsAlone) {
  std::ofstream(*scratch_ / "prompts.jsonl") << "{\"prompt\": \"The \"}\n"
                                             << "{\"prompt_ids\": [65, 110, 100, 32, 116, 104, 101, 110], \"max_new_tokens\": 3}\n"
                                             << "{\"prompt\": \"In\"}\n";
  const CliResult r = gen("--model " + model() + " --batch-file " + (*scratch_ / "prompts.jsonl").string() +
                          " --temperature 0 --max-new-tokens 6");
  ASSERT_EQ(r.status, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::vector<json> got;
  while (std::getline(lines, line)) got.push_back(json::parse(line));
  ASSERT_EQ(got.size(), 3u);
  const char* alone[] = {"--prompt 'The '", "--prompt-ids 65,110,100,32,116,104,101,110",
                         "--prompt In"};
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(got[i]["ids"], last_json(gen("--model " + model() + " " + alone[i] + " --temperature 0 "
                                           "--max-new-tokens " + (i == 1 ? "3" : "6") + " --json").out)["ids"])
        << i;
  EXPECT_EQ(got[1]["ids"].size(), 3u);
}

TEST_F(GenerateCli, CheckpointLoadsAsModel) {
  const std::string args = " --prompt-ids 84,104 --temperature 0 --max-new-tokens 6 --json";
  const CliResult c = gen("--model " + (*scratch_ / "ckpt").string() + args);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_EQ(last_json(c.out)["ids"], last_json(gen("--model " + model() + args).out)["ids"]);
}

TEST_F(GenerateCli, OffloadedWeightsSameTokens) {
  const std::string args = " --prompt-ids 84,104 --temperature 0 --max-new-tokens 6 --json";
  const json want = last_json(gen("--model " + model() + args).out)["ids"];
  EXPECT_EQ(last_json(gen("--model " + model() + args + " --offload-params cpu").out)["ids"], want);
  const fs::path nv = *scratch_ / "nvme";
  fs::create_directories(nv);
  const CliResult r = gen("--model " + model() + args + " --offload-params nvme --nvme-path " + nv.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(last_json(r.out)["ids"], want);
}

TEST_F(GenerateCli, BadInputIsOneClearLine) {
  struct Case {
    std::string args, says;
  };
  const Case cases[] = {
      {"--model " + (*scratch_ / "missing").string() + " --prompt-ids 1", "no such directory"},
      {"--model " + model() + " --prompt-ids 1,x,3", "--prompt-ids '1,x,3'"},
      {"--model " + model() + " --prompt-ids 1,256", "outside the vocabulary"},
      {"--model " + model() + " --prompt-ids 1 --top-p 1.5", "--top-p"},
      {"--model " + model() + " --prompt-ids 1 --temperature -1", "--temperature"},
      {"--model " + model(), "give exactly one of --prompt, --prompt-ids, --batch-file"},
      {"--model " + model() + " --prompt-ids 1 --max-new-tokens 5000", "max_position_embeddings"},
  };
  for (const Case& c : cases) {
    const CliResult r = gen(c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

}  // namespace
}  // namespace strata::test
