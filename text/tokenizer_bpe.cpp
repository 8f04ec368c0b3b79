// BPE: loading vocab and merges (both merge spellings), the per-thread word cache, initial symbols
// (bytes, characters, byte fallback, unknown tokens as the Rust `merge_word`), and the merge loop:
// an array scan for short words, a heap over linked symbols (the Rust `Word::merge_all`) for long
// ones. Both give the Rust result: repeatedly merge the lowest-rank pair, leftmost among equals.
#include "text/tokenizer_bpe.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "text/tokenizer_unicode.h"

namespace strata::text::detail {

bool json_is_id(const nlohmann::json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < int64_t(kNoId);
}

uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t(n) * 0xff51afd7ed558ccdull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * 0x94d049bb133111ebull;
    h ^= h >> 29;
  }
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 32;
  return h;
}

// ---------------------------------------------------------------------------------------------
// StringIdMap, MergeMap

void StringIdMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  if (cap <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  for (const Slot& s : old) {
    if (s.id == kNoId) continue;
    const uint64_t h = hash_bytes(arena_.data() + s.off, s.len);
    size_t i = h & mask_;
    while (slots_[i].id != kNoId) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

void StringIdMap::grow() { reserve(std::max<size_t>(16, count_ * 2 + 2)); }

bool StringIdMap::insert(std::string_view key, uint32_t id) {
  if ((count_ + 1) * 2 > slots_.size()) grow();
  const uint64_t h = hash_bytes(key.data(), key.size());
  const uint32_t tag = uint32_t(h >> 32);
  size_t i = h & mask_;
  while (slots_[i].id != kNoId) {
    const Slot& s = slots_[i];
    if (s.tag == tag && s.len == key.size() && std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0) {
      return false;
    }
    i = (i + 1) & mask_;
  }
  slots_[i] = Slot{uint32_t(arena_.size()), uint32_t(key.size()), id, tag};
  arena_.append(key);
  ++count_;
  return true;
}

uint32_t StringIdMap::get(std::string_view key, uint64_t h) const {
  if (slots_.empty()) return kNoId;
  const uint32_t tag = uint32_t(h >> 32);
  size_t i = h & mask_;
  for (;;) {
    const Slot& s = slots_[i];
    if (s.id == kNoId) return kNoId;
    if (s.tag == tag && s.len == key.size() && std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0) {
      return s.id;
    }
    i = (i + 1) & mask_;
  }
}

void MergeMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  if (cap <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(cap, Slot{});
  mask_ = cap - 1;
  for (const Slot& s : old) {
    if (s.key == kEmpty) continue;
    size_t i = mix(s.key) & mask_;
    while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

void MergeMap::set(uint32_t left, uint32_t right, uint32_t rank, uint32_t merged) {
  if ((count_ + 1) * 2 > slots_.size()) reserve(std::max<size_t>(16, count_ * 2 + 2));
  const uint64_t key = (uint64_t(left) << 32) | right;
  size_t i = mix(key) & mask_;
  while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask_;
  if (slots_[i].key == kEmpty) ++count_;
  slots_[i] = Slot{key, rank, merged};
}

// ---------------------------------------------------------------------------------------------
// Per-thread word cache: pre-token bytes -> ids, direct-mapped, for words of up to kKeyMax bytes
// that become at most kMaxIds tokens. A model's caches are found by its instance number.

namespace {

constexpr size_t kKeyMax = 22;
constexpr size_t kMaxIds = 8;
constexpr size_t kCacheSlots = 1 << 14;
constexpr size_t kCachesPerThread = 4;
// Words longer than this many symbols merge with the heap.
constexpr size_t kScanMax = 48;

struct CacheEntry {
  uint64_t hash = 0;
  uint8_t key_len = 0xFF;  // 0xFF: empty
  uint8_t n_ids = 0;
  char key[kKeyMax];
  uint32_t ids[kMaxIds];
};
static_assert(sizeof(CacheEntry) == 64);

}  // namespace

// A model's per-thread caches: words, and merge-table lookups (the table of a large vocab does not
// fit in cache, and the same pairs recur throughout a document).
struct ModelCache {
  CacheEntry words[kCacheSlots];
  PairCache pairs;
};

namespace {

struct ThreadCaches {
  std::vector<std::pair<uint64_t, std::unique_ptr<ModelCache>>> caches;
  ModelCache* get(uint64_t instance) {
    for (auto& [id, c] : caches) {
      if (id == instance) return c.get();
    }
    if (caches.size() >= kCachesPerThread) caches.erase(caches.begin());
    caches.emplace_back(instance, std::make_unique<ModelCache>());
    return caches.back().second.get();
  }
};

ModelCache* thread_model_cache(uint64_t instance) {
  thread_local ThreadCaches caches;
  return caches.get(instance);
}

std::atomic<uint64_t> g_next_instance{1};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Loading

BpeModel::BpeModel(const nlohmann::json& m, bool byte_level, const std::string& where)
    : where_(where), byte_level_(byte_level), instance_(g_next_instance.fetch_add(1)) {
  auto fail = [&](const std::string& msg) { throw std::runtime_error(where_ + ": model: " + msg); };
  auto get_bool = [&](const char* key, bool dflt) {
    auto it = m.find(key);
    if (it == m.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) fail(std::string("'") + key + "' must be true or false");
    return it->get<bool>();
  };
  auto get_opt_string = [&](const char* key) -> std::optional<std::string> {
    auto it = m.find(key);
    if (it == m.end() || it->is_null()) return std::nullopt;
    if (!it->is_string()) fail(std::string("'") + key + "' must be a string or null");
    return it->get<std::string>();
  };
  if (auto it = m.find("dropout"); it != m.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 0.0) {
      fail("dropout " + it->dump() + " is not supported (only null or 0: encoding must be deterministic)");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (auto v = get_opt_string(key); v && !v->empty()) {
      fail(std::string("a non-empty ") + key + " ('" + *v + "') is not supported");
    }
  }
  ignore_merges_ = get_bool("ignore_merges", false);
  byte_fallback_ = get_bool("byte_fallback", false);
  fuse_unk_ = get_bool("fuse_unk", false);
  if (auto unk = get_opt_string("unk_token")) {
    has_unk_ = true;
    unk_token_ = *unk;
  }

  // vocab
  auto vit = m.find("vocab");
  if (vit == m.end() || !vit->is_object()) fail("'vocab' is missing or not an object");
  const auto& vocab = *vit;
  file_vocab_.reserve(vocab.size());
  uint32_t max_id = 0;
  bool any = false;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!json_is_id(it.value())) {
      fail("vocab entry '" + it.key() + "' has id " + it.value().dump() + ", not a non-negative 32-bit integer");
    }
    const uint32_t id = it.value().get<uint32_t>();
    if (!file_vocab_.insert(it.key(), id)) fail("vocab token '" + it.key() + "' appears twice");
    max_id = any ? std::max(max_id, id) : id;
    any = true;
  }
  max_id_ = any ? max_id : kNoId;
  if (any) {
    id_to_token_.resize(size_t(max_id) + 1);
    id_valid_.assign(size_t(max_id) + 1, 0);
  }
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const uint32_t id = it.value().get<uint32_t>();
    if (id_valid_[id]) fail("id " + std::to_string(id) + " is given to both '" + id_to_token_[id] + "' and '" + it.key() + "'");
    id_valid_[id] = 1;
    id_to_token_[id] = it.key();
  }

  // The map keyed like the model's input.
  std::fill(std::begin(byte_atom_), std::end(byte_atom_), kNoId);
  if (byte_level_) {
    byte_vocab_.reserve(vocab.size());
    std::string bytes;
    for (uint32_t id = 0; id < id_to_token_.size(); ++id) {
      if (id_valid_[id] && byte_level_to_bytes(id_to_token_[id], bytes)) byte_vocab_.insert(bytes, id);
    }
    lookup_ = &byte_vocab_;
    for (int b = 0; b < 256; ++b) byte_atom_[b] = byte_vocab_.get(std::string_view(reinterpret_cast<const char*>(&b), 1));
  } else {
    lookup_ = &file_vocab_;
    bmp_ids_.assign(0x10000, kNoId);
    for (uint32_t id = 0; id < id_to_token_.size(); ++id) {
      if (!id_valid_[id]) continue;
      const std::string& t = id_to_token_[id];
      if (t.empty()) continue;
      int len;
      const uint32_t cp = decode_utf8(t.data(), &len);
      if (size_t(len) == t.size() && cp < 0x10000) bmp_ids_[cp] = id;
    }
  }
  for (int b = 0; b < 256; ++b) {
    char code[8];
    std::snprintf(code, sizeof code, "<0x%02X>", b);
    fallback_id_[b] = lookup_->get(code);
  }
  if (has_unk_) unk_id_ = lookup_->get(unk_token_);

  // merges: "a b" strings or ["a", "b"] pairs; the rank is the position (a later duplicate wins,
  // as in the Rust HashMap).
  auto mit = m.find("merges");
  if (mit == m.end() || mit->is_null()) {
    fail("'merges' is missing");
  }
  if (!mit->is_array()) fail("'merges' is not an array");
  merges_.reserve(mit->size());
  uint32_t rank = 0;
  int form = 0;  // 1 strings, 2 pairs
  std::string merged;
  for (const auto& e : *mit) {
    std::string_view a, b;
    std::string tmp;
    if (e.is_string()) {
      if (form == 2) fail("'merges' mixes \"a b\" strings and [a, b] pairs");
      form = 1;
      const std::string& s = e.get_ref<const std::string&>();
      if (s.rfind("#version", 0) == 0) continue;
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        fail("merge " + std::to_string(rank + 1) + " ('" + s + "') is not two tokens separated by one space");
      }
      a = std::string_view(s).substr(0, sp);
      b = std::string_view(s).substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      if (form == 1) fail("'merges' mixes \"a b\" strings and [a, b] pairs");
      form = 2;
      a = e[0].get_ref<const std::string&>();
      b = e[1].get_ref<const std::string&>();
    } else {
      fail("merge " + std::to_string(rank + 1) + " is " + e.dump() + ", not \"a b\" or [\"a\", \"b\"]");
    }
    const uint32_t ia = file_vocab_.get(a), ib = file_vocab_.get(b);
    if (ia == kNoId) fail("merge " + std::to_string(rank + 1) + " names '" + std::string(a) + "', which is not in the vocab");
    if (ib == kNoId) fail("merge " + std::to_string(rank + 1) + " names '" + std::string(b) + "', which is not in the vocab");
    merged.assign(a);
    merged.append(b);
    const uint32_t im = file_vocab_.get(merged);
    if (im == kNoId) fail("merge " + std::to_string(rank + 1) + " makes '" + merged + "', which is not in the vocab");
    merges_.set(ia, ib, rank, im);
    ++rank;
  }
}

BpeModel::~BpeModel() = default;

// ---------------------------------------------------------------------------------------------
// Initial symbols

uint32_t BpeModel::char_id(uint32_t cp, std::string_view s) const {
  if (cp < 0x10000) return bmp_ids_[cp];
  return lookup_->get(s);
}

void BpeModel::initial_symbols(std::string_view w, std::vector<BpeSymbol>& syms) const {
  syms.clear();
  const auto* u = reinterpret_cast<const uint8_t*>(w.data());
  if (byte_level_) {
    for (size_t i = 0; i < w.size(); ++i) {
      const uint32_t id = byte_atom_[u[i]];
      if (id == kNoId) return initial_symbols_slow(w, syms);
      syms.push_back({id, 1});
    }
    return;
  }
  for (size_t i = 0; i < w.size();) {
    int len;
    const uint32_t cp = decode_utf8(w.data() + i, &len);
    const uint32_t id = char_id(cp, w.substr(i, size_t(len)));
    if (id == kNoId) return initial_symbols_slow(w, syms);
    syms.push_back({id, uint32_t(len)});
    i += size_t(len);
  }
}

// The Rust `merge_word` for words with characters outside the vocab: byte fallback, then the
// unknown token (fused or not); without either the character is dropped.
void BpeModel::initial_symbols_slow(std::string_view w, std::vector<BpeSymbol>& syms) const {
  syms.clear();
  bool unk_pending = false;
  BpeSymbol unk{kNoId, 0};
  std::string mapped;
  for (size_t i = 0; i < w.size();) {
    std::string_view s;  // the character as the vocab spells it
    uint32_t byte_len;
    uint32_t id;
    if (byte_level_) {
      byte_len = 1;
      id = byte_atom_[static_cast<uint8_t>(w[i])];
      mapped.clear();
      append_utf8(mapped, kByteToChar[static_cast<uint8_t>(w[i])]);
      s = mapped;
    } else {
      int len;
      const uint32_t cp = decode_utf8(w.data() + i, &len);
      byte_len = uint32_t(len);
      s = w.substr(i, byte_len);
      id = char_id(cp, s);
    }
    i += byte_len;
    if (id != kNoId) {
      if (unk_pending) {
        syms.push_back(unk);
        unk_pending = false;
      }
      syms.push_back({id, byte_len});
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : s) all = all && fallback_id_[static_cast<uint8_t>(c)] != kNoId;
      if (all) {
        // Each "<0xNN>" covers one byte of s; in a byte-level word s stands for one input byte,
        // so all but the last cover nothing (their offsets stay at that byte).
        for (size_t k = 0; k < s.size(); ++k) {
          const uint32_t len = byte_level_ ? (k + 1 == s.size() ? 1 : 0) : 1;
          syms.push_back({fallback_id_[static_cast<uint8_t>(s[k])], len});
        }
        continue;  // as in Rust, a pending unknown token is not flushed here
      }
    }
    if (has_unk_) {
      if (unk_id_ == kNoId) {
        throw std::runtime_error(where_ + ": model: unk_token '" + unk_token_ + "' is not in the vocab");
      }
      if (unk_pending && fuse_unk_) {
        unk.len += byte_len;
      } else {
        if (unk_pending) syms.push_back(unk);
        unk = {unk_id_, byte_len};
        unk_pending = true;
      }
    }
  }
  if (unk_pending) syms.push_back(unk);
}

