// Locks, the read/write path rules and the ranks' agreement on flags; see run_guard.h.
#include "src/train/run_guard.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <stdexcept>
#include <thread>
#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/checkpoint/hf.h"
#include "src/checkpoint/train_checkpoint.h"
#include "src/comm/communicator.h"
#include "src/model/config.h"
#include "src/train/options.h"

namespace strata {
namespace fs = std::filesystem;

// ---- PathLock -------------------------------------------------------------------------------

LockResult lock_exclusive(int fd, const std::string& what) {
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return LockResult::locked;
  if (errno == EWOULDBLOCK) return LockResult::held_elsewhere;
  if (errno == ENOSYS || errno == EOPNOTSUPP || errno == ENOLCK) {
    // A filesystem without locks (Lustre without -o flock, NFS with nolock): warned, not fatal.
    std::fprintf(stderr, "strata: warning: %s: the filesystem does not support locks (%s); nothing stops another "
                 "run from using it at the same time\n", what.c_str(), errno_text().c_str());
    return LockResult::unsupported;
  }
  throw std::runtime_error(what + ": cannot lock it: " + errno_text());
}

PathLock PathLock::acquire(const fs::path& lock_file, const std::string& what, bool remove_on_release) {
  // A lock file removed by its last holder between our open and our flock would leave us
  // holding a lock nobody else can see: lock, then check the path still names the file we hold.
  for (int attempt = 0; attempt < 16; ++attempt) {
    UniqueFd fd(::open(lock_file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (fd.get() < 0)
      throw std::runtime_error(what + ": cannot create the lock file " + lock_file.string() + ": " + errno_text());
    const LockResult got = lock_exclusive(fd.get(), what);
    if (got == LockResult::unsupported) return PathLock();
    if (got == LockResult::held_elsewhere) {
      std::string holder;
      char buf[32] = {};
      const ssize_t n = ::pread(fd.get(), buf, sizeof(buf) - 1, 0);
      if (n > 0) holder = std::string(buf, static_cast<size_t>(n));
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      throw std::runtime_error(what + " is in use by another strata run" +
                               (holder.empty() ? std::string() : " (pid " + holder + ")") +
                               "; two runs would overwrite each other's files: wait for it, stop it, or give this "
                               "run another directory");
    }
    struct stat held {}, named {};
    if (::fstat(fd.get(), &held) != 0)
      throw std::runtime_error(lock_file.string() + ": fstat failed: " + errno_text());
    if (::stat(lock_file.c_str(), &named) != 0 || named.st_ino != held.st_ino || named.st_dev != held.st_dev)
      continue;  // removed or replaced meanwhile: lock the file that is there now
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd.get(), 0) != 0 || ::pwrite(fd.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size()))
      throw std::runtime_error(what + ": cannot write the lock file " + lock_file.string() + ": " + errno_text());
    PathLock l;
    l.path_ = lock_file;
    l.fd_ = std::move(fd);
    l.remove_ = remove_on_release;
    return l;
  }
  throw std::runtime_error(what + ": the lock file " + lock_file.string() + " keeps being replaced; is another "
                           "program removing it?");
}

PathLock& PathLock::operator=(PathLock&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    fd_ = std::move(o.fd_);
    remove_ = o.remove_;
  }
  return *this;
}

PathLock::~PathLock() { release(); }

void PathLock::release() {
  if (fd_.get() < 0) return;
  // Removed while still locked: a run that opens it meanwhile finds the inode gone (acquire's
  // check) and starts over on a new file.
  struct stat held {}, named {};
  if (remove_ && ::fstat(fd_.get(), &held) == 0 && ::stat(path_.c_str(), &named) == 0 &&
      held.st_ino == named.st_ino && held.st_dev == named.st_dev)
    ::unlink(path_.c_str());  // only the file this run holds, never a newer run's
  fd_ = UniqueFd();
}

namespace {
fs::path real(const fs::path& p);
}  // namespace

fs::path dir_lock_file(const fs::path& dir) {
  const fs::path d = real(dir);  // one lock for every spelling of the directory (./x, /abs/x, a symlink)
  std::string name = ".";
  name += d.filename().string();
  name += ".strata-lock";
  return d.parent_path() / name;
}

// ---- paths ----------------------------------------------------------------------------------

