// TEMPORARY: ops not yet implemented on the CPU backend. Each helper removes its ops from here
// when it lands the real implementation; this file must be gone before the issue closes.
#include <stdexcept>

#include "kernels/cpu/cpu_ops.h"

namespace strata::kernels::cpu {
#define STRATA_TODO(name, Args) \
  void name(const Args&) { throw std::logic_error(#name ": not implemented on the CPU backend yet"); }
#undef STRATA_TODO
}  // namespace strata::kernels::cpu
