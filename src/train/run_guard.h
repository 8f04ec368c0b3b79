// What keeps a run from destroying files, its own inputs or another run's: an exclusive lock on
// --checkpoint-dir and on --out for the life of the run, the files a run reads kept apart from
// the files it writes, a --metrics file that is only ever a metrics file, and (mpirun) every
// rank started with the same flags. Checked before anything is written.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "src/checkpoint/file_util.h"

namespace strata {

struct TrainOptions;
struct ModelConfig;
class Communicator;

// flock(LOCK_EX | LOCK_NB) on an open file: held, held by another process, or impossible on
// this filesystem (warned once per call, naming `what`); any other failure throws.
enum class LockResult { locked, held_elsewhere, unsupported };
LockResult lock_exclusive(int fd, const std::string& what);

// An exclusive flock(2) on a lock file, held until destroyed; the kernel releases it when the
// process dies (kill -9 included), so a stale lock never blocks a later run. The holder's pid
// is written into the file, so a refused run can name it.
class PathLock {
 public:
  PathLock() = default;
  // Locks `lock_file` (created if missing) or throws naming `what` ("--checkpoint-dir DIR") and
  // the pid holding it. remove_on_release: the file is removed when the lock is given up (a
  // lock file beside --out, which should not outlive the run).
  static PathLock acquire(const std::filesystem::path& lock_file, const std::string& what, bool remove_on_release);
  PathLock(PathLock&&) noexcept = default;
  PathLock& operator=(PathLock&&) noexcept;
  ~PathLock();
  bool held() const { return fd_.get() >= 0; }

 private:
  void release();
  std::filesystem::path path_;
  UniqueFd fd_;
  bool remove_ = false;
};

// The lock file of a directory a run writes (--checkpoint-dir, --out): beside it, named after
// its canonical path, so one run's --out and another's --checkpoint-dir in the same place
// collide, and a save that replaces --out whole never moves the lock.
std::filesystem::path dir_lock_file(const std::filesystem::path& dir);

// The paths a run reads (model files, data shards, the checkpoint it resumes) and writes
// (--out, --checkpoint-dir, --metrics), checked against each other before anything is written:
// --metrics is never a file the run reads nor inside a directory it replaces or rotates; --out
// is never --checkpoint-dir, around it or one of its own names, never holds an --nvme-path, nor
// is the input model unless overwrite_model. Throws one line naming both flags and the fix.
struct RunPaths {
  std::filesystem::path model_dir;                 // --model (empty: none)
  std::vector<std::filesystem::path> model_files;  // what is read from it (and an --adapter's files)
  std::vector<std::filesystem::path> data_files;   // token shards
  std::filesystem::path resume;                    // the checkpoint resumed (empty: none)
};
void check_run_paths(const TrainOptions& o, const RunPaths& reads);

// Rank 0 of a run, before it writes anything: check_run_paths; --checkpoint-dir (already locked)
// must hold no other run's checkpoints than run `run_id`'s (a fresh run: none, reads.resume
// empty); --out is locked and may be replaced by a save. Returns the lock on --out (none
// without --out); throws naming the flag and the fix.
PathLock guard_run_outputs(const TrainOptions& o, const RunPaths& reads, const std::string& run_id);

// An existing --metrics file may only be a strata metrics file (JSON lines, each an object with
// an integer "step"): anything else is refused, never appended to. Absent or empty is fine.
void check_metrics_file(const std::filesystem::path& metrics);

// A shell word: quoted only when it needs to be.
std::string shell_quote(const std::string& s);

// Collective: every rank sends a digest of each flag (option_values, plus the model's config and
// the checkpoint it resumes); any difference throws, naming the flag and the ranks that differ.
// --threads and --nvme-path may differ (a rank's cores and disks are its own).
void check_ranks_agree(Communicator& comm, const TrainOptions& o, const ModelConfig& cfg,
                       const std::filesystem::path& resume);

// A new run's identity, recorded in trainer.json: rotation removes only this run's checkpoints.
std::string new_run_id();

}  // namespace strata