namespace {

// The path with every existing part's symlinks resolved (what the kernel would open), absolute.
fs::path real(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p, ec), ec);
  if (ec) r = fs::absolute(p, ec).lexically_normal();
  if (!r.has_filename() && r.has_parent_path() && r != r.root_path()) r = r.parent_path();  // "dir/" -> "dir"
  return r;
}

// a is b or lies under it.
bool within(const fs::path& a, const fs::path& b) {
  auto ai = a.begin(), bi = b.begin();
  for (; bi != b.end(); ++ai, ++bi)
    if (ai == a.end() || *ai != *bi) return false;
  return true;
}

// Under a checkpoint directory, the names it manages itself: step-N (and what is in them),
// `latest`, temporaries and its lock. Anything else there is the user's (a metrics file, a
// final model beside the checkpoints).
bool reserved_in_checkpoint_dir(const fs::path& p, const fs::path& ckpt) {
  const fs::path rel = p.lexically_relative(ckpt);
  if (rel.empty() || rel == ".") return true;
  const std::string first = rel.begin()->string();
  return first.rfind("step-", 0) == 0 || first == "latest" || first.rfind(".tmp", 0) == 0 ||
         first.rfind(".latest", 0) == 0;
}

bool same_file(const fs::path& a, const fs::path& b) {
  struct stat sa {}, sb {};
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return real(a) == real(b);
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

}  // namespace

void check_run_paths(const TrainOptions& o, const RunPaths& reads) {
  const bool has_out = !o.out.empty(), has_ckpt = !o.checkpoint_dir.empty(), has_metrics = !o.metrics.empty();
  const fs::path out = has_out ? real(o.out) : fs::path(), ckpt = has_ckpt ? real(o.checkpoint_dir) : fs::path();
  if (has_out && has_ckpt) {
    if (out == ckpt)
      throw std::invalid_argument("--out " + o.out + " is also the --checkpoint-dir: the final save would replace the "
                                  "run's checkpoints; give --out a directory of its own, beside the checkpoint directory");
    if (within(ckpt, out))
      throw std::invalid_argument("--checkpoint-dir " + o.checkpoint_dir + " is inside --out " + o.out +
                                  ": the final save replaces --out whole; put them side by side");
    if (within(out, ckpt) && reserved_in_checkpoint_dir(out, ckpt))
      throw std::invalid_argument("--out " + o.out + " is a name the checkpoint directory " + o.checkpoint_dir +
                                  " uses for itself (step-N, latest, .tmp-*); name it otherwise, e.g. " +
                                  (fs::path(o.checkpoint_dir) / "final").string());
  }
  if (has_out)
    for (const std::string& swap : o.nvme_paths)
      if (within(real(swap), out))
        throw std::invalid_argument("--nvme-path " + swap + " is --out " + o.out + " or inside it: the swap files "
                                    "would sit in the directory the final save replaces whole (and it would refuse "
                                    "to); put them elsewhere");
  // A LoRA run's --out is an adapter (or, merged, a model): written over its own base, the base
  // the adapter needs would be gone, whatever --overwrite-model says.
  if (has_out && !reads.model_dir.empty() && out == real(reads.model_dir) && o.lora_rank > 0 && !o.merge_adapter)
    throw std::invalid_argument("--out " + o.out + " is the base --model: the adapter would replace the base it "
                                "needs; give --out a directory of its own (--overwrite-model does not apply to an "
                                "adapter)");
  if (has_out && !o.adapter.empty() && out == real(o.adapter) && o.merge_adapter)
    throw std::invalid_argument("--out " + o.out + " is the --adapter being merged: give the merged model a directory "
                                "of its own");
  if (has_out && !reads.model_dir.empty() && out == real(reads.model_dir) && !o.overwrite_model)
    throw std::invalid_argument("--out " + o.out + " is the input --model: saving would replace the model the run "
                                "started from; give --out another directory, or add --overwrite-model to replace it");
  if (has_out && !reads.resume.empty() && within(real(reads.resume), out))
    throw std::invalid_argument("--out " + o.out + " would replace the checkpoint this run resumes (" +
                                reads.resume.string() + "); give --out another directory");
  if (!has_metrics) return;
  const fs::path metrics = real(o.metrics);
  auto refuse = [&](const std::string& why) {
    throw std::invalid_argument("--metrics " + o.metrics + ": " + why + "; give --metrics a file of its own (e.g. " +
                                "run.jsonl)");
  };
  for (const auto* files : {&reads.model_files, &reads.data_files})
    for (const fs::path& f : *files)
      if (same_file(f, o.metrics)) refuse("is " + f.string() + ", which this run reads");
  if (!reads.resume.empty() && within(metrics, real(reads.resume)))
    refuse("is inside the checkpoint this run resumes (" + reads.resume.string() + ")");
  if (!reads.model_dir.empty() && within(metrics, real(reads.model_dir)))
    refuse("is inside the --model directory " + reads.model_dir.string());
  if (has_ckpt && within(metrics, ckpt) && reserved_in_checkpoint_dir(metrics, ckpt))
    refuse("is a name the checkpoint directory " + o.checkpoint_dir + " uses for itself (step-N, latest, .tmp-*)");
  if (has_out && within(metrics, out)) refuse("is inside --out " + o.out + ", which the final save replaces");
  check_metrics_file(o.metrics);
}

