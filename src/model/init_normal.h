// Normal random numbers for weight initialisation: counter-based (value i of a stream depends on
// the stream's key and i alone), so any split of the work over threads gives the same values,
// and computed with +, -, *, / and sqrt only (no libm, no fused multiply-add: the file is built
// with -ffp-contract=off), so every x86-64 machine and compiler flag set gives the same bits.
#pragma once
#include <cstdint>

namespace strata {

// The stream of a (seed, parameter index) pair.
uint64_t init_stream_key(uint64_t seed, uint64_t param);

// out[k] = scale * z_{first + k} for k in [0, n): standard normal values first .. first+n-1 of
// stream `key`. Values 2j and 2j+1 are one Box-Muller pair from SplitMix64 output j (31 bits
// for the radius, so |z| reaches 6.55; 24 for the angle). Single-threaded; split large fills.
void fill_normal(uint64_t key, int64_t first, int64_t n, float scale, float* out);

// Uniform value i of stream `key` in [0, 1) on a 2^-24 grid: the top 24 bits of SplitMix64
// output i (LoRA's init and its dropout masks).
float uniform_at(uint64_t key, int64_t i);
// out[k] = bound * (2 u_{first + k} - 1), u = uniform_at(key, first + k): U(-bound, bound),
// exact in float.
void fill_uniform(uint64_t key, int64_t first, int64_t n, float bound, float* out);

}  // namespace strata
