// Introspection of cpu::matmul's primitive cache (tests and benchmarks check that a step loop
// builds each oneDNN primitive once and then only looks it up).
#pragma once
#include <cstddef>

namespace strata::kernels::cpu {

// Number of distinct matmul problems whose oneDNN primitive has been built so far.
size_t matmul_primitives_built();

}  // namespace strata::kernels::cpu
