// AlignedBuffer: alignment, moves, helpers.
#include <gtest/gtest.h>

#include <cstring>

#include "io/aligned_buffer.h"

using namespace strata::io;

TEST(AlignedBuffer, AlignedAndMovable) {
  AlignedBuffer a(10000);
  EXPECT_TRUE(is_aligned(a.data()));
  EXPECT_EQ(a.size(), 10000u);
  std::memset(a.data(), 3, a.size());
  AlignedBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.as<unsigned char>()[9999], 3);
  AlignedBuffer big(8u << 20);
  EXPECT_TRUE(is_aligned(big.data()));
  EXPECT_EQ(round_up(1), 4096u);
  EXPECT_EQ(round_up(8192), 8192u);
  EXPECT_FALSE(is_aligned(uint64_t{100}));
}
