// CUDA causal GQA attention: the dispatcher (tensor-core kernels for bf16/fp16 with head_dim 64
// or 128 in attention_tc.cu, SIMT kernels here for the rest; STRATA_CUDA_ATTENTION=simt or
// =mma_plain overrides, see requested_impl), the backward's delta = rowsum(dO ∘ O), and the SIMT
// kernels: one warp per query (or key) row, keys (or queries) staged through shared memory 16 at a
// time, dot products reduced by a fixed butterfly. Every output element has one owner and a fixed
// summation order (dK, dV over a GQA group's query heads in head order): deterministic. Each
// query sees the keys [seg_start, its position]; chunks outside a block's windows are skipped.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kRows = 8;             // warps per block: one query (or key) row each
constexpr int kChunk = 16;           // keys (or queries) staged in shared memory at a time
constexpr int kPerLane = kSimtMaxHeadDim / 32;  // head_dim elements per lane

// Copies rows [r0, r0 + kChunk) (those < seq) of a token view into sm (kChunk, d) as fp32.
template <class T>
__device__ void stage_rows(float* sm, const T* src, int64_t stride, int r0, int seq, int d) {
  for (int i = threadIdx.x; i < kChunk * d; i += blockDim.x) {
    const int r = i / d, c = i - r * d;
    sm[i] = r0 + r < seq ? to_f32(src[static_cast<int64_t>(r0 + r) * stride + c]) : 0.f;
  }
}

// Forward: block (row block, b·Hq + h); warp w owns query t = rb·kRows + w. Online softmax
// over its keys first_key..q_pos0 + t one key at a time, in natural-log units of the scaled scores.
template <class T>
__global__ void __launch_bounds__(kRows * 32)
    attn_fwd_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                  float* __restrict__ lse, AttnGeometry g) {
  extern __shared__ float sm[];
  float* ks = sm;                  // (kChunk, D)
  float* vs = sm + kChunk * g.head_dim;  // (kChunk, D)
  const int D = g.head_dim, T_ = g.seq;
  const int rb = gridDim.x - 1 - blockIdx.x;  // late (dear) row blocks first
  const int b = blockIdx.y / g.n_heads, h = blockIdx.y % g.n_heads, kvh = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = rb * kRows + warp;
  const bool valid = t < T_;
  const T* kb = k + static_cast<int64_t>(b) * g.k_batch + static_cast<int64_t>(kvh) * D;
  const T* vb = v + static_cast<int64_t>(b) * g.v_batch + static_cast<int64_t>(kvh) * D;
  const int pos = g.q_pos0 + t, first = valid ? g.first_key(b, t) : 0;  // keys first..pos
  float qr[kPerLane], o[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + 32 * j;
    qr[j] = valid && d < D ? g.scale * to_f32(q[(static_cast<int64_t>(b) * T_ + t) * g.q_stride + h * D + d]) : 0.f;
    o[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int last = g.q_pos0 + min(T_, (rb + 1) * kRows) - 1;  // the block's last query sees keys ..last
  const int k_lo = g.warp_min_first_key(b, rb * kRows, kRows) / kChunk * kChunk;
  for (int k0 = k_lo; k0 <= last; k0 += kChunk) {
    __syncthreads();
    stage_rows(ks, kb, g.k_stride, k0, g.kv_seq, D);
    stage_rows(vs, vb, g.v_stride, k0, g.kv_seq, D);
    __syncthreads();
    if (!valid) continue;
    const int n = min(kChunk, pos - k0 + 1);  // keys k0 .. min(pos, k0 + kChunk - 1)
    for (int j = max(0, first - k0); j < n; ++j) {
      float part = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < D) part += qr[e] * ks[j * D + d];
      }
      const float s = warp_sum(part);
      const float m_new = fmaxf(m, s);
      const float corr = expf(m - m_new), p = expf(s - m_new);
      l = l * corr + p;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < D) o[e] = o[e] * corr + p * vs[j * D + d];
      }
      m = m_new;
    }
  }
  if (!valid) return;
  const float inv = 1.f / l;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < D) out[(static_cast<int64_t>(b) * T_ + t) * g.o_stride + h * D + d] = from_f32<T>(o[e] * inv);
  }
  if (lane == 0) lse[(static_cast<int64_t>(b) * g.n_heads + h) * T_ + t] = m + logf(l);
}

