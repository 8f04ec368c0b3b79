// CUDA fused softmax + cross-entropy over a chunk of rows, forward and backward in one call,
// in place when dlogits aliases logits. One block per row: an online (max, sum) sweep, combined
// over the block in a fixed order, then one sweep writing dlogits. A target outside [-1, vocab)
// is recorded in the stream's device error record and its row treated as ignored.
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 512;

// logits, dlogits: (rows, vocab) with row stride ld (may alias); targets, losses: (rows).
template <class T>
__global__ void cross_entropy_kernel(const T* logits, const int32_t* __restrict__ targets, float* __restrict__ losses,
                                     T* dlogits, int64_t vocab, int64_t ld, float grad_scale, DeviceErrorSink errors) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const T* x = logits + r * ld;
  T* dx = dlogits ? dlogits + r * ld : nullptr;
  int32_t target = targets[r];
  if (target < -1 || target >= vocab) {
    if (threadIdx.x == 0) report_device_error(errors, kErrCrossEntropy, r, target, vocab);
    target = -1;
  }
  if (target < 0) {  // ignored row: no loss, no gradient
    if (threadIdx.x == 0 && losses) losses[r] = 0.f;
    if (dx)
      for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) dx[c] = from_f32<T>(0.f);
    return;
  }
  const float x_target = to_f32(x[target]);  // every thread reads it before the barriers below
  // Online softmax statistics of this thread's logits c = tid, tid + blockDim, ...
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float v = to_f32(x[c]);
    if (v > m) {
      s = s * expf(m - v) + 1.f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  const float row_max = block_max(m, sh);
  const float sum = block_sum(m == -INFINITY ? 0.f : s * expf(m - row_max), sh);
  const float log_sum = logf(sum);
  // loss = logsumexp - x[target] = (max - x[target]) + log(sum): exact subtraction first.
  if (threadIdx.x == 0 && losses) losses[r] = (row_max - x_target) + log_sum;
  if (!dx) return;
  const float inv = grad_scale / sum;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float v = to_f32(x[c]);  // the same thread reads, then overwrites, element c
    float d = expf(v - row_max) * inv;
    if (c == target) d = (expf((x_target - row_max) - log_sum) - 1.f) * grad_scale;
    dx[c] = from_f32<T>(d);
  }
}

}  // namespace

void CudaOps::do_cross_entropy(Stream& s, const CrossEntropyArgs& a) {
  StreamContext& ctx = context(s);
  const int64_t ld = a.ld ? a.ld : a.vocab;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_kernel<T><<<static_cast<unsigned>(a.rows), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.logits), a.targets, a.losses, static_cast<T*>(a.dlogits), a.vocab, ld, a.grad_scale,
        ctx.errors());
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata::kernels::cuda
