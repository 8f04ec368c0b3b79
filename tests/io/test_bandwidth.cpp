// io::measure_bandwidth takes each direction's median pass, so one slow pass is not the disk's
// rate. io::BackgroundTraffic (the disk's traffic behind `strata plan`'s compute-beside-I/O
// probe): it moves bytes only after its first pass, verifies what it reads, gives its space
// back, and hands its first I/O error to stop().
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>

#include "io/bandwidth.h"
#include "io/errors.h"
#include "tests/io/io_test_util.h"

using namespace strata::io;
using namespace strata::io::testing;

namespace {

constexpr uint64_t kPiece = 64 << 10;

SwapOptions one_path(const ScratchDir& d) {
  SwapOptions s;
  s.paths = {d.path()};
  return s;
}

// The first timed write pass (writes 33-64: the first pass into fresh space is not timed) is held
// up 50 ms a piece, as a virtio disk's stall would: at most ~4 MB/s. The median of the three
// timed passes is one of the others.
TEST(MeasureBandwidth, OneSlowPassIsNotTheRate) {
  ScratchDir dir;
  std::atomic<int> writes{0};
  EngineOptions o = options_for(Config::threads);
  o.completion_hook = [&](IoOp op, uint64_t, uint64_t, int64_t res) -> int64_t {
    if (op == IoOp::write) {
      const int n = ++writes;
      if (n > 32 && n <= 64) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return res;
  };
  auto engine = make_engine(o);
  SwapSpace space(one_path(dir), *engine);
  const Bandwidth bw = measure_bandwidth(space, kPiece, 32);
  EXPECT_EQ(writes.load(), 4 * 32);  // a first pass, then three timed ones
  EXPECT_GT(bw.write_gbps, 0.02) << "the slow pass became the rate";
  EXPECT_GT(bw.read_gbps, 0.02);
  EXPECT_EQ(space.stats().bytes_allocated, 0u);
}

TEST(BackgroundTraffic, MovesBytesAfterItsFirstPassAndGivesTheSpaceBack) {
  ScratchDir dir;
  std::atomic<uint64_t> writes{0}, reads{0};
  EngineOptions o = options_for(Config::threads);
  o.completion_hook = [&](IoOp op, uint64_t, uint64_t, int64_t res) -> int64_t {
    (op == IoOp::write ? writes : reads) += 1;
    return res;
  };
  auto engine = make_engine(o);
  SwapSpace space(one_path(dir), *engine);
  {
    BackgroundTraffic traffic(space, kPiece, 8);
    traffic.wait_started();
    // The first pass (8 writes into fresh space) is not counted; what counts came after it.
    EXPECT_GE(writes.load(), 8u);
    EXPECT_GT(traffic.bytes_moved(), 0u);
    const uint64_t before = traffic.bytes_moved();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (traffic.bytes_moved() < before + 32 * kPiece && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_GE(traffic.bytes_moved(), before + 32 * kPiece);
    traffic.stop();
    EXPECT_GT(reads.load(), 0u);  // pass after pass: reads follow the writes
    EXPECT_EQ(traffic.bytes_moved() % kPiece, 0u);
    EXPECT_GT(space.stats().bytes_allocated, 0u);
  }
  EXPECT_EQ(space.stats().bytes_allocated, 0u);
  EXPECT_EQ(space.stats().checksum_failures, 0u);
}

TEST(BackgroundTraffic, StopRethrowsTheFirstIoError) {
  ScratchDir dir;
  std::atomic<bool> inject{false};
  EngineOptions o = options_for(Config::threads);
  o.completion_hook = [&](IoOp op, uint64_t, uint64_t, int64_t res) -> int64_t {
    return inject.load() && op == IoOp::read ? -EIO : res;
  };
  auto engine = make_engine(o);
  SwapSpace space(one_path(dir), *engine);
  BackgroundTraffic traffic(space, kPiece, 4);
  traffic.wait_started();
  inject = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  try {
    traffic.stop();
    FAIL() << "the read error was dropped";
  } catch (const IoError& e) {
    EXPECT_EQ(e.errno_value(), EIO);
  }
}

TEST(BackgroundTraffic, AFailureBeforeItStartsReachesWaitStarted) {
  ScratchDir dir;
  EngineOptions o = options_for(Config::threads);
  o.completion_hook = [](IoOp, uint64_t, uint64_t, int64_t) -> int64_t { return -EIO; };
  auto engine = make_engine(o);
  SwapSpace space(one_path(dir), *engine);
  BackgroundTraffic traffic(space, kPiece, 4);
  EXPECT_THROW(traffic.wait_started(), IoError);
  EXPECT_THROW(traffic.stop(), IoError);
}

}  // namespace
