// CUDA token/position embedding lookup and its backward, whole or one vocabulary shard of the
// table. The backward is deterministic without atomics: token indices are stably sorted by their
// row in this table (CUB radix sort), and one block per run of equal rows adds that run's dout
// rows in token order into the fp32 table gradient. A bad id is recorded in the stream's device
// error record (reported at synchronize) and its row skipped.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// The table holds rows [row0, row0 + vocab) of a table whose ids lie in [0, id_limit).
struct Shard {
  int64_t row0, vocab, id_limit;
};

// Block t copies (or adds) table[ids[t] - row0, :] into out[t, :]; a token of another shard gets
// zeros (accumulating: nothing).
template <class T>
__global__ void embedding_kernel(const int32_t* __restrict__ ids, const T* __restrict__ table, T* __restrict__ out,
                                 int64_t dim, Shard shard, bool accumulate, DeviceErrorSink errors) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  if (id < 0 || id >= shard.id_limit) {
    if (threadIdx.x == 0) report_device_error(errors, kErrEmbedding, t, id, shard.id_limit);
    return;
  }
  const int64_t row = id - shard.row0;
  T* dst = out + t * dim;
  if (row < 0 || row >= shard.vocab) {
    if (!accumulate)
      for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = from_f32<T>(0.f);
    return;
  }
  const T* src = table + row * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x)
    dst[c] = accumulate ? from_f32<T>(to_f32(dst[c]) + to_f32(src[c])) : src[c];
}

// Sort keys: the token's row in this table, or `vocab` (sorted last, then skipped) for a bad id
// or another shard's; values: token index.
__global__ void embedding_keys_kernel(const int32_t* __restrict__ ids, uint32_t* __restrict__ keys,
                                      uint32_t* __restrict__ tokens, int64_t n_tokens, Shard shard,
                                      DeviceErrorSink errors) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= n_tokens) return;
  const int32_t id = ids[t];
  if (id < 0 || id >= shard.id_limit) report_device_error(errors, kErrEmbeddingBackward, t, id, shard.id_limit);
  const int64_t row = id - shard.row0;
  const bool here = id >= 0 && id < shard.id_limit && row >= 0 && row < shard.vocab;
  keys[t] = here ? static_cast<uint32_t>(row) : static_cast<uint32_t>(shard.vocab);
  tokens[t] = static_cast<uint32_t>(t);
}

// Block (i, y): if sorted position i starts a run of equal ids, columns [y·blockDim, ...) of
// that id's dtable row get the run's dout rows added in token order (the sort is stable).
template <class T>
__global__ void embedding_backward_kernel(const uint32_t* __restrict__ keys, const uint32_t* __restrict__ tokens,
                                          const T* __restrict__ dout, float* __restrict__ dtable, int64_t n_tokens,
                                          int64_t dim, int64_t vocab) {
  const int64_t i = blockIdx.x;
  const uint32_t id = keys[i];
  if (id >= vocab || (i > 0 && keys[i - 1] == id)) return;
  const int64_t c = blockIdx.y * int64_t{blockDim.x} + threadIdx.x;
  if (c >= dim) return;
  float acc = 0.f;
  for (int64_t j = i; j < n_tokens && keys[j] == id; ++j) acc += to_f32(dout[static_cast<int64_t>(tokens[j]) * dim + c]);
  dtable[static_cast<int64_t>(id) * dim + c] += acc;
}

int bits_for(int64_t max_value) {
  int b = 1;
  while (b < 32 && (int64_t{1} << b) <= max_value) ++b;
  return b;
}

}  // namespace

void CudaOps::do_embedding(Stream& s, const EmbeddingArgs& a) {
  StreamContext& ctx = context(s);
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    embedding_kernel<T><<<static_cast<unsigned>(a.n_tokens), kThreads, 0, ctx.stream()>>>(
        a.ids, static_cast<const T*>(a.table), static_cast<T*>(a.out), a.dim, Shard{a.row0, a.vocab, id_limit(a)},
        a.accumulate, ctx.errors());
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_embedding_backward(Stream& s, const EmbeddingBackwardArgs& a) {
  StreamContext& ctx = context(s);
  const int n = static_cast<int>(a.n_tokens);
  const int end_bit = bits_for(a.vocab);  // keys are rows of this table, in [0, vocab]
  size_t temp_bytes = 0;
  STRATA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, static_cast<const uint32_t*>(nullptr),
                                                    static_cast<uint32_t*>(nullptr),
                                                    static_cast<const uint32_t*>(nullptr),
                                                    static_cast<uint32_t*>(nullptr), n, 0, end_bit, ctx.stream()));
  ScratchPlan plan;
  const size_t words = static_cast<size_t>(n) * sizeof(uint32_t);
  const size_t at_keys = plan.add(words), at_keys_sorted = plan.add(words), at_tok = plan.add(words),
               at_tok_sorted = plan.add(words), at_temp = plan.add(temp_bytes);
  char* base = static_cast<char*>(ctx.scratch(plan.total()));
  auto* keys = reinterpret_cast<uint32_t*>(base + at_keys);                // (n_tokens)
  auto* keys_sorted = reinterpret_cast<uint32_t*>(base + at_keys_sorted);  // (n_tokens)
  auto* tokens = reinterpret_cast<uint32_t*>(base + at_tok);               // (n_tokens)
  auto* tokens_sorted = reinterpret_cast<uint32_t*>(base + at_tok_sorted); // (n_tokens)
  embedding_keys_kernel<<<grid_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
      a.ids, keys, tokens, a.n_tokens, Shard{a.row0, a.vocab, id_limit(a)}, ctx.errors());
  STRATA_CUDA_CHECK_LAUNCH();
  STRATA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + at_temp, temp_bytes, keys, keys_sorted, tokens,
                                                    tokens_sorted, n, 0, end_bit, ctx.stream()));
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>((a.dim + kThreads - 1) / kThreads));
    embedding_backward_kernel<T><<<grid, kThreads, 0, ctx.stream()>>>(
        keys_sorted, tokens_sorted, static_cast<const T*>(a.dout), a.dtable, a.n_tokens, a.dim, a.vocab);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata::kernels::cuda
