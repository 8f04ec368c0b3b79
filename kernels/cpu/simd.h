// Run-time choice between the AVX-512 and the portable paths of the CPU kernels. The AVX-512
// path is used when the CPU has it; tests switch it off to check the portable path, which is
// what runs on CPUs without AVX-512.
#pragma once

namespace strata::kernels::cpu {

// True when the AVX-512 paths run (the CPU supports them and they are not disabled).
bool use_avx512();
// Disables (false) or re-enables (true, if supported) the AVX-512 paths. Not while ops run.
void set_avx512_enabled(bool enabled);

}  // namespace strata::kernels::cpu
