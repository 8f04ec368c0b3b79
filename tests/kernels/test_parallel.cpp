// cpu::parallel_for on both pools (the OpenMP team, the default, and oneTBB): every index is
// visited exactly once in chunks of at least `grain`, exceptions reach the caller, nested
// calls run, and OpenMP parallel regions (what oneDNN uses) interleave with it.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "kernels/cpu/parallel.h"

using namespace strata::kernels::cpu;

namespace {
class ParallelFor : public ::testing::TestWithParam<Pool> {
 protected:
  void SetUp() override {
    saved_ = pool();
    set_pool(GetParam());
  }
  void TearDown() override { set_pool(saved_); }
  Pool saved_ = Pool::openmp;
};
}  // namespace

TEST_P(ParallelFor, CoversTheRangeOnceInLargeEnoughChunks) {
  for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{1000}, int64_t{100003}}) {
    std::vector<std::atomic<int>> hits(n);
    std::atomic<int64_t> smallest{n};
    parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
      ASSERT_LT(lo, hi);
      for (int64_t i = lo; i < hi; ++i) hits[i]++;
      if (hi != n) {  // only the last chunk may be short
        int64_t cur = smallest.load();
        while (hi - lo < cur && !smallest.compare_exchange_weak(cur, hi - lo)) {}
      }
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
    if (n > 64) {
      EXPECT_GE(smallest.load(), 64) << "n=" << n;
    }
  }
  parallel_for(5, 5, 1, [](int64_t, int64_t) { FAIL() << "empty range ran"; });
}

TEST_P(ParallelFor, ExceptionsReachTheCaller) {
  EXPECT_THROW(parallel_for(0, 1 << 20, 1024,
                            [](int64_t lo, int64_t) {
                              if (lo > 0) throw std::runtime_error("chunk failed");
                            }),
               std::runtime_error);
  // The pool still works afterwards.
  std::atomic<int64_t> sum{0};
  parallel_for(0, 1000, 10, [&](int64_t lo, int64_t hi) { sum += hi - lo; });
  EXPECT_EQ(sum.load(), 1000);
}

TEST_P(ParallelFor, NestedCallsRun) {
  std::atomic<int64_t> sum{0};
  parallel_for(0, 8, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      parallel_for(0, 100, 10, [&](int64_t a, int64_t b) { sum += b - a; });
  });
  EXPECT_EQ(sum.load(), 800);
}

TEST_P(ParallelFor, ThreadIndexIsInRange) {
  std::vector<std::atomic<int>> seen(num_threads());
  std::atomic<int> bad{0};
  parallel_for(0, 1 << 16, 256, [&](int64_t, int64_t) {
    const int t = thread_index();
    if (t < 0 || t >= num_threads()) bad++;
    else seen[t]++;
  });
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(seen[0].load(), 0);
  EXPECT_EQ(thread_index(), 0);
}

INSTANTIATE_TEST_SUITE_P(Pools, ParallelFor, ::testing::Values(Pool::openmp, Pool::tbb),
                         [](const auto& info) { return info.param == Pool::openmp ? "openmp" : "tbb"; });
