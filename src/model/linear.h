// Linear layers on the op set, shared by the block recipes: y = x·Wᵀ for (out, in) weights
// (llama) or y = x·W for HF Conv1D (in, out) weights (gpt2), and their backward passes.
// Internal to src/model/.
#pragma once
#include <cstdint>

#include "kernels/ops.h"
#include "kernels/runtime.h"

namespace strata::model_detail {
using kernels::DType;

struct Linear {
  kernels::Ops* ops;
  kernels::Stream* stream;
  DType dtype;          // of x, W, y, dx
  bool w_in_out;        // W stored (in, out) (HF Conv1D) instead of (out, in)
  bool accumulate_grads = true;  // dW += ...; false: dW = ... (its old contents are never read)
};

inline const void* at(const void* base, int64_t elems, DType t) {
  return static_cast<const char*>(base) + elems * static_cast<int64_t>(kernels::dtype_size(t));
}
inline void* at(void* base, int64_t elems, DType t) {
  return static_cast<char*>(base) + elems * static_cast<int64_t>(kernels::dtype_size(t));
}

// y (rows, out) = x (rows, in) · op(W) [+ b]
inline void linear_forward(const Linear& l, const void* x, const void* w, const void* b, void* y, int64_t rows,
                           int64_t in, int64_t out) {
  kernels::MatmulArgs m;
  m.a = x;
  m.b = w;
  m.c = y;
  m.ab_dtype = l.dtype;
  m.c_dtype = l.dtype;
  m.m = rows;
  m.n = out;
  m.k = in;
  m.trans_b = !l.w_in_out;  // (out, in) = (n, k) stored
  l.ops->matmul(*l.stream, m);
  if (b) l.ops->bias_add(*l.stream, {.dtype = l.dtype, .rows = rows, .cols = out, .y = y, .bias = b});
}

// dx (rows, in) = dy · op(W)ᵀ (overwritten; skipped when dx is null); dW += ... (= when the layer
// does not accumulate grads; skipped when dw is null: a frozen weight); db += Σ_r dy (always:
// the caller zeroes it first when needed; skipped when null).
inline void linear_backward(const Linear& l, const void* x, const void* w, const void* dy, void* dx, float* dw,
                            float* db, int64_t rows, int64_t in, int64_t out) {
  if (dx) {
    kernels::MatmulArgs m;
    m.a = dy;
    m.b = w;
    m.c = dx;
    m.ab_dtype = l.dtype;
    m.c_dtype = l.dtype;
    m.m = rows;
    m.n = in;
    m.k = out;
    m.trans_b = l.w_in_out;  // (in, out) = (n, k) stored
    l.ops->matmul(*l.stream, m);
  }
  if (!dw) return;
  kernels::MatmulArgs g;
  g.ab_dtype = l.dtype;
  g.c_dtype = DType::f32;
  g.c = dw;
  g.beta = l.accumulate_grads ? 1.f : 0.f;
  g.k = rows;
  g.trans_a = true;
  if (l.w_in_out) {  // dW (in, out) += xᵀ · dy
    g.a = x;
    g.b = dy;
    g.m = in;
    g.n = out;
  } else {  // dW (out, in) += dyᵀ · x
    g.a = dy;
    g.b = x;
    g.m = out;
    g.n = in;
  }
  l.ops->matmul(*l.stream, g);
  if (db) l.ops->bias_backward(*l.stream, {.dtype = l.dtype, .rows = rows, .cols = out, .dy = dy, .dbias = db});
}

}  // namespace strata::model_detail
