// Timed passes over one extent (the median of three each way), a fixed number of pieces in
// flight; and the same traffic in the background, for probes that time compute beside it.
#include "io/bandwidth.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>

#include "io/aligned_buffer.h"

namespace strata::io {

Bandwidth measure_bandwidth(SwapSpace& space, uint64_t piece, int count) {
  using Clock = std::chrono::steady_clock;
  constexpr int kInFlight = 4, kRounds = 3;
  Extent e = space.allocate(piece * static_cast<uint64_t>(count));
  AlignedBuffer buf(piece * kInFlight);
  std::memset(buf.data(), 0x5a, buf.size());
  auto pass = [&](bool write) {
    const auto t0 = Clock::now();
    std::deque<IoHandle> inflight;
    try {
      for (int u = 0; u < count; ++u) {
        if (inflight.size() == kInFlight) {
          inflight.front().wait();
          inflight.pop_front();
        }
        char* p = buf.as<char>() + (static_cast<uint64_t>(u) % kInFlight) * piece;
        const uint64_t off = static_cast<uint64_t>(u) * piece;
        inflight.push_back(write ? space.write(e, off, piece, p) : space.read(e, off, piece, p));
      }
      for (auto& h : inflight) h.wait();
    } catch (...) {  // nothing may still use the buffer when it is freed
      for (auto& h : inflight) try {
          h.wait();
        } catch (...) {
        }
      throw;
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    return static_cast<double>(piece) * count / (s * 1e9);
  };
  Bandwidth bw;
  try {
    pass(true);  // the space's first write (see the header)
    std::array<double, kRounds> w{}, r{};
    for (int i = 0; i < kRounds; ++i) w[i] = pass(true), r[i] = pass(false);
    std::sort(w.begin(), w.end());
    std::sort(r.begin(), r.end());
    bw.write_gbps = w[kRounds / 2];
    bw.read_gbps = r[kRounds / 2];
  } catch (...) {
    space.free(e);
    throw;
  }
  space.free(e);
  return bw;
}

BackgroundTraffic::BackgroundTraffic(SwapSpace& space, uint64_t piece, int count)
    : space_(space), piece_(piece), count_(count), extent_(space.allocate(piece * static_cast<uint64_t>(count))) {
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    space_.free(extent_);
    throw;
  }
}

BackgroundTraffic::~BackgroundTraffic() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  space_.free(extent_);
}

void BackgroundTraffic::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (error_) std::rethrow_exception(error_);
}

void BackgroundTraffic::wait_started() const {
  while (moved_.load() == 0 && !stop_.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  if (stop_.load() && error_) std::rethrow_exception(error_);
}

// Writes every piece, then reads every piece, kInFlight at a time, until stop_; the first
// failure is kept for stop() and ends the traffic.
void BackgroundTraffic::run() {
  constexpr int kInFlight = 4;
  std::deque<IoHandle> inflight;
  try {
    AlignedBuffer buf(piece_ * kInFlight);
    std::memset(buf.data(), 0x5a, buf.size());
    // The first pass writes into fresh swap space (which ext4 converts from unwritten extents,
    // at about half the speed: measure_bandwidth's note) and is not counted.
    const uint64_t first_pass = static_cast<uint64_t>(count_);
    for (uint64_t n = 0; !stop_.load(); ++n) {
      const uint64_t u = n % (2 * static_cast<uint64_t>(count_));
      const bool write = u < static_cast<uint64_t>(count_);
      if (inflight.size() == kInFlight) {
        inflight.front().wait();
        if (n - kInFlight >= first_pass) moved_ += piece_;
        inflight.pop_front();
      }
      char* p = buf.as<char>() + (n % kInFlight) * piece_;
      const uint64_t off = (u % static_cast<uint64_t>(count_)) * piece_;
      inflight.push_back(write ? space_.write(extent_, off, piece_, p) : space_.read(extent_, off, piece_, p));
    }
    for (auto& h : inflight) h.wait();
  } catch (...) {
    error_ = std::current_exception();
    for (auto& h : inflight) try {
        h.wait();
      } catch (...) {
      }
    stop_ = true;
  }
}

}  // namespace strata::io
