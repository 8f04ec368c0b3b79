// A fixed table of paths (no allocation at cleanup time): a slot is claimed with an atomic
// state, filled, then published; the handler reads only published slots.
#include "io/cleanup.h"

#include <unistd.h>

#include <atomic>
#include <cstring>

namespace strata::io {
namespace {

constexpr int kSlots = 128;
constexpr size_t kPathMax = 4096;
enum : int { kFree = 0, kFilling = 1, kFile = 2, kDir = 3 };

struct Slot {
  std::atomic<int> state{kFree};
  char path[kPathMax];
};
Slot g_slots[kSlots];

}  // namespace

int register_cleanup(const std::string& path, bool directory) {
  if (path.size() + 1 > kPathMax) return -1;
  for (int i = 0; i < kSlots; ++i) {
    int expected = kFree;
    if (!g_slots[i].state.compare_exchange_strong(expected, kFilling)) continue;
    std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
    g_slots[i].state.store(directory ? kDir : kFile, std::memory_order_release);
    return i;
  }
  return -1;
}

void unregister_cleanup(int slot) {
  if (slot >= 0 && slot < kSlots) g_slots[slot].state.store(kFree, std::memory_order_release);
}

void emergency_cleanup() noexcept {
  for (int pass : {kFile, kDir})
    for (Slot& s : g_slots) {
      if (s.state.load(std::memory_order_acquire) != pass) continue;
      if (pass == kFile)
        ::unlink(s.path);
      else
        ::rmdir(s.path);
    }
}

}  // namespace strata::io
