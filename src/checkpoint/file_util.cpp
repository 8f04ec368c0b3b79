// POSIX file helpers for checkpoints and token shards: every syscall checked, every error
// naming the path (and offset where there is one).
#include "src/checkpoint/file_util.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <stdexcept>

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/cleanup.h"

namespace strata {

namespace fs = std::filesystem;

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message (possibly not in buf).
  const char* msg = strerror_r(err, buf, sizeof(buf));
  return msg;
}
std::string errno_text() { return errno_text(errno); }

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

void UniqueFd::close_checked(const std::filesystem::path& path) {
  int fd = release();
  if (fd >= 0 && ::close(fd) != 0) throw std::runtime_error(path.string() + ": close failed: " + errno_text());
}

UniqueFd open_regular_file(const std::filesystem::path& path, uint64_t* size) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) throw std::runtime_error(path.string() + ": cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw std::runtime_error(path.string() + ": fstat failed: " + errno_text());
  if (!S_ISREG(st.st_mode))
    throw std::runtime_error(path.string() + ": not a regular file (" + file_type_name(st.st_mode) + ")");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0)
    throw std::runtime_error(path.string() + ": fcntl failed: " + errno_text());
  if (size) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

std::string file_type_name(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  UniqueFd fd = open_regular_file(path, &size_);
  if (size_ == 0) return;
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (p == MAP_FAILED) throw std::runtime_error(path.string() + ": mmap of " + std::to_string(size_) +
                                                " bytes failed: " + errno_text());
  data_ = static_cast<const std::byte*>(p);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

UniqueFd open_for_write(const std::filesystem::path& path, bool exclusive) {
  int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (exclusive ? O_EXCL : O_TRUNC);
  UniqueFd fd(::open(path.c_str(), flags, 0644));
  if (fd.get() < 0) throw std::runtime_error(path.string() + ": cannot create: " + errno_text());
  return fd;
}

void write_all(int fd, const void* data, size_t n, const std::filesystem::path& path, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < n) {
    ssize_t w = ::write(fd, p + done, n - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(path.string() + ": write of " + std::to_string(n - done) + " bytes at offset " +
                               std::to_string(offset + done) + " failed: " + errno_text());
    }
    if (w == 0)
      throw std::runtime_error(path.string() + ": write at offset " + std::to_string(offset + done) +
                               " made no progress");
    done += static_cast<size_t>(w);
  }
}

void fsync_fd(int fd, const std::filesystem::path& path) {
  if (::fsync(fd) != 0) throw std::runtime_error(path.string() + ": fsync failed: " + errno_text());
}

void fsync_dir(const std::filesystem::path& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) throw std::runtime_error(dir.string() + ": cannot open directory to fsync: " + errno_text());
  fsync_fd(fd.get(), dir);
  fd.close_checked(dir);
}

void write_file_synced(const std::filesystem::path& path, std::string_view contents) {
  UniqueFd fd = open_for_write(path, false);
  write_all(fd.get(), contents.data(), contents.size(), path, 0);
  fsync_fd(fd.get(), path);
  fd.close_checked(path);
}

std::string read_text_file(const std::filesystem::path& path) {
  MappedFile m(path);
  return std::string(reinterpret_cast<const char*>(m.data()), m.size());
}

TempDir::TempDir(std::filesystem::path p) : path_(std::move(p)) {
  if (!path_.empty()) cleanup_slot_ = io::register_cleanup_tree(path_.string());
}

TempDir::~TempDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  io::unregister_cleanup(cleanup_slot_);  // after: a signal meanwhile removes what is left
}

void TempDir::release() {
  io::unregister_cleanup(cleanup_slot_);
  cleanup_slot_ = -1;
  path_.clear();
}

TempDir TempDir::create_owned(const std::filesystem::path& base, const std::string& suffix) {
  // mkdtemp picks the name and creates the directory at once, leaving an instant where a
  // signal would find it unregistered; here the name is drawn first, claimed, then created.
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  const std::string stem = base.string() + suffix + std::to_string(::getpid()) + "-";
  uint64_t state = (static_cast<uint64_t>(::getpid()) << 32) ^ static_cast<uint64_t>(::time(nullptr)) ^
                   reinterpret_cast<uintptr_t>(&state);
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string name = stem;
    for (int i = 0; i < 6; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;  // one LCG draw per character
      name += kChars[(state >> 33) % (sizeof(kChars) - 1)];
    }
    const int slot = io::register_cleanup_tree(name);
    if (::mkdir(name.c_str(), 0700) == 0) return TempDir(std::filesystem::path(name), slot);
    const int err = errno;
    io::unregister_cleanup(slot);
    if (err != EEXIST)
      throw std::runtime_error(base.string() + ": cannot create temporary directory " + name + ": " + errno_text(err));
  }
  throw std::runtime_error(base.string() + ": cannot create a temporary directory " + stem +
                           "XXXXXX: 100 names taken");
}

