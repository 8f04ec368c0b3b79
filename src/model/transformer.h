// The decoder-only transformer (llama/mistral/qwen2 and gpt2 families) as units of flat
// parameter buffers (DESIGN.md "unit of movement") with an explicit llm.c-style forward and
// backward per block. Every buffer (parameters, grads, activations, workspace) is sized from
// the config and the batch shape and allocated once, at construction; a step allocates nothing.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "kernels/runtime.h"
#include "src/checkpoint/hf.h"
#include "src/model/config.h"
#include "src/tensor.h"

namespace strata {

// Units are padded to this many elements so every unit starts 4 KiB aligned in fp32 and bf16.
constexpr int64_t kUnitAlignElems = 2048;
// Default bound on the LM-head logits that exist at once (one chunk of rows): 64 MiB. At
// GPT-2 scale that is 333 fp32 / 667 bf16 rows, so B·T = 256 runs in one chunk and the V×C
// head gradient is read and written once per micro-batch, not once per chunk.
constexpr int64_t kLogitsChunkBytes = int64_t{64} << 20;

// One named parameter tensor (HF name and HF shape; gpt2's Conv1D weights stay [in, out]).
struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  int unit = 0;
  int64_t offset = 0;  // elements from the start of the whole flat parameter buffer
  int64_t numel = 0;
  bool decay = false;  // AdamW weight decay: 2-D tensors only (embeddings included)
  bool ones = false;   // random init: norm gains start at 1, biases at 0, matrices ~ N(0, 0.02)
  bool zeros = false;
};

// A unit: a contiguous, padded range of the flat parameter (and grad, m, v) buffers.
struct Unit {
  std::string name;    // "embed", "block.3", "final_norm", "lm_head"
  int64_t offset = 0;  // elements, multiple of kUnitAlignElems
  int64_t numel = 0;   // padded length
  std::vector<int> params;
};

// Where each tensor of a block lives, in elements from the start of its unit (-1 = absent).
// llama: qkv_w is HF's q_proj, k_proj, v_proj stacked ((Hq+2·Hkv)·D, C); fc_w is gate_proj then
// up_proj (2·I, C); proj_w is down_proj (C, I); all (out, in). gpt2: HF's Conv1D layouts,
// (in, out): c_attn (C, 3C), c_proj (C, C), c_fc (C, 4C), mlp.c_proj (4C, C).
struct BlockLayout {
  int64_t ln1_w = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, o_w = -1, o_b = -1;
  int64_t ln2_w = -1, ln2_b = -1, fc_w = -1, fc_b = -1, proj_w = -1, proj_b = -1;
};

// Derived sizes of one model at one batch shape.
struct ModelDims {
  int64_t B = 0, T = 0, N = 0;   // batch, sequence, rows N = B·T
  int64_t C = 0, L = 0, V = 0;   // width, layers, vocab
  int64_t Hq = 0, Hkv = 0, D = 0;  // query heads, kv heads, head dim
  int64_t Q = 0, QKV = 0;        // Hq·D, (Hq + 2·Hkv)·D
  int64_t I = 0;                 // MLP width
  int64_t FC = 0;                // fc output width: llama 2·I (gate|up), gpt2 I
  int64_t chunk_rows = 0;        // LM-head + cross-entropy rows per chunk
};

// Saved activations of one block (pointers into the activation arena). Stats are fp32.
struct BlockActs {
  void* ln1 = nullptr;      // (N, C)
  float* mean1 = nullptr;   // (N) gpt2 only
  float* rstd1 = nullptr;   // (N)
  void* qkv = nullptr;      // (N, QKV), q and k after RoPE
  void* att = nullptr;      // (N, Q)
  float* lse = nullptr;     // (B, Hq, T)
  void* res_mid = nullptr;  // (N, C) residual after attention
  void* ln2 = nullptr;      // (N, C)
  float* mean2 = nullptr;   // (N) gpt2 only
  float* rstd2 = nullptr;   // (N)
  void* fc = nullptr;       // (N, FC) llama: [gate | up]; gpt2: pre-GELU
  void* act = nullptr;      // (N, I) llama: SwiGLU out; gpt2: GELU out
};

// Scratch shared by all blocks' backward passes.
struct BlockScratch {
  void* tmp_c = nullptr;   // (N, C)  projection outputs before the residual add
  void* d_c = nullptr;     // (N, C)  gradient into a norm's output
  void* d_q = nullptr;     // (N, Q)  gradient of the attention output
  void* d_fc = nullptr;    // (N, max(FC, QKV)) gradient of fc / qkv outputs
  void* d_act = nullptr;   // (N, I)
};

// What a block's forward and backward need, besides its activations.
struct BlockCtx {
  kernels::Ops* ops = nullptr;
  kernels::Stream* stream = nullptr;
  const ModelConfig* cfg = nullptr;
  const ModelDims* dims = nullptr;
  DType dtype = DType::f32;
  const void* w = nullptr;  // the block's unit in the working weights (dtype)
  float* g = nullptr;       // the block's unit in the fp32 grads
  const BlockLayout* layout = nullptr;
  const float* rope_cos = nullptr;  // (T, D/2), llama only
  const float* rope_sin = nullptr;
  const BlockScratch* scratch = nullptr;
  // false: the weight matrices' grads are written (dW = ...), not accumulated; the caller has
  // zeroed the block's other grads (norms, biases), which always accumulate.
  bool accumulate_grads = true;
};

