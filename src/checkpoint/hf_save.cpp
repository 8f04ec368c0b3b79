// Saving a HF model directory crash-safely: everything is written and fsynced in a sibling
// temporary directory, which then replaces `out_dir` (atomic exchange where the filesystem
// supports it). Tensors are produced one at a time by callbacks, so memory stays bounded.
#include <algorithm>
#include <cstdio>
#include <set>
#include <stdexcept>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "src/checkpoint/file_util.h"
#include "src/checkpoint/hf.h"
#include "src/checkpoint/safetensors.h"
#include "io/crc32c.h"

namespace strata {

namespace {

namespace fs = std::filesystem;

struct Shard {
  std::string file_name;
  std::vector<size_t> tensors;  // indices into the caller's list, in order
};

uint64_t tensor_bytes(const TensorToSave& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape) {
    if (d < 0) throw std::invalid_argument("save_hf_model: tensor '" + t.name + "' has a negative dimension");
    n *= static_cast<uint64_t>(d);
  }
  return n * kernels::dtype_size(t.dtype);
}

WrittenFile write_shard(const fs::path& path, const std::vector<TensorToSave>& tensors, const Shard& shard,
                        std::vector<std::byte>& buffer) {
  std::vector<safetensors::Entry> entries;
  uint64_t offset = 0;
  for (size_t i : shard.tensors) {
    const TensorToSave& t = tensors[i];
    safetensors::Entry e;
    e.name = t.name;
    e.dtype = t.dtype;
    e.shape = t.shape;
    e.begin = offset;
    offset += tensor_bytes(t);
    e.end = offset;
    entries.push_back(std::move(e));
  }
  const std::string header = safetensors::build_header(entries);
  UniqueFd fd = open_for_write(path, true);
  write_all(fd.get(), header.data(), header.size(), path, 0);
  uint32_t crc = io::crc32c(header.data(), header.size());
  uint64_t file_offset = header.size();
  for (size_t k = 0; k < shard.tensors.size(); ++k) {
    const TensorToSave& t = tensors[shard.tensors[k]];
    const uint64_t n = entries[k].end - entries[k].begin;
    // In pieces where the tensor can be filled by ranges (kSavePieceBytes: whole elements of
    // every dtype), else whole.
    const uint64_t piece = t.fill_range ? std::min(n, kSavePieceBytes) : n;
    for (uint64_t at = 0; at < n; at += piece) {
      const uint64_t len = std::min(piece, n - at);
      // Zeroed, so a callback that writes fewer bytes than promised still saves deterministically.
      buffer.assign(len, std::byte{0});
      try {
        if (t.fill_range)
          t.fill_range(buffer.data(), at, len);
        else
          t.fill(buffer.data());
      } catch (const std::exception& e) {
        throw std::runtime_error(path.string() + ": producing tensor '" + t.name + "' failed: " + e.what());
      }
      write_all(fd.get(), buffer.data(), len, path, file_offset);
      crc = io::crc32c(buffer.data(), len, crc);
      file_offset += len;
    }
  }
  fsync_fd(fd.get(), path);
  fd.close_checked(path);
  return {file_offset, crc};
}

}  // namespace

WrittenFile write_safetensors_file(const std::filesystem::path& path, const std::vector<TensorToSave>& tensors) {
  std::set<std::string> names;
  Shard all;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name.empty() || tensors[i].name == "__metadata__" || !names.insert(tensors[i].name).second)
      throw std::invalid_argument(path.string() + ": tensor name '" + tensors[i].name + "' is empty, reserved or repeated");
    if (!tensors[i].fill && !tensors[i].fill_range)
      throw std::invalid_argument(path.string() + ": tensor '" + tensors[i].name + "' has no fill");
    all.tensors.push_back(i);
  }
  std::vector<std::byte> buffer;
  return write_shard(path, tensors, all, buffer);
}

