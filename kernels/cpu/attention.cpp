// Causal scaled-dot-product attention with grouped-query heads on the CPU: a flash-style forward
// (64×64 blocks, online softmax, never seq × seq) and a FlashAttention-2 backward that recomputes
// the probabilities from the saved log-sum-exp. Tiles are converted to fp32 in per-thread scratch.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"

namespace strata::kernels::cpu {
namespace {

// Queries per block = keys per block, so the causal diagonal of a query block is one key block.
constexpr int64_t kBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::atomic<AttentionIsa> g_isa{AttentionIsa::best};

bool cpu_has(AttentionIsa isa) {
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  switch (isa) {
    case AttentionIsa::avx512: return avx512;
    case AttentionIsa::avx2: return avx2;
    case AttentionIsa::portable: return true;
    case AttentionIsa::best: return true;
  }
  return false;
}

// One call's shape, shared by forward and backward. Strides are in elements between tokens.
struct Geometry {
  DType dtype = DType::f32;
  int64_t batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int64_t group = 0;     // query heads per kv head
  int64_t n_blocks = 0;  // ceil(seq / kBlock)
  int64_t q_stride = 0, k_stride = 0, v_stride = 0, o_stride = 0;
  float scale = 0.f;

  template <class A>
  explicit Geometry(const A& a)
      : dtype(a.dtype), batch(a.batch), seq(a.seq), n_heads(a.n_heads), n_kv_heads(a.n_kv_heads),
        head_dim(a.head_dim), group(a.n_heads / a.n_kv_heads), n_blocks((a.seq + kBlock - 1) / kBlock),
        q_stride(a.q_stride ? a.q_stride : a.n_heads * a.head_dim),
        k_stride(a.k_stride ? a.k_stride : a.n_kv_heads * a.head_dim),
        v_stride(a.v_stride ? a.v_stride : a.n_kv_heads * a.head_dim), o_stride(a.n_heads * a.head_dim),
        scale(a.scale > 0.f ? a.scale : 1.f / std::sqrt(static_cast<float>(a.head_dim))) {}

  // Element offsets of token t of batch b, head h.
  int64_t q_at(int64_t b, int64_t t, int64_t h) const { return (b * seq + t) * q_stride + h * head_dim; }
  int64_t k_at(int64_t b, int64_t t, int64_t h) const { return (b * seq + t) * k_stride + h * head_dim; }
  int64_t v_at(int64_t b, int64_t t, int64_t h) const { return (b * seq + t) * v_stride + h * head_dim; }
  int64_t o_at(int64_t b, int64_t t, int64_t h) const { return (b * seq + t) * o_stride + h * head_dim; }
  int64_t lse_at(int64_t b, int64_t h, int64_t t) const { return (b * n_heads + h) * seq + t; }
};

// Per-thread fp32 scratch, grown on first use and kept for the thread's life (TBB workers and
// stream workers live as long as the process), so steady-state calls allocate nothing.
float* thread_scratch(size_t n_floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < n_floats + 16) buf.resize(n_floats + 16);
  auto p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});  // 64-byte aligned
}
// Carves 64-byte-aligned slices out of one scratch block.
class Carver {
 public:
  static size_t padded(int64_t n) { return (static_cast<size_t>(n) + 15) & ~size_t{15}; }
  explicit Carver(float* base) : p_(base) {}
  float* take(int64_t n) {
    float* r = p_;
    p_ += padded(n);
    return r;
  }
 private:
  float* p_;
};

// ---- dtype <-> fp32 tiles ---------------------------------------------------------------------

// dst (n, d) with row stride ld_dst = mul · src rows (n, d) starting at element `off`, row stride
// `stride`.
void load_rows(const void* src, DType t, int64_t off, int64_t stride, int64_t n, int64_t d, float* dst,
               int64_t ld_dst, float mul) {
  for (int64_t r = 0; r < n; ++r) {
    float* out = dst + r * ld_dst;
    const int64_t base = off + r * stride;
    switch (t) {
      case DType::f32: {
        const float* in = static_cast<const float*>(src) + base;
        for (int64_t c = 0; c < d; ++c) out[c] = mul * in[c];
        break;
      }
      case DType::bf16: {
        const uint16_t* in = static_cast<const uint16_t*>(src) + base;
        for (int64_t c = 0; c < d; ++c) out[c] = mul * bf16_to_f32(in[c]);
        break;
      }
      case DType::f16: {
        const uint16_t* in = static_cast<const uint16_t*>(src) + base;
        for (int64_t c = 0; c < d; ++c) out[c] = mul * f16_to_f32(in[c]);
        break;
      }
    }
  }
}

