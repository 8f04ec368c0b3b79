// Internals of the CPU attention kernels that tests and benches reach past cpu_ops.h: which
// instruction-set path runs (AVX-512 where the CPU has it, else the portable loops), so both
// paths can be checked on one machine.
#pragma once

namespace strata::kernels::cpu {

enum class AttentionIsa { best, portable };
// Selects the path for later calls (not while an attention op runs). Default: best.
void set_attention_isa(AttentionIsa isa);
// True when the AVX-512 path would run now.
bool attention_uses_avx512();

}  // namespace strata::kernels::cpu
