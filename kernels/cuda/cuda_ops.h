// The CUDA backend's op set (internal header: CUDA types allowed here, not in public headers).
#pragma once
#include <cuda_runtime.h>

#include "kernels/ops.h"
#include "kernels/runtime.h"

namespace strata::kernels::cuda {

cudaStream_t native(Stream& s);

class CudaOps final : public Ops {
 protected:
  void do_matmul(Stream& s, const MatmulArgs& a) override;
  void do_bias_add(Stream& s, const BiasAddArgs& a) override;
  void do_bias_backward(Stream& s, const BiasBackwardArgs& a) override;
  void do_embedding(Stream& s, const EmbeddingArgs& a) override;
  void do_embedding_backward(Stream& s, const EmbeddingBackwardArgs& a) override;
  void do_rmsnorm(Stream& s, const NormArgs& a) override;
  void do_rmsnorm_backward(Stream& s, const NormBackwardArgs& a) override;
  void do_layernorm(Stream& s, const NormArgs& a) override;
  void do_layernorm_backward(Stream& s, const NormBackwardArgs& a) override;
  void do_rope(Stream& s, const RopeArgs& a) override;
  void do_attention(Stream& s, const AttentionArgs& a) override;
  void do_attention_backward(Stream& s, const AttentionBackwardArgs& a) override;
  void do_swiglu(Stream& s, const SwigluArgs& a) override;
  void do_swiglu_backward(Stream& s, const SwigluBackwardArgs& a) override;
  void do_gelu(Stream& s, const GeluArgs& a) override;
  void do_gelu_backward(Stream& s, const GeluBackwardArgs& a) override;
  void do_add(Stream& s, const AddArgs& a) override;
  void do_cross_entropy(Stream& s, const CrossEntropyArgs& a) override;
  void do_adamw(Stream& s, const AdamWArgs& a) override;
  void do_sum_squares(Stream& s, const SumSquaresArgs& a) override;
  void do_scale(Stream& s, const ScaleArgs& a) override;
  void do_cast(Stream& s, const CastArgs& a) override;
};

}  // namespace strata::kernels::cuda