// delta[b, h, t] = Σ_d dO·O, one warp per row.
template <class T>
__global__ void attn_delta_kernel(const T* __restrict__ out, const T* __restrict__ dout, float* __restrict__ delta,
                                  AttnGeometry g) {
  const int64_t row = blockIdx.x * int64_t{blockDim.x / 32} + (threadIdx.x >> 5);  // (b·T + t)·Hq + h
  const int lane = threadIdx.x & 31;
  const int64_t n_rows = static_cast<int64_t>(g.batch) * g.seq * g.n_heads;
  if (row >= n_rows) return;
  const T* o = out + row * g.head_dim;  // out and dout are packed (B, T, Hq, D)
  const T* d = dout + row * g.head_dim;
  float part = 0.f;
  for (int c = lane; c < g.head_dim; c += 32) part += to_f32(o[c]) * to_f32(d[c]);
  const float s = warp_sum(part);
  const int64_t h = row % g.n_heads, bt = row / g.n_heads, t = bt % g.seq, b = bt / g.seq;
  if (lane == 0) delta[(b * g.n_heads + h) * g.seq + t] = s;
}

// dQ: as the forward, warp w owns query t; dQ = scale · Σ_j P·(dP - delta)·K_j.
template <class T>
__global__ void __launch_bounds__(kRows * 32)
    attn_bwd_dq_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                     T* __restrict__ dq, AttnGeometry g) {
  extern __shared__ float sm[];
  float* ks = sm;
  float* vs = sm + kChunk * g.head_dim;
  const int D = g.head_dim, T_ = g.seq;
  const int rb = gridDim.x - 1 - blockIdx.x;
  const int b = blockIdx.y / g.n_heads, h = blockIdx.y % g.n_heads, kvh = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = rb * kRows + warp;
  const bool valid = t < T_;
  const T* kb = k + static_cast<int64_t>(b) * g.k_batch + static_cast<int64_t>(kvh) * D;
  const T* vb = v + static_cast<int64_t>(b) * g.v_batch + static_cast<int64_t>(kvh) * D;
  const int first = valid ? g.first_key(b, t) : 0;
  const int64_t stat = (static_cast<int64_t>(b) * g.n_heads + h) * T_ + t;
  const float lse_t = valid ? lse[stat] : 0.f, delta_t = valid ? delta[stat] : 0.f;
  float qr[kPerLane], dor[kPerLane], acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    const bool in = valid && d < D;
    qr[e] = in ? g.scale * to_f32(q[(static_cast<int64_t>(b) * T_ + t) * g.q_stride + h * D + d]) : 0.f;
    dor[e] = in ? to_f32(dout[(static_cast<int64_t>(b) * T_ + t) * g.o_stride + h * D + d]) : 0.f;
    acc[e] = 0.f;
  }
  const int last = min(T_, (rb + 1) * kRows) - 1;
  const int k_lo = g.warp_min_first_key(b, rb * kRows, kRows) / kChunk * kChunk;
  for (int k0 = k_lo; k0 <= last; k0 += kChunk) {
    __syncthreads();
    stage_rows(ks, kb, g.k_stride, k0, T_, D);
    stage_rows(vs, vb, g.v_stride, k0, T_, D);
    __syncthreads();
    if (!valid) continue;
    const int n = min(kChunk, t - k0 + 1);
    for (int j = max(0, first - k0); j < n; ++j) {
      float ps = 0.f, pd = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < D) ps += qr[e] * ks[j * D + d], pd += dor[e] * vs[j * D + d];
      }
      const float p = expf(warp_sum(ps) - lse_t);
      const float ds = p * (warp_sum(pd) - delta_t);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < D) acc[e] += ds * ks[j * D + d];
      }
    }
  }
  if (!valid) return;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < D) dq[(static_cast<int64_t>(b) * T_ + t) * g.q_stride + h * D + d] = from_f32<T>(g.scale * acc[e]);
  }
}

