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

// Tensor parallelism (Megatron-LM). Without it every helper here is the plain op (rows = N).
// With sequence parallelism the residual stream, the norms and the row-parallel outputs hold
// this rank's rows only (dims res_rows from res_row0: B·T / tp of them), and the column-parallel
// layers read the norms' outputs gathered whole: the all-reduces become a reduce-scatter (row-
// parallel outputs, column-parallel input gradients) and an all-gather (norm outputs; the
// residual gradient before the row-parallel layers' backward).

// Whether the residual stream is split by rows (dims res_rows < N).
inline bool sequence_parallel(const BlockCtx& c) { return c.dims->res_rows != c.dims->N; }

// This rank's rows of a whole (N, cols) buffer (the buffer itself without sequence parallelism).
inline void* own_rows(const BlockCtx& c, void* full, int64_t cols) {
  return at(full, c.dims->res_row0 * cols, c.dtype);
}

// After a norm wrote this rank's rows of full (N, cols): every rank's (all-gather in place).
inline void sp_gather(const BlockCtx& c, void* full, int64_t cols) {
  if (sequence_parallel(c))
    c.tp_comm->all_gather(own_rows(c, full, cols), full, static_cast<size_t>(c.dims->res_rows * cols), c.dtype,
                          *c.stream);
}

// The residual gradient as the row-parallel layers' backward reads it: whole, gathered from
// every rank's rows into `full` under sequence parallelism, else `local` itself.
inline const void* sp_whole(const BlockCtx& c, const void* local, void* full, int64_t cols) {
  if (!sequence_parallel(c)) return local;
  c.tp_comm->all_gather(local, full, static_cast<size_t>(c.dims->res_rows * cols), c.dtype, *c.stream);
  return full;
}

// A column-parallel layer's input gradient d (N, cols), this rank's part, summed over the group
// (Megatron's f in the backward): whole (all-reduce), or this rank's rows (reduce-scatter under
// sequence parallelism). Returns the rows the norm backward reads.
inline void* tp_input_grad(const BlockCtx& c, void* d, int64_t cols) {
  if (!c.tp_comm) return d;
  if (!sequence_parallel(c)) {
    c.tp_comm->all_reduce(d, d, static_cast<size_t>(c.dims->N * cols), c.dtype, *c.stream);
    return d;
  }
  void* mine = own_rows(c, d, cols);
  c.tp_comm->reduce_scatter(d, mine, static_cast<size_t>(c.dims->res_rows * cols), c.dtype, *c.stream);
  return mine;
}

// A row-parallel layer and its LoRA adapters (slot): y (N, out) = x · op(W) + the adapters'
// output, summed over the tp group, then + b (the bias is whole on every rank: added once, after
// the sum; Megatron's g). Returns the rows of y that hold the result: all of them, or this
// rank's under sequence parallelism. Without tensor parallelism, linear_forward then the
// adapters.
inline void* row_parallel_forward(const Linear& l, const BlockCtx& c, LoraSlot slot, const void* x, const void* w,
                                  const void* b, void* y, int64_t rows, int64_t in, int64_t out) {
  if (!c.tp_comm) {
    linear_forward(l, x, w, b, y, rows, in, out);
    lora_forward(c, slot, x, y, out);
    return y;
  }
  linear_forward(l, x, w, nullptr, y, rows, in, out);
  lora_forward(c, slot, x, y, out);  // (each rank's input columns' part of it, summed with the layer's)
  void* mine = y;
  if (sequence_parallel(c)) {
    mine = own_rows(c, y, out);
    rows = c.dims->res_rows;
    c.tp_comm->reduce_scatter(y, mine, static_cast<size_t>(rows * out), c.dtype, *c.stream);
  } else {
    c.tp_comm->all_reduce(y, y, static_cast<size_t>(rows * out), c.dtype, *c.stream);
  }
  if (b) c.ops->bias_add(*c.stream, {.dtype = c.dtype, .rows = rows, .cols = out, .y = mine, .bias = b});
  return mine;
}

// A norm's weight (and bias) grads under sequence parallelism come from this rank's rows only:
// they go to a zeroed scratch (norm_grads), which norm_grads_done sums over the group and adds
// to the grads, so every rank holds the whole model's (the norms are whole on every rank).
// Otherwise straight into the grads. The norm's cols = C.
struct NormGrads {
  float* w;
  float* b;
};
inline NormGrads norm_grads(const BlockCtx& c, float* gw, float* gb) {
  if (!sequence_parallel(c) || !gw) return {gw, gb};
  const int64_t C = c.dims->C;
  c.stream->memset_async(c.sp_norm_grads, 0, static_cast<size_t>(2 * C) * sizeof(float));
  return {c.sp_norm_grads, gb ? c.sp_norm_grads + C : nullptr};
}
inline void norm_grads_done(const BlockCtx& c, float* gw, float* gb) {
  if (!sequence_parallel(c) || !gw) return;
  const int64_t C = c.dims->C;
  float* scratch = c.sp_norm_grads;
  c.tp_comm->all_reduce(scratch, scratch, static_cast<size_t>((gb ? 2 : 1) * C), DType::f32, *c.stream);
  c.ops->add(*c.stream, {.dtype = DType::f32, .n = C, .a = gw, .b = scratch, .out = gw});
  if (gb) c.ops->add(*c.stream, {.dtype = DType::f32, .n = C, .a = gb, .b = scratch + C, .out = gb});
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
