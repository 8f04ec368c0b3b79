// Documents and loss masks beside llm.c token shards (DESIGN.md "Token data"). `strata data`
// writes, for each shard NAME.bin, two sidecar files with the same 256 × int32 header layout:
//   NAME.mask  magic 20261205, version 1, token count; then one uint8 per token: 1 = trained
//              (the loss counts a target whose token is trained), 0 = not trained.
//   NAME.docs  magic 20261206, version 1, document count D; then D + 1 int64 offsets: document
//              d is tokens [offsets[d], offsets[d+1]); offsets[0] = 0, offsets[D] = the token
//              count. A document never spans two shards.
// Readers that know only the llm.c format read NAME.bin as before.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "src/checkpoint/file_util.h"

namespace strata {

inline constexpr int32_t kMaskMagic = 20261205, kMaskVersion = 1;
inline constexpr int32_t kDocsMagic = 20261206, kDocsVersion = 1;

// NAME.mask / NAME.docs for a shard NAME.bin (or the shard's name + ".mask" without ".bin").
std::filesystem::path shard_mask_path(const std::filesystem::path& shard);
std::filesystem::path shard_docs_path(const std::filesystem::path& shard);

// The sidecars of one shard, validated against its token count; throw naming the file.
std::vector<uint8_t> read_shard_mask(const std::filesystem::path& shard, int64_t n_tokens);
std::vector<int64_t> read_shard_docs(const std::filesystem::path& shard, int64_t n_tokens);

// Writes a set of shards PREFIX_000000.bin, PREFIX_000001.bin, ... with their sidecars into a
// directory, a document at a time. Each file is written as NAME.partial and renamed when its
// shard is complete (sidecars first, NAME.bin last), so an interrupted run never leaves a file
// that a reader of *.bin could take for a shard; partial files are removed on destruction
// unless finish() ran.
class ShardSetWriter {
 public:
  // version 1 (uint16 tokens; every id must be < 65536) or 7 (uint32). A shard holds at most
  // shard_tokens tokens, except a single longer document, which gets a shard of its own.
  ShardSetWriter(std::filesystem::path dir, std::string prefix, int64_t shard_tokens, int version);
  ~ShardSetWriter();
  ShardSetWriter(const ShardSetWriter&) = delete;
  ShardSetWriter& operator=(const ShardSetWriter&) = delete;
  void add_document(const uint32_t* ids, const uint8_t* mask, size_t n);
  // Completes the last shard; the names of all shards written, in order.
  std::vector<std::string> finish();
  // Removes every file this writer wrote, complete shards included (a run that failed halfway).
  void abandon() noexcept;
  int64_t documents() const { return docs_; }
  int64_t tokens() const { return tokens_; }

 private:
  struct Open;
  void open_shard();
  void close_shard();
  void flush();
  void discard_partials() noexcept;
  std::filesystem::path dir_;
  std::string prefix_;
  int64_t shard_tokens_;
  int version_;
  std::unique_ptr<Open> cur_;
  std::vector<std::string> names_;
  int64_t docs_ = 0, tokens_ = 0;
  bool finished_ = false;
};

}  // namespace strata
