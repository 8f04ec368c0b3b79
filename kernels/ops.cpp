// Argument validation shared by every backend, and the Ops front door (validate, then enqueue).
#include "kernels/ops.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace strata::kernels {
namespace {

[[noreturn]] void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string(op) + ": " + what);
}
void need(bool ok, const char* op, const std::string& what) {
  if (!ok) fail(op, what);
}
void need_ptr(const void* p, const char* op, const char* field) {
  if (!p) fail(op, std::string(field) + " is null");
}
void need_pos(int64_t v, const char* op, const char* field) {
  if (v <= 0) fail(op, std::string(field) + " must be > 0 (got " + std::to_string(v) + ")");
}

}  // namespace

void validate(const MatmulArgs& a) {
  const char* op = "matmul";
  need_pos(a.m, op, "m");
  need_pos(a.n, op, "n");
  need_pos(a.k, op, "k");
  need_pos(a.batch, op, "batch");
  need_ptr(a.a, op, "a");
  need_ptr(a.b, op, "b");
  need_ptr(a.c, op, "c");
  need(a.c_dtype == DType::f32 || a.c_dtype == a.ab_dtype, op,
       "c dtype must be fp32 or the input dtype (got " + std::string(dtype_name(a.c_dtype)) + " for " +
           std::string(dtype_name(a.ab_dtype)) + " inputs)");
  const int64_t a_cols = a.trans_a ? a.m : a.k, b_cols = a.trans_b ? a.k : a.n;
  need(a.lda == 0 || a.lda >= a_cols, op, "lda " + std::to_string(a.lda) + " < row length " + std::to_string(a_cols));
  need(a.ldb == 0 || a.ldb >= b_cols, op, "ldb " + std::to_string(a.ldb) + " < row length " + std::to_string(b_cols));
  need(a.ldc == 0 || a.ldc >= a.n, op, "ldc " + std::to_string(a.ldc) + " < n " + std::to_string(a.n));
  need(a.stride_a >= 0 && a.stride_b >= 0 && a.stride_c >= 0, op, "negative batch stride");
}

void validate(const BiasAddArgs& a) {
  need_pos(a.rows, "bias_add", "rows");
  need_pos(a.cols, "bias_add", "cols");
  need_ptr(a.y, "bias_add", "y");
  need_ptr(a.bias, "bias_add", "bias");
}
void validate(const BiasBackwardArgs& a) {
  need_pos(a.rows, "bias_backward", "rows");
  need_pos(a.cols, "bias_backward", "cols");
  need_ptr(a.dy, "bias_backward", "dy");
  need_ptr(a.dbias, "bias_backward", "dbias");
}

namespace {
// Sizes and the shard's place in the full table, common to the forward and the backward.
template <class A>
void validate_embedding_shape(const A& a, const char* op) {
  need_pos(a.n_tokens, op, "n_tokens");
  need_pos(a.dim, op, "dim");
  need_pos(a.vocab, op, "vocab");
  need_ptr(a.ids, op, "ids");
  need(a.full_vocab >= 0, op, "full_vocab must be >= 0 (got " + std::to_string(a.full_vocab) + ")");
  if (a.full_vocab == 0) {
    need(a.row0 == 0, op, "row0 must be 0 when full_vocab is 0 (got " + std::to_string(a.row0) + ")");
  } else {
    need(a.row0 >= 0 && a.row0 + a.vocab <= a.full_vocab, op,
         "row0 " + std::to_string(a.row0) + " + vocab " + std::to_string(a.vocab) + " outside full_vocab " +
             std::to_string(a.full_vocab));
  }
}
}  // namespace

void validate(const EmbeddingArgs& a) {
  const char* op = "embedding";
  validate_embedding_shape(a, op);
  need_ptr(a.table, op, "table");
  need_ptr(a.out, op, "out");
}
void validate(const EmbeddingBackwardArgs& a) {
  const char* op = "embedding_backward";
  validate_embedding_shape(a, op);
  need_ptr(a.dout, op, "dout");
  need_ptr(a.dtable, op, "dtable");
}

