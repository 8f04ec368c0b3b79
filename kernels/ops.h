// The op set every backend implements, forward and backward, on raw pointers in stream order.
// Each op takes a plain argument struct (shapes in the comments; row-major, innermost last).
// Ops::x() validates the arguments synchronously (a shape or dtype mistake throws
// std::invalid_argument naming the op and the field) and then enqueues the work on the stream.
//
// Conventions shared by every op:
// - Activations (x, y, dy, dx) and layer weights have the op's `dtype` (fp32, bf16 or fp16);
//   statistics (mean, rstd, lse, losses) are fp32; math is done in fp32.
// - Parameter gradients (dweight, dbias, dtable) are fp32 and always ACCUMULATED (+=): the
//   caller zeroes them once per optimizer step, which is what gradient accumulation needs.
// - Activation gradients (dx) are overwritten, unless the struct has `accumulate` set (dx +=),
//   which is how a residual branch adds into the residual stream's gradient.
#pragma once
#include <cstdint>

#include "kernels/dtype.h"

namespace strata::kernels {

class Stream;

// C[b] = alpha * op(A[b]) · op(B[b]) + beta * C[b], op(A): (m, k), op(B): (k, n), C: (m, n).
// A and B share a dtype; C is fp32 or the input dtype; accumulation is fp32. With beta = 1, C
// accumulates (gradient accumulation). Backward of C = A·B is two calls: dA = dC·Bᵀ, dB = Aᵀ·dC.
struct MatmulArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  DType ab_dtype = DType::f32;
  DType c_dtype = DType::f32;
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false;  // A stored as (k, m)
  bool trans_b = false;  // B stored as (n, k)
  int64_t lda = 0, ldb = 0, ldc = 0;  // row strides in elements of the stored matrices; 0 = packed
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements between batch items; 0 = packed
  float alpha = 1.f, beta = 0.f;
};

// y[r, c] += bias[c]  (y, bias: dtype). Backward: dbias[c] += Σ_r dy[r, c] (dbias fp32).
struct BiasAddArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  void* y = nullptr;
  const void* bias = nullptr;
};
struct BiasBackwardArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  const void* dy = nullptr;
  float* dbias = nullptr;
};

// out[t, :] = table[ids[t], :]   ids: (n_tokens) int32 in [0, vocab), table: (vocab, dim),
// out: (n_tokens, dim). With accumulate, out += (adds position embeddings to token ones).
// Backward: dtable[ids[t], :] += dout[t, :] (dtable fp32). An id outside [0, vocab) is an error.
//
// Vocabulary-sharded (tensor parallel), full_vocab > 0: table and dtable hold rows
// [row0, row0 + vocab) of a (full_vocab, dim) table, one rank's shard. Ids must be in
// [0, full_vocab); a token whose id is outside the shard gets a zero row in out (with accumulate,
// its row is left as it was) and adds nothing to dtable, so the sum of every rank's out is the
// unsharded lookup. full_vocab = 0: unsharded (row0 must be 0).
struct EmbeddingArgs {
  DType dtype = DType::f32;
  int64_t n_tokens = 0, dim = 0, vocab = 0;
  const int32_t* ids = nullptr;
  const void* table = nullptr;
  void* out = nullptr;
  bool accumulate = false;
  int64_t row0 = 0;        // first global row the table holds
  int64_t full_vocab = 0;  // rows of the whole table; 0 = vocab (not sharded)
};
struct EmbeddingBackwardArgs {
  DType dtype = DType::f32;  // of dout
  int64_t n_tokens = 0, dim = 0, vocab = 0;
  const int32_t* ids = nullptr;
  const void* dout = nullptr;
  float* dtable = nullptr;
  int64_t row0 = 0;        // as in EmbeddingArgs
  int64_t full_vocab = 0;
};
// Ids must be below this: the whole vocabulary, sharded or not.
inline int64_t id_limit(const EmbeddingArgs& a) { return a.full_vocab ? a.full_vocab : a.vocab; }
inline int64_t id_limit(const EmbeddingBackwardArgs& a) { return a.full_vocab ? a.full_vocab : a.vocab; }

