// Loss-mask and document sidecars of token shards, and the writer of a shard set; see
// doc_shards.h and DESIGN.md "Token data".
#include "src/data/doc_shards.h"

#include <unistd.h>

#include <cerrno>

#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace strata {
namespace {

namespace fs = std::filesystem;
constexpr int kHeaderInts = 256;
constexpr uint64_t kHeaderBytes = kHeaderInts * sizeof(int32_t);
constexpr int32_t kShardMagic[2] = {20240520, 20240801};
constexpr size_t kFlushBytes = 4 << 20;

fs::path sidecar(const fs::path& shard, const char* ext) {
  fs::path p = shard;
  if (p.extension() == ".bin") return p.replace_extension(ext);
  p += ext;
  return p;
}

fs::path partial(const fs::path& p) {
  fs::path q = p;
  q += ".partial";
  return q;
}

// Reads a sidecar: header checked (magic, version), the payload whole.
std::string read_sidecar(const fs::path& path, int32_t magic, int32_t version, const char* what, int32_t* count) {
  uint64_t size = 0;
  UniqueFd fd = open_regular_file(path, &size);
  const std::string file = path.string();
  if (size < kHeaderBytes)
    throw std::runtime_error(file + ": " + std::to_string(size) + " bytes, too small for a " + what + " header");
  std::string bytes(size, '\0');
  size_t done = 0;
  while (done < size) {
    const ssize_t r = ::pread(fd.get(), bytes.data() + done, size - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw std::runtime_error(file + ": read failed: " + (r < 0 ? errno_text() : std::string("short read")));
    done += static_cast<size_t>(r);
  }
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  if (header[0] != magic || header[1] != version)
    throw std::runtime_error(file + ": not a strata " + what + " file (magic " + std::to_string(header[0]) +
                             ", version " + std::to_string(header[1]) + "; expected " + std::to_string(magic) + ", " +
                             std::to_string(version) + ")");
  if (header[2] < 0) throw std::runtime_error(file + ": negative count in the " + std::string(what) + " header");
  *count = header[2];
  return bytes.substr(kHeaderBytes);
}

}  // namespace

fs::path shard_mask_path(const fs::path& shard) { return sidecar(shard, ".mask"); }
fs::path shard_docs_path(const fs::path& shard) { return sidecar(shard, ".docs"); }

std::vector<uint8_t> read_shard_mask(const fs::path& shard, int64_t n_tokens) {
  const fs::path path = shard_mask_path(shard);
  int32_t count = 0;
  const std::string payload = read_sidecar(path, kMaskMagic, kMaskVersion, "loss-mask", &count);
  if (count != n_tokens || payload.size() != static_cast<size_t>(n_tokens))
    throw std::runtime_error(path.string() + ": holds " + std::to_string(payload.size()) + " mask bytes (header " +
                             std::to_string(count) + ") for a shard of " + std::to_string(n_tokens) +
                             " tokens; the mask belongs to another shard: rewrite the data set with `strata data`");
  std::vector<uint8_t> mask(payload.begin(), payload.end());
  for (size_t i = 0; i < mask.size(); ++i)
    if (mask[i] > 1)
      throw std::runtime_error(path.string() + ": token " + std::to_string(i) + " has mask value " +
                               std::to_string(mask[i]) + " (expected 0 or 1)");
  return mask;
}

std::vector<int64_t> read_shard_docs(const fs::path& shard, int64_t n_tokens) {
  const fs::path path = shard_docs_path(shard);
  int32_t count = 0;
  const std::string payload = read_sidecar(path, kDocsMagic, kDocsVersion, "document-offsets", &count);
  const size_t want = (static_cast<size_t>(count) + 1) * sizeof(int64_t);
  if (payload.size() != want)
    throw std::runtime_error(path.string() + ": header says " + std::to_string(count) + " documents, so " +
                             std::to_string(want) + " bytes of offsets, but the file holds " +
                             std::to_string(payload.size()));
  std::vector<int64_t> off(static_cast<size_t>(count) + 1);
  std::memcpy(off.data(), payload.data(), want);
  if (off.front() != 0 || off.back() != n_tokens)
    throw std::runtime_error(path.string() + ": document offsets run from " + std::to_string(off.front()) + " to " +
                             std::to_string(off.back()) + ", expected 0 to the shard's " + std::to_string(n_tokens) +
                             " tokens");
  for (size_t d = 0; d + 1 < off.size(); ++d)
    if (off[d + 1] <= off[d])
      throw std::runtime_error(path.string() + ": document " + std::to_string(d) + " is empty or out of order (offsets " +
                               std::to_string(off[d]) + ", " + std::to_string(off[d + 1]) + ")");
  return off;
}

// One shard being written: three partial files, buffered.
struct ShardSetWriter::Open {
  std::string name;  // PREFIX_NNNNNN.bin
  fs::path bin, mask, docs;
  UniqueFd bin_fd, mask_fd;
  std::string bin_buf, mask_buf;
  uint64_t bin_written = kHeaderBytes, mask_written = kHeaderBytes;
  std::vector<int64_t> offsets{0};
};

ShardSetWriter::ShardSetWriter(fs::path dir, std::string prefix, int64_t shard_tokens, int version)
    : dir_(std::move(dir)), prefix_(std::move(prefix)), shard_tokens_(shard_tokens), version_(version) {
  if (version != 1 && version != 7) throw std::invalid_argument("token shard version must be 1 or 7");
  if (shard_tokens < 1 || shard_tokens > INT32_MAX)
    throw std::invalid_argument("--shard-tokens must be between 1 and 2147483647 (the llm.c header holds an int32)");
}

ShardSetWriter::~ShardSetWriter() {
  if (!finished_) discard_partials();
}

void ShardSetWriter::discard_partials() noexcept {
  if (!cur_) return;
  std::error_code ec;
  fs::remove(partial(cur_->bin), ec);
  fs::remove(partial(cur_->mask), ec);
  fs::remove(partial(cur_->docs), ec);
  cur_.reset();
}

void ShardSetWriter::open_shard() {
  auto o = std::make_unique<Open>();
  char num[16];
  std::snprintf(num, sizeof(num), "%06zu", names_.size());
  o->name = prefix_ + "_" + num + ".bin";
  o->bin = dir_ / o->name;
  o->mask = shard_mask_path(o->bin);
  o->docs = shard_docs_path(o->bin);
  o->bin_fd = open_for_write(partial(o->bin), false);
  o->mask_fd = open_for_write(partial(o->mask), false);
  const std::string zeros(kHeaderBytes, '\0');
  write_all(o->bin_fd.get(), zeros.data(), zeros.size(), partial(o->bin), 0);
  write_all(o->mask_fd.get(), zeros.data(), zeros.size(), partial(o->mask), 0);
  cur_ = std::move(o);
}

void ShardSetWriter::flush() {
  Open& o = *cur_;
  write_all(o.bin_fd.get(), o.bin_buf.data(), o.bin_buf.size(), partial(o.bin), o.bin_written);
  o.bin_written += o.bin_buf.size();
  o.bin_buf.clear();
  write_all(o.mask_fd.get(), o.mask_buf.data(), o.mask_buf.size(), partial(o.mask), o.mask_written);
  o.mask_written += o.mask_buf.size();
  o.mask_buf.clear();
}

void ShardSetWriter::add_document(const uint32_t* ids, const uint8_t* mask, size_t n) {
  if (n == 0) throw std::invalid_argument("ShardSetWriter: an empty document");
  if (n > static_cast<size_t>(INT32_MAX))
    throw std::runtime_error("a document of " + std::to_string(n) + " tokens does not fit an llm.c shard (int32 count)");
  if (cur_ && cur_->offsets.back() + static_cast<int64_t>(n) > shard_tokens_) close_shard();
  if (!cur_) open_shard();
  Open& o = *cur_;
  if (version_ == 1) {
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] > 0xFFFF)
        throw std::runtime_error("token id " + std::to_string(ids[i]) + " does not fit a version-1 (uint16) shard");
      const uint16_t v = static_cast<uint16_t>(ids[i]);
      o.bin_buf.append(reinterpret_cast<const char*>(&v), 2);
    }
  } else {
    o.bin_buf.append(reinterpret_cast<const char*>(ids), n * 4);
  }
  o.mask_buf.append(reinterpret_cast<const char*>(mask), n);
  o.offsets.push_back(o.offsets.back() + static_cast<int64_t>(n));
  ++docs_;
  tokens_ += static_cast<int64_t>(n);
  if (o.bin_buf.size() >= kFlushBytes) flush();
}

