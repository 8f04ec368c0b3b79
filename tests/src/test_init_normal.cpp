// The init's normal numbers: N(0, 1) by their moments, tails and CDF; the same values however a
// fill is split (threads); independent streams; and fixed bits, so a build that changes them
// (FMA contraction, a different polynomial) is noticed rather than silently changing every
// model's init.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "src/model/init_normal.h"

namespace strata {
namespace {

std::vector<float> draw(uint64_t key, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_normal(key, 0, n, 1.0f, v.data());
  return v;
}

TEST(InitNormal, MomentsTailsAndCdfAreStandardNormal) {
  const int64_t n = int64_t{1} << 22;
  const std::vector<float> z = draw(init_stream_key(1, 0), n);
  double s1 = 0, s2 = 0, s3 = 0, s4 = 0, most = 0;
  int64_t beyond3 = 0, beyond4 = 0;
  constexpr int kBins = 100;
  std::vector<int64_t> bins(kBins, 0);  // of Phi(z): uniform for normal z
  for (float f : z) {
    const double x = f;
    s1 += x, s2 += x * x, s3 += x * x * x, s4 += x * x * x * x;
    most = std::max(most, std::abs(x));
    beyond3 += std::abs(x) > 3;
    beyond4 += std::abs(x) > 4;
    const double u = 0.5 * std::erfc(-x / std::sqrt(2.0));
    ++bins[static_cast<size_t>(std::min(kBins - 1, static_cast<int>(u * kBins)))];
  }
  const double dn = static_cast<double>(n);
  // Bounds of about 5 standard errors of each statistic at this n.
  EXPECT_NEAR(s1 / dn, 0.0, 5 / std::sqrt(dn));
  EXPECT_NEAR(s2 / dn, 1.0, 5 * std::sqrt(2 / dn));
  EXPECT_NEAR(s3 / dn, 0.0, 5 * std::sqrt(15 / dn));
  EXPECT_NEAR(s4 / dn, 3.0, 5 * std::sqrt(96 / dn));
  const double p3 = std::erfc(3 / std::sqrt(2.0)), p4 = std::erfc(4 / std::sqrt(2.0));
  EXPECT_NEAR(static_cast<double>(beyond3), p3 * dn, 5 * std::sqrt(p3 * dn));
  EXPECT_NEAR(static_cast<double>(beyond4), p4 * dn, 5 * std::sqrt(p4 * dn));
  EXPECT_GT(most, 4.5);   // the tails are there ...
  EXPECT_LE(most, 6.56);  // ... up to the 31-bit uniform's limit, sqrt(2 ln 2^31)
  double chi2 = 0;
  const double want = dn / kBins;
  for (int64_t c : bins) chi2 += (static_cast<double>(c) - want) * (static_cast<double>(c) - want) / want;
  EXPECT_LT(chi2, 160.0);  // 99 degrees of freedom: p < 1e-4 above 160
}

TEST(InitNormal, StreamsAndNeighboursAreUncorrelated) {
  const int64_t n = int64_t{1} << 20;
  const std::vector<float> a = draw(init_stream_key(7, 1), n), b = draw(init_stream_key(7, 2), n),
                           c = draw(init_stream_key(8, 1), n);
  double ab = 0, ac = 0, lag1 = 0, lag2 = 0;
  for (int64_t i = 0; i + 2 < n; ++i) {
    const auto k = static_cast<size_t>(i);
    ab += double{a[k]} * b[k];
    ac += double{a[k]} * c[k];
    lag1 += double{a[k]} * a[k + 1];  // the two halves of one Box-Muller pair, and across pairs
    lag2 += double{a[k]} * a[k + 2];
  }
  const double bound = 5 / std::sqrt(static_cast<double>(n));
  EXPECT_NEAR(ab / static_cast<double>(n), 0.0, bound);
  EXPECT_NEAR(ac / static_cast<double>(n), 0.0, bound);
  EXPECT_NEAR(lag1 / static_cast<double>(n), 0.0, bound);
  EXPECT_NEAR(lag2 / static_cast<double>(n), 0.0, bound);
}

TEST(InitNormal, AnySplitGivesTheSameValues) {
  const uint64_t key = init_stream_key(3, 9);
  const int64_t n = 100003;
  std::vector<float> whole(n);
  fill_normal(key, 0, n, 0.02f, whole.data());
  std::vector<float> parts(n, -1.0f);
  for (int64_t lo = 0, k = 0; lo < n; ++k) {  // odd and even starts, 1 .. ~1000 values long
    const int64_t len = std::min(n - lo, 1 + (k * 7919) % 1013);
    fill_normal(key, lo, len, 0.02f, parts.data() + lo);
    lo += len;
  }
  EXPECT_EQ(std::memcmp(whole.data(), parts.data(), sizeof(float) * static_cast<size_t>(n)), 0);
}

// The same bits on every x86-64 machine and build: SSE2, AVX2 and AVX-512 code paths, -O0,
// gcc and clang all gave these. A change here changes every randomly initialised model.
TEST(InitNormal, ValuesArePinned) {
  const std::vector<float> z = draw(init_stream_key(42, 3), int64_t{1} << 20);
  const uint32_t first[6] = {0xbfe46228, 0x3e595a97, 0xbf8fb22a, 0xbfa58a9e, 0x3dc9f1e5, 0xbf1a3b9c};
  for (size_t i = 0; i < 6; ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, &z[i], 4);
    EXPECT_EQ(bits, first[i]) << "value " << i << " = " << z[i];
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a over all the values' bits
  for (float f : z) {
    uint32_t bits = 0;
    std::memcpy(&bits, &f, 4);
    h = (h ^ bits) * 1099511628211ull;
  }
  EXPECT_EQ(h, 0xd882307bc6357416ull);
}

}  // namespace
}  // namespace strata
