// What NVMe bandwidth a run can expect from its swap paths: a short write pass then a read pass
// of whole extents through the same engine and SwapSpace the offload store uses (so striping,
// O_DIRECT and queue depth are the run's own), for `strata plan` and the offload bench.
#pragma once
#include <cstdint>

#include "io/swap_space.h"

namespace strata::io {

struct Bandwidth {
  double read_gbps = 0, write_gbps = 0;  // 10^9 bytes/s
};

// Writes `count` pieces of `piece_bytes` (4 at a time in flight) twice, timing the second pass,
// then reads them back; frees the space again. The first write into freshly allocated swap space
// converts the filesystem's unwritten extents (ext4 on a virtio disk: 3.5 GB/s against 6.4 for
// an overwrite), which a run pays once, not every step. Throws IoError (path, errno) as any swap
// I/O would.
Bandwidth measure_bandwidth(SwapSpace& space, uint64_t piece_bytes, int count);

}  // namespace strata::io
