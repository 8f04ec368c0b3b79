// The decoder-only transformer as units of flat parameter buffers (DESIGN.md "The unit of
// movement") and per-unit phases with an explicit llm.c-style forward and backward per block,
// whose family (llama/mistral/qwen2, gpt2) is a recipe (src/model/family.h). The model sees
// units, never a whole-model buffer: whoever sequences a step hands each phase the units it
// needs, from wherever they live.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "kernels/runtime.h"
#include "src/checkpoint/hf.h"
#include "src/model/config.h"
#include "src/model/lora.h"
#include "src/tensor.h"

namespace strata {

class Communicator;

// Units are padded to this many elements so every unit starts 4 KiB aligned in fp32 and bf16.
constexpr int64_t kUnitAlignElems = 2048;
// Default bound on the LM-head logits that exist at once (one chunk of rows): 64 MiB. At
// GPT-2 scale that is 333 fp32 / 667 bf16 rows, so B·T = 256 runs in one chunk and the V×C
// head gradient is read and written once per micro-batch, not once per chunk.
constexpr int64_t kLogitsChunkBytes = int64_t{64} << 20;

// How tensor parallelism splits an HF tensor over the tp ranks (Megatron-LM): along dimension
// `dim` of its HF shape, each of `segments` equal parts (gpt2's c_attn: q, k and v side by side)
// cut into tp pieces of ceil(part / tp), the last ones shorter where it does not divide (the
// vocabulary); dim -1: not split, the whole tensor on every rank (norms, row-parallel biases).
struct TpSplit {
  int dim = -1;
  int segments = 1;
};

// Tensor parallelism: this rank's place in its tp group, and the group (null when size is 1,
// or for a part that is only sized).
// sequence: Megatron's sequence parallelism on top (the residual stream split by rows).
struct TensorParallel {
  int size = 1, rank = 0;
  Communicator* comm = nullptr;
  bool sequence = false;
  bool on() const { return size > 1; }
};

// Pipeline parallelism: this rank's stage of `size` (Megatron-LM's contiguous layer stages).
// It holds the layers [first, end), the embedding on the first stage, the final norm and head on
// the last (a tied head's embedding on both: the last stage keeps a copy, its gradient summed
// with the first stage's), and the activations of `slots` micro-batches at once (1F1B: at most
// size - rank in flight). comm: the pipeline group (neighbours by rank), null where only sized.
struct PipelineStage {
  int size = 1, rank = 0;
  int64_t first = 0, end = -1;  // end -1: to the last layer
  int slots = 1;
  Communicator* comm = nullptr;
  bool on() const { return size > 1; }
  bool first_stage() const { return rank == 0; }
  bool last_stage() const { return rank == size - 1; }
};
// --pp-layers ("5,7"): the layers of each of `size` stages, one count each, summing to L; throws
// naming the text and the numbers otherwise. (The default split is src/train/perf_model.h's
// pipeline_split.)
std::vector<int64_t> pipeline_layers(int64_t L, int size, const std::string& layers);
// Stage `rank` of a pipeline whose stages hold `layers` each: its layer range, and activation
// slots for the micro-batches it has in flight at once in 1F1B (size − rank, at most
// micro_batches). comm: its pipeline group (null: sized only, for a plan).
PipelineStage pipeline_stage(const std::vector<int64_t>& layers, int rank, int64_t micro_batches,
                             Communicator* comm = nullptr);

// One named parameter tensor (HF name and HF shape; gpt2's Conv1D weights stay [in, out]).
// Under tensor parallelism `shape` is this rank's part of the HF tensor: `full_shape` and
// `split` say which (tp_runs).
struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<int64_t> full_shape;  // the HF tensor's shape (= shape without tensor parallelism)
  TpSplit split;
  int unit = 0;
  int64_t offset = 0;       // elements from the start of the whole flat numbering (all units)
  int64_t unit_offset = 0;  // elements from the start of its unit
  int64_t numel = 0;
  bool decay = false;  // AdamW weight decay: 2-D tensors only (embeddings included)
  bool ones = false;   // random init: norm gains start at 1, biases at 0, matrices ~ N(0, 0.02)
  bool zeros = false;
  float uniform = 0;   // > 0: random init ~ U(-uniform, uniform) (LoRA's A: Kaiming-uniform, a = √5)
};

