// `strata data` and `strata tokenize` end to end through the built binary, with the `bytes`
// tokenizer (tests/text/fixtures/tokenizers/bytes: byte-level BPE whose ids fit the embedded
// 256-token model, a ChatML template): chat masks equal the reference's (Jinja2 + Hugging Face
// tokenizers, tests/apps/fixtures/conversations.expected.jsonl), output byte-identical for 1 and
// 2 threads and across runs, text shards train exactly like the same tokens as plain llm.c
// shards, held-out documents, instruction data with and without a template, and bad input
// (malformed JSON, bad UTF-8, unknown roles, a conversation without an assistant answer, an
// --out that holds a data set) as one clear line with a non-zero status and no shard written.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "src/data/doc_shards.h"
#include "src/data/token_shards.h"

namespace fs = std::filesystem;
using nlohmann::json;
using strata::test::run_strata;
using strata::test::slurp;

namespace {

const fs::path kSource = STRATA_SOURCE_DIR;
const fs::path kBytes = kSource / "tests/text/fixtures/tokenizers/bytes";
const fs::path kFixtures = kSource / "tests/apps/fixtures";

class DataCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = strata::test::make_scratch_dir("strata_data_cli");
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override { fs::remove_all(dir_); }
  strata::test::CliResult run(const std::string& args) { return run_strata(dir_, args); }
  fs::path write(const std::string& name, const std::string& contents) {
    std::ofstream(dir_ / name, std::ios::binary) << contents;
    return dir_ / name;
  }
  // A text corpus: documents of varied length and script, one per line.
  fs::path text_corpus(int docs) {
    std::string s;
    const char* parts[] = {"the cat sat on the mat. ", "Über straße — naïve café. ", "日本語のテキスト。", "  \t  code(x);\n",
                           "emoji 👩‍👩‍👧 and 12345678 digits. ", "it's what they're doing, isn't it? "};
    for (int d = 0; d < docs; ++d) {
      std::string t;
      for (int k = 0; k <= d % 7; ++k) t += parts[(d + k) % 6];
      s += json{{"text", t}}.dump() + "\n";
    }
    return write("corpus.jsonl", s);
  }
  fs::path dir_;
};

// Every file of a directory (name -> bytes), lock files aside.
std::map<std::string, std::string> files_of(const fs::path& d) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::directory_iterator(d)) m[e.path().filename().string()] = slurp(e.path());
  return m;
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> v;
  size_t a = 0;
  for (size_t b; (b = s.find('\n', a)) != std::string::npos; a = b + 1) v.push_back(s.substr(a, b - a));
  return v;
}

