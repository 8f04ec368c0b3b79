// CPU token/position embedding lookup and its backward (scatter-add into the fp32 table
// gradient), whole or one vocabulary shard of the table. Ids are checked before anything is
// written; the backward partitions the embedding dimension across tasks so no two tasks touch
// the same dtable element (deterministic, no races).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"

namespace strata::kernels::cpu {
namespace {

void check_ids(const char* op, const int32_t* ids, int64_t n_tokens, int64_t vocab) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab) {
      throw std::out_of_range(std::string(op) + ": token " + std::to_string(t) + " has id " +
                              std::to_string(ids[t]) + " outside [0, " + std::to_string(vocab) + ")");
    }
  }
}

// The row of token t in this table (rows [row0, row0 + vocab) of the full one), or -1 when its
// id lies in another shard.
template <class A>
int64_t local_row(const A& a, int64_t t) {
  const int64_t row = static_cast<int64_t>(a.ids[t]) - a.row0;
  return row >= 0 && row < a.vocab ? row : -1;
}

template <class E>
void embedding_impl(const EmbeddingArgs& a) {
  using T = typename E::T;
  const int64_t dim = a.dim;
  const T* table = static_cast<const T*>(a.table);  // (vocab, dim)
  T* out = static_cast<T*>(a.out);                  // (n_tokens, dim)
  parallel_simd(a.n_tokens, row_grain(dim), [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t row = local_row(a, t);
      T* dst = out + t * dim;
      if (row < 0) {  // another shard's token: zero (or, accumulating, unchanged)
        if (!a.accumulate) std::memset(dst, 0, static_cast<size_t>(dim) * sizeof(T));
        continue;
      }
      const T* src = table + row * dim;
      if (a.accumulate) {
        for (int64_t c = 0; c < dim; ++c) dst[c] = E::store(E::load(dst[c]) + E::load(src[c]));
      } else {
        std::memcpy(dst, src, static_cast<size_t>(dim) * sizeof(T));
      }
    }
  });
}

// Each task owns a block of columns [c0, c1) of every dtable row and walks all tokens in
// order: every element's sum is formed in token order whatever the thread count.
template <class E>
void embedding_backward_impl(const EmbeddingBackwardArgs& a) {
  using T = typename E::T;
  const int64_t dim = a.dim, n_tokens = a.n_tokens;
  const T* dout = static_cast<const T*>(a.dout);  // (n_tokens, dim)
  float* dtable = a.dtable;                       // (vocab, dim) fp32
  // Blocks of whole cache lines (16 floats) so tasks never share a line; enough blocks for
  // every thread when dim allows.
  const int64_t want_blocks = std::max<int64_t>(1, 4 * num_threads());
  int64_t block = (dim + want_blocks - 1) / want_blocks;
  block = std::max<int64_t>(16, (block + 15) / 16 * 16);
  const int64_t n_blocks = (dim + block - 1) / block;
  parallel_simd(n_blocks, 1, [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    const int64_t c0 = lo * block, c1 = std::min(dim, hi * block);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const int64_t row = local_row(a, t);
      if (row < 0) continue;  // another shard's row
      const T* src = dout + t * dim;
      float* dst = dtable + row * dim;
      for (int64_t c = c0; c < c1; ++c) dst[c] += E::load(src[c]);
    }
  });
}

}  // namespace

void embedding(const EmbeddingArgs& a) {
  check_ids("embedding", a.ids, a.n_tokens, id_limit(a));
  dispatch_dtype(a.dtype, [&](auto e) { embedding_impl<decltype(e)>(a); });
}
void embedding_backward(const EmbeddingBackwardArgs& a) {
  check_ids("embedding_backward", a.ids, a.n_tokens, id_limit(a));
  dispatch_dtype(a.dtype, [&](auto e) { embedding_backward_impl<decltype(e)>(a); });
}

}  // namespace strata::kernels::cpu
