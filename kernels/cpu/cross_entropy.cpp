// CPU fused softmax + cross-entropy over a chunk of rows: losses and dlogits in one call, in
// place when dlogits aliases logits. Built for large vocabularies (GPT-2's 50,257): each row is
// read from memory once (statistics and one exp per logit); a second sweep, from cache, writes
// dlogits. Also its vocabulary-parallel form (stats per shard, then finish from all shards'
// stats), with the same chunk loops and exp, so one shard agrees with the fused op.
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

// Logits [c0, c0 + n) of a row as fp32: fp32 logits where they are, bf16/fp16 converted into buf.
template <class E>
STRATA_INLINE const float* chunk_f32(const typename E::T* x, int64_t c0, int64_t n, float* buf) {
  if constexpr (std::is_same_v<typename E::T, float>) {
    return x + c0;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = E::load(x[c0 + i]);
    return buf;
  }
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
    const float* src = chunk_f32<E>(x, c0, n, v);
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

// ---- vocabulary-parallel: stats per shard, finish from every shard's stats --------------------

// One row's shard statistics: (max, Σ e^(x - max), target's logit or 0), by the same chunked
// online sweep as ce_row's forward-only path (so a single shard's max and sum are cross_entropy's).
template <class E>
STRATA_INLINE void ce_stats_row(const typename E::T* x, int64_t vocab, int64_t local_target, float* stats) {
  alignas(64) float buf[kChunk];  // fp32 copy of one bf16/fp16 chunk
  float row_max = -INFINITY, sum = 0.f;
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const float* src = chunk_f32<E>(x, c0, n, buf);
    const float new_max = std::max(row_max, chunk_max(src, n));
    sum = sum * fast_exp(row_max - new_max) + chunk_sum_exp(src, n, new_max);
    row_max = new_max;
  }
  stats[0] = row_max;
  stats[1] = sum;
  stats[2] = local_target >= 0 && local_target < vocab ? E::load(x[local_target]) : 0.f;
}

template <class E>
void cross_entropy_stats_impl(const CrossEntropyStatsArgs& a) {
  using T = typename E::T;
  const int64_t ld = a.ld ? a.ld : a.vocab;
  const T* logits = static_cast<const T*>(a.logits);  // (rows, vocab), row stride ld
  parallel_simd(a.rows, std::max<int64_t>(1, 8192 / a.vocab), [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t r = lo; r < hi; ++r) {
      float* st = a.stats + 3 * r;  // (3)
      if (a.targets[r] < 0) {  // ignored row
        st[0] = st[1] = st[2] = 0.f;
        continue;
      }
      ce_stats_row<E>(logits + r * ld, a.vocab, a.targets[r] - a.vocab_start, st);
    }
  });
}

// M, S and the target's logit t of row r from every shard's stats, in shard order: the same on
// every rank.
struct RowStats {
  float max, sum, target_logit;
};
STRATA_INLINE RowStats combine_stats(const float* all_stats, int parts, int64_t rows, int64_t r) {
  float m = -INFINITY;
  for (int p = 0; p < parts; ++p) m = std::max(m, all_stats[(p * rows + r) * 3]);
  float s = 0.f, t = 0.f;
  for (int p = 0; p < parts; ++p) {
    const float* st = all_stats + (p * rows + r) * 3;  // (3) of shard p
    s += st[1] * fast_exp(st[0] - m);
    t += st[2];
  }
  return {m, s, t};
}

template <class E>
void cross_entropy_finish_impl(const CrossEntropyFinishArgs& a) {
  using T = typename E::T;
  const int64_t ld = a.ld ? a.ld : a.vocab, vocab = a.vocab;
  const T* logits = static_cast<const T*>(a.logits);  // (rows, vocab), row stride ld, or null
  T* dlogits = static_cast<T*>(a.dlogits);            // same layout, or null
  parallel_simd(a.rows, std::max<int64_t>(1, 8192 / vocab), [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t r = lo; r < hi; ++r) {
      T* dx = dlogits ? dlogits + r * ld : nullptr;
      if (a.targets[r] < 0) {  // ignored row: no loss, no gradient
        if (a.losses) a.losses[r] = 0.f;
        if (dx)
          for (int64_t c = 0; c < vocab; ++c) dx[c] = E::store(0.f);
        continue;
      }
      const RowStats rs = combine_stats(a.all_stats, a.parts, a.rows, r);
      const float log_sum = std::log(rs.sum);
      // (max - x[target]) + log(sum), as cross_entropy: exact subtraction first.
      if (a.losses) a.losses[r] = (rs.max - rs.target_logit) + log_sum;
      if (!dx) continue;
      const T* x = logits + r * ld;  // read, then overwritten element by element when in place
      const float f = a.grad_scale / rs.sum;
      for (int64_t c = 0; c < vocab; ++c) dx[c] = E::store(fast_exp(E::load(x[c]) - rs.max) * f);
      const int64_t local_target = a.targets[r] - a.vocab_start;
      if (local_target >= 0 && local_target < vocab)
        dx[local_target] = E::store((fast_exp((rs.target_logit - rs.max) - log_sum) - 1.f) * a.grad_scale);
    }
  });
}

#undef STRATA_INLINE

// Every target is -1 (ignored) or a class in [0, n_classes); thrown before anything is written.
void check_targets(const char* op, const int32_t* targets, int64_t rows, int64_t n_classes) {
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] < -1 || targets[r] >= n_classes) {
      throw std::out_of_range(std::string(op) + ": row " + std::to_string(r) + " has target " +
                              std::to_string(targets[r]) + " outside [0, " + std::to_string(n_classes) +
                              ") (-1 = ignored)");
    }
  }
}

}  // namespace

void cross_entropy(const CrossEntropyArgs& a) {
  check_targets("cross_entropy", a.targets, a.rows, a.vocab);
  dispatch_dtype(a.dtype, [&](auto e) { cross_entropy_impl<decltype(e)>(a); });
}

void cross_entropy_stats(const CrossEntropyStatsArgs& a) {
  check_targets("cross_entropy_stats", a.targets, a.rows, a.full_vocab);
  dispatch_dtype(a.dtype, [&](auto e) { cross_entropy_stats_impl<decltype(e)>(a); });
}

void cross_entropy_finish(const CrossEntropyFinishArgs& a) {
  check_targets("cross_entropy_finish", a.targets, a.rows, a.full_vocab);
  dispatch_dtype(a.dtype, [&](auto e) { cross_entropy_finish_impl<decltype(e)>(a); });
}

}  // namespace strata::kernels::cpu
