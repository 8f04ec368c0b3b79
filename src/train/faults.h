// Test-only fault injection and test hooks, from one documented variable read in one place:
//   STRATA_FAULT=kill:R:S              rank R of an mpirun job raises SIGKILL in the middle of
//                                      step S (its collectives enqueued), as a crashed node would
//   STRATA_FAULT=io-read:N | io-write:N the N-th NVMe read (write) piece fails with EIO
//   STRATA_FAULT=io-flip:N             one bit flips in the swap files under the N-th written
//                                      piece once it is on disk (the checksums must catch it)
//   STRATA_FAULT=separate-optimizer    AdamW on a CPU runtime and stream of its own on the CPU
//                                      backend too: the two-runtime path a GPU run takes
//   STRATA_FAULT=trial-verdicts:BITS   --speculate auto's trial ends with rank r's own verdict
//                                      BITS[r] (the last for ranks past its end): 1 speculate,
//                                      0 wait; e.g. 10: the ranks disagree (rank 0's must still
//                                      decide for every rank)
//   STRATA_FAULT=save-fill:N           the N-th tensor a save or checkpoint writes fails to be
//                                      produced (as a diverged weight or a failed read would), counted
//                                      on the rank that writes over the whole run
// Several are separated by commas. Unset or empty: no fault. Anything else is an error naming the
// variable, so a misspelt fault never passes a test by not firing.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

namespace strata {

struct Faults {
  int kill_rank = -1;
  int64_t kill_step = -1;
  std::string io;       // "", "read", "write" or "flip"
  int64_t io_nth = 0;   // the piece it hits (1-based)
  bool separate_optimizer = false;
  std::string trial_verdicts;  // "": the trial's own; else a 0/1 per rank
  int64_t save_fill_nth = 0;   // the tensor fill that fails (1-based; 0: none)
  // The verdict trial-verdicts gives `rank` (only where it is set).
  bool trial_verdict(int rank) const {
    return trial_verdicts[std::min(static_cast<size_t>(rank), trial_verdicts.size() - 1)] == '1';
  }
};

// STRATA_FAULT, parsed at its first use.
const Faults& faults();
// Parses a value of STRATA_FAULT; throws std::invalid_argument naming what it does not know.
Faults parse_faults(const std::string& text);

}  // namespace strata