void check_metrics_file(const fs::path& metrics) {
  std::error_code ec;
  const fs::file_status st = fs::status(metrics, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw std::invalid_argument("--metrics " + metrics.string() + ": " + ec.message());
  if (!fs::exists(st)) return;
  // A device or a FIFO (/dev/null, /dev/stdout, `>(jq ...)`) is a stream: nothing to lose.
  if (fs::is_character_file(st) || fs::is_fifo(st)) return;
  if (!fs::is_regular_file(st)) {
    struct stat s {};
    const std::string what = ::stat(metrics.c_str(), &s) == 0 ? file_type_name(s.st_mode) : "not a regular file";
    throw std::invalid_argument("--metrics " + metrics.string() + ": is " + what +
                                "; --metrics writes a JSON-lines file: name a new file");
  }
  uint64_t size = 0;
  UniqueFd fd = open_regular_file(metrics, &size);
  if (size == 0) return;
  // Its first line tells (read alone: the file can be long, and a resumed run reads it whole
  // later anyway): an object with an integer "step". strata's lines are under 1 KiB.
  std::string head(static_cast<size_t>(std::min<uint64_t>(size, 64 << 10)), '\0');
  const ssize_t n = ::pread(fd.get(), head.data(), head.size(), 0);
  if (n < 0) throw std::invalid_argument("--metrics " + metrics.string() + ": cannot read it: " + errno_text());
  head.resize(static_cast<size_t>(n));
  const nlohmann::json j = nlohmann::json::parse(head.substr(0, head.find('\n')), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer())
    throw std::invalid_argument("--metrics " + metrics.string() +
                                ": exists and is not a strata metrics file (its first line is not a JSON object with "
                                "a \"step\"); strata appends only to its own metrics files: name a new file");
}

// ---- flags ----------------------------------------------------------------------------------

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-+=.,/:@%") ==
                        std::string::npos)
    return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

namespace {

uint64_t fnv1a(const std::string& s, uint64_t h = 0xcbf29ce484222325ull) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

std::string config_text(const ModelConfig& c) {
  return fmt::format("{} {} {} {} {} {} {} {} {} {:.17g} {:.17g} {} {} {} {} {} {} {}", c.model_type, c.vocab_size,
                     c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size,
                     c.max_position_embeddings, c.norm_eps, c.rope_theta, c.rope_scaling.type,
                     c.tie_word_embeddings, c.attention_bias, c.o_bias, c.mlp_bias, c.activation, c.torch_dtype);
}

}  // namespace

