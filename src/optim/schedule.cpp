// Learning-rate schedules (see schedule.h for the formulas).
#include "src/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace strata {

LrSchedule parse_lr_schedule(std::string_view text) {
  if (text == "constant") return LrSchedule::constant;
  if (text == "cosine") return LrSchedule::cosine;
  throw std::invalid_argument("unknown learning-rate schedule '" + std::string(text) + "' (valid: constant, cosine)");
}

std::string_view lr_schedule_name(LrSchedule s) { return s == LrSchedule::constant ? "constant" : "cosine"; }

double lr_at(const LrScheduleConfig& c, int64_t step) {
  if (step < c.warmup) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup);
  if (c.kind == LrSchedule::constant) return c.lr;
  const int64_t span = std::max<int64_t>(1, c.total - 1 - c.warmup);
  const double ratio = std::min(1.0, static_cast<double>(step - c.warmup) / static_cast<double>(span));
  return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + std::cos(M_PI * ratio));
}

}  // namespace strata