// ---------------------------------------------------------------------------------------------
// Merging

bool BpeModel::pair_merge(PairCache* pc, uint32_t left, uint32_t right, uint32_t* rank, uint32_t* merged) const {
  if (!pc) return merges_.get(left, right, rank, merged);
  const uint64_t key = (uint64_t(left) << 32) | right;
  PairCache::Slot& s = pc->slots[(key * 0x9E3779B97F4A7C15ull) >> (64 - PairCache::kBits)];
  if (s.key != key) {
    s.key = key;
    if (!merges_.get(left, right, &s.rank, &s.merged)) s.rank = kNoId;
  }
  *rank = s.rank;
  *merged = s.merged;
  return s.rank != kNoId;
}

void BpeModel::merge(std::vector<BpeSymbol>& syms, int force, PairCache* pc) const {
  if (syms.size() < 2 || merges_.size() == 0) return;
  if (force == 1 || (force == 0 && syms.size() <= kScanMax)) {
    merge_scan(syms, pc);
  } else {
    merge_heap(syms, pc);
  }
}

void BpeModel::merge_scan(std::vector<BpeSymbol>& syms, PairCache* pc) const {
  size_t n = syms.size();
  // rank[i], merged[i]: the merge of the pair (i, i+1).
  uint32_t rank_buf[kScanMax], merged_buf[kScanMax];
  std::vector<uint32_t> rank_heap, merged_heap;
  uint32_t* rank = rank_buf;
  uint32_t* merged = merged_buf;
  if (n > kScanMax) {
    rank_heap.resize(n);
    merged_heap.resize(n);
    rank = rank_heap.data();
    merged = merged_heap.data();
  }
  BpeSymbol* s = syms.data();
  auto pair = [&](size_t i) {
    if (!pair_merge(pc, s[i].id, s[i + 1].id, &rank[i], &merged[i])) rank[i] = kNoId;
  };
  for (size_t i = 0; i + 1 < n; ++i) pair(i);
  while (n > 1) {
    size_t best = 0;
    uint32_t best_rank = rank[0];
    for (size_t i = 1; i + 1 < n; ++i) {
      if (rank[i] < best_rank) {
        best_rank = rank[i];
        best = i;
      }
    }
    if (best_rank == kNoId) break;
    s[best].id = merged[best];
    s[best].len += s[best + 1].len;
    std::memmove(s + best + 1, s + best + 2, (n - best - 2) * sizeof(BpeSymbol));
    std::memmove(rank + best, rank + best + 1, (n - best - 2) * sizeof(uint32_t));
    std::memmove(merged + best, merged + best + 1, (n - best - 2) * sizeof(uint32_t));
    --n;
    if (best + 1 < n) pair(best);
    if (best > 0) pair(best - 1);
  }
  syms.resize(n);
}

