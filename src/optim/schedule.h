// Learning-rate schedules: constant or cosine decay to --min-lr, both after a linear warmup.
// Steps count from 0 (the first optimizer step uses lr_at(0)).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace strata {

enum class LrSchedule : uint8_t { constant, cosine };

LrSchedule parse_lr_schedule(std::string_view text);  // "constant" | "cosine"; throws naming the text
std::string_view lr_schedule_name(LrSchedule s);

struct LrScheduleConfig {
  LrSchedule kind = LrSchedule::cosine;
  double lr = 3e-4;        // peak learning rate
  double min_lr = 0.0;     // cosine: the value reached at the last step
  int64_t warmup = 0;      // steps of linear warmup: lr · (step + 1) / warmup
  int64_t total = 1;       // total optimizer steps
};

// warmup: lr·(step+1)/warmup for step < warmup; then constant: lr; cosine:
// min_lr + (lr - min_lr) · ½(1 + cos(π · (step - warmup) / max(1, total - 1 - warmup))).
double lr_at(const LrScheduleConfig& c, int64_t step);

}  // namespace strata
