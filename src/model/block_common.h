// What the family recipes' blocks share: a block's weight and grad pointers by offset, and
// causal attention over the fused qkv projection, qkv (N, QKV) holding per token
// [q (Hq·D) | k (Hkv·D) | v (Hkv·D)]; and the workspace carver. Internal to src/model/ and
// src/infer/.
#pragma once
#include "src/comm/communicator.h"
#include "src/model/linear.h"
#include "src/model/transformer.h"

namespace strata::model_detail {

// Carves 64-byte aligned sub-buffers out of one allocation; run once with base = null to size it.
struct Carver {
  char* base = nullptr;
  size_t off = 0;
  void* take(size_t bytes) {
    off = (off + 63) / 64 * 64;
    void* p = base ? base + off : nullptr;
    off += bytes;
    return p;
  }
  float* take_f32(int64_t n) { return static_cast<float*>(take(static_cast<size_t>(n) * 4)); }
  void* take_dt(int64_t n, DType t) { return take(static_cast<size_t>(n) * kernels::dtype_size(t)); }
};

// The block's tensor at element offset `off` of its unit (working weights / fp32 grads);
// null for an absent tensor (offset -1).
inline const void* wptr(const BlockCtx& c, int64_t off) { return off >= 0 ? at(c.w, off, c.dtype) : nullptr; }
inline float* gptr(const BlockCtx& c, int64_t off) { return c.g && off >= 0 ? c.g + off : nullptr; }

// Tensor parallelism (Megatron-LM's f and g): x (rows, cols) summed over the tp group in place
// (after a row-parallel layer in the forward; after a column-parallel layer's input gradient in
// the backward). Nothing without tensor parallelism.
inline void tp_all_reduce(const BlockCtx& c, void* x, int64_t rows, int64_t cols) {
  if (c.tp_comm) c.tp_comm->all_reduce(x, x, static_cast<size_t>(rows * cols), c.dtype, *c.stream);
}

// A row-parallel layer: y (rows, out) = x · op(W) summed over the tp group, then + b (the bias
// is whole on every rank: added once, after the sum). Without tensor parallelism,
// linear_forward.
inline void row_parallel_forward(const Linear& l, const BlockCtx& c, const void* x, const void* w, const void* b,
                                 void* y, int64_t rows, int64_t in, int64_t out) {
  if (!c.tp_comm) return linear_forward(l, x, w, b, y, rows, in, out);
  linear_forward(l, x, w, nullptr, y, rows, in, out);
  tp_all_reduce(c, y, rows, out);
  if (b) c.ops->bias_add(*c.stream, {.dtype = c.dtype, .rows = rows, .cols = out, .y = y, .bias = b});
}

// The shape and q/k/v views shared by the attention forward and backward arguments.
template <class Args>
void set_fused_qkv(Args& args, const BlockCtx& c, const BlockActs& a) {
  const ModelDims& d = *c.dims;
  args.dtype = c.dtype;
  args.batch = d.B;
  args.seq = d.T;
  args.n_heads = d.Hq;
  args.n_kv_heads = d.Hkv;
  args.head_dim = d.D;
  args.q = a.qkv;
  args.k = at(a.qkv, d.Q, c.dtype);
  args.v = at(a.qkv, d.Q + d.Hkv * d.D, c.dtype);
  args.q_stride = args.k_stride = args.v_stride = d.QKV;
  args.out = a.att;
  args.lse = a.lse;
  args.seg_start = c.seg_start;  // documents: no token sees another document's
}

// att (N, Q) = causal softmax(q·kᵀ/√D)·v over a.qkv, saving lse (B, Hq, T). Decoding (c.kv):
// the new tokens' [k | v] rows are appended to the cache first (one copy per token: they are
// strided inside qkv), then each query sees the cached keys from its seg_start up to itself.
inline void fused_qkv_attention(const BlockCtx& c, const BlockActs& a) {
  kernels::AttentionArgs args;
  set_fused_qkv(args, c, a);
  if (const KvStep* kv = c.kv) {
    const ModelDims& d = *c.dims;
    const int64_t KV2 = 2 * d.Hkv * d.D;  // one cached token: [k | v]
    const size_t row_bytes = static_cast<size_t>(KV2) * kernels::dtype_size(c.dtype);
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t t = 0; t < d.T; ++t)
        c.stream->memcpy_async(at(kv->cache, ((b * kv->capacity) + kv->past + t) * KV2, c.dtype),
                               at(a.qkv, (b * d.T + t) * d.QKV + d.Q, c.dtype), row_bytes);
    args.k = kv->cache;
    args.v = at(kv->cache, KV2 / 2, c.dtype);
    args.k_stride = args.v_stride = KV2;
    args.kv_seq = kv->past + d.T;
    args.kv_batch_stride = kv->capacity * KV2;
    args.seg_start = kv->seg_start;
  }
  c.ops->attention(*c.stream, args);
}

// d_qkv (N, QKV) = [dq | dk | dv] from d_att (N, Q), with the layout of a.qkv.
inline void fused_qkv_attention_backward(const BlockCtx& c, const BlockActs& a, const void* d_att, void* d_qkv) {
  const ModelDims& d = *c.dims;
  kernels::AttentionBackwardArgs args;
  set_fused_qkv(args, c, a);
  args.dout = d_att;
  args.dq = d_qkv;
  args.dk = at(d_qkv, d.Q, c.dtype);
  args.dv = at(d_qkv, d.Q + d.Hkv * d.D, c.dtype);
  c.ops->attention_backward(*c.stream, args);
}

}  // namespace strata::model_detail
