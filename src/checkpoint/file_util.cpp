// POSIX file helpers for checkpoints and token shards: every syscall checked, every error
// naming the path (and offset where there is one).
#include "src/checkpoint/file_util.h"

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace strata {

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

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw std::runtime_error(path.string() + ": cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw std::runtime_error(path.string() + ": fstat failed: " + errno_text());
  if (!S_ISREG(st.st_mode)) throw std::runtime_error(path.string() + ": not a regular file");
  size_ = static_cast<uint64_t>(st.st_size);
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

}  // namespace strata
