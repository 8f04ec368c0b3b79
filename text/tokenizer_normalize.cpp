// Normalizers of tokenizer.json: Sequence, NFC/NFD/NFKC/NFKD, Lowercase, Prepend, Replace. Each
// keeps the origin of every output byte as the Rust NormalizedString alignments do: inserted text
// takes the origin of the character it is attached to (Prepend: the first; Replace: the last
// replaced one).
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "text/tokenizer_pipeline.h"

namespace strata::text::detail {

Piece EncodeState::append(std::string_view s, const uint32_t* s_orig) {
  Piece p;
  p.begin = uint32_t(buf.size());
  const char* base = buf.data();
  const bool inside = !s.empty() && s.data() >= base && s.data() < base + buf.size();
  const size_t off = inside ? size_t(s.data() - base) : 0;
  buf.reserve(buf.size() + s.size());
  buf.append(inside ? buf.data() + off : s.data(), s.size());
  if (track) {
    const uint32_t* obase = orig.data();
    const bool oinside = s_orig >= obase && s_orig < obase + orig.size();
    const size_t ooff = oinside ? size_t(s_orig - obase) : 0;
    orig.reserve(orig.size() + s.size());
    const uint32_t* src = oinside ? orig.data() + ooff : s_orig;
    orig.insert(orig.end(), src, src + s.size());
  }
  p.end = uint32_t(buf.size());
  return p;
}

namespace {

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  void apply(std::string& text, std::vector<uint32_t>* orig) const override {
    for (const auto& p : parts_) p->apply(text, orig);
  }
  bool identity() const override {
    for (const auto& p : parts_) {
      if (!p->identity()) return false;
    }
    return true;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormForm form) : form_(form) {}
  void apply(std::string& text, std::vector<uint32_t>* orig) const override {
    thread_local std::string out;
    thread_local std::vector<uint32_t> out_orig;
    unicode_normalize(form_, text, orig ? orig->data() : nullptr, out, orig ? &out_orig : nullptr);
    text.swap(out);
    if (orig) orig->swap(out_orig);
  }

 private:
  NormForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  void apply(std::string& text, std::vector<uint32_t>* orig) const override {
    thread_local std::string out;
    thread_local std::vector<uint32_t> out_orig;
    out.clear();
    out_orig.clear();
    for (size_t i = 0; i < text.size();) {
      int len;
      const uint32_t cp = decode_utf8(text.data() + i, &len);
      const size_t before = out.size();
      append_lowercase(out, cp);
      if (orig) out_orig.insert(out_orig.end(), out.size() - before, (*orig)[i]);
      i += size_t(len);
    }
    text.swap(out);
    if (orig) orig->swap(out_orig);
  }
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string s) : s_(std::move(s)) {}
  void apply(std::string& text, std::vector<uint32_t>* orig) const override {
    if (text.empty()) return;
    text.insert(0, s_);
    if (orig) orig->insert(orig->begin(), s_.size(), (*orig)[0]);
  }
  bool identity() const override { return s_.empty(); }

 private:
  std::string s_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::string literal, std::unique_ptr<Regex> regex, std::string content)
      : literal_(std::move(literal)), regex_(std::move(regex)), content_(std::move(content)) {}
  void apply(std::string& text, std::vector<uint32_t>* orig) const override {
    thread_local std::vector<std::pair<uint32_t, uint32_t>> spans;
    spans.clear();
    if (regex_) {
      regex_->find_all(text, spans);
    } else if (!literal_.empty()) {
      for (size_t pos = text.find(literal_); pos != std::string::npos; pos = text.find(literal_, pos + literal_.size())) {
        spans.emplace_back(uint32_t(pos), uint32_t(pos + literal_.size()));
      }
    }
    if (spans.empty()) return;
    thread_local std::string out;
    thread_local std::vector<uint32_t> out_orig;
    out.clear();
    out_orig.clear();
    size_t prev = 0;
    for (const auto& [s, e] : spans) {
      out.append(text, prev, s - prev);
      out += content_;
      if (orig) {
        out_orig.insert(out_orig.end(), orig->begin() + prev, orig->begin() + s);
        // Inserted characters share the alignment of the byte before the insertion point: the last
        // replaced byte (Rust transform_range).
        const uint32_t o = e > 0 ? (*orig)[e - 1] : (orig->empty() ? 0 : (*orig)[0]);
        out_orig.insert(out_orig.end(), content_.size(), o);
      }
      prev = e;
    }
    out.append(text, prev, std::string::npos);
    if (orig) out_orig.insert(out_orig.end(), orig->begin() + prev, orig->end());
    text.swap(out);
    if (orig) orig->swap(out_orig);
  }

 private:
  std::string literal_;
  std::unique_ptr<Regex> regex_;
  std::string content_;
};

std::string type_of(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw std::runtime_error(where + " must be an object or null, not " + j.dump());
  auto it = j.find("type");
  if (it == j.end() || !it->is_string()) throw std::runtime_error(where + " has no \"type\"");
  return it->get<std::string>();
}

const nlohmann::json& field(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) throw std::runtime_error(where + ": '" + key + "' is missing");
  return *it;
}

std::string string_field(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto& v = field(j, key, where);
  if (!v.is_string()) throw std::runtime_error(where + ": '" + key + "' must be a string");
  return v.get<std::string>();
}

}  // namespace

// Parses {"String": s} or {"Regex": r} into a literal or a compiled regex.
void parse_pattern(const nlohmann::json& j, const std::string& where, std::string& literal,
                   std::unique_ptr<Regex>& regex) {
  const auto& p = field(j, "pattern", where);
  if (p.is_object() && p.size() == 1 && p.contains("String") && p["String"].is_string()) {
    literal = p["String"].get<std::string>();
    // The Rust library compiles an escaped String pattern as a regex: an empty one matches the
    // empty string at every character boundary.
    if (literal.empty()) regex = std::make_unique<Regex>("");
    return;
  }
  if (p.is_object() && p.size() == 1 && p.contains("Regex") && p["Regex"].is_string()) {
    try {
      regex = std::make_unique<Regex>(p["Regex"].get<std::string>());
    } catch (const std::exception& e) {
      throw std::runtime_error(where + ": " + e.what());
    }
    return;
  }
  throw std::runtime_error(where + ": pattern " + p.dump() + " is not {\"String\": ...} or {\"Regex\": ...}");
}

std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& where) {
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    const auto& list = field(j, "normalizers", where);
    if (!list.is_array()) throw std::runtime_error(where + ": 'normalizers' must be an array");
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (size_t i = 0; i < list.size(); ++i) {
      parts.push_back(make_normalizer(list[i], where + "[" + std::to_string(i) + "]"));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormForm::NFC);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormForm::NFD);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormForm::NFKC);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormForm::NFKD);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(string_field(j, "prepend", where));
  if (type == "Replace") {
    std::string literal;
    std::unique_ptr<Regex> regex;
    parse_pattern(j, where, literal, regex);
    const std::string content = string_field(j, "content", where);
    if (regex && content.find('$') != std::string::npos) {
      throw std::runtime_error(where + ": Replace content '" + content +
                               "' with '$' (group references) is not supported");
    }
    return std::make_unique<ReplaceNormalizer>(std::move(literal), std::move(regex), content);
  }
  throw std::runtime_error(where + " type '" + type + "' is not supported");
}

}  // namespace strata::text::detail