std::filesystem::path make_temp_dir(const std::filesystem::path& base, const char* suffix) {
  std::string templ = base.string() + suffix + "XXXXXX";
  if (!::mkdtemp(templ.data()))
    throw std::runtime_error(base.string() + ": cannot create temporary directory " + templ + ": " + errno_text());
  return templ;
}

std::filesystem::path make_owned_temp_dir(const std::filesystem::path& base, const std::string& suffix) {
  const std::string tagged = suffix + std::to_string(::getpid()) + "-";
  return make_temp_dir(base, tagged.c_str());
}

namespace {
// Whether pid is a process that has not exited (or one this user may not signal: not ours to
// judge). An exited process its parent has not reaped yet is a zombie and counts as gone: an
// mpirun rank killed after its launcher exited is reparented to the container's pid 1, which
// may never reap it, and would otherwise keep its partial checkpoint forever.
bool process_running(long pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno != ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  std::FILE* f = std::fopen(path, "r");
  if (!f) return errno != ENOENT;  // (gone between the two looks, or no /proc: alive)
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) S ...": the state follows the last ')' (comm may hold spaces and parentheses).
  const char* close = std::strrchr(buf, ')');
  return !(close && close[1] == ' ' && close[2] == 'Z');
}
}  // namespace

int remove_dead_pid_dirs(const std::filesystem::path& dir, const std::string& prefix, bool report) {
  std::error_code ec;
  int removed = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const size_t dash = name.find('-', prefix.size());
    if (dash == std::string::npos || dash == prefix.size()) continue;
    const std::string pid_text = name.substr(prefix.size(), dash - prefix.size());
    if (pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0 || process_running(pid)) continue;
    std::error_code rm;
    if (!fs::is_directory(fs::symlink_status(it->path(), rm))) continue;
    if (fs::remove_all(it->path(), rm) > 0 && !rm) {
      ++removed;
      if (report)
        std::fprintf(stderr, "strata: removed %s, left by a run (pid %ld) that did not finish\n", it->path().c_str(), pid);
    }
  }
  return removed;
}

namespace {
void fsync_parent(const fs::path& p) { fsync_dir(p.has_parent_path() ? p.parent_path() : fs::path(".")); }
}  // namespace

void replace_directory(const std::filesystem::path& tmp, const std::filesystem::path& out, bool use_exchange) {
  std::error_code ec;
  const bool exists = fs::exists(fs::symlink_status(out, ec));
  if (!exists) {
    if (::rename(tmp.c_str(), out.c_str()) != 0)
      throw std::runtime_error(out.string() + ": cannot rename " + tmp.string() + " into place: " + errno_text());
    fsync_parent(out);
    return;
  }
  if (!fs::is_directory(fs::symlink_status(out, ec)))
    throw std::runtime_error(out.string() + ": exists and is not a directory; refusing to replace it");
  // Atomic swap first: afterwards `tmp` holds the old directory.
  if (use_exchange) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_parent(out);
      fs::remove_all(tmp, ec);
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
      throw std::runtime_error(out.string() + ": cannot exchange with " + tmp.string() + ": " + errno_text());
  }
  // Filesystem without RENAME_EXCHANGE: move the old directory aside, move the new one in.
  const fs::path aside = make_owned_temp_dir(out, ".old-");  // reserves a name; rename replaces the empty dir
  if (::rename(out.c_str(), aside.c_str()) != 0) {
    std::string why = errno_text();
    fs::remove(aside, ec);
    throw std::runtime_error(out.string() + ": cannot move the old directory aside: " + why);
  }
  if (::rename(tmp.c_str(), out.c_str()) != 0) {
    std::string why = errno_text();
    if (::rename(aside.c_str(), out.c_str()) != 0)
      throw std::runtime_error(out.string() + ": cannot rename " + tmp.string() + " into place (" + why +
                               ") and cannot restore the old directory from " + aside.string() + ": " +
                               errno_text());
    throw std::runtime_error(out.string() + ": cannot rename " + tmp.string() + " into place: " + why);
  }
  fsync_parent(out);
  fs::remove_all(aside, ec);
}

}  // namespace strata
