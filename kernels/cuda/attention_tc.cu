// Tensor-core causal GQA attention for bf16/fp16, head_dim 64 or 128, FlashAttention-2 style:
// mma.sync m16n8k16 (fp32 accumulate) on tiles staged in shared memory, online softmax in the
// accumulator registers (the S accumulator is reused as the A operand of P·V), O(T) memory,
// lse saved. Backward recomputes P from lse in two deterministic kernels: dQ per (query tile,
// head) over its key tiles, and dK/dV per (key tile, kv head) over the group's query heads in
// order. No atomics. Query t sees the keys [seg_start, kv_seq - seq + t]: tiles outside every
// row's window are skipped, partial tiles masked element-wise. Fragment layouts are PTX's for m16n8k16 (g = lane/4, tig = lane%4):
//   A (16×16, row): a0 = (g, 2tig..+1), a1 = (g+8, 2tig..), a2 = (g, 2tig+8..), a3 = (g+8, 2tig+8..)
//   B (16×8, col):  b0 = (k 2tig..+1, n g), b1 = (k 2tig+8..+1, n g)
//   C (16×8):       c0,c1 = (g, 2tig..+1), c2,c3 = (g+8, 2tig..+1)
// Fragments come from shared memory through ldmatrix (default) or plain 32/16-bit loads
// (STRATA_CUDA_ATTENTION=mma_plain, the reference the ldmatrix path must match bit for bit).
// Tiles are plain (non-async) 16-byte loads between barriers: cp.async double buffering and
// larger tiles are the next steps for speed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 64;     // query rows per block (fwd, dQ) = keys per block (dK/dV) = 16 per warp
constexpr int kKeyTile = 64;  // keys per step (fwd, dQ)
constexpr int kQTile = 32;    // queries per step (dK/dV)

template <int D> constexpr int lds() { return D + 8; }  // smem row stride: fragment loads hit 32 banks

// ---- mma and fragment helpers ----------------------------------------------------------------

