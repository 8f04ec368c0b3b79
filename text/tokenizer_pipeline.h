// The stages of encoding and decoding between the JSON and the BPE model: added-token matching,
// normalizers, pre-tokenizers, decoders. Text moves through an EncodeState: one byte buffer that
// holds the normalized and rewritten pieces, and (when offsets are wanted) for each of its bytes
// the offset in the original text of the character it came from.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "text/tokenizer_bpe.h"
#include "text/tokenizer_regex.h"
#include "text/tokenizer_unicode.h"

namespace strata::text::detail {

// A span [begin, end) of EncodeState::buf, or (id != kNoId) an added token found at original
// offset `orig`.
struct Piece {
  uint32_t begin = 0, end = 0;
  uint32_t id = kNoId;
  uint32_t orig = 0;
};

struct EncodeState {
  std::string buf;
  std::vector<uint32_t> orig;  // per byte of buf when track
  bool track = false;
  std::vector<Piece> pieces, next;
  std::vector<std::pair<uint32_t, uint32_t>> spans;  // regex matches, scratch
  std::string scratch;
  std::vector<uint32_t> scratch_orig;
  std::vector<uint32_t> word_starts;

  std::string_view view(const Piece& p) const { return std::string_view(buf).substr(p.begin, p.end - p.begin); }
  // Appends s (with its origins when tracking) and returns its piece.
  Piece append(std::string_view s, const uint32_t* s_orig);
};

// ---------------------------------------------------------------------------------------------
// Normalizers: rewrite text (and, when orig is non-null, its per-byte origins) in place.

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void apply(std::string& text, std::vector<uint32_t>* orig) const = 0;
  virtual bool identity() const { return false; }
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers: split each text piece of st.pieces (added tokens pass through) into st.next,
// dropping empty pieces; then the caller swaps the two.

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void apply(EncodeState& st) const = 0;
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// Emits the pieces of text piece p cut at `spans` (sorted, non-overlapping [s, e) relative to p,
// the matches of a pattern), under behavior, with matches and gaps swapped when invert.
void emit_split(EncodeState& st, const Piece& p, const std::vector<std::pair<uint32_t, uint32_t>>& spans,
                SplitBehavior behavior, bool invert);

// ---------------------------------------------------------------------------------------------
// Added tokens: matched leftmost-longest in a byte trie, then single_word / lstrip / rstrip as
// the Rust AddedVocabulary::find_matches.

struct AddedToken {
  std::string content;
  uint32_t id = kNoId;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

class AddedMatcher {
 public:
  // patterns[i] is matched for token tokens[i].
  AddedMatcher(const std::vector<std::string>& patterns, std::vector<const AddedToken*> tokens);
  bool empty() const { return tokens_.empty(); }
  struct Match {
    uint32_t begin, end, id;
  };
  // The added tokens of sentence, in order (spans may overlap after an rstrip, as in Rust).
  void find(std::string_view sentence, std::vector<Match>& out) const;

 private:
  struct Node {
    int32_t token = -1;  // index into tokens_ of the pattern ending here
  };
  uint32_t child(uint32_t node, uint8_t byte) const;
  std::vector<Node> nodes_;
  std::unordered_map<uint64_t, uint32_t> edges_;  // (node << 8 | byte) -> child
  bool first_[256] = {};
  std::vector<const AddedToken*> tokens_;
};

// ---------------------------------------------------------------------------------------------
// Decoders: rewrite the list of token strings (Rust decode_chain); the result is joined.

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

// ---------------------------------------------------------------------------------------------
// Builders from tokenizer.json objects; `where` names the component in error messages
// ("tokenizer.json: pre_tokenizer"). They throw std::runtime_error for what is unsupported.

struct PipelineFlags {
  bool byte_level = false;        // a ByteLevel pre-tokenizer maps bytes to the printable alphabet
  bool needs_origins = false;     // a stage reads original offsets (Metaspace prepend_scheme first)
};

// Parses j["pattern"], {"String": s} or {"Regex": r}, into a literal or a compiled regex.
void parse_pattern(const nlohmann::json& j, const std::string& where, std::string& literal,
                   std::unique_ptr<Regex>& regex);
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& where);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, const std::string& where,
                                                 PipelineFlags& flags);
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& where);

}  // namespace strata::text::detail