// Per family: x (N, C) -> out (N, C), saving `acts`; backward: dres (N, C) holds d out on entry
// and d x on exit; parameter grads accumulate into ctx.g (see BlockCtx::accumulate_grads).
void llama_block_forward(const BlockCtx& ctx, const void* x, const BlockActs& acts, void* out);
void llama_block_backward(const BlockCtx& ctx, const void* x, const BlockActs& acts, void* dres);
void gpt2_block_forward(const BlockCtx& ctx, const void* x, const BlockActs& acts, void* out);
void gpt2_block_backward(const BlockCtx& ctx, const void* x, const BlockActs& acts, void* dres);

// RoPE inverse frequencies exactly as HF computes them in fp32 (default and "llama3" scaling).
std::vector<float> rope_inv_freq(const ModelConfig& cfg);

class Transformer {
 public:
  // Allocates everything for micro-batches of (batch, seq) in working dtype `dtype`.
  // Throws std::invalid_argument when seq exceeds max_position_embeddings.
  // logits_chunk_bytes bounds the LM-head chunk: at most that many bytes of logits exist at
  // once (whole rows; at least one row).
  Transformer(const ModelConfig& cfg, DType dtype, int64_t batch, int64_t seq, kernels::Runtime& rt,
              int64_t logits_chunk_bytes = kLogitsChunkBytes);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ModelDims& dims() const { return dims_; }
  DType dtype() const { return dtype_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const std::vector<Unit>& units() const { return units_; }
  const ParamInfo* find_param(const std::string& name) const;
  int64_t n_params() const;          // real parameters (no padding)
  int64_t n_flat() const { return n_flat_; }  // padded length of the flat buffers
  size_t bytes_allocated() const { return bytes_allocated_; }

  float* master() const { return master_.as<float>(); }  // (n_flat) fp32 master weights
  void* weights() const;                                   // (n_flat) working weights (dtype)
  float* grads() const { return grads_.as<float>(); }      // (n_flat) fp32
  float* loss_rows() const { return losses_.as<float>(); } // (N) per-row losses of the last forward

  // GPT-2-style init from `seed`: matrices ~ N(0, 0.02), norm gains 1, biases 0. Deterministic
  // and independent of the thread count. Host work; call before any stream work.
  void init_random(uint64_t seed);
  // Loads every parameter from an HF checkpoint (missing tensor or shape mismatch throws).
  void load(const HfCheckpoint& ckpt);
  // The master weights as HF tensors (fp32), for save_hf_model.
  std::vector<TensorToSave> tensors_to_save() const;
  // Working weights <- master weights (a cast; no-op in fp32). Enqueued on s.
  void sync_weights(kernels::Stream& s);
  void zero_grads(kernels::Stream& s);

  // One micro-batch: ids, targets (N) int32 in runtime memory. Forward writes loss_rows();
  // with backward, d loss / d params · grad_scale accumulates (+=) into grads(), where the loss
  // is Σ rows' cross-entropy (so grad_scale = 1 / targets-in-global-batch gives the mean).
  // accumulate = false makes it the first micro-batch of a step: grads() is overwritten and its
  // old contents never read, which saves zeroing the whole buffer and the read-modify-write of
  // every weight gradient (the big matmuls write dW with beta = 0; only the few tensors reduced
  // by accumulating ops — norms, biases, embedding tables not tied to the head — are zeroed).
  void forward(kernels::Stream& s, const int32_t* ids, const int32_t* targets);
  void forward_backward(kernels::Stream& s, const int32_t* ids, const int32_t* targets, float grad_scale,
                        bool accumulate = true);

 private:
  void build_layout();
  void allocate();
  BlockCtx block_ctx(kernels::Stream& s, int layer) const;
  void run(kernels::Stream& s, const int32_t* ids, const int32_t* targets, bool backward, float grad_scale,
           bool accumulate);

  ModelConfig cfg_;
  DType dtype_;
  ModelDims dims_;
  kernels::Runtime& rt_;
  std::vector<ParamInfo> params_;
  std::vector<Unit> units_;
  BlockLayout layout_;           // same relative layout for every block
  std::vector<int> block_units_; // unit index per layer
  int64_t n_flat_ = 0;
  // Element offsets (into the flat buffers) of the non-block tensors (-1 = absent).
  int64_t wte_ = -1, wpe_ = -1, lnf_w_ = -1, lnf_b_ = -1, head_ = -1;
  // Grad ranges (offset, numel; adjacent ones merged) that only accumulating ops write: zeroed
  // before a non-accumulating backward. Every other grad element is a matmul's dW (beta = 0)
  // or unit padding (zero from allocation, never written).
  std::vector<std::pair<int64_t, int64_t>> accum_only_grads_;

  size_t bytes_allocated_ = 0;
  kernels::DeviceBuffer master_, working_, grads_;
  kernels::DeviceBuffer acts_buf_, scratch_buf_, losses_, rope_, pos_ids_;
  std::vector<BlockActs> acts_;   // per layer
  std::vector<void*> residual_;   // L+1 residual streams (N, C): input of each block, then final
  BlockScratch scratch_;
  void* lnf_ = nullptr;           // (N, C) final norm output
  float* lnf_mean_ = nullptr;     // (N)
  float* lnf_rstd_ = nullptr;     // (N)
  void* dres_ = nullptr;          // (N, C) gradient of the residual stream
  void* dlnf_ = nullptr;          // (N, C)
  void* logits_ = nullptr;        // (chunk_rows, V) logits / dlogits in logits_dtype_
  void* dlogits_lp_ = nullptr;    // (chunk_rows, V) fp16 dlogits (fp16 runs only)
  DType logits_dtype_ = DType::f32;  // bf16 runs keep logits in bf16 (as llm.c); fp32 and fp16 in fp32
};

}  // namespace strata