template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<bf16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<f16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a packed pair (lo in the low half: the lower column index).
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<bf16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<f16>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two consecutive elements (even index) of a smem tile as one 32-bit word.
template <class T>
__device__ __forceinline__ uint32_t ld_pair(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
// Elements p[0] (low half) and p[stride] (high half): a B fragment down a column.
template <class T>
__device__ __forceinline__ uint32_t ld_column_pair(const T* p, int stride) {
  const uint32_t lo = *reinterpret_cast<const uint16_t*>(p);
  const uint32_t hi = *reinterpret_cast<const uint16_t*>(p + stride);
  return lo | (hi << 16);
}

// A fragment (16 rows from row r0, 16 columns from c0) of a row-major smem tile.
template <class T, int LDS>
__device__ __forceinline__ void ld_a(uint32_t (&a)[4], const T* tile, int r0, int c0, int g, int tig) {
  const T* p = tile + (r0 + g) * LDS + c0 + 2 * tig;
  a[0] = ld_pair(p);
  a[1] = ld_pair(p + 8 * LDS);
  a[2] = ld_pair(p + 8);
  a[3] = ld_pair(p + 8 * LDS + 8);
}
// B fragment of X·Tileᵀ: n = tile rows n0..n0+7, k = tile columns c0..c0+15 (contiguous pairs).
template <class T, int LDS>
__device__ __forceinline__ void ld_b_rows(uint32_t& b0, uint32_t& b1, const T* tile, int n0, int c0, int g, int tig) {
  const T* p = tile + (n0 + g) * LDS + c0 + 2 * tig;
  b0 = ld_pair(p);
  b1 = ld_pair(p + 8);
}
// B fragment of X·Tile: k = tile rows k0..k0+15, n = tile columns n0..n0+7 (pairs down a column).
template <class T, int LDS>
__device__ __forceinline__ void ld_b_cols(uint32_t& b0, uint32_t& b1, const T* tile, int k0, int n0, int g, int tig) {
  const T* p = tile + (k0 + 2 * tig) * LDS + n0 + g;
  b0 = ld_column_pair(p, LDS);
  b1 = ld_column_pair(p + 8 * LDS, LDS);
}
// ldmatrix: lane l supplies the address of row l%8 of 8×8 matrix l/8 (16-byte rows); register j
// of lane l receives matrix j's elements (l/4, 2(l%4)..+1), or with .trans (2(l%4)..+1, l/4).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}

// The same fragments two ways: kLdm (ldmatrix, one instruction per four registers) or plain
// 32/16-bit shared loads. Both give bit-identical fragments (the tests check it).
// A fragment: matrices (r0, c0), (r0+8, c0), (r0, c0+8), (r0+8, c0+8).
template <bool kLdm, class T, int LDS>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const T* tile, int r0, int c0, int lane) {
  if constexpr (kLdm) {
    const int j = lane >> 3, r = lane & 7;
    ldsm_x4(a, tile + (r0 + (j & 1) * 8 + r) * LDS + c0 + (j >> 1) * 8);
  } else {
    ld_a<T, LDS>(a, tile, r0, c0, lane >> 2, lane & 3);
  }
}
// B fragments of X·Tileᵀ for n-tiles n0 and n0+8: b = {b0(n0), b1(n0), b0(n0+8), b1(n0+8)};
// matrices (n0, c0), (n0, c0+8), (n0+8, c0), (n0+8, c0+8).
template <bool kLdm, class T, int LDS>
__device__ __forceinline__ void frag_b_rows2(uint32_t (&b)[4], const T* tile, int n0, int c0, int lane) {
  if constexpr (kLdm) {
    const int j = lane >> 3, r = lane & 7;
    ldsm_x4(b, tile + (n0 + (j >> 1) * 8 + r) * LDS + c0 + (j & 1) * 8);
  } else {
    ld_b_rows<T, LDS>(b[0], b[1], tile, n0, c0, lane >> 2, lane & 3);
    ld_b_rows<T, LDS>(b[2], b[3], tile, n0 + 8, c0, lane >> 2, lane & 3);
  }
}
// B fragments of X·Tile for n-tiles n0 and n0+8 (k = tile rows k0..k0+15), transposed loads of
// matrices (k0, n0), (k0+8, n0), (k0, n0+8), (k0+8, n0+8).
template <bool kLdm, class T, int LDS>
__device__ __forceinline__ void frag_b_cols2(uint32_t (&b)[4], const T* tile, int k0, int n0, int lane) {
  if constexpr (kLdm) {
    const int j = lane >> 3, r = lane & 7;
    ldsm_x4_trans(b, tile + (k0 + (j & 1) * 8 + r) * LDS + n0 + (j >> 1) * 8);
  } else {
    ld_b_cols<T, LDS>(b[0], b[1], tile, k0, n0, lane >> 2, lane & 3);
    ld_b_cols<T, LDS>(b[2], b[3], tile, k0, n0 + 8, lane >> 2, lane & 3);
  }
}

// The C accumulators of a 16×16 block (two n-tiles s0, s1) as an A fragment (k = their columns).
template <class T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&s0)[4], const float (&s1)[4]) {
  a[0] = pack2<T>(s0[0], s0[1]);
  a[1] = pack2<T>(s0[2], s0[3]);
  a[2] = pack2<T>(s1[0], s1[1]);
  a[3] = pack2<T>(s1[2], s1[3]);
}

// Copies rows [r0, r0 + ROWS) of a token view (row r at src + r·stride, D elements) into a smem
// tile (ROWS, LDS); rows at or past seq are zero. 16-byte loads (alignment checked on the host).
template <int ROWS, int D, class T>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t stride, int r0, int seq) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r0 + r < seq) v = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r0 + r) * stride + c);
    *reinterpret_cast<uint4*>(tile + r * lds<D>() + c) = v;
  }
}

// ---- forward ----------------------------------------------------------------------------------

