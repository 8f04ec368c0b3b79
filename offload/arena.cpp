// Arena: first-fit over an ordered map of holes, coalescing on free.
#include "offload/arena.h"

#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <iterator>

#include "offload/tier.h"

namespace strata::offload {

Arena::Arena(uint64_t capacity) : capacity_(capacity / kAlign * kAlign) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::optional<uint64_t> Arena::alloc(uint64_t bytes) {
  uint64_t need = align_up(bytes == 0 ? 1 : bytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    uint64_t off = it->first, len = it->second;
    free_.erase(it);
    if (len > need) free_.emplace(off + need, len - need);
    used_ += need;
    if (used_ > peak_) peak_ = used_;
    check();
    return off;
  }
  return std::nullopt;
}

void Arena::free(uint64_t offset, uint64_t bytes) {
  uint64_t len = align_up(bytes == 0 ? 1 : bytes);
  assert(offset + len <= capacity_ && used_ >= len);
  auto next = free_.lower_bound(offset);
  assert(next == free_.end() || next->first >= offset + len);  // no double free
  if (next != free_.end() && next->first == offset + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    assert(prev->first + prev->second <= offset);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(offset, len);
  used_ -= align_up(bytes == 0 ? 1 : bytes);
  check();
}

bool Arena::can_alloc(uint64_t bytes) const {
  uint64_t need = align_up(bytes == 0 ? 1 : bytes);
  for (const auto& [off, len] : free_)
    if (len >= need) return true;
  return false;
}

uint64_t Arena::largest_free() const {
  uint64_t best = 0;
  for (const auto& [off, len] : free_) best = len > best ? len : best;
  return best;
}

double Arena::fragmentation() const {
  uint64_t free_bytes = capacity_ - used_;
  return free_bytes == 0 ? 0.0 : 1.0 - static_cast<double>(largest_free()) / static_cast<double>(free_bytes);
}

// The hard budget, checked at every change in every build (a few holes: cheap): exceeding it is
// a bug in offload/, never a user error, so it aborts with the numbers.
void Arena::check() const {
  uint64_t holes = 0;
  for (const auto& [off, len] : free_) holes += len;
  if (used_ > capacity_ || holes + used_ != capacity_) {
    std::fprintf(stderr, "strata: offload arena invariant broken: used %llu + free %llu != budget %llu\n",
                 static_cast<unsigned long long>(used_), static_cast<unsigned long long>(holes),
                 static_cast<unsigned long long>(capacity_));
    std::abort();
  }
}

}  // namespace strata::offload
