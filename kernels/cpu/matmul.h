// Introspection of cpu::matmul's primitive cache (tests and benchmarks check that a step loop
// builds each oneDNN primitive once and then only looks it up).
#pragma once
#include <cstddef>

namespace strata::kernels::cpu {

// Number of distinct matmul problems whose oneDNN primitive has been built so far.
size_t matmul_primitives_built();

// Whether bf16 operands are widened to fp32 before oneDNN multiplies them: where oneDNN has no
// bf16 kernels for this CPU (it needs AVX-512 or AMX; an AVX2-only CPU refuses every bf16
// primitive), as fp16 always is. widen_bf16_for_tests(true) takes that path on any CPU (tests:
// the path an AVX2 machine runs, checked on one with AVX-512 too); false restores the probe's.
bool bf16_widened();
void widen_bf16_for_tests(bool on);

}  // namespace strata::kernels::cpu
