// CUDA rotary position embedding (HF "rotate half"), in place on q or k, which may sit inside a
// fused qkv buffer (token_stride), at positions pos0 + t or per-token positions (packed
// documents). The backward rotates the gradient by the negative angle.
// One thread per rotated pair (x[i], x[i + head_dim/2]).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// x: (batch·seq tokens, heads, head_dim), token_stride elements between tokens; cos, sin:
// (max_pos, head_dim/2); pos: (batch·seq) per-token positions or null (pos0 + t).
template <class T>
__global__ void rope_kernel(T* x, const float* __restrict__ cos_t, const float* __restrict__ sin_t, int64_t tokens,
                            int64_t seq, int64_t heads, int64_t half, int64_t token_stride, int64_t pos0,
                            const int32_t* __restrict__ pos_t, float sign) {
  const int64_t n = tokens * heads * half;
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < n; k += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = k % half, th = k / half, h = th % heads, bt = th / heads;
    const int64_t pos = pos_t ? int64_t{pos_t[bt]} : pos0 + bt % seq;
    T* lo = x + bt * token_stride + h * 2 * half + i;
    T* hi = lo + half;
    const float x1 = to_f32(*lo), x2 = to_f32(*hi);
    const float c = cos_t[pos * half + i], s = sign * sin_t[pos * half + i];
    *lo = from_f32<T>(x1 * c - x2 * s);
    *hi = from_f32<T>(x2 * c + x1 * s);
  }
}

}  // namespace

void CudaOps::do_rope(Stream& s, const RopeArgs& a) {
  StreamContext& ctx = context(s);
  const int64_t half = a.head_dim / 2, tokens = a.batch * a.seq;
  const int64_t token_stride = a.token_stride ? a.token_stride : a.heads * a.head_dim;
  const float sign = a.backward ? -1.f : 1.f;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<grid_for(tokens * a.heads * half, kThreads * 4), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(a.x), a.cos, a.sin, tokens, a.seq, a.heads, half, token_stride, a.pos0, a.pos, sign);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata::kernels::cuda