// dst (d, kBlock) = transpose of src rows (n, d), columns n..kBlock zero.
void load_transposed(const void* src, DType t, int64_t off, int64_t stride, int64_t n, int64_t d, float* dst) {
  if (n < kBlock)
    for (int64_t c = 0; c < d; ++c) std::fill(dst + c * kBlock + n, dst + (c + 1) * kBlock, 0.f);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t base = off + r * stride;
    for (int64_t c = 0; c < d; ++c) dst[c * kBlock + r] = load_as_f32(src, t, static_cast<size_t>(base + c));
  }
}

// dst rows (n, d) starting at element `off`, row stride `stride` = mul · src (n, d), row stride d.
void store_rows(void* dst, DType t, int64_t off, int64_t stride, int64_t n, int64_t d, const float* src, float mul) {
  for (int64_t r = 0; r < n; ++r) {
    const float* in = src + r * d;
    const int64_t base = off + r * stride;
    switch (t) {
      case DType::f32: {
        float* out = static_cast<float*>(dst) + base;
        for (int64_t c = 0; c < d; ++c) out[c] = mul * in[c];
        break;
      }
      case DType::bf16: {
        uint16_t* out = static_cast<uint16_t*>(dst) + base;
        for (int64_t c = 0; c < d; ++c) out[c] = f32_to_bf16(mul * in[c]);
        break;
      }
      case DType::f16: {
        uint16_t* out = static_cast<uint16_t*>(dst) + base;
        for (int64_t c = 0; c < d; ++c) out[c] = f32_to_f16(mul * in[c]);
        break;
      }
    }
  }
}

// ---- the math both paths share (inlined into each path so it is compiled for its ISA) ----------

// e^x to ~2 ulp, 0 below e^-87 (and for -inf); x <= 0 in every use here. Branch-free so that a
// loop over it vectorises: 2^(x·log2 e) = 2^n · 2^f, n = round(x·log2 e), |f| <= 1/2.
[[gnu::always_inline]] inline float fast_exp(float x) {
  float t = x * 1.44269504f;
  const bool underflow = t < -126.f;
  t = t < -126.f ? -126.f : t;
  t = t > 126.f ? 126.f : t;
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  const float f = t - n;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  const float pow2n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.f : p * pow2n;
}

// Max and sum of a kBlock row in 16 independent lanes (vectorises without reassociation).
[[gnu::always_inline]] inline float block_max(const float* x) {
  float lane[16];
  for (int l = 0; l < 16; ++l) lane[l] = x[l];
  for (int64_t j = 16; j < kBlock; j += 16)
    for (int l = 0; l < 16; ++l) lane[l] = x[j + l] > lane[l] ? x[j + l] : lane[l];
  float m = lane[0];
  for (int l = 1; l < 16; ++l) m = lane[l] > m ? lane[l] : m;
  return m;
}
[[gnu::always_inline]] inline float block_sum(const float* x) {
  float lane[16] = {};
  for (int64_t j = 0; j < kBlock; j += 16)
    for (int l = 0; l < 16; ++l) lane[l] += x[j + l];
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += lane[l];
  return s;
}
// Σ_c a[c]·b[c] over n, in 16 lanes plus a scalar tail.
[[gnu::always_inline]] inline float dot(const float* a, const float* b, int64_t n) {
  float lane[16] = {};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    for (int l = 0; l < 16; ++l) lane[l] += a[c + l] * b[c + l];
  float s = 0.f;
  for (; c < n; ++c) s += a[c] * b[c];
  for (int l = 0; l < 16; ++l) s += lane[l];
  return s;
}

// dst (kBlock, n) = transpose of src (n, kBlock): row j of dst holds column j of src.
[[gnu::always_inline]] inline void transpose_block(const float* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < kBlock; ++j) dst[j * kBlock + i] = src[i * kBlock + j];
}

