// CUDA memory-bound ops of the optimizer step: fused AdamW (torch.optim.AdamW semantics, the
// same per-element formula and fp32 constants as the CPU kernel), sum of squares in fp64 (fixed
// per-block partials, then one block adds them in order: deterministic), scale, and casts with
// round-to-nearest-even.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Per-step constants, computed once in double on the host and rounded to fp32 (as the CPU does).
struct AdamConsts {
  float decay;         // 1 - lr·wd
  float b1, one_m_b1;  // beta1, 1 - beta1
  float b2, one_m_b2;
  float step_size;     // lr / (1 - beta1^step)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^step)
  float eps, grad_scale;
};
AdamConsts adam_consts(const AdamWArgs& a) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), static_cast<double>(a.step));
  AdamConsts c;
  c.decay = static_cast<float>(1.0 - static_cast<double>(a.lr) * a.weight_decay);
  c.b1 = a.beta1, c.one_m_b1 = static_cast<float>(1.0 - a.beta1);
  c.b2 = a.beta2, c.one_m_b2 = static_cast<float>(1.0 - a.beta2);
  c.step_size = static_cast<float>(a.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = a.eps, c.grad_scale = a.grad_scale;
  return c;
}

// G: grad storage type; C: param_copy storage type (ignored when copy is null).
template <class G, class C>
__global__ void adamw_kernel(float* param, const float* param_in, const G* __restrict__ grad, float* m,
                             const float* m_in, float* v, const float* v_in, C* __restrict__ copy, int64_t n,
                             AdamConsts c) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    // Operation for operation the CPU kernel's (kernels/cpu/optim.cpp: the same roundings and
    // fused multiply-adds, explicit so nvcc contracts nothing else), so an update gives the same
    // bits on either device and AdamW's placement (GPU, or CPU next to offloaded state) never
    // changes a loss.
    const float g = __fmul_rn(to_f32(grad[i]), c.grad_scale);
    float p = __fmul_rn(param_in[i], c.decay);
    const float mi = __fmaf_rn(m_in[i], c.b1, __fmul_rn(g, c.one_m_b1));
    const float vi = __fmaf_rn(v_in[i], c.b2, __fmul_rn(__fmul_rn(g, g), c.one_m_b2));
    const float denom = __fmaf_rn(__fsqrt_rn(vi), c.inv_sqrt_bc2, c.eps);
    p = __fmaf_rn(-c.step_size, __fdiv_rn(mi, denom), p);
    param[i] = p, m[i] = mi, v[i] = vi;
    if (copy) copy[i] = from_f32<C>(p);
  }
}

// Fixed grid: thread t of the grid sums elements t, t + stride, ... in order (fp64), the block
// sums its threads with a fixed tree into partial[block]; then one block sums the partials.
constexpr int kSumBlocks = 1024;

template <class T>
__global__ void sum_squares_partial_kernel(const T* __restrict__ x, int64_t n, double* __restrict__ partial) {
  __shared__ double sh[32];
  double acc = 0.0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const double v = to_f32(x[i]);
    acc += v * v;
  }
  acc = block_sum(acc, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void sum_squares_final_kernel(const double* __restrict__ partial, int n_partials, double* out) {
  __shared__ double sh[32];
  double v = 0.0;
  for (int i = threadIdx.x; i < n_partials; i += blockDim.x) v += partial[i];
  v = block_sum(v, sh);
  if (threadIdx.x == 0) *out += v;
}

template <class T>
__global__ void scale_kernel(T* x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    x[i] = from_f32<T>(to_f32(x[i]) * s);
}

// The fixed-order sum (RankOrderSumArgs): fp32 in rank order, rounded once.
template <class T>
__global__ void rank_order_sum_kernel(const T* mine, int me, int world, const T* others, int64_t stride, T* out,
                                      int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float acc = 0.f;
    for (int r = 0; r < world; ++r) {
      const T v = r == me ? mine[i] : others[static_cast<int64_t>(r < me ? r : r - 1) * stride + i];
      acc = r == 0 ? to_f32(v) : __fadd_rn(acc, to_f32(v));
    }
    out[i] = from_f32<T>(acc);
  }
}

