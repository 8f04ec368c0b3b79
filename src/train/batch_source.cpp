// The three batch sources and the one place that picks between them.
#include "src/train/batch_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "src/train/corpus.h"
#include "src/train/options.h"

namespace strata {
namespace fs = std::filesystem;

nlohmann::json BatchSource::position() const { return nullptr; }
void BatchSource::restore(const nlohmann::json&, const std::string&) {}

namespace {

std::string shard_count(const std::vector<fs::path>& files) {
  return fmt::format("{} shard{}", files.size(), files.size() == 1 ? "" : "s");
}

// A token stream cut into windows (llm.c): every target is trained.
class StreamBatches final : public BatchSource {
 public:
  StreamBatches(std::vector<fs::path> files, std::unique_ptr<EmbeddedCorpusShard> corpus, std::string description,
                int64_t batch, int64_t seq, int rank, int world, int64_t vocab)
      : corpus_(std::move(corpus)),
        loader_(corpus_ ? std::vector<fs::path>{corpus_->path()} : files, batch, seq, rank, world, vocab),
        description_(std::move(description)),
        global_(batch * seq * world) {}
  int64_t next(const RowBatch& rows) override {
    loader_.next(rows.inputs, rows.targets);
    return global_;
  }
  std::string describe() const override { return description_; }
  nlohmann::json position() const override {
    return {{"shard", loader_.shard_index()}, {"position", loader_.position()}};
  }
  void restore(const nlohmann::json& recorded, const std::string& data_flag) override {
    const nlohmann::json& d = recorded.at("data");
    if (d.is_null()) return;
    if (d.contains("epoch"))
      throw std::runtime_error("the checkpoint was trained on documents (rows from NAME.docs), but this --data is a "
                               "token stream; resume with the --data the checkpoint was trained on");
    const int64_t shard = d.at("shard").get<int64_t>(), position = d.at("position").get<int64_t>();
    try {
      loader_.seek(shard, position);
    } catch (const std::invalid_argument&) {
      const auto& f = recorded.contains("flags") ? recorded["flags"] : nlohmann::json::object();
      const std::string was = f.is_object() && f.contains("data") && f["data"].is_string()
                                  ? "'" + f["data"].get<std::string>() + "'"
                                  : std::string("its data");
      throw std::runtime_error(fmt::format(
          "the checkpoint stopped at token {} of shard {} of {}, which this run's --data '{}' does not have (a "
          "different dataset?); resume with the --data the checkpoint was trained on",
          position, shard + 1, was, data_flag.empty() ? "(embedded corpus)" : data_flag));
    }
  }
  void rewind() override { loader_.reset(); }
  int64_t batches_per_pass() const override { return loader_.windows_per_pass(); }

 private:
  std::unique_ptr<EmbeddedCorpusShard> corpus_;  // the embedded corpus as a shard (removed after)
  DataLoader loader_;
  std::string description_;
  int64_t global_;  // targets per global micro-batch
};

// Rows from documents, with their loss masks.
class DocumentBatches final : public BatchSource {
 public:
  DocumentBatches(const std::vector<fs::path>& files, const DocRowsOptions& d, const std::string& data_flag)
      : rows_(files, d) {
    description_ = fmt::format("{} ({}, {} documents, {} tokens{}): rows from documents, {}{}", data_flag,
                               shard_count(files), rows_.n_documents(), rows_.n_tokens(),
                               rows_.has_mask() ? ", loss mask" : "",
                               d.pack ? "packed (attention inside each document)"
                                      : "one per row (cut to --seq + 1 tokens, padded)",
                               d.shuffle ? ", shuffled each epoch" : "");
    seq_ = d.seq;
  }
  bool documents() const override { return true; }
  int64_t next(const RowBatch& rows) override { return rows_.next(rows); }
  std::string describe() const override { return description_; }
  nlohmann::json position() const override {
    const DocPosition p = rows_.position();
    return {{"epoch", p.epoch}, {"document", p.doc}, {"offset", p.offset}, {"documents", rows_.n_documents()}};
  }
  void restore(const nlohmann::json& recorded, const std::string& data_flag) override {
    const nlohmann::json& d = recorded.at("data");
    if (d.is_null() || !d.contains("epoch") || d.at("documents").get<int64_t>() != rows_.n_documents())
      throw std::runtime_error(fmt::format(
          "the checkpoint was trained on {}, not on this --data '{}' of {} documents; resume with the --data the "
          "checkpoint was trained on",
          d.is_object() && d.contains("documents")
              ? fmt::format("a data set of {} documents", d["documents"].get<int64_t>())
              : std::string("a token stream"),
          data_flag, rows_.n_documents()));
    try {
      rows_.seek({d.at("epoch").get<int64_t>(), d.at("document").get<int64_t>(), d.at("offset").get<int64_t>()});
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(std::string(e.what()) + "; resume with the --data and --pack the checkpoint was trained on");
    }
  }
  void rewind() override { rows_.seek({}); }
  int64_t batches_per_pass() const override { return INT64_MAX; }
  bool done() const override { return rows_.done(); }
  std::string losses() const override {
    if (rows_.truncated_documents() == 0) return "";
    return fmt::format("{} documents longer than --seq + 1 = {} tokens were cut ({} tokens not trained; --pack on "
                       "keeps them)",
                       rows_.truncated_documents(), seq_ + 1, rows_.truncated_tokens());
  }
  int64_t rows_for_epochs(int64_t epochs) const override { return rows_.rows_for_epochs(epochs); }