void check_ranks_agree(Communicator& comm, const TrainOptions& o, const ModelConfig& cfg, const fs::path& resume) {
  const int world = comm.world();
  if (world <= 1) return;
  std::vector<std::pair<std::string, std::string>> values = option_values(o);
  values.push_back({"the model's config.json (--model/--preset)", config_text(cfg)});
  values.push_back({"the checkpoint resumed (--resume)", resume.empty() ? "none (a fresh start)" : real(resume).string()});
  // The count first, alone: ranks of different strata builds do not even list the same flags.
  const uint64_t count = values.size();
  std::vector<uint64_t> counts(static_cast<size_t>(world));
  comm.host_all_gather(&count, counts.data(), sizeof(count));
  for (uint64_t c : counts)
    if (c != count)
      throw std::invalid_argument("the ranks of this job run different strata builds (they list different flags); "
                                  "start every rank with the same binary");
  std::vector<uint64_t> mine{count};
  for (const auto& [flag, value] : values) mine.push_back(fnv1a(value));
  std::vector<uint64_t> all(mine.size() * static_cast<size_t>(world));
  comm.host_all_gather(mine.data(), all.data(), mine.size() * sizeof(uint64_t));
  size_t first_difference = 0;
  for (size_t i = 0; i < mine.size() && !first_difference; ++i)
    for (int r = 1; r < world; ++r)
      if (all[static_cast<size_t>(r) * mine.size() + i] != all[i]) first_difference = i + 1;
  if (!first_difference) return;
  const size_t i = first_difference - 1;
  if (i == 0)
    throw std::invalid_argument("the ranks of this job run different strata builds (they list different flags); "
                                "start every rank with the same binary");
  // Every rank decided the same: exchange that flag's values so rank 0 names them all.
  const std::string& value = values[i - 1].second;
  uint64_t len = value.size(), max_len = 0;
  std::vector<uint64_t> lens(static_cast<size_t>(world));
  comm.host_all_gather(&len, lens.data(), sizeof(len));
  for (uint64_t l : lens) max_len = std::max(max_len, l);
  std::string padded = value;
  padded.resize(static_cast<size_t>(max_len) + 1, '\0');
  std::string every(padded.size() * static_cast<size_t>(world), '\0');
  comm.host_all_gather(padded.data(), every.data(), padded.size());
  std::string by_rank;
  for (int r = 0; r < world; ++r) {
    const std::string v = every.substr(static_cast<size_t>(r) * padded.size(), static_cast<size_t>(lens[static_cast<size_t>(r)]));
    by_rank += fmt::format("{}rank {} has {}", r ? ", " : "", r, v.empty() ? "it unset" : shell_quote(v));
  }
  const std::string message = fmt::format(
      "{} differs between the ranks of this job ({}); start every rank with the same flags (only --threads and "
      "--nvme-path may differ)",
      values[i - 1].first, by_rank);
  // Rank 0 reports for the job (one line, and its abort ends the others); a rank that is not
  // ended within a while reports too.
  if (comm.rank() != 0)
    for (int waited = 0; waited < 300; ++waited) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  throw std::invalid_argument(message);
}

std::string new_run_id() {
  std::random_device rd;
  const uint64_t t = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32 ^ rd()) ^ t * 0x9e3779b97f4a7c15ull ^
                     static_cast<uint64_t>(::getpid()) << 17;
  return fmt::format("{:016x}", v);
}

PathLock guard_run_outputs(const TrainOptions& o, const RunPaths& reads, const std::string& run_id) {
  check_run_paths(o, reads);
  if (!o.checkpoint_dir.empty()) {
    const std::vector<std::string> others = checkpoints_of_other_runs(o.checkpoint_dir, run_id, reads.resume.empty());
    if (!others.empty()) {
      std::string list;
      for (size_t i = 0; i < others.size() && i < 3; ++i) list += (i ? ", " : "") + others[i];
      if (others.size() > 3) list += fmt::format(" and {} more", others.size() - 3);
      throw std::runtime_error(
          "--checkpoint-dir " + o.checkpoint_dir + " holds checkpoints of another run (" + list + "); " +
          (reads.resume.empty() ? "continue that run with --resume auto, or give this run another --checkpoint-dir"
                                : "give this run a --checkpoint-dir of its own") +
          " (strata never writes over or rotates away another run's checkpoints)");
    }
  }
  if (o.out.empty()) return {};
  // Locked first (the lock file sits beside --out), then the save's own rules, so a finished run
  // is never lost at the end; they also clear what dead runs left beside it.
  std::error_code ec;
  std::filesystem::create_directories(dir_lock_file(o.out).parent_path(), ec);
  PathLock lock = PathLock::acquire(dir_lock_file(o.out), "--out " + o.out, /*remove_on_release=*/true);
  try {
    check_hf_save_target(o.out);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("--out ") + e.what());  // the messages start with the path
  }
  return lock;
}

}  // namespace strata