// RMSNorm: y = x · rstd · weight,              rstd = 1/sqrt(mean(x²) + eps)
// LayerNorm: y = (x - mean) · rstd · weight + bias, rstd = 1/sqrt(var(x) + eps)
// x, y: (rows, cols); weight, bias: (cols); mean, rstd: (rows) fp32, saved for backward.
// bias may be null for LayerNorm; mean is unused (may be null) for RMSNorm.
struct NormArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  float eps = 1e-5f;
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  void* y = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
};
struct NormBackwardArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* dy = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  void* dx = nullptr;
  float* dweight = nullptr;  // null: a frozen norm (the input gradient only)
  float* dbias = nullptr;  // LayerNorm only; may be null
  bool accumulate = false;  // dx += instead of dx =
};

// Rotary position embedding, in place, HF "rotate half" convention: for i < rot/2,
//   x'[i]       = x[i]·cos - x[i + rot/2]·sin
//   x'[i+rot/2] = x[i + rot/2]·cos + x[i]·sin,      angle = p(b, t) · inv_freq[i]
// where the position p(b, t) = pos0 + t, or pos[b·seq + t] when `pos` is set.
// x: (batch, seq, heads, head_dim) with `token_stride` elements between consecutive tokens
// (0 = heads·head_dim; lets q and k be rotated inside a fused qkv buffer). cos, sin:
// (max_pos, head_dim/2) fp32 tables (built by the model from rope_theta and rope_scaling).
// backward = rotation by the negative angle, applied to the gradient in place (same positions).
struct RopeArgs {
  DType dtype = DType::f32;
  int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
  int64_t token_stride = 0;
  int64_t pos0 = 0;     // must be 0 when pos is set
  int64_t max_pos = 0;  // rows of the cos/sin tables; pos0 + seq must not exceed it
  void* x = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  bool backward = false;
  // (batch, seq) int32 per-token positions in runtime memory (packed documents restart at 0).
  // Not read by validation: the caller guarantees every position is in [0, max_pos).
  const int32_t* pos = nullptr;
};

// Causal scaled-dot-product attention with grouped-query heads (query head h reads kv head
// h / (n_heads / n_kv_heads)). q: (batch, seq, n_heads, head_dim), k, v: (batch, kv_seq,
// n_kv_heads, head_dim), each with a token stride (0 = packed) so they can live inside a fused
// qkv buffer; out: (batch, seq, n_heads, head_dim) packed; lse: (batch, n_heads, seq) fp32,
// the log-sum-exp of each softmax row (scaled scores), saved for backward. Softmax in fp32;
// blocked with an online softmax, never materialising seq × kv_seq.
//
// Which keys a query sees: query i of batch item b sits at key position kv_seq - seq + i and
// attends key j iff  seg_start[b·seq + i] <= j <= kv_seq - seq + i  (seg_start null: 0).
//  - kv_seq > seq: decoding with a KV cache (seq = 1 new token, kv_seq = cached length
//    including it) or chunked prefill; the keys/values of the new tokens are the last seq rows.
//  - seg_start: block-diagonal causal attention for packed documents (each token's seg_start =
//    the position of its document's first token), or left padding in batched decoding. The
//    caller guarantees seg_start <= the query's own position, so each row sees at least itself.
// Key blocks outside every row's window are skipped, not masked, so packing short documents
// costs less than dense causal attention. Keys of a partly seen block get probability exactly 0
// (other documents' outputs are bitwise independent), but their values are still multiplied by
// it: k/v rows below kv_seq must be finite (zero a cache's padding); rows past kv_seq are never read.
struct AttentionArgs {
  DType dtype = DType::f32;
  int64_t batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 0.f;  // 0 = 1/sqrt(head_dim)
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  void* out = nullptr;
  float* lse = nullptr;
  int64_t kv_seq = 0;  // keys/values per batch item; 0 = seq; must be >= seq
  // Elements between batch items of k AND of v (one stride for both; a cache with capacity >
  // kv_seq). 0 = packed: kv_seq·k_stride for k and kv_seq·v_stride for v.
  int64_t kv_batch_stride = 0;
  const int32_t* seg_start = nullptr;  // (batch, seq) int32 in runtime memory, or null
};
// dq, dk, dv have the same layouts (and strides) as q, k, v and are overwritten. Keys and
// queries are the same tokens (kv_seq = seq); seg_start as in the forward (the same array).
struct AttentionBackwardArgs {
  DType dtype = DType::f32;
  int64_t batch = 0, seq = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float scale = 0.f;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  const void* out = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  const int32_t* seg_start = nullptr;  // (batch, seq) int32 in runtime memory, or null
};

