// The CUDA backend's op set and what its ops need from the runtime: a stream's native handle,
// its device scratch and its device error record (internal header: CUDA types are allowed here,
// never in the public headers). One .cu/.cpp per op family implements the do_* hooks.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "kernels/ops.h"
#include "kernels/runtime.h"

namespace strata::kernels::cuda {

// Which op found bad data on the device (DeviceErrorRecord::op; 0 = no error).
enum DeviceErrorOp : int {
  kNoDeviceError = 0,
  kErrEmbedding = 1,
  kErrEmbeddingBackward = 2,
  kErrCrossEntropy = 3,
  kErrCrossEntropyStats = 4,
  kErrCrossEntropyFinish = 5,
};

// The first bad token id a kernel met on a stream, in host-mapped pinned memory: the GPU writes
// it, the host reads it after the stream (or an event) synchronizes. See DeviceErrorSink.
struct DeviceErrorRecord {
  int op;  // DeviceErrorOp, written last
  int pad;
  long long row, value, limit;  // offending row/token, its id, the vocabulary size
};

// What a kernel gets to report bad data. The first reporting thread wins `claim` (device memory,
// atomicCAS 0 -> 1; int atomics only) and fills `record`; the rest drop theirs. The host checks
// record->op after synchronizing and throws std::out_of_range naming the op (runtime.cpp).
struct DeviceErrorSink {
  int* claim = nullptr;                  // device memory
  DeviceErrorRecord* record = nullptr;   // device pointer of host-mapped memory
};

#ifdef __CUDACC__
__device__ inline void report_device_error(DeviceErrorSink sink, int op, long long row, long long value,
                                           long long limit) {
  if (atomicCAS(sink.claim, 0, 1) != 0) return;
  volatile DeviceErrorRecord* r = sink.record;
  r->row = row;
  r->value = value;
  r->limit = limit;
  __threadfence_system();
  r->op = op;
}
#endif

// What the ops see of a CUDA stream.
class StreamContext {
 public:
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  DeviceErrorSink errors() const { return errors_; }
  // Device scratch of at least `bytes` (256-byte aligned), valid for work enqueued on this stream
  // until the next scratch() call: stream order makes the reuse safe. Grows stream-ordered
  // (cudaFreeAsync + cudaMallocAsync), so after the first steps it never allocates.
  virtual void* scratch(size_t bytes) = 0;

 protected:
  ~StreamContext() = default;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
  DeviceErrorSink errors_;
};

// The context of a CUDA stream, with the stream's device made current on the calling thread
// (every op calls this first). Throws std::invalid_argument for another runtime's stream.
StreamContext& context(Stream& s);
cudaStream_t native(Stream& s);

// Carves 256-byte-aligned pieces out of one scratch block: first sum the sizes with add(), then
// take the pieces in the same order from the block.
class ScratchPlan {
 public:
  static size_t round(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
  size_t add(size_t bytes) {
    const size_t at = total_;
    total_ += round(bytes);
    return at;
  }
  size_t total() const { return total_ ? total_ : 256; }

 private:
  size_t total_ = 0;
};

class MatmulEngine;  // matmul.cpp: the cuBLASLt handle and the per-shape plan cache

class CudaOps final : public Ops {
 public:
  explicit CudaOps(int device);
  ~CudaOps() override;
  MatmulEngine& matmul_engine() { return *matmul_; }

 protected:
  void do_matmul(Stream& s, const MatmulArgs& a) override;
  void do_bias_add(Stream& s, const BiasAddArgs& a) override;
  void do_bias_backward(Stream& s, const BiasBackwardArgs& a) override;
  void do_embedding(Stream& s, const EmbeddingArgs& a) override;
  void do_embedding_backward(Stream& s, const EmbeddingBackwardArgs& a) override;
  void do_rmsnorm(Stream& s, const NormArgs& a) override;
  void do_rmsnorm_backward(Stream& s, const NormBackwardArgs& a) override;
  void do_layernorm(Stream& s, const NormArgs& a) override;
  void do_layernorm_backward(Stream& s, const NormBackwardArgs& a) override;
  void do_rope(Stream& s, const RopeArgs& a) override;
  void do_attention(Stream& s, const AttentionArgs& a) override;
  void do_attention_backward(Stream& s, const AttentionBackwardArgs& a) override;
  void do_swiglu(Stream& s, const SwigluArgs& a) override;
  void do_swiglu_backward(Stream& s, const SwigluBackwardArgs& a) override;
  void do_gelu(Stream& s, const GeluArgs& a) override;
  void do_gelu_backward(Stream& s, const GeluBackwardArgs& a) override;
  void do_add(Stream& s, const AddArgs& a) override;
  void do_cross_entropy(Stream& s, const CrossEntropyArgs& a) override;
  void do_cross_entropy_stats(Stream& s, const CrossEntropyStatsArgs& a) override;
  void do_cross_entropy_finish(Stream& s, const CrossEntropyFinishArgs& a) override;
  void do_adamw(Stream& s, const AdamWArgs& a) override;
  void do_sum_squares(Stream& s, const SumSquaresArgs& a) override;
  void do_scale(Stream& s, const ScaleArgs& a) override;
  void do_cast(Stream& s, const CastArgs& a) override;
  void do_dequantize(Stream& s, const DequantizeArgs& a) override;
  void do_dropout(Stream& s, const DropoutArgs& a) override;
  void do_rank_order_sum(Stream& s, const RankOrderSumArgs& a) override;

 private:
  int device_;
  std::unique_ptr<MatmulEngine> matmul_;
};

}  // namespace strata::kernels::cuda
