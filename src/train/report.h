// What a run tells its user: the --metrics JSONL file (one object per optimizer step, whole
// lines only), the progress, eval and summary lines. Trainer::print_header lives in report.cpp
// too. Nothing here changes what is trained.
#pragma once
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "offload/manager.h"
#include "src/checkpoint/file_util.h"
#include "src/train/trainer.h"

namespace strata {

std::string human_bytes(double b);   // "1.5 GiB"
std::string human_count(double n);   // "124.44M"

// The --metrics file, appended to by rank 0: never truncated beyond what open() cuts, each
// line written whole or not at all.
class MetricsFile {
 public:
  // Opens `path` for appending (a FIFO or device as a plain stream) and locks it: one writer at
  // a time. Cuts a last line without its newline (what a killed writer left) and, when
  // `resumed`, the lines this run (`run_id`) wrote past `steps_done` before it was killed
  // (those steps are about to be trained again); another run's lines are never cut. Throws
  // naming the path.
  void open(const std::string& path, const std::string& run_id, bool resumed, int64_t steps_done);
  bool is_open() const { return fd_.get() >= 0; }
  // One JSON line. On a failure (disk full, I/O error) the partial line is cut off again, one
  // warning names the path and errno, and no more metrics are written: training goes on.
  void write(const nlohmann::json& line, int64_t step);

 private:
  std::string path_;
  UniqueFd fd_;
  uint64_t bytes_ = 0;  // whole lines written so far
};

// One step's --metrics object: the step's figures, the tiers' bytes and the plan's counters from
// `os` (cumulative), the validation of that step if any.
nlohmann::json step_metrics(const StepStats& st, const offload::OffloadStats& os,
                            const std::optional<Trainer::EvalStats>& ev, const std::string& run_id);
// The line of a validation before step 1 (step 0): val_loss and val_tokens alone.
nlohmann::json eval_metrics(const Trainer::EvalStats& ev, const std::string& run_id);
// "step  3/10 | loss ... | ... ms" (with the I/O figures when `io`); `loss_scale` is the scale
// after the step (an fp16 overflow names it).
std::string step_line(const StepStats& st, int64_t steps, bool io, double loss_scale);
// "eval  3/10 | val loss ..." of a validation after `step` steps.
std::string eval_line(const Trainer::EvalStats& ev, int64_t step, int64_t steps);

// What the summary line adds up over the steps a run trained.
struct RunTally {
  double first_loss = NAN, last_loss = NAN, min_loss = INFINITY;
  double ms_after_first = 0;   // the steps after the first (which includes warm-up)
  int64_t steps = 0;           // trained by this run (a resumed run: since the resume)
  int64_t fp16_skipped = 0, no_targets = 0, rolled_back = 0;
  uint64_t moved = 0;          // bytes between tiers
  void add(const StepStats& st);
  // "done: N steps, ... tokens in S s (tok/s, ms/step after the first); loss a -> b (min c)..."
  // `total_steps`, `tokens` and `tokens_per_step` of the run; `extra`: what the data adds
  // ("; N trained targets; ...") and the last validation.
  std::string done_line(int64_t total_steps, int64_t tokens, int64_t tokens_per_step, double total_s,
                        const std::string& extra) const;
};

}  // namespace strata
