// CPU elementwise ops: bias add and its column-sum backward, SwiGLU, GELU (exact erf form and
// the tanh approximation), residual add. Templated on the activation dtype, math in fp32,
// parallel over rows (or flat element ranges) on the compute arena.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"

namespace strata::kernels::cpu {
namespace {

constexpr int64_t kElemGrain = 16384;  // elements per task for flat elementwise loops

template <class E>
void bias_add_impl(const BiasAddArgs& a) {
  using T = typename E::T;
  T* y = static_cast<T*>(a.y);                    // (rows, cols)
  const T* bias = static_cast<const T*>(a.bias);  // (cols)
  const int64_t cols = a.cols;
  parallel_simd(a.rows, row_grain(cols), [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t r = lo; r < hi; ++r) {
      T* yr = y + r * cols;
      for (int64_t c = 0; c < cols; ++c) yr[c] = E::store(E::load(yr[c]) + E::load(bias[c]));
    }
  });
}

// dbias[c] += Σ_r dy[r, c]. Parallel over column blocks, each summing its columns over all rows
// in row order (fp64 accumulators): no shared writes, and the result does not depend on the
// thread count.
template <class E>
void bias_backward_impl(const BiasBackwardArgs& a) {
  using T = typename E::T;
  const T* dy = static_cast<const T*>(a.dy);  // (rows, cols)
  const int64_t rows = a.rows, cols = a.cols;
  constexpr int64_t kBlock = 64;  // columns per task: 256 B of fp32 output, no false sharing
  const int64_t n_blocks = (cols + kBlock - 1) / kBlock;
  parallel_simd(n_blocks, 1, [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t c0 = blk * kBlock, w = std::min(kBlock, cols - c0);
      double acc[kBlock] = {};
      for (int64_t r = 0; r < rows; ++r) {
        const T* row = dy + r * cols + c0;
        for (int64_t j = 0; j < w; ++j) acc[j] += E::load(row[j]);
      }
      for (int64_t j = 0; j < w; ++j) a.dbias[c0 + j] += static_cast<float>(acc[j]);
    }
  });
}

template <class E>
void swiglu_impl(const SwigluArgs& a) {
  using T = typename E::T;
  const int64_t cols = a.cols, ld = a.ld ? a.ld : a.cols;
  const T* gate = static_cast<const T*>(a.gate);  // (rows, cols), row stride ld
  const T* up = static_cast<const T*>(a.up);      // (rows, cols), row stride ld
  T* out = static_cast<T*>(a.out);                // (rows, cols) packed
  parallel_simd(a.rows, row_grain(cols), [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t r = lo; r < hi; ++r) {
      const T* g = gate + r * ld;
      const T* u = up + r * ld;
      T* o = out + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const float gv = E::load(g[c]);
        const float silu = gv / (1.f + fast_exp(-gv));
        o[c] = E::store(silu * E::load(u[c]));
      }
    }
  });
}

// d silu(g)/dg = σ(g)·(1 + g·(1 - σ(g))).
template <class E>
void swiglu_backward_impl(const SwigluBackwardArgs& a) {
  using T = typename E::T;
  const int64_t cols = a.cols, ld = a.ld ? a.ld : a.cols;
  const T* gate = static_cast<const T*>(a.gate);  // (rows, cols), row stride ld
  const T* up = static_cast<const T*>(a.up);
  const T* dout = static_cast<const T*>(a.dout);  // (rows, cols) packed
  T* dgate = static_cast<T*>(a.dgate);            // (rows, cols), row stride ld
  T* dup = static_cast<T*>(a.dup);
  parallel_simd(a.rows, row_grain(cols), [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t r = lo; r < hi; ++r) {
      const T* g = gate + r * ld;
      const T* u = up + r * ld;
      const T* d = dout + r * cols;
      T* dg = dgate + r * ld;
      T* du = dup + r * ld;
      for (int64_t c = 0; c < cols; ++c) {
        const float gv = E::load(g[c]), uv = E::load(u[c]), dv = E::load(d[c]);
        const float sig = 1.f / (1.f + fast_exp(-gv));
        const float silu = gv * sig;
        // Read everything before writing: dgate/dup may alias gate/up (in-place backward).
        dg[c] = E::store(dv * uv * sig * (1.f + gv * (1.f - sig)));
        du[c] = E::store(dv * silu);
      }
    }
  });
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;  // sqrt(2/π)
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1/sqrt(2π)
constexpr float kGeluC = 0.044715f;

