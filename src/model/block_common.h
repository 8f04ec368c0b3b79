// What the llama and gpt2 block recipes share: a block's weight and grad pointers by offset,
// and causal attention over the fused qkv projection, qkv (N, QKV) holding per token
// [q (Hq·D) | k (Hkv·D) | v (Hkv·D)]. Internal to src/model/.
#pragma once
#include "src/model/linear.h"
#include "src/model/transformer.h"

namespace strata::model_detail {

// The block's tensor at element offset `off` of its unit (working weights / fp32 grads);
// null for an absent tensor (offset -1).
inline const void* wptr(const BlockCtx& c, int64_t off) { return off >= 0 ? at(c.w, off, c.dtype) : nullptr; }
inline float* gptr(const BlockCtx& c, int64_t off) { return off >= 0 ? c.g + off : nullptr; }

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

// att (N, Q) = causal softmax(q·kᵀ/√D)·v over a.qkv, saving lse (B, Hq, T).
inline void fused_qkv_attention(const BlockCtx& c, const BlockActs& a) {
  kernels::AttentionArgs args;
  set_fused_qkv(args, c, a);
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