// The [start, end) of piece `rank` of `size` of one segment of `length` elements (TpSplit).
std::pair<int64_t, int64_t> tp_piece(int64_t length, int rank, int size);
// Rank `rank`'s part of p's HF tensor as runs of contiguous elements: fn(local, full, n) for
// local elements [local, local + n) of the part, which are the HF tensor's [full, full + n).
// Runs come in local order and cover the part once; an unsplit tensor is one run.
void tp_runs(const ParamInfo& p, int rank, int size, const std::function<void(int64_t, int64_t, int64_t)>& fn);
// The elements of rank `rank`'s part of p's HF tensor.
int64_t tp_numel(const ParamInfo& p, int rank, int size);

// A contiguous range of one unit's flat buffers, in elements from the unit's start.
struct UnitRange {
  int64_t offset = 0, numel = 0;
  bool decay = false;
};

// A unit: the padded flat buffer of a group of tensors (DESIGN.md "The unit of movement"). Its
// parameters are contiguous from element 0 (n_real of them); padding follows, up to numel.
struct Unit {
  std::string name;    // "embed", "block.3", "final_norm", "lm_head"
  int64_t offset = 0;  // elements in the whole flat numbering, multiple of kUnitAlignElems
  int64_t numel = 0;   // padded length
  int64_t n_real = 0;  // parameters (no padding)
  std::vector<int> params;
  std::vector<UnitRange> adamw_ranges;  // [0, n_real) split where the decay flag changes
  // Ranges whose gradient only accumulating ops write (norm gains, biases, embeddings not tied
  // to the head): zeroed when a step's first micro-batch first writes the unit's grads. Every
  // other grad element is a matmul's dW, written with beta = 0.
  std::vector<UnitRange> accum_only;
  // A frozen unit (the base under LoRA adapters) has working weights only: no grads, master or
  // AdamW state, and its phases compute only the input gradient.
  bool trainable = true;
  // Pipeline parallel: false for another stage's unit (no tensors here: numel 0, params empty;
  // its tensors stay in params() with their indices, so every stage inits the same values).
  bool held = true;
};

// Activation checkpointing: which blocks keep only their input and recompute their forward
// inside their backward, into one shared set of activation buffers.
struct Checkpointing {
  int64_t every = 0;  // 0: none; 1: every block ("full"); N: blocks 0, N, 2N, ... ("every:N")
  bool at(int64_t layer) const { return every > 0 && layer % every == 0; }
  bool any() const { return every > 0; }
};
// "none" | "full" | "every:N" (N >= 1); throws naming the text.
Checkpointing parse_checkpointing(const std::string& text);
std::string checkpointing_name(const Checkpointing& c);

// Where each tensor of a block lives, in elements from the start of its unit (-1 = absent).
// qkv_w is the fused q|k|v projection, fc_w the MLP's first (llama: gate and up stacked) and
// proj_w its second; each family's block_tensors says how its HF tensors map onto these.
struct BlockLayout {
  int64_t ln1_w = -1, ln1_b = -1, qkv_w = -1, qkv_b = -1, o_w = -1, o_b = -1;
  int64_t ln2_w = -1, ln2_b = -1, fc_w = -1, fc_b = -1, proj_w = -1, proj_b = -1;
};

