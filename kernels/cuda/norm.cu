// CUDA RMSNorm and LayerNorm, forward and backward. One block per row in the forward (fp32
// statistics, two-pass variance); the backward gives each block a fixed chunk of rows, writes dx
// and keeps per-chunk partial dweight/dbias rows, which a second kernel adds in chunk order:
// deterministic, no atomics.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <class T, bool kLayerNorm>
__global__ void norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                    T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                    int64_t cols, float eps) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  const float inv_n = 1.f / static_cast<float>(cols);
  float mean = 0.f, rstd;
  if constexpr (kLayerNorm) {
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += to_f32(xr[c]);
    mean = block_sum(s, sh) * inv_n;
    float q = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float d = to_f32(xr[c]) - mean;
      q += d * d;
    }
    rstd = rsqrtf(block_sum(q, sh) * inv_n + eps);
  } else {
    float q = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = to_f32(xr[c]);
      q += v * v;
    }
    rstd = rsqrtf(block_sum(q, sh) * inv_n + eps);
  }
  if (threadIdx.x == 0) {
    rstd_out[r] = rstd;
    if (kLayerNorm) mean_out[r] = mean;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = (to_f32(xr[c]) - mean) * rstd * to_f32(w[c]);
    if (kLayerNorm && b) v += to_f32(b[c]);
    yr[c] = from_f32<T>(v);
  }
}

// With xhat = (x - mean)·rstd (mean = 0 for RMSNorm) and g = dy·weight:
//   RMSNorm:   dx = rstd · (g - xhat · mean(g·xhat))
//   LayerNorm: dx = rstd · (g - mean(g) - xhat · mean(g·xhat))
// Block k owns rows [k·rows_per_block, ...) and the partial rows part_dw[k, :], part_db[k, :]
// (its threads own columns tid, tid + blockDim, ...: no two threads touch one element).
template <class T, bool kLayerNorm>
__global__ void norm_backward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                                     const float* __restrict__ mean_in, const float* __restrict__ rstd_in, T* dx,
                                     float* __restrict__ part_dw, float* __restrict__ part_db, int64_t rows,
                                     int64_t cols, int64_t rows_per_block, bool accumulate) {
  __shared__ float sh[32];
  const float inv_n = 1.f / static_cast<float>(cols);
  float* pdw = part_dw + blockIdx.x * cols;
  float* pdb = part_db ? part_db + blockIdx.x * cols : nullptr;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    pdw[c] = 0.f;
    if (pdb) pdb[c] = 0.f;
  }
  const int64_t r0 = blockIdx.x * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    const float mean = kLayerNorm ? mean_in[r] : 0.f, rstd = rstd_in[r];
    float sg = 0.f, sgx = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float xhat = (to_f32(xr[c]) - mean) * rstd;
      const float d = to_f32(dyr[c]);
      const float g = d * to_f32(w[c]);
      sg += g;
      sgx += g * xhat;
      pdw[c] += d * xhat;
      if (pdb) pdb[c] += d;
    }
    const float mean_g = kLayerNorm ? block_sum(sg, sh) * inv_n : 0.f;
    const float mean_gx = block_sum(sgx, sh) * inv_n;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float xhat = (to_f32(xr[c]) - mean) * rstd;
      const float g = to_f32(dyr[c]) * to_f32(w[c]);
      float v = rstd * (g - mean_g - xhat * mean_gx);
      if (accumulate) v += to_f32(dxr[c]);
      dxr[c] = from_f32<T>(v);
    }
  }
}

// dweight[c] += Σ_k part_dw[k, c] and dbias likewise, k in order.
__global__ void norm_param_grads_kernel(const float* __restrict__ part_dw, const float* __restrict__ part_db,
                                        float* __restrict__ dweight, float* __restrict__ dbias, int64_t n_blocks,
                                        int64_t cols) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  float sw = 0.f, sb = 0.f;
  for (int64_t k = 0; k < n_blocks; ++k) {
    sw += part_dw[k * cols + c];
    if (part_db) sb += part_db[k * cols + c];
  }
  dweight[c] += sw;
  if (part_db) dbias[c] += sb;
}

template <bool kLayerNorm>
void norm_forward(Stream& s, const NormArgs& a) {
  StreamContext& ctx = context(s);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    norm_forward_kernel<T, kLayerNorm><<<static_cast<unsigned>(a.rows), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.x), static_cast<const T*>(a.weight), static_cast<const T*>(a.bias),
        static_cast<T*>(a.y), a.mean, a.rstd, a.cols, a.eps);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

template <bool kLayerNorm>
void norm_backward(Stream& s, const NormBackwardArgs& a) {
  StreamContext& ctx = context(s);
  // The chunking depends on the shape only, so the summation order is fixed.
  const int64_t n_blocks = std::min<int64_t>(512, (a.rows + 7) / 8);
  const int64_t rows_per_block = (a.rows + n_blocks - 1) / n_blocks;
  const bool with_db = kLayerNorm && a.dbias != nullptr;
  ScratchPlan plan;
  const size_t part_bytes = static_cast<size_t>(n_blocks * a.cols) * sizeof(float);
  const size_t at_dw = plan.add(part_bytes), at_db = with_db ? plan.add(part_bytes) : 0;
  char* base = static_cast<char*>(ctx.scratch(plan.total()));
  float* part_dw = reinterpret_cast<float*>(base + at_dw);                           // (n_blocks, cols)
  float* part_db = with_db ? reinterpret_cast<float*>(base + at_db) : nullptr;        // (n_blocks, cols)
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    norm_backward_kernel<T, kLayerNorm><<<static_cast<unsigned>(n_blocks), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.x), static_cast<const T*>(a.weight), static_cast<const T*>(a.dy), a.mean, a.rstd,
        static_cast<T*>(a.dx), part_dw, part_db, a.rows, a.cols, rows_per_block, a.accumulate);
    STRATA_CUDA_CHECK_LAUNCH();
  });
  if (!a.dweight) return;  // a frozen norm: the input gradient only
  norm_param_grads_kernel<<<grid_for(a.cols, kThreads), kThreads, 0, ctx.stream()>>>(part_dw, part_db, a.dweight,
                                                                                      a.dbias, n_blocks, a.cols);
  STRATA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void CudaOps::do_rmsnorm(Stream& s, const NormArgs& a) { norm_forward<false>(s, a); }
void CudaOps::do_layernorm(Stream& s, const NormArgs& a) { norm_forward<true>(s, a); }
void CudaOps::do_rmsnorm_backward(Stream& s, const NormBackwardArgs& a) { norm_backward<false>(s, a); }
void CudaOps::do_layernorm_backward(Stream& s, const NormBackwardArgs& a) { norm_backward<true>(s, a); }

}  // namespace strata::kernels::cuda
