// TEMPORARY: ops not yet implemented on the CPU backend. Each helper removes its ops from here
// when it lands the real implementation; this file must be gone before the issue closes.
#include <stdexcept>

#include "kernels/cpu/cpu_ops.h"

namespace strata::kernels::cpu {
#define STRATA_TODO(name, Args) \
  void name(const Args&) { throw std::logic_error(#name ": not implemented on the CPU backend yet"); }
STRATA_TODO(bias_add, BiasAddArgs)
STRATA_TODO(bias_backward, BiasBackwardArgs)
STRATA_TODO(embedding, EmbeddingArgs)
STRATA_TODO(embedding_backward, EmbeddingBackwardArgs)
STRATA_TODO(rmsnorm, NormArgs)
STRATA_TODO(rmsnorm_backward, NormBackwardArgs)
STRATA_TODO(layernorm, NormArgs)
STRATA_TODO(layernorm_backward, NormBackwardArgs)
STRATA_TODO(rope, RopeArgs)
STRATA_TODO(attention, AttentionArgs)
STRATA_TODO(attention_backward, AttentionBackwardArgs)
STRATA_TODO(swiglu, SwigluArgs)
STRATA_TODO(swiglu_backward, SwigluBackwardArgs)
STRATA_TODO(gelu, GeluArgs)
STRATA_TODO(gelu_backward, GeluBackwardArgs)
STRATA_TODO(add, AddArgs)
STRATA_TODO(cross_entropy, CrossEntropyArgs)
#undef STRATA_TODO
}  // namespace strata::kernels::cpu
