// llm.c token shards (mapped, validated) and the DataLoader that cuts them into llm.c's
// per-rank batches; see token_shards.h and DESIGN.md "Token data" for the convention.
#include "src/data/token_shards.h"

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <glob.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "src/checked.h"
#include "src/checkpoint/file_util.h"

namespace strata {

namespace {

namespace fs = std::filesystem;

constexpr int32_t kMagicU16 = 20240520, kVersionU16 = 1;  // GPT-2 vocab, uint16 tokens
constexpr int32_t kMagicU32 = 20240801, kVersionU32 = 7;  // LLaMA-3 vocab, uint32 tokens
constexpr int kHeaderInts = 256;
constexpr uint64_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

// A shard read with pread, never mapped: a shard truncated or rewritten under a running job is
// then a short read, an error naming the file, where a mapped page past the new end would kill
// the process with SIGBUS (no message, no checkpoint, swap files left behind).
class ShardFile final : public TokenShard {
 public:
  explicit ShardFile(const fs::path& path) : path_(path), fd_(open_regular_file(path, &size_)) {
    const std::string file = path.string();
    if (size_ < kHeaderBytes)
      throw std::runtime_error(file + ": " + std::to_string(size_) + " bytes, too small for the " +
                               std::to_string(kHeaderBytes) + "-byte token shard header");
    int32_t header[3];
    read_at(0, header, sizeof(header));
    if (header[0] == kMagicU16) {
      expect_version(file, header, kVersionU16);
      token_bytes_ = 2;
    } else if (header[0] == kMagicU32) {
      expect_version(file, header, kVersionU32);
      token_bytes_ = 4;
    } else {
      throw std::runtime_error(file + ": bad magic " + std::to_string(header[0]) + " (expected " +
                               std::to_string(kMagicU16) + " or " + std::to_string(kMagicU32) +
                               "); not an llm.c token shard");
    }
    if (header[2] < 0)
      throw std::runtime_error(file + ": negative token count " + std::to_string(header[2]) + " in header");
    n_tokens_ = header[2];
    const uint64_t expected = kHeaderBytes + static_cast<uint64_t>(n_tokens_) * token_bytes_;
    if (size_ != expected)
      throw std::runtime_error(file + ": header says " + std::to_string(n_tokens_) + " tokens of " +
                               std::to_string(token_bytes_) + " bytes, so the file should be " +
                               std::to_string(expected) + " bytes, but it is " + std::to_string(size_));
  }

  int64_t n_tokens() const override { return n_tokens_; }
  uint32_t token(int64_t i) const override {
    assert(i >= 0 && i < n_tokens_);
    uint32_t t;
    read_tokens(i, 1, &t);
    return t;
  }
  void read_tokens(int64_t first, int64_t count, uint32_t* out) const override {
    assert(first >= 0 && count >= 0 && first + count <= n_tokens_);
    const uint64_t off = kHeaderBytes + static_cast<uint64_t>(first) * token_bytes_;
    if (token_bytes_ == 4) {
      read_at(off, out, static_cast<size_t>(count) * 4);
      return;
    }
    narrow_.resize(static_cast<size_t>(count));  // keeps its capacity: no allocation per batch
    read_at(off, narrow_.data(), static_cast<size_t>(count) * 2);
    for (int64_t k = 0; k < count; ++k) out[k] = narrow_[static_cast<size_t>(k)];
  }
  const fs::path& path() const override { return path_; }
  uint64_t token_bytes() const override { return token_bytes_; }
  int64_t find_token_at_least(uint64_t limit) const override {
    constexpr int64_t kChunk = 1 << 20;  // tokens per read
    std::vector<uint32_t> buf(static_cast<size_t>(std::min<int64_t>(kChunk, std::max<int64_t>(n_tokens_, 1))));
    for (int64_t first = 0; first < n_tokens_; first += kChunk) {
      const int64_t count = std::min(kChunk, n_tokens_ - first);
      read_tokens(first, count, buf.data());
      for (int64_t k = 0; k < count; ++k)
        if (buf[static_cast<size_t>(k)] >= limit) return first + k;
    }
    return -1;
  }

