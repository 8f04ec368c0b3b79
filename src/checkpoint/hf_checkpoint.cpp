// Reading a HF model directory: model.safetensors, or the shards listed by
// model.safetensors.index.json, each memory-mapped and validated; tensors converted on read
// into whatever dtype the caller's buffer holds.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "kernels/cpu/parallel.h"
#include "src/checkpoint/file_util.h"
#include "src/checkpoint/hf.h"
#include "src/checkpoint/safetensors.h"

namespace strata {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

// The mapping's hold on the whole pages inside [p, p + bytes), which have just been read, let
// go (MADV_DONTNEED): the file's pages stay in the page cache, but no longer count in this
// process's RSS, where a load would otherwise keep every byte it read (a whole model, or at a
// ZeRO resume each rank's share of the checkpoint) until the checkpoint is closed. Read
// again, they fault back in from the cache.
void drop_pages(const void* p, size_t bytes, const std::string& file) {
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  if (hi > lo && ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) != 0)
    throw std::runtime_error(file + ": madvise(MADV_DONTNEED) of " + std::to_string(hi - lo) +
                             " bytes read failed: " + errno_text());
}

// Converts n elements; the mapped source may be unaligned, so loads go through memcpy.
void convert(const void* src, kernels::DType st, void* dst, kernels::DType dt, size_t n) {
  if (n == 0) return;
  if (st == dt) {
    std::memcpy(dst, src, n * kernels::dtype_size(st));
    return;
  }
  const auto* s = static_cast<const unsigned char*>(src);
  kernels::cpu::parallel_for(0, static_cast<int64_t>(n), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float x;
      if (st == kernels::DType::f32) {
        std::memcpy(&x, s + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, s + 2 * i, 2);
        x = st == kernels::DType::bf16 ? kernels::bf16_to_f32(h) : kernels::f16_to_f32(h);
      }
      kernels::store_from_f32(dst, dt, static_cast<size_t>(i), x);
    }
  });
}

// The first non-finite element of n stored values, or n. Checked on the stored bits, so
// nothing is converted twice: an Inf/NaN exponent is all ones in every float format.
size_t first_non_finite(const unsigned char* s, kernels::DType dt, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (dt == kernels::DType::f32) {
      uint32_t b;
      std::memcpy(&b, s + 4 * i, 4);
      if ((b & 0x7f800000u) == 0x7f800000u) return i;
    } else {
      uint16_t h;
      std::memcpy(&h, s + 2 * i, 2);
      const uint16_t exp = dt == kernels::DType::bf16 ? 0x7f80 : 0x7c00;
      if ((h & exp) == exp) return i;
    }
  }
  return n;
}

class MappedCheckpoint final : public HfCheckpoint {
 public:
  explicit MappedCheckpoint(const fs::path& dir) : dir_(dir) {
    const fs::path index = dir / "model.safetensors.index.json";
    const fs::path single = dir / "model.safetensors";
    std::error_code ec;
    // transformers' precedence: a single model.safetensors wins over an index.
    if (fs::exists(single, ec)) {
      add_file(single);
    } else if (fs::exists(index, ec)) {
      open_sharded(index);
    } else {
      throw std::runtime_error(dir.string() + ": no model.safetensors or model.safetensors.index.json" +
                               (fs::is_directory(dir, ec) ? "" : " (not a directory)"));
    }
  }

  // One .safetensors file on its own (a training checkpoint's optimizer state).
  struct SingleFile {};
  MappedCheckpoint(const fs::path& file, SingleFile) : dir_(file) { add_file(file); }

  const std::vector<StoredTensor>& tensors() const override { return tensors_; }

  const StoredTensor* find(const std::string& name) const override {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &tensors_[it->second];
  }