void BpeModel::merge_heap(std::vector<BpeSymbol>& syms, PairCache* pc) const {
  struct Sym {
    uint32_t id, len;
    int32_t prev, next;
  };
  // A queued merge of the pair (left, right) at pos. It is stale once the pair at pos differs
  // (Rust compares the merged id, which names the same pair: merged ids are vocab ids of a+b).
  struct Cand {
    uint32_t rank, merged, left, right;
    uint32_t pos;
  };
  // std heap is a max-heap: "less" means lower priority (higher rank, then further right).
  auto lower = [](const Cand& a, const Cand& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  const size_t n = syms.size();
  thread_local std::vector<Sym> sym;
  thread_local std::vector<Cand> heap;
  sym.resize(n);
  heap.clear();
  for (size_t i = 0; i < n; ++i) {
    sym[i] = {syms[i].id, syms[i].len, int32_t(i) - 1, i + 1 < n ? int32_t(i + 1) : -1};
  }
  uint32_t r, mg;
  for (size_t i = 0; i + 1 < n; ++i) {
    if (pair_merge(pc, sym[i].id, sym[i + 1].id, &r, &mg)) heap.push_back({r, mg, sym[i].id, sym[i + 1].id, uint32_t(i)});
  }
  std::make_heap(heap.begin(), heap.end(), lower);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), lower);
    const Cand top = heap.back();
    heap.pop_back();
    Sym& cur = sym[top.pos];
    if (cur.id != top.left || cur.next < 0) continue;
    const size_t next_pos = size_t(cur.next);
    const Sym right = sym[next_pos];
    if (right.id != top.right) continue;
    cur.id = top.merged;
    cur.len += right.len;
    cur.next = right.next;
    sym[next_pos].id = kNoId;
    if (right.next >= 0) sym[size_t(right.next)].prev = int32_t(top.pos);
    if (cur.prev >= 0) {
      const uint32_t left_id = sym[size_t(cur.prev)].id;
      if (pair_merge(pc, left_id, cur.id, &r, &mg)) {
        heap.push_back({r, mg, left_id, cur.id, uint32_t(cur.prev)});
        std::push_heap(heap.begin(), heap.end(), lower);
      }
    }
    if (cur.next >= 0) {
      const uint32_t right_id = sym[size_t(cur.next)].id;
      if (pair_merge(pc, cur.id, right_id, &r, &mg)) {
        heap.push_back({r, mg, cur.id, right_id, top.pos});
        std::push_heap(heap.begin(), heap.end(), lower);
      }
    }
  }
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    if (sym[i].id != kNoId) syms[k++] = {sym[i].id, sym[i].len};
  }
  syms.resize(k);
}

