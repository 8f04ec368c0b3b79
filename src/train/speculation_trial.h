// --speculate auto's trial: the run's first steps time both ways of updating with clipping on
// (speculating in the backward, and waiting for the norm) and the run keeps the faster.
//
// Why measured and not predicted: on the 1.5B all-NVMe run of bench/RESULTS.md (2 vCPUs,
// 8 GiB of host RAM) `strata plan` replayed the speculative step at 9.8-10.0 s and the waiting
// one at 8.5-8.8 s, but the run measured 9.5 s against 10.2 s: the replay had compute and I/O
// overlap where, on two cores, the I/O's own CPU slows compute. The replay now counts that
// (perf_model.h Interference), but the two ways still differ by less than the run-to-run noise
// (on 2026-12-07: 10.5 s speculating against 10.2 s waiting, the plan 10.7 against 9.3). A
// prediction that ranks the two the wrong way round would switch speculation off exactly where
// it pays; a few timed steps do not, and cost nothing in results: both ways are bitwise the
// same run.
#pragma once

namespace strata {

class SpeculationTrial {
 public:
  // Each way runs `steps` steps in a row, speculating first (the run's first step, which
  // reads every block cold, is the first of those). The first step of each way is left out
  // of its mean: it carries the switch (the first waiting step has no update of the last
  // step to run in its forward; the first speculating step runs the last one's on its own).
  // A tie, or a gain under kMinGain, waits: a rollback costs a step's compute again.
  static constexpr double kMinGain = 0.02;
  explicit SpeculationTrial(int steps) : steps_(steps < 2 ? 2 : steps) {}

  bool deciding() const { return !decided_; }
  // While deciding: whether the coming step speculates (its way in the trial).
  bool speculate_next() const { return done_ < steps_; }
  // The step just run (speculate_next()'s way); returns true when it ends the trial.
  bool record(double step_ms) {
    if (decided_) return false;
    const bool speculating = done_ < steps_;
    if (done_ % steps_ != 0) (speculating ? spec_ms_ : wait_ms_) += step_ms;
    if (++done_ < 2 * steps_) return false;
    spec_ms_ /= steps_ - 1;
    wait_ms_ /= steps_ - 1;
    verdict_ = spec_ms_ < wait_ms_ * (1 - kMinGain);
    decided_ = true;
    return true;
  }
  // Another rank's verdict (rank 0's, broadcast) replaces this one's: every rank must update
  // the same way.
  void agree(bool speculate) { verdict_ = speculate, decided_ = true; }
  bool verdict() const { return decided_ && verdict_; }
  // Each way's mean over its timed steps (set once the trial ended).
  double speculating_ms() const { return spec_ms_; }
  double waiting_ms() const { return wait_ms_; }

 private:
  int steps_;
  int done_ = 0;
  double spec_ms_ = 0, wait_ms_ = 0;
  bool decided_ = false, verdict_ = false;
};

}  // namespace strata
