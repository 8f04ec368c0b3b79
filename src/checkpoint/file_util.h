// Small POSIX helpers shared by the checkpoint and data readers/writers: an owned fd, a
// read-only memory map, complete writes that name the path and offset on failure, fsync of
// files and directories. Internal to strata_core.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace strata {

// strerror(errno) as a string (thread-safe).
std::string errno_text(int err);
std::string errno_text();

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes now and throws naming `path` if close fails (it can report a deferred write error).
  void close_checked(const std::filesystem::path& path);

 private:
  int fd_ = -1;
};

// Opens a regular file for reading (its size in *size); a FIFO, device or directory is an
// error naming the path and what it is, without ever blocking on it.
UniqueFd open_regular_file(const std::filesystem::path& path, uint64_t* size = nullptr);
// "a directory", "a FIFO", ... for a st_mode that is not a regular file.
std::string file_type_name(unsigned mode);

// A whole file mapped read-only. An empty file maps to data() == nullptr, size() == 0.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);  // throws naming the path
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  const std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

// Opens `path` for writing (created, or truncated). Throws naming the path.
UniqueFd open_for_write(const std::filesystem::path& path, bool exclusive);
// Writes all of `data` at the fd's current position; retries short writes and EINTR; throws
// naming `path` and the byte offset on failure (ENOSPC, EIO, ...). `offset` is for messages.
void write_all(int fd, const void* data, size_t n, const std::filesystem::path& path, uint64_t offset);
void fsync_fd(int fd, const std::filesystem::path& path);
void fsync_dir(const std::filesystem::path& dir);
// Writes a whole file (created or truncated), fsyncs and closes it, all checked.
void write_file_synced(const std::filesystem::path& path, std::string_view contents);
// A whole (small) file as a string; throws naming the path.
std::string read_text_file(const std::filesystem::path& path);

// mkdtemp next to `base`: "<base><suffix>XXXXXX"; throws naming `base`.
std::filesystem::path make_temp_dir(const std::filesystem::path& base, const char* suffix);
// As make_temp_dir, with this process's pid after the suffix: "<base><suffix><pid>-XXXXXX", so
// a later run can tell (remove_dead_pid_dirs) that the run which made it was killed.
std::filesystem::path make_owned_temp_dir(const std::filesystem::path& base, const std::string& suffix);
// Removes the directory trees in `dir` named "<prefix><pid>-..." whose pid is not a live
// process: what a killed run left (SIGKILL, a crash, power loss). Never anything else; best
// effort, each removal reported on stderr when `report`. Returns how many were removed.
int remove_dead_pid_dirs(const std::filesystem::path& dir, const std::string& prefix, bool report = true);

// Owns a directory being written (flat: files only): removed (best effort) on destruction
// unless released, and registered for io::emergency_cleanup meanwhile, so a second Ctrl-C in
// the middle of a checkpoint or a save leaves no full-size temporary directory behind.
class TempDir {
 public:
  TempDir() = default;
  explicit TempDir(std::filesystem::path p);
  // A new directory "<base><suffix><pid>-XXXXXX" (as make_owned_temp_dir), registered for
  // io::emergency_cleanup before it is created: a signal at any instant leaves nothing behind.
  static TempDir create_owned(const std::filesystem::path& base, const std::string& suffix);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  void release();
  const std::filesystem::path& path() const { return path_; }

 private:
  TempDir(std::filesystem::path p, int slot) : path_(std::move(p)), cleanup_slot_(slot) {}
  std::filesystem::path path_;
  int cleanup_slot_ = -1;
};
// Puts the complete directory `tmp` at `out`, replacing the directory there, if any: an atomic
// RENAME_EXCHANGE where the filesystem has it (use_exchange), else old aside -> new in -> old
// removed. On failure `out` is left as it was (or restored) and `tmp` is still there for the
// caller to remove. Refuses to replace a non-directory. Fsyncs the parent.
void replace_directory(const std::filesystem::path& tmp, const std::filesystem::path& out, bool use_exchange = true);

}  // namespace strata
