// Causal attention over a block's fused qkv projection, shared by the llama and gpt2 recipes:
// qkv (N, QKV) holds, per token, [q (Hq·D) | k (Hkv·D) | v (Hkv·D)]. Internal to src/model/.
#pragma once
#include "src/model/linear.h"
#include "src/model/transformer.h"

namespace strata::model_detail {

// att (N, Q) = causal softmax(q·kᵀ/√D)·v over a.qkv, saving lse (B, Hq, T).
inline void fused_qkv_attention(const BlockCtx& c, const BlockActs& a) {
  const ModelDims& d = *c.dims;
  kernels::AttentionArgs args;
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
  c.ops->attention(*c.stream, args);
}

// d_qkv (N, QKV) = [dq | dk | dv] from d_att (N, Q), with the layout of a.qkv.
inline void fused_qkv_attention_backward(const BlockCtx& c, const BlockActs& a, const void* d_att, void* d_qkv) {
  const ModelDims& d = *c.dims;
  kernels::AttentionBackwardArgs args;
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
  args.dout = d_att;
  args.lse = a.lse;
  args.dq = d_qkv;
  args.dk = at(d_qkv, d.Q, c.dtype);
  args.dv = at(d_qkv, d.Q + d.Hkv * d.D, c.dtype);
  c.ops->attention_backward(*c.stream, args);
}

}  // namespace strata::model_detail