// dK, dV: block (key block, b·Hkv + kvh), warp w owns key j = kb·kRows + w, and walks the query
// heads of its group in order, queries j..T-1 staged 16 at a time (chunks whose queries all start
// their window after the block's keys are skipped; a query i sees key j iff first_key(i) <= j).
template <class T>
__global__ void __launch_bounds__(kRows * 32)
    attn_bwd_dkdv_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                       T* __restrict__ dk, T* __restrict__ dv, AttnGeometry g) {
  extern __shared__ float sm[];
  float* qs = sm;                        // (kChunk, D)
  float* dos = sm + kChunk * g.head_dim;  // (kChunk, D)
  float* ls = dos + kChunk * g.head_dim;  // (kChunk) lse
  float* ds_ = ls + kChunk;               // (kChunk) delta
  int* fs = reinterpret_cast<int*>(ds_ + kChunk);  // (kChunk) first key of each query
  const int D = g.head_dim, T_ = g.seq;
  const int kb = blockIdx.x;  // early key blocks see the most queries: first
  const int b = blockIdx.y / g.n_kv_heads, kvh = blockIdx.y % g.n_kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = kb * kRows + warp;
  const bool valid = j < T_;
  float kr[kPerLane], vr[kPerLane], dka[kPerLane], dva[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    const bool in = valid && d < D;
    kr[e] = in ? g.scale * to_f32(k[static_cast<int64_t>(b) * g.k_batch + static_cast<int64_t>(j) * g.k_stride + kvh * D + d]) : 0.f;
    vr[e] = in ? to_f32(v[static_cast<int64_t>(b) * g.v_batch + static_cast<int64_t>(j) * g.v_stride + kvh * D + d]) : 0.f;
    dka[e] = dva[e] = 0.f;
  }
  const int first = kb * kRows;  // the block's first key: queries before it see none of its keys
  for (int gi = 0; gi < g.group; ++gi) {
    const int h = kvh * g.group + gi;
    const T* qb = q + static_cast<int64_t>(b) * T_ * g.q_stride + static_cast<int64_t>(h) * D;
    const T* ob = dout + static_cast<int64_t>(b) * T_ * g.o_stride + static_cast<int64_t>(h) * D;
    const float* lb = lse + (static_cast<int64_t>(b) * g.n_heads + h) * T_;
    const float* db = delta + (static_cast<int64_t>(b) * g.n_heads + h) * T_;
    for (int q0 = first; q0 < T_; q0 += kChunk) {
      if (g.warp_min_first_key(b, q0, kChunk) >= first + kRows) continue;  // sees none of these keys
      __syncthreads();
      stage_rows(qs, qb, g.q_stride, q0, T_, D);
      stage_rows(dos, ob, g.o_stride, q0, T_, D);
      if (threadIdx.x < kChunk) {
        const int t = q0 + threadIdx.x;
        ls[threadIdx.x] = t < T_ ? lb[t] : 0.f;
        ds_[threadIdx.x] = t < T_ ? db[t] : 0.f;
        fs[threadIdx.x] = t < T_ ? g.first_key(b, t) : 0;
      }
      __syncthreads();
      if (!valid) continue;
      for (int i = max(0, j - q0); i < kChunk && q0 + i < T_; ++i) {  // queries t >= j
        if (fs[i] > j) continue;                                        // whose window holds j
        float ps = 0.f, pd = 0.f;
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          const int d = lane + 32 * e;
          if (d < D) ps += kr[e] * qs[i * D + d], pd += vr[e] * dos[i * D + d];
        }
        const float p = expf(warp_sum(ps) - ls[i]);
        const float dsv = p * (warp_sum(pd) - ds_[i]);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          const int d = lane + 32 * e;
          if (d < D) dva[e] += p * dos[i * D + d], dka[e] += dsv * qs[i * D + d];
        }
      }
    }
  }
  if (!valid) return;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < D) {
      dk[static_cast<int64_t>(b) * g.k_batch + static_cast<int64_t>(j) * g.k_stride + kvh * D + d] =
          from_f32<T>(g.scale * dka[e]);
      dv[static_cast<int64_t>(b) * g.v_batch + static_cast<int64_t>(j) * g.v_stride + kvh * D + d] = from_f32<T>(dva[e]);
    }
  }
}