 private:
  DocRowLoader rows_;
  std::string description_;
  int64_t seq_ = 0;
};

// Fixed tokens, uniform over the vocabulary, drawn once from the seed (and the rank): the same
// grad_accum micro-batches every step.
class SyntheticBatches final : public BatchSource {
 public:
  SyntheticBatches(const TrainOptions& o, int rank, int world, int64_t vocab)
      : n_(o.batch * o.seq), accum_(o.grad_accum), global_(o.batch * o.seq * world) {
    tokens_.resize(static_cast<size_t>(accum_ * 2 * n_));
    uint64_t s = (o.seed + static_cast<uint64_t>(rank) * 0x2545f4914f6cdd1dull) * 0x9e3779b97f4a7c15ull + 1;
    for (int32_t& t : tokens_) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      t = static_cast<int32_t>(s % static_cast<uint64_t>(vocab));
    }
  }
  int64_t next(const RowBatch& rows) override {
    const int32_t* k = tokens_.data() + next_ * 2 * n_;
    std::copy(k, k + n_, rows.inputs);
    std::copy(k + n_, k + 2 * n_, rows.targets);
    next_ = (next_ + 1) % accum_;
    return global_;
  }
  std::string describe() const override { return "synthetic (fixed random tokens)"; }
  int64_t batches_per_pass() const override { return accum_; }

 private:
  int64_t n_, accum_, global_;
  int64_t next_ = 0;  // the micro-batch next() hands out
  std::vector<int32_t> tokens_;  // (accum, 2, B·T)
};

}  // namespace

std::unique_ptr<BatchSource> make_batch_source(const TrainOptions& o, const std::vector<fs::path>& files,
                                               bool documents, bool validation, int rank, int world, int64_t vocab) {
  const std::string& flag = validation ? o.val_data : o.data;
  if (documents) {
    DocRowsOptions d{o.batch, o.seq, rank, world, vocab, o.pack == "on", o.shuffle, o.seed, o.epochs};
    if (validation) d.shuffle = false, d.seed = 0, d.epochs = 1;
    return std::make_unique<DocumentBatches>(files, d, flag);
  }
  if (!validation && o.synthetic_data) return std::make_unique<SyntheticBatches>(o, rank, world, vocab);
  if (!validation && o.data.empty()) {
    if (vocab < 256)
      throw std::invalid_argument("the embedded corpus is byte-level (256 token ids) but the model's vocab_size is " +
                                  std::to_string(vocab) + "; pass --data");
    auto corpus = std::make_unique<EmbeddedCorpusShard>();
    std::string what = fmt::format("embedded corpus ({} byte-level tokens)", corpus->n_tokens());
    return std::make_unique<StreamBatches>(std::vector<fs::path>{}, std::move(corpus), std::move(what), o.batch, o.seq,
                                           rank, world, vocab);
  }
  return std::make_unique<StreamBatches>(files, nullptr, fmt::format("{} ({})", flag, shard_count(files)), o.batch,
                                         o.seq, rank, world, vocab);
}

}  // namespace strata
