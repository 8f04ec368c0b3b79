// What NVMe bandwidth a run can expect from its swap paths: a short write pass then a read pass
// of whole extents through the same engine and SwapSpace the offload store uses (so striping,
// O_DIRECT and queue depth are the run's own), for `strata plan` and the offload bench.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

#include "io/swap_space.h"

namespace strata::io {

struct Bandwidth {
  double read_gbps = 0, write_gbps = 0;  // 10^9 bytes/s
};

// Writes `count` pieces of `piece_bytes` (4 at a time in flight), then three times writes them
// again and reads them back, each pass timed: the median pass of each direction is its rate (a
// virtio disk's pace drifts by tens of percent within a second, and one slow pass would
// otherwise be the plan's disk: a 1.65 GB/s write pass where the passes around it ran at 5-7).
// Frees the space again. The first write into freshly allocated swap space
// converts the filesystem's unwritten extents (ext4 on a virtio disk: 3.5 GB/s against 6.4 for
// an overwrite), which a run pays once, not every step. Throws IoError (path, errno) as any swap
// I/O would.
Bandwidth measure_bandwidth(SwapSpace& space, uint64_t piece_bytes, int count);

// Disk traffic in the background, as an offloaded step makes it: a thread writes `count` pieces
// of `piece_bytes` and reads them back (4 in flight), pass after pass, until destroyed, through
// `space`, so its checksums, O_DIRECT and completions cost the CPU what a run's do. For probes
// that time compute beside the disk (perf_model.h probe_compute_rate_under_io).
class BackgroundTraffic {
 public:
  BackgroundTraffic(SwapSpace& space, uint64_t piece_bytes, int count);
  ~BackgroundTraffic();  // lets the pieces in flight finish, then frees the space
  BackgroundTraffic(const BackgroundTraffic&) = delete;
  BackgroundTraffic& operator=(const BackgroundTraffic&) = delete;

  // Until a piece has moved after the first pass (which writes into fresh space, and does not
  // count); rethrows the traffic's failure.
  void wait_started() const;
  uint64_t bytes_moved() const { return moved_.load(); }  // since the first pass
  // Stops the traffic and rethrows its first failure (an IoError naming the path), if any.
  void stop();

 private:
  void run();
  SwapSpace& space_;
  uint64_t piece_;
  int count_;
  Extent extent_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> moved_{0};
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace strata::io
