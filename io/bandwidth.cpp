// Two timed passes over one extent, a fixed number of pieces in flight.
#include "io/bandwidth.h"

#include <chrono>
#include <cstring>
#include <deque>

#include "io/aligned_buffer.h"

namespace strata::io {

Bandwidth measure_bandwidth(SwapSpace& space, uint64_t piece, int count) {
  using Clock = std::chrono::steady_clock;
  constexpr int kInFlight = 4;
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
    bw.write_gbps = pass(true);
    bw.read_gbps = pass(false);
  } catch (...) {
    space.free(e);
    throw;
  }
  space.free(e);
  return bw;
}

}  // namespace strata::io