template <class S, class D>
__global__ void cast_kernel(const S* __restrict__ src, D* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = from_f32<D>(to_f32(src[i]));
}

}  // namespace

void CudaOps::do_adamw(Stream& s, const AdamWArgs& args) {
  const AdamWArgs a = args.with_inputs();
  StreamContext& ctx = context(s);
  const AdamConsts c = adam_consts(a);
  const unsigned grid = grid_for(a.n, kThreads * 8);
  dispatch_dtype(a.grad_dtype, [&](auto gtag) {
    using G = decltype(gtag);
    const auto* g = static_cast<const G*>(a.grad);
    if (!a.param_copy) {
      adamw_kernel<G, bf16><<<grid, kThreads, 0, ctx.stream()>>>(a.param, a.param_in, g, a.m, a.m_in, a.v, a.v_in,
                                                                 nullptr, a.n, c);
      STRATA_CUDA_CHECK_LAUNCH();
      return;
    }
    dispatch_dtype(a.copy_dtype, [&](auto ctag) {
      using C = decltype(ctag);
      adamw_kernel<G, C><<<grid, kThreads, 0, ctx.stream()>>>(a.param, a.param_in, g, a.m, a.m_in, a.v, a.v_in,
                                                              static_cast<C*>(a.param_copy), a.n, c);
      STRATA_CUDA_CHECK_LAUNCH();
    });
  });
}

// The block count depends on n only, so the summation order is fixed.
void CudaOps::do_sum_squares(Stream& s, const SumSquaresArgs& a) {
  StreamContext& ctx = context(s);
  const int n_blocks = static_cast<int>(std::min<int64_t>(kSumBlocks, (a.n + 4 * kThreads - 1) / (4 * kThreads)));
  auto* partial = static_cast<double*>(ctx.scratch(sizeof(double) * kSumBlocks));
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    sum_squares_partial_kernel<T><<<n_blocks, kThreads, 0, ctx.stream()>>>(static_cast<const T*>(a.x), a.n, partial);
    STRATA_CUDA_CHECK_LAUNCH();
  });
  sum_squares_final_kernel<<<1, 1024, 0, ctx.stream()>>>(partial, n_blocks, a.out);
  STRATA_CUDA_CHECK_LAUNCH();
}

void CudaOps::do_scale(Stream& s, const ScaleArgs& a) {
  StreamContext& ctx = context(s);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T><<<grid_for(a.n, kThreads * 8), kThreads, 0, ctx.stream()>>>(static_cast<T*>(a.x), a.n, a.s);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_rank_order_sum(Stream& s, const RankOrderSumArgs& a) {
  StreamContext& ctx = context(s);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    rank_order_sum_kernel<T><<<grid_for(a.n, kThreads * 8), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.mine), a.me, a.world, static_cast<const T*>(a.others), a.others_stride,
        static_cast<T*>(a.out), a.n);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_cast(Stream& s, const CastArgs& a) {
  StreamContext& ctx = context(s);
  if (a.src_dtype == a.dst_dtype) {
    STRATA_CUDA_CHECK(cudaMemcpyAsync(a.dst, a.src, static_cast<size_t>(a.n) * dtype_size(a.src_dtype),
                                      cudaMemcpyDeviceToDevice, ctx.stream()));
    return;
  }
  dispatch_dtype(a.src_dtype, [&](auto stag) {
    using S = decltype(stag);
    dispatch_dtype(a.dst_dtype, [&](auto dtag) {
      using D = decltype(dtag);
      cast_kernel<S, D><<<grid_for(a.n, kThreads * 8), kThreads, 0, ctx.stream()>>>(static_cast<const S*>(a.src),
                                                                                    static_cast<D*>(a.dst), a.n);
      STRATA_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace strata::kernels::cuda