void validate(const NormArgs& a, bool layernorm) {
  const char* op = layernorm ? "layernorm" : "rmsnorm";
  need_pos(a.rows, op, "rows");
  need_pos(a.cols, op, "cols");
  need(a.eps >= 0.f, op, "eps must be >= 0");
  need_ptr(a.x, op, "x");
  need_ptr(a.weight, op, "weight");
  need_ptr(a.y, op, "y");
  need_ptr(a.rstd, op, "rstd");
  if (layernorm) need_ptr(a.mean, op, "mean");
  else need(a.bias == nullptr, op, "rmsnorm takes no bias");
}
void validate(const NormBackwardArgs& a, bool layernorm) {
  const char* op = layernorm ? "layernorm_backward" : "rmsnorm_backward";
  need_pos(a.rows, op, "rows");
  need_pos(a.cols, op, "cols");
  need_ptr(a.x, op, "x");
  need_ptr(a.weight, op, "weight");
  need_ptr(a.dy, op, "dy");
  need_ptr(a.rstd, op, "rstd");
  need_ptr(a.dx, op, "dx");
  // dweight null: a frozen norm (the input gradient only); then no dbias either.
  need(a.dweight != nullptr || a.dbias == nullptr, op, "dbias without dweight");
  if (layernorm) need_ptr(a.mean, op, "mean");
  else need(a.dbias == nullptr, op, "rmsnorm has no dbias");
}

void validate(const RopeArgs& a) {
  const char* op = "rope";
  need_pos(a.batch, op, "batch");
  need_pos(a.seq, op, "seq");
  need_pos(a.heads, op, "heads");
  need_pos(a.head_dim, op, "head_dim");
  need(a.head_dim % 2 == 0, op, "head_dim must be even (got " + std::to_string(a.head_dim) + ")");
  need(a.token_stride == 0 || a.token_stride >= a.heads * a.head_dim, op, "token_stride < heads*head_dim");
  need(!a.pos || a.pos0 == 0, op, "pos0 must be 0 when pos is set (got " + std::to_string(a.pos0) + ")");
  need(a.pos0 >= 0 && a.pos0 + a.seq <= a.max_pos, op,
       "positions " + std::to_string(a.pos0) + "+" + std::to_string(a.seq) + " exceed the table's " +
           std::to_string(a.max_pos) + " rows");
  need_ptr(a.x, op, "x");
  need_ptr(a.cos, op, "cos");
  need_ptr(a.sin, op, "sin");
}

namespace {
template <class A>
void validate_attention_shape(const A& a, const char* op) {
  need_pos(a.batch, op, "batch");
  need_pos(a.seq, op, "seq");
  need_pos(a.n_heads, op, "n_heads");
  need_pos(a.n_kv_heads, op, "n_kv_heads");
  need_pos(a.head_dim, op, "head_dim");
  need(a.n_heads % a.n_kv_heads == 0, op,
       "n_heads " + std::to_string(a.n_heads) + " is not a multiple of n_kv_heads " + std::to_string(a.n_kv_heads));
  need(a.q_stride == 0 || a.q_stride >= a.n_heads * a.head_dim, op, "q_stride < n_heads*head_dim");
  need(a.k_stride == 0 || a.k_stride >= a.n_kv_heads * a.head_dim, op, "k_stride < n_kv_heads*head_dim");
  need(a.v_stride == 0 || a.v_stride >= a.n_kv_heads * a.head_dim, op, "v_stride < n_kv_heads*head_dim");
  need(a.scale >= 0.f, op, "scale must be >= 0");
  need_ptr(a.q, op, "q");
  need_ptr(a.k, op, "k");
  need_ptr(a.v, op, "v");
}
}  // namespace

void validate(const AttentionArgs& a) {
  const char* op = "attention";
  validate_attention_shape(a, op);
  const int64_t kv_seq = kv_seq_of(a);
  need(a.kv_seq >= 0 && kv_seq >= a.seq, op,
       "kv_seq " + std::to_string(a.kv_seq) + " < seq " + std::to_string(a.seq));
  const int64_t k_stride = a.k_stride ? a.k_stride : a.n_kv_heads * a.head_dim;
  const int64_t v_stride = a.v_stride ? a.v_stride : a.n_kv_heads * a.head_dim;
  need(a.kv_batch_stride == 0 || a.kv_batch_stride >= kv_seq * std::max(k_stride, v_stride), op,
       "kv_batch_stride " + std::to_string(a.kv_batch_stride) + " < kv_seq * token stride");
  need_ptr(a.out, "attention", "out");
  need_ptr(a.lse, "attention", "lse");
}
void validate(const AttentionBackwardArgs& a) {
  const char* op = "attention_backward";
  validate_attention_shape(a, op);
  need_ptr(a.out, op, "out");
  need_ptr(a.dout, op, "dout");
  need_ptr(a.lse, op, "lse");
  need_ptr(a.dq, op, "dq");
  need_ptr(a.dk, op, "dk");
  need_ptr(a.dv, op, "dv");
}