TEST_F(DataCli, ChatMasksEqualTheReference) {
  const auto r = run("tokenize --chat --tokenizer " + kBytes.string() + " " + (kFixtures / "conversations.jsonl").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const auto got = lines_of(r.out), want = lines_of(slurp(kFixtures / "conversations.expected.jsonl"));
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(json::parse(got[i]), json::parse(want[i])) << "conversation " << i;
}

TEST_F(DataCli, ChatShardsHoldTheRenderedIdsAndMasks) {
  const auto r = run("data --quiet --format chat --tokenizer " + kBytes.string() + " --in " +
                     (kFixtures / "conversations.jsonl").string() + " --out " + (dir_ / "out").string());
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<uint32_t> want_ids;
  std::vector<uint8_t> want_mask;
  std::vector<int64_t> want_off{0};
  for (const std::string& l : lines_of(slurp(kFixtures / "conversations.expected.jsonl"))) {
    const json j = json::parse(l);
    for (uint32_t id : j["ids"]) want_ids.push_back(id);
    for (uint8_t m : j["mask"]) want_mask.push_back(m);
    want_off.push_back(static_cast<int64_t>(want_ids.size()));
  }
  const fs::path shard = dir_ / "out" / "train_000000.bin";
  auto s = strata::TokenShard::open(shard);
  ASSERT_EQ(s->n_tokens(), static_cast<int64_t>(want_ids.size()));
  std::vector<uint32_t> ids(want_ids.size());
  s->read_tokens(0, s->n_tokens(), ids.data());
  EXPECT_EQ(ids, want_ids);
  EXPECT_EQ(s->token_bytes(), 2u);  // the vocabulary fits uint16: llm.c version 1
  EXPECT_EQ(strata::read_shard_mask(shard, s->n_tokens()), want_mask);
  EXPECT_EQ(strata::read_shard_docs(shard, s->n_tokens()), want_off);
  const json dj = json::parse(slurp(dir_ / "out" / "data.json"));
  EXPECT_EQ(dj["format"], "chat");
  EXPECT_EQ(dj["splits"]["train"]["documents"], 5);
  EXPECT_EQ(dj["tokenizer"]["vocab_size"], 256);
  EXPECT_EQ(dj["tokenizer"]["crc32c"].get<std::string>().size(), 8u);
  EXPECT_NE(dj["command"].get<std::string>().find("strata data"), std::string::npos);
}

TEST_F(DataCli, OutputIsByteIdenticalForAnyThreadCountAndAcrossRuns) {
  const fs::path corpus = text_corpus(3000);
  const std::string base = "data --quiet --tokenizer " + kBytes.string() + " --in " + corpus.string() +
                           " --val-docs 7 --shard-tokens 20000 --out ";
  ASSERT_EQ(run(base + (dir_ / "t1").string() + " --threads 1").status, 0);
  ASSERT_EQ(run(base + (dir_ / "t2").string() + " --threads 2").status, 0);
  ASSERT_EQ(run(base + (dir_ / "t2b").string() + " --threads 2").status, 0);
  auto a = files_of(dir_ / "t1"), b = files_of(dir_ / "t2"), c = files_of(dir_ / "t2b");
  // data.json records --out; everything else must be the same bytes
  for (auto* m : {&a, &b, &c}) m->erase("data.json");
  EXPECT_GT(a.size(), 6u);  // several train shards with sidecars, and val
  EXPECT_EQ(a, b);
  EXPECT_EQ(b, c);
  EXPECT_TRUE(a.count("val_000000.bin"));
  const json dj = json::parse(slurp(dir_ / "t1" / "data.json"));
  EXPECT_EQ(dj["splits"]["val"]["documents"], 7);
  EXPECT_EQ(dj["splits"]["train"]["documents"], 3000 - 7);
  EXPECT_EQ(dj["splits"]["train"]["trained_tokens"], dj["splits"]["train"]["tokens"]);  // text: every token
}

TEST_F(DataCli, TextDocumentsAreTheTokenizersIdsThenEos) {
  const fs::path in = write("one.jsonl", "{\"text\": \"the cat sat on the mat\"}\n");
  ASSERT_EQ(run("data --quiet --tokenizer " + kBytes.string() + " --in " + in.string() + " --out " + (dir_ / "o").string()).status, 0);
  auto s = strata::TokenShard::open(dir_ / "o" / "train_000000.bin");
  std::vector<uint32_t> ids(static_cast<size_t>(s->n_tokens()));
  s->read_tokens(0, s->n_tokens(), ids.data());
  // Hugging Face tokenizers: "the cat sat on the mat" -> these ids; then <|endoftext|> (243)
  EXPECT_EQ(ids, (std::vector<uint32_t>{116, 247, 32, 99, 255, 254, 255, 32, 252, 248, 32, 109, 255, 243}));
}

// The invariant: shards from `strata data --format text` train exactly like the same tokens in a
// plain llm.c shard (the sidecars change nothing for a reader of the token stream).
TEST_F(DataCli, TextShardsTrainLikePlainShards) {
  const fs::path corpus = text_corpus(400);
  ASSERT_EQ(run("data --quiet --tokenizer " + kBytes.string() + " --in " + corpus.string() + " --out " + (dir_ / "d").string()).status, 0);
  auto s = strata::TokenShard::open(dir_ / "d" / "train_000000.bin");
  std::vector<uint32_t> ids(static_cast<size_t>(s->n_tokens()));
  s->read_tokens(0, s->n_tokens(), ids.data());
  fs::create_directories(dir_ / "plain");
  strata::write_token_shard(dir_ / "plain" / "tokens.bin", ids, 1);
  strata::test::write_tiny_llama(dir_ / "tiny", 32, 2, 64);
  const std::string train = "train --model " + (dir_ / "tiny").string() + " --batch 2 --seq 32 --steps 4 --seed 3 --metrics ";
  auto losses = [&](const fs::path& m) {
    std::vector<std::string> v;
    static const std::regex loss(R"re("loss":([^,}]+))re");
    for (const std::string& l : lines_of(slurp(m))) {
      std::smatch sm;
      if (std::regex_search(l, sm, loss)) v.push_back(sm[1]);
    }
    return v;
  };
  // Without their sidecars (with them, rows are built from documents: test_sft_cli.cpp) the
  // shards are a plain llm.c stream.
  fs::remove(strata::shard_docs_path(dir_ / "d" / "train_000000.bin"));
  fs::remove(strata::shard_mask_path(dir_ / "d" / "train_000000.bin"));
  auto r1 = run(train + (dir_ / "m1.jsonl").string() + " --data '" + (dir_ / "d").string() + "/train_*.bin'");
  ASSERT_EQ(r1.status, 0) << r1.err;
  auto r2 = run(train + (dir_ / "m2.jsonl").string() + " --data " + (dir_ / "plain" / "tokens.bin").string());
  ASSERT_EQ(r2.status, 0) << r2.err;
  const auto a = losses(dir_ / "m1.jsonl"), b = losses(dir_ / "m2.jsonl");
  EXPECT_EQ(a.size(), 4u);
  EXPECT_EQ(a, b);
}

TEST_F(DataCli, InstructionsWithAndWithoutAChatTemplate) {
  // With the template: the answer and its <|im_end|> are trained, the prompt is not.
  auto r = run("data --quiet --json --format instruct --tokenizer " + kBytes.string() + " --in " +
               (kFixtures / "instructions.jsonl").string() + " --out " + (dir_ / "a").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const json sa = json::parse(r.out);
  EXPECT_EQ(sa["documents"], 3);
  EXPECT_GT(sa["trained_tokens"].get<int64_t>(), 0);
  EXPECT_LT(sa["trained_tokens"].get<int64_t>(), sa["tokens"].get<int64_t>());
  // Without: the Alpaca prompt, the answer and a trained EOS.
  fs::create_directories(dir_ / "plain_tok");
  fs::copy_file(kBytes / "tokenizer.json", dir_ / "plain_tok" / "tokenizer.json");
  write("plain_tok/tokenizer_config.json", R"({"eos_token": "<|endoftext|>"})");
  r = run("data --quiet --format instruct --tokenizer " + (dir_ / "plain_tok").string() + " --in " +
          (kFixtures / "instructions.jsonl").string() + " --out " + (dir_ / "b").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const fs::path shard = dir_ / "b" / "train_000000.bin";
  auto s = strata::TokenShard::open(shard);
  const auto mask = strata::read_shard_mask(shard, s->n_tokens());
  const auto off = strata::read_shard_docs(shard, s->n_tokens());
  ASSERT_EQ(off.size(), 4u);
  // document 0: "...### Response:\n" then "5" then EOS: the last two tokens trained, the rest not
  const int64_t end0 = off[1];
  EXPECT_EQ(s->token(end0 - 1), 243u);
  EXPECT_EQ(mask[static_cast<size_t>(end0 - 1)], 1);
  EXPECT_EQ(mask[static_cast<size_t>(end0 - 2)], 1);
  EXPECT_EQ(mask[static_cast<size_t>(end0 - 3)], 0);
  EXPECT_EQ(mask[0], 0);
  // --format chat on a tokenizer without a template is refused up front
  r = run("data --format chat --tokenizer " + (dir_ / "plain_tok").string() + " --in " +
          (kFixtures / "conversations.jsonl").string() + " --out " + (dir_ / "c").string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("chat template"), std::string::npos) << r.err;
}

TEST_F(DataCli, BadInputIsOneClearLineAndNoShard) {
  struct Case {
    const char* name;
    std::string contents;
    const char* format;
    std::vector<const char*> needles;
  };
  const std::string good = R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})";
  const std::vector<Case> cases = {
      {"malformed.jsonl", good + "\n{\"messages\": [\n", "chat", {"malformed.jsonl:2", "not valid JSON"}},
      {"role.jsonl", good + "\n" + R"({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]})" + "\n",
       "chat", {"role.jsonl:2", "wizard"}},
      {"noanswer.jsonl", R"({"messages": [{"role": "user", "content": "hi"}]})" "\n", "chat", {"noanswer.jsonl:1", "assistant"}},
      {"utf8.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"bad \xff byte\"}\n", "text", {"utf8.jsonl:2", "UTF-8"}},
      {"field.jsonl", "{\"txt\": \"wrong field\"}\n", "text", {"field.jsonl:1", "\"text\""}},
      {"instr.jsonl", "{\"instruction\": \"x\"}\n", "instruct", {"instr.jsonl:1", "\"output\""}},
      {"empty.jsonl", "", "text", {"no documents"}},
  };
  for (const Case& c : cases) {
    const fs::path in = write(c.name, c.contents);
    const fs::path out = dir_ / (std::string("out_") + c.name);
    const auto r = run(std::string("data --quiet --format ") + c.format + " --tokenizer " + kBytes.string() + " --in " +
                       in.string() + " --out " + out.string());
    EXPECT_NE(r.status, 0) << c.name;
    for (const char* n : c.needles) EXPECT_NE(r.err.find(n), std::string::npos) << c.name << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    if (fs::exists(out))
      for (const auto& e : fs::directory_iterator(out)) ADD_FAILURE() << c.name << " left " << e.path();
  }
  // --skip-bad: counted, reported, the rest written
  const fs::path in = write("mixed.jsonl", good + "\n{oops\n" + good + "\n");
  const auto r = run("data --json --format chat --skip-bad --tokenizer " + kBytes.string() + " --in " + in.string() +
                     " --out " + (dir_ / "skip").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const json s = json::parse(r.out);
  EXPECT_EQ(s["documents"], 2);
  EXPECT_EQ(s["skipped_bad"], 1);
}

TEST_F(DataCli, AnOutputDirectoryThatHoldsADataSetIsNeverOverwritten) {
  const fs::path corpus = text_corpus(20);
  const std::string cmd = "data --quiet --tokenizer " + kBytes.string() + " --in " + corpus.string() + " --out " + (dir_ / "o").string();
  ASSERT_EQ(run(cmd).status, 0);
  const auto before = files_of(dir_ / "o");
  const auto r = run(cmd);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("already holds a data set"), std::string::npos) << r.err;
  EXPECT_EQ(files_of(dir_ / "o"), before);
  // an unknown input type and a missing tokenizer are named
  auto r2 = run("data --tokenizer " + kBytes.string() + " --in " + (kBytes / "make_bytes_tokenizer.py").string() + " --out " + (dir_ / "p").string());
  EXPECT_NE(r2.err.find("unknown input type"), std::string::npos) << r2.err;
  r2 = run("data --tokenizer " + (dir_ / "nope").string() + " --in " + corpus.string() + " --out " + (dir_ / "p").string());
  EXPECT_NE(r2.err.find("no such file"), std::string::npos) << r2.err;
}

TEST_F(DataCli, TokenizeEncodesAndDecodes) {
  const fs::path in = write("t.jsonl", "{\"text\": \"the cat sat on the mat<|endoftext|>\"}\n");
  auto r = run("tokenize --tokenizer " + kBytes.string() + " " + in.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["ids"], json::parse("[116,247,32,99,255,254,255,32,252,248,32,109,255,243]"));
  const fs::path ids = write("ids.jsonl", r.out);
  r = run("tokenize --decode --tokenizer " + kBytes.string() + " " + ids.string());
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["text"], "the cat sat on the mat<|endoftext|>");
  r = run("tokenize --decode --skip-special --tokenizer " + kBytes.string() + " " + ids.string());
  EXPECT_EQ(json::parse(r.out)["text"], "the cat sat on the mat");
  const fs::path bad = write("bad.jsonl", "{\"ids\": [1, 999]}\n");
  r = run("tokenize --decode --tokenizer " + kBytes.string() + " " + bad.string());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("bad.jsonl:1"), std::string::npos) << r.err;
}

}  // namespace