  void read_range(const std::string& name, const std::vector<int64_t>& expected_shape, int64_t begin, int64_t end,
                  void* dst, kernels::DType dst_dtype) const override {
    const StoredTensor* t = find(name);
    if (!t) throw std::runtime_error(dir_.string() + ": tensor '" + name + "' not found in the checkpoint");
    if (t->shape != expected_shape)
      throw std::runtime_error(t->file + ": tensor '" + name + "': expected shape " + shape_str(expected_shape) +
                               ", found " + shape_str(t->shape));
    const size_t esz = kernels::dtype_size(t->dtype);
    const auto numel = static_cast<int64_t>(t->nbytes / esz);
    if (end < 0) end = numel;
    if (begin < 0 || begin > end || end > numel)
      throw std::logic_error(t->file + ": tensor '" + name + "': elements [" + std::to_string(begin) + ", " +
                             std::to_string(end) + ") of " + std::to_string(numel));
    const auto n = static_cast<size_t>(end - begin);
    const auto* src = static_cast<const unsigned char*>(t->data) + static_cast<size_t>(begin) * esz;
    // A NaN or Inf weight (a diverged run's save, a corrupt file) would make every loss NaN.
    const size_t bad = first_non_finite(src, t->dtype, n);
    if (bad < n)
      throw std::runtime_error(t->file + ": tensor '" + name + "' holds a non-finite value (NaN or Inf) at element " +
                               std::to_string(static_cast<size_t>(begin) + bad) +
                               "; the checkpoint is corrupt or was saved by a diverged run");
    convert(src, t->dtype, dst, dst_dtype, n);
    drop_pages(src, n * esz, t->file);
  }

 private:
  void open_sharded(const fs::path& index) {
    const std::string file = index.string();
    const json j = safetensors::read_json_file(index);
    if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object())
      throw std::runtime_error(file + ": missing 'weight_map' object");
    std::map<std::string, std::vector<std::string>> by_file;  // shard -> tensors the index puts there
    for (const auto& [name, v] : j.at("weight_map").items()) {
      if (!v.is_string())
        throw std::runtime_error(file + ": weight_map entry for tensor '" + name + "' is not a string");
      std::string shard = v.get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
        throw std::runtime_error(file + ": weight_map entry for tensor '" + name + "' names '" + shard +
                                 "', which is not a file name in this directory");
      by_file[shard].push_back(name);
    }
    if (by_file.empty()) throw std::runtime_error(file + ": weight_map is empty");
    for (const auto& [shard, names] : by_file) {
      const fs::path path = dir_ / shard;
      std::error_code ec;
      if (!fs::exists(path, ec))
        throw std::runtime_error(file + ": shard " + path.string() + " (holding tensor '" + names.front() +
                                 "') does not exist");
      add_file(path);
    }
    for (const auto& [shard, names] : by_file) {
      const std::string path = (dir_ / shard).string();
      for (const std::string& name : names) {
        const StoredTensor* t = find(name);
        if (!t || t->file != path)
          throw std::runtime_error(file + ": tensor '" + name + "' should be in " + path + " but " +
                                   (t ? "is in " + t->file : std::string("no shard holds it")));
      }
    }
  }

  void add_file(const fs::path& path) {
    auto& m = maps_.emplace_back(std::make_unique<MappedFile>(path));
    const std::string file = path.string();
    safetensors::Parsed parsed = safetensors::parse(m->data(), m->size(), file);
    for (safetensors::Entry& e : parsed.entries) {
      auto [it, inserted] = by_name_.emplace(e.name, tensors_.size());
      if (!inserted)
        throw std::runtime_error(file + ": tensor '" + e.name + "' is also in " + tensors_[it->second].file);
      StoredTensor t;
      t.name = std::move(e.name);
      t.dtype = e.dtype;
      t.shape = std::move(e.shape);
      t.data = m->data() + parsed.data_start + e.begin;
      t.nbytes = e.end - e.begin;
      t.file = file;
      tensors_.push_back(std::move(t));
    }
  }

  fs::path dir_;
  std::vector<std::unique_ptr<MappedFile>> maps_;
  std::vector<StoredTensor> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
};

}  // namespace

std::unique_ptr<HfCheckpoint> HfCheckpoint::open(const std::filesystem::path& model_dir) {
  return std::make_unique<MappedCheckpoint>(model_dir);
}

std::unique_ptr<HfCheckpoint> HfCheckpoint::open_file(const std::filesystem::path& file) {
  return std::make_unique<MappedCheckpoint>(file, MappedCheckpoint::SingleFile{});
}

}  // namespace strata