// Portable GEMM: C (m, n) (+)= A (m, k) · B (k, n), row strides lda, ldb, ldc. Panels of R rows ×
// 16 columns of C stay in registers across the k loop (the compiler vectorises the 16 lanes at
// whatever width the enclosing function's ISA has); leftover columns take a plain axpy loop.
template <int R>
[[gnu::always_inline]] inline void mm_panel_portable(float* c, int64_t ldc, const float* a, int64_t lda,
                                                     const float* b, int64_t ldb, int64_t k, bool accumulate) {
  float acc[R][16];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 16; ++l) acc[r][l] = accumulate ? c[r * ldc + l] : 0.f;
  for (int64_t p = 0; p < k; ++p) {
    const float* bp = b + p * ldb;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float ap = a[r * lda + p];
      for (int l = 0; l < 16; ++l) acc[r][l] += ap * bp[l];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 16; ++l) c[r * ldc + l] = acc[r][l];
}

template <int R>
struct PortableKernels {
  [[gnu::always_inline]] static inline void matmul(float* c, int64_t ldc, const float* a, int64_t lda, const float* b,
                                                   int64_t ldb, int64_t m, int64_t k, int64_t n, bool accumulate) {
    const int64_t n16 = n & ~int64_t{15};
    for (int64_t j0 = 0; j0 < n16; j0 += 16) {
      int64_t i = 0;
      for (; i + R <= m; i += R) mm_panel_portable<R>(c + i * ldc + j0, ldc, a + i * lda, lda, b + j0, ldb, k, accumulate);
      for (; i < m; ++i) mm_panel_portable<1>(c + i * ldc + j0, ldc, a + i * lda, lda, b + j0, ldb, k, accumulate);
    }
    if (n16 == n) return;
    for (int64_t i = 0; i < m; ++i) {
      float* ci = c + i * ldc;
      if (!accumulate) std::fill(ci + n16, ci + n, 0.f);
      for (int64_t p = 0; p < k; ++p) {
        const float ap = a[i * lda + p];
        const float* bp = b + p * ldb;
        for (int64_t j = n16; j < n; ++j) ci[j] += ap * bp[j];
      }
    }
  }
};

#define STRATA_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")))
#define STRATA_AVX2 __attribute__((target("avx2,fma,f16c")))

// AVX-512 micro-kernel: R rows × up to 64 columns of C held in registers across the k loop.
template <int R>
STRATA_AVX512 inline void mm_panel_avx512(float* c, int64_t ldc, const float* a, int64_t lda, const float* b,
                                          int64_t ldb, int64_t k, int64_t cols, bool accumulate) {
  __mmask16 mask[4];
  for (int v = 0; v < 4; ++v) {
    const int64_t left = cols - 16 * v;
    mask[v] = left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1u);
  }
  __m512 acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(mask[v], c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const float* bp = b + p * ldb;
    __m512 bv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) bv[v] = _mm512_maskz_loadu_ps(mask[v], bp + 16 * v);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + p]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(c + r * ldc + 16 * v, mask[v], acc[r][v]);
}

struct Avx512Kernels {
  STRATA_AVX512 static inline void matmul(float* c, int64_t ldc, const float* a, int64_t lda, const float* b,
                                          int64_t ldb, int64_t m, int64_t k, int64_t n, bool accumulate) {
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
      const int64_t cols = std::min<int64_t>(64, n - j0);
      int64_t i = 0;
      for (; i + 4 <= m; i += 4)
        mm_panel_avx512<4>(c + i * ldc + j0, ldc, a + i * lda, lda, b + j0, ldb, k, cols, accumulate);
      for (; i < m; ++i) mm_panel_avx512<1>(c + i * ldc + j0, ldc, a + i * lda, lda, b + j0, ldb, k, cols, accumulate);
    }
  }
};

// ---- forward ----------------------------------------------------------------------------------

