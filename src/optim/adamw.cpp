// AdamW over flat fp32 buffers and the global gradient norm, on the op set (kernels::adamw,
// kernels::sum_squares) in stream order.
#include "src/optim/adamw.h"

#include <cmath>

namespace strata {

AdamW::AdamW(kernels::Runtime& rt, const std::vector<ParamRange>& ranges, int64_t n_flat, const AdamWConfig& cfg)
    : rt_(rt), cfg_(cfg) {
  for (const ParamRange& r : ranges) {
    if (!ranges_.empty() && ranges_.back().decay == r.decay && ranges_.back().offset + ranges_.back().numel == r.offset)
      ranges_.back().numel += r.numel;
    else
      ranges_.push_back(r);
  }
  const size_t bytes = static_cast<size_t>(n_flat) * sizeof(float);
  m_ = kernels::DeviceBuffer(rt, bytes);
  v_ = kernels::DeviceBuffer(rt, bytes);
  auto s = rt.create_stream();
  s->memset_async(m_.data(), 0, bytes);
  s->memset_async(v_.data(), 0, bytes);
  s->synchronize();
}

void AdamW::step(kernels::Stream& s, float* master, const float* grads, void* working, kernels::DType working_dtype,
                 float lr, float grad_scale) {
  ++t_;
  const size_t esz = kernels::dtype_size(working_dtype);
  for (const ParamRange& r : ranges_) {
    kernels::AdamWArgs a;
    a.n = r.numel;
    a.param = master + r.offset;
    a.grad = grads + r.offset;
    a.grad_dtype = kernels::DType::f32;
    a.m = m_.as<float>() + r.offset;
    a.v = v_.as<float>() + r.offset;
    a.param_copy = working ? static_cast<char*>(working) + static_cast<size_t>(r.offset) * esz : nullptr;
    a.copy_dtype = working_dtype;
    a.lr = lr;
    a.beta1 = cfg_.beta1;
    a.beta2 = cfg_.beta2;
    a.eps = cfg_.eps;
    a.weight_decay = r.decay ? cfg_.weight_decay : 0.f;
    a.step = t_;
    a.grad_scale = grad_scale;
    rt_.ops().adamw(s, a);
  }
}

GradNorm::GradNorm(kernels::Runtime& rt) : rt_(rt), acc_(rt, 64) {}

double GradNorm::compute(kernels::Stream& s, const float* grads, int64_t n) {
  double host = 0;
  s.memset_async(acc_.data(), 0, sizeof(double));
  rt_.ops().sum_squares(s, {.dtype = kernels::DType::f32, .n = n, .x = grads, .out = acc_.as<double>()});
  s.memcpy_async(&host, acc_.data(), sizeof(double));
  s.synchronize();
  return std::sqrt(host);
}

}  // namespace strata
