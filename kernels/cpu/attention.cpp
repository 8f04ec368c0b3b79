// Causal scaled-dot-product attention with grouped-query heads on the CPU: a flash-style forward
// (64×64 blocks, online softmax, never seq × seq) and a FlashAttention-2 backward that recomputes
// the probabilities from the saved log-sum-exp. Tiles are converted to fp32 in per-thread scratch.
// Each query row sees a window of keys [seg_start, its own position] (packed documents, KV-cache
// decoding): key blocks outside a query block's windows are skipped, partial ones masked.
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

#if defined(__x86_64__) || defined(__i386__)
#define STRATA_X86 1
#include <immintrin.h>
#else
#define STRATA_X86 0  // only the portable path exists
#endif

namespace strata::kernels::cpu {
namespace {

// Queries per block = keys per block, so the causal diagonal of a query block is one key block.
constexpr int64_t kBlock = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::atomic<AttentionIsa> g_isa{AttentionIsa::best};
std::atomic<AttentionSchedule> g_schedule{AttentionSchedule::automatic};

bool cpu_has(AttentionIsa isa) {
#if STRATA_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
#else
  constexpr bool avx512 = false, avx2 = false;
#endif
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
  int64_t n_blocks = 0;  // ceil(seq / kBlock): query blocks
  int64_t kv_seq = 0;    // keys per batch item (>= seq)
  int64_t q_pos0 = 0;    // key position of query 0: kv_seq - seq
  int64_t q_stride = 0, k_stride = 0, v_stride = 0, o_stride = 0;
  int64_t k_batch = 0, v_batch = 0;  // elements between batch items of k, v
  const int32_t* seg_start = nullptr;  // (batch, seq) first key each query sees; null = 0
  float scale = 0.f;

  template <class A>
  explicit Geometry(const A& a)
      : dtype(a.dtype), batch(a.batch), seq(a.seq), n_heads(a.n_heads), n_kv_heads(a.n_kv_heads),
        head_dim(a.head_dim), group(a.n_heads / a.n_kv_heads), n_blocks((a.seq + kBlock - 1) / kBlock),
        q_stride(a.q_stride ? a.q_stride : a.n_heads * a.head_dim),
        k_stride(a.k_stride ? a.k_stride : a.n_kv_heads * a.head_dim),
        v_stride(a.v_stride ? a.v_stride : a.n_kv_heads * a.head_dim), o_stride(a.n_heads * a.head_dim),
        seg_start(a.seg_start), scale(a.scale > 0.f ? a.scale : 1.f / std::sqrt(static_cast<float>(a.head_dim))) {
    kv_seq = kv_seq_of(a);
    q_pos0 = kv_seq - seq;
    const int64_t kv_batch = kv_batch_stride_of(a);
    k_batch = kv_batch ? kv_batch : kv_seq * k_stride;
    v_batch = kv_batch ? kv_batch : kv_seq * v_stride;
  }

  // Element offsets of token t of batch b, head h (t: query index for q/o, key position for k/v).
  int64_t q_at(int64_t b, int64_t t, int64_t h) const { return (b * seq + t) * q_stride + h * head_dim; }
  int64_t k_at(int64_t b, int64_t t, int64_t h) const { return b * k_batch + t * k_stride + h * head_dim; }
  int64_t v_at(int64_t b, int64_t t, int64_t h) const { return b * v_batch + t * v_stride + h * head_dim; }
  int64_t o_at(int64_t b, int64_t t, int64_t h) const { return (b * seq + t) * o_stride + h * head_dim; }
  int64_t lse_at(int64_t b, int64_t h, int64_t t) const { return (b * n_heads + h) * seq + t; }

  // Query t of batch b sees keys [first_key(b, t), q_pos0 + t].
  int64_t first_key(int64_t b, int64_t t) const { return seg_start ? std::max<int64_t>(0, seg_start[b * seq + t]) : 0; }
  // The first key any of queries [q0, q0 + nq) sees.
  int64_t first_key(int64_t b, int64_t q0, int64_t nq) const {
    if (!seg_start) return 0;
    const int32_t* s = seg_start + b * seq + q0;
    return std::max<int64_t>(0, *std::min_element(s, s + nq));
  }
};

// Sets the scores s (nq, kBlock) of query rows q0.. against key block k0 (nk keys) to -inf where
// the key is outside the row's window or past nk: exp then gives probability 0.
void mask_block(const Geometry& g, int64_t b, int64_t q0, int64_t nq, int64_t k0, int64_t nk, float* s) {
  for (int64_t i = 0; i < nq; ++i) {
    float* row = s + i * kBlock;
    const int64_t lo = std::clamp<int64_t>(g.first_key(b, q0 + i) - k0, 0, kBlock);
    const int64_t hi = std::clamp<int64_t>(g.q_pos0 + q0 + i - k0 + 1, 0, nk);
    std::fill(row, row + lo, kNegInf);
    std::fill(row + hi, row + kBlock, kNegInf);
  }
}

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

// dst (d, kBlock) = transpose of src (n, d) packed, columns n..kBlock zero. In 16 × 16 tiles so
// both sides stay in L1.
void transpose_rows(const float* src, int64_t n, int64_t d, float* dst) {
  if (n < kBlock)
    for (int64_t c = 0; c < d; ++c) std::fill(dst + c * kBlock + n, dst + (c + 1) * kBlock, 0.f);
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const int64_t r1 = std::min(n, r0 + 16);
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
      const int64_t c1 = std::min(d, c0 + 16);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[c * kBlock + r] = src[r * d + c];
    }
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

// e^x with relative error < 3e-7, exactly 0 below e^-87.3 (and for -inf). Branch-free so that a
// loop over it vectorises: e^x = 2^n · e^r, n = round(x / ln 2), r = x - n·ln 2 split in two
// parts (Cody-Waite), |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial.
[[gnu::always_inline]] inline float fast_exp(float x) {
  const bool underflow = x < -87.3f;
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.f ? 88.f : x;
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest (|.| < 2^22)
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float pow2n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  const float e = p * pow2n;  // computed unconditionally: the select below stays branch-free
  return underflow ? 0.f : e;
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
// 16 columns of C stay in registers across the k loop as GCC vector-extension values of the
// ISA's native width V (4 lanes baseline, 8 with AVX2); leftover columns take an axpy loop.
// Loads and stores go through memcpy, so rows need only float alignment.
typedef float F32x4 __attribute__((vector_size(16)));
typedef float F32x8 __attribute__((vector_size(32)));
template <int Lanes> struct VecOf;
template <> struct VecOf<4> { using type = F32x4; };
template <> struct VecOf<8> { using type = F32x8; };

template <int Lanes, int R>
[[gnu::always_inline]] inline void mm_panel_portable(float* c, int64_t ldc, const float* a, int64_t lda,
                                                     const float* b, int64_t ldb, int64_t k, bool accumulate) {
  using V = typename VecOf<Lanes>::type;
  constexpr int kVecs = 16 / Lanes;
  V acc[R][kVecs];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) {
      if (accumulate)
        std::memcpy(&acc[r][v], c + r * ldc + v * Lanes, sizeof(V));
      else
        acc[r][v] = V{};
    }
  for (int64_t p = 0; p < k; ++p) {
    V bv[kVecs];
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) std::memcpy(&bv[v], b + p * ldb + v * Lanes, sizeof(V));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float ap = a[r * lda + p];
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) acc[r][v] += ap * bv[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) std::memcpy(c + r * ldc + v * Lanes, &acc[r][v], sizeof(V));
}

template <int Lanes, int R>
struct PortableKernels {
  [[gnu::always_inline]] static inline void matmul(float* c, int64_t ldc, const float* a, int64_t lda, const float* b,
                                                   int64_t ldb, int64_t m, int64_t k, int64_t n, bool accumulate) {
    const int64_t n16 = n & ~int64_t{15};
    for (int64_t j0 = 0; j0 < n16; j0 += 16) {
      int64_t i = 0;
      for (; i + R <= m; i += R)
        mm_panel_portable<Lanes, R>(c + i * ldc + j0, ldc, a + i * lda, lda, b + j0, ldb, k, accumulate);
      for (; i < m; ++i) mm_panel_portable<Lanes, 1>(c + i * ldc + j0, ldc, a + i * lda, lda, b + j0, ldb, k, accumulate);
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

#if STRATA_X86
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
#endif  // STRATA_X86

// Block order within one head: 0, n-1, 1, n-2, ... Causal blocks cost ∝ their index (or its
// complement), and parallel_for hands each thread a contiguous run of items, so pairing cheap
// with dear blocks keeps threads even when there are few heads.
inline int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// ---- forward ----------------------------------------------------------------------------------

// One (batch, head, query block): online softmax over the key blocks that hold the rows' windows.
template <class K>
[[gnu::always_inline]] inline void forward_item(const AttentionArgs& args, const Geometry& g, int64_t b, int64_t h,
                                                int64_t qb) {
  const int64_t d = g.head_dim, kvh = h / g.group;
  const int64_t q0 = qb * kBlock, nq = std::min(kBlock, g.seq - q0);
  Carver carve(thread_scratch(5 * Carver::padded(kBlock * d) + Carver::padded(kBlock * kBlock) +
                              2 * Carver::padded(kBlock)));
  float* q = carve.take(kBlock * d);         // (nq, d), pre-scaled
  float* o = carve.take(kBlock * d);         // (nq, d) unnormalised accumulator
  float* v = carve.take(kBlock * d);         // (nk, d)
  float* kr = carve.take(kBlock * d);        // (nk, d) keys
  float* kt = carve.take(d * kBlock);        // (d, kBlock) keys transposed, zero-padded
  float* s = carve.take(kBlock * kBlock);    // (nq, kBlock) scores, then probabilities
  float* row_max = carve.take(kBlock);       // (nq) running max of scaled scores
  float* row_sum = carve.take(kBlock);       // (nq) running Σ exp(score - max)

  load_rows(args.q, g.dtype, g.q_at(b, q0, h), g.q_stride, nq, d, q, d, g.scale);
  std::fill(o, o + nq * d, 0.f);
  std::fill(row_max, row_max + nq, kNegInf);
  std::fill(row_sum, row_sum + nq, 0.f);

  const int64_t kb_lo = g.first_key(b, q0, nq) / kBlock, kb_hi = (g.q_pos0 + q0 + nq - 1) / kBlock;
  for (int64_t kb = kb_lo; kb <= kb_hi; ++kb) {
    const int64_t k0 = kb * kBlock, nk = std::min(kBlock, g.kv_seq - k0);
    load_rows(args.k, g.dtype, g.k_at(b, k0, kvh), g.k_stride, nk, d, kr, d, 1.f);
    transpose_rows(kr, nk, d, kt);
    load_rows(args.v, g.dtype, g.v_at(b, k0, kvh), g.v_stride, nk, d, v, d, 1.f);
    K::matmul(s, kBlock, q, d, kt, kBlock, nq, d, kBlock, false);  // S = (scale·Q)·Kᵀ
    mask_block(g, b, q0, nq, k0, nk, s);
    for (int64_t i = 0; i < nq; ++i) {
      float* row = s + i * kBlock;
      const float m_new = std::max(row_max[i], block_max(row));
      // A row whose window starts in a later block has seen no key: its max stays -inf, and
      // subtracting 0 keeps its probabilities (and alpha) 0 rather than NaN.
      const float m_sub = m_new == kNegInf ? 0.f : m_new;
      for (int64_t j = 0; j < kBlock; ++j) row[j] = fast_exp(row[j] - m_sub);
      const float alpha = fast_exp(row_max[i] - m_sub);  // 0 on the row's first block (max was -inf)
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

// Items [lo, hi) of (batch, head, query block), query block fastest (zigzag).
template <class K>
[[gnu::always_inline]] inline void forward_items(const AttentionArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  for (int64_t item = lo; item < hi; ++item) {
    const int64_t qb = zigzag(item % g.n_blocks, g.n_blocks), bh = item / g.n_blocks;
    forward_item<K>(args, g, bh / g.n_heads, bh % g.n_heads, qb);
  }
}
void forward_items_portable(const AttentionArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  forward_items<PortableKernels<4, 2>>(args, g, lo, hi);
}
#if STRATA_X86
STRATA_AVX2 void forward_items_avx2(const AttentionArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  forward_items<PortableKernels<8, 4>>(args, g, lo, hi);
}
STRATA_AVX512 void forward_items_avx512(const AttentionArgs& args, const Geometry& g, int64_t lo, int64_t hi) {
  forward_items<Avx512Kernels>(args, g, lo, hi);
}
#endif

// ---- backward ---------------------------------------------------------------------------------
// Two schedules, both deterministic (each output element has one owner and a fixed summation
// order) and chosen by shape and thread count only:
//  - per (batch, kv head): one task owns dK, dV of the kv head and dQ of its query heads, and
//    computes each block pair once (5 block matmuls). Used when there are enough such tasks.
//  - split: pass 1 per (batch, kv head, key block) owns dK, dV of the key block; pass 2 per
//    (batch, head, query block) owns dQ of the query block. Recomputes S and dP in both passes
//    (7 matmuls instead of 5) but has seq/64 times more parallelism (one long-context GQA layer).

// delta (B, Hq, T) = rowsum(dO ∘ O), per (batch, head, query block).
void compute_delta(const AttentionBackwardArgs& args, const Geometry& g, float* delta, int64_t lo, int64_t hi) {
  const int64_t d = g.head_dim;
  Carver carve(thread_scratch(2 * Carver::padded(kBlock * d)));
  float* ot = carve.take(kBlock * d);   // (n, d)
  float* dt = carve.take(kBlock * d);  // (n, d)
  for (int64_t item = lo; item < hi; ++item) {
    const int64_t qb = item % g.n_blocks, bh = item / g.n_blocks, b = bh / g.n_heads, h = bh % g.n_heads;
    const int64_t t0 = qb * kBlock, n = std::min(kBlock, g.seq - t0);
    load_rows(args.out, g.dtype, g.o_at(b, t0, h), g.o_stride, n, d, ot, d, 1.f);
    load_rows(args.dout, g.dtype, g.o_at(b, t0, h), g.o_stride, n, d, dt, d, 1.f);
    for (int64_t i = 0; i < n; ++i) delta[g.lse_at(b, h, t0 + i)] = dot(ot + i * d, dt + i * d, d);
  }
}

// For one block pair (query rows q0.., key block k0): p (nq, kBlock) = P = exp(S - lse) (0 where
// masked), ds (nq, kBlock) = dS = P ∘ (dP - delta). qi = scale·Q rows, doi = dO rows, kt/vt =
// Kᵀ/Vᵀ zero-padded.
template <class K>
[[gnu::always_inline]] inline void block_scores(const Geometry& g, int64_t b, int64_t q0, int64_t k0, const float* qi,
                                                const float* doi, const float* kt, const float* vt, const float* lse,
                                                const float* delta, int64_t nq, int64_t nk, float* p, float* ds) {
  const int64_t d = g.head_dim;
  K::matmul(p, kBlock, qi, d, kt, kBlock, nq, d, kBlock, false);   // S = (scale·Q)·Kᵀ
  K::matmul(ds, kBlock, doi, d, vt, kBlock, nq, d, kBlock, false);  // dP = dO·Vᵀ
  mask_block(g, b, q0, nq, k0, nk, p);
  for (int64_t i = 0; i < nq; ++i) {
    float* pr = p + i * kBlock;
    float* dr = ds + i * kBlock;
    const float l = lse[i], di = delta[i];
    for (int64_t j = 0; j < kBlock; ++j) {
      pr[j] = fast_exp(pr[j] - l);
      dr[j] = pr[j] * (dr[j] - di);
    }
  }
}

// K rows (nk, d) into kr, and Kᵀ, Vᵀ (d, kBlock) of key block k0 (tmp: (nk, d) scratch).
[[gnu::always_inline]] inline void load_key_block(const AttentionBackwardArgs& args, const Geometry& g, int64_t b,
                                                  int64_t kvh, int64_t k0, int64_t nk, float* kr, float* kt,
                                                  float* vt, float* tmp) {
  const int64_t d = g.head_dim;
  load_rows(args.k, g.dtype, g.k_at(b, k0, kvh), g.k_stride, nk, d, kr, d, 1.f);
  transpose_rows(kr, nk, d, kt);
  load_rows(args.v, g.dtype, g.v_at(b, k0, kvh), g.v_stride, nk, d, tmp, d, 1.f);
  transpose_rows(tmp, nk, d, vt);
}

// Per-(batch, kv head) schedule. With dq_too false it is pass 1 of the split schedule for key
// blocks [kb_lo, kb_hi) only.
template <class K>
[[gnu::always_inline]] inline void backward_kv(const AttentionBackwardArgs& args, const Geometry& g,
                                               const float* delta, int64_t b, int64_t kvh, int64_t kb_lo,
                                               int64_t kb_hi, bool dq_too) {
  const int64_t d = g.head_dim, T = g.seq, G = g.group, h0 = kvh * G;
  const int64_t q_lo = kb_lo * kBlock, rows = T - q_lo;  // query rows that see these keys
  const int64_t tile = kBlock * d, sq = kBlock * kBlock;
  Carver carve(thread_scratch((dq_too ? Carver::padded(G * rows * d) : 0) + 8 * Carver::padded(tile) +
                              4 * Carver::padded(sq)));
  float* dq = dq_too ? carve.take(G * rows * d) : nullptr;  // (G, rows, d) Σ dS·K
  float* qi = carve.take(tile);                             // (nq, d) scale·Q
  float* doi = carve.take(tile);                            // (nq, d)
  float* kr = carve.take(tile);                             // (nk, d) keys
  float* kt = carve.take(tile);                             // (d, kBlock)
  float* vt = carve.take(tile);                             // (d, kBlock)
  float* tmp = carve.take(tile);                            // (nk, d)
  float* dk = carve.take(tile);                             // (nk, d)
  float* dv = carve.take(tile);                             // (nk, d)
  float* p = carve.take(sq);                                // (nq, kBlock)
  float* ds = carve.take(sq);                               // (nq, kBlock)
  float* pt = carve.take(sq);                               // (kBlock, nq) Pᵀ
  float* dst = carve.take(sq);                              // (kBlock, nq) dSᵀ
  if (dq_too) std::fill(dq, dq + G * rows * d, 0.f);

  for (int64_t kb = kb_lo; kb < kb_hi; ++kb) {
    const int64_t k0 = kb * kBlock, nk = std::min(kBlock, T - k0);
    load_key_block(args, g, b, kvh, k0, nk, kr, kt, vt, tmp);
    std::fill(dk, dk + nk * d, 0.f);
    std::fill(dv, dv + nk * d, 0.f);
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t h = h0 + gi;
      for (int64_t qb = kb; qb < g.n_blocks; ++qb) {
        const int64_t q0 = qb * kBlock, nq = std::min(kBlock, T - q0);
        if (g.first_key(b, q0, nq) >= k0 + nk) continue;  // every row's window starts after this block
        // Converting the two tiles again for every key block costs ~1/300 of the block's math.
        load_rows(args.q, g.dtype, g.q_at(b, q0, h), g.q_stride, nq, d, qi, d, g.scale);
        load_rows(args.dout, g.dtype, g.o_at(b, q0, h), g.o_stride, nq, d, doi, d, 1.f);
        block_scores<K>(g, b, q0, k0, qi, doi, kt, vt, args.lse + g.lse_at(b, h, q0), delta + g.lse_at(b, h, q0), nq,
                        nk, p, ds);
        transpose_block(p, nq, pt);
        transpose_block(ds, nq, dst);
        K::matmul(dv, d, pt, kBlock, doi, d, nk, nq, d, true);  // dV += Pᵀ·dO
        K::matmul(dk, d, dst, kBlock, qi, d, nk, nq, d, true);  // dK += dSᵀ·(scale·Q)
        if (dq_too) K::matmul(dq + (gi * rows + q0 - q_lo) * d, d, ds, kBlock, kr, d, nq, nk, d, true);  // dQ += dS·K
      }
    }
    store_rows(args.dk, g.dtype, g.k_at(b, k0, kvh), g.k_stride, nk, d, dk, 1.f);
    store_rows(args.dv, g.dtype, g.v_at(b, k0, kvh), g.v_stride, nk, d, dv, 1.f);
  }
  if (dq_too)
    for (int64_t gi = 0; gi < G; ++gi)
      store_rows(args.dq, g.dtype, g.q_at(b, q_lo, h0 + gi), g.q_stride, rows, d, dq + gi * rows * d, g.scale);
}

// Pass 2 of the split schedule: dQ of one (batch, head, query block) over the key blocks from the
// one holding the rows' first key to qb.
template <class K>
[[gnu::always_inline]] inline void backward_q(const AttentionBackwardArgs& args, const Geometry& g,
                                              const float* delta, int64_t b, int64_t h, int64_t qb) {
  const int64_t d = g.head_dim, kvh = h / g.group, tile = kBlock * d, sq = kBlock * kBlock;
  const int64_t q0 = qb * kBlock, nq = std::min(kBlock, g.seq - q0);
  Carver carve(thread_scratch(7 * Carver::padded(tile) + 2 * Carver::padded(sq)));
  float* qi = carve.take(tile);   // (nq, d) scale·Q
  float* doi = carve.take(tile);  // (nq, d)
  float* dq = carve.take(tile);   // (nq, d)
  float* kr = carve.take(tile);   // (nk, d)
  float* kt = carve.take(tile);   // (d, kBlock)
  float* vt = carve.take(tile);   // (d, kBlock)
  float* tmp = carve.take(tile);  // (nk, d)
  float* p = carve.take(sq);      // (nq, kBlock)
  float* ds = carve.take(sq);     // (nq, kBlock)
  load_rows(args.q, g.dtype, g.q_at(b, q0, h), g.q_stride, nq, d, qi, d, g.scale);
  load_rows(args.dout, g.dtype, g.o_at(b, q0, h), g.o_stride, nq, d, doi, d, 1.f);
  const int64_t kb_lo = g.first_key(b, q0, nq) / kBlock;
  for (int64_t kb = kb_lo; kb <= qb; ++kb) {
    const int64_t k0 = kb * kBlock, nk = std::min(kBlock, g.seq - k0);
    load_key_block(args, g, b, kvh, k0, nk, kr, kt, vt, tmp);
    block_scores<K>(g, b, q0, k0, qi, doi, kt, vt, args.lse + g.lse_at(b, h, q0), delta + g.lse_at(b, h, q0), nq, nk,
                    p, ds);
    K::matmul(dq, d, ds, kBlock, kr, d, nq, nk, d, kb > kb_lo);  // dQ += dS·K
  }
  store_rows(args.dq, g.dtype, g.q_at(b, q0, h), g.q_stride, nq, d, dq, g.scale);
}

enum class BackwardPass { fused, split_kv, split_q };

// Items [lo, hi) of one pass: fused (batch, kv head); split_kv (batch, kv head, key block);
// split_q (batch, head, query block); blocks in zigzag order.
template <class K>
[[gnu::always_inline]] inline void backward_items(const AttentionBackwardArgs& args, const Geometry& g,
                                                  const float* delta, BackwardPass pass, int64_t lo, int64_t hi) {
  for (int64_t item = lo; item < hi; ++item) {
    if (pass == BackwardPass::fused) {
      backward_kv<K>(args, g, delta, item / g.n_kv_heads, item % g.n_kv_heads, 0, g.n_blocks, true);
    } else if (pass == BackwardPass::split_kv) {
      const int64_t kb = zigzag(item % g.n_blocks, g.n_blocks), bk = item / g.n_blocks;
      backward_kv<K>(args, g, delta, bk / g.n_kv_heads, bk % g.n_kv_heads, kb, kb + 1, false);
    } else {
      const int64_t qb = zigzag(item % g.n_blocks, g.n_blocks), bh = item / g.n_blocks;
      backward_q<K>(args, g, delta, bh / g.n_heads, bh % g.n_heads, qb);
    }
  }
}
void backward_items_portable(const AttentionBackwardArgs& args, const Geometry& g, const float* delta,
                             BackwardPass pass, int64_t lo, int64_t hi) {
  backward_items<PortableKernels<4, 2>>(args, g, delta, pass, lo, hi);
}
#if STRATA_X86
STRATA_AVX2 void backward_items_avx2(const AttentionBackwardArgs& args, const Geometry& g, const float* delta,
                                     BackwardPass pass, int64_t lo, int64_t hi) {
  backward_items<PortableKernels<8, 4>>(args, g, delta, pass, lo, hi);
}
STRATA_AVX512 void backward_items_avx512(const AttentionBackwardArgs& args, const Geometry& g, const float* delta,
                                         BackwardPass pass, int64_t lo, int64_t hi) {
  backward_items<Avx512Kernels>(args, g, delta, pass, lo, hi);
}
#endif

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
void set_attention_backward_schedule(AttentionSchedule s) { g_schedule.store(s); }

void attention(const AttentionArgs& a) {
  validate(a);
  const Geometry g(a);
  const AttentionIsa isa = attention_isa();
  // (batch, head, query block) items; static partitioning gives each thread a contiguous run that
  // spans many heads, so the causal imbalance between early and late query blocks evens out.
  parallel_for(0, g.batch * g.n_heads * g.n_blocks, 1, [&](int64_t lo, int64_t hi) {
    switch (isa) {
#if STRATA_X86
      case AttentionIsa::avx512: forward_items_avx512(a, g, lo, hi); break;
      case AttentionIsa::avx2: forward_items_avx2(a, g, lo, hi); break;
#endif
      default: forward_items_portable(a, g, lo, hi); break;
    }
  });
}

void attention_backward(const AttentionBackwardArgs& a) {
  validate(a);
  const Geometry g(a);
  const AttentionIsa isa = attention_isa();
  // delta (B, Hq, T), on the calling thread's own buffer (TBB workers use thread_scratch).
  thread_local std::vector<float> delta_buf;
  const auto n_rows = static_cast<size_t>(g.batch * g.n_heads * g.seq);
  if (delta_buf.size() < n_rows) delta_buf.resize(n_rows);
  float* delta = delta_buf.data();
  parallel_for(0, g.batch * g.n_heads * g.n_blocks, 1,
               [&](int64_t lo, int64_t hi) { compute_delta(a, g, delta, lo, hi); });

  auto run = [&](BackwardPass pass, int64_t n_items) {
    parallel_for(0, n_items, 1, [&](int64_t lo, int64_t hi) {
      switch (isa) {
#if STRATA_X86
        case AttentionIsa::avx512: backward_items_avx512(a, g, delta, pass, lo, hi); break;
        case AttentionIsa::avx2: backward_items_avx2(a, g, delta, pass, lo, hi); break;
#endif
        default: backward_items_portable(a, g, delta, pass, lo, hi); break;
      }
    });
  };
  const int64_t kv_tasks = g.batch * g.n_kv_heads;
  const AttentionSchedule schedule = g_schedule.load();
  // Fused needs a (group, seq, head_dim) fp32 dQ accumulator per task: cap it at 32 MiB.
  const bool fits = g.group * g.seq * g.head_dim <= (int64_t{8} << 20);
  const bool fused = schedule == AttentionSchedule::automatic
                         ? fits && (g.n_blocks == 1 || kv_tasks >= 2 * static_cast<int64_t>(num_threads()))
                         : schedule == AttentionSchedule::fused;
  if (fused) {
    run(BackwardPass::fused, kv_tasks);
  } else {
    run(BackwardPass::split_kv, kv_tasks * g.n_blocks);
    run(BackwardPass::split_q, g.batch * g.n_heads * g.n_blocks);
  }
}

}  // namespace strata::kernels::cpu
