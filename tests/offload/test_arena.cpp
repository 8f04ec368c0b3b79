// Arena: first fit, coalescing, the budget as a hard limit, fragmentation reported.
#include <gtest/gtest.h>

#include <random>

#include "offload/arena.h"
#include "offload/tier.h"

using namespace strata::offload;

TEST(Arena, FirstFitCoalescesAndNeverExceedsCapacity) {
  Arena a(10 * kAlign);
  auto x = a.alloc(1), y = a.alloc(3 * kAlign), z = a.alloc(kAlign + 1);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, kAlign);
  EXPECT_EQ(*z, 4 * kAlign);
  EXPECT_EQ(a.used(), 6 * kAlign);
  EXPECT_FALSE(a.alloc(5 * kAlign));  // 4 pages free
  a.free(*y, 3 * kAlign);
  EXPECT_EQ(a.largest_free(), 4 * kAlign);
  EXPECT_NEAR(a.fragmentation(), 1.0 - 4.0 / 7.0, 1e-12);  // holes of 3 and 4 pages
  a.free(*x, 1);
  a.free(*z, kAlign + 1);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.largest_free(), 10 * kAlign);
  EXPECT_EQ(a.fragmentation(), 0.0);
  EXPECT_EQ(a.peak(), 6 * kAlign);
}

TEST(Arena, RandomAllocFreeKeepsAccounting) {
  std::mt19937_64 rng(7);
  Arena a(256 * kAlign);
  std::vector<std::pair<uint64_t, uint64_t>> live;
  for (int i = 0; i < 20000; ++i) {
    if (!live.empty() && rng() % 2) {
      size_t k = rng() % live.size();
      a.free(live[k].first, live[k].second);
      live.erase(live.begin() + static_cast<long>(k));
    } else {
      uint64_t bytes = 1 + rng() % (9 * kAlign);
      const bool fits = a.can_alloc(bytes);  // asked before, so the answer is checked against alloc
      auto off = a.alloc(bytes);
      EXPECT_EQ(off.has_value(), fits);
      if (off) {
        for (auto& [o, b] : live) ASSERT_TRUE(*off + align_up(bytes) <= o || o + align_up(b) <= *off) << "overlap";
        live.push_back({*off, bytes});
      }
    }
    ASSERT_LE(a.used(), a.capacity());
  }
}
