// Training checkpoints: atomic directory writes, a checksummed manifest, `latest`, rotation.
#include "src/checkpoint/train_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "io/crc32c.h"
#include "src/checkpoint/file_util.h"
#include "src/checkpoint/safetensors.h"

namespace strata {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kManifest = "trainer.json";
constexpr const char* kLatest = "latest";


// N for a "step-N" name, else -1.
int64_t step_of_name(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return -1;
  if (name.find_first_not_of("0123456789", 5) != std::string::npos) return -1;
  return std::stoll(name.substr(5));
}

// step-N directories under dir, by step (complete checkpoints only: a temporary one is
// .tmp-*, never step-*).
std::map<int64_t, fs::path> complete_checkpoints(const fs::path& dir) {
  std::map<int64_t, fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = step_of_name(e.path().filename().string());
    if (step < 0 || !fs::is_directory(e.path(), ec)) continue;
    out[step] = e.path();
  }
  return out;
}

// crc32c and size of a whole file, read in 8 MiB pieces.
std::pair<uint64_t, uint32_t> file_crc(const fs::path& path) {
  UniqueFd fd = open_regular_file(path);
  std::vector<char> buf(8 << 20);
  uint64_t total = 0;
  uint32_t crc = 0;
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(path.string() + ": read failed at byte " + std::to_string(total) + ": " + errno_text());
    }
    if (n == 0) break;
    crc = io::crc32c(buf.data(), static_cast<size_t>(n), crc);
    total += static_cast<uint64_t>(n);
  }
  return {total, crc};
}

std::string hex32(uint32_t v) { return fmt::format("{:08x}", v); }

// The run id a checkpoint's manifest records ("" when it has none or cannot be read: written
// before run ids, or damaged).
std::string run_id_of(const fs::path& ckpt) {
  try {
    const json m = json::parse(read_text_file(ckpt / kManifest), nullptr, /*allow_exceptions=*/false);
    if (m.is_object() && m.contains("run_id") && m["run_id"].is_string()) return m["run_id"].get<std::string>();
  } catch (const std::exception&) {
  }
  return "";
}

// For an error about a damaged checkpoint: the newest complete checkpoint in `dir` older than
// step `before` (any, when before < 0), named as the way out.
std::string resume_instead(const fs::path& dir, int64_t before) {
  const auto all = complete_checkpoints(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if ((before < 0 || it->first < before) && is_train_checkpoint(it->second))
      return "the newest complete checkpoint before it is " + it->second.string() + ": resume from it with --resume " +
             it->second.string() + ", or move the damaged one away";
  return "no complete checkpoint is there to resume instead: move the damaged one away to start fresh";
}


}  // namespace

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:08d}", step); }