// Keys per batch item (kv_seq, 0 = seq) and elements between batch items of k and of v (0 =
// packed); the backward's keys are its queries.
inline int64_t kv_seq_of(const AttentionArgs& a) { return a.kv_seq ? a.kv_seq : a.seq; }
inline int64_t kv_seq_of(const AttentionBackwardArgs& a) { return a.seq; }
inline int64_t kv_batch_stride_of(const AttentionArgs& a) { return a.kv_batch_stride; }
inline int64_t kv_batch_stride_of(const AttentionBackwardArgs&) { return 0; }

// SwiGLU: out = silu(gate) · up, silu(g) = g / (1 + e^-g). gate, up: (rows, cols) with row
// stride ld (0 = cols; a fused [gate | up] projection output has ld = 2·cols); out: (rows,
// cols) packed. Backward writes dgate, dup with the same row stride ld.
struct SwigluArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0, ld = 0;
  const void* gate = nullptr;
  const void* up = nullptr;
  void* out = nullptr;
};
struct SwigluBackwardArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0, ld = 0;
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* dout = nullptr;
  void* dgate = nullptr;
  void* dup = nullptr;
};

// GELU, exact (x·Φ(x)) or tanh approximation (HF "gelu_new"/"gelu_pytorch_tanh"). n elements.
struct GeluArgs {
  DType dtype = DType::f32;
  int64_t n = 0;
  bool tanh_approx = false;
  const void* x = nullptr;
  void* y = nullptr;
};
struct GeluBackwardArgs {
  DType dtype = DType::f32;
  int64_t n = 0;
  bool tanh_approx = false;
  const void* x = nullptr;
  const void* dy = nullptr;
  void* dx = nullptr;
  bool accumulate = false;
};

// out = a + b (n elements; out may alias a or b). The residual add; its backward is identity
// to both inputs, i.e. the caller passes the same gradient on (or uses accumulate flags).
struct AddArgs {
  DType dtype = DType::f32;
  int64_t n = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
};

// Fused softmax + cross-entropy over one chunk of rows, forward and backward in one call, so
// the full (tokens, vocab) logits never need to exist at once: the caller computes logits for
// a chunk of rows, calls this, then back-propagates the chunk's dlogits through the LM head.
// logits: (rows, vocab) with row stride ld (0 = vocab); targets: (rows) int32, -1 = ignored.
// losses[r] = logsumexp(logits[r]) - logits[r, target] (0 for ignored rows; may be null).
// dlogits[r] = grad_scale · (softmax(logits[r]) - onehot(target)) (0 for ignored rows); same
// layout as logits, may alias it (in place). grad_scale is typically 1 / (targets in the batch).
struct CrossEntropyArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, vocab = 0, ld = 0;
  const void* logits = nullptr;
  const int32_t* targets = nullptr;
  float* losses = nullptr;
  void* dlogits = nullptr;  // null: forward only
  float grad_scale = 1.f;
};

