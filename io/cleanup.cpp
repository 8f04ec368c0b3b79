// A fixed table of paths (no allocation at cleanup time): a slot is claimed with an atomic
// state, filled, then published; the handler reads only published slots.
#include "io/cleanup.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace strata::io {
namespace {

constexpr int kSlots = 128;
constexpr size_t kPathMax = 4096;
enum : int { kFree = 0, kFilling = 1, kFile = 2, kDir = 3, kTree = 4 };

struct Slot {
  std::atomic<int> state{kFree};
  char path[kPathMax];
};
Slot g_slots[kSlots];

int claim(const std::string& path, int kind) {
  if (path.size() + 1 > kPathMax) return -1;
  for (int i = 0; i < kSlots; ++i) {
    int expected = kFree;
    if (!g_slots[i].state.compare_exchange_strong(expected, kFilling)) continue;
    std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
    g_slots[i].state.store(kind, std::memory_order_release);
    return i;
  }
  return -1;
}

// Unlinks every entry of a flat directory: open, getdents64 and unlinkat are async-signal-safe
// (opendir/readdir allocate). A subdirectory is tried with AT_REMOVEDIR (removed when empty).
void empty_directory(const char* path) noexcept {
  const int fd = ::open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  alignas(8) char buf[8192];
  for (int rounds = 0; rounds < 1024; ++rounds) {
    const long n = ::syscall(SYS_getdents64, fd, buf, sizeof(buf));
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      // struct linux_dirent64: d_ino (8), d_off (8), d_reclen (2), d_type (1), d_name.
      unsigned short reclen;
      std::memcpy(&reclen, buf + off + 16, sizeof(reclen));
      const char* name = buf + off + 19;
      if (std::strcmp(name, ".") != 0 && std::strcmp(name, "..") != 0 && ::unlinkat(fd, name, 0) != 0)
        (void)::unlinkat(fd, name, AT_REMOVEDIR);
      off += reclen;
    }
  }
  ::close(fd);
}

}  // namespace

int register_cleanup(const std::string& path, bool directory) { return claim(path, directory ? kDir : kFile); }
int register_cleanup_tree(const std::string& path) { return claim(path, kTree); }

void unregister_cleanup(int slot) {
  if (slot >= 0 && slot < kSlots) g_slots[slot].state.store(kFree, std::memory_order_release);
}

void emergency_cleanup() noexcept {
  for (int pass : {kFile, kTree, kDir})
    for (Slot& s : g_slots) {
      if (s.state.load(std::memory_order_acquire) != pass) continue;
      if (pass == kFile) {
        ::unlink(s.path);
      } else {
        // Again while the directory is not empty: an entry a getdents pass missed, or a file
        // another thread created meanwhile.
        for (int round = 0; round < 16; ++round) {
          if (pass == kTree) empty_directory(s.path);
          if (::rmdir(s.path) == 0 || errno != ENOTEMPTY || pass != kTree) break;
        }
      }
    }
}

}  // namespace strata::io