// One (batch, head, query block): online softmax over the key blocks 0..qb (causal).
template <class K>
[[gnu::always_inline]] inline void forward_item(const AttentionArgs& args, const Geometry& g, int64_t b, int64_t h,
                                                int64_t qb) {
  const int64_t d = g.head_dim, kvh = h / g.group;
  const int64_t q0 = qb * kBlock, nq = std::min(kBlock, g.seq - q0);
  Carver carve(thread_scratch(4 * Carver::padded(kBlock * d) + Carver::padded(kBlock * kBlock) +
                              2 * Carver::padded(kBlock)));
  float* q = carve.take(kBlock * d);         // (nq, d), pre-scaled
  float* o = carve.take(kBlock * d);         // (nq, d) unnormalised accumulator
  float* v = carve.take(kBlock * d);         // (nk, d)
  float* kt = carve.take(d * kBlock);        // (d, kBlock) keys transposed, zero-padded
  float* s = carve.take(kBlock * kBlock);    // (nq, kBlock) scores, then probabilities
  float* row_max = carve.take(kBlock);       // (nq) running max of scaled scores
  float* row_sum = carve.take(kBlock);       // (nq) running Σ exp(score - max)

  load_rows(args.q, g.dtype, g.q_at(b, q0, h), g.q_stride, nq, d, q, d, g.scale);
  std::fill(o, o + nq * d, 0.f);
  std::fill(row_max, row_max + nq, kNegInf);
  std::fill(row_sum, row_sum + nq, 0.f);

  for (int64_t kb = 0; kb <= qb; ++kb) {
    const int64_t k0 = kb * kBlock, nk = std::min(kBlock, g.seq - k0);
    load_transposed(args.k, g.dtype, g.k_at(b, k0, kvh), g.k_stride, nk, d, kt);
    load_rows(args.v, g.dtype, g.v_at(b, k0, kvh), g.v_stride, nk, d, v, d, 1.f);
    K::matmul(s, kBlock, q, d, kt, kBlock, nq, d, kBlock, false);  // S = (scale·Q)·Kᵀ
    for (int64_t i = 0; i < nq; ++i) {
      float* row = s + i * kBlock;
      const int64_t valid = kb == qb ? std::min(nk, i + 1) : nk;  // keys j <= query i
      for (int64_t j = valid; j < kBlock; ++j) row[j] = kNegInf;
      const float m_new = std::max(row_max[i], block_max(row));
      for (int64_t j = 0; j < kBlock; ++j) row[j] = fast_exp(row[j] - m_new);
      const float alpha = fast_exp(row_max[i] - m_new);  // 0 on the first block (max was -inf)
      row_sum[i] = row_sum[i] * alpha + block_sum(row);
      row_max[i] = m_new;
      if (alpha != 1.f) {
        float* oi = o + i * d;
        for (int64_t c = 0; c < d; ++c) oi[c] *= alpha;
      }
    }
    K::matmul(o, d, s, kBlock, v, d, nq, nk, d, true);  // O += P·V
  }
  for (int64_t i = 0; i < nq; ++i) {
    const float inv = 1.f / row_sum[i];
    float* oi = o + i * d;
    for (int64_t c = 0; c < d; ++c) oi[c] *= inv;
    args.lse[g.lse_at(b, h, q0 + i)] = row_max[i] + std::log(row_sum[i]);
  }
  store_rows(args.out, g.dtype, g.o_at(b, q0, h), g.o_stride, nq, d, o, 1.f);
}

// Items [lo, hi) of (batch, head, query block), query block fastest.
template <class K>
[[gnu::always_inline]] inline void forward_items(const AttentionArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  for (int64_t item = lo; item < hi; ++item) {
    const int64_t qb = item % g.n_blocks, bh = item / g.n_blocks;
    forward_item<K>(args, g, bh / g.n_heads, bh % g.n_heads, qb);
  }
}
void forward_items_portable(const AttentionArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  forward_items<PortableKernels<2>>(args, g, lo, hi);
}
STRATA_AVX2 void forward_items_avx2(const AttentionArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  forward_items<PortableKernels<4>>(args, g, lo, hi);
}
STRATA_AVX512 void forward_items_avx512(const AttentionArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  forward_items<Avx512Kernels>(args, g, lo, hi);
}

// ---- backward ---------------------------------------------------------------------------------

