// Internals of the CPU attention kernels that tests and benches reach past cpu_ops.h: which
// instruction-set path runs (AVX-512 or AVX2 where the CPU has it, else portable loops), so
// every path can be checked on one machine.
#pragma once

namespace strata::kernels::cpu {

// portable: baseline x86-64/any-ISA loops; avx2: the same loops compiled for AVX2+FMA;
// avx512: hand-written AVX-512 micro-kernels; best: the widest this CPU has.
enum class AttentionIsa { best, portable, avx2, avx512 };
bool attention_isa_available(AttentionIsa isa);
// Selects the path for later calls (not while an attention op runs); default best. Throws
// std::invalid_argument when this CPU lacks it.
void set_attention_isa(AttentionIsa isa);
// The path calls take now (never `best`).
AttentionIsa attention_isa();

// Backward schedule: fused (one task per (batch, kv head), 5 block matmuls per block pair) or
// split (dK/dV per key block, then dQ per query block: 7 matmuls, seq/64 times more tasks).
// automatic picks split when batch·n_kv_heads < 2·num_threads() or the fused schedule's dQ
// accumulator (n_heads/n_kv_heads · seq · head_dim fp32) would pass 32 MiB. Both are deterministic.
enum class AttentionSchedule { automatic, fused, split };
void set_attention_backward_schedule(AttentionSchedule s);

}  // namespace strata::kernels::cpu
