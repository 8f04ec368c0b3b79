// The CUDA attention kernels' shared vocabulary: the geometry of one call and the entry points
// of the two implementations (attention.cu: SIMT, any dtype and head_dim <= 256, and the
// dispatcher; attention_tc.cu: tensor cores, bf16/fp16 with head_dim 64 or 128).
#pragma once
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/ops.h"

namespace strata::kernels::cuda {

// One call's shape. Strides are elements between consecutive tokens; every view starts at batch
// 0, token 0, head 0. lse and delta are (batch, n_heads, seq) fp32. Query t sees the keys
// [first_key(b, t), q_pos0 + t].
struct AttnGeometry {
  DType dtype = DType::f32;
  int batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, group = 0;
  int kv_seq = 0, q_pos0 = 0;  // keys per batch item; key position of query 0 (kv_seq - seq)
  int64_t q_stride = 0, k_stride = 0, v_stride = 0, o_stride = 0;
  int64_t k_batch = 0, v_batch = 0;    // elements between batch items of k, v
  const int32_t* seg_start = nullptr;  // (batch, seq) device memory, or null (0)
  float scale = 0.f;

  template <class A>
  explicit AttnGeometry(const A& a)
      : dtype(a.dtype), batch(static_cast<int>(a.batch)), seq(static_cast<int>(a.seq)),
        n_heads(static_cast<int>(a.n_heads)), n_kv_heads(static_cast<int>(a.n_kv_heads)),
        head_dim(static_cast<int>(a.head_dim)), group(static_cast<int>(a.n_heads / a.n_kv_heads)),
        q_stride(a.q_stride ? a.q_stride : a.n_heads * a.head_dim),
        k_stride(a.k_stride ? a.k_stride : a.n_kv_heads * a.head_dim),
        v_stride(a.v_stride ? a.v_stride : a.n_kv_heads * a.head_dim), o_stride(a.n_heads * a.head_dim),
        seg_start(a.seg_start), scale(a.scale > 0.f ? a.scale : 1.f / std::sqrt(static_cast<float>(a.head_dim))) {
    kv_seq = static_cast<int>(kv_seq_of(a));
    q_pos0 = kv_seq - seq;
    const int64_t kv_batch = kv_batch_stride_of(a);
    k_batch = kv_batch ? kv_batch : kv_seq * k_stride;
    v_batch = kv_batch ? kv_batch : kv_seq * v_stride;
  }

#ifdef __CUDACC__
  // The first key query t (< seq) of batch b sees.
  __device__ __forceinline__ int first_key(int b, int t) const {
    return seg_start ? max(0, static_cast<int>(seg_start[static_cast<int64_t>(b) * seq + t])) : 0;
  }
  // The smallest first key of queries [q0, min(q0 + n, seq)), computed by the calling warp alone:
  // every warp of a block gets the same value, so loops bounded by it stay block-uniform.
  __device__ __forceinline__ int warp_min_first_key(int b, int q0, int n) const {
    if (!seg_start) return 0;
    int m = INT_MAX;
    for (int i = static_cast<int>(threadIdx.x & 31u); i < n && q0 + i < seq; i += 32) m = min(m, first_key(b, q0 + i));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = min(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
  }
#endif
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// SIMT (attention.cu).
constexpr int kSimtMaxHeadDim = 256;
void attention_forward_simt(const AttentionArgs& a, const AttnGeometry& g, cudaStream_t s);
void attention_backward_simt(const AttentionBackwardArgs& a, const AttnGeometry& g, const float* delta,
                             cudaStream_t s);

// Tensor cores (attention_tc.cu). tc_supported: the dtype, head_dim, pointer alignment (16 B)
// and strides (multiples of 8 elements) the kernels handle.
bool attention_tc_supported(const AttentionArgs& a, const AttnGeometry& g);
bool attention_tc_supported(const AttentionBackwardArgs& a, const AttnGeometry& g);
// ldmatrix: fragments through ldmatrix (true) or plain shared loads (false); bit-identical.
void attention_forward_tc(const AttentionArgs& a, const AttnGeometry& g, bool ldmatrix, cudaStream_t s);
void attention_backward_tc(const AttentionBackwardArgs& a, const AttnGeometry& g, const float* delta, bool ldmatrix,
                           cudaStream_t s);

}  // namespace strata::kernels::cuda
