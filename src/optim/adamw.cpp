// AdamW over one range of fp32 buffers, on the op set (kernels::adamw) in stream order.
#include "src/optim/adamw.h"

namespace strata {

void adamw_range(kernels::Ops& ops, kernels::Stream& s, const AdamWStep& st, bool decay, int64_t n, float* master,
                 float* m, float* v, const float* grads, void* working, kernels::DType working_dtype,
                 const AdamWFrom& from) {
  kernels::AdamWArgs a;
  a.n = n;
  a.param = master;
  a.grad = grads;
  a.grad_dtype = kernels::DType::f32;
  a.m = m;
  a.v = v;
  a.param_in = from.master;
  a.m_in = from.m;
  a.v_in = from.v;
  a.param_copy = working;
  a.copy_dtype = working_dtype;
  a.lr = st.lr;
  a.beta1 = st.cfg.beta1;
  a.beta2 = st.cfg.beta2;
  a.eps = st.cfg.eps;
  a.weight_decay = decay ? st.cfg.weight_decay : 0.f;
  a.step = st.step;
  a.grad_scale = st.grad_scale;
  ops.adamw(s, a);
}

}  // namespace strata
