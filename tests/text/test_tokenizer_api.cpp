// Tokenizer beyond the fixtures: refusals (unsupported components, malformed files), added-token
// options against ids taken from the Rust library, batches across thread counts, byte-level round
// trips on random text, the two BPE merge loops, and the small API.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "text/gzip_file.h"
#include "text/tokenizer.h"
#include "text/tokenizer_bpe.h"
#include "text/tokenizer_unicode.h"

namespace fs = std::filesystem;
using nlohmann::json;
using strata::text::Tokenizer;

namespace {

const fs::path kTok = fs::path(STRATA_SOURCE_DIR) / "tests/text/fixtures/tokenizers";

json tiny() {
  return json::parse(R"({"version":"1.0","added_tokens":[],"normalizer":null,"pre_tokenizer":null,
    "post_processor":null,"decoder":null,
    "model":{"type":"BPE","dropout":null,"unk_token":null,"vocab":{"a":0,"b":1,"ab":2,"c":3},"merges":["a b"]}})");
}

// from_json must throw a runtime_error whose message has every one of `parts`.
void expect_error(const json& j, std::initializer_list<std::string> parts) {
  try {
    Tokenizer::from_json(j, "tiny.json");
    ADD_FAILURE() << "no error for " << j.dump();
  } catch (const std::runtime_error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

TEST(TokenizerErrors, UnsupportedComponentsAreNamed) {
  json j = tiny();
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_error(j, {"tiny.json: pre_tokenizer type 'Whitespace' is not supported"});
  j = tiny();
  j["normalizer"] = {{"type", "BertNormalizer"}};
  expect_error(j, {"normalizer", "BertNormalizer"});
  j = tiny();
  j["normalizer"] = json::parse(R"({"type":"Sequence","normalizers":[{"type":"NFC"},{"type":"Precompiled"}]})");
  expect_error(j, {"normalizer[1]", "Precompiled"});
  j = tiny();
  j["decoder"] = {{"type", "WordPiece"}};
  expect_error(j, {"decoder", "WordPiece"});
  j = tiny();
  j["post_processor"] = {{"type", "Foo"}};
  expect_error(j, {"post_processor", "Foo"});
  j = tiny();
  j["model"]["type"] = "Unigram";
  expect_error(j, {"model type", "Unigram"});
  j = tiny();
  j["model"]["type"] = "WordPiece";
  expect_error(j, {"WordPiece", "only BPE"});
  j = tiny();
  j["model"]["dropout"] = 0.1;
  expect_error(j, {"dropout"});
  j = tiny();
  j["model"]["continuing_subword_prefix"] = "##";
  expect_error(j, {"continuing_subword_prefix", "##"});
  j = tiny();
  j["model"]["end_of_word_suffix"] = "</w>";
  expect_error(j, {"end_of_word_suffix"});
  j = tiny();
  j["pre_tokenizer"] = json::parse(R"({"type":"Split","pattern":{"String":" "},"behavior":"Sideways","invert":false})");
  expect_error(j, {"behavior", "Sideways"});
  j = tiny();
  j["pre_tokenizer"] = json::parse(R"({"type":"Sequence","pretokenizers":[{"type":"ByteLevel"},{"type":"Digits"}]})");
  expect_error(j, {"after ByteLevel", "Digits"});
  j = tiny();
  j["pre_tokenizer"] = json::parse(R"({"type":"Split","pattern":{"Regex":"(unclosed"},"behavior":"Isolated","invert":false})");
  expect_error(j, {"pre_tokenizer", "(unclosed", "does not compile"});
  j = tiny();
  j["post_processor"] = json::parse(R"({"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"special_tokens":{}})");
  expect_error(j, {"post_processor", "<s>"});
  // Zero dropout is deterministic: accepted.
  j = tiny();
  j["model"]["dropout"] = 0.0;
  EXPECT_NO_THROW(Tokenizer::from_json(j, "tiny.json"));
}

TEST(TokenizerErrors, MalformedFilesAreRefused) {
  EXPECT_THROW(Tokenizer::from_json(std::string_view("{\"model\": "), "bad.json"), std::runtime_error);
  try {
    Tokenizer::from_json(std::string_view("{not json"), "bad.json");
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json: not valid JSON"), std::string::npos) << e.what();
  }
  expect_error(json::array(), {"top level"});
  json j = tiny();
  j.erase("model");
  expect_error(j, {"'model' is missing"});
  j = tiny();
  j["model"].erase("vocab");
  expect_error(j, {"vocab"});
  j = tiny();
  j["model"]["merges"] = {"a x"};
  expect_error(j, {"merge 1", "'x'", "not in the vocab"});
  j = tiny();
  j["model"]["merges"] = {"b c"};  // "bc" is not a token
  expect_error(j, {"merge 1", "'bc'"});
  j = tiny();
  j["model"]["merges"] = {"a b c"};
  expect_error(j, {"merge 1", "two tokens"});
  j = tiny();
  j["model"]["merges"] = json::parse(R"(["a b", ["a", "b"]])");
  expect_error(j, {"mixes"});
  j = tiny();
  j["model"]["vocab"]["d"] = 1;  // id of "b"
  expect_error(j, {"id 1", "'b'", "'d'"});
  j = tiny();
  j["model"]["vocab"]["d"] = -4;
  expect_error(j, {"'d'", "-4"});
  j = tiny();
  j["added_tokens"] = json::parse(R"([{"id":9,"content":"<x>","special":true}])");  // Rust gives it 4
  expect_error(j, {"added_tokens[0]", "<x>", "assigns it 4"});
  j = tiny();
  j["added_tokens"] = json::parse(R"([{"id":4,"content":"<x>","special":true},{"id":4,"content":"<y>","special":true}])");
  expect_error(j, {"added_tokens[1]", "<y>"});
  EXPECT_THROW(Tokenizer::from_file("/nonexistent/tokenizer.json"), std::runtime_error);
  // A tokenizer that loads but names an unk_token outside its vocab fails when one is needed.
  j = tiny();
  j["model"]["unk_token"] = "<unk>";
  const Tokenizer t = Tokenizer::from_json(j, "tiny.json");
  EXPECT_EQ(t.encode("ab"), (std::vector<uint32_t>{2}));
  EXPECT_THROW(t.encode("abz"), std::runtime_error);
  EXPECT_THROW(t.encode(std::string_view("a\xff", 2)), std::invalid_argument);
  // Text that is not UTF-8 (what `strata data` reports as file:line): overlongs, a surrogate,
  // past U+10FFFF, a truncated sequence; the message names the byte.
  for (const char* bad : {"\xC0\xAF", "\xE0\x80\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80", "ab\xC3"}) {
    try {
      (void)t.encode(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("not valid UTF-8 at byte"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(t.encode("ab"), (std::vector<uint32_t>{2}));  // valid text still encodes
}

// Ids from the Rust library (@anush008/tokenizers 0.6.0, tokenizers 0.22) for a tokenizer with
// lstrip / rstrip / single_word / normalized added tokens, a Lowercase normalizer, Split on " "
// MergedWithNext and a template that wraps the sequence in <sep> ... <mask>.
TEST(TokenizerAdded, OptionsMatchRust) {
  json vocab = json::object();
  for (char c : std::string("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ<>!.,\t\n")) {
    vocab[std::string(1, c)] = vocab.size();
  }
  for (const char* t : {"th", "the", "an", "and"}) vocab[t] = vocab.size();
  json j = tiny();
  j["model"]["vocab"] = vocab;
  j["model"]["merges"] = {"t h", "th e", "a n", "an d"};
  j["normalizer"] = {{"type", "Lowercase"}};
  j["pre_tokenizer"] = json::parse(R"({"type":"Split","pattern":{"String":" "},"behavior":"MergedWithNext","invert":false})");
  j["added_tokens"] = json::parse(R"([
    {"id":64,"content":"<mask>","single_word":true,"lstrip":true,"rstrip":true,"normalized":false,"special":true},
    {"id":65,"content":"<sep>","single_word":false,"lstrip":false,"rstrip":true,"normalized":false,"special":true},
    {"id":66,"content":"HeLLo","single_word":false,"lstrip":false,"rstrip":false,"normalized":true,"special":false},
    {"id":67,"content":"<l>","single_word":false,"lstrip":true,"rstrip":false,"normalized":false,"special":false}])");
  j["post_processor"] = json::parse(R"({"type":"TemplateProcessing",
    "single":[{"SpecialToken":{"id":"<sep>","type_id":0}},{"Sequence":{"id":"A","type_id":0}},{"SpecialToken":{"id":"<mask>","type_id":0}}],
    "pair":[],"special_tokens":{"<sep>":{"id":"<sep>","ids":[65],"tokens":["<sep>"]},"<mask>":{"id":"<mask>","ids":[64],"tokens":["<mask>"]}}})");
  const Tokenizer t = Tokenizer::from_json(j, "flags.json");
  using V = std::vector<uint32_t>;
  struct Case {
    std::string text;
    V ids, ids_special;
    std::string decoded, decoded_skip;
  };
  const std::vector<Case> cases = {
      {"the <mask> and", {61, 64, 63}, {65, 61, 64, 63, 64}, "<sep> the <mask> and <mask>", "the and"},
      {"x<mask>y", {23, 53, 12, 0, 18, 10, 54, 24}, {65, 23, 53, 12, 0, 18, 10, 54, 24, 64},
       "<sep> x < m a s k > y <mask>", "x < m a s k > y"},
      {"a <mask>\t<mask>  b", {0, 64, 64, 1}, {65, 0, 64, 64, 1, 64}, "<sep> a <mask> <mask> b <mask>", "a b"},
      {"<sep>   the", {65, 61}, {65, 65, 61, 64}, "<sep> <sep> the <mask>", "the"},
      {"say HELLO there hello", {18, 0, 24, 26, 66, 26, 61, 17, 4, 26, 66}, {65, 18, 0, 24, 26, 66, 26, 61, 17, 4, 26, 66, 64},
       "<sep> s a y   HeLLo   the r e   HeLLo <mask>", "s a y   HeLLo   the r e   HeLLo"},
      {"ab  <l>cd", {0, 1, 67, 2, 3}, {65, 0, 1, 67, 2, 3, 64}, "<sep> a b <l> c d <mask>", "a b <l> c d"},
      {"The AND  the", {61, 26, 63, 26, 26, 61}, {65, 61, 26, 63, 26, 26, 61, 64}, "<sep> the   and     the <mask>",
       "the   and     the"},
      {"<mask>", {64}, {65, 64, 64}, "<sep> <mask> <mask>", ""},
      {"", {}, {65, 64}, "<sep> <mask>", ""},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(t.encode(c.text), c.ids) << c.text;
    EXPECT_EQ(t.encode(c.text, true), c.ids_special) << c.text;
    EXPECT_EQ(t.decode(c.ids_special), c.decoded) << c.text;
    EXPECT_EQ(t.decode(c.ids_special, true), c.decoded_skip) << c.text;
  }
  EXPECT_EQ(t.special_prefix(), (V{65}));
  EXPECT_EQ(t.special_suffix(), (V{64}));
  EXPECT_TRUE(t.is_special(64));
  EXPECT_FALSE(t.is_special(66));
  EXPECT_FALSE(t.is_special(3));
  EXPECT_EQ(t.vocab_size(), 68u);
  EXPECT_EQ(t.token_to_id("HeLLo"), 66u);
  EXPECT_EQ(t.id_to_token(63), "and");
  EXPECT_EQ(t.id_to_token(1000), std::nullopt);
  // Offsets: the template's tokens sit at 0 and at the end; an lstrip token starts at its spaces.
  std::vector<uint32_t> ids, starts;
  t.encode_with_offsets("ab  <l>cd", true, ids, starts);
  EXPECT_EQ(starts, (V{0, 0, 1, 2, 7, 8, 9}));
}

const Tokenizer& llama(const std::string& name) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, Tokenizer::from_file(kTok / name / "tokenizer.json.gz")).first;
  return it->second;
}

std::vector<std::string> corpus_docs(size_t n) {
  strata::text::LineReader r(fs::path(STRATA_SOURCE_DIR) / "tests/text/fixtures/corpus/mixed.jsonl.gz");
  std::vector<std::string> docs;
  std::string line;
  while (docs.size() < n && r.next(line)) docs.push_back(json::parse(line).at("text").get<std::string>());
  return docs;
}

TEST(TokenizerBatch, SameForAnyThreadCount) {
  const Tokenizer& t = llama("llama3_1");
  const auto docs = corpus_docs(400);
  std::vector<std::string_view> views(docs.begin(), docs.end());
  std::vector<std::vector<uint32_t>> want;
  for (const auto& d : docs) want.push_back(t.encode(d, true));
  for (int threads : {1, 2, 4, 0}) EXPECT_EQ(t.encode_batch(views, true, threads), want) << threads << " threads";
  // Plain threads sharing one Tokenizer.
  std::vector<std::vector<std::vector<uint32_t>>> got(4);
  std::vector<std::thread> pool;
  for (int k = 0; k < 4; ++k) {
    pool.emplace_back([&, k] {
      for (const auto& d : docs) got[size_t(k)].push_back(t.encode(d, true));
    });
  }
  for (auto& th : pool) th.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
}

// Random valid UTF-8: ASCII, Latin, Greek, CJK, Hangul, combining marks, astral (emoji, math),
// whitespace runs of many kinds.
std::string random_text(std::mt19937& rng) {
  static const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
      {0x20, 0x7E}, {0xA0, 0x24F}, {0x300, 0x36F}, {0x370, 0x3FF}, {0x400, 0x4FF}, {0x590, 0x6FF},
      {0x900, 0x97F}, {0x3040, 0x30FF}, {0x4E00, 0x9FFF}, {0xAC00, 0xD7A3}, {0x1F300, 0x1FAFF},
      {0x1D400, 0x1D7FF}, {0x10000, 0x1007F}, {0xE000, 0xF8FF}, {0x0, 0x1F}};
  static const char* spaces[] = {" ", "  ", "\n", "\t", "\r\n", "\xE3\x80\x80", "\xC2\xA0", "   \n\n", "\xE1\xA0\x8E"};
  std::string s;
  const int n = std::uniform_int_distribution<int>(0, 120)(rng);
  for (int i = 0; i < n; ++i) {
    if (rng() % 6 == 0) {
      s += spaces[rng() % std::size(spaces)];
      continue;
    }
    const auto& r = ranges[rng() % ranges.size()];
    strata::text::detail::append_utf8(s, r.first + uint32_t(rng() % (r.second - r.first + 1)));
  }
  return s;
}

TEST(TokenizerRoundTrip, ByteLevelDecodesToInput) {
  std::mt19937 rng(1234);
  for (const char* name : {"llama3", "gpt4o", "deepseek_v3", "qwen3"}) {
    const Tokenizer& t = llama(name);
    for (int i = 0; i < 300; ++i) {
      const std::string s = random_text(rng);
      std::string want = s;
      if (std::string(name) == "qwen3") {  // NFC normalizer
        strata::text::detail::unicode_normalize(strata::text::detail::NormForm::NFC, s, nullptr, want, nullptr);
      }
      EXPECT_EQ(t.decode(t.encode(s)), want) << name;
    }
  }
}

// The array scan (short words) and the heap (long words) give the same merges.
TEST(TokenizerBpe, ScanAndHeapAgree) {
  const json j = json::parse(strata::text::read_text_file(kTok / "llama2/tokenizer.json.gz"));
  const strata::text::detail::BpeModel model(j["model"], false, "llama2");
  const auto docs = corpus_docs(200);
  std::mt19937 rng(5);
  int compared = 0;
  for (const auto& d : docs) {
    std::vector<strata::text::detail::BpeSymbol> syms;
    std::string word = "\xE2\x96\x81" + d;  // as the llama2 normalizer makes it
    for (char& c : word) c = c == ' ' ? '_' : c;
    for (size_t i = 0; i < word.size();) {
      const int len = strata::text::detail::utf8_len(uint8_t(word[i]));
      const uint32_t id = model.token_to_id(word.substr(i, size_t(len)));
      if (id != strata::text::detail::kNoId) syms.push_back({id, uint32_t(len)});
      i += size_t(len);
    }
    const size_t cut = std::min<size_t>(syms.size(), 8 + rng() % 200);
    syms.resize(cut);
    auto a = syms, b = syms;
    model.merge(a, 1);
    model.merge(b, 2);
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_EQ(a[k].id, b[k].id);
      EXPECT_EQ(a[k].len, b[k].len);
    }
    ++compared;
  }
  EXPECT_GT(compared, 100);
}

