// Rows from documents: layout (which pieces of which documents fill a row) from lengths alone,
// then tokens, targets, positions and segments for this rank's rows.
#include "src/data/doc_rows.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "src/data/doc_shards.h"

namespace strata {
namespace fs = std::filesystem;

bool shards_have_documents(const std::vector<fs::path>& shards) {
  size_t with = 0;
  for (const fs::path& s : shards) with += fs::exists(shard_docs_path(s)) ? 1 : 0;
  if (with == 0 || with == shards.size()) return with > 0;
  for (const fs::path& s : shards)
    if (!fs::exists(shard_docs_path(s)))
      throw std::runtime_error(s.string() + ": has no document offsets (" + shard_docs_path(s).filename().string() +
                               ") but other shards of the data set have: rows would be cut from a stream for some "
                               "shards and built from documents for others; write the whole set with `strata data`");
  return true;
}

struct DocRowLoader::Data {
  std::vector<std::unique_ptr<TokenShard>> shards;
  std::vector<std::vector<uint8_t>> masks;  // per shard; empty: every token trained
  std::vector<int32_t> doc_shard;           // per document (all shards, in order)
  std::vector<int64_t> doc_start, doc_len;  // in its shard
  std::vector<uint32_t> tokens;             // one piece's tokens (scratch)
};

DocRowLoader::DocRowLoader(const std::vector<fs::path>& shards, const DocRowsOptions& o)
    : d_(std::make_unique<Data>()), o_(o) {
  if (shards.empty()) throw std::invalid_argument("DocRowLoader: no token shards given");
  if (o.batch <= 0 || o.seq <= 0) throw std::invalid_argument("DocRowLoader: batch and seq must be positive");
  if (o.world <= 0 || o.rank < 0 || o.rank >= o.world) throw std::invalid_argument("DocRowLoader: rank outside world");
  for (const fs::path& path : shards) {
    d_->shards.push_back(TokenShard::open(path));
    const TokenShard& sh = *d_->shards.back();
    if (const int64_t at = sh.find_token_at_least(static_cast<uint64_t>(o.vocab)); at >= 0)
      throw std::runtime_error(path.string() + ": token " + std::to_string(sh.token(at)) + " at position " +
                               std::to_string(at) + " is >= vocab_size " + std::to_string(o.vocab) +
                               "; the shard was tokenized for a larger vocabulary than the model's");
    const std::vector<int64_t> off = read_shard_docs(path, sh.n_tokens());
    for (size_t k = 0; k + 1 < off.size(); ++k) {
      d_->doc_shard.push_back(static_cast<int32_t>(d_->shards.size() - 1));
      d_->doc_start.push_back(off[k]);
      d_->doc_len.push_back(off[k + 1] - off[k]);
    }
    d_->masks.push_back(fs::exists(shard_mask_path(path)) ? read_shard_mask(path, sh.n_tokens())
                                                          : std::vector<uint8_t>{});
  }
  if (d_->doc_len.empty()) throw std::runtime_error("the data set holds no documents");
}

DocRowLoader::~DocRowLoader() = default;

int64_t DocRowLoader::n_documents() const { return static_cast<int64_t>(d_->doc_len.size()); }
int64_t DocRowLoader::n_tokens() const {
  int64_t n = 0;
  for (const auto& s : d_->shards) n += s->n_tokens();
  return n;
}
bool DocRowLoader::has_mask() const {
  return std::any_of(d_->masks.begin(), d_->masks.end(), [](const auto& m) { return !m.empty(); });
}

// splitmix64: the permutation's random numbers, the same on every machine.
namespace {
uint64_t splitmix(uint64_t& s) {
  s += 0x9e3779b97f4a7c15ull;
  uint64_t z = s;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

// Fisher-Yates from (seed, epoch); the last epoch's order is kept.
const std::vector<int64_t>& DocRowLoader::order(int64_t epoch) const {
  if (order_epoch_ != epoch) {
    const int64_t n = n_documents();
    order_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order_[static_cast<size_t>(i)] = i;
    uint64_t s = o_.seed ^ (0xd1b54a32d192ed03ull * static_cast<uint64_t>(epoch + 1));
    for (int64_t i = n - 1; i > 0; --i) {
      // Unbiased enough for any realistic count (2^64 / n rejection-free modulo bias < 2^-20).
      const auto j = static_cast<int64_t>(splitmix(s) % static_cast<uint64_t>(i + 1));
      std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(j)]);
    }
    order_epoch_ = epoch;
  }
  return order_;
}

int64_t DocRowLoader::doc_at(int64_t epoch, int64_t index) const {
  return o_.shuffle ? order(epoch)[static_cast<size_t>(index)] : index;
}

void DocRowLoader::next_row(DocPosition& p, std::vector<Piece>& row, int64_t epochs, int64_t* truncated) const {
  row.clear();
  if (epochs > 0 && p.epoch >= epochs) return;  // past the last epoch: padding
  const int64_t cap = o_.seq + 1, n_docs = n_documents();
  int64_t free = cap;
  const auto advance = [&] {
    p.offset = 0;
    if (++p.doc == n_docs) ++p.epoch, p.doc = 0;
  };
  while (free > 0 && !(epochs > 0 && p.epoch >= epochs)) {
    const int64_t d = doc_at(p.epoch, p.doc);
    const int64_t rest = d_->doc_len[static_cast<size_t>(d)] - p.offset;
    if (!o_.pack) {
      const int64_t take = std::min(rest, cap);
      if (rest > cap && truncated) ++truncated[0], truncated[1] += rest - cap;
      row.push_back({d, 0, take});
      advance();
      return;
    }
    if (rest <= free) {
      row.push_back({d, p.offset, rest});
      free -= rest;
      advance();
    } else if (free == cap) {  // longer than a row: a row-sized piece
      row.push_back({d, p.offset, cap});
      p.offset += cap;
      return;
    } else {
      return;  // starts the next row
    }
  }
}

// The one rule: token j of a piece is a trained target (of slot j - 1) when it is not the
// piece's first and its mask says so (no mask: every token).
bool DocRowLoader::trains(const Piece& pc, int64_t j) const {
  const auto& mask = d_->masks[static_cast<size_t>(d_->doc_shard[static_cast<size_t>(pc.doc)])];
  return j >= 1 && j < pc.len &&
         (mask.empty() || mask[static_cast<size_t>(d_->doc_start[static_cast<size_t>(pc.doc)] + pc.first + j)]);
}

int64_t DocRowLoader::trained_in(const std::vector<Piece>& row) const {
  int64_t n = 0;
  for (const Piece& pc : row)
    for (int64_t j = 1; j < pc.len; ++j) n += trains(pc, j);
  return n;
}

void DocRowLoader::fill_row(const std::vector<Piece>& row, int64_t r, const RowBatch& out) {
  const int64_t T = o_.seq, base = r * T;
  int64_t s = 0;  // the slot of the piece's first token
  for (const Piece& pc : row) {
    const size_t sh = static_cast<size_t>(d_->doc_shard[static_cast<size_t>(pc.doc)]);
    const int64_t at = d_->doc_start[static_cast<size_t>(pc.doc)] + pc.first;
    d_->tokens.resize(static_cast<size_t>(pc.len));
    d_->shards[sh]->read_tokens(at, pc.len, d_->tokens.data());
    for (int64_t j = 0; j < pc.len && s + j < T; ++j) {
      const int64_t i = base + s + j;
      out.inputs[i] = static_cast<int32_t>(d_->tokens[static_cast<size_t>(j)]);
      out.pos[i] = static_cast<int32_t>(j);
      out.seg[i] = static_cast<int32_t>(s);
      out.targets[i] = trains(pc, j + 1) ? static_cast<int32_t>(d_->tokens[static_cast<size_t>(j + 1)]) : -1;
    }
    s += pc.len;
  }
  for (; s < T; ++s) {  // padding
    const int64_t i = base + s;
    out.inputs[i] = 0;
    out.targets[i] = -1;
    out.pos[i] = 0;
    out.seg[i] = static_cast<int32_t>(s);
  }
}

int64_t DocRowLoader::next(const RowBatch& out) {
  std::vector<Piece> row;
  int64_t trained = 0;
  for (int64_t r = 0; r < o_.world * o_.batch; ++r) {
    next_row(pos_, row, o_.epochs, truncated_);
    trained += trained_in(row);
    if (r / o_.batch == o_.rank) fill_row(row, r % o_.batch, out);
  }
  return trained;
}

void DocRowLoader::seek(const DocPosition& p) {
  const int64_t n = n_documents();
  if (p.epoch < 0 || p.doc < 0 || p.doc >= n || p.offset < 0 ||
      p.offset >= d_->doc_len[static_cast<size_t>(doc_at(p.epoch, p.doc))] || (!o_.pack && p.offset != 0))
    throw std::invalid_argument("DocRowLoader::seek: epoch " + std::to_string(p.epoch) + ", document " +
                                std::to_string(p.doc) + ", offset " + std::to_string(p.offset) +
                                " is not a position of this data set of " + std::to_string(n) + " documents");
  pos_ = p;
}

int64_t DocRowLoader::rows_for_epochs(int64_t epochs) const {
  DocPosition p;
  std::vector<Piece> row;
  int64_t rows = 0;
  while (p.epoch < epochs) next_row(p, row, epochs, nullptr), ++rows;
  return rows;
}

}  // namespace strata
