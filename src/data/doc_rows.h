// Rows built from documents (DESIGN.md "Token data", README "Rows from documents"): what
// `strata train` feeds the model when its shards carry document boundaries (NAME.docs, and
// usually a loss mask NAME.mask: src/data/doc_shards.h).
//
// A row has T + 1 token slots: the inputs are slots [0, T), the target of slot i is the token
// in slot i + 1 when both belong to the same piece of a document (else -1: not trained), and
// only if that token is trained (mask 1; every token without a mask). Each input slot also has
// its position (its index inside its piece: positions restart at 0 for each document) and its
// segment start (the slot of its piece's first token: attention sees keys [seg_start, i]).
//   pack off: one document per row, cut to its first T + 1 tokens (a truncation, counted),
//             the rest of the row padding;
//   pack on:  documents in order, first fit: a document that does not fit in the rest of the
//             current row starts the next one; a document longer than a row is cut into
//             row-sized pieces (each its own sequence: positions restart, no target crosses).
// Padding slots hold token 0, target -1, position 0 and a segment of their own (they see only
// themselves, and no real token sees them), so they are never trained and never attended to.
//
// Order: the documents of all shards in order, or with shuffle a permutation of them drawn
// from (seed, epoch) once per epoch; epochs follow each other without a gap (a row may hold the
// end of one epoch and the start of the next). The global micro-batch is the next world · B
// rows; rank r takes rows [r·B, (r+1)·B). The position (epoch, document, offset) is the whole
// state: seek() to it and the same rows follow, bit for bit.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "src/data/token_shards.h"

namespace strata {

struct DocRowsOptions {
  int64_t batch = 1, seq = 1;
  int rank = 0, world = 1;
  int64_t vocab = 0;
  bool pack = false;
  bool shuffle = false;
  uint64_t seed = 0;
  int64_t epochs = 0;  // > 0: after this many epochs every row is padding (nothing trained)
};

// Where the next row starts: the epoch, the index into that epoch's document order, and the
// tokens of that document already placed (a document split over rows).
struct DocPosition {
  int64_t epoch = 0, doc = 0, offset = 0;
  bool operator==(const DocPosition&) const = default;
};

// One micro-batch of rows: (B · T) each, this rank's B rows.
struct RowBatch {
  int32_t* inputs = nullptr;
  int32_t* targets = nullptr;
  int32_t* pos = nullptr;
  int32_t* seg = nullptr;
};

// True when every shard has a NAME.docs sidecar; false when none has; throws naming a shard
// when only some have (a mixed set would silently change how rows are made).
bool shards_have_documents(const std::vector<std::filesystem::path>& shards);

class DocRowLoader {
 public:
  // Opens the shards, reads their sidecars (the mask, where there is one) and checks every
  // token id < vocab once, naming the shard, position and id of one that is not.
  DocRowLoader(const std::vector<std::filesystem::path>& shards, const DocRowsOptions& o);
  ~DocRowLoader();
  DocRowLoader(const DocRowLoader&) = delete;
  DocRowLoader& operator=(const DocRowLoader&) = delete;

  // The next global micro-batch: this rank's rows into `out`; returns the number of trained
  // targets in ALL ranks' rows of it (every rank computes the same number).
  int64_t next(const RowBatch& out);
  DocPosition position() const { return pos_; }
  void seek(const DocPosition& p);  // throws std::invalid_argument when p is outside the data

  int64_t n_documents() const;
  int64_t n_tokens() const;
  int64_t truncated_documents() const { return truncated_[0]; }  // pack off: cut to T + 1 so far
  int64_t truncated_tokens() const { return truncated_[1]; }
  bool has_mask() const;
  // Rows that `epochs` whole epochs make from the start (lengths only; reads no tokens).
  int64_t rows_for_epochs(int64_t epochs) const;
  // True once every row of the options' epochs has been handed out (epochs > 0).
  bool done() const { return o_.epochs > 0 && pos_.epoch >= o_.epochs; }

 private:
  struct Data;
  struct Piece {
    int64_t doc = 0;  // global document index
    int64_t first = 0, len = 0;
  };
  // Lays out the next row's pieces from p, advancing p; nothing once p is past `epochs` (> 0).
  // truncated (pack off): documents cut, tokens dropped, added to when not null.
  void next_row(DocPosition& p, std::vector<Piece>& row, int64_t epochs, int64_t* truncated) const;
  int64_t doc_at(int64_t epoch, int64_t index) const;  // the document at `index` of epoch's order
  const std::vector<int64_t>& order(int64_t epoch) const;
  void fill_row(const std::vector<Piece>& row, int64_t r, const RowBatch& out);
  bool trains(const Piece& pc, int64_t j) const;
  int64_t trained_in(const std::vector<Piece>& row) const;

  std::unique_ptr<Data> d_;
  DocRowsOptions o_;
  DocPosition pos_;
  int64_t truncated_[2] = {0, 0};  // documents, tokens
  mutable int64_t order_epoch_ = -1;
  mutable std::vector<int64_t> order_;
};

}  // namespace strata
