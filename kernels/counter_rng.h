// A counter-based uniform: value i of stream `key` depends on the two alone, so any split of the
// work (threads, GPU blocks, a recomputed forward) draws the same numbers. SplitMix64's output
// function over the counter; the same code on the host and, compiled by nvcc, on the device.
// Weight init (src/model/init_normal.h) and LoRA's dropout masks (Ops::dropout) draw from it.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define STRATA_HOST_DEVICE inline
#endif

namespace strata::kernels {

inline constexpr uint64_t kSplitMixGamma = 0x9e3779b97f4a7c15ull;  // SplitMix64's increment

STRATA_HOST_DEVICE uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform value i of stream `key` in [0, 1) on a 2^-24 grid: the top 24 bits of SplitMix64
// output i (exact in float).
STRATA_HOST_DEVICE float counter_uniform(uint64_t key, int64_t i) {
  return static_cast<float>(splitmix64_mix(key + (static_cast<uint64_t>(i) + 1) * kSplitMixGamma) >> 40) * 5.9604645e-8f;
}

}  // namespace strata::kernels
