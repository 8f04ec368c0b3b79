// CPU RMSNorm and LayerNorm, forward and backward. Row statistics in fp32 (mean, rstd saved for
// backward); the weight/bias gradients are reduced over rows through fixed row blocks whose
// partial sums are added in block order, so results are deterministic and race-free.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"

namespace strata::kernels::cpu {
namespace {

constexpr int kLanes = 16;  // independent fp32 accumulators: lets the compiler vectorise sums

// Σ x and Σ x² of one row in fp32.
template <class E>
inline __attribute__((always_inline)) void row_sums(const typename E::T* x, int64_t n, float& sum, float& sum_sq) {
  float s[kLanes] = {}, q[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = E::load(x[i + j]);
      s[j] += v;
      q[j] += v * v;
    }
  }
  float ts = 0.f, tq = 0.f;
  for (; i < n; ++i) {
    const float v = E::load(x[i]);
    ts += v;
    tq += v * v;
  }
  for (int j = 0; j < kLanes; ++j) ts += s[j], tq += q[j];
  sum = ts;
  sum_sq = tq;
}

// Σ (x - mean)² of one row in fp32 (two-pass variance: no cancellation for large means).
template <class E>
inline __attribute__((always_inline)) float row_centered_sq(const typename E::T* x, int64_t n, float mean) {
  float q[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float d = E::load(x[i + j]) - mean;
      q[j] += d * d;
    }
  }
  float tq = 0.f;
  for (; i < n; ++i) {
    const float d = E::load(x[i]) - mean;
    tq += d * d;
  }
  for (int j = 0; j < kLanes; ++j) tq += q[j];
  return tq;
}

template <class E, bool kLayerNorm>
void norm_forward(const NormArgs& a) {
  using T = typename E::T;
  const int64_t cols = a.cols;
  const T* x = static_cast<const T*>(a.x);         // (rows, cols)
  const T* w = static_cast<const T*>(a.weight);    // (cols)
  const T* b = static_cast<const T*>(a.bias);      // (cols) or null
  T* y = static_cast<T*>(a.y);                     // (rows, cols)
  const float inv_n = 1.f / static_cast<float>(cols);
  parallel_simd(a.rows, row_grain(cols, 8192), [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * cols;
      T* yr = y + r * cols;
      float sum, sum_sq;
      row_sums<E>(xr, cols, sum, sum_sq);
      if constexpr (kLayerNorm) {
        const float mean = sum * inv_n;
        const float rstd = 1.f / std::sqrt(row_centered_sq<E>(xr, cols, mean) * inv_n + a.eps);
        a.mean[r] = mean;
        a.rstd[r] = rstd;
        for (int64_t c = 0; c < cols; ++c) {
          float v = (E::load(xr[c]) - mean) * rstd * E::load(w[c]);
          if (b) v += E::load(b[c]);
          yr[c] = E::store(v);
        }
      } else {
        const float rstd = 1.f / std::sqrt(sum_sq * inv_n + a.eps);
        a.rstd[r] = rstd;
        for (int64_t c = 0; c < cols; ++c) yr[c] = E::store(E::load(xr[c]) * rstd * E::load(w[c]));
      }
    }
  });
}

