// The corpus strata ships for training without --data: deterministic template-generated English
// (a few hundred KB, nothing downloaded), tokenized byte-level (token = byte, vocab 256) into a
// temporary llm.c shard that the DataLoader reads like any other.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include "src/checkpoint/file_util.h"

namespace strata {

// The embedded corpus: the same text on every machine and every run (~`bytes` long).
std::string embedded_corpus_text(size_t bytes = 300 * 1024);

// A byte-level token shard of the embedded corpus in a fresh temporary directory, deleted with
// this object.
class EmbeddedCorpusShard {
 public:
  EmbeddedCorpusShard();
  EmbeddedCorpusShard(const EmbeddedCorpusShard&) = delete;
  EmbeddedCorpusShard& operator=(const EmbeddedCorpusShard&) = delete;
  const std::filesystem::path& path() const { return path_; }
  int64_t n_tokens() const { return n_tokens_; }

 private:
  TempDir dir_;  // removed on destruction
  std::filesystem::path path_;
  int64_t n_tokens_ = 0;
};

}  // namespace strata