// One (batch, kv head): owns dK, dV of that kv head and dQ of its `group` query heads, so no two
// tasks write the same element and the summation order is fixed (deterministic).
template <class K>
[[gnu::always_inline]] inline void backward_item(const AttentionBackwardArgs& args, const Geometry& g, int64_t b,
                                                 int64_t kvh) {
  const int64_t d = g.head_dim, T = g.seq, G = g.group, h0 = kvh * G;
  const int64_t tile = kBlock * d, sq = kBlock * kBlock;
  Carver carve(thread_scratch(3 * Carver::padded(G * T * d) + Carver::padded(G * T) + 6 * Carver::padded(tile) +
                              4 * Carver::padded(sq)));
  float* qs = carve.take(G * T * d);   // (G, T, d) scale·Q of the group's query heads
  float* dout = carve.take(G * T * d);  // (G, T, d)
  float* dq = carve.take(G * T * d);   // (G, T, d) Σ dS·K (times scale when stored)
  float* delta = carve.take(G * T);    // (G, T) rowsum(dO ∘ O)
  float* kr = carve.take(tile);        // (nk, d) keys
  float* kt = carve.take(d * kBlock);  // (d, kBlock) keys transposed, zero-padded
  float* vt = carve.take(d * kBlock);  // (d, kBlock) values transposed, zero-padded
  float* dk = carve.take(tile);        // (nk, d) accumulators for this key block
  float* dv = carve.take(tile);        // (nk, d)
  float* ot = carve.take(tile);        // (nq, d) output tile, for delta
  float* p = carve.take(sq);           // (nq, kBlock) probabilities
  float* ds = carve.take(sq);          // (nq, kBlock) dP, then dS
  float* pt = carve.take(sq);          // (kBlock, nq) Pᵀ
  float* dst = carve.take(sq);         // (kBlock, nq) dSᵀ

  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t h = h0 + gi;
    load_rows(args.q, g.dtype, g.q_at(b, 0, h), g.q_stride, T, d, qs + gi * T * d, d, g.scale);
    load_rows(args.dout, g.dtype, g.o_at(b, 0, h), g.o_stride, T, d, dout + gi * T * d, d, 1.f);
    for (int64_t t0 = 0; t0 < T; t0 += kBlock) {
      const int64_t n = std::min(kBlock, T - t0);
      load_rows(args.out, g.dtype, g.o_at(b, t0, h), g.o_stride, n, d, ot, d, 1.f);
      for (int64_t i = 0; i < n; ++i) delta[gi * T + t0 + i] = dot(ot + i * d, dout + (gi * T + t0 + i) * d, d);
    }
  }
  std::fill(dq, dq + G * T * d, 0.f);

  for (int64_t kb = 0; kb < g.n_blocks; ++kb) {
    const int64_t k0 = kb * kBlock, nk = std::min(kBlock, T - k0);
    load_rows(args.k, g.dtype, g.k_at(b, k0, kvh), g.k_stride, nk, d, kr, d, 1.f);
    load_transposed(args.k, g.dtype, g.k_at(b, k0, kvh), g.k_stride, nk, d, kt);
    load_transposed(args.v, g.dtype, g.v_at(b, k0, kvh), g.v_stride, nk, d, vt);
    std::fill(dk, dk + nk * d, 0.f);
    std::fill(dv, dv + nk * d, 0.f);
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t h = h0 + gi;
      for (int64_t qb = kb; qb < g.n_blocks; ++qb) {
        const int64_t q0 = qb * kBlock, nq = std::min(kBlock, T - q0);
        const float* qi = qs + (gi * T + q0) * d;
        const float* doi = dout + (gi * T + q0) * d;
        const float* lse = args.lse + g.lse_at(b, h, q0);
        const float* di = delta + gi * T + q0;
        K::matmul(p, kBlock, qi, d, kt, kBlock, nq, d, kBlock, false);   // S = (scale·Q)·Kᵀ
        K::matmul(ds, kBlock, doi, d, vt, kBlock, nq, d, kBlock, false);  // dP = dO·Vᵀ
        for (int64_t i = 0; i < nq; ++i) {
          float* pr = p + i * kBlock;
          float* dr = ds + i * kBlock;
          const int64_t valid = qb == kb ? std::min(nk, i + 1) : nk;
          for (int64_t j = valid; j < kBlock; ++j) pr[j] = kNegInf;
          const float l = lse[i], di_i = di[i];
          for (int64_t j = 0; j < kBlock; ++j) {
            pr[j] = fast_exp(pr[j] - l);      // P = exp(S - lse), 0 where masked
            dr[j] = pr[j] * (dr[j] - di_i);  // dS = P ∘ (dP - D)
          }
        }
        transpose_block(p, nq, pt);
        transpose_block(ds, nq, dst);
        K::matmul(dv, d, pt, kBlock, doi, d, nk, nq, d, true);                  // dV += Pᵀ·dO
        K::matmul(dk, d, dst, kBlock, qi, d, nk, nq, d, true);                  // dK += dSᵀ·(scale·Q)
        K::matmul(dq + (gi * T + q0) * d, d, ds, kBlock, kr, d, nq, nk, d, true);  // dQ += dS·K
      }
    }
    store_rows(args.dk, g.dtype, g.k_at(b, k0, kvh), g.k_stride, nk, d, dk, 1.f);
    store_rows(args.dv, g.dtype, g.v_at(b, k0, kvh), g.v_stride, nk, d, dv, 1.f);
  }
  for (int64_t gi = 0; gi < G; ++gi)
    store_rows(args.dq, g.dtype, g.q_at(b, 0, h0 + gi), g.q_stride, T, d, dq + gi * T * d, g.scale);
}