void validate(const SwigluArgs& a) {
  need_pos(a.rows, "swiglu", "rows");
  need_pos(a.cols, "swiglu", "cols");
  need(a.ld == 0 || a.ld >= a.cols, "swiglu", "ld < cols");
  need_ptr(a.gate, "swiglu", "gate");
  need_ptr(a.up, "swiglu", "up");
  need_ptr(a.out, "swiglu", "out");
}
void validate(const SwigluBackwardArgs& a) {
  const char* op = "swiglu_backward";
  need_pos(a.rows, op, "rows");
  need_pos(a.cols, op, "cols");
  need(a.ld == 0 || a.ld >= a.cols, op, "ld < cols");
  need_ptr(a.gate, op, "gate");
  need_ptr(a.up, op, "up");
  need_ptr(a.dout, op, "dout");
  need_ptr(a.dgate, op, "dgate");
  need_ptr(a.dup, op, "dup");
}

void validate(const GeluArgs& a) {
  need_pos(a.n, "gelu", "n");
  need_ptr(a.x, "gelu", "x");
  need_ptr(a.y, "gelu", "y");
}
void validate(const GeluBackwardArgs& a) {
  need_pos(a.n, "gelu_backward", "n");
  need_ptr(a.x, "gelu_backward", "x");
  need_ptr(a.dy, "gelu_backward", "dy");
  need_ptr(a.dx, "gelu_backward", "dx");
}

void validate(const AddArgs& a) {
  need_pos(a.n, "add", "n");
  need_ptr(a.a, "add", "a");
  need_ptr(a.b, "add", "b");
  need_ptr(a.out, "add", "out");
}

void validate(const CrossEntropyArgs& a) {
  const char* op = "cross_entropy";
  need_pos(a.rows, op, "rows");
  need_pos(a.vocab, op, "vocab");
  need(a.ld == 0 || a.ld >= a.vocab, op, "ld < vocab");
  need_ptr(a.logits, op, "logits");
  need_ptr(a.targets, op, "targets");
  need(a.losses || a.dlogits, op, "neither losses nor dlogits is set: nothing to compute");
}

namespace {
// The shard's shape and place in the vocabulary, common to both vocabulary-parallel ops.
template <class A>
void validate_vocab_shard(const A& a, const char* op) {
  need(a.dtype == DType::f32 || a.dtype == DType::bf16 || a.dtype == DType::f16, op,
       "dtype must be f32, bf16 or f16 (got " + std::to_string(static_cast<int>(a.dtype)) + ")");
  need(a.rows >= 0, op, "rows must be >= 0 (got " + std::to_string(a.rows) + ")");
  need_pos(a.vocab, op, "vocab");
  need(a.ld == 0 || a.ld >= a.vocab, op, "ld < vocab");
  need_pos(a.full_vocab, op, "full_vocab");
  need(a.vocab_start >= 0 && a.vocab_start + a.vocab <= a.full_vocab, op,
       "vocab_start " + std::to_string(a.vocab_start) + " + vocab " + std::to_string(a.vocab) +
           " outside full_vocab " + std::to_string(a.full_vocab));
  if (a.rows > 0) need_ptr(a.targets, op, "targets");
}
}  // namespace

void validate(const CrossEntropyStatsArgs& a) {
  const char* op = "cross_entropy_stats";
  validate_vocab_shard(a, op);
  if (a.rows == 0) return;
  need_ptr(a.logits, op, "logits");
  need_ptr(a.stats, op, "stats");
}
void validate(const CrossEntropyFinishArgs& a) {
  const char* op = "cross_entropy_finish";
  validate_vocab_shard(a, op);
  need(a.parts >= 1, op, "parts must be >= 1 (got " + std::to_string(a.parts) + ")");
  need(a.losses || a.dlogits, op, "neither losses nor dlogits is set: nothing to compute");
  if (a.rows == 0) return;
  need_ptr(a.all_stats, op, "all_stats");
  if (a.dlogits) need_ptr(a.logits, op, "logits");
}

void validate(const AdamWArgs& a) {
  const char* op = "adamw";
  need_pos(a.n, op, "n");
  need_ptr(a.param, op, "param");
  need_ptr(a.grad, op, "grad");
  need_ptr(a.m, op, "m");
  need_ptr(a.v, op, "v");
  need(a.step >= 1, op, "step counts from 1 (got " + std::to_string(a.step) + ")");
  need(a.beta1 >= 0.f && a.beta1 < 1.f, op, "beta1 must be in [0, 1)");
  need(a.beta2 >= 0.f && a.beta2 < 1.f, op, "beta2 must be in [0, 1)");
  need(a.eps >= 0.f, op, "eps must be >= 0");
  need(!a.param_copy || a.copy_dtype != DType::f32 || a.param_copy != a.param, op, "param_copy aliases param");
  // An input either is its output (in place) or lies apart from it: a partial overlap would read
  // bytes the step already wrote.
  const auto apart = [&](const float* in, const float* out) {
    return !in || in == out || in + a.n <= out || out + a.n <= in;
  };
  need(apart(a.param_in, a.param) && apart(a.m_in, a.m) && apart(a.v_in, a.v), op,
       "an input (param_in, m_in or v_in) partly overlaps its output");
}

