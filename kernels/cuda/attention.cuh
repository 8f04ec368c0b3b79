// The CUDA attention kernels' shared vocabulary: the geometry of one call and the entry points
// of the two implementations (attention.cu: SIMT, any dtype and head_dim <= 256, and the
// dispatcher; attention_tc.cu: tensor cores, bf16/fp16 with head_dim 64 or 128).
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/ops.h"

namespace strata::kernels::cuda {

// One call's shape. Strides are elements between consecutive tokens; every view starts at batch
// 0, token 0, head 0. lse and delta are (batch, n_heads, seq) fp32.
struct AttnGeometry {
  DType dtype = DType::f32;
  int batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, group = 0;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0, o_stride = 0;
  float scale = 0.f;

  template <class A>
  explicit AttnGeometry(const A& a)
      : dtype(a.dtype), batch(static_cast<int>(a.batch)), seq(static_cast<int>(a.seq)),
        n_heads(static_cast<int>(a.n_heads)), n_kv_heads(static_cast<int>(a.n_kv_heads)),
        head_dim(static_cast<int>(a.head_dim)), group(static_cast<int>(a.n_heads / a.n_kv_heads)),
        q_stride(a.q_stride ? a.q_stride : a.n_heads * a.head_dim),
        k_stride(a.k_stride ? a.k_stride : a.n_kv_heads * a.head_dim),
        v_stride(a.v_stride ? a.v_stride : a.n_kv_heads * a.head_dim), o_stride(a.n_heads * a.head_dim),
        scale(a.scale > 0.f ? a.scale : 1.f / std::sqrt(static_cast<float>(a.head_dim))) {}
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
