// CPU fused softmax + cross-entropy over a chunk of rows: losses and dlogits in one call, in
// place when dlogits aliases logits. Built for large vocabularies (GPT-2's 50,257): each row is
// read from memory once (statistics and one exp per logit); a second sweep, from cache, writes
// dlogits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

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

// The same, overwriting v[i] with e^(v[i] - shift) for reuse by the gradient pass.
STRATA_INLINE float chunk_sum_exp_inplace(float* v, int64_t n, float shift) {
  float s[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float e = fast_exp(v[i + j] - shift);
      v[i + j] = e;
      s[j] += e;
    }
  float r = 0.f;
  for (; i < n; ++i) {
    const float e = fast_exp(v[i] - shift);
    v[i] = e;
    r += e;
  }
  for (int j = 0; j < kLanes; ++j) r += s[j];
  return r;
}

struct CeScratch;  // thread_scratch tag: one fp32 row per worker for bf16/fp16 dlogits

// One row. Memory passes (what reaches DRAM: the row is read once and dlogits written once):
//  1. chunk by chunk (L1-sized): read the chunk from memory (fp32 logits are used where they
//     are; bf16/fp16 are converted into an fp32 row buffer), take its max, then over the same
//     chunk from L1 sum e^(x - m) with m the running max, the (max, sum) pair rescaled when a
//     chunk raises it (online softmax). When dlogits is wanted, each e^(x - m) is also written
//     back (into dlogits itself for fp32 — the logits are dead once read, even in place — or
//     into the row buffer), with the chunk's m remembered.
//  2. if dlogits is wanted: one sweep over those exps (≤ 200 KiB for 50,257: still in L2)
//     writing grad_scale · (e^(x - m_chunk) · e^(m_chunk - max) / sum - onehot(target)).
// So one exp per logit and no re-read of the logits; the bf16/fp16 row buffer is per worker
// thread and grows once, not per call.
template <class E>
STRATA_INLINE void ce_row(const typename E::T* x, int64_t vocab, int32_t target, float grad_scale,
                          float* loss, typename E::T* dx) {
  using T = typename E::T;
  constexpr bool kF32 = std::is_same_v<T, float>;
  if (target < 0) {  // ignored row: no loss, no gradient
    if (loss) *loss = 0.f;
    if (dx)
      for (int64_t c = 0; c < vocab; ++c) dx[c] = E::store(0.f);
    return;
  }
  const float x_target = E::load(x[target]);  // read before an in-place dlogits overwrites it
  float* ebuf = nullptr;  // (vocab) fp32: e^(x - chunk_shift[k]) when dlogits is wanted
  if (dx) {
    if constexpr (kF32) ebuf = dx;
    else ebuf = thread_scratch<CeScratch>(static_cast<size_t>(vocab));
  }
  // With ebuf, chunks of at least kChunk logits, at most kMaxChunks of them (their shifts live
  // on the stack); without, kChunk-sized chunks through `buf`.
  constexpr int64_t kMaxChunks = 256;
  const int64_t chunk =
      ebuf ? std::max(kChunk, ((vocab + kMaxChunks - 1) / kMaxChunks + kLanes - 1) / kLanes * kLanes) : kChunk;
  float chunk_shift[kMaxChunks];
  alignas(64) float buf[kChunk];  // fp32 copy of one bf16/fp16 chunk when only the loss is wanted
  float row_max = -INFINITY, sum = 0.f;
  for (int64_t c0 = 0, k = 0; c0 < vocab; c0 += chunk, ++k) {
    const int64_t n = std::min(chunk, vocab - c0);
    float* v = ebuf ? ebuf + c0 : buf;  // where this chunk's fp32 values (then exps) go
    const float* src = v;
    if constexpr (kF32) {
      src = x + c0;
    } else {
      for (int64_t i = 0; i < n; ++i) v[i] = E::load(x[c0 + i]);
    }
    const float new_max = std::max(row_max, chunk_max(src, n));
    float chunk_sum;
    if (ebuf) {
      // fp32 into a separate dlogits: copy the chunk there (L1), then exponentiate it in place.
      if (src != v) std::memcpy(v, src, static_cast<size_t>(n) * sizeof(float));
      chunk_sum = chunk_sum_exp_inplace(v, n, new_max);
      chunk_shift[k] = new_max;
    } else {
      chunk_sum = chunk_sum_exp(src, n, new_max);
    }
    sum = sum * fast_exp(row_max - new_max) + chunk_sum;
    row_max = new_max;
  }
  const float log_sum = std::log(sum);
  // loss = logsumexp - x[target] = (max - x[target]) + log(sum): exact subtraction first, so
  // large logits (~1e4, where fp32 spacing is 1e-3) keep the loss accurate.
  if (loss) *loss = (row_max - x_target) + log_sum;
  if (!dx) return;
  for (int64_t c0 = 0, k = 0; c0 < vocab; c0 += chunk, ++k) {
    const int64_t n = std::min(chunk, vocab - c0);
    const float f = fast_exp(chunk_shift[k] - row_max) * (grad_scale / sum);
    float* e = ebuf + c0;
    if constexpr (kF32) {
      for (int64_t i = 0; i < n; ++i) e[i] *= f;  // ebuf is dlogits: scale in place
    } else {
      T* d = dx + c0;
      for (int64_t i = 0; i < n; ++i) d[i] = E::store(e[i] * f);
    }
  }
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

template <class E>
void cross_entropy_impl(const CrossEntropyArgs& a) {
  // The row loop compiled for the baseline ISA and for AVX-512 (picked at run time), where the
  // 16-lane chunk loops become single zmm operations.
  parallel_simd(a.rows, std::max<int64_t>(1, 8192 / a.vocab),
                [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY { ce_rows<E>(a, lo, hi); });
}

#undef STRATA_INLINE

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