// Vocabulary-parallel cross-entropy (Megatron-LM's), the LM head's columns split over ranks.
// Each of `parts` ranks holds logits (rows, vocab), row stride ld (0 = vocab), for global vocabulary
// columns [vocab_start, vocab_start + vocab) of the same rows; targets are global ids (-1 = ignored),
// each in [0, full_vocab).
// cross_entropy_stats: per row r, stats[3r] = max of the shard's logits, stats[3r+1] = Σ exp(x − that max)
//   over the shard, stats[3r+2] = the target's logit when the target is in the shard, else 0. Ignored rows: 0, 0, 0.
// The caller all-gathers stats over the ranks into all_stats (parts, rows, 3), rank-major.
// cross_entropy_finish: per row, M = max over p of all_stats[p][r][0]; S = Σ_{p = 0..parts-1, in that order}
//   all_stats[p][r][1] · exp(all_stats[p][r][0] − M); t = Σ_p all_stats[p][r][2];
//   losses[r] = log(S) + M − t (may be null; 0 for ignored rows), and when dlogits is non-null
//   dlogits = grad_scale · (exp(x − M) / S − onehot(target)) over the shard's columns (0 for ignored rows),
//   same layout as logits, may alias it (in place). logits is read only for dlogits (may be null without).
// Every rank forms M, S and t of a row identically from the same all_stats (fixed order, no atomics),
// so the ranks agree on the loss bit for bit. With parts = 1 (vocab_start = 0, full_vocab = vocab)
// the result is cross_entropy's to fp32 rounding.
struct CrossEntropyStatsArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, vocab = 0, ld = 0, vocab_start = 0, full_vocab = 0;
  const void* logits = nullptr;       // (rows, vocab), row stride ld
  const int32_t* targets = nullptr;   // (rows) global ids
  float* stats = nullptr;             // (rows, 3) fp32
};
struct CrossEntropyFinishArgs {
  DType dtype = DType::f32;
  int64_t rows = 0, vocab = 0, ld = 0, vocab_start = 0, full_vocab = 0;
  int parts = 1;
  const void* logits = nullptr;       // (rows, vocab), row stride ld
  const int32_t* targets = nullptr;   // (rows) global ids
  const float* all_stats = nullptr;   // (parts, rows, 3) fp32, rank-major
  float* losses = nullptr;            // (rows) or null
  void* dlogits = nullptr;            // like logits, or null: forward only
  float grad_scale = 1.f;
};

// AdamW with PyTorch's torch.optim.AdamW semantics, over n fp32 master parameters:
//   g = grad · grad_scale                   (grad_scale folds in clipping and 1/accumulation)
//   p = p - lr · weight_decay · p           (decoupled weight decay)
//   m = beta1 · m + (1 - beta1) · g
//   v = beta2 · v + (1 - beta2) · g²
//   p = p - (lr / (1 - beta1^step)) · m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// step counts from 1. If param_copy is set, the updated p is also written there in copy_dtype
// (the low-precision working weights).
struct AdamWArgs {
  int64_t n = 0;
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  float* m = nullptr;
  float* v = nullptr;
  // Out of place: the step reads param, m and v from these (each null: in place), and writes
  // param, m and v; the same operations, so the same bits as copying them first. Each either
  // equals its output or does not overlap it.
  const float* param_in = nullptr;
  const float* m_in = nullptr;
  const float* v_in = nullptr;
  // These arguments with every *_in set: to its output where null (in place). The kernels read
  // the *_in pointers.
  AdamWArgs with_inputs() const {
    AdamWArgs a = *this;
    if (!a.param_in) a.param_in = param;
    if (!a.m_in) a.m_in = m;
    if (!a.v_in) a.v_in = v;
    return a;
  }
  void* param_copy = nullptr;
  DType copy_dtype = DType::bf16;
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.f;
  int64_t step = 1;
  float grad_scale = 1.f;
};

// *out += Σ x[i]² (fp64 result, accumulated so several buffers sum into one global norm²).
struct SumSquaresArgs {
  DType dtype = DType::f32;
  int64_t n = 0;
  const void* x = nullptr;
  double* out = nullptr;
};

// x[i] *= s
struct ScaleArgs {
  DType dtype = DType::f32;
  int64_t n = 0;
  void* x = nullptr;
  float s = 1.f;
};

// The fixed-order sum of a reduction over `world` ranks (src/comm/communicator.h): out[i] =
// dtype(((f32(x_0[i]) + f32(x_1[i])) + ...) + f32(x_{world-1}[i])), rounded once, where x_me is
// `mine` and the others' contributions sit in rank order in `others`, one every others_stride
// elements (x_r at others + (r < me ? r : r - 1) · others_stride). out may be mine (in place);
// no other overlap. The NCCL communicator's reduce-scatter and all-reduce finish with it.
struct RankOrderSumArgs {
  DType dtype = DType::f32;
  int64_t n = 0;
  const void* mine = nullptr;
  int me = 0, world = 1;
  const void* others = nullptr;  // (world - 1) contributions; null when world is 1
  int64_t others_stride = 0;     // elements, >= n
  void* out = nullptr;
};

// dst[i] = convert(src[i]) with round-to-nearest-even; same dtype is a copy.
struct CastArgs {
  int64_t n = 0;
  const void* src = nullptr;
  DType src_dtype = DType::f32;
  void* dst = nullptr;
  DType dst_dtype = DType::f32;
};