TEST(TokenizerApi, SpecialTokensAndVocab) {
  const Tokenizer& l3 = llama("llama3");
  const Tokenizer& l31 = llama("llama3_1");
  const Tokenizer& l2 = llama("llama2");
  EXPECT_TRUE(l3.special_prefix().empty());
  EXPECT_EQ(l31.special_prefix(), (std::vector<uint32_t>{128000}));
  EXPECT_TRUE(l31.special_suffix().empty());
  EXPECT_EQ(l2.special_prefix(), (std::vector<uint32_t>{1}));
  EXPECT_EQ(l31.vocab_size(), 128256u);
  EXPECT_EQ(l2.vocab_size(), 32000u);
  EXPECT_EQ(l31.token_to_id("<|begin_of_text|>"), 128000u);
  EXPECT_TRUE(l31.is_special(128000));
  EXPECT_FALSE(l31.is_special(100));
  EXPECT_EQ(l31.id_to_token(9906), "Hello");
  EXPECT_EQ(l31.token_to_id("\xC4\xA0world"), 1917u);  // "Ġworld", as the file spells it
  // Offsets: llama2's normalizer inserts "▁" before each word; the tokens map to the word's space.
  std::vector<uint32_t> ids, starts;
  l2.encode_with_offsets("Hi there", true, ids, starts);
  ASSERT_EQ(ids.size(), starts.size());
  EXPECT_EQ(starts.front(), 0u);
  EXPECT_EQ(starts.back(), 2u);  // "▁there" starts at the space
  // A token inside a multi-byte character starts at that character.
  l31.encode_with_offsets("\xF0\x9F\x98\x80\xF0\x9F\x98\x80", false, ids, starts);
  for (uint32_t s : starts) EXPECT_TRUE(s == 0 || s == 4) << s;
}

}  // namespace