// Block (query tile, b·Hq + h): warp w owns query rows q0 + 16w + {g, g+8}. Scores are kept in
// log2 units (scale·log2e folded in) so the exponentials are exp2.
template <class T, int D, bool kLdm>
__global__ void __launch_bounds__(kThreads)
    attn_fwd_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                float* __restrict__ lse, AttnGeometry geo) {
  constexpr int LDS = lds<D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(smem_raw);  // (kKeyTile, LDS); first holds the Q tile
  T* vs = ks + kKeyTile * LDS;             // (kKeyTile, LDS)
  const int T_ = geo.seq;
  const int qt = gridDim.x - 1 - blockIdx.x;  // late (dear) query tiles first
  const int b = blockIdx.y / geo.n_heads, h = blockIdx.y % geo.n_heads, kvh = h / geo.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int q0 = qt * kTile;
  const float sl = geo.scale * kLog2e;
  const T* qb = q + static_cast<int64_t>(b) * T_ * geo.q_stride + static_cast<int64_t>(h) * D;
  const T* kb = k + static_cast<int64_t>(b) * geo.k_batch + static_cast<int64_t>(kvh) * D;
  const T* vb = v + static_cast<int64_t>(b) * geo.v_batch + static_cast<int64_t>(kvh) * D;

  load_tile<kTile, D>(ks, qb, geo.q_stride, q0, T_);
  __syncthreads();
  uint32_t qf[D / 16][4];  // this warp's 16 query rows as A fragments
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) frag_a<kLdm, T, LDS>(qf[kt], ks, warp * 16, kt * 16, lane);

  const int row_lo = q0 + warp * 16 + g, row_hi = row_lo + 8;
  // Each row's keys [first, pos]; rows past the end see [0, pos] (computed, never stored).
  const int pos_lo = geo.q_pos0 + row_lo, pos_hi = geo.q_pos0 + row_hi;
  const int first_lo = row_lo < T_ ? geo.first_key(b, row_lo) : 0;
  const int first_hi = row_hi < T_ ? geo.first_key(b, row_hi) : 0;
  float o[D / 8][4] = {};
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;  // l: this thread's columns only
  const int last_key = geo.q_pos0 + min(T_, q0 + kTile) - 1;
  const int k_lo = geo.warp_min_first_key(b, q0, kTile) / kKeyTile * kKeyTile;
  for (int k0 = k_lo; k0 <= last_key; k0 += kKeyTile) {
    __syncthreads();  // everyone is done with the previous tiles (and the Q tile)
    load_tile<kKeyTile, D>(ks, kb, geo.k_stride, k0, geo.kv_seq);
    load_tile<kKeyTile, D>(vs, vb, geo.v_stride, k0, geo.kv_seq);
    __syncthreads();

    float s[kKeyTile / 8][4] = {};  // S = Q·Kᵀ, (16 rows, 64 keys)
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt)
#pragma unroll
      for (int nt = 0; nt < kKeyTile / 8; nt += 2) {
        uint32_t bb[4];
        frag_b_rows2<kLdm, T, LDS>(bb, ks, nt * 8, kt * 16, lane);
        mma16816<T>(s[nt], qf[kt], bb[0], bb[1]);
        mma16816<T>(s[nt + 1], qf[kt], bb[2], bb[3]);
      }
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = k0 + nt * 8 + 2 * tig + e;
        s[nt][e] = key >= first_lo && key <= pos_lo && key < geo.kv_seq ? s[nt][e] * sl : -INFINITY;
        s[nt][2 + e] = key >= first_hi && key <= pos_hi && key < geo.kv_seq ? s[nt][2 + e] * sl : -INFINITY;
        mx_lo = fmaxf(mx_lo, s[nt][e]);
        mx_hi = fmaxf(mx_hi, s[nt][2 + e]);
      }
    // The four threads of a quad hold one row's 64 scores.
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
    const float base_lo = mn_lo == -INFINITY ? 0.f : mn_lo, base_hi = mn_hi == -INFINITY ? 0.f : mn_hi;
    const float corr_lo = exp2f(m_lo - base_lo), corr_hi = exp2f(m_hi - base_hi);  // 0 on the first tile
    m_lo = mn_lo, m_hi = mn_hi;
    l_lo *= corr_lo, l_hi *= corr_hi;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= corr_lo, o[dt][1] *= corr_lo;
      o[dt][2] *= corr_hi, o[dt][3] *= corr_hi;
    }
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - base_lo), s[nt][1] = exp2f(s[nt][1] - base_lo);
      s[nt][2] = exp2f(s[nt][2] - base_hi), s[nt][3] = exp2f(s[nt][3] - base_hi);
      l_lo += s[nt][0] + s[nt][1];
      l_hi += s[nt][2] + s[nt][3];
    }
    // O += P·V: P's accumulators are the A operand (k = keys), V the B operand down its columns.