void prepare_checkpoint_dir(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error("--checkpoint-dir " + dir.string() + ": cannot create it: " + ec.message());
  if (!fs::is_directory(dir)) throw std::runtime_error("--checkpoint-dir " + dir.string() + ": not a directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw std::runtime_error("--checkpoint-dir " + dir.string() + ": not writable: " + errno_text());
}

void remove_dead_checkpoint_temporaries(const fs::path& dir) {
  // Temporary directories of runs killed while writing (.tmp-<pid>-...): removed once that pid
  // is gone. Never anything else.
  remove_dead_pid_dirs(dir, ".tmp-");
}

fs::path write_train_checkpoint(const fs::path& dir, int64_t step, const TrainCheckpointContent& c, int keep) {
  if (keep < 1) throw std::invalid_argument("--keep must be at least 1");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error(dir.string() + ": cannot create the checkpoint directory: " + ec.message());
  const fs::path final_path = dir / checkpoint_name(step);
  // Its run id: rotation removes, and a save of the same step replaces, only this run's own.
  const std::string run_id =
      c.state.contains("run_id") && c.state["run_id"].is_string() ? c.state["run_id"].get<std::string>() : "";
  TempDir tmp = TempDir::create_owned(dir / ".tmp", "-");  // .tmp-<pid>-XXXXXX

  json files = json::array();
  auto add = [&](const std::string& name, WrittenFile w) {
    files.push_back({{"name", name}, {"bytes", w.bytes}, {"crc32c", hex32(w.crc32c)}});
  };
  add("model.safetensors", write_safetensors_file(tmp.path() / "model.safetensors", c.model));
  add("optimizer.safetensors", write_safetensors_file(tmp.path() / "optimizer.safetensors", c.optimizer));
  write_hf_config(c.cfg, tmp.path() / "config.json");
  {
    const auto [bytes, crc] = file_crc(tmp.path() / "config.json");
    add("config.json", WrittenFile{bytes, crc});
  }
  json manifest = c.state;
  manifest["format"] = kTrainCheckpointFormat;
  manifest["version"] = kTrainCheckpointVersion;
  manifest["step"] = step;
  manifest["files"] = files;
  write_file_synced(tmp.path() / kManifest, manifest.dump(2) + "\n");
  if (::chmod(tmp.path().c_str(), 0755) != 0)
    throw std::runtime_error(tmp.path().string() + ": chmod failed: " + errno_text());
  fsync_dir(tmp.path());

  // Into place. A checkpoint of the same step (a resumed run saving again) is replaced whole,
  // only when it is this run's own.
  if (fs::exists(final_path, ec) && is_train_checkpoint(final_path) && run_id_of(final_path) != run_id)
    throw std::runtime_error(final_path.string() + " is a checkpoint of another run (or of one written before run "
                             "ids); not replaced: move it away, or resume with a --checkpoint-dir of its own");
  if (fs::exists(final_path, ec)) {
    replace_directory(tmp.path(), final_path);
  } else {
    if (::rename(tmp.path().c_str(), final_path.c_str()) != 0)
      throw std::runtime_error(final_path.string() + ": rename from " + tmp.path().string() + " failed: " + errno_text());
  }
  tmp.release();
  fsync_dir(dir);

  // `latest`, replaced by rename so it is always whole.
  const fs::path latest_tmp = dir / fmt::format(".latest-{}", ::getpid());
  write_file_synced(latest_tmp, checkpoint_name(step) + "\n");
  if (::rename(latest_tmp.c_str(), (dir / kLatest).c_str()) != 0)
    throw std::runtime_error((dir / kLatest).string() + ": rename failed: " + errno_text());
  fsync_dir(dir);

  // Rotation: the newest `keep` complete checkpoints stay (the one just written among them).
  // An old checkpoint is first renamed out of the step-N namespace (atomic), then removed: a
  // kill in the middle of the removal leaves a .tmp-<pid>-* directory (removed by the next
  // run), never a step-N directory with files missing.
  // Only this run's checkpoints: another run's, or one written before run ids, is never removed.
  auto all = complete_checkpoints(dir);
  for (auto it = all.begin(); it != all.end();)
    it = !run_id.empty() && run_id_of(it->second) == run_id ? std::next(it) : all.erase(it);
  while (static_cast<int>(all.size()) > keep && all.begin()->first != step) {
    const fs::path doomed = dir / fmt::format(".tmp-{}-drop-{}", ::getpid(), all.begin()->second.filename().string());
    {
      // Registered before the rename: removed now, or by the signal handler on a second Ctrl-C
      // at any instant from here (a failed rename leaves nothing to remove).
      TempDir gone(doomed);
      if (::rename(all.begin()->second.c_str(), doomed.c_str()) != 0) {
        // Best effort, as before: a checkpoint that cannot be moved out stays whole.
      }
    }
    all.erase(all.begin());
  }
  return final_path;
}

bool is_train_checkpoint(const fs::path& path) {
  std::error_code ec;
  return fs::is_regular_file(path / kManifest, ec);
}

json verify_train_checkpoint(const fs::path& ckpt) {
  const fs::path mpath = ckpt / kManifest;
  if (!is_train_checkpoint(ckpt))
    throw std::runtime_error(ckpt.string() + ": not a training checkpoint (no " + kManifest + ")");
  json m;
  const auto bad = [&](const std::string& why) { return std::runtime_error(mpath.string() + ": " + why); };
  try {
    const std::string text = read_text_file(mpath);
    if (safetensors::json_nesting_depth(text) > 16) throw bad("nested too deeply");
    m = json::parse(text);
  } catch (const json::exception& e) {
    throw bad(std::string("malformed manifest: ") + e.what());
  }
  if (!m.is_object()) throw bad("not a JSON object");
  if (!m.contains("format") || !m["format"].is_string() || m["format"].get<std::string>() != kTrainCheckpointFormat)
    throw bad("format is not " + std::string(kTrainCheckpointFormat));
  if (!m.contains("version") || !m["version"].is_number_integer() || m["version"].get<int64_t>() != kTrainCheckpointVersion)
    throw bad("unsupported version (this strata reads version " + std::to_string(kTrainCheckpointVersion) + ")");
  if (!m.contains("step") || !m["step"].is_number_integer() || m["step"].get<int64_t>() < 0)
    throw bad("'step' missing or invalid");
  if (!m.contains("files") || !m["files"].is_array()) throw bad("'files' missing");
  std::set<std::string> seen;
  for (const json& f : m["files"]) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() || !f.contains("bytes") ||
        !f["bytes"].is_number_unsigned() || !f.contains("crc32c") || !f["crc32c"].is_string())
      throw std::runtime_error(mpath.string() + ": malformed entry in 'files': " + f.dump());
    const std::string name = f["name"].get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      throw std::runtime_error(mpath.string() + ": file name '" + name + "' is not a file in the checkpoint");
    seen.insert(name);
    const fs::path p = ckpt / name;
    std::error_code ec;
    const uint64_t want = f["bytes"].get<uint64_t>();
    const uint64_t have = fs::file_size(p, ec);
    if (ec) throw std::runtime_error(p.string() + ": missing from the checkpoint (" + ec.message() + ")");
    if (have != want)
      throw std::runtime_error(p.string() + ": " + std::to_string(have) + " bytes, the manifest says " +
                               std::to_string(want) + " (truncated or replaced)");
    const auto [bytes, crc] = file_crc(p);
    if (bytes != want || hex32(crc) != f["crc32c"].get<std::string>())
      throw std::runtime_error(p.string() + ": checksum mismatch (crc32c " + hex32(crc) + ", the manifest says " +
                               f["crc32c"].get<std::string>() + "): the file is corrupt");
  }
  for (const char* required : {"model.safetensors", "optimizer.safetensors", "config.json"})
    if (!seen.count(required))
      throw std::runtime_error(mpath.string() + ": the manifest does not list " + required);
  return m;
}

