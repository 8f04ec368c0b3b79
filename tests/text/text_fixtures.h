// The tokenizer fixtures (tests/text/fixtures/tokenizers): a real tokenizer.json.gz, or a derived
// one, base + "set" ('.'-separated paths into the object), as fixtures/make_expected.js builds it.
// Shared by the tokenizer tests and bench/text/bench_tokenizer.cpp.
#pragma once
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "text/gzip_file.h"

namespace strata::test {

inline const std::filesystem::path kTextFixtures = std::filesystem::path(STRATA_SOURCE_DIR) / "tests/text/fixtures";

inline nlohmann::json read_json(const std::filesystem::path& p) {
  return nlohmann::json::parse(strata::text::read_text_file(p));
}

inline nlohmann::json tokenizer_json(const std::string& name) {
  const std::filesystem::path dir = kTextFixtures / "tokenizers" / name;
  if (std::filesystem::exists(dir / "tokenizer.json.gz")) return read_json(dir / "tokenizer.json.gz");
  const nlohmann::json d = read_json(dir / "derive.json");
  nlohmann::json j = tokenizer_json(d.at("from").get<std::string>());
  for (const auto& [key, value] : d.at("set").items()) {
    nlohmann::json* o = &j;
    size_t start = 0;
    for (size_t dot; (dot = key.find('.', start)) != std::string::npos; start = dot + 1) o = &(*o)[key.substr(start, dot - start)];
    (*o)[key.substr(start)] = value;
  }
  return j;
}

}  // namespace strata::test
