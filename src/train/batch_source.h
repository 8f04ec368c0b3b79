// BatchSource: where a run's micro-batches come from, chosen once (make_batch_source) for the
// training data and once for the held-out data: a token stream cut into windows as llm.c does
// (token shards, or the embedded byte-level corpus), rows built from documents with their loss
// masks (src/data/doc_rows.h), or fixed random tokens (benches). The trainer only fills rows,
// counts trained targets, and saves and restores the position.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "src/data/doc_rows.h"

namespace strata {

struct TrainOptions;

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Rows carry positions and segment starts (RowBatch::pos, seg): rows from documents.
  virtual bool documents() const { return false; }
  // This rank's rows of the next global micro-batch into `rows` (inputs and targets; positions
  // and segment starts when documents()); returns the targets ALL ranks' rows of it train.
  virtual int64_t next(const RowBatch& rows) = 0;
  // One line for the header: what the rows are made of.
  virtual std::string describe() const = 0;
  // Where the next row starts, as a checkpoint records it (null: nothing to record), and back.
  // `recorded` is the checkpoint's whole trainer state (its "data", and the flags it ran with, for
  // the error when the data differs); `data_flag` names this run's data in that error.
  virtual nlohmann::json position() const;
  virtual void restore(const nlohmann::json& recorded, const std::string& data_flag);
  // Validation: back to the first row; micro-batches in one pass (INT64_MAX: until done()).
  virtual void rewind() {}
  virtual int64_t batches_per_pass() const = 0;
  virtual bool done() const { return false; }
  // For the summary line: what the source dropped (documents cut to --seq + 1 tokens), or "".
  virtual std::string losses() const { return ""; }
  // Documents: the rows `epochs` whole epochs make (sets the run's length with --epochs).
  virtual int64_t rows_for_epochs(int64_t /*epochs*/) const { return 0; }
};

// The training data of a run (`files` from --data; none: the embedded corpus, or synthetic rows
// with o.synthetic_data), or with `validation` its held-out data (`files` from --val-data: one
// pass, never shuffled). `documents`: the shards carry document offsets.
std::unique_ptr<BatchSource> make_batch_source(const TrainOptions& o, const std::vector<std::filesystem::path>& files,
                                               bool documents, bool validation, int rank, int world, int64_t vocab);

}  // namespace strata
