// TEMPORARY: CUDA ops not yet written. Each throws a clear error; the CUDA-op work replaces
// them one by one.
#include <stdexcept>

#include "kernels/cuda/cuda_ops.h"

namespace strata::kernels::cuda {
#define STRATA_CUDA_TODO(name, Args)                                                            \
  void CudaOps::do_##name(Stream&, const Args&) {                                               \
    throw std::runtime_error(#name ": not implemented on the CUDA backend yet (use --backend cpu)"); \
  }
STRATA_CUDA_TODO(matmul, MatmulArgs)
STRATA_CUDA_TODO(bias_add, BiasAddArgs)
STRATA_CUDA_TODO(bias_backward, BiasBackwardArgs)
STRATA_CUDA_TODO(embedding, EmbeddingArgs)
STRATA_CUDA_TODO(embedding_backward, EmbeddingBackwardArgs)
STRATA_CUDA_TODO(rmsnorm, NormArgs)
STRATA_CUDA_TODO(rmsnorm_backward, NormBackwardArgs)
STRATA_CUDA_TODO(layernorm, NormArgs)
STRATA_CUDA_TODO(layernorm_backward, NormBackwardArgs)
STRATA_CUDA_TODO(rope, RopeArgs)
STRATA_CUDA_TODO(attention, AttentionArgs)
STRATA_CUDA_TODO(attention_backward, AttentionBackwardArgs)
STRATA_CUDA_TODO(swiglu, SwigluArgs)
STRATA_CUDA_TODO(swiglu_backward, SwigluBackwardArgs)
STRATA_CUDA_TODO(gelu, GeluArgs)
STRATA_CUDA_TODO(gelu_backward, GeluBackwardArgs)
STRATA_CUDA_TODO(add, AddArgs)
STRATA_CUDA_TODO(cross_entropy, CrossEntropyArgs)
STRATA_CUDA_TODO(adamw, AdamWArgs)
STRATA_CUDA_TODO(sum_squares, SumSquaresArgs)
STRATA_CUDA_TODO(scale, ScaleArgs)
STRATA_CUDA_TODO(cast, CastArgs)
#undef STRATA_CUDA_TODO
}  // namespace strata::kernels::cuda