namespace {

// SIGTERM in the middle of a run: it stops at its next batch, removes the shards it had already
// completed, and exits 128 + 15; --out holds nothing a later `strata train` could read.
TEST_F(DataCli, ASignalMidRunRemovesEveryShardOfTheRun) {
  std::string corpus;
  const std::string line = json{{"text", std::string(2000, 'a') + " the cat sat on the mat"}}.dump() + "\n";
  while (corpus.size() < (48u << 20)) corpus += line;
  const fs::path in = write("big.jsonl", corpus);
  const fs::path out = dir_ / "out";
  const std::string cmd = std::string("exec ") + STRATA_BIN + " data --quiet --threads 1 --shard-tokens 200000 --tokenizer " +
                          kBytes.string() + " --in " + in.string() + " --out " + out.string() + " 2>" +
                          (dir_ / "err").string();
  FILE* p = ::popen((cmd + " & echo $!").c_str(), "r");
  ASSERT_NE(p, nullptr);
  long pid = 0;
  ASSERT_EQ(std::fscanf(p, "%ld", &pid), 1);
  // wait for the first complete shard, then stop the run
  bool seen = false;
  for (int i = 0; i < 600 && !seen; ++i) {
    seen = fs::exists(out / "train_000000.bin");
    if (!seen) ::usleep(10000);
  }
  ASSERT_TRUE(seen) << "no shard appeared";
  ::kill(static_cast<pid_t>(pid), SIGTERM);
  for (int i = 0; i < 1000 && ::kill(static_cast<pid_t>(pid), 0) == 0; ++i) ::usleep(10000);
  ::pclose(p);
  const std::string err = slurp(dir_ / "err");
  if (fs::exists(out / "data.json")) GTEST_SKIP() << "the run finished before the signal";
  EXPECT_NE(err.find("stopped by signal 15"), std::string::npos) << err;
  for (const auto& e : fs::directory_iterator(out)) ADD_FAILURE() << "left " << e.path();
}

}  // namespace
