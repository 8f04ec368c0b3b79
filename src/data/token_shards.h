// llm.c token shards and llm.c's batching convention (DESIGN.md "Token data"). A shard is a
// 256 × int32 header (magic, version, token count) then the tokens: 20240520/v1 uint16 or
// 20240801/v7 uint32; the file size must match the count. Several shards by glob, sorted.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace strata {

// One shard, validated (magic, version, size) and read with pread; throws naming the file, also
// when the file shrinks under the run.
class TokenShard {
 public:
  static std::unique_ptr<TokenShard> open(const std::filesystem::path& path);
  virtual ~TokenShard() = default;
  virtual int64_t n_tokens() const = 0;
  virtual uint32_t token(int64_t i) const = 0;
  // Tokens [first, first + count) widened to uint32.
  virtual void read_tokens(int64_t first, int64_t count, uint32_t* out) const = 0;
  // The position of the first token >= limit, or -1 (one pass over the file).
  virtual int64_t find_token_at_least(uint64_t limit) const = 0;
  virtual uint64_t token_bytes() const = 0;  // 2 (version 1) or 4 (version 7)
  virtual const std::filesystem::path& path() const = 0;
};

// Writes a shard (tests, the embedded corpus, tools). version 1 (uint16) or 7 (uint32); a
// token that does not fit uint16 with version 1 throws.
void write_token_shard(const std::filesystem::path& path, const std::vector<uint32_t>& tokens, int version);

// Expands a glob (e.g. "data/*.bin") to sorted paths; throws naming the pattern if none match.
std::vector<std::filesystem::path> expand_glob(const std::string& pattern);

// The batching convention of llm.c's DataLoader, exactly: with world ranks, rank r reads
// B·T+1 consecutive tokens starting at r·B·T within the current window; the window then
// advances by world·B·T, moving to the next shard (wrapping to the first after the last) when
// the current shard cannot fill a whole window of world·B·T+1 tokens.
class DataLoader {
 public:
  DataLoader(const std::vector<std::filesystem::path>& shards, int64_t batch, int64_t seq, int rank, int world,
             int64_t vocab_size);
  // Opens the shards and scans every token once: an id >= vocab_size throws here, naming the
  // shard, the token's position and byte offset, and the id.
  // Fills inputs (B·T) and targets (B·T).
  void next(int32_t* inputs, int32_t* targets);
  void reset();  // back to the first window of the first shard
  // Position for checkpoint/resume.
  int64_t shard_index() const { return shard_; }
  int64_t position() const { return pos_; }
  void seek(int64_t shard_index, int64_t position);
  int64_t tokens_per_step() const { return batch_ * seq_ * world_; }  // global micro-batch
  // Micro-batches in one pass over every shard from the first window (as next() walks them).
  int64_t windows_per_pass() const;

 private:
  std::vector<std::unique_ptr<TokenShard>> shards_;
  int64_t batch_, seq_;
  int rank_, world_;
  int64_t vocab_;
  int64_t shard_ = 0;
  int64_t pos_ = 0;  // start of the current window in shard_
  std::vector<uint32_t> row_;  // one rank's B·T+1 tokens, read at once
};

}  // namespace strata
