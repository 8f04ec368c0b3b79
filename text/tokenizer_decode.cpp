// Decoders of tokenizer.json, each the Rust decode_chain over the list of token strings:
// ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace, Sequence.
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "text/tokenizer_pipeline.h"

namespace strata::text::detail {

namespace {

class SequenceDec final : public Decoder {
 public:
  explicit SequenceDec(std::vector<std::unique_ptr<Decoder>> parts) : parts_(std::move(parts)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts_) p->apply(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

// All tokens to bytes (characters of the byte-level alphabet; a token with any other character
// as its own UTF-8), then one lossy UTF-8 string.
class ByteLevelDec final : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string bytes, tok;
    for (const std::string& t : tokens) {
      if (byte_level_to_bytes(t, tok)) {
        bytes += tok;
      } else {
        bytes += t;
      }
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

// Runs of "<0xNN>" tokens become their bytes when those are valid UTF-8, else one U+FFFD each.
class ByteFallbackDec final : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string run;
    size_t run_len = 0;
    auto flush = [&] {
      if (run_len == 0) return;
      if (find_invalid_utf8(run) == kNpos) {
        out.push_back(run);
      } else {
        for (size_t i = 0; i < run_len; ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      run.clear();
      run_len = 0;
    };
    for (std::string& t : tokens) {
      int byte = -1;
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') byte = parse_hex2(t[3], t[4]);
      if (byte >= 0) {
        run.push_back(char(byte));
        ++run_len;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens.swap(out);
  }

 private:
  static int hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  static int parse_hex2(char a, char b) {
    const int h = hex(a), l = hex(b);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
};

class FuseDec final : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

// Removes up to `start` leading and `stop` trailing copies of one character from each token.
class StripDec final : public Decoder {
 public:
  StripDec(uint32_t content, size_t start, size_t stop) : content_(content), start_(start), stop_(stop) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      std::vector<std::pair<uint32_t, size_t>> chars;  // (code point, byte offset)
      for (size_t i = 0; i < t.size();) {
        int len;
        chars.emplace_back(decode_utf8(t.data() + i, &len), i);
        i += size_t(len);
      }
      size_t start_cut = 0;
      for (size_t i = 0; i < std::min(start_, chars.size()); ++i) {
        if (chars[i].first != content_) break;
        start_cut = i + 1;
      }
      size_t stop_cut = chars.size();
      for (size_t i = 0; i < std::min(stop_, chars.size() - start_cut); ++i) {
        const size_t index = chars.size() - i - 1;
        if (chars[index].first != content_) break;
        stop_cut = index;
      }
      const size_t b = start_cut < chars.size() ? chars[start_cut].second : t.size();
      const size_t e = stop_cut < chars.size() ? chars[stop_cut].second : t.size();
      t = b < e ? t.substr(b, e - b) : std::string();
    }
  }

 private:
  uint32_t content_;
  size_t start_, stop_;
};

class ReplaceDec final : public Decoder {
 public:
  ReplaceDec(std::string literal, std::unique_ptr<Regex> regex, std::string content)
      : literal_(std::move(literal)), regex_(std::move(regex)), content_(std::move(content)) {}
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::pair<uint32_t, uint32_t>> spans;
    for (std::string& t : tokens) {
      spans.clear();
      if (regex_) {
        regex_->find_all(t, spans);
      } else {
        for (size_t pos = t.find(literal_); pos != std::string::npos; pos = t.find(literal_, pos + literal_.size())) {
          spans.emplace_back(uint32_t(pos), uint32_t(pos + literal_.size()));
        }
      }
      if (spans.empty()) continue;
      std::string out;
      size_t prev = 0;
      for (const auto& [s, e] : spans) {
        out.append(t, prev, s - prev);
        out += content_;
        prev = e;
      }
      out.append(t, prev, std::string::npos);
      t.swap(out);
    }
  }

 private:
  std::string literal_;
  std::unique_ptr<Regex> regex_;
  std::string content_;
};

// The replacement character becomes a space; in the first token it is dropped unless the
// pre-tokenizer never prepends one.
class MetaspaceDec final : public Decoder {
 public:
  MetaspaceDec(std::string rep, bool drop_first) : rep_(std::move(rep)), drop_first_(drop_first) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      if (t.find(rep_) == std::string::npos) continue;
      std::string out;
      size_t prev = 0;
      for (size_t pos = t.find(rep_); pos != std::string::npos; pos = t.find(rep_, pos + rep_.size())) {
        out.append(t, prev, pos - prev);
        if (!(i == 0 && drop_first_)) out.push_back(' ');
        prev = pos + rep_.size();
      }
      out.append(t, prev, std::string::npos);
      t.swap(out);
    }
  }

 private:
  std::string rep_;
  bool drop_first_;
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    throw std::runtime_error(where + " must be an object with a \"type\", not " + j.dump());
  }
  const std::string type = j["type"].get<std::string>();
  auto string_field = [&](const char* key) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) throw std::runtime_error(where + ": '" + key + "' must be a string");
    return it->get<std::string>();
  };
  if (type == "Sequence") {
    auto it = j.find("decoders");
    if (it == j.end() || !it->is_array()) throw std::runtime_error(where + ": 'decoders' must be an array");
    std::vector<std::unique_ptr<Decoder>> parts;
    for (size_t i = 0; i < it->size(); ++i) {
      parts.push_back(make_decoder((*it)[i], where + "[" + std::to_string(i) + "]"));
    }
    return std::make_unique<SequenceDec>(std::move(parts));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDec>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDec>();
  if (type == "Fuse") return std::make_unique<FuseDec>();
  if (type == "Strip") {
    const std::string content = string_field("content");
    int len = 0;
    if (!content.empty()) decode_utf8(content.data(), &len);
    if (content.empty() || size_t(len) != content.size()) {
      throw std::runtime_error(where + ": Strip content '" + content + "' is not one character");
    }
    auto num = [&](const char* key) -> size_t {
      auto it = j.find(key);
      if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() < 0) {
        throw std::runtime_error(where + ": '" + key + "' must be a non-negative integer");
      }
      return it->get<size_t>();
    };
    int l;
    return std::make_unique<StripDec>(decode_utf8(content.data(), &l), num("start"), num("stop"));
  }
  if (type == "Replace") {
    std::string literal;
    std::unique_ptr<Regex> regex;
    parse_pattern(j, where, literal, regex);
    const std::string content = string_field("content");
    if (regex && content.find('$') != std::string::npos) {
      throw std::runtime_error(where + ": Replace content '" + content +
                               "' with '$' (group references) is not supported");
    }
    return std::make_unique<ReplaceDec>(std::move(literal), std::move(regex), content);
  }
  if (type == "Metaspace") {
    const std::string rep = string_field("replacement");
    bool drop_first = true;
    if (auto it = j.find("prepend_scheme"); it != j.end() && it->is_string()) {
      drop_first = it->get<std::string>() != "never";
    } else if (auto it2 = j.find("add_prefix_space"); it2 != j.end() && it2->is_boolean()) {
      drop_first = it2->get<bool>();
    }
    if (auto it2 = j.find("add_prefix_space"); it2 != j.end() && it2->is_boolean() && !it2->get<bool>()) {
      drop_first = false;
    }
    return std::make_unique<MetaspaceDec>(rep, drop_first);
  }
  throw std::runtime_error(where + " type '" + type + "' is not supported");
}

}  // namespace strata::text::detail
