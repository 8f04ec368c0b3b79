// crc32c: the standard check value, hardware path against the table path on odd lengths and
// misaligned starts, and chaining.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "io/crc32c.h"

using namespace strata::io;

TEST(Crc32c, CheckValue) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c(s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c_table(s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(s, 0), 0u);
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720 B.4 test vector
}

TEST(Crc32c, HardwareMatchesTable) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> buf(70000);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (int t = 0; t < 60; ++t) {
    size_t off = rng() % 16, len = rng() % (buf.size() - 16);
    if (t == 0) len = 3 * 4096 * 2 + 5;  // exercises the 3-stream interleave exactly
    ASSERT_EQ(crc32c(buf.data() + off, len), crc32c_table(buf.data() + off, len)) << "len " << len << " off " << off;
  }
  std::printf("crc32c hardware path: %s\n", crc32c_hardware() ? "yes" : "no");
}

TEST(Crc32c, ChainsAndDetectsFlips) {
  std::vector<unsigned char> buf(50000, 3);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 31);
  uint32_t whole = crc32c(buf.data(), buf.size());
  uint32_t chained = crc32c(buf.data() + 20000, buf.size() - 20000, crc32c(buf.data(), 20000));
  EXPECT_EQ(whole, chained);
  buf[12345] ^= 0x10;
  EXPECT_NE(crc32c(buf.data(), buf.size()), whole);
}

// Per-block checksums (what SwapSpace records per 4 KiB): each equals the block's own crc32c,
// for block counts that do and do not fill the three-stream groups, and odd block sizes.
TEST(Crc32c, BlocksMatchOneAtATime) {
  std::mt19937_64 rng(11);
  std::vector<unsigned char> buf(8 * 4096 + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t block : {size_t{4096}, size_t{24}, size_t{13}})
    for (size_t n = 0; n <= 8; ++n) {
      std::vector<uint32_t> got(n + 1, 0xdeadbeef);
      crc32c_blocks(buf.data() + 8, n, block, got.data());
      for (size_t k = 0; k < n; ++k)
        ASSERT_EQ(got[k], crc32c_table(buf.data() + 8 + k * block, block)) << "block " << k << " of " << n << " x " << block;
      EXPECT_EQ(got[n], 0xdeadbeefu);  // nothing written past n
    }
}