template <class K>
[[gnu::always_inline]] inline void backward_items(const AttentionBackwardArgs& args, const Geometry& g, int64_t lo,
                                                  int64_t hi) {
  for (int64_t item = lo; item < hi; ++item) backward_item<K>(args, g, item / g.n_kv_heads, item % g.n_kv_heads);
}
void backward_items_portable(const AttentionBackwardArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  backward_items<PortableKernels<2>>(args, g, lo, hi);
}
STRATA_AVX2 void backward_items_avx2(const AttentionBackwardArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  backward_items<PortableKernels<4>>(args, g, lo, hi);
}
STRATA_AVX512 void backward_items_avx512(const AttentionBackwardArgs& args, const Geometry& g, int64_t lo,
                                         int64_t hi) {
  backward_items<Avx512Kernels>(args, g, lo, hi);
}

}  // namespace

void set_attention_isa(AttentionIsa isa) {
  if (!cpu_has(isa)) throw std::invalid_argument("set_attention_isa: this CPU lacks the requested instruction set");
  g_isa.store(isa);
}
AttentionIsa attention_isa() {
  const AttentionIsa isa = g_isa.load();
  if (isa != AttentionIsa::best) return isa;
  if (cpu_has(AttentionIsa::avx512)) return AttentionIsa::avx512;
  if (cpu_has(AttentionIsa::avx2)) return AttentionIsa::avx2;
  return AttentionIsa::portable;
}
bool attention_isa_available(AttentionIsa isa) { return cpu_has(isa); }

void attention(const AttentionArgs& a) {
  validate(a);
  const Geometry g(a);
  const AttentionIsa isa = attention_isa();
  // (batch, head, query block) items; static partitioning gives each thread a contiguous run that
  // spans many heads, so the causal imbalance between early and late query blocks evens out.
  parallel_for(0, g.batch * g.n_heads * g.n_blocks, 1, [&](int64_t lo, int64_t hi) {
    switch (isa) {
      case AttentionIsa::avx512: forward_items_avx512(a, g, lo, hi); break;
      case AttentionIsa::avx2: forward_items_avx2(a, g, lo, hi); break;
      default: forward_items_portable(a, g, lo, hi); break;
    }
  });
}

void attention_backward(const AttentionBackwardArgs& a) {
  validate(a);
  const Geometry g(a);
  const AttentionIsa isa = attention_isa();
  parallel_for(0, g.batch * g.n_kv_heads, 1, [&](int64_t lo, int64_t hi) {
    switch (isa) {
      case AttentionIsa::avx512: backward_items_avx512(a, g, lo, hi); break;
      case AttentionIsa::avx2: backward_items_avx2(a, g, lo, hi); break;
      default: backward_items_portable(a, g, lo, hi); break;
    }
  });
}

}  // namespace strata::kernels::cpu
