// AdamW over fp32 master weights, one contiguous range at a time (DESIGN.md: torch.optim.AdamW
// semantics, decoupled weight decay on 2-D tensors only), global-norm gradient clipping as
// torch.nn.utils.clip_grad_norm_, and a dynamic loss scaler for fp16 training.
#pragma once
#include <cstdint>

#include "kernels/ops.h"
#include "kernels/runtime.h"

namespace strata {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

// One optimizer step's scalars: step counts from 1; grad_scale folds clipping, 1/accumulation
// and 1/loss-scale into the gradient.
struct AdamWStep {
  AdamWConfig cfg;
  int64_t step = 1;
  float lr = 0.f;
  float grad_scale = 1.f;
};

// AdamW over one contiguous range of n fp32 master parameters with its m and v (enqueued on s):
// g = grad · grad_scale, decoupled decay only when `decay`; the updated weights are also
// written to `working` in working_dtype when working is non-null. `from` (optional): read the
// old master, m and v there instead of in place (kernels::AdamWArgs::param_in; the same bits).
struct AdamWFrom {
  const float* master = nullptr;
  const float* m = nullptr;
  const float* v = nullptr;
};
void adamw_range(kernels::Ops& ops, kernels::Stream& s, const AdamWStep& st, bool decay, int64_t n, float* master,
                 float* m, float* v, const float* grads, void* working, kernels::DType working_dtype,
                 const AdamWFrom& from = {});

// torch.nn.utils.clip_grad_norm_: min(1, max_norm / (norm + 1e-6)); max_norm <= 0 = no clipping.
inline float clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.f;
  const double c = max_norm / (norm + 1e-6);
  return static_cast<float>(c < 1.0 ? c : 1.0);
}

// Dynamic loss scaling for fp16 (as torch.cuda.amp.GradScaler): the loss gradient is multiplied
// by scale(); a step whose gradients are not finite is skipped and halves the scale; after
// `growth_interval` finite steps in a row the scale doubles.
class LossScaler {
 public:
  explicit LossScaler(bool enabled, float init_scale = 65536.f, int growth_interval = 2000)
      : enabled_(enabled), scale_(enabled ? init_scale : 1.f), growth_interval_(growth_interval) {}
  bool enabled() const { return enabled_; }
  float scale() const { return scale_; }
  int good_steps() const { return good_; }  // finite steps since the scale last changed
  // Resume: the state a checkpoint recorded.
  void restore(float scale, int good_steps) {
    scale_ = scale;
    good_ = good_steps;
  }
  // Returns true when the step should be applied (gradients finite).
  bool update(bool grads_finite) {
    if (!enabled_) return true;
    if (!grads_finite) {
      scale_ = scale_ * 0.5f < 1.f ? 1.f : scale_ * 0.5f;
      good_ = 0;
      return false;
    }
    if (++good_ >= growth_interval_) {
      scale_ *= 2.f;
      good_ = 0;
    }
    return true;
  }

 private:
  bool enabled_;
  float scale_;
  int growth_interval_;
  int good_ = 0;
};

}  // namespace strata