void validate(const SumSquaresArgs& a) {
  need_pos(a.n, "sum_squares", "n");
  need_ptr(a.x, "sum_squares", "x");
  need_ptr(a.out, "sum_squares", "out");
}
void validate(const ScaleArgs& a) {
  need_pos(a.n, "scale", "n");
  need_ptr(a.x, "scale", "x");
}
void validate(const RankOrderSumArgs& a) {
  need_pos(a.n, "rank_order_sum", "n");
  need_ptr(a.mine, "rank_order_sum", "mine");
  need_ptr(a.out, "rank_order_sum", "out");
  need(a.world >= 1 && a.me >= 0 && a.me < a.world, "rank_order_sum", "me outside [0, world)");
  if (a.world > 1) {
    need_ptr(a.others, "rank_order_sum", "others");
    need(a.others_stride >= a.n, "rank_order_sum", "others_stride shorter than n");
  }
}
void validate(const CastArgs& a) {
  need_pos(a.n, "cast", "n");
  need_ptr(a.src, "cast", "src");
  need_ptr(a.dst, "cast", "dst");
}

void validate(const DequantizeArgs& a) {
  need_pos(a.rows, "dequantize", "rows");
  need_pos(a.cols, "dequantize", "cols");
  need(a.row_lo >= 0 && a.row_lo < a.hi() && a.hi() <= a.rows, "dequantize", "row range outside the matrix");
  need_ptr(a.codes, "dequantize", "codes");
  need_ptr(a.out, "dequantize", "out");
  if (a.format == StoredFormat::int8 || a.format == StoredFormat::nf4) need_ptr(a.scales, "dequantize", "scales");
  if (a.format == StoredFormat::nf4) {
    need_ptr(a.absmax_codes, "dequantize", "absmax_codes");
    need_ptr(a.levels, "dequantize", "levels");
    need_ptr(a.map, "dequantize", "map");
  }
}

void validate(const DropoutArgs& a) {
  need_pos(a.n, "dropout", "n");
  need_ptr(a.x, "dropout", "x");
  need_ptr(a.out, "dropout", "out");
  need(a.p >= 0.f && a.p < 1.f, "dropout", "p outside [0, 1)");
  need(a.mask_cols == 0 || (a.cols > 0 && a.n % a.cols == 0 && a.mask_col0 >= 0 && a.mask_col0 + a.cols <= a.mask_cols),
       "dropout", "a mask slice needs cols > 0 dividing n and [mask_col0, mask_col0 + cols) inside mask_cols");
}

#define STRATA_OP(name, Args, ...)                    \
  void Ops::name(Stream& s, const Args& a) {          \
    validate(a __VA_OPT__(, ) __VA_ARGS__);           \
    do_##name(s, a);                                  \
  }
STRATA_OP(matmul, MatmulArgs)
STRATA_OP(bias_add, BiasAddArgs)
STRATA_OP(bias_backward, BiasBackwardArgs)
STRATA_OP(embedding, EmbeddingArgs)
STRATA_OP(embedding_backward, EmbeddingBackwardArgs)
STRATA_OP(rmsnorm, NormArgs, false)
STRATA_OP(rmsnorm_backward, NormBackwardArgs, false)
STRATA_OP(layernorm, NormArgs, true)
STRATA_OP(layernorm_backward, NormBackwardArgs, true)
STRATA_OP(rope, RopeArgs)
STRATA_OP(attention, AttentionArgs)
STRATA_OP(attention_backward, AttentionBackwardArgs)
STRATA_OP(swiglu, SwigluArgs)
STRATA_OP(swiglu_backward, SwigluBackwardArgs)
STRATA_OP(gelu, GeluArgs)
STRATA_OP(gelu_backward, GeluBackwardArgs)
STRATA_OP(add, AddArgs)
STRATA_OP(cross_entropy, CrossEntropyArgs)
STRATA_OP(cross_entropy_stats, CrossEntropyStatsArgs)
STRATA_OP(cross_entropy_finish, CrossEntropyFinishArgs)
STRATA_OP(adamw, AdamWArgs)
STRATA_OP(sum_squares, SumSquaresArgs)
STRATA_OP(scale, ScaleArgs)
STRATA_OP(cast, CastArgs)
STRATA_OP(dequantize, DequantizeArgs)
STRATA_OP(dropout, DropoutArgs)
STRATA_OP(rank_order_sum, RankOrderSumArgs)
#undef STRATA_OP

}  // namespace strata::kernels
