// Test-only fault injection and test hooks, from one documented variable read in one place:
//   STRATA_FAULT=kill:R:S              rank R of an mpirun job raises SIGKILL in the middle of
//                                      step S (its collectives enqueued), as a crashed node would
//   STRATA_FAULT=io-read:N | io-write:N the N-th NVMe read (write) piece fails with EIO
//   STRATA_FAULT=io-flip:N             one bit flips in the swap files under the N-th written
//                                      piece once it is on disk (the checksums must catch it)
//   STRATA_FAULT=separate-optimizer    AdamW on a CPU runtime and stream of its own on the CPU
//                                      backend too: the two-runtime path a GPU run takes
// Several are separated by commas. Unset or empty: no fault. Anything else is an error naming the
// variable, so a misspelt fault never passes a test by not firing.
#pragma once
#include <cstdint>
#include <string>

namespace strata {

struct Faults {
  int kill_rank = -1;
  int64_t kill_step = -1;
  std::string io;       // "", "read", "write" or "flip"
  int64_t io_nth = 0;   // the piece it hits (1-based)
  bool separate_optimizer = false;
};

// STRATA_FAULT, parsed at its first use.
const Faults& faults();
// Parses a value of STRATA_FAULT; throws std::invalid_argument naming what it does not know.
Faults parse_faults(const std::string& text);

}  // namespace strata
