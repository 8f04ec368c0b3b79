// Tokenizer: loads tokenizer.json into the pipeline (added tokens, normalizer, pre-tokenizer, BPE,
// post-processor, decoder) and runs it: encode with or without offsets, in batches on TBB, decode.
// Per-call working memory is thread-local, so a const Tokenizer serves any number of threads.
#include "text/tokenizer.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "text/gzip_file.h"
#include "text/tokenizer_pipeline.h"

namespace strata::text {

namespace detail {

struct TokenizerImpl {
  std::string source;
  std::unique_ptr<Normalizer> normalizer;  // null when absent or the identity
  std::unique_ptr<PreTokenizer> pre;
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<Decoder> decoder;
  PipelineFlags flags;

  std::vector<AddedToken> added;  // one per content, in the order the Rust library adds them
  std::unordered_map<std::string, uint32_t> added_by_content;
  std::unordered_map<uint32_t, size_t> added_by_id;  // -> index into added
  std::unordered_set<std::string> special_contents;
  std::unique_ptr<AddedMatcher> raw_matcher, norm_matcher;

  std::vector<uint32_t> prefix, suffix;
  uint32_t vocab_size = 0;

  void load(const nlohmann::json& j);
  void load_added(const nlohmann::json& list);
  void load_post_processor(const nlohmann::json& j, const std::string& where, std::vector<uint32_t>& pre,
                           std::vector<uint32_t>& post);
  void encode(std::string_view text, bool add_special, std::vector<uint32_t>& ids,
              std::vector<uint32_t>* starts) const;
  void add_text(EncodeState& st, std::string_view text, size_t a, size_t b) const;
  const AddedToken* added_for_id(uint32_t id) const {
    auto it = added_by_id.find(id);
    return it == added_by_id.end() ? nullptr : &added[it->second];
  }
};

namespace {

[[noreturn]] void fail(const std::string& source, const std::string& msg) {
  throw std::runtime_error(source + ": " + msg);
}

bool opt_bool(const nlohmann::json& j, const char* key, bool dflt, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) throw std::runtime_error(where + ": '" + key + "' must be true or false");
  return it->get<bool>();
}

// Appends to st.orig the original offset of the character of each byte of text[a, b).
void append_char_starts(std::vector<uint32_t>& orig, std::string_view text, size_t a, size_t b) {
  size_t lead = a;
  while (lead > 0 && (static_cast<uint8_t>(text[lead]) & 0xC0) == 0x80) --lead;
  for (size_t i = a; i < b; ++i) {
    if ((static_cast<uint8_t>(text[i]) & 0xC0) != 0x80) lead = i;
    orig.push_back(uint32_t(lead));
  }
}

EncodeState& thread_state() {
  thread_local EncodeState st;
  return st;
}

}  // namespace

void TokenizerImpl::load(const nlohmann::json& j) {
  if (!j.is_object()) fail(source, "the top level is not a JSON object");
  auto get = [&](const char* key) -> const nlohmann::json* {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  if (const auto* n = get("normalizer")) {
    normalizer = make_normalizer(*n, source + ": normalizer");
    if (normalizer->identity()) normalizer.reset();
  }
  if (const auto* p = get("pre_tokenizer")) pre = make_pre_tokenizer(*p, source + ": pre_tokenizer", flags);

  const auto* m = get("model");
  if (!m) fail(source, "'model' is missing");
  if (!m->is_object()) fail(source, "'model' is not an object");
  if (auto t = m->find("type"); t != m->end()) {
    if (!t->is_string() || t->get<std::string>() != "BPE") {
      fail(source, "model type " + t->dump() + " is not supported (only BPE)");
    }
  } else if (!m->contains("merges")) {
    fail(source, "model has no \"type\" and no merges: only BPE models are supported");
  }
  model = std::make_unique<BpeModel>(*m, flags.byte_level, source);

  if (const auto* a = get("added_tokens")) {
    if (!a->is_array()) fail(source, "'added_tokens' is not an array");
    load_added(*a);
  }
  if (const auto* p = get("post_processor")) load_post_processor(*p, source + ": post_processor", prefix, suffix);
  if (const auto* d = get("decoder")) decoder = make_decoder(*d, source + ": decoder");

  uint32_t max_id = model->max_id();
  for (const AddedToken& t : added) max_id = max_id == kNoId ? t.id : std::max(max_id, t.id);
  vocab_size = max_id == kNoId ? 0 : max_id + 1;
}

// Ids as the Rust AddedVocabulary::add_tokens gives them (it ignores the file's ids): the model's
// id for a content in its vocab, else one past the largest added id (or the model's vocab size).
// A file whose ids differ from those would encode differently from the Rust library: refused.
void TokenizerImpl::load_added(const nlohmann::json& list) {
  const uint32_t model_size = uint32_t(model->vocab_count());
  std::vector<AddedToken> tokens;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& e = list[i];
    const std::string where = source + ": added_tokens[" + std::to_string(i) + "]";
    if (!e.is_object()) throw std::runtime_error(where + " is not an object");
    auto c = e.find("content");
    if (c == e.end() || !c->is_string()) throw std::runtime_error(where + ": 'content' must be a string");
    AddedToken t;
    t.content = c->get<std::string>();
    t.special = opt_bool(e, "special", false, where);
    t.single_word = opt_bool(e, "single_word", false, where);
    t.lstrip = opt_bool(e, "lstrip", false, where);
    t.rstrip = opt_bool(e, "rstrip", false, where);
    t.normalized = opt_bool(e, "normalized", !t.special, where);
    auto idj = e.find("id");
    if (idj == e.end() || !json_is_id(*idj)) {
      throw std::runtime_error(where + ": 'id' must be a non-negative 32-bit integer");
    }
    t.id = idj->get<uint32_t>();
    if (t.content.empty()) continue;
    if (find_invalid_utf8(t.content) != kNpos) throw std::runtime_error(where + ": content is not valid UTF-8");

    uint32_t id;
    if (auto it = added_by_content.find(t.content); it != added_by_content.end()) {
      id = it->second;
    } else if (uint32_t mid = model->token_to_id(t.content); mid != kNoId) {
      id = mid;
    } else {
      uint32_t max_added = kNoId;
      for (const auto& [content, aid] : added_by_content) max_added = max_added == kNoId ? aid : std::max(max_added, aid);
      if (max_added == kNoId) {
        id = model_size;
      } else {
        id = (max_added >= model_size || model_size == 0) ? max_added + 1 : model_size;
      }
    }
    if (id != t.id) {
      throw std::runtime_error(where + ": '" + t.content + "' has id " + std::to_string(t.id) +
                               " but the Hugging Face library assigns it " + std::to_string(id) +
                               " (a duplicate or out-of-sequence id); fix the file");
    }
    added_by_content[t.content] = id;
    if (auto it = added_by_id.find(id); it != added_by_id.end()) {
      added[it->second] = t;  // the last definition of a content wins
    } else {
      added_by_id[id] = added.size();
      added.push_back(t);
    }
  }
  for (const AddedToken& t : added) {
    if (t.special) special_contents.insert(t.content);
  }
  // Specials first, then the others (the Rust trie order; the first pattern wins a tie).
  std::vector<std::string> raw_pats, norm_pats;
  std::vector<const AddedToken*> raw_toks, norm_toks;
  for (int pass = 0; pass < 2; ++pass) {
    for (const AddedToken& t : added) {
      if (t.special != (pass == 0)) continue;
      if (t.normalized) {
        std::string p = t.content;
        if (normalizer) normalizer->apply(p, nullptr);
        norm_pats.push_back(std::move(p));
        norm_toks.push_back(&t);
      } else {
        raw_pats.push_back(t.content);
        raw_toks.push_back(&t);
      }
    }
  }
  if (!raw_toks.empty()) raw_matcher = std::make_unique<AddedMatcher>(raw_pats, std::move(raw_toks));
  if (!norm_toks.empty()) norm_matcher = std::make_unique<AddedMatcher>(norm_pats, std::move(norm_toks));
}

void TokenizerImpl::load_post_processor(const nlohmann::json& j, const std::string& where,
                                        std::vector<uint32_t>& pre, std::vector<uint32_t>& post) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    throw std::runtime_error(where + " must be an object with a \"type\"");
  }
  const std::string type = j["type"].get<std::string>();
  if (type == "ByteLevel") return;  // trims offsets only
  if (type == "Sequence") {
    auto it = j.find("processors");
    if (it == j.end() || !it->is_array()) throw std::runtime_error(where + ": 'processors' must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      std::vector<uint32_t> p, s;
      load_post_processor((*it)[i], where + "[" + std::to_string(i) + "]", p, s);
      pre.insert(pre.begin(), p.begin(), p.end());  // a later processor wraps the earlier result
      post.insert(post.end(), s.begin(), s.end());
    }
    return;
  }
  if (type == "TemplateProcessing") {
    auto sit = j.find("single");
    auto tit = j.find("special_tokens");
    if (sit == j.end() || !sit->is_array()) throw std::runtime_error(where + ": 'single' must be an array");
    bool seen_a = false;
    for (const auto& item : *sit) {
      if (item.is_object() && item.contains("Sequence")) {
        const auto& seq = item["Sequence"];
        if (!seq.is_object() || seq.value("id", "") != "A" || seen_a) {
          throw std::runtime_error(where + ": single template item " + item.dump() + " is not supported (one Sequence A)");
        }
        seen_a = true;
        continue;
      }
      if (!item.is_object() || !item.contains("SpecialToken") || !item["SpecialToken"].is_object() ||
          !item["SpecialToken"].contains("id") || !item["SpecialToken"]["id"].is_string()) {
        throw std::runtime_error(where + ": single template item " + item.dump() + " is not supported");
      }
      const std::string name = item["SpecialToken"]["id"].get<std::string>();
      if (tit == j.end() || !tit->is_object() || !tit->contains(name)) {
        throw std::runtime_error(where + ": special token '" + name + "' of the template is not in special_tokens");
      }
      const auto& ids = (*tit)[name]["ids"];
      if (!ids.is_array()) throw std::runtime_error(where + ": special token '" + name + "' has no ids");
      for (const auto& id : ids) {
        if (!json_is_id(id)) throw std::runtime_error(where + ": special token '" + name + "' has a bad id");
        (seen_a ? post : pre).push_back(id.get<uint32_t>());
      }
    }
    if (!seen_a) throw std::runtime_error(where + ": the single template has no Sequence A");
    return;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    auto tok = [&](const char* key) {
      auto it = j.find(key);
      if (it == j.end() || !it->is_array() || it->size() != 2 || !json_is_id((*it)[1])) {
        throw std::runtime_error(where + ": '" + key + "' must be [token, id]");
      }
      return (*it)[1].get<uint32_t>();
    };
    pre.push_back(tok("cls"));
    post.push_back(tok("sep"));
    return;
  }
  throw std::runtime_error(where + " type '" + type + "' is not supported");
}

