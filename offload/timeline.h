// Timeline: how long a planned step takes, by replaying its plan against a clock. Compute runs
// the step's phases in order on one stream; every move the plan issues queues on its link (NVMe
// reads and writes share one queue; host<->device one per direction) and starts once the link
// is free, its source is current and, for a write-back, compute is done with the block. An
// acquire whose bytes have not arrived stalls compute, as the trainer does. The largest floor
// (max of compute and bytes ÷ bandwidth) assumes the two overlap everywhere; a placement whose
// budget leaves no room to move anything while part of the step computes (the 1.5B run's
// backward, with 8 GiB of host RAM) takes that part's compute plus the rest's I/O instead.
#pragma once
#include <array>
#include <span>

#include "offload/planner.h"
#include "offload/residency.h"
#include "offload/schedule.h"

namespace strata::offload {

struct LinkRates {
  // Bytes per millisecond; 0: the link is not modelled (its moves take no time).
  double nvme_read = 0, nvme_write = 0, h2d = 0, d2h = 0;
};

struct StepTimeline {
  double step_ms = 0;       // the second of two consecutive steps: from compute's start to its end
  double compute_ms = 0;    // the phases' own time
  double stall_ms = 0;      // compute waiting for a block
  double nvme_busy_ms = 0;  // the NVMe queue moving bytes
};

// Replays two consecutive steps of schedule `s` from `start`, each with the plan the manager would
// choose (candidate_plans' first), and returns the second. compute_after_ms[i]: compute that
// runs right after event i (the phase whose blocks are acquired by then), 0 for none.
// Throws BudgetError when no plan runs `s` from `start`.
StepTimeline estimate_step(const Residency& start, const Schedule& s, std::span<const double> compute_after_ms,
                           const LinkRates& rates);

}  // namespace strata::offload
