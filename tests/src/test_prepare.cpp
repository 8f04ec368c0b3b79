// `strata data`'s fast path for {"text": "..."} lines (decode_text_record) decodes exactly what
// nlohmann::json decodes, on random strings with every escape form, and declines (returns false)
// anything else, so the full parser then decodes it or names the error.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "src/data/prepare.h"

using strata::decode_text_record;

namespace {

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) s += static_cast<char>(cp);
  else if (cp < 0x800) s += static_cast<char>(0xC0 | (cp >> 6)), s += static_cast<char>(0x80 | (cp & 0x3F));
  else if (cp < 0x10000)
    s += static_cast<char>(0xE0 | (cp >> 12)), s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
        s += static_cast<char>(0x80 | (cp & 0x3F));
  else
    s += static_cast<char>(0xF0 | (cp >> 18)), s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
        s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), s += static_cast<char>(0x80 | (cp & 0x3F));
}

TEST(DecodeTextRecord, EqualsTheJsonParserOnRandomStrings) {
  std::mt19937 rng(7);
  for (int n = 0; n < 3000; ++n) {
    std::string text;
    const int len = static_cast<int>(rng() % 40);
    for (int k = 0; k < len; ++k) {
      uint32_t cp;
      switch (rng() % 5) {
        case 0: cp = rng() % 0x80; break;                           // ASCII, controls and quotes included
        case 1: cp = 0x80 + rng() % 0x780; break;
        case 2: cp = 0x800 + rng() % (0xD800 - 0x800); break;
        case 3: cp = 0xE000 + rng() % 0x2000; break;
        default: cp = 0x10000 + rng() % 0x100000; break;
      }
      append_utf8(text, cp);
    }
    // nlohmann writes the escapes it must (\" \\ \n \u0001 ...); ensure_ascii also writes \uXXXX
    // and surrogate pairs for everything past ASCII.
    for (bool ascii : {false, true}) {
      const std::string line = nlohmann::json{{"text", text}}.dump(-1, ' ', ascii);
      std::string got;
      ASSERT_TRUE(decode_text_record(line, got)) << line;
      EXPECT_EQ(got, text) << line;
    }
  }
}

TEST(DecodeTextRecord, OtherEscapesAndSpacing) {
  std::string out;
  EXPECT_TRUE(decode_text_record(R"(  { "text" :  "a\/b\b\f\u00E9\ud83d\ude00" }  )", out));
  EXPECT_EQ(out, nlohmann::json::parse(R"({"text": "a\/b\b\f\u00E9\ud83d\ude00"})")["text"].get<std::string>());
  EXPECT_TRUE(decode_text_record(R"({"text":""})", out));
  EXPECT_EQ(out, "");
}

TEST(DecodeTextRecord, DeclinesAnythingElse) {
  std::string out;
  for (const char* line : {R"({"text": "a", "id": 1})", R"({"id": 1, "text": "a"})", R"({"text": 5})", R"(["text"])",
                           R"({"text": "a\x"})", R"({"text": "\ud800"})", R"({"text": "\udc00x"})",
                           R"({"text": "\ud800\u0041"})", R"({"text": "unterminated)", R"({"text": "a"} x)",
                           "{\"text\": \"tab\tinside\"}", R"({"text": "a")", R"({"text": "\u12"})", ""})
    EXPECT_FALSE(decode_text_record(line, out)) << line;
}

}  // namespace