void TokenizerImpl::add_text(EncodeState& st, std::string_view text, size_t a, size_t b) const {
  if (!normalizer) {
    Piece p;
    p.begin = uint32_t(st.buf.size());
    st.buf.append(text.data() + a, b - a);
    if (st.track) append_char_starts(st.orig, text, a, b);
    p.end = uint32_t(st.buf.size());
    st.pieces.push_back(p);
    return;
  }
  thread_local std::string t;
  thread_local std::vector<uint32_t> to;
  t.assign(text.data() + a, b - a);
  to.clear();
  if (st.track) append_char_starts(to, text, a, b);
  normalizer->apply(t, st.track ? &to : nullptr);
  if (!t.empty()) st.pieces.push_back(st.append(t, to.data()));
}

void TokenizerImpl::encode(std::string_view text, bool add_special, std::vector<uint32_t>& ids,
                           std::vector<uint32_t>* starts) const {
  if (const size_t bad = find_invalid_utf8(text); bad != kNpos) {
    throw std::invalid_argument("tokenizer: text is not valid UTF-8 at byte " + std::to_string(bad));
  }
  if (text.size() >= 0xFFFFFFF0u) throw std::invalid_argument("tokenizer: text of 4 GiB or more");
  EncodeState& st = thread_state();
  st.buf.clear();
  st.orig.clear();
  st.pieces.clear();
  st.track = starts != nullptr || flags.needs_origins;
  ids.clear();
  if (starts) starts->clear();
  if (add_special) {
    ids.insert(ids.end(), prefix.begin(), prefix.end());
    if (starts) starts->insert(starts->end(), prefix.size(), 0);
  }

  // 1. Added tokens on the raw text; the text between them is normalized.
  thread_local std::vector<AddedMatcher::Match> matches;
  matches.clear();
  if (raw_matcher) raw_matcher->find(text, matches);
  size_t prev = 0;
  for (const auto& m : matches) {
    if (prev < m.begin) add_text(st, text, prev, m.begin);
    if (m.begin < m.end) st.pieces.push_back(Piece{0, 0, m.id, m.begin});
    prev = m.end;
  }
  if (prev < text.size()) add_text(st, text, prev, text.size());

  // 2. Added tokens that match normalized text.
  if (norm_matcher) {
    st.next.clear();
    for (const Piece& p : st.pieces) {
      if (p.id != kNoId) {
        st.next.push_back(p);
        continue;
      }
      matches.clear();
      norm_matcher->find(st.view(p), matches);
      uint32_t at = 0;
      for (const auto& m : matches) {
        if (at < m.begin) st.next.push_back(Piece{p.begin + at, p.begin + m.begin, kNoId, 0});
        if (m.begin < m.end) st.next.push_back(Piece{0, 0, m.id, st.track ? st.orig[p.begin + m.begin] : 0});
        at = m.end;
      }
      if (at < p.end - p.begin) st.next.push_back(Piece{p.begin + at, p.end, kNoId, 0});
    }
    std::swap(st.pieces, st.next);
  }

  // 3. Pre-tokenizer.
  if (pre) pre->apply(st);

  // 4. Model.
  for (const Piece& p : st.pieces) {
    if (p.id != kNoId) {
      ids.push_back(p.id);
      if (starts) starts->push_back(p.orig);
      continue;
    }
    if (!starts) {
      model->tokenize(st.view(p), ids, nullptr);
      continue;
    }
    st.word_starts.clear();
    model->tokenize(st.view(p), ids, &st.word_starts);
    for (uint32_t off : st.word_starts) starts->push_back(st.orig[p.begin + off]);
  }

  if (add_special) {
    ids.insert(ids.end(), suffix.begin(), suffix.end());
    if (starts) starts->insert(starts->end(), suffix.size(), uint32_t(text.size()));
  }
}

}  // namespace detail