 private:
  // Exactly n bytes at `offset`; a short read means the file shrank under the run.
  void read_at(uint64_t offset, void* dst, size_t n) const {
    char* p = static_cast<char*>(dst);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd_.get(), p + done, n - done, static_cast<off_t>(offset + done));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw std::runtime_error(path_.string() + ": read of " + std::to_string(n - done) + " bytes at offset " +
                                 std::to_string(offset + done) + " failed: " + errno_text());
      }
      if (r == 0) {
        struct stat st {};
        const std::string now = ::fstat(fd_.get(), &st) == 0 ? std::to_string(st.st_size) + " bytes" : "unknown";
        throw std::runtime_error(path_.string() + ": the token shard shrank while the run was reading it (it was " +
                                 std::to_string(size_) + " bytes, now " + now + ", no data at offset " +
                                 std::to_string(offset + done) +
                                 "); a shard must not be rewritten during a run: restore it and resume");
      }
      done += static_cast<size_t>(r);
    }
  }

  static void expect_version(const std::string& file, const int32_t* header, int32_t version) {
    if (header[1] != version)
      throw std::runtime_error(file + ": magic " + std::to_string(header[0]) + " expects version " +
                               std::to_string(version) + ", found version " + std::to_string(header[1]));
  }

  fs::path path_;
  uint64_t size_ = 0;
  UniqueFd fd_;
  int64_t n_tokens_ = 0;
  uint32_t token_bytes_ = 0;
  mutable std::vector<uint16_t> narrow_;  // version 1: the uint16 tokens before widening
};

}  // namespace

std::unique_ptr<TokenShard> TokenShard::open(const std::filesystem::path& path) {
  return std::make_unique<ShardFile>(path);
}

void write_token_shard(const std::filesystem::path& path, const std::vector<uint32_t>& tokens, int version) {
  if (version != kVersionU16 && version != kVersionU32)
    throw std::invalid_argument(path.string() + ": token shard version must be 1 (uint16) or 7 (uint32), got " +
                                std::to_string(version));
  if (tokens.size() > static_cast<size_t>(INT32_MAX))
    throw std::invalid_argument(path.string() + ": " + std::to_string(tokens.size()) +
                                " tokens do not fit a shard's int32 count");
  int32_t header[kHeaderInts] = {};
  header[0] = version == kVersionU16 ? kMagicU16 : kMagicU32;
  header[1] = version;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  if (version == kVersionU16) {
    std::vector<uint16_t> narrow(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] > 0xffffu)
        throw std::invalid_argument(path.string() + ": token " + std::to_string(tokens[i]) + " at position " +
                                    std::to_string(i) + " does not fit uint16 (version 1); use version 7");
      narrow[i] = static_cast<uint16_t>(tokens[i]);
    }
    bytes.append(reinterpret_cast<const char*>(narrow.data()), narrow.size() * 2);
  } else {
    bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4);
  }
  write_file_synced(path, bytes);
}

