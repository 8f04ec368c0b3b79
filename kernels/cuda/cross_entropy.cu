// CUDA fused softmax + cross-entropy over a chunk of rows, forward and backward in one call,
// in place when dlogits aliases logits, and its vocabulary-parallel form (stats per shard, then
// finish from every shard's stats). One block per row: an online (max, sum) sweep, combined
// over the block in a fixed order, then one sweep writing dlogits. A target outside [-1, vocab)
// (full_vocab when sharded) is recorded in the stream's device error record and its row treated
// as ignored.
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 512;

// (max, Σ e^(x - max)) over x[0, n), the same in every thread of the block: an online sweep of
// this thread's elements c = tid, tid + blockDim, ..., combined over the block in a fixed order.
template <class T>
__device__ float2 block_max_sum_exp(const T* x, int64_t n, float* sh) {
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
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
  return make_float2(row_max, sum);
}

// An ignored row: loss 0 (when wanted), dlogits 0 (when wanted).
template <class T>
__device__ void ignore_row(float* losses, T* dx, int64_t r, int64_t vocab) {
  if (threadIdx.x == 0 && losses) losses[r] = 0.f;
  if (dx)
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) dx[c] = from_f32<T>(0.f);
}

// dx[c] = grad_scale · (e^(x[c] - row_max) / sum - onehot(target)) over c in [0, vocab) (target
// outside it: no onehot), each element read, then written, by the same thread (in place safe).
template <class T>
__device__ void write_dlogits(const T* x, T* dx, int64_t vocab, int64_t target, float x_target, float row_max,
                              float sum, float grad_scale) {
  const float log_sum = logf(sum), inv = grad_scale / sum;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    float d = expf(to_f32(x[c]) - row_max) * inv;
    if (c == target) d = (expf((x_target - row_max) - log_sum) - 1.f) * grad_scale;
    dx[c] = from_f32<T>(d);
  }
}

// The row's target, or -1 for an ignored row; a target outside [-1, n_classes) is reported (op)
// and its row ignored.
__device__ int32_t checked_target(const int32_t* targets, int64_t r, int64_t n_classes, int op,
                                  DeviceErrorSink errors) {
  const int32_t target = targets[r];
  if (target >= -1 && target < n_classes) return target;
  if (threadIdx.x == 0) report_device_error(errors, op, r, target, n_classes);
  return -1;
}

// logits, dlogits: (rows, vocab) with row stride ld (may alias); targets, losses: (rows).
template <class T>
__global__ void cross_entropy_kernel(const T* logits, const int32_t* __restrict__ targets, float* __restrict__ losses,
                                     T* dlogits, int64_t vocab, int64_t ld, float grad_scale, DeviceErrorSink errors) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const T* x = logits + r * ld;
  T* dx = dlogits ? dlogits + r * ld : nullptr;
  const int32_t target = checked_target(targets, r, vocab, kErrCrossEntropy, errors);
  if (target < 0) {  // ignored row: no loss, no gradient
    ignore_row(losses, dx, r, vocab);
    return;
  }
  const float x_target = to_f32(x[target]);  // every thread reads it before the barriers below
  const float2 st = block_max_sum_exp(x, vocab, sh);
  const float row_max = st.x, sum = st.y;
  const float log_sum = logf(sum);
  // loss = logsumexp - x[target] = (max - x[target]) + log(sum): exact subtraction first.
  if (threadIdx.x == 0 && losses) losses[r] = (row_max - x_target) + log_sum;
  if (dx) write_dlogits(x, dx, vocab, target, x_target, row_max, sum, grad_scale);
}

// Block r: stats[3r..3r+2] = (max, Σ e^(x - max), target's logit or 0) of row r of this shard
// (columns [vocab_start, vocab_start + vocab) of the vocabulary); 0, 0, 0 for an ignored row.
template <class T>
__global__ void cross_entropy_stats_kernel(const T* __restrict__ logits, const int32_t* __restrict__ targets,
                                           float* __restrict__ stats, int64_t vocab, int64_t ld,
                                           int64_t vocab_start, int64_t full_vocab, DeviceErrorSink errors) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const T* x = logits + r * ld;
  float* st = stats + 3 * r;  // (3)
  const int32_t target = checked_target(targets, r, full_vocab, kErrCrossEntropyStats, errors);
  if (target < 0) {
    if (threadIdx.x < 3) st[threadIdx.x] = 0.f;
    return;
  }
  const float2 ms = block_max_sum_exp(x, vocab, sh);
  if (threadIdx.x == 0) {
    const int64_t local = target - vocab_start;
    st[0] = ms.x;
    st[1] = ms.y;
    st[2] = local >= 0 && local < vocab ? to_f32(x[local]) : 0.f;
  }
}

// Block r: row r's M, S, t from every shard's stats (each thread forms them alike, in shard
// order), its loss, and this shard's dlogits (in place when dlogits aliases logits).
template <class T>
__global__ void cross_entropy_finish_kernel(const T* logits, const int32_t* __restrict__ targets,
                                            const float* __restrict__ all_stats, float* __restrict__ losses,
                                            T* dlogits, int64_t rows, int64_t vocab, int64_t ld, int64_t vocab_start,
                                            int64_t full_vocab, int parts, float grad_scale, DeviceErrorSink errors) {
  const int64_t r = blockIdx.x;
  T* dx = dlogits ? dlogits + r * ld : nullptr;
  const int32_t target = checked_target(targets, r, full_vocab, kErrCrossEntropyFinish, errors);
  if (target < 0) {  // ignored row: no loss, no gradient
    ignore_row(losses, dx, r, vocab);
    return;
  }
  float m = -INFINITY;
  for (int p = 0; p < parts; ++p) m = fmaxf(m, all_stats[(p * rows + r) * 3]);
  float sum = 0.f, x_target = 0.f;
  for (int p = 0; p < parts; ++p) {
    const float* st = all_stats + (p * rows + r) * 3;  // (3) of shard p
    sum += st[1] * expf(st[0] - m);
    x_target += st[2];
  }
  const float log_sum = logf(sum);
  // loss = (M - t) + log(S): exact subtraction first.
  if (threadIdx.x == 0 && losses) losses[r] = (m - x_target) + log_sum;
  if (dx) write_dlogits(logits + r * ld, dx, vocab, target - vocab_start, x_target, m, sum, grad_scale);
}

}  // namespace

void CudaOps::do_cross_entropy_stats(Stream& s, const CrossEntropyStatsArgs& a) {
  if (a.rows == 0) return;  // an empty grid is a launch error
  StreamContext& ctx = context(s);
  const int64_t ld = a.ld ? a.ld : a.vocab;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_stats_kernel<T><<<static_cast<unsigned>(a.rows), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.logits), a.targets, a.stats, a.vocab, ld, a.vocab_start, a.full_vocab, ctx.errors());
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_cross_entropy_finish(Stream& s, const CrossEntropyFinishArgs& a) {
  if (a.rows == 0) return;
  StreamContext& ctx = context(s);
  const int64_t ld = a.ld ? a.ld : a.vocab;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_finish_kernel<T><<<static_cast<unsigned>(a.rows), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.logits), a.targets, a.all_stats, a.losses, static_cast<T*>(a.dlogits), a.rows, a.vocab,
        ld, a.vocab_start, a.full_vocab, a.parts, a.grad_scale, ctx.errors());
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

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
