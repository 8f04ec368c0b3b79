// AdamW over fp32 master weights in flat buffers (DESIGN.md: torch.optim.AdamW semantics,
// decoupled weight decay on 2-D tensors only), global-norm gradient clipping as
// torch.nn.utils.clip_grad_norm_, and a dynamic loss scaler for fp16 training.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/ops.h"
#include "kernels/runtime.h"

namespace strata {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

// A contiguous range of the flat buffers with one weight-decay setting.
struct ParamRange {
  int64_t offset = 0, numel = 0;
  bool decay = false;
};

class AdamW {
 public:
  // Allocates (and zeroes) the m and v states of n_flat elements. Adjacent ranges with the
  // same decay flag are merged into one update.
  AdamW(kernels::Runtime& rt, const std::vector<ParamRange>& ranges, int64_t n_flat, const AdamWConfig& cfg);
  // One optimizer step over every range (enqueued on s): g = grads · grad_scale, update master,
  // and write the updated weights to `working` in working_dtype when working is non-null.
  void step(kernels::Stream& s, float* master, const float* grads, void* working, kernels::DType working_dtype,
            float lr, float grad_scale);
  int64_t steps_taken() const { return t_; }
  size_t bytes_allocated() const { return m_.bytes() + v_.bytes(); }
  const float* m() const { return m_.as<float>(); }
  const float* v() const { return v_.as<float>(); }

 private:
  kernels::Runtime& rt_;
  std::vector<ParamRange> ranges_;
  AdamWConfig cfg_;
  kernels::DeviceBuffer m_, v_;
  int64_t t_ = 0;
};

// Global L2 norm of n fp32 values (Σ in fp64). Enqueues on s, then synchronises s.
class GradNorm {
 public:
  explicit GradNorm(kernels::Runtime& rt);
  double compute(kernels::Stream& s, const float* grads, int64_t n);
  size_t bytes_allocated() const { return acc_.bytes(); }

 private:
  kernels::Runtime& rt_;
  kernels::DeviceBuffer acc_;  // one double
};

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