#pragma unroll
    for (int kt = 0; kt < kKeyTile / 16; ++kt) {
      uint32_t pa[4];
      c_to_a<T>(pa, s[2 * kt], s[2 * kt + 1]);
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t bb[4];
        frag_b_cols2<kLdm, T, LDS>(bb, vs, kt * 16, dt * 8, lane);
        mma16816<T>(o[dt], pa, bb[0], bb[1]);
        mma16816<T>(o[dt + 1], pa, bb[2], bb[3]);
      }
    }
  }
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  const float inv_lo = 1.f / l_lo, inv_hi = 1.f / l_hi;
  T* ob = out + static_cast<int64_t>(b) * T_ * geo.o_stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int c = dt * 8 + 2 * tig;
    if (row_lo < T_)
      *reinterpret_cast<uint32_t*>(ob + static_cast<int64_t>(row_lo) * geo.o_stride + c) =
          pack2<T>(o[dt][0] * inv_lo, o[dt][1] * inv_lo);
    if (row_hi < T_)
      *reinterpret_cast<uint32_t*>(ob + static_cast<int64_t>(row_hi) * geo.o_stride + c) =
          pack2<T>(o[dt][2] * inv_hi, o[dt][3] * inv_hi);
  }
  if (tig == 0) {
    float* lb = lse + (static_cast<int64_t>(b) * geo.n_heads + h) * T_;
    if (row_lo < T_) lb[row_lo] = (m_lo + log2f(l_lo)) * kLn2;
    if (row_hi < T_) lb[row_hi] = (m_hi + log2f(l_hi)) * kLn2;
  }
}

// ---- backward: dQ -------------------------------------------------------------------------------

