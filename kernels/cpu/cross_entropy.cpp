// CPU fused softmax + cross-entropy over a chunk of rows: losses and dlogits in one call, in
// place when dlogits aliases logits. Built for large vocabularies (GPT-2's 50,257): each row is
// streamed from memory once for its statistics and once more, from cache, to write dlogits.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"

namespace strata::kernels::cpu {
namespace {

constexpr int kLanes = 16;       // independent accumulators: one zmm, two ymm or four xmm
constexpr int64_t kChunk = 2048;  // logits per chunk: 8 KiB of fp32, stays in L1

#define STRATA_INLINE inline __attribute__((always_inline))

// Max of n floats.
STRATA_INLINE float chunk_max(const float* v, int64_t n) {
  float m[kLanes];
  for (int j = 0; j < kLanes; ++j) m[j] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) m[j] = v[i + j] > m[j] ? v[i + j] : m[j];
  float r = -INFINITY;
  for (; i < n; ++i) r = v[i] > r ? v[i] : r;
  for (int j = 0; j < kLanes; ++j) r = m[j] > r ? m[j] : r;
  return r;
}

// Σ e^(v[i] - shift) over n floats.
STRATA_INLINE float chunk_sum_exp(const float* v, int64_t n, float shift) {
  float s[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) s[j] += fast_exp(v[i + j] - shift);
  float r = 0.f;
  for (; i < n; ++i) r += fast_exp(v[i] - shift);
  for (int j = 0; j < kLanes; ++j) r += s[j];
  return r;
}

// One row. Memory passes (what reaches DRAM: the row is read once and dlogits written once):
//  1. chunk by chunk (kChunk logits, L1-sized): read the chunk from memory (converting to fp32
//     into `buf` for bf16/fp16), take its max, then Σ e^(x - max) over the same chunk from L1;
//     the running (max, sum) pair is rescaled when a chunk raises the max (online softmax).
//  2. if dlogits is wanted: re-read the row (≤ 200 KiB for fp32 × 50,257: still in L2) and
//     write grad_scale · (e^(x - max) / sum - onehot(target)), in place if dlogits == logits.
template <class E>
STRATA_INLINE void ce_row(const typename E::T* x, int64_t vocab, int32_t target, float grad_scale,
                          float* loss, typename E::T* dx) {
  using T = typename E::T;
  if (target < 0) {  // ignored row: no loss, no gradient
    if (loss) *loss = 0.f;
    if (dx)
      for (int64_t c = 0; c < vocab; ++c) dx[c] = E::store(0.f);
    return;
  }
  alignas(64) float buf[kChunk];
  float row_max = -INFINITY, sum = 0.f;
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const float* v;
    if constexpr (std::is_same_v<T, float>) {
      v = x + c0;
    } else {
      for (int64_t i = 0; i < n; ++i) buf[i] = E::load(x[c0 + i]);
      v = buf;
    }
    const float new_max = std::max(row_max, chunk_max(v, n));
    sum = sum * fast_exp(row_max - new_max) + chunk_sum_exp(v, n, new_max);
    row_max = new_max;
  }
  const float x_target = E::load(x[target]);  // read before an in-place dlogits overwrites it
  const float log_sum = std::log(sum);
  // loss = logsumexp - x[target] = (max - x[target]) + log(sum): exact subtraction first, so
  // large logits (~1e4, where fp32 spacing is 1e-3) keep the loss accurate.
  if (loss) *loss = (row_max - x_target) + log_sum;
  if (!dx) return;
  const float scale = grad_scale / sum;
  for (int64_t c = 0; c < vocab; ++c) dx[c] = E::store(fast_exp(E::load(x[c]) - row_max) * scale);
  dx[target] = E::store((fast_exp((x_target - row_max) - log_sum) - 1.f) * grad_scale);
}

template <class E>
STRATA_INLINE void ce_rows(const CrossEntropyArgs& a, int64_t lo, int64_t hi) {
  using T = typename E::T;
  const int64_t ld = a.ld ? a.ld : a.vocab;
  const T* logits = static_cast<const T*>(a.logits);  // (rows, vocab), row stride ld
  T* dlogits = static_cast<T*>(a.dlogits);            // same layout, or null
  for (int64_t r = lo; r < hi; ++r) {
    ce_row<E>(logits + r * ld, a.vocab, a.targets[r], a.grad_scale, a.losses ? a.losses + r : nullptr,
              dlogits ? dlogits + r * ld : nullptr);
  }
}

// The same row loop compiled twice: for the build's baseline ISA and for AVX-512 (chosen at
// run time), where the 16-lane loops become single zmm operations.
template <class E>
void ce_rows_baseline(const CrossEntropyArgs& a, int64_t lo, int64_t hi) {
  ce_rows<E>(a, lo, hi);
}
template <class E>
__attribute__((target("avx512f,avx512bw,fma"))) void ce_rows_avx512(const CrossEntropyArgs& a, int64_t lo,
                                                                    int64_t hi) {
  ce_rows<E>(a, lo, hi);
}

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
}

template <class E>
void cross_entropy_impl(const CrossEntropyArgs& a) {
  const bool avx512 = have_avx512();
  const int64_t grain = std::max<int64_t>(1, 8192 / a.vocab);
  parallel_for(0, a.rows, grain, [&](int64_t lo, int64_t hi) {
    if (avx512) ce_rows_avx512<E>(a, lo, hi);
    else ce_rows_baseline<E>(a, lo, hi);
  });
}

}  // namespace

void cross_entropy(const CrossEntropyArgs& a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    if (a.targets[r] < -1 || a.targets[r] >= a.vocab) {
      throw std::out_of_range("cross_entropy: row " + std::to_string(r) + " has target " +
                              std::to_string(a.targets[r]) + " outside [0, " + std::to_string(a.vocab) +
                              ") (-1 = ignored)");
    }
  }
  dispatch_dtype(a.dtype, [&](auto e) { cross_entropy_impl<decltype(e)>(a); });
}

}  // namespace strata::kernels::cpu