// STRATA_CUDA_ATTENTION: "simt" (SIMT kernels for every call), "mma_plain" (tensor cores with
// plain shared loads instead of ldmatrix); unset or anything else: tensor cores with ldmatrix.
enum class Impl { simt, mma_plain, mma_ldmatrix };
Impl requested_impl() {
  const char* e = std::getenv("STRATA_CUDA_ATTENTION");
  if (e && std::strcmp(e, "simt") == 0) return Impl::simt;
  if (e && std::strcmp(e, "mma_plain") == 0) return Impl::mma_plain;
  return Impl::mma_ldmatrix;
}

void check_head_dim(const AttnGeometry& g, const char* op) {
  if (g.head_dim > kSimtMaxHeadDim)
    throw std::invalid_argument(std::string(op) + ": head_dim " + std::to_string(g.head_dim) +
                                " is not supported on CUDA (at most " + std::to_string(kSimtMaxHeadDim) + ")");
}

}  // namespace

void attention_forward_simt(const AttentionArgs& a, const AttnGeometry& g, cudaStream_t s) {
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid((g.seq + kRows - 1) / kRows, g.batch * g.n_heads);
    const size_t smem = 2 * kChunk * g.head_dim * sizeof(float);
    attn_fwd_simt<T><<<grid, kRows * 32, smem, s>>>(static_cast<const T*>(a.q), static_cast<const T*>(a.k),
                                                    static_cast<const T*>(a.v), static_cast<T*>(a.out), a.lse, g);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void attention_backward_simt(const AttentionBackwardArgs& a, const AttnGeometry& g, const float* delta,
                             cudaStream_t s) {
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* q = static_cast<const T*>(a.q);
    const auto* k = static_cast<const T*>(a.k);
    const auto* v = static_cast<const T*>(a.v);
    const auto* dout = static_cast<const T*>(a.dout);
    const dim3 grid_q((g.seq + kRows - 1) / kRows, g.batch * g.n_heads);
    attn_bwd_dq_simt<T><<<grid_q, kRows * 32, 2 * kChunk * g.head_dim * sizeof(float), s>>>(
        q, k, v, dout, a.lse, delta, static_cast<T*>(a.dq), g);
    STRATA_CUDA_CHECK_LAUNCH();
    const dim3 grid_kv((g.seq + kRows - 1) / kRows, g.batch * g.n_kv_heads);
    attn_bwd_dkdv_simt<T><<<grid_kv, kRows * 32, (2 * kChunk * g.head_dim + 3 * kChunk) * sizeof(float), s>>>(
        q, k, v, dout, a.lse, delta, static_cast<T*>(a.dk), static_cast<T*>(a.dv), g);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_attention(Stream& s, const AttentionArgs& a) {
  StreamContext& ctx = context(s);
  const AttnGeometry g(a);
  check_head_dim(g, "attention");
  const Impl impl = requested_impl();
  if (impl != Impl::simt && attention_tc_supported(a, g))
    return attention_forward_tc(a, g, impl == Impl::mma_ldmatrix, ctx.stream());
  attention_forward_simt(a, g, ctx.stream());
}

void CudaOps::do_attention_backward(Stream& s, const AttentionBackwardArgs& a) {
  StreamContext& ctx = context(s);
  const AttnGeometry g(a);
  check_head_dim(g, "attention_backward");
  // delta (B, Hq, T) in the stream's scratch.
  const int64_t n_rows = static_cast<int64_t>(g.batch) * g.n_heads * g.seq;
  auto* delta = static_cast<float*>(ctx.scratch(static_cast<size_t>(n_rows) * sizeof(float)));
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    attn_delta_kernel<T><<<grid_for(n_rows, 8, INT32_MAX), 256, 0, ctx.stream()>>>(
        static_cast<const T*>(a.out), static_cast<const T*>(a.dout), delta, g);
    STRATA_CUDA_CHECK_LAUNCH();
  });
  const Impl impl = requested_impl();
  if (impl != Impl::simt && attention_tc_supported(a, g))
    return attention_backward_tc(a, g, delta, impl == Impl::mma_ldmatrix, ctx.stream());
  attention_backward_simt(a, g, delta, ctx.stream());
}

}  // namespace strata::kernels::cuda