namespace {
// "runs/x/" has an empty filename; normalise so the temp dir is a sibling, not a child.
fs::path normalised_out(const fs::path& out_dir) {
  if (out_dir.empty()) throw std::invalid_argument("save_hf_model: empty output path");
  return out_dir.has_filename() ? out_dir : out_dir.parent_path();
}

// The files a save writes (config.json, model.safetensors, model-0000k-of-0000n.safetensors,
// model.safetensors.index.json, the tokenizer files it carries over): a directory holding only
// these may be replaced.
bool is_saved_file_name(const std::string& name) {
  if (name == "config.json" || name == "model.safetensors.index.json") return true;
  if (name == "adapter_config.json" || name == "adapter_model.safetensors") return true;  // save_peft_adapter
  for (const char* t : kTokenizerFiles)
    if (name == t) return true;
  const std::string ext = ".safetensors";
  return name.size() >= 5 + ext.size() && name.compare(0, 5, "model") == 0 &&
         name.compare(name.size() - ext.size(), ext.size(), ext) == 0;
}

// Refuses an out_dir whose replacement would delete something a save did not write: ".",
// "..", the working directory or one of its parents, the filesystem root, and a non-empty
// directory holding anything but a model's files.
void check_replaceable(const fs::path& out_dir) {
  const std::string shown = out_dir.string();
  const std::string fix = "; pass a new directory for the model (e.g. --out " +
                          (out_dir / "model").lexically_normal().string() + ")";
  const std::string last = out_dir.filename().string();
  if (out_dir == "." || out_dir == ".." || last == "." || last == "..")
    throw std::runtime_error(shown + ": names a directory by '.' or '..'; saving replaces the whole directory" + fix);
  std::error_code ec;
  const fs::path abs = fs::weakly_canonical(fs::absolute(out_dir, ec), ec);
  if (!ec) {
    if (abs == abs.root_path())
      throw std::runtime_error(shown + ": is the filesystem root; saving replaces the whole directory" + fix);
    const fs::path cwd = fs::weakly_canonical(fs::current_path(ec), ec);
    if (!ec) {
      const auto [a, c] = std::mismatch(abs.begin(), abs.end(), cwd.begin(), cwd.end());
      if (a == abs.end())
        throw std::runtime_error(shown + ": is the working directory" + std::string(c == cwd.end() ? "" : " or one of its parents") +
                                 "; saving replaces the whole directory" + fix);
    }
  }
  const fs::file_status st = fs::symlink_status(out_dir, ec);
  if (!fs::is_directory(st)) return;  // absent (a fresh save) or refused by prepare_parent
  std::vector<std::string> foreign;
  size_t n_foreign = 0;
  for (fs::directory_iterator it(out_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code e2;
    if (fs::is_regular_file(fs::symlink_status(it->path(), e2)) && is_saved_file_name(name)) continue;
    if (++n_foreign <= 3) foreign.push_back("'" + name + (fs::is_directory(it->symlink_status(e2)) ? "/'" : "'"));
  }
  if (ec) throw std::runtime_error(shown + ": cannot list the directory: " + ec.message());
  if (n_foreign == 0) return;
  std::string list;
  for (size_t i = 0; i < foreign.size(); ++i) list += (i ? ", " : "") + foreign[i];
  if (n_foreign > foreign.size()) list += " and " + std::to_string(n_foreign - foreign.size()) + " more";
  throw std::runtime_error(shown + ": is not empty and not a model directory (it holds " + list +
                           ", which strata did not write); saving would replace the whole directory" + fix +
                           ", or an empty one");
}

// Refuses what replace_directory would refuse, and creates the parent. Removes temporary
// siblings that earlier, killed saves to this directory left.
void prepare_parent(const fs::path& out_dir) {
  check_replaceable(out_dir);
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(out_dir, ec);
  if (fs::exists(st) && !fs::is_directory(st))
    throw std::runtime_error(out_dir.string() + ": exists and is not a directory" +
                             (fs::is_symlink(st) ? " (a symlink)" : "") + "; refusing to replace it");
  const fs::path parent = out_dir.has_parent_path() ? out_dir.parent_path() : fs::path(".");
  fs::create_directories(parent, ec);
  if (ec) throw std::runtime_error(out_dir.string() + ": cannot create parent directory " + parent.string() + ": " +
                                   ec.message());
  const std::string name = out_dir.filename().string();
  remove_dead_pid_dirs(parent, name + ".tmp-");
  remove_dead_pid_dirs(parent, name + ".old-");
}
}  // namespace

void check_hf_save_target(const std::filesystem::path& out_dir_in) {
  const fs::path out_dir = normalised_out(out_dir_in);
  prepare_parent(out_dir);
  TempDir probe = TempDir::create_owned(out_dir, ".tmp-");  // the sibling the save will write into
}

void save_hf_model(const std::filesystem::path& out_dir_in, const ModelConfig& cfg,
                   const std::vector<TensorToSave>& tensors, uint64_t shard_bytes,
                   const std::vector<fs::path>& extra_files) {
  const fs::path out_dir = normalised_out(out_dir_in);
  cfg.validate();
  std::set<std::string> names;
  uint64_t total = 0;
  for (const TensorToSave& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      throw std::invalid_argument("save_hf_model: invalid tensor name '" + t.name + "'");
    if (!names.insert(t.name).second)
      throw std::invalid_argument("save_hf_model: tensor '" + t.name + "' given twice");
    if (!t.fill && !t.fill_range)
      throw std::invalid_argument("save_hf_model: tensor '" + t.name + "' has no fill callback");
    total += tensor_bytes(t);
  }

  // Greedy split in the caller's order (keeps each layer's tensors together, as HF does); a
  // tensor larger than shard_bytes gets a shard of its own.
  std::vector<Shard> shards;
  uint64_t in_current = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = tensor_bytes(tensors[i]);
    if (shards.empty() || (!shards.back().tensors.empty() && in_current + n > shard_bytes)) {
      shards.emplace_back();
      in_current = 0;
    }
    shards.back().tensors.push_back(i);
    in_current += n;
  }
  if (shards.empty()) shards.emplace_back();
  if (shards.size() == 1) {
    shards[0].file_name = "model.safetensors";
  } else {
    char buf[64];
    for (size_t k = 0; k < shards.size(); ++k) {
      std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      shards[k].file_name = buf;
    }
  }