std::vector<std::filesystem::path> expand_glob(const std::string& pattern) {
  glob_t g{};
  int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  struct Free {
    glob_t* g;
    ~Free() { ::globfree(g); }
  } free_on_exit{&g};
  if (rc == GLOB_NOMATCH) throw std::runtime_error("no files match '" + pattern + "'");
  if (rc != 0)
    throw std::runtime_error("cannot expand '" + pattern + "': " +
                             (rc == GLOB_NOSPACE ? std::string("out of memory") : std::string("read error")));
  std::vector<std::filesystem::path> out(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  std::sort(out.begin(), out.end());  // bytewise, independent of the locale's collation
  return out;
}

DataLoader::DataLoader(const std::vector<std::filesystem::path>& shards, int64_t batch, int64_t seq, int rank,
                       int world, int64_t vocab_size)
    : batch_(batch), seq_(seq), rank_(rank), world_(world), vocab_(vocab_size) {
  if (shards.empty()) throw std::invalid_argument("DataLoader: no token shards given");
  if (batch <= 0 || seq <= 0)
    throw std::invalid_argument("DataLoader: batch and seq must be positive, got " + std::to_string(batch) + ", " +
                                std::to_string(seq));
  if (world <= 0 || rank < 0 || rank >= world)
    throw std::invalid_argument("DataLoader: rank " + std::to_string(rank) + " outside world " + std::to_string(world));
  if (vocab_size <= 0) throw std::invalid_argument("DataLoader: vocab_size must be positive");
  const int64_t window = checked_add(checked_mul(checked_mul(batch, seq, "DataLoader: B x T"), int64_t{world},
                                                 "DataLoader: world x B x T"),
                                     int64_t{1}, "DataLoader: window");
  // Every shard stays open (read with pread): a thousand shards must not hit the common soft
  // limit of 1024 descriptors, so it is raised towards the hard limit as needed.
  struct rlimit nofile {};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY &&
      nofile.rlim_cur < shards.size() + 256) {
    nofile.rlim_cur = nofile.rlim_max == RLIM_INFINITY ? shards.size() + 256
                                                        : std::min<rlim_t>(nofile.rlim_max, shards.size() + 256);
    (void)::setrlimit(RLIMIT_NOFILE, &nofile);  // best effort: opening then names the shard that failed
  }
  for (const auto& path : shards) {
    shards_.push_back(TokenShard::open(path));
    // As llm.c: every shard must hold at least one whole window, else it would be skipped forever.
    if (shards_.back()->n_tokens() < window)
      throw std::runtime_error(path.string() + ": " + std::to_string(shards_.back()->n_tokens()) +
                               " tokens, fewer than one window of world·B·T+1 = " + std::to_string(window) +
                               " tokens (world " + std::to_string(world) + ", B " + std::to_string(batch) + ", T " +
                               std::to_string(seq) + ")");
    // Every id, once, now: a bad token found by the loader hours into a run loses the run.
    const TokenShard& sh = *shards_.back();
    if (const int64_t at = sh.find_token_at_least(static_cast<uint64_t>(vocab_size)); at >= 0)
      throw std::runtime_error(path.string() + ": token " + std::to_string(sh.token(at)) + " at position " +
                               std::to_string(at) + " (byte offset " +
                               std::to_string(kHeaderBytes + static_cast<uint64_t>(at) * sh.token_bytes()) +
                               ") is >= vocab_size " + std::to_string(vocab_size) +
                               "; the shard was tokenized for a larger vocabulary than the model's");
  }
}

void DataLoader::next(int32_t* inputs, int32_t* targets) {
  const int64_t step = tokens_per_step();
  if (pos_ + step + 1 > shards_[shard_]->n_tokens()) {  // this shard cannot fill the window
    shard_ = (shard_ + 1) % static_cast<int64_t>(shards_.size());
    pos_ = 0;
  }
  const TokenShard& shard = *shards_[shard_];
  const int64_t n = batch_ * seq_;
  const int64_t start = pos_ + rank_ * n;
  row_.resize(static_cast<size_t>(n + 1));
  shard.read_tokens(start, n + 1, row_.data());
  for (int64_t i = 0; i <= n; ++i) {
    const uint32_t tok = row_[static_cast<size_t>(i)];
    if (tok >= static_cast<uint64_t>(vocab_))
      throw std::runtime_error(shard.path().string() + ": token " + std::to_string(tok) + " at position " +
                               std::to_string(start + i) + " is >= vocab_size " + std::to_string(vocab_) +
                               " (the shard changed since the run started?)");
    if (i < n) inputs[i] = static_cast<int32_t>(tok);
    if (i > 0) targets[i - 1] = static_cast<int32_t>(tok);
  }
  pos_ += step;
}

int64_t DataLoader::windows_per_pass() const {
  int64_t n = 0;  // next() moves on when pos + window + 1 passes the shard's end
  for (const auto& s : shards_) n += (s->n_tokens() - 1) / tokens_per_step();
  return n;
}

void DataLoader::reset() {
  shard_ = 0;
  pos_ = 0;
}

void DataLoader::seek(int64_t shard_index, int64_t position) {
  if (shard_index < 0 || shard_index >= static_cast<int64_t>(shards_.size()))
    throw std::invalid_argument("DataLoader::seek: shard index " + std::to_string(shard_index) + " outside [0, " +
                                std::to_string(shards_.size()) + ")");
  if (position < 0 || position > shards_[shard_index]->n_tokens())
    throw std::invalid_argument("DataLoader::seek: position " + std::to_string(position) + " outside shard " +
                                shards_[shard_index]->path().string() + " of " +
                                std::to_string(shards_[shard_index]->n_tokens()) + " tokens");
  shard_ = shard_index;
  pos_ = position;
}

}  // namespace strata
