// CUDA elementwise ops: bias add and its column-sum backward (fixed-order partial sums, no
// atomics), SwiGLU, GELU (exact erf form and the tanh approximation), residual add. Templated on
// the activation dtype, math in fp32, grid-stride loops.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void bias_add_kernel(T* __restrict__ y, const T* __restrict__ bias, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    y[i] = from_f32<T>(to_f32(y[i]) + to_f32(bias[i % cols]));
}

// Pass 1 of dbias: block (32 columns, 8 row lanes) sums rows [chunk·rows_per_chunk, ...) of its
// 32 columns; lane ty takes rows ty, ty + 8, ... in order, then lanes are added in ty order.
// partial: (n_chunks, cols).
template <class T>
__global__ void bias_partial_kernel(const T* __restrict__ dy, float* __restrict__ partial, int64_t rows,
                                    int64_t cols, int64_t rows_per_chunk) {
  __shared__ float s[8][33];
  const int64_t c = blockIdx.x * int64_t{32} + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  float acc = 0.f;
  if (c < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += to_f32(dy[r * cols + c]);
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) t += s[j][threadIdx.x];
    partial[blockIdx.y * cols + c] = t;
  }
}

// Pass 2: dbias[c] += Σ_chunk partial[chunk, c], chunks in order.
__global__ void sum_partials_kernel(const float* __restrict__ partial, float* __restrict__ out, int64_t n_chunks,
                                    int64_t cols) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  float t = 0.f;
  for (int64_t k = 0; k < n_chunks; ++k) t += partial[k * cols + c];
  out[c] += t;
}

template <class T>
__global__ void swiglu_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, int64_t rows,
                              int64_t cols, int64_t ld) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    const float g = to_f32(gate[r * ld + c]);
    out[i] = from_f32<T>(g / (1.f + expf(-g)) * to_f32(up[r * ld + c]));
  }
}

// d silu(g)/dg = σ(g)·(1 + g·(1 - σ(g))). dgate/dup may alias gate/up: each element is read
// before it is written, by the same thread.
template <class T>
__global__ void swiglu_backward_kernel(const T* gate, const T* up, const T* __restrict__ dout, T* dgate, T* dup,
                                       int64_t rows, int64_t cols, int64_t ld) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols, at = r * ld + c;
    const float g = to_f32(gate[at]), u = to_f32(up[at]), d = to_f32(dout[i]);
    const float sig = 1.f / (1.f + expf(-g));
    dgate[at] = from_f32<T>(d * u * sig * (1.f + g * (1.f - sig)));
    dup[at] = from_f32<T>(d * g * sig);
  }
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
constexpr float kGeluC = 0.044715f;

template <bool kTanh>
__device__ __forceinline__ float gelu_value(float x) {
  if constexpr (kTanh) return 0.5f * x * (1.f + tanhf(kSqrt2OverPi * (x + kGeluC * x * x * x)));
  return 0.5f * x * (1.f + erff(x * kInvSqrt2));
}
template <bool kTanh>
__device__ __forceinline__ float gelu_grad(float x) {
  if constexpr (kTanh) {
    const float t = tanhf(kSqrt2OverPi * (x + kGeluC * x * x * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluC * x * x);
  }
  return 0.5f * (1.f + erff(x * kInvSqrt2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);  // Φ(x) + x·φ(x)
}

template <class T, bool kTanh>
__global__ void gelu_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    y[i] = from_f32<T>(gelu_value<kTanh>(to_f32(x[i])));
}

template <class T, bool kTanh>
__global__ void gelu_backward_kernel(const T* x, const T* dy, T* dx, int64_t n, bool accumulate) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float v = to_f32(dy[i]) * gelu_grad<kTanh>(to_f32(x[i]));
    if (accumulate) v += to_f32(dx[i]);
    dx[i] = from_f32<T>(v);
  }
}

// out may alias a or b (same index only).
template <class T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

}  // namespace

void CudaOps::do_bias_add(Stream& s, const BiasAddArgs& a) {
  StreamContext& ctx = context(s);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_add_kernel<T><<<grid_for(a.rows * a.cols, kThreads * 4), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(a.y), static_cast<const T*>(a.bias), a.rows, a.cols);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

// Chunks depend on the shape only, so the summation order (and the result) is the same run
// after run and on every device.
void CudaOps::do_bias_backward(Stream& s, const BiasBackwardArgs& a) {
  StreamContext& ctx = context(s);
  const int64_t n_chunks = std::min<int64_t>(256, (a.rows + 63) / 64);
  const int64_t rows_per_chunk = (a.rows + n_chunks - 1) / n_chunks;
  float* partial = static_cast<float*>(ctx.scratch(static_cast<size_t>(n_chunks * a.cols) * sizeof(float)));
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>((a.cols + 31) / 32), static_cast<unsigned>(n_chunks));
    bias_partial_kernel<T><<<grid, dim3(32, 8), 0, ctx.stream()>>>(static_cast<const T*>(a.dy), partial, a.rows,
                                                                  a.cols, rows_per_chunk);
    STRATA_CUDA_CHECK_LAUNCH();
  });
  sum_partials_kernel<<<grid_for(a.cols, kThreads), kThreads, 0, ctx.stream()>>>(partial, a.dbias, n_chunks, a.cols);
  STRATA_CUDA_CHECK_LAUNCH();
}

void CudaOps::do_swiglu(Stream& s, const SwigluArgs& a) {
  StreamContext& ctx = context(s);
  const int64_t ld = a.ld ? a.ld : a.cols;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    swiglu_kernel<T><<<grid_for(a.rows * a.cols, kThreads * 4), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.gate), static_cast<const T*>(a.up), static_cast<T*>(a.out), a.rows, a.cols, ld);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_swiglu_backward(Stream& s, const SwigluBackwardArgs& a) {
  StreamContext& ctx = context(s);
  const int64_t ld = a.ld ? a.ld : a.cols;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<grid_for(a.rows * a.cols, kThreads * 4), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.gate), static_cast<const T*>(a.up), static_cast<const T*>(a.dout),
        static_cast<T*>(a.dgate), static_cast<T*>(a.dup), a.rows, a.cols, ld);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_gelu(Stream& s, const GeluArgs& a) {
  StreamContext& ctx = context(s);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* x = static_cast<const T*>(a.x);
    auto* y = static_cast<T*>(a.y);
    if (a.tanh_approx) gelu_kernel<T, true><<<grid_for(a.n, kThreads * 4), kThreads, 0, ctx.stream()>>>(x, y, a.n);
    else gelu_kernel<T, false><<<grid_for(a.n, kThreads * 4), kThreads, 0, ctx.stream()>>>(x, y, a.n);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_gelu_backward(Stream& s, const GeluBackwardArgs& a) {
  StreamContext& ctx = context(s);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* x = static_cast<const T*>(a.x);
    const auto* dy = static_cast<const T*>(a.dy);
    auto* dx = static_cast<T*>(a.dx);
    const unsigned grid = grid_for(a.n, kThreads * 4);
    if (a.tanh_approx) gelu_backward_kernel<T, true><<<grid, kThreads, 0, ctx.stream()>>>(x, dy, dx, a.n, a.accumulate);
    else gelu_backward_kernel<T, false><<<grid, kThreads, 0, ctx.stream()>>>(x, dy, dx, a.n, a.accumulate);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_add(Stream& s, const AddArgs& a) {
  StreamContext& ctx = context(s);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    add_kernel<T><<<grid_for(a.n, kThreads * 4), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.a), static_cast<const T*>(a.b), static_cast<T*>(a.out), a.n);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata::kernels::cuda