// With xhat = (x - mean)·rstd (mean = 0 for RMSNorm) and g = dy·weight:
//   RMSNorm:   dx = rstd · (g - xhat · mean(g·xhat))
//   LayerNorm: dx = rstd · (g - mean(g) - xhat · mean(g·xhat))
//   dweight += Σ_rows dy·xhat,  dbias += Σ_rows dy
template <class E, bool kLayerNorm>
void norm_backward(const NormBackwardArgs& a) {
  using T = typename E::T;
  const int64_t rows = a.rows, cols = a.cols;
  const T* x = static_cast<const T*>(a.x);        // (rows, cols)
  const T* w = static_cast<const T*>(a.weight);   // (cols)
  const T* dy = static_cast<const T*>(a.dy);      // (rows, cols)
  T* dx = static_cast<T*>(a.dx);                  // (rows, cols)
  const bool with_db = kLayerNorm && a.dbias != nullptr;
  const float inv_n = 1.f / static_cast<float>(cols);

  // Fixed row blocks (their count depends only on rows): block k writes partial sums
  // part_dw[k, :] and part_db[k, :], then columns are reduced over blocks in order.
  constexpr int64_t kMaxBlocks = 64;
  const int64_t rows_per_block = (rows + std::min(rows, kMaxBlocks) - 1) / std::min(rows, kMaxBlocks);
  const int64_t n_blocks = (rows + rows_per_block - 1) / rows_per_block;
  float* part_dw = thread_scratch<struct NormPartials>(static_cast<size_t>(n_blocks * cols * (with_db ? 2 : 1)));  // (n_blocks, cols)
  float* part_db = with_db ? part_dw + n_blocks * cols : nullptr;                             // (n_blocks, cols)

  parallel_simd(n_blocks, 1, [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t blk = lo; blk < hi; ++blk) {
      float* pdw = part_dw + blk * cols;
      float* pdb = with_db ? part_db + blk * cols : nullptr;
      std::fill(pdw, pdw + cols, 0.f);
      if (pdb) std::fill(pdb, pdb + cols, 0.f);
      const int64_t r_end = std::min(rows, (blk + 1) * rows_per_block);
      for (int64_t r = blk * rows_per_block; r < r_end; ++r) {
        const T* xr = x + r * cols;
        const T* dyr = dy + r * cols;
        T* dxr = dx + r * cols;
        const float mean = kLayerNorm ? a.mean[r] : 0.f, rstd = a.rstd[r];
        float sg[kLanes] = {}, sgx[kLanes] = {};
        int64_t c = 0;
        for (; c + kLanes <= cols; c += kLanes) {
          for (int j = 0; j < kLanes; ++j) {
            const float xhat = (E::load(xr[c + j]) - mean) * rstd;
            const float d = E::load(dyr[c + j]);
            const float g = d * E::load(w[c + j]);
            sg[j] += g;
            sgx[j] += g * xhat;
            pdw[c + j] += d * xhat;
            if (pdb) pdb[c + j] += d;
          }
        }
        float tg = 0.f, tgx = 0.f;
        for (; c < cols; ++c) {
          const float xhat = (E::load(xr[c]) - mean) * rstd;
          const float d = E::load(dyr[c]);
          const float g = d * E::load(w[c]);
          tg += g;
          tgx += g * xhat;
          pdw[c] += d * xhat;
          if (pdb) pdb[c] += d;
        }
        for (int j = 0; j < kLanes; ++j) tg += sg[j], tgx += sgx[j];
        const float mean_g = kLayerNorm ? tg * inv_n : 0.f, mean_gx = tgx * inv_n;
        for (c = 0; c < cols; ++c) {
          const float xhat = (E::load(xr[c]) - mean) * rstd;
          const float g = E::load(dyr[c]) * E::load(w[c]);
          float v = rstd * (g - mean_g - xhat * mean_gx);
          if (a.accumulate) v += E::load(dxr[c]);
          dxr[c] = E::store(v);
        }
      }
    }
  });

  if (!a.dweight) return;  // a frozen norm: the input gradient only
  parallel_simd(cols, 1024, [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t c = lo; c < hi; ++c) {
      float sw = 0.f, sb = 0.f;
      for (int64_t blk = 0; blk < n_blocks; ++blk) {
        sw += part_dw[blk * cols + c];
        if (part_db) sb += part_db[blk * cols + c];
      }
      a.dweight[c] += sw;
      if (part_db) a.dbias[c] += sb;
    }
  });
}

}  // namespace

void rmsnorm(const NormArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { norm_forward<decltype(e), false>(a); });
}
void layernorm(const NormArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { norm_forward<decltype(e), true>(a); });
}
void rmsnorm_backward(const NormBackwardArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { norm_backward<decltype(e), false>(a); });
}
void layernorm_backward(const NormBackwardArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { norm_backward<decltype(e), true>(a); });
}

}  // namespace strata::kernels::cpu