void ShardSetWriter::close_shard() {
  flush();
  Open& o = *cur_;
  const int32_t n_tokens = static_cast<int32_t>(o.offsets.back());
  const int32_t n_docs = static_cast<int32_t>(o.offsets.size() - 1);
  int32_t header[kHeaderInts] = {};
  header[0] = kShardMagic[version_ == 1 ? 0 : 1];
  header[1] = version_;
  header[2] = n_tokens;
  if (::pwrite(o.bin_fd.get(), header, kHeaderBytes, 0) != static_cast<ssize_t>(kHeaderBytes))
    throw std::runtime_error(partial(o.bin).string() + ": header write failed: " + errno_text());
  header[0] = kMaskMagic;
  header[1] = kMaskVersion;
  if (::pwrite(o.mask_fd.get(), header, kHeaderBytes, 0) != static_cast<ssize_t>(kHeaderBytes))
    throw std::runtime_error(partial(o.mask).string() + ": header write failed: " + errno_text());
  header[0] = kDocsMagic;
  header[1] = kDocsVersion;
  header[2] = n_docs;
  std::string docs(reinterpret_cast<const char*>(header), kHeaderBytes);
  docs.append(reinterpret_cast<const char*>(o.offsets.data()), o.offsets.size() * sizeof(int64_t));
  write_file_synced(partial(o.docs), docs);
  fsync_fd(o.bin_fd.get(), partial(o.bin));
  fsync_fd(o.mask_fd.get(), partial(o.mask));
  o.bin_fd.close_checked(partial(o.bin));
  o.mask_fd.close_checked(partial(o.mask));
  // Sidecars first: a NAME.bin that exists always has its mask and documents beside it.
  for (const fs::path* p : {&o.mask, &o.docs, &o.bin}) {
    if (std::rename(partial(*p).c_str(), p->c_str()) != 0)
      throw std::runtime_error("cannot rename " + partial(*p).string() + " to " + p->string() + ": " + errno_text());
  }
  fsync_dir(dir_);
  names_.push_back(o.name);
  cur_.reset();
}

void ShardSetWriter::abandon() noexcept {
  discard_partials();
  std::error_code ec;
  for (const std::string& n : names_) {
    const fs::path p = dir_ / n;
    fs::remove(p, ec);  // NAME.bin first: a reader never sees a shard without its sidecars
    fs::remove(shard_mask_path(p), ec);
    fs::remove(shard_docs_path(p), ec);
  }
  names_.clear();
  finished_ = true;
}

std::vector<std::string> ShardSetWriter::finish() {
  if (cur_) close_shard();
  finished_ = true;
  return names_;
}

}  // namespace strata
