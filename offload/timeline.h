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
  // Compute's speed while the NVMe queue moves bytes, relative to its speed alone: on the CPU
  // backend the I/O's own CPU work (checksums, completions, the kernel's block layer) runs on
  // the cores compute uses. 1: no effect.
  double compute_beside_nvme = 1;
  // The disk's speed while compute runs, for the same reason. The replay slows compute inside
  // each span the disk moves bytes in, and the disk by the share of its busy time that compute
  // overlapped, replayed again until that share settles (moves are queued ahead of the compute
  // beside them, so this one is an average).
  double nvme_beside_compute = 1;
};

struct StepTimeline {
  double step_ms = 0;       // the second of two consecutive steps: from compute's start to its end
  double compute_ms = 0;    // the phases' own time, and what the disk's traffic slowed them by
  double slowed_ms = 0;     // of compute_ms: the slowing (LinkRates::compute_beside_nvme)
  double stall_ms = 0;      // compute waiting for a block
  double nvme_busy_ms = 0;  // the NVMe queue moving bytes
  double nvme_overlapped = 0;  // the share of nvme_busy_ms that compute ran beside
};

// Replays two consecutive steps of schedule `s` from `start`, each with the plan the manager would
// choose (candidate_plans' first), and returns the second. compute_after_ms[i]: compute that
// runs right after event i (the phase whose blocks are acquired by then), 0 for none.
// Throws BudgetError when no plan runs `s` from `start`.
StepTimeline estimate_step(const Residency& start, const Schedule& s, std::span<const double> compute_after_ms,
                           const LinkRates& rates);

}  // namespace strata::offload
