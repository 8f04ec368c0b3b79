// The BPE model of tokenizer.json: vocab, merges, byte fallback, unknown tokens, and the merge loop
// of the Rust `Word::merge_all` (lowest rank first, leftmost among equal ranks). Byte-level vocabs
// are held as raw bytes so encoding never maps bytes to the printable alphabet.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace strata::text::detail {

inline constexpr uint32_t kNoId = 0xFFFFFFFFu;

// A JSON number that is a valid id: an integer in [0, kNoId) (parsed files give unsigned
// integers, objects built in code may hold signed ones).
bool json_is_id(const nlohmann::json& v);

// 64-bit hash of a byte string (for the vocab and the word cache).
uint64_t hash_bytes(const char* p, size_t n);

// Open-addressing map from byte strings (held in an arena) to ids.
class StringIdMap {
 public:
  void reserve(size_t n);
  // False (and nothing changes) when key is already present.
  bool insert(std::string_view key, uint32_t id);
  uint32_t get(std::string_view key) const { return get(key, hash_bytes(key.data(), key.size())); }
  uint32_t get(std::string_view key, uint64_t h) const;
  size_t size() const { return count_; }

 private:
  struct Slot {
    uint32_t off = 0, len = 0, id = kNoId, tag = 0;
  };
  void grow();
  std::string arena_;
  std::vector<Slot> slots_;
  size_t mask_ = 0, count_ = 0;
};

// (left id, right id) -> (rank, merged id), open addressing.
class MergeMap {
 public:
  void reserve(size_t n);
  void set(uint32_t left, uint32_t right, uint32_t rank, uint32_t merged);  // later set wins
  // False when the pair has no merge.
  bool get(uint32_t left, uint32_t right, uint32_t* rank, uint32_t* merged) const {
    if (slots_.empty()) return false;
    const uint64_t key = (uint64_t(left) << 32) | right;
    size_t i = mix(key) & mask_;
    for (;;) {
      const Slot& s = slots_[i];
      if (s.key == key) {
        *rank = s.rank;
        *merged = s.merged;
        return true;
      }
      if (s.key == kEmpty) return false;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return count_; }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t mix(uint64_t k) {
    k ^= k >> 29;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 32;
    return k;
  }
  struct Slot {
    uint64_t key = kEmpty;
    uint32_t rank = 0, merged = 0;
  };
  std::vector<Slot> slots_;
  size_t mask_ = 0, count_ = 0;
};

// A per-thread, direct-mapped memo of merge-table lookups (rank kNoId: no merge).
struct PairCache {
  static constexpr int kBits = 15;
  struct Slot {
    uint64_t key = ~0ull;
    uint32_t rank = 0, merged = 0;
  };
  Slot slots[size_t(1) << kBits];
};

struct BpeSymbol {
  uint32_t id;
  uint32_t len;  // bytes of the word it covers
};

class BpeModel {
 public:
  // Builds from tokenizer.json's "model" object; `where` prefixes error messages. byte_level: the
  // pre-tokenizer maps bytes to GPT-2's alphabet, so the model is fed raw bytes instead.
  BpeModel(const nlohmann::json& model, bool byte_level, const std::string& where);
  ~BpeModel();

  // Appends the ids of one pre-token (and, when starts is non-null, each token's byte offset in
  // word). Throws when an unknown character needs an unk_token that is not in the vocab.
  void tokenize(std::string_view word, std::vector<uint32_t>& ids, std::vector<uint32_t>* starts) const;

  uint32_t token_to_id(std::string_view token) const { return file_vocab_.get(token); }
  // The token as the file spells it, or nullptr.
  const std::string* id_to_token(uint32_t id) const {
    return id < id_to_token_.size() && id_valid_[id] ? &id_to_token_[id] : nullptr;
  }
  uint32_t max_id() const { return max_id_; }  // kNoId for an empty vocab
  size_t vocab_count() const { return file_vocab_.size(); }
  bool byte_level() const { return byte_level_; }

  // The merge loop on initial symbols, in place (tests compare the two variants). force: 0 picks by
  // length, 1 the array scan, 2 the heap.
  void merge(std::vector<BpeSymbol>& syms, int force = 0, PairCache* pc = nullptr) const;

 private:
  void initial_symbols(std::string_view word, std::vector<BpeSymbol>& syms) const;
  void initial_symbols_slow(std::string_view word, std::vector<BpeSymbol>& syms) const;
  void merge_scan(std::vector<BpeSymbol>& syms, PairCache* pc) const;
  void merge_heap(std::vector<BpeSymbol>& syms, PairCache* pc) const;
  bool pair_merge(PairCache* pc, uint32_t left, uint32_t right, uint32_t* rank, uint32_t* merged) const;
  uint32_t char_id(uint32_t cp, std::string_view s) const;

  std::string where_;
  bool byte_level_ = false;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool has_unk_ = false;
  std::string unk_token_;
  uint32_t unk_id_ = kNoId;  // kNoId when has_unk_ but the token is not in the vocab
  uint32_t max_id_ = kNoId;
  uint64_t instance_ = 0;  // key of this model's per-thread word caches

  StringIdMap file_vocab_;  // tokens as the file spells them
  StringIdMap byte_vocab_;  // byte-level vocabs: raw bytes -> id (only tokens of the alphabet)
  const StringIdMap* lookup_ = nullptr;  // the map keyed like the model's input
  MergeMap merges_;
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> id_valid_;
  uint32_t byte_atom_[256];        // byte-level: id of each single byte, or kNoId
  uint32_t fallback_id_[256];      // id of "<0xNN>", or kNoId
  std::vector<uint32_t> bmp_ids_;  // char mode: id of each single BMP character, or kNoId
};

}  // namespace strata::text::detail
