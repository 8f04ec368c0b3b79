// Pre-tokenizers of tokenizer.json: Sequence, Split (String or Regex; the five delimiter behaviors;
// invert), ByteLevel (prefix space, GPT-2's regex), Digits, Metaspace. Splitting follows the Rust
// NormalizedString::split: a pattern cuts a piece into alternating gaps and matches, the behavior
// decides what is kept and merged, and empty pieces are dropped.
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "text/tokenizer_pipeline.h"

namespace strata::text::detail {

namespace {

struct Seg {
  uint32_t b, e;
  bool match;
};

void emit(EncodeState& st, const Piece& p, uint32_t b, uint32_t e) {
  if (b < e) st.next.push_back(Piece{p.begin + b, p.begin + e, kNoId, 0});
}

}  // namespace

void emit_split(EncodeState& st, const Piece& p, const std::vector<std::pair<uint32_t, uint32_t>>& spans,
                SplitBehavior behavior, bool invert) {
  const uint32_t len = p.end - p.begin;
  if (behavior == SplitBehavior::Isolated) {  // every gap and match is a piece; the common case
    uint32_t prev = 0;
    for (const auto& [s, e] : spans) {
      emit(st, p, prev, s);
      emit(st, p, s, e);
      prev = e;
    }
    emit(st, p, prev, len);
    return;
  }
  thread_local std::vector<Seg> segs;
  segs.clear();
  uint32_t prev = 0;
  for (const auto& [s, e] : spans) {
    if (prev != s) segs.push_back({prev, s, invert});
    segs.push_back({s, e, !invert});
    prev = e;
  }
  if (prev != len) segs.push_back({prev, len, invert});

  thread_local std::vector<Seg> out;
  out.clear();
  switch (behavior) {
    case SplitBehavior::Isolated:
      break;
    case SplitBehavior::Removed:
      for (const Seg& s : segs) {
        if (!s.match) out.push_back(s);
      }
      break;
    case SplitBehavior::Contiguous: {
      bool previous_match = false;
      for (const Seg& s : segs) {
        if (s.match == previous_match && !out.empty()) {
          out.back().e = s.e;
        } else {
          out.push_back(s);
        }
        previous_match = s.match;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      bool previous_match = false;
      for (const Seg& s : segs) {
        if (s.match && !previous_match && !out.empty()) {
          out.back().e = s.e;
        } else {
          out.push_back(s);
        }
        previous_match = s.match;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      // The Rust fold runs from the end: a match joins the segment after it unless that one is
      // a match too.
      bool previous_match = false;
      for (size_t k = segs.size(); k-- > 0;) {
        const Seg& s = segs[k];
        if (s.match && !previous_match && !out.empty()) {
          out.back().b = s.b;
        } else {
          out.push_back(s);
        }
        previous_match = s.match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  for (const Seg& s : out) emit(st, p, s.b, s.e);
}

namespace {

// Runs fn(st, piece) for each text piece, passing added tokens through, and makes the result
// the new st.pieces.
template <class F>
void for_text_pieces(EncodeState& st, F&& fn) {
  st.next.clear();
  for (size_t i = 0; i < st.pieces.size(); ++i) {
    const Piece p = st.pieces[i];
    if (p.id != kNoId) {
      st.next.push_back(p);
    } else {
      fn(p);
    }
  }
  std::swap(st.pieces, st.next);
}

class SequencePre final : public PreTokenizer {
 public:
  explicit SequencePre(std::vector<std::unique_ptr<PreTokenizer>> parts) : parts_(std::move(parts)) {}
  void apply(EncodeState& st) const override {
    for (const auto& p : parts_) p->apply(st);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class SplitPre final : public PreTokenizer {
 public:
  SplitPre(std::string literal, std::unique_ptr<Regex> regex, SplitBehavior behavior, bool invert)
      : literal_(std::move(literal)), regex_(std::move(regex)), behavior_(behavior), invert_(invert) {}
  void apply(EncodeState& st) const override {
    for_text_pieces(st, [&](const Piece& p) {
      const std::string_view text = st.view(p);
      st.spans.clear();
      if (regex_) {
        regex_->find_all(text, st.spans);
      } else if (!literal_.empty()) {
        for (size_t pos = text.find(literal_); pos != std::string_view::npos;
             pos = text.find(literal_, pos + literal_.size())) {
          st.spans.emplace_back(uint32_t(pos), uint32_t(pos + literal_.size()));
        }
      }
      emit_split(st, p, st.spans, behavior_, invert_);
    });
  }

 private:
  std::string literal_;
  std::unique_ptr<Regex> regex_;
  SplitBehavior behavior_;
  bool invert_;
};

constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPre final : public PreTokenizer {
 public:
  ByteLevelPre(bool add_prefix_space, bool use_regex) : add_prefix_space_(add_prefix_space) {
    if (use_regex) regex_ = std::make_unique<Regex>(kGpt2Pattern);
  }
  void apply(EncodeState& st) const override {
    for_text_pieces(st, [&](Piece p) {
      if (add_prefix_space_ && st.buf[p.begin] != ' ') {
        const uint32_t o = st.track ? st.orig[p.begin] : 0;
        st.scratch.assign(1, ' ');
        st.scratch.append(st.view(p));
        if (st.track) {
          st.scratch_orig.assign(1, o);
          st.scratch_orig.insert(st.scratch_orig.end(), st.orig.begin() + p.begin, st.orig.begin() + p.end);
        }
        p = st.append(st.scratch, st.scratch_orig.data());
      }
      if (!regex_) {
        st.next.push_back(p);
        return;
      }
      st.spans.clear();
      regex_->find_all(st.view(p), st.spans);
      emit_split(st, p, st.spans, SplitBehavior::Isolated, false);
    });
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;
};

class DigitsPre final : public PreTokenizer {
 public:
  explicit DigitsPre(bool individual) : individual_(individual) {}
  void apply(EncodeState& st) const override {
    for_text_pieces(st, [&](const Piece& p) {
      const std::string_view text = st.view(p);
      st.spans.clear();
      for (size_t i = 0; i < text.size();) {
        int len;
        const uint32_t cp = decode_utf8(text.data() + i, &len);
        if (is_numeric(cp)) st.spans.emplace_back(uint32_t(i), uint32_t(i + size_t(len)));
        i += size_t(len);
      }
      emit_split(st, p, st.spans, individual_ ? SplitBehavior::Isolated : SplitBehavior::Contiguous, false);
    });
  }

 private:
  bool individual_;
};

enum class PrependScheme { Always, First, Never };

class MetaspacePre final : public PreTokenizer {
 public:
  MetaspacePre(std::string replacement, PrependScheme scheme, bool split)
      : rep_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void apply(EncodeState& st) const override {
    for_text_pieces(st, [&](Piece p) {
      const std::string_view text = st.view(p);
      const bool starts_with_rep_or_space = text.rfind(rep_, 0) == 0 || text[0] == ' ';
      bool prepend = false;
      if (!starts_with_rep_or_space) {
        prepend = scheme_ == PrependScheme::Always || (scheme_ == PrependScheme::First && st.orig[p.begin] == 0);
      }
      const bool has_space = text.find(' ') != std::string_view::npos;
      if (prepend || has_space) {
        st.scratch.clear();
        st.scratch_orig.clear();
        if (prepend) {
          st.scratch = rep_;
          if (st.track) st.scratch_orig.assign(rep_.size(), st.orig[p.begin]);
        }
        for (size_t i = 0; i < text.size(); ++i) {
          if (text[i] == ' ') {
            st.scratch += rep_;
            if (st.track) st.scratch_orig.insert(st.scratch_orig.end(), rep_.size(), st.orig[p.begin + i]);
          } else {
            st.scratch.push_back(text[i]);
            if (st.track) st.scratch_orig.push_back(st.orig[p.begin + i]);
          }
        }
        p = st.append(st.scratch, st.scratch_orig.data());
      }
      if (!split_) {
        st.next.push_back(p);
        return;
      }
      const std::string_view t = st.view(p);
      st.spans.clear();
      for (size_t pos = t.find(rep_); pos != std::string_view::npos; pos = t.find(rep_, pos + rep_.size())) {
        st.spans.emplace_back(uint32_t(pos), uint32_t(pos + rep_.size()));
      }
      emit_split(st, p, st.spans, SplitBehavior::MergedWithNext, false);
    });
  }

 private:
  std::string rep_;
  PrependScheme scheme_;
  bool split_;
};

bool bool_field(const nlohmann::json& j, const char* key, bool dflt, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) throw std::runtime_error(where + ": '" + key + "' must be true or false");
  return it->get<bool>();
}

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const std::string& where,
                                                 PipelineFlags& flags) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    throw std::runtime_error(where + " must be an object with a \"type\", not " + j.dump());
  }
  const std::string type = j["type"].get<std::string>();
  if (flags.byte_level) {
    throw std::runtime_error(where + ": a pre-tokenizer after ByteLevel ('" + type + "') is not supported");
  }
  if (type == "Sequence") {
    auto it = j.find("pretokenizers");
    if (it == j.end() || !it->is_array()) throw std::runtime_error(where + ": 'pretokenizers' must be an array");
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (size_t i = 0; i < it->size(); ++i) {
      parts.push_back(make_pre_tokenizer((*it)[i], where + "[" + std::to_string(i) + "]", flags));
    }
    return std::make_unique<SequencePre>(std::move(parts));
  }
  if (type == "Split") {
    std::string literal;
    std::unique_ptr<Regex> regex;
    parse_pattern(j, where, literal, regex);
    auto bit = j.find("behavior");
    if (bit == j.end() || !bit->is_string()) throw std::runtime_error(where + ": 'behavior' is missing");
    const std::string b = bit->get<std::string>();
    SplitBehavior behavior;
    if (b == "Removed") behavior = SplitBehavior::Removed;
    else if (b == "Isolated") behavior = SplitBehavior::Isolated;
    else if (b == "MergedWithPrevious") behavior = SplitBehavior::MergedWithPrevious;
    else if (b == "MergedWithNext") behavior = SplitBehavior::MergedWithNext;
    else if (b == "Contiguous") behavior = SplitBehavior::Contiguous;
    else throw std::runtime_error(where + ": Split behavior '" + b + "' is not supported");
    return std::make_unique<SplitPre>(std::move(literal), std::move(regex), behavior,
                                      bool_field(j, "invert", false, where));
  }
  if (type == "ByteLevel") {
    auto p = std::make_unique<ByteLevelPre>(bool_field(j, "add_prefix_space", true, where),
                                            bool_field(j, "use_regex", true, where));
    flags.byte_level = true;
    return p;
  }
  if (type == "Digits") return std::make_unique<DigitsPre>(bool_field(j, "individual_digits", false, where));
  if (type == "Metaspace") {
    auto rit = j.find("replacement");
    if (rit == j.end() || !rit->is_string()) throw std::runtime_error(where + ": 'replacement' is missing");
    const std::string rep = rit->get<std::string>();
    int len = 0;
    if (!rep.empty()) decode_utf8(rep.data(), &len);
    if (rep.empty() || size_t(len) != rep.size()) {
      throw std::runtime_error(where + ": Metaspace replacement '" + rep + "' is not one character");
    }
    PrependScheme scheme = PrependScheme::Always;
    bool scheme_given = false;
    if (auto it = j.find("prepend_scheme"); it != j.end() && !it->is_null()) {
      const std::string s = it->is_string() ? it->get<std::string>() : it->dump();
      if (s == "always") scheme = PrependScheme::Always;
      else if (s == "first") scheme = PrependScheme::First;
      else if (s == "never") scheme = PrependScheme::Never;
      else throw std::runtime_error(where + ": Metaspace prepend_scheme '" + s + "' is not supported");
      scheme_given = true;
    }
    if (auto it = j.find("add_prefix_space"); it != j.end() && it->is_boolean() && !it->get<bool>()) {
      if (scheme_given && scheme == PrependScheme::Always) {
        throw std::runtime_error(where + ": add_prefix_space false contradicts prepend_scheme 'always'");
      }
      scheme = PrependScheme::Never;
    }
    if (scheme == PrependScheme::First) flags.needs_origins = true;
    return std::make_unique<MetaspacePre>(rep, scheme, bool_field(j, "split", true, where));
  }
  throw std::runtime_error(where + " type '" + type + "' is not supported");
}

}  // namespace strata::text::detail