using detail::TokenizerImpl;

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  const std::string text = read_text_file(tokenizer_json);
  return from_json(std::string_view(text), tokenizer_json.string());
}

Tokenizer Tokenizer::from_json(std::string_view json_text, std::string source_name) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text.begin(), json_text.end());
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(source_name + ": not valid JSON: " + e.what());
  }
  return from_json(j, std::move(source_name));
}

Tokenizer Tokenizer::from_json(const nlohmann::json& j, std::string source_name) {
  auto impl = std::make_unique<TokenizerImpl>();
  impl->source = std::move(source_name);
  try {
    impl->load(j);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(impl->source + ": unexpected JSON: " + e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool add_special) const {
  std::vector<uint32_t> ids;
  impl_->encode(text, add_special, ids, nullptr);
  return ids;
}

void Tokenizer::encode_with_offsets(std::string_view text, bool add_special, std::vector<uint32_t>& ids,
                                    std::vector<uint32_t>& starts) const {
  impl_->encode(text, add_special, ids, &starts);
}

std::vector<std::vector<uint32_t>> Tokenizer::encode_batch(const std::vector<std::string_view>& texts,
                                                           bool add_special, int threads) const {
  std::vector<std::vector<uint32_t>> out(texts.size());
  tbb::task_arena arena(threads > 0 ? threads : tbb::task_arena::automatic);
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, texts.size(), 1), [&](const tbb::blocked_range<size_t>& r) {
      for (size_t i = r.begin(); i < r.end(); ++i) impl_->encode(texts[i], add_special, out[i], nullptr);
    });
  });
  return out;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (uint32_t id : ids) {
    const std::string* s = nullptr;
    if (const auto* a = impl_->added_for_id(id)) {
      s = &a->content;
    } else {
      s = impl_->model->id_to_token(id);
    }
    if (!s) continue;
    if (skip_special_tokens && impl_->special_contents.count(*s)) continue;
    tokens.push_back(*s);
  }
  if (!impl_->decoder) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out += ' ';
      out += tokens[i];
    }
    return out;
  }
  impl_->decoder->apply(tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

uint32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<uint32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(std::string(token)); it != impl_->added_by_content.end()) {
    return it->second;
  }
  const uint32_t id = impl_->model->token_to_id(token);
  if (id == detail::kNoId) return std::nullopt;
  return id;
}

std::optional<std::string> Tokenizer::id_to_token(uint32_t id) const {
  if (const auto* a = impl_->added_for_id(id)) return a->content;
  if (const std::string* s = impl_->model->id_to_token(id)) return *s;
  return std::nullopt;
}

bool Tokenizer::is_special(uint32_t id) const {
  const auto* a = impl_->added_for_id(id);
  return a && a->special;
}

const std::vector<uint32_t>& Tokenizer::special_prefix() const { return impl_->prefix; }
const std::vector<uint32_t>& Tokenizer::special_suffix() const { return impl_->suffix; }

}  // namespace strata::text
