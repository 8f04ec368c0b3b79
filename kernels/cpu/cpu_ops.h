// The CPU backend's op set. Each op is a synchronous function (run on the calling thread,
// parallel on the compute arena) that tests and benches may call directly; CpuOps enqueues
// the same functions on a CPU stream's worker.
#pragma once
#include <chrono>
#include <functional>
#include <memory>

#include "kernels/ops.h"
#include "kernels/runtime.h"

namespace strata::kernels::cpu {

void matmul(const MatmulArgs& a);
void bias_add(const BiasAddArgs& a);
void bias_backward(const BiasBackwardArgs& a);
void embedding(const EmbeddingArgs& a);
void embedding_backward(const EmbeddingBackwardArgs& a);
void rmsnorm(const NormArgs& a);
void rmsnorm_backward(const NormBackwardArgs& a);
void layernorm(const NormArgs& a);
void layernorm_backward(const NormBackwardArgs& a);
void rope(const RopeArgs& a);
void attention(const AttentionArgs& a);
void attention_backward(const AttentionBackwardArgs& a);
void swiglu(const SwigluArgs& a);
void swiglu_backward(const SwigluBackwardArgs& a);
void gelu(const GeluArgs& a);
void gelu_backward(const GeluBackwardArgs& a);
void add(const AddArgs& a);
void cross_entropy(const CrossEntropyArgs& a);
void cross_entropy_stats(const CrossEntropyStatsArgs& a);
void cross_entropy_finish(const CrossEntropyFinishArgs& a);
void adamw(const AdamWArgs& a);
void sum_squares(const SumSquaresArgs& a);
void scale(const ScaleArgs& a);
void rank_order_sum(const RankOrderSumArgs& a);
void cast(const CastArgs& a);
void dequantize(const DequantizeArgs& a);
void dropout(const DropoutArgs& a);

// Runs fn on CPU stream s's worker, in order (s must be a CPU stream).
void enqueue(Stream& s, std::function<void()> fn);

// Opt-in per-op timing of the CPU ops run through CpuOps: with STRATA_PROFILE_OPS=1 in the
// environment each op's wall time is summed by name and a table (calls, total ms, share) goes
// to stderr at exit. Off (one branch per op) otherwise.
bool profiling_ops();
void record_op_time(const char* name, double ms);
template <class F>
void run_op(const char* name, F&& f) {
  if (!profiling_ops()) return f();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  record_op_time(name, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}
std::unique_ptr<Runtime> make_cpu_runtime();

class CpuOps final : public Ops {
 protected:
#define STRATA_CPU_OP(name, Args) \
  void do_##name(Stream& s, const Args& a) override {       \
    enqueue(s, [a] { run_op(#name, [&] { cpu::name(a); }); }); \
  }
  STRATA_CPU_OP(matmul, MatmulArgs)
  STRATA_CPU_OP(bias_add, BiasAddArgs)
  STRATA_CPU_OP(bias_backward, BiasBackwardArgs)
  STRATA_CPU_OP(embedding, EmbeddingArgs)
  STRATA_CPU_OP(embedding_backward, EmbeddingBackwardArgs)
  STRATA_CPU_OP(rmsnorm, NormArgs)
  STRATA_CPU_OP(rmsnorm_backward, NormBackwardArgs)
  STRATA_CPU_OP(layernorm, NormArgs)
  STRATA_CPU_OP(layernorm_backward, NormBackwardArgs)
  STRATA_CPU_OP(rope, RopeArgs)
  STRATA_CPU_OP(attention, AttentionArgs)
  STRATA_CPU_OP(attention_backward, AttentionBackwardArgs)
  STRATA_CPU_OP(swiglu, SwigluArgs)
  STRATA_CPU_OP(swiglu_backward, SwigluBackwardArgs)
  STRATA_CPU_OP(gelu, GeluArgs)
  STRATA_CPU_OP(gelu_backward, GeluBackwardArgs)
  STRATA_CPU_OP(add, AddArgs)
  STRATA_CPU_OP(cross_entropy, CrossEntropyArgs)
  STRATA_CPU_OP(cross_entropy_stats, CrossEntropyStatsArgs)
  STRATA_CPU_OP(cross_entropy_finish, CrossEntropyFinishArgs)
  STRATA_CPU_OP(adamw, AdamWArgs)
  STRATA_CPU_OP(sum_squares, SumSquaresArgs)
  STRATA_CPU_OP(scale, ScaleArgs)
  STRATA_CPU_OP(cast, CastArgs)
  STRATA_CPU_OP(dequantize, DequantizeArgs)
  STRATA_CPU_OP(dropout, DropoutArgs)
  STRATA_CPU_OP(rank_order_sum, RankOrderSumArgs)
#undef STRATA_CPU_OP
};

}  // namespace strata::kernels::cpu