// tanh(u) = 1 - 2/(e^(2u) + 1) through the vectorisable exp: absolute error ~1e-7, which is what
// GELU needs (it uses 1 + tanh and 1 - tanh², never tanh's relative accuracy near 0).
inline __attribute__((always_inline)) float fast_tanh(float u) { return 1.f - 2.f / (fast_exp(2.f * u) + 1.f); }

// The form is a template parameter so each loop is branch-free (the tanh form vectorises).
template <bool kTanh>
inline __attribute__((always_inline)) float gelu_value(float x) {
  if constexpr (kTanh) return 0.5f * x * (1.f + fast_tanh(kSqrt2OverPi * (x + kGeluC * x * x * x)));
  return 0.5f * x * (1.f + std::erf(x * kInvSqrt2));
}
template <bool kTanh>
inline __attribute__((always_inline)) float gelu_grad(float x) {
  if constexpr (kTanh) {
    const float t = fast_tanh(kSqrt2OverPi * (x + kGeluC * x * x * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluC * x * x);
  }
  // Φ(x) + x·φ(x)
  return 0.5f * (1.f + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * fast_exp(-0.5f * x * x);
}

template <class E, bool kTanh>
void gelu_impl(const GeluArgs& a) {
  using T = typename E::T;
  const T* x = static_cast<const T*>(a.x);  // (n)
  T* y = static_cast<T*>(a.y);              // (n)
  parallel_simd(a.n, kElemGrain, [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t i = lo; i < hi; ++i) y[i] = E::store(gelu_value<kTanh>(E::load(x[i])));
  });
}

template <class E, bool kTanh>
void gelu_backward_impl(const GeluBackwardArgs& a) {
  using T = typename E::T;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const bool accumulate = a.accumulate;
  parallel_simd(a.n, kElemGrain, [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    if (accumulate) {
      for (int64_t i = lo; i < hi; ++i)
        dx[i] = E::store(E::load(dy[i]) * gelu_grad<kTanh>(E::load(x[i])) + E::load(dx[i]));
    } else {
      for (int64_t i = lo; i < hi; ++i) dx[i] = E::store(E::load(dy[i]) * gelu_grad<kTanh>(E::load(x[i])));
    }
  });
}

template <class E>
void add_impl(const AddArgs& a) {
  using T = typename E::T;
  const T* x = static_cast<const T*>(a.a);  // (n); out may alias a or b (same index only)
  const T* y = static_cast<const T*>(a.b);
  T* out = static_cast<T*>(a.out);
  parallel_simd(a.n, kElemGrain, [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t i = lo; i < hi; ++i) out[i] = E::store(E::load(x[i]) + E::load(y[i]));
  });
}

}  // namespace

void bias_add(const BiasAddArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { bias_add_impl<decltype(e)>(a); });
}
void bias_backward(const BiasBackwardArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { bias_backward_impl<decltype(e)>(a); });
}
void swiglu(const SwigluArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { swiglu_impl<decltype(e)>(a); });
}
void swiglu_backward(const SwigluBackwardArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { swiglu_backward_impl<decltype(e)>(a); });
}
void gelu(const GeluArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) {
    if (a.tanh_approx) gelu_impl<decltype(e), true>(a);
    else gelu_impl<decltype(e), false>(a);
  });
}
void gelu_backward(const GeluBackwardArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) {
    if (a.tanh_approx) gelu_backward_impl<decltype(e), true>(a);
    else gelu_backward_impl<decltype(e), false>(a);
  });
}
void add(const AddArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { add_impl<decltype(e)>(a); });
}

}  // namespace strata::kernels::cpu
