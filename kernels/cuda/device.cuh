// Device-side helpers every CUDA op file shares: element types and their fp32 conversions
// (round to nearest even, bit-identical to kernels/dtype.h), the host-side dtype dispatcher,
// fixed-order (deterministic) warp and block reductions, and launch-size helpers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/check.h"
#include "kernels/dtype.h"

namespace strata::kernels::cuda {

using bf16 = __nv_bfloat16;
using f16 = __half;

// ---- conversions ------------------------------------------------------------------------------

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(f16 v) { return __half2float(v); }

// fp32 -> bf16 exactly as dtype.h's f32_to_bf16 (round to nearest even; a NaN keeps its top
// bits and is quietened), so casts match the CPU backend bit for bit.
__device__ __forceinline__ bf16 f32_to_bf16_rne(float f) {
  const uint32_t u = __float_as_uint(f);
  uint16_t h;
  if ((u & 0x7fffffffu) > 0x7f800000u) h = static_cast<uint16_t>((u >> 16) | 0x0040u);
  else h = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return __ushort_as_bfloat16(h);
}
// fp32 -> fp16, round to nearest even (cvt.rn.f16.f32: subnormals and overflow as IEEE). A NaN
// becomes the canonical fp16 NaN (the CPU keeps payload bits): the only difference.
__device__ __forceinline__ f16 f32_to_f16_rne(float f) { return __float2half_rn(f); }

template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return f32_to_bf16_rne(v); }
template <> __device__ __forceinline__ f16 from_f32<f16>(float v) { return f32_to_f16_rne(v); }

// Calls f(T{}) with T the storage type of dtype t (float, bf16 or f16); f is a generic lambda.
template <class F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: f(float{}); return;
    case DType::bf16: f(bf16{}); return;
    case DType::f16: f(f16{}); return;
  }
  throw std::invalid_argument("unknown dtype " + std::to_string(static_cast<int>(t)));
}

// ---- reductions in a fixed order ---------------------------------------------------------------
// Butterfly (xor) shuffles: every lane ends with the same value, formed by the same tree of
// additions on every run. Block reductions go warp -> shared -> warp 0, also fixed.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 values; the call begins with a barrier so it can be reused back to back.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T r = lane < n_warps ? shared[lane] : T(0);
  return warp_sum(r);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = lane < n_warps ? shared[lane] : -INFINITY;
  return warp_max(r);
}

// ---- launch helpers -----------------------------------------------------------------------------

// Blocks for n items at `per_block` items each, capped for grid-stride loops.
inline unsigned grid_for(int64_t n, int64_t per_block, int64_t cap = int64_t{1} << 20) {
  int64_t g = (n + per_block - 1) / per_block;
  if (g < 1) g = 1;
  if (g > cap) g = cap;
  return static_cast<unsigned>(g);
}

}  // namespace strata::kernels::cuda