// LoRA's adapter dropout (PEFT's lora_dropout), a mask drawn from a counter-based stream
// (kernels/counter_rng.h), so every backend, thread split and recomputation draws the same one:
//   v = counter_uniform(key, i) >= p ? x[i] * (1 / (1 - p)) : 0    (1 / (1 - p) rounded to fp32)
//   out[i] = accumulate ? out[i] + v : v                             (fp32, then rounded to dtype)
// A column slice of a wider mask (mask_cols > 0, tensor parallelism's part of a layer's input):
// the n elements are rows of `cols`, and element (r, c) draws mask element r·mask_cols +
// mask_col0 + c of the (rows, mask_cols) mask, so every rank's slice is the whole mask's.
struct DropoutArgs {
  DType dtype = DType::f32;
  int64_t n = 0;
  const void* x = nullptr;
  void* out = nullptr;
  uint64_t key = 0;
  float p = 0.f;  // in [0, 1)
  bool accumulate = false;
  int64_t cols = 0, mask_cols = 0, mask_col0 = 0;  // mask_cols 0: element i draws mask element i
};
// The mask element element i of a dropout draws.
inline int64_t dropout_mask_index(const DropoutArgs& a, int64_t i) {
  return a.mask_cols > 0 ? (i / a.cols) * a.mask_cols + a.mask_col0 + i % a.cols : i;
}

// A frozen weight matrix (rows, cols) as LoRA's --base-dtype stores it (src/model/quant.h has
// the format and the arithmetic), decoded into out (f32, bf16 or f16, rounded to nearest even):
//   bf16, fp16  values at codes.
//   int8        w = codes[r][c] * scales[r] (fp32).
//   nf4         block b = e / 64: absmax = map[absmax_codes[b]] * scales[1 + b / 256] + scales[0],
//               w = levels[nibble e] * absmax, each product and sum rounded to fp32 on its own;
//               element 2i in the high nibble of codes[i]. levels (16) and map (256) are host
//               values the op copies (the device kernels take them by value).
// Rows [row_lo, row_hi) of the matrix land at out (row row_lo first); a whole matrix by default.
enum class StoredFormat : uint8_t { bf16, fp16, int8, nf4 };
struct DequantizeArgs {
  StoredFormat format = StoredFormat::bf16;
  int64_t rows = 0, cols = 0;
  int64_t row_lo = 0, row_hi = -1;  // -1: rows
  const void* codes = nullptr;
  const uint8_t* absmax_codes = nullptr;  // nf4
  const float* scales = nullptr;          // int8, nf4
  const float* levels = nullptr;          // nf4, host
  const float* map = nullptr;             // nf4, host
  void* out = nullptr;
  DType out_dtype = DType::f32;
  int64_t hi() const { return row_hi < 0 ? rows : row_hi; }
};

// The op set of one backend. Each call validates, then enqueues on `s`.
class Ops {
 public:
  virtual ~Ops() = default;
  void matmul(Stream& s, const MatmulArgs& a);
  void bias_add(Stream& s, const BiasAddArgs& a);
  void bias_backward(Stream& s, const BiasBackwardArgs& a);
  void embedding(Stream& s, const EmbeddingArgs& a);
  void embedding_backward(Stream& s, const EmbeddingBackwardArgs& a);
  void rmsnorm(Stream& s, const NormArgs& a);
  void rmsnorm_backward(Stream& s, const NormBackwardArgs& a);
  void layernorm(Stream& s, const NormArgs& a);
  void layernorm_backward(Stream& s, const NormBackwardArgs& a);
  void rope(Stream& s, const RopeArgs& a);
  void attention(Stream& s, const AttentionArgs& a);
  void attention_backward(Stream& s, const AttentionBackwardArgs& a);
  void swiglu(Stream& s, const SwigluArgs& a);
  void swiglu_backward(Stream& s, const SwigluBackwardArgs& a);
  void gelu(Stream& s, const GeluArgs& a);
  void gelu_backward(Stream& s, const GeluBackwardArgs& a);
  void add(Stream& s, const AddArgs& a);
  void cross_entropy(Stream& s, const CrossEntropyArgs& a);
  void cross_entropy_stats(Stream& s, const CrossEntropyStatsArgs& a);
  void cross_entropy_finish(Stream& s, const CrossEntropyFinishArgs& a);
  void adamw(Stream& s, const AdamWArgs& a);
  void sum_squares(Stream& s, const SumSquaresArgs& a);
  void scale(Stream& s, const ScaleArgs& a);
  void cast(Stream& s, const CastArgs& a);
  void dequantize(Stream& s, const DequantizeArgs& a);
  void dropout(Stream& s, const DropoutArgs& a);
  void rank_order_sum(Stream& s, const RankOrderSumArgs& a);