// Block (query tile, b·Hq + h): warp w owns query rows q0 + 16w + {g, g+8}. Per key tile:
// S = Q·Kᵀ, P = exp(scale·S - lse), dP = dO·Vᵀ, dS = P∘(dP - delta), dQ += dS·K.
template <class T, int D, bool kLdm>
__global__ void __launch_bounds__(kThreads)
    attn_bwd_dq_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                   T* __restrict__ dq, AttnGeometry geo) {
  constexpr int LDS = lds<D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);  // (kTile, LDS)
  T* dos = qs + kTile * LDS;               // (kTile, LDS)
  T* ks = dos + kTile * LDS;               // (kKeyTile, LDS)
  T* vs = ks + kKeyTile * LDS;             // (kKeyTile, LDS)
  const int T_ = geo.seq;
  const int qt = gridDim.x - 1 - blockIdx.x;
  const int b = blockIdx.y / geo.n_heads, h = blockIdx.y % geo.n_heads, kvh = h / geo.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int q0 = qt * kTile;
  const float sl = geo.scale * kLog2e;
  const T* kb = k + static_cast<int64_t>(b) * geo.k_batch + static_cast<int64_t>(kvh) * D;
  const T* vb = v + static_cast<int64_t>(b) * geo.v_batch + static_cast<int64_t>(kvh) * D;
  load_tile<kTile, D>(qs, q + static_cast<int64_t>(b) * T_ * geo.q_stride + static_cast<int64_t>(h) * D,
                      geo.q_stride, q0, T_);
  load_tile<kTile, D>(dos, dout + static_cast<int64_t>(b) * T_ * geo.o_stride + static_cast<int64_t>(h) * D,
                      geo.o_stride, q0, T_);
  const int row_lo = q0 + warp * 16 + g, row_hi = row_lo + 8;
  const int64_t stat = (static_cast<int64_t>(b) * geo.n_heads + h) * T_;
  // Rows past the end get lse = +inf, so their P (and dS) are 0.
  const float lse_lo = row_lo < T_ ? lse[stat + row_lo] * kLog2e : INFINITY;
  const float lse_hi = row_hi < T_ ? lse[stat + row_hi] * kLog2e : INFINITY;
  const float dl_lo = row_lo < T_ ? delta[stat + row_lo] : 0.f;
  const float dl_hi = row_hi < T_ ? delta[stat + row_hi] : 0.f;
  const int first_lo = row_lo < T_ ? geo.first_key(b, row_lo) : 0;
  const int first_hi = row_hi < T_ ? geo.first_key(b, row_hi) : 0;

  float acc[D / 8][4] = {};
  const int last_key = min(T_, q0 + kTile) - 1;
  const int k_lo = geo.warp_min_first_key(b, q0, kTile) / kKeyTile * kKeyTile;
  for (int k0 = k_lo; k0 <= last_key; k0 += kKeyTile) {
    __syncthreads();
    load_tile<kKeyTile, D>(ks, kb, geo.k_stride, k0, T_);
    load_tile<kKeyTile, D>(vs, vb, geo.v_stride, k0, T_);
    __syncthreads();
    float s[kKeyTile / 8][4] = {}, dp[kKeyTile / 8][4] = {};
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt) {
      uint32_t qa[4], da[4];
      frag_a<kLdm, T, LDS>(qa, qs, warp * 16, kt * 16, lane);
      frag_a<kLdm, T, LDS>(da, dos, warp * 16, kt * 16, lane);
#pragma unroll
      for (int nt = 0; nt < kKeyTile / 8; nt += 2) {
        uint32_t bb[4];
        frag_b_rows2<kLdm, T, LDS>(bb, ks, nt * 8, kt * 16, lane);
        mma16816<T>(s[nt], qa, bb[0], bb[1]);
        mma16816<T>(s[nt + 1], qa, bb[2], bb[3]);
        frag_b_rows2<kLdm, T, LDS>(bb, vs, nt * 8, kt * 16, lane);
        mma16816<T>(dp[nt], da, bb[0], bb[1]);
        mma16816<T>(dp[nt + 1], da, bb[2], bb[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < kKeyTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = k0 + nt * 8 + 2 * tig + e;
        const float p_lo = key >= first_lo && key <= row_lo && key < T_ ? exp2f(s[nt][e] * sl - lse_lo) : 0.f;
        const float p_hi = key >= first_hi && key <= row_hi && key < T_ ? exp2f(s[nt][2 + e] * sl - lse_hi) : 0.f;
        s[nt][e] = p_lo * (dp[nt][e] - dl_lo);  // s now holds dS
        s[nt][2 + e] = p_hi * (dp[nt][2 + e] - dl_hi);
      }
    // dQ += dS·K: dS is the A operand (k = keys), K the B operand down its columns.
#pragma unroll
    for (int kt = 0; kt < kKeyTile / 16; ++kt) {
      uint32_t sa[4];
      c_to_a<T>(sa, s[2 * kt], s[2 * kt + 1]);
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t bb[4];
        frag_b_cols2<kLdm, T, LDS>(bb, ks, kt * 16, dt * 8, lane);
        mma16816<T>(acc[dt], sa, bb[0], bb[1]);
        mma16816<T>(acc[dt + 1], sa, bb[2], bb[3]);
      }
    }
  }
  T* qo = dq + static_cast<int64_t>(b) * T_ * geo.q_stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int c = dt * 8 + 2 * tig;
    if (row_lo < T_)
      *reinterpret_cast<uint32_t*>(qo + static_cast<int64_t>(row_lo) * geo.q_stride + c) =
          pack2<T>(geo.scale * acc[dt][0], geo.scale * acc[dt][1]);
    if (row_hi < T_)
      *reinterpret_cast<uint32_t*>(qo + static_cast<int64_t>(row_hi) * geo.q_stride + c) =
          pack2<T>(geo.scale * acc[dt][2], geo.scale * acc[dt][3]);
  }
}

// ---- backward: dK, dV ---------------------------------------------------------------------------