// ---------------------------------------------------------------------------------------------
// Tokenize one pre-token

void BpeModel::tokenize(std::string_view w, std::vector<uint32_t>& ids, std::vector<uint32_t>* starts) const {
  if (w.empty()) return;
  if (ignore_merges_) {
    const uint32_t id = lookup_->get(w);
    if (id != kNoId) {
      ids.push_back(id);
      if (starts) starts->push_back(0);
      return;
    }
  }
  ModelCache* mc = thread_model_cache(instance_);
  CacheEntry* entry = nullptr;
  uint64_t h = 0;
  if (!starts && w.size() <= kKeyMax) {
    h = hash_bytes(w.data(), w.size());
    entry = &mc->words[h & (kCacheSlots - 1)];
    if (entry->hash == h && entry->key_len == w.size() && std::memcmp(entry->key, w.data(), w.size()) == 0) {
      ids.insert(ids.end(), entry->ids, entry->ids + entry->n_ids);
      return;
    }
  }
  thread_local std::vector<BpeSymbol> syms;
  initial_symbols(w, syms);
  merge(syms, 0, &mc->pairs);
  uint32_t off = 0;
  for (const BpeSymbol& s : syms) {
    ids.push_back(s.id);
    if (starts) starts->push_back(off);
    off += s.len;
  }
  if (entry && syms.size() <= kMaxIds) {
    entry->hash = h;
    entry->key_len = uint8_t(w.size());
    std::memcpy(entry->key, w.data(), w.size());
    entry->n_ids = uint8_t(syms.size());
    for (size_t i = 0; i < syms.size(); ++i) entry->ids[i] = syms[i].id;
  }
}

}  // namespace strata::text::detail