std::string older_checkpoint_hint(const fs::path& ckpt) {
  const int64_t step = step_of_name(ckpt.filename().string());
  if (step < 0) return "no older checkpoint is known for it";
  return resume_instead(ckpt.parent_path().empty() ? fs::path(".") : ckpt.parent_path(), step);
}

fs::path find_resume_checkpoint(const std::string& resume, const std::string& checkpoint_dir) {
  const bool is_auto = resume == "auto";
  if (is_auto && checkpoint_dir.empty())
    throw std::invalid_argument("--resume auto looks under --checkpoint-dir; give --checkpoint-dir DIR");
  const fs::path base = is_auto ? fs::path(checkpoint_dir) : fs::path(resume);
  const std::string flag = is_auto ? "--resume auto (--checkpoint-dir " + checkpoint_dir + ")" : "--resume " + resume;
  std::error_code ec;
  const fs::file_status st = fs::status(base, ec);
  if (!fs::exists(st)) {
    if (is_auto) return {};  // the first run of this directory
    throw std::runtime_error("--resume " + resume + ": does not exist");
  }
  if (is_train_checkpoint(base)) return base;
  if (!fs::is_directory(st)) {
    if (is_auto) throw std::runtime_error("--checkpoint-dir " + checkpoint_dir + ": not a directory");
    throw std::runtime_error("--resume " + resume + ": not a checkpoint or a checkpoint directory");
  }
  const auto all = complete_checkpoints(base);
  const fs::path latest = base / kLatest;
  const bool has_latest = fs::exists(fs::symlink_status(latest, ec));
  if (!has_latest && all.empty()) {
    if (is_auto) return {};  // no checkpoint at all: a fresh start
    throw std::runtime_error("--resume " + resume + ": no checkpoint in it (no 'latest', no step-N directory)");
  }
  // The checkpoint to continue: what `latest` names, else the newest step-N. Anything wrong with
  // it is an error (never a silent fresh start, never a silent older checkpoint): the user
  // decides, and the message names the newest complete checkpoint as the way out.
  std::string why;
  fs::path damaged;
  if (has_latest) {
    std::string name;
    try {
      name = read_text_file(latest);
    } catch (const std::exception& e) {
      why = e.what();
    }
    while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
    const bool well_formed = name.rfind("step-", 0) == 0 && name.size() < 64 && name.find('/') == std::string::npos &&
                             name.find('\0') == std::string::npos;
    if (why.empty() && well_formed && is_train_checkpoint(base / name)) return base / name;
    if (why.empty())
      why = latest.string() + " names " +
            (well_formed ? "'" + name + "', which is not a complete checkpoint there (no " + kManifest + ")"
                         : std::string("no checkpoint (it is damaged)"));
    if (well_formed) damaged = base / name;
  } else {
    const fs::path newest = all.rbegin()->second;
    if (is_train_checkpoint(newest)) return newest;
    why = newest.string() + " is not a complete checkpoint (no " + kManifest + ")";
    damaged = newest;
  }
  throw std::runtime_error(flag + ": " + why + "; " +
                           resume_instead(base, damaged.empty() ? -1 : step_of_name(damaged.filename().string())));
}

std::vector<std::string> checkpoints_of_other_runs(const fs::path& dir, const std::string& run_id, bool fresh) {
  std::vector<std::string> out;
  for (const auto& [step, path] : complete_checkpoints(dir)) {
    if (fresh) {
      out.push_back(path.filename().string());
      continue;
    }
    const std::string id = run_id_of(path);
    if (!id.empty() && id != run_id) out.push_back(path.filename().string());
  }
  return out;
}

}  // namespace strata
