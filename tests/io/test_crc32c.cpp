// crc32c: the standard check value, every path this CPU has against the table path on odd
// lengths, misaligned starts and start values, and chaining.
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
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
  std::printf("crc32c path: %s\n", crc32c_name(crc32c_fastest()));
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

// Each implementation this CPU has, by name, against the table: lengths around the folding paths'
// 128- and 256-byte steps (a 4 KiB block is 16 of them), misaligned starts, chained start values, and
// blocks of SwapSpace's size and of sizes the fold does not divide.
TEST(Crc32c, EveryPathMatchesTheTable) {
  std::mt19937_64 rng(23);
  std::vector<unsigned char> buf(3 * 4096 + 1024);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  std::vector<size_t> lengths = {0, 1, 7, 8, 15, 16, 127, 128, 129, 255, 256, 257, 384, 511, 512, 513, 768, 4095, 4096, 4097, 8192, 3 * 4096 + 17};
  for (int t = 0; t < 40; ++t) lengths.push_back(rng() % (buf.size() - 64));
  int ran = 0;
  for (Crc32cPath path : {Crc32cPath::table, Crc32cPath::sse42, Crc32cPath::vpclmulqdq_avx2, Crc32cPath::vpclmulqdq_avx512}) {
    if (!crc32c_supported(path)) {
      EXPECT_THROW(crc32c_with(path, buf.data(), 16), std::invalid_argument);
      std::printf("crc32c path %s: not on this CPU\n", crc32c_name(path));
      continue;
    }
    ++ran;
    for (size_t len : lengths)
      for (size_t off : {size_t{0}, size_t{1}, size_t{13}, size_t{64}})
        for (uint32_t start : {0u, 0xE3069283u}) {
          ASSERT_EQ(crc32c_with(path, buf.data() + off, len, start), crc32c_table(buf.data() + off, len, start))
              << crc32c_name(path) << " len " << len << " off " << off << " start " << start;
        }
    for (size_t block : {size_t{4096}, size_t{256}, size_t{128}, size_t{1024 + 8}, size_t{24}})
      for (size_t n : {size_t{1}, size_t{2}, size_t{3}, size_t{4}}) {
        if (n * block + 5 > buf.size()) continue;
        std::vector<uint32_t> got(n + 1, 0xdeadbeef);
        crc32c_blocks_with(path, buf.data() + 5, n, block, got.data());
        for (size_t k = 0; k < n; ++k)
          ASSERT_EQ(got[k], crc32c_table(buf.data() + 5 + k * block, block)) << crc32c_name(path) << " block " << k << " x " << block;
        EXPECT_EQ(got[n], 0xdeadbeefu);
      }
    // A flipped bit anywhere in a 4 KiB block changes the fold's sum (it is the crc, not a hash of it).
    const uint32_t whole = crc32c_with(path, buf.data(), 4096);
    for (size_t bit : {size_t{0}, size_t{31}, size_t{32}, size_t{2047}, size_t{4096 * 8 - 1}}) {
      buf[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
      EXPECT_NE(crc32c_with(path, buf.data(), 4096), whole) << crc32c_name(path) << " bit " << bit;
      buf[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    }
  }
  EXPECT_GE(ran, 1);
  EXPECT_TRUE(crc32c_supported(crc32c_fastest()));
  std::printf("crc32c fastest path here: %s\n", crc32c_name(crc32c_fastest()));
}