 protected:
  // Backend hooks: called with validated arguments.
  virtual void do_matmul(Stream& s, const MatmulArgs& a) = 0;
  virtual void do_bias_add(Stream& s, const BiasAddArgs& a) = 0;
  virtual void do_bias_backward(Stream& s, const BiasBackwardArgs& a) = 0;
  virtual void do_embedding(Stream& s, const EmbeddingArgs& a) = 0;
  virtual void do_embedding_backward(Stream& s, const EmbeddingBackwardArgs& a) = 0;
  virtual void do_rmsnorm(Stream& s, const NormArgs& a) = 0;
  virtual void do_rmsnorm_backward(Stream& s, const NormBackwardArgs& a) = 0;
  virtual void do_layernorm(Stream& s, const NormArgs& a) = 0;
  virtual void do_layernorm_backward(Stream& s, const NormBackwardArgs& a) = 0;
  virtual void do_rope(Stream& s, const RopeArgs& a) = 0;
  virtual void do_attention(Stream& s, const AttentionArgs& a) = 0;
  virtual void do_attention_backward(Stream& s, const AttentionBackwardArgs& a) = 0;
  virtual void do_swiglu(Stream& s, const SwigluArgs& a) = 0;
  virtual void do_swiglu_backward(Stream& s, const SwigluBackwardArgs& a) = 0;
  virtual void do_gelu(Stream& s, const GeluArgs& a) = 0;
  virtual void do_gelu_backward(Stream& s, const GeluBackwardArgs& a) = 0;
  virtual void do_add(Stream& s, const AddArgs& a) = 0;
  virtual void do_cross_entropy(Stream& s, const CrossEntropyArgs& a) = 0;
  virtual void do_cross_entropy_stats(Stream& s, const CrossEntropyStatsArgs& a) = 0;
  virtual void do_cross_entropy_finish(Stream& s, const CrossEntropyFinishArgs& a) = 0;
  virtual void do_adamw(Stream& s, const AdamWArgs& a) = 0;
  virtual void do_sum_squares(Stream& s, const SumSquaresArgs& a) = 0;
  virtual void do_scale(Stream& s, const ScaleArgs& a) = 0;
  virtual void do_cast(Stream& s, const CastArgs& a) = 0;
  virtual void do_dequantize(Stream& s, const DequantizeArgs& a) = 0;
  virtual void do_dropout(Stream& s, const DropoutArgs& a) = 0;
  virtual void do_rank_order_sum(Stream& s, const RankOrderSumArgs& a) = 0;
};

// Argument validation shared by all backends (throws std::invalid_argument "op: field ...").
void validate(const MatmulArgs& a);
void validate(const BiasAddArgs& a);
void validate(const BiasBackwardArgs& a);
void validate(const EmbeddingArgs& a);
void validate(const EmbeddingBackwardArgs& a);
void validate(const NormArgs& a, bool layernorm);
void validate(const NormBackwardArgs& a, bool layernorm);
void validate(const RopeArgs& a);
void validate(const AttentionArgs& a);
void validate(const AttentionBackwardArgs& a);
void validate(const SwigluArgs& a);
void validate(const SwigluBackwardArgs& a);
void validate(const GeluArgs& a);
void validate(const GeluBackwardArgs& a);
void validate(const AddArgs& a);
void validate(const CrossEntropyArgs& a);
void validate(const CrossEntropyStatsArgs& a);
void validate(const CrossEntropyFinishArgs& a);
void validate(const AdamWArgs& a);
void validate(const SumSquaresArgs& a);
void validate(const ScaleArgs& a);
void validate(const CastArgs& a);
void validate(const DequantizeArgs& a);
void validate(const DropoutArgs& a);
void validate(const RankOrderSumArgs& a);

}  // namespace strata::kernels