// Block (key tile, b·Hkv + kvh): warp w owns keys k0 + 16w + {g, g+8}, and the block walks the
// group's query heads in order, queries k0.. in tiles of 32 (tiles whose queries all start their
// window after the block's keys are skipped). Transposed scores: Sᵀ = K·Qᵀ,
// Pᵀ = exp(scale·Sᵀ - lse), dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ - delta), dV += Pᵀ·dO, dK += dSᵀ·Q.
template <class T, int D, bool kLdm>
__global__ void __launch_bounds__(kThreads)
    attn_bwd_dkdv_tc(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                     T* __restrict__ dk, T* __restrict__ dv, AttnGeometry geo) {
  constexpr int LDS = lds<D>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(smem_raw);  // (kTile, LDS)
  T* vs = ks + kTile * LDS;                // (kTile, LDS)
  T* qs = vs + kTile * LDS;                // (kQTile, LDS)
  T* dos = qs + kQTile * LDS;              // (kQTile, LDS)
  float* ls = reinterpret_cast<float*>(dos + kQTile * LDS);  // (kQTile) lse·log2e (+inf past the end)
  float* dls = ls + kQTile;                                   // (kQTile) delta
  int* fs = reinterpret_cast<int*>(dls + kQTile);             // (kQTile) first key of each query
  const int T_ = geo.seq;
  const int kt_block = blockIdx.x;  // early key tiles see the most queries: first
  const int b = blockIdx.y / geo.n_kv_heads, kvh = blockIdx.y % geo.n_kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int k0 = kt_block * kTile;
  const float sl = geo.scale * kLog2e;
  load_tile<kTile, D>(ks, k + static_cast<int64_t>(b) * geo.k_batch + static_cast<int64_t>(kvh) * D,
                      geo.k_stride, k0, T_);
  load_tile<kTile, D>(vs, v + static_cast<int64_t>(b) * geo.v_batch + static_cast<int64_t>(kvh) * D,
                      geo.v_stride, k0, T_);
  const int key_lo = k0 + warp * 16 + g, key_hi = key_lo + 8;
  float dka[D / 8][4] = {}, dva[D / 8][4] = {};

  for (int gi = 0; gi < geo.group; ++gi) {
    const int h = kvh * geo.group + gi;
    const T* qb = q + static_cast<int64_t>(b) * T_ * geo.q_stride + static_cast<int64_t>(h) * D;
    const T* ob = dout + static_cast<int64_t>(b) * T_ * geo.o_stride + static_cast<int64_t>(h) * D;
    const int64_t stat = (static_cast<int64_t>(b) * geo.n_heads + h) * T_;
    for (int q0 = k0; q0 < T_; q0 += kQTile) {
      if (geo.warp_min_first_key(b, q0, kQTile) >= k0 + kTile) continue;  // sees none of these keys
      __syncthreads();  // the previous query tile is no longer read
      load_tile<kQTile, D>(qs, qb, geo.q_stride, q0, T_);
      load_tile<kQTile, D>(dos, ob, geo.o_stride, q0, T_);
      if (threadIdx.x < kQTile) {
        const int t = q0 + threadIdx.x;
        ls[threadIdx.x] = t < T_ ? lse[stat + t] * kLog2e : INFINITY;
        dls[threadIdx.x] = t < T_ ? delta[stat + t] : 0.f;
        fs[threadIdx.x] = t < T_ ? geo.first_key(b, t) : 0;
      }
      __syncthreads();
      float st[kQTile / 8][4] = {}, dpt[kQTile / 8][4] = {};  // (16 keys, 32 queries)
#pragma unroll
      for (int kt = 0; kt < D / 16; ++kt) {
        uint32_t ka[4], va[4];
        frag_a<kLdm, T, LDS>(ka, ks, warp * 16, kt * 16, lane);
        frag_a<kLdm, T, LDS>(va, vs, warp * 16, kt * 16, lane);
#pragma unroll
        for (int nt = 0; nt < kQTile / 8; nt += 2) {
          uint32_t bb[4];
          frag_b_rows2<kLdm, T, LDS>(bb, qs, nt * 8, kt * 16, lane);
          mma16816<T>(st[nt], ka, bb[0], bb[1]);
          mma16816<T>(st[nt + 1], ka, bb[2], bb[3]);
          frag_b_rows2<kLdm, T, LDS>(bb, dos, nt * 8, kt * 16, lane);
          mma16816<T>(dpt[nt], va, bb[0], bb[1]);
          mma16816<T>(dpt[nt + 1], va, bb[2], bb[3]);
        }
      }
      // st -> Pᵀ, dpt -> dSᵀ. Element (key, query): c0,c1 = (key_lo, 2tig..), c2,c3 = (key_hi, ..).
#pragma unroll
      for (int nt = 0; nt < kQTile / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int qi = nt * 8 + 2 * tig + e, t = q0 + qi;
          const bool seen_lo = t >= key_lo && key_lo >= fs[qi] && key_lo < T_;
          const bool seen_hi = t >= key_hi && key_hi >= fs[qi] && key_hi < T_;
          const float p_lo = seen_lo ? exp2f(st[nt][e] * sl - ls[qi]) : 0.f;
          const float p_hi = seen_hi ? exp2f(st[nt][2 + e] * sl - ls[qi]) : 0.f;
          st[nt][e] = p_lo, st[nt][2 + e] = p_hi;
          dpt[nt][e] = p_lo * (dpt[nt][e] - dls[qi]);
          dpt[nt][2 + e] = p_hi * (dpt[nt][2 + e] - dls[qi]);
        }
      // dV += Pᵀ·dO and dK += dSᵀ·Q (k = queries; dO and Q read down their columns).
#pragma unroll
      for (int kt = 0; kt < kQTile / 16; ++kt) {
        uint32_t pa[4], sa[4];
        c_to_a<T>(pa, st[2 * kt], st[2 * kt + 1]);
        c_to_a<T>(sa, dpt[2 * kt], dpt[2 * kt + 1]);
#pragma unroll
        for (int dt = 0; dt < D / 8; dt += 2) {
          uint32_t bb[4];
          frag_b_cols2<kLdm, T, LDS>(bb, dos, kt * 16, dt * 8, lane);
          mma16816<T>(dva[dt], pa, bb[0], bb[1]);
          mma16816<T>(dva[dt + 1], pa, bb[2], bb[3]);
          frag_b_cols2<kLdm, T, LDS>(bb, qs, kt * 16, dt * 8, lane);
          mma16816<T>(dka[dt], sa, bb[0], bb[1]);
          mma16816<T>(dka[dt + 1], sa, bb[2], bb[3]);
        }
      }
    }
  }
  T* kout = dk + static_cast<int64_t>(b) * geo.k_batch + static_cast<int64_t>(kvh) * D;
  T* vout = dv + static_cast<int64_t>(b) * geo.v_batch + static_cast<int64_t>(kvh) * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int c = dt * 8 + 2 * tig;
    if (key_lo < T_) {
      *reinterpret_cast<uint32_t*>(kout + static_cast<int64_t>(key_lo) * geo.k_stride + c) =
          pack2<T>(geo.scale * dka[dt][0], geo.scale * dka[dt][1]);
      *reinterpret_cast<uint32_t*>(vout + static_cast<int64_t>(key_lo) * geo.v_stride + c) =
          pack2<T>(dva[dt][0], dva[dt][1]);
    }
    if (key_hi < T_) {
      *reinterpret_cast<uint32_t*>(kout + static_cast<int64_t>(key_hi) * geo.k_stride + c) =
          pack2<T>(geo.scale * dka[dt][2], geo.scale * dka[dt][3]);
      *reinterpret_cast<uint32_t*>(vout + static_cast<int64_t>(key_hi) * geo.v_stride + c) =
          pack2<T>(dva[dt][2], dva[dt][3]);
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <class A>
bool supported(const A& a, const AttnGeometry& g) {
  if (a.dtype != DType::bf16 && a.dtype != DType::f16) return false;
  if (g.head_dim != 64 && g.head_dim != 128) return false;
  if (g.q_stride % 8 || g.k_stride % 8 || g.v_stride % 8 || g.k_batch % 8 || g.v_batch % 8) return false;
  return aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.out);
}

// Dynamic shared memory above 48 KiB must be opted into, per kernel (on the current device).
template <class K>
void allow_smem(K kernel, size_t smem) {
  if (smem > 48 * 1024)
    STRATA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
}

template <class T, int D, bool kLdm>
void forward(const AttentionArgs& a, const AttnGeometry& g, cudaStream_t s) {
  const size_t smem = 2 * kKeyTile * lds<D>() * sizeof(T);
  const dim3 grid((g.seq + kTile - 1) / kTile, g.batch * g.n_heads);
  allow_smem(attn_fwd_tc<T, D, kLdm>, smem);
  attn_fwd_tc<T, D, kLdm><<<grid, kThreads, smem, s>>>(static_cast<const T*>(a.q), static_cast<const T*>(a.k),
                                                       static_cast<const T*>(a.v), static_cast<T*>(a.out), a.lse, g);
  STRATA_CUDA_CHECK_LAUNCH();
}

template <class T, int D, bool kLdm>
void backward(const AttentionBackwardArgs& a, const AttnGeometry& g, const float* delta, cudaStream_t s) {
  const auto* q = static_cast<const T*>(a.q);
  const auto* k = static_cast<const T*>(a.k);
  const auto* v = static_cast<const T*>(a.v);
  const auto* dout = static_cast<const T*>(a.dout);
  const size_t smem_q = (2 * kTile + 2 * kKeyTile) * lds<D>() * sizeof(T);
  const dim3 grid_q((g.seq + kTile - 1) / kTile, g.batch * g.n_heads);
  allow_smem(attn_bwd_dq_tc<T, D, kLdm>, smem_q);
  attn_bwd_dq_tc<T, D, kLdm><<<grid_q, kThreads, smem_q, s>>>(q, k, v, dout, a.lse, delta, static_cast<T*>(a.dq), g);
  STRATA_CUDA_CHECK_LAUNCH();
  const size_t smem_kv = (2 * kTile + 2 * kQTile) * lds<D>() * sizeof(T) + 3 * kQTile * sizeof(float);
  const dim3 grid_kv((g.seq + kTile - 1) / kTile, g.batch * g.n_kv_heads);
  allow_smem(attn_bwd_dkdv_tc<T, D, kLdm>, smem_kv);
  attn_bwd_dkdv_tc<T, D, kLdm><<<grid_kv, kThreads, smem_kv, s>>>(q, k, v, dout, a.lse, delta,
                                                                  static_cast<T*>(a.dk), static_cast<T*>(a.dv), g);
  STRATA_CUDA_CHECK_LAUNCH();
}

// Calls f.template operator()<T, D, kLdm>() for the call's dtype and head_dim.
template <class F>
void dispatch_tc(DType t, int head_dim, bool ldmatrix, F&& f) {
  auto by_dim = [&](auto tag, auto ldm) {
    using T = decltype(tag);
    if (head_dim == 64) f.template operator()<T, 64, decltype(ldm)::value>();
    else f.template operator()<T, 128, decltype(ldm)::value>();
  };
  auto by_ldm = [&](auto tag) {
    if (ldmatrix) by_dim(tag, std::true_type{});
    else by_dim(tag, std::false_type{});
  };
  if (t == DType::bf16) by_ldm(bf16{});
  else by_ldm(f16{});
}

}  // namespace

bool attention_tc_supported(const AttentionArgs& a, const AttnGeometry& g) { return supported(a, g); }
bool attention_tc_supported(const AttentionBackwardArgs& a, const AttnGeometry& g) {
  return supported(a, g) && aligned16(a.dout) && aligned16(a.dq) && aligned16(a.dk) && aligned16(a.dv);
}

void attention_forward_tc(const AttentionArgs& a, const AttnGeometry& g, bool ldmatrix, cudaStream_t s) {
  dispatch_tc(a.dtype, g.head_dim, ldmatrix, [&]<class T, int D, bool L>() { forward<T, D, L>(a, g, s); });
}
void attention_backward_tc(const AttentionBackwardArgs& a, const AttnGeometry& g, const float* delta, bool ldmatrix,
                           cudaStream_t s) {
  dispatch_tc(a.dtype, g.head_dim, ldmatrix, [&]<class T, int D, bool L>() { backward<T, D, L>(a, g, delta, s); });
}

}  // namespace strata::kernels::cuda
