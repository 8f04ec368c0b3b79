// Added tokens: a byte trie searched leftmost-longest (the Rust AddedVocabulary's Aho-Corasick
// with MatchKind::LeftmostLongest), then the single_word, lstrip and rstrip rules of its
// find_matches, with the search resuming after each match as the Aho-Corasick iterator does.
#include "text/tokenizer_pipeline.h"

namespace strata::text::detail {

AddedMatcher::AddedMatcher(const std::vector<std::string>& patterns, std::vector<const AddedToken*> tokens)
    : tokens_(std::move(tokens)) {
  nodes_.emplace_back();  // root
  for (size_t t = 0; t < patterns.size(); ++t) {
    const std::string& pat = patterns[t];
    if (pat.empty()) continue;
    first_[static_cast<uint8_t>(pat[0])] = true;
    uint32_t node = 0;
    for (char c : pat) {
      const uint64_t key = (uint64_t(node) << 8) | static_cast<uint8_t>(c);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        nodes_.emplace_back();
        it = edges_.emplace(key, uint32_t(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    if (nodes_[node].token < 0) nodes_[node].token = int32_t(t);  // the first pattern wins a tie
  }
}

uint32_t AddedMatcher::child(uint32_t node, uint8_t byte) const {
  auto it = edges_.find((uint64_t(node) << 8) | byte);
  return it == edges_.end() ? 0 : it->second;
}

void AddedMatcher::find(std::string_view s, std::vector<Match>& out) const {
  const auto* u = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t pos = 0;
  size_t start_offset = 0;  // end of the last accepted match (Rust's start_offset)
  while (pos < n) {
    // Leftmost start with any match, longest match there.
    size_t start = n, stop = 0;
    int32_t token = -1;
    for (size_t p = pos; p < n; ++p) {
      if (!first_[u[p]]) continue;
      uint32_t node = 0;
      for (size_t q = p; q < n; ++q) {
        node = child(node, u[q]);
        if (node == 0) break;
        if (nodes_[node].token >= 0) {
          token = nodes_[node].token;
          stop = q + 1;
        }
      }
      if (token >= 0) {
        start = p;
        break;
      }
    }
    if (token < 0) break;
    pos = stop;  // the search goes on after the raw match, whatever happens to it below
    const AddedToken& tok = *tokens_[size_t(token)];
    size_t b = start, e = stop;
    if (tok.single_word) {
      int len;
      const bool start_space = b == 0 || !is_word_char(decode_utf8_before(s, b, &len));
      const bool stop_space = e == n || !is_word_char(decode_utf8(s.data() + e, &len));
      if (!start_space || !stop_space) continue;
    }
    if (tok.lstrip) {
      size_t nb = b;
      while (nb > 0) {
        int len;
        const uint32_t cp = decode_utf8_before(s, nb, &len);
        if (!is_white_space(cp)) break;
        nb -= size_t(len);
      }
      b = std::max(nb, start_offset);
    }
    if (tok.rstrip) {
      while (e < n) {
        int len;
        const uint32_t cp = decode_utf8(s.data() + e, &len);
        if (!is_white_space(cp)) break;
        e += size_t(len);
      }
    }
    out.push_back(Match{uint32_t(b), uint32_t(e), tok.id});
    start_offset = e;
  }
}

}  // namespace strata::text::detail