  prepare_parent(out_dir);
  TempDir tmp = TempDir::create_owned(out_dir, ".tmp-");
  // mkdtemp makes 0700; a model directory is normally readable by others.
  if (::chmod(tmp.path().c_str(), 0755) != 0)
    throw std::runtime_error(tmp.path().string() + ": chmod failed: " + errno_text());

  std::vector<std::byte> buffer;
  for (const Shard& s : shards) write_shard(tmp.path() / s.file_name, tensors, s, buffer);
  if (shards.size() > 1) {
    nlohmann::json index;
    index["metadata"] = {{"total_size", total}};
    nlohmann::json& map = index["weight_map"] = nlohmann::json::object();
    for (const Shard& s : shards)
      for (size_t i : s.tensors) map[tensors[i].name] = s.file_name;
    write_file_synced(tmp.path() / "model.safetensors.index.json", index.dump(2) + "\n");
  }
  write_hf_config(cfg, tmp.path() / "config.json");
  for (const fs::path& f : extra_files) {
    const std::string name = f.filename().string();
    if (std::find(std::begin(kTokenizerFiles), std::end(kTokenizerFiles), name) == std::end(kTokenizerFiles))
      throw std::invalid_argument("save_hf_model: " + name + " is not a tokenizer file a save carries");
    write_file_synced(tmp.path() / name, read_text_file(f));
  }
  fsync_dir(tmp.path());
  replace_directory(tmp.path(), out_dir);
  tmp.release();
}

void save_peft_adapter(const std::filesystem::path& out_dir_in, const nlohmann::json& adapter_config,
                       const std::vector<TensorToSave>& tensors, const std::vector<fs::path>& extra_files) {
  const fs::path out_dir = normalised_out(out_dir_in);
  prepare_parent(out_dir);
  TempDir tmp = TempDir::create_owned(out_dir, ".tmp-");
  if (::chmod(tmp.path().c_str(), 0755) != 0)
    throw std::runtime_error(tmp.path().string() + ": chmod failed: " + errno_text());
  write_safetensors_file(tmp.path() / "adapter_model.safetensors", tensors);
  write_file_synced(tmp.path() / "adapter_config.json", adapter_config.dump(2) + "\n");
  for (const fs::path& f : extra_files) write_file_synced(tmp.path() / f.filename(), read_text_file(f));
  fsync_dir(tmp.path());
  replace_directory(tmp.path(), out_dir);
  tmp.release();
}

}  // namespace strata