// Where the embedding tables, final norm and head live inside their units (elements; -1 = absent).
struct OuterLayout {
  int64_t wte = -1, wpe = -1, lnf_w = -1, lnf_b = -1, head = -1;
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
  // Tensor parallelism: Hq, Hkv, Q, QKV, I, FC and V are this rank's (its heads, its slice of
  // the MLP, its vocabulary rows [vocab_start, vocab_start + V) of full_vocab).
  int64_t vocab_start = 0, full_vocab = 0;
  // The residual stream's rows on this rank (the block inputs and outputs, the norms' inputs):
  // all N from 0, or under sequence parallelism N / tp of them from res_row0.
  int64_t res_rows = 0, res_row0 = 0;
};
// The dims of a valid cfg at micro-batches of (batch, seq), as a Transformer sizes them,
// without building one; chunk_rows is left 0 (it depends on the logits' chunk budget). With
// tensor parallelism, rank tp.rank's; throws std::invalid_argument naming the numbers when
// tp.size does not divide the heads, the kv heads or the MLP width, or leaves a rank without
// vocabulary rows.
ModelDims model_dims(const ModelConfig& cfg, int64_t batch, int64_t seq, const TensorParallel& tp = {});

// Saved activations of one block (pointers into the activation arena). Stats are fp32.
struct BlockActs {
  void* ln1 = nullptr;      // (N, C)
  float* mean1 = nullptr;   // (N) LayerNorm only
  float* rstd1 = nullptr;   // (N)
  void* qkv = nullptr;      // (N, QKV), q and k after RoPE
  void* att = nullptr;      // (N, Q)
  float* lse = nullptr;     // (B, Hq, T)
  void* res_mid = nullptr;  // (N, C) residual after attention
  void* ln2 = nullptr;      // (N, C)
  float* mean2 = nullptr;   // (N) LayerNorm only
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

// Decoding with a KV cache (src/infer/generator.h): a block's T new tokens per batch item sit
// after `past` cached ones. Each token's k and v rows are appended to the cache, and attention
// reads keys and values from there. Null in training.
struct KvStep {
  void* cache = nullptr;               // (B, capacity, 2, Hkv, D) this layer's [k | v] per token, dtype
  int64_t capacity = 0;                // tokens per batch item
  int64_t past = 0;                    // tokens already cached per batch item (the same for all)
  const int32_t* pos = nullptr;        // (B, T) each new token's position (RoPE), runtime memory
  int64_t max_pos = 0;                 // rows of the RoPE tables
  const int32_t* seg_start = nullptr;  // (B, T) first cache slot each new token sees (left padding), or null
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
  const float* rope_cos = nullptr;  // (T, D/2), RoPE families only
  const float* rope_sin = nullptr;
  // Rows built from documents (Transformer::set_documents): per token its position and the
  // first position its attention may see; null: positions 0..T-1 and plain causal attention.
  const int32_t* pos = nullptr;
  const int32_t* seg_start = nullptr;
  const BlockScratch* scratch = nullptr;
  // false: the weight matrices' grads are written (dW = ...), not accumulated; the caller has
  // zeroed the block's other grads (norms, biases), which always accumulate.
  bool accumulate_grads = true;
  const KvStep* kv = nullptr;  // forward only: decode with a KV cache instead of plain causal attention
  // Tensor parallelism: the tp group (null: none), over which row-parallel outputs (forward) and
  // column-parallel input gradients (backward) are summed.
  Communicator* tp_comm = nullptr;
  float* sp_norm_grads = nullptr;   // sequence parallel (ModelDims::res_rows): (2, C) fp32 scratch of a norm's grads
  // LoRA (src/model/lora.h): the layer's adapter unit (working weights, fp32 grads or null) and
  // two (N, max_kr) scratch buffers; lora null: no adapters.
  const LoraLayout* lora = nullptr;
  const void* lora_w = nullptr;
  float* lora_g = nullptr;
  void* lora_u = nullptr;
  void* lora_du = nullptr;
  // Dropout (LoraLayout::dropout > 0, a training micro-batch): this layer's mask key (0: no
  // dropout), and two (N, max_in) scratch buffers (the dropped input; the input gradient).
  uint64_t lora_dropout_key = 0;
  void* lora_x = nullptr;
  void* lora_t = nullptr;
};

struct FamilyRecipe;

// RoPE inverse frequencies exactly as HF computes them in fp32 (default and "llama3" scaling).
std::vector<float> rope_inv_freq(const ModelConfig& cfg);
// The RoPE tables of positions [0, positions): (2, positions, D/2) cos then sin of fp32
// t · inv_freq, as HF computes them (the training workspace and the generator's cache).
std::vector<float> rope_tables(const ModelConfig& cfg, int64_t positions);

// The model as per-unit phases on the op set. It owns no parameter memory: every phase is handed
// the units it reads (working weights, dtype) and writes (fp32 grads), acquired by whoever
// sequences the step (src/train/step_driver.h), and it never holds a pointer to them after the
// call returns. It keeps what it needs besides its units in one workspace the caller places:
// non-checkpointed blocks' activations, one shared set for recomputed blocks, backward
// scratch, the final residual, the head's logits chunk, per-row losses and constant tables.
// Each block's input x_l (N, C) is a separate buffer the caller gives (it may live on another
// tier: the kept input of a checkpointed block). Phases are enqueued on a stream and allocate
// nothing.
class Transformer {
 public:
  // Sizes everything for micro-batches of (batch, seq) in working dtype `dtype`. Throws
  // std::invalid_argument when seq exceeds max_position_embeddings. logits_chunk_bytes bounds
  // the LM-head chunk: at most that many bytes of logits exist at once (whole rows, >= 1 row).
  // shard_world: units are padded to a multiple of shard_world × kUnitAlignElems elements, so
  // each splits into that many equal, aligned ZeRO shards (src/train/run_memory.h Sharding).
  // lora.on(): every base unit is frozen and each layer gets an adapter unit (lora_unit).
  // tp.on(): this rank's part of the model (Megatron-LM's tensor parallelism): its heads of
  // each attention, its slice of each MLP, its vocabulary rows of the embedding and head; the
  // phases sum partial results over tp.comm on their stream, so every rank of the group enqueues
  // the same phases in the same order. A part made without tp.comm is sized only (a plan's): its
  // phases throw.
  Transformer(const ModelConfig& cfg, DType dtype, int64_t batch, int64_t seq, kernels::Runtime& rt,
              Checkpointing ckpt = {}, int64_t logits_chunk_bytes = kLogitsChunkBytes, int shard_world = 1,
              const LoraSpec& lora = {}, const TensorParallel& tp = {}, const PipelineStage& pp = {});
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return cfg_; }
  // What differs per family (src/model/family.h): tensors, block, norm, positions, description.
  const FamilyRecipe& recipe() const { return recipe_; }
  const ModelDims& dims() const { return dims_; }
  const TensorParallel& tensor_parallel() const { return tp_; }
  const PipelineStage& pipeline() const { return pp_; }
  bool holds_layer(int64_t layer) const { return layer >= pp_.first && layer < pp_.end; }
  // Whether tensor p lives on this stage (every tensor without pipeline parallelism).
  bool holds(const ParamInfo& p) const { return units_[static_cast<size_t>(p.unit)].held; }
  // Pipeline parallel: the micro-batch slot whose activations the phases use from now on
  // (0 <= slot < pipeline().slots), and a layer's kept input's RunMemory index in that slot.
  void select_slot(int slot);
  int slot() const { return slot_; }
  int activation_index(int64_t layer) const { return static_cast<int>(slot_ * dims_.L + layer); }
  DType dtype() const { return dtype_; }
  const Checkpointing& checkpointing() const { return ckpt_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const std::vector<Unit>& units() const { return units_; }
  const ParamInfo* find_param(const std::string& name) const;
  int64_t n_params() const;                   // real parameters (no padding); tensor or pipeline parallel: this rank's
  int64_t n_model_params() const;             // the whole model's (every tensor-parallel rank's together)
  int64_t n_flat() const { return n_flat_; }  // all units' padded lengths together

  // The units by role. The head lives in head_unit() (the embedding unit when tied).
  int embed_unit() const { return 0; }
  int block_unit(int64_t layer) const { return static_cast<int>(1 + layer); }
  int final_norm_unit() const { return static_cast<int>(1 + dims_.L); }
  int head_unit() const { return head_unit_; }
  bool tied_head() const { return head_unit_ == 0; }
  // LoRA: layer l's adapter unit (after every base unit), or -1 without adapters.
  bool lora() const { return lora_first_unit_ >= 0; }
  int lora_unit(int64_t layer) const { return lora() ? lora_first_unit_ + static_cast<int>(layer) : -1; }
  const LoraLayout& lora_layout() const { return lora_layout_; }
  const LoraSpec& lora_spec() const { return lora_spec_; }
  // LoRA dropout's key for the phases from now on (a training micro-batch's; 0: no dropout, as
  // a validation pass runs).
  void set_lora_dropout_key(uint64_t key) { lora_dropout_key_ = key; }
  // The linear modules given adapters, by their names inside a layer ("self_attn.q_proj").
  const std::vector<std::string>& lora_modules() const { return lora_modules_; }
  int64_t n_trainable_params() const;
  // LoRA --base-dtype (src/model/quant.h): unit u's weights block holds their stored form (a
  // frozen layer's matrices quantized, its norms and biases in the working dtype, each tensor 64
  // bytes aligned), stored_bytes(u) of it; decode_unit enqueues on s the decode of the whole
  // unit into `working` in the working dtype (stored and working in s's backend's memory).
  bool stored_unit(int u) const;
  size_t stored_bytes(int u) const;
  void store_unit(int u, const float* master, void* stored) const;
  void decode_unit(kernels::Stream& s, kernels::Ops& ops, int u, const void* stored, void* working) const;
  // Where the tensors live inside their units (elements; -1 = absent): every block's, and the
  // embedding tables', final norm's and head's.
  const BlockLayout& block_layout() const { return layout_; }
  const OuterLayout& outer_layout() const { return outer_; }

  // Workspace: bytes, then the memory (device memory of the runtime, 4 KiB aligned, alive while
  // the model is used). bind_workspace enqueues the constant tables' upload on s.
  size_t workspace_bytes() const { return workspace_bytes_; }
  void bind_workspace(kernels::Stream& s, void* base);
  size_t input_bytes() const;  // one block's input x_l: (res_rows, C) in dtype (N rows but with sequence parallelism)

  // GPT-2-style init of unit u's fp32 master weights into `master` (host memory, numel
  // elements, padding zeroed) from `seed`: matrices ~ N(0, 0.02), norm gains 1, biases 0.
  // The same values whatever the thread count or the other units.
  void init_unit(int u, uint64_t seed, float* master) const;
  // The same init's elements [lo, hi) of unit u into out (hi - lo floats): a unit in pieces.
  void init_range(int u, uint64_t seed, int64_t lo, int64_t hi, float* out) const;
  // Unit u's parameters from an HF checkpoint into `master` (host, fp32, padding zeroed); a
  // missing tensor or a shape mismatch throws naming it.
  // name_prefix: the file's names are the model's behind it (a PEFT adapter's "base_model.model.").
  // whole (optional): each tensor's whole HF values as read, in unit order (tensor parallel: the
  // whole tensor it reads anyway before keeping its part).
  using WholeTensorFn = std::function<void(const ParamInfo& p, const float* values)>;
  void load_unit(int u, const HfCheckpoint& ckpt, float* master, const std::string& name_prefix = "",
                 const WholeTensorFn& whole = {}) const;
  // The elements [lo, hi) of unit u from ckpt into out (hi - lo fp32 values; the padding zero):
  // a ZeRO shard read without the rest of the unit (the 8B model's embedding is 2 GiB whole).
  // Not under tensor parallelism (logic_error): a tp part is not a range of the HF tensor.
  void load_range(int u, const HfCheckpoint& ckpt, int64_t lo, int64_t hi, float* out,
                  const std::string& name_prefix = "") const;
  // Tensor `name` of ckpt, in p's HF shape, into dst (fp32): this rank's part of it under tensor
  // parallelism (p.shape), the whole tensor otherwise; whole (optional) as in load_unit.
  void read_param(const HfCheckpoint& ckpt, const std::string& name, const ParamInfo& p, float* dst,
                  const WholeTensorFn& whole = {}) const;

  // Phases of one micro-batch (ids, targets: (N) int32 in runtime memory). Unit pointers are
  // the unit's start (working weights `w`, dtype; fp32 grads `g`). `first`: the step's first
  // micro-batch — its backward overwrites the grads instead of adding to them (the matmuls
  // write dW with beta 0, the accumulate-only ranges are zeroed first), so grads never need
  // a zeroing pass and their old bytes are never read.
  // Rows of packed or padded documents (src/data/doc_rows.h): pos (N) int32, each token's
  // position inside its document (RoPE angle, learned position), and seg_start (N) int32, the
  // first position in its row its attention may see (block-diagonal causal attention). Both in
  // runtime memory, read by every phase from now on (recomputed forwards included) until set
  // again; null, null: a plain stream (positions 0..T-1, causal attention over the whole row).
  void set_documents(const int32_t* pos, const int32_t* seg_start) {
    doc_pos_ = pos;
    doc_seg_ = seg_start;
  }
  // x0 (N, C) = wte[ids] (+ wpe[t])
  void embed_forward(kernels::Stream& s, const int32_t* ids, const void* w_embed, void* x0);
  // y (N, C) = block l (x); y is x_{l+1}, or final_residual() after the last block. w_lora: the
  // layer's adapter unit (LoRA).
  void block_forward(kernels::Stream& s, int64_t layer, const void* w, const void* x, void* y,
                     const void* w_lora = nullptr);
  void* final_residual() const { return final_res_; }
  // The residual stream's gradient (res_rows, C) that the backward phases carry down: what the
  // head phase leaves and block_backward continues (pipeline parallel: sent to the stage before,
  // received from the stage after).
  void* residual_grad() const { return dres_; }
  // Final norm, then LM head + cross-entropy in row chunks: loss_rows() gets each row's loss.
  // With g_fn/g_head non-null it back-propagates too: grads of the final norm and the head
  // (scaled by grad_scale) and d x_L into the residual gradient that block_backward continues.
  // frozen_backward (both null: LoRA's frozen norm and head): d x_L only.
  void head(kernels::Stream& s, const int32_t* targets, const void* w_fn, const void* w_head_unit, float* g_fn,
            float* g_head_unit, float grad_scale, bool first, bool frozen_backward = false);
  // Backward of block l (its forward recomputed first when it is checkpointed): grads into g
  // (null: a frozen block), the adapters' into g_lora, d x_l into the residual gradient.
  void block_backward(kernels::Stream& s, int64_t layer, const void* w, const void* x, float* g, bool first,
                      const void* w_lora = nullptr, float* g_lora = nullptr);
  // Embedding backward: dwte (and dwpe) += the residual gradient. With a tied head the head
  // phase has already written this unit's grads this step; otherwise `first` zeroes them.
  void embed_backward(kernels::Stream& s, const int32_t* ids, float* g_embed, bool first);
  // *out += Σ g² over unit u's parameters (padding excluded), fp64. Tensor parallel: tp rank 0
  // counts the unsplit tensors (the same on every rank), the others only their parts of split
  // ones, so the sum over the group is the whole model's.
  void grad_sum_squares(kernels::Stream& s, int u, const float* g, double* out) const;
  // The same over elements [lo, hi) of the unit (a ZeRO shard; g points at element lo), on ops.
  void grad_sum_squares(kernels::Ops& ops, kernels::Stream& s, int u, const float* g, int64_t lo, int64_t hi,
                        double* out) const;
  float* loss_rows() const { return losses_; }  // (N) per-row losses of the last head()

 private:
  void build_layout(int shard_world);
  void plan_workspace(char* base);
  // What every phase's ops read: ops, stream, config, dims, dtype, the tp group; block_ctx adds
  // a layer's weights, grads, activations and adapters.
  BlockCtx base_ctx(kernels::Stream& s) const;
  BlockCtx block_ctx(kernels::Stream& s, int64_t layer, const void* w, float* g, const void* w_lora = nullptr,
                     float* g_lora = nullptr) const;
  const BlockActs& acts_for(int64_t layer) const;
  void zero_ranges(kernels::Stream& s, const std::vector<UnitRange>& r, float* g) const;
  void need_group() const;  // throws where a tensor-parallel part has no group (sized for a plan)

  ModelConfig cfg_;
  const FamilyRecipe& recipe_;
  DType dtype_;
  TensorParallel tp_;
  PipelineStage pp_;
  int slot_ = 0;
  ModelDims dims_;
  kernels::Runtime& rt_;
  Checkpointing ckpt_;
  std::vector<ParamInfo> params_;
  std::vector<Unit> units_;
  BlockLayout layout_;  // same relative layout for every block
  int head_unit_ = 0;
  int64_t n_flat_ = 0;
  LoraSpec lora_spec_;
  LoraLayout lora_layout_;
  std::vector<std::string> lora_modules_;
  int lora_first_unit_ = -1;
  void* lora_u_ = nullptr;   // (N, max_kr) scratch of the adapters' GEMMs
  void* lora_du_ = nullptr;
  uint64_t lora_dropout_key_ = 0;
  void* lora_x_ = nullptr;  // (N, max_in) dropout scratch
  void* lora_t_ = nullptr;
  OuterLayout outer_;

  size_t workspace_bytes_ = 0;
  bool bound_ = false;
  std::vector<BlockActs> acts_;  // per slot and layer (unused for checkpointed layers, and other stages')
  BlockActs shared_acts_;        // checkpointed layers, forward and recompute
  BlockScratch scratch_;
  void* final_res_ = nullptr;    // (N, C) output of the last block
  void* recompute_out_ = nullptr;  // (N, C) discarded output of a recomputed forward
  void* lnf_ = nullptr;          // (N, C) final norm output
  float* lnf_mean_ = nullptr;    // (N)
  float* lnf_rstd_ = nullptr;    // (N)
  void* dres_ = nullptr;         // (N, C) gradient of the residual stream
  void* dlnf_ = nullptr;         // (N, C)
  void* logits_ = nullptr;       // (chunk_rows, V) logits / dlogits in logits_dtype_
  void* dlogits_lp_ = nullptr;   // (chunk_rows, V) fp16 dlogits (fp16 runs only)
  float* losses_ = nullptr;      // (N)
  float* ce_stats_ = nullptr;    // tensor parallel: (chunk_rows, 3) this rank's cross-entropy statistics
  float* ce_all_ = nullptr;      //   and (tp, chunk_rows, 3) the group's
  float* sp_norm_grads_ = nullptr;  // sequence parallel: (2, C) a norm's grads from this rank's rows
  float* rope_ = nullptr;        // (2, T, D/2) cos then sin (PositionKind::rope)
  int32_t* pos_ids_ = nullptr;   // (N) position of each row (PositionKind::learned)
  const int32_t* doc_pos_ = nullptr;  // set_documents
  const int32_t* doc_seg_ = nullptr;
  std::vector<char> constants_;  // host copy of the rope table / position ids, uploaded at bind
  DType logits_dtype_ = DType::f32;  // bf16 runs keep logits in bf16 (as llm.c); fp32 and fp16 in fp32
};

}  // namespace strata
