// The Transformer's units, parameter table and workspace plan, and its per-unit phases:
// embedding, blocks (with recompute for checkpointed ones), final norm, then the LM head and
// cross-entropy chunked over rows so the (N, V) logits never exist at once.
#include "src/model/transformer.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>

#include "kernels/cpu/parallel.h"
#include "src/comm/communicator.h"
#include "src/model/block_common.h"
#include "src/model/family.h"
#include "src/model/init_normal.h"
#include "src/model/linear.h"
#include "src/model/quant.h"

namespace strata {
using model_detail::at;
using model_detail::Carver;

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

Checkpointing parse_checkpointing(const std::string& text) {
  if (text == "none") return {0};
  if (text == "full") return {1};
  if (text.rfind("every:", 0) == 0) {
    const std::string n = text.substr(6);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(n, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == n.size() && !n.empty() && v >= 1) return {v};
  }
  throw std::invalid_argument("--checkpoint-activations '" + text + "': expected none, full or every:N (N >= 1)");
}

std::string checkpointing_name(const Checkpointing& c) {
  if (c.every == 0) return "none";
  if (c.every == 1) return "full";
  return "every:" + std::to_string(c.every);
}

ModelDims model_dims(const ModelConfig& cfg, int64_t batch, int64_t seq, const TensorParallel& tp) {
  ModelDims d;
  d.B = batch;
  d.T = seq;
  d.N = batch * seq;
  d.C = cfg.hidden_size;
  d.L = cfg.n_layers;
  d.V = cfg.vocab_size;
  d.full_vocab = d.V;
  d.Hq = cfg.n_heads;
  d.D = cfg.effective_head_dim();
  d.Q = d.Hq * d.D;
  d.I = cfg.intermediate_size > 0 ? cfg.intermediate_size : 4 * d.C;
  family_recipe(cfg.family).dims(cfg, d);  // Hkv, FC
  d.QKV = (d.Hq + 2 * d.Hkv) * d.D;
  d.res_rows = d.N;
  if (tp.size == 1) return d;
  // Megatron-LM: each rank its heads (GQA: its kv heads, so no kv head is repeated across
  // ranks), its slice of the MLP, its rows of the vocabulary.
  const int64_t n = tp.size;
  auto divides = [&](int64_t what, const char* name) {
    if (what % n != 0)
      throw std::invalid_argument("--tp " + std::to_string(n) + " does not divide the model's " + name + " (" +
                                  std::to_string(what) + "): choose a --tp that divides it");
  };
  divides(d.Hq, "attention heads");
  divides(d.Hkv, "key/value heads");
  divides(d.I, "MLP width (intermediate_size)");
  const auto [v0, v1] = tp_piece(d.V, static_cast<int>(n) - 1, static_cast<int>(n));
  if (v1 <= v0)
    throw std::invalid_argument("--tp " + std::to_string(n) + " leaves the last rank no rows of the " +
                                std::to_string(d.V) + "-token vocabulary: use a smaller --tp");
  const auto [mine0, mine1] = tp_piece(d.V, tp.rank, static_cast<int>(n));
  d.vocab_start = mine0;
  d.V = mine1 - mine0;
  d.Hq /= n;
  d.Hkv /= n;
  d.Q = d.Hq * d.D;
  d.QKV = (d.Hq + 2 * d.Hkv) * d.D;
  d.FC = d.FC / n;  // gate and up (llama) or c_fc (gpt2): each split the same way
  d.I /= n;
  if (tp.sequence) {
    if (d.N % n != 0)
      throw std::invalid_argument("--sequence-parallel splits the " + std::to_string(d.N) +
                                  " rows of a micro-batch (--batch × --seq) over --tp " + std::to_string(n) +
                                  ", which does not divide them: choose a --batch or --seq that it divides");
    d.res_rows = d.N / n;
    d.res_row0 = tp.rank * d.res_rows;
  }
  return d;
}

std::pair<int64_t, int64_t> tp_piece(int64_t length, int rank, int size) {
  const int64_t piece = (length + size - 1) / size;
  return {std::min(length, rank * piece), std::min(length, (rank + 1) * piece)};
}

int64_t tp_numel(const ParamInfo& p, int rank, int size) {
  int64_t numel = 0;
  tp_runs(p, rank, size, [&](int64_t, int64_t, int64_t n) { numel += n; });
  return numel;
}

void tp_runs(const ParamInfo& p, int rank, int size, const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const std::vector<int64_t>& full = p.full_shape;
  int64_t numel = 1;
  for (int64_t x : full) numel *= x;
  if (p.split.dim < 0 || size == 1) {
    fn(0, 0, numel);
    return;
  }
  const auto d = static_cast<size_t>(p.split.dim);
  // rows: the product of the dims before `dim`; inner: after it. Each row holds the segments'
  // pieces, each piece (b - a) · inner contiguous elements of the HF tensor.
  int64_t rows = 1, inner = 1;
  for (size_t i = 0; i < d; ++i) rows *= full[i];
  for (size_t i = d + 1; i < full.size(); ++i) inner *= full[i];
  const int64_t seg = full[d] / p.split.segments;
  const auto [a, b] = tp_piece(seg, rank, size);
  const int64_t local_row = (b - a) * p.split.segments * inner;
  for (int64_t r = 0; r < rows; ++r)
    for (int s = 0; s < p.split.segments; ++s)
      fn(r * local_row + s * (b - a) * inner, (r * full[d] + s * seg + a) * inner, (b - a) * inner);
}

Transformer::Transformer(const ModelConfig& cfg, DType dtype, int64_t batch, int64_t seq, kernels::Runtime& rt,
                         Checkpointing ckpt, int64_t logits_chunk_bytes, int shard_world, const LoraSpec& lora,
                         const TensorParallel& tp, const PipelineStage& pp)
    : cfg_(cfg), recipe_(family_recipe(cfg.family)), dtype_(dtype), tp_(tp), pp_(pp), rt_(rt), ckpt_(ckpt),
      lora_spec_(lora) {
  if (shard_world < 1) throw std::invalid_argument("shard_world must be >= 1, got " + std::to_string(shard_world));
  cfg_.validate();
  if (batch <= 0) throw std::invalid_argument("batch must be positive, got " + std::to_string(batch));
  if (seq <= 0) throw std::invalid_argument("seq must be positive, got " + std::to_string(seq));
  if (seq > cfg_.max_position_embeddings)
    throw std::invalid_argument("--seq " + std::to_string(seq) + " exceeds the model's max_position_embeddings " +
                                std::to_string(cfg_.max_position_embeddings));
  if (ckpt_.every < 0) throw std::invalid_argument("checkpointing: every must be >= 0");
  if (tp_.size < 1 || tp_.rank < 0 || tp_.rank >= tp_.size)
    throw std::invalid_argument("Transformer: tensor-parallel rank " + std::to_string(tp_.rank) + " of " +
                                std::to_string(tp_.size));
  if (tp_.sequence && !tp_.on())
    throw std::invalid_argument("--sequence-parallel splits rows over the tensor-parallel group: it needs --tp 2 or more");
  dims_ = model_dims(cfg_, batch, seq, tp_);
  ModelDims& d = dims_;
  if (pp_.end < 0) pp_.end = d.L;
  if (pp_.size < 1 || pp_.rank < 0 || pp_.rank >= pp_.size || pp_.first < 0 || pp_.first >= pp_.end ||
      pp_.end > d.L || pp_.slots < 1 || (!pp_.on() && (pp_.first != 0 || pp_.end != d.L)))
    throw std::invalid_argument("Transformer: pipeline stage " + std::to_string(pp_.rank) + " of " +
                                std::to_string(pp_.size) + " with layers [" + std::to_string(pp_.first) + ", " +
                                std::to_string(pp_.end) + ") of " + std::to_string(d.L) + ", " +
                                std::to_string(pp_.slots) + " slots");
  // LM-head chunks: at most logits_chunk_bytes of logits at once, split evenly so each chunk's
  // matmuls stay large. Each chunk re-reads and re-writes the fp32 head gradient (V, C), so
  // fewer, larger chunks are cheaper; bf16 runs keep logits in bf16 (half the bytes per row),
  // with the cross-entropy's math in fp32 as llm.c does.
  logits_dtype_ = dtype_ == DType::bf16 ? DType::bf16 : DType::f32;
  const int64_t row_bytes = d.V * static_cast<int64_t>(kernels::dtype_size(logits_dtype_));
  const int64_t max_rows = std::max<int64_t>(logits_chunk_bytes / row_bytes, 1);
  const int64_t n_chunks = (d.N + max_rows - 1) / max_rows;
  d.chunk_rows = (d.N + n_chunks - 1) / n_chunks;
  build_layout(shard_world);
  plan_workspace(nullptr);  // sizes workspace_bytes_
}

Transformer::~Transformer() = default;

void Transformer::build_layout(int shard_world) {
  const ModelDims& d = dims_;
  int64_t flat = 0;
  auto begin_unit = [&](std::string name) { units_.push_back(Unit{std::move(name), flat, 0, 0, {}, {}, {}}); };
  // Tensor parallel: the LoRA tensors' splits, by name (the adapters build them below).
  std::map<std::string, TpSplit> lora_splits;
  // Adds a tensor to the current unit; returns its offset relative to the unit's start.
  const AddTensor add = [&](const std::string& name, std::vector<int64_t> shape, InitKind init) -> int64_t {
    Unit& u = units_.back();
    ParamInfo p;
    p.name = name;
    p.numel = 1;
    for (int64_t sz : shape) p.numel *= sz;
    p.shape = std::move(shape);
    p.full_shape = p.shape;
    if (tp_.on()) {  // shape is this rank's part (the dims are): the HF tensor's from the split
      // The embedding table (the embedding unit's first tensor) and an untied head: vocabulary
      // rows; the rest as the family says.
      const bool vocab =
          (units_.size() == 1 && u.params.empty()) || (!recipe_.head_name.empty() && name == recipe_.head_name);
      const auto adapter = lora_splits.find(name);
      p.split = vocab ? TpSplit{0, 1} : adapter != lora_splits.end() ? adapter->second : recipe_.tp_split(name);
      if (vocab) p.full_shape[0] = d.full_vocab;
      else if (p.split.dim >= 0) p.full_shape[static_cast<size_t>(p.split.dim)] *= tp_.size;
    }
    p.unit = static_cast<int>(units_.size() - 1);
    p.unit_offset = u.n_real;
    p.offset = u.offset + u.n_real;
    p.decay = p.shape.size() == 2;
    p.ones = init == InitKind::ones;
    p.zeros = init == InitKind::zeros;
    u.n_real += p.numel;
    u.params.push_back(static_cast<int>(params_.size()));
    params_.push_back(p);
    return p.unit_offset;
  };
  auto end_unit = [&] {
    Unit& u = units_.back();
    u.numel = round_up(u.n_real, kUnitAlignElems * shard_world);
    flat += u.numel;
  };

  begin_unit("embed");
  recipe_.embed_tensors(cfg_, d, add, outer_);
  end_unit();

  for (int64_t l = 0; l < d.L; ++l) {
    begin_unit("block." + std::to_string(l));
    const BlockLayout b = recipe_.block_tensors(cfg_, d, l, add);
    if (l == 0) layout_ = b;
    end_unit();
  }

  begin_unit("final_norm");
  recipe_.final_norm_tensors(cfg_, d, add, outer_);
  end_unit();

  if (!recipe_.tied_head(cfg_)) {
    begin_unit("lm_head");
    outer_.head = add(std::string(recipe_.head_name), {d.V, d.C}, InitKind::normal);
    head_unit_ = static_cast<int>(units_.size() - 1);
    end_unit();
  } else {
    outer_.head = outer_.wte;
    head_unit_ = 0;
  }

  // LoRA: the base frozen; per layer one adapter unit, each slot's A matrices stacked, then its
  // B matrices (src/model/lora.h LoraLayout), in PEFT's names.
  if (lora_spec_.on()) {
    const int64_t r = lora_spec_.rank;
    const std::vector<std::string> targets =
        lora_spec_.targets.empty() ? parse_lora_targets(std::string(recipe_.lora_default_targets)) : lora_spec_.targets;
    const std::vector<LinearModule> mods = match_lora_targets(recipe_.linear_modules(d), targets);
    for (const LinearModule& m : mods) lora_modules_.push_back(m.name);
    for (Unit& u : units_) u.trainable = false;
    lora_first_unit_ = static_cast<int>(units_.size());
    lora_layout_ = LoraLayout{};
    lora_layout_.rank = r;
    lora_layout_.scale = lora_spec_.scale();
    lora_layout_.dropout = static_cast<float>(lora_spec_.dropout);
    for (int64_t l = 0; l < d.L; ++l) {
      begin_unit("block." + std::to_string(l) + ".lora");
      const std::string h = std::string(recipe_.layer_prefix) + std::to_string(l) + ".";
      for (int s = 0; s < kLoraSlots; ++s) {
        LoraSlotLayout sl;
        std::vector<const LinearModule*> in_slot;
        for (const LinearModule& m : mods)
          if (static_cast<int>(m.slot) == s) in_slot.push_back(&m);
        // Tensor parallel: a column-parallel layer's adapter (q, k, v, gate, up, c_attn, c_fc)
        // has A whole and B split as the layer's output; a row-parallel one's (o, down, c_proj)
        // A split as its input and B whole.
        const bool row = s == static_cast<int>(LoraSlot::o) || s == static_cast<int>(LoraSlot::proj);
        for (const LinearModule* m : in_slot) {
          const std::string name = h + m->name;
          lora_splits[name + ".lora_A.weight"] = row ? TpSplit{1, 1} : TpSplit{};
          lora_splits[name + ".lora_B.weight"] =
              row ? TpSplit{} : TpSplit{0, recipe_.tp_split(name + ".weight").segments};
        }
        for (const LinearModule* m : in_slot) {
          const int64_t a = add(h + m->name + ".lora_A.weight", {r, m->in}, InitKind::normal);
          const int64_t in = row ? m->in * tp_.size : m->in;  // the layer's whole input
          params_.back().uniform = 1.0f / std::sqrt(static_cast<float>(in));  // Kaiming-uniform, a = √5
          if (sl.a < 0) sl.a = a;
          sl.in = m->in;
          sl.kr += r;
        }
        for (const LinearModule* m : in_slot)
          sl.targets.push_back({m->col, m->out, add(h + m->name + ".lora_B.weight", {m->out, r}, InitKind::zeros)});
        lora_layout_.max_kr = std::max(lora_layout_.max_kr, sl.kr);
        lora_layout_.max_in = std::max(lora_layout_.max_in, sl.in);
        lora_layout_.slots[static_cast<size_t>(s)] = std::move(sl);
      }
      end_unit();
    }
  }
  // Pipeline parallel: another stage's units hold nothing here (their tensors keep their places
  // in params_, so init draws the same values on every grid); offsets close up.
  if (pp_.on()) {
    const int64_t L = d.L;
    for (size_t ui = 0; ui < units_.size(); ++ui) {
      const auto u = static_cast<int64_t>(ui);
      const int64_t layer = u >= 1 && u <= L ? u - 1 : lora() && u >= lora_first_unit_ ? u - lora_first_unit_ : -1;
      bool held = layer >= 0 ? holds_layer(layer) : u == L + 1 || u == head_unit_ ? pp_.last_stage() : false;
      if (u == 0) held = pp_.first_stage() || (pp_.last_stage() && tied_head());
      if (held) continue;
      Unit& unit = units_[ui];
      unit.held = false;
      unit.params.clear();
      unit.numel = unit.n_real = 0;
    }
    flat = 0;
    for (Unit& unit : units_) {
      unit.offset = flat;
      for (int pi : unit.params) params_[static_cast<size_t>(pi)].offset = flat + params_[static_cast<size_t>(pi)].unit_offset;
      flat += unit.numel;
    }
  }
  n_flat_ = flat;

  // Per unit: AdamW ranges (decay runs merged) and the grads no matmul writes whole. Matmuls
  // write each block's fused qkv, o, fc and proj matrices and the head; the rest accumulates.
  auto add_range = [](std::vector<UnitRange>& v, UnitRange r) {
    if (!v.empty() && v.back().decay == r.decay && v.back().offset + v.back().numel == r.offset)
      v.back().numel += r.numel;
    else
      v.push_back(r);
  };
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    Unit& u = units_[ui];
    std::vector<std::pair<int64_t, int64_t>> by_matmul;  // (unit offset, numel)
    if (static_cast<int>(ui) == head_unit_) by_matmul.emplace_back(outer_.head, d.V * d.C);
    if (ui >= 1 && static_cast<int64_t>(ui) <= d.L)
      by_matmul.insert(by_matmul.end(), {{layout_.qkv_w, d.QKV * d.C},
                                         {layout_.o_w, d.C * d.Q},
                                         {layout_.fc_w, d.FC * d.C},
                                         {layout_.proj_w, d.I * d.C}});
    for (int pi : u.params) {
      const ParamInfo& p = params_[static_cast<size_t>(pi)];
      add_range(u.adamw_ranges, {p.unit_offset, p.numel, p.decay});
      const bool written = std::any_of(by_matmul.begin(), by_matmul.end(), [&](const auto& r) {
        return p.unit_offset >= r.first && p.unit_offset + p.numel <= r.first + r.second;
      });
      if (!written) add_range(u.accum_only, {p.unit_offset, p.numel, false});
    }
  }
}

// Carves the workspace out of `base` (null: only sizes it, into workspace_bytes_).
void Transformer::plan_workspace(char* base) {
  const ModelDims& d = dims_;
  const DType dt = dtype_;
  Carver cv{base};
  auto plan_acts = [&](BlockActs& a) { a = recipe_.carve_acts(cv, d, dt); };
  acts_.assign(static_cast<size_t>(d.L * pp_.slots), BlockActs{});
  for (int64_t k = 0; k < pp_.slots; ++k)
    for (int64_t l = pp_.first; l < pp_.end; ++l)
      if (!ckpt_.at(l)) plan_acts(acts_[static_cast<size_t>(k * d.L + l)]);
  shared_acts_ = BlockActs{};
  if (ckpt_.any()) {
    plan_acts(shared_acts_);
    recompute_out_ = cv.take_dt(d.N * d.C, dt);
  }
  scratch_.tmp_c = cv.take_dt(d.N * d.C, dt);
  scratch_.d_c = cv.take_dt(d.N * d.C, dt);
  scratch_.d_q = cv.take_dt(d.N * d.Q, dt);
  scratch_.d_fc = cv.take_dt(d.N * std::max(d.FC, d.QKV), dt);
  scratch_.d_act = cv.take_dt(d.N * d.I, dt);
  final_res_ = cv.take_dt(d.N * d.C, dt);
  lnf_ = cv.take_dt(d.N * d.C, dt);
  lnf_mean_ = cv.take_f32(d.N);
  lnf_rstd_ = cv.take_f32(d.N);
  dres_ = cv.take_dt(d.N * d.C, dt);
  dlnf_ = cv.take_dt(d.N * d.C, dt);
  const int64_t head_rows = pp_.last_stage() ? d.chunk_rows : 0;  // (another stage's head: none)
  logits_ = cv.take_dt(head_rows * d.V, logits_dtype_);
  dlogits_lp_ = dt == DType::f16 ? cv.take_dt(head_rows * d.V, dt) : nullptr;
  losses_ = cv.take_f32(d.N);
  ce_stats_ = tp_.on() ? cv.take_f32(3 * d.chunk_rows) : nullptr;
  ce_all_ = tp_.on() ? cv.take_f32(3 * d.chunk_rows * tp_.size) : nullptr;
  sp_norm_grads_ = tp_.sequence ? cv.take_f32(2 * d.C) : nullptr;
  lora_u_ = lora() ? cv.take_dt(d.N * lora_layout_.max_kr, dt) : nullptr;
  lora_du_ = lora() ? cv.take_dt(d.N * lora_layout_.max_kr, dt) : nullptr;
  const bool drop = lora() && lora_layout_.dropout > 0;
  lora_x_ = drop ? cv.take_dt(d.N * lora_layout_.max_in, dt) : nullptr;
  lora_t_ = drop ? cv.take_dt(d.N * lora_layout_.max_in, dt) : nullptr;
  if (recipe_.positions == PositionKind::learned)
    pos_ids_ = static_cast<int32_t*>(cv.take(static_cast<size_t>(d.N) * sizeof(int32_t)));
  else
    rope_ = cv.take_f32(2 * d.T * (d.D / 2));
  workspace_bytes_ = (cv.off + 4095) / 4096 * 4096;
}

void Transformer::bind_workspace(kernels::Stream& s, void* base) {
  if (!base) throw std::invalid_argument("bind_workspace: null workspace");
  plan_workspace(static_cast<char*>(base));
  bound_ = true;
  const ModelDims& d = dims_;
  // Constants: learned positions' ids (N): t for row b·T + t; RoPE tables (2, T, D/2): cos/sin
  // of fp32 t · inv_freq, as HF computes them. Uploaded from a host copy the model keeps alive.
  if (recipe_.positions == PositionKind::learned) {
    constants_.resize(static_cast<size_t>(d.N) * sizeof(int32_t));
    auto* pos = reinterpret_cast<int32_t*>(constants_.data());
    for (int64_t i = 0; i < d.N; ++i) pos[i] = static_cast<int32_t>(i % d.T);
    s.memcpy_async(pos_ids_, constants_.data(), constants_.size());
  } else {
    const std::vector<float> table = rope_tables(cfg_, d.T);
    constants_.resize(table.size() * sizeof(float));
    std::memcpy(constants_.data(), table.data(), constants_.size());
    s.memcpy_async(rope_, constants_.data(), constants_.size());
  }
}

size_t Transformer::input_bytes() const {
  return static_cast<size_t>(dims_.res_rows * dims_.C) * kernels::dtype_size(dtype_);
}

const ParamInfo* Transformer::find_param(const std::string& name) const {
  for (const ParamInfo& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

int64_t Transformer::n_params() const {
  int64_t n = 0;
  for (const ParamInfo& p : params_)
    if (holds(p)) n += p.numel;
  return n;
}

int64_t Transformer::n_model_params() const {
  int64_t n = 0;
  for (const ParamInfo& p : params_) {
    int64_t k = 1;
    for (int64_t x : p.full_shape) k *= x;
    n += k;
  }
  return n;
}

namespace {
// The stored form's pieces: per tensor of the unit, its kind (a matrix: the base's; otherwise
// the working dtype's) and byte offset.
struct StoredPiece {
  const ParamInfo* p;
  bool matrix;
  size_t at, bytes;
};
QuantKind working_kind(DType dt) { return dt == DType::bf16 ? QuantKind::bf16 : QuantKind::fp16; }
}  // namespace

bool Transformer::stored_unit(int u) const {
  if (!lora() || lora_spec_.base_dtype.empty()) return false;
  const bool layer = u >= block_unit(0) && u < block_unit(dims_.L);  // a frozen layer, not its adapters
  return layer && !units_.at(static_cast<size_t>(u)).trainable && lora_spec_.base_dtype != kernels::dtype_name(dtype_);
}

static std::vector<StoredPiece> stored_pieces(const Transformer& m, int u, QuantKind kind) {
  std::vector<StoredPiece> out;
  size_t at = 0;
  const size_t esz = kernels::dtype_size(m.dtype());
  for (int pi : m.units()[static_cast<size_t>(u)].params) {
    const ParamInfo& p = m.params()[static_cast<size_t>(pi)];
    const bool matrix = p.shape.size() == 2;
    const size_t bytes = matrix ? bytes_for(kind, p.shape[0], p.shape[1]) : static_cast<size_t>(p.numel) * esz;
    at = (at + 63) / 64 * 64;
    out.push_back({&p, matrix, at, bytes});
    at += bytes;
  }
  return out;
}

size_t Transformer::stored_bytes(int u) const {
  const auto pieces = stored_pieces(*this, u, parse_quant_kind(lora_spec_.base_dtype));
  return pieces.empty() ? 64 : (pieces.back().at + pieces.back().bytes + 63) / 64 * 64;
}

void Transformer::store_unit(int u, const float* master, void* stored) const {
  const QuantKind kind = parse_quant_kind(lora_spec_.base_dtype);
  auto* dst = static_cast<char*>(stored);
  std::memset(dst, 0, stored_bytes(u));
  for (const StoredPiece& s : stored_pieces(*this, u, kind)) {
    const float* src = master + s.p->unit_offset;
    if (s.matrix)
      quantize(kind, src, DType::f32, s.p->shape[0], s.p->shape[1], dst + s.at);
    else if (dtype_ == DType::f32)
      std::memcpy(dst + s.at, src, s.bytes);
    else
      quantize(working_kind(dtype_), src, DType::f32, 1, s.p->numel, dst + s.at);
  }
}

void Transformer::decode_unit(kernels::Stream& s, kernels::Ops& ops, int u, const void* stored, void* working) const {
  const QuantKind kind = parse_quant_kind(lora_spec_.base_dtype);
  const auto* src = static_cast<const char*>(stored);
  const size_t esz = kernels::dtype_size(dtype_);
  const Unit& unit = units_.at(static_cast<size_t>(u));
  for (const StoredPiece& p : stored_pieces(*this, u, kind)) {
    void* out = static_cast<char*>(working) + static_cast<size_t>(p.p->unit_offset) * esz;
    if (p.matrix)
      ops.dequantize(s, dequantize_args(kind, src + p.at, p.p->shape[0], p.p->shape[1], out, dtype_));
    else
      s.memcpy_async(out, src + p.at, p.bytes);
  }
  if (unit.numel > unit.n_real)
    s.memset_async(static_cast<char*>(working) + static_cast<size_t>(unit.n_real) * esz, 0,
                   static_cast<size_t>(unit.numel - unit.n_real) * esz);
}

int64_t Transformer::n_trainable_params() const {
  int64_t n = 0;
  for (const ParamInfo& p : params_)
    if (units_[static_cast<size_t>(p.unit)].trainable && holds(p)) n += p.numel;
  return n;
}

void Transformer::init_unit(int u, uint64_t seed, float* master) const {
  init_range(u, seed, 0, units_.at(static_cast<size_t>(u)).numel, master);
}

void Transformer::init_range(int u, uint64_t seed, int64_t lo, int64_t hi, float* out) const {
  const Unit& unit = units_.at(static_cast<size_t>(u));
  for (int pi : unit.params) {
    const ParamInfo& p = params_[static_cast<size_t>(pi)];
    // This tensor's elements inside [lo, hi): [a, b) of the tensor, at out + (offset + a - lo).
    const int64_t a = std::max<int64_t>(0, lo - p.unit_offset), b = std::min(p.numel, hi - p.unit_offset);
    if (b <= a) continue;
    float* dst = out + (p.unit_offset + a - lo);
    if (p.ones || p.zeros) {
      std::fill(dst, dst + (b - a), p.ones ? 1.f : 0.f);
      continue;
    }
    const uint64_t key = init_stream_key(seed, static_cast<uint64_t>(pi));
    // The HF tensor's values (tensor parallel: this rank's part of them, each element the one
    // of the whole tensor's stream it stands for, so every grid starts from the same model).
    tp_runs(p, tp_.rank, tp_.size, [&](int64_t local, int64_t full, int64_t n) {
      const int64_t x0 = std::max(a, local), x1 = std::min(b, local + n);
      if (x1 <= x0) return;
      if (p.uniform > 0) {
        fill_uniform(key, full + (x0 - local), x1 - x0, p.uniform, dst + (x0 - a));
        return;
      }
      kernels::cpu::parallel_for(x0, x1, 1 << 16, [&](int64_t x, int64_t y) {
        fill_normal(key, full + (x - local), y - x, 0.02f, dst + (x - a));
      });
    });
  }
  if (hi > unit.n_real) std::fill(out + (std::max(lo, unit.n_real) - lo), out + (hi - lo), 0.f);
}

namespace {

// p's name in ckpt: behind name_prefix, without the family's optional prefix where the file
// leaves it out (gpt2's "transformer.").
std::string stored_name(const HfCheckpoint& ckpt, const std::string& name_prefix, std::string_view optional,
                        const ParamInfo& p) {
  std::string name = name_prefix + p.name;
  if (!optional.empty() && !ckpt.find(name) && name.rfind(optional, 0) == 0 && ckpt.find(name.substr(optional.size())))
    name = name.substr(optional.size());
  return name;
}

}  // namespace

void Transformer::load_unit(int u, const HfCheckpoint& ckpt, float* master, const std::string& name_prefix,
                            const WholeTensorFn& whole) const {
  const Unit& unit = units_.at(static_cast<size_t>(u));
  for (int pi : unit.params) {
    const ParamInfo& p = params_[static_cast<size_t>(pi)];
    read_param(ckpt, stored_name(ckpt, name_prefix, recipe_.optional_prefix, p), p, master + p.unit_offset, whole);
  }
  std::fill(master + unit.n_real, master + unit.numel, 0.f);
}

void Transformer::load_range(int u, const HfCheckpoint& ckpt, int64_t lo, int64_t hi, float* out,
                             const std::string& name_prefix) const {
  if (tp_.on()) throw std::logic_error("Transformer::load_range under tensor parallelism");
  const Unit& unit = units_.at(static_cast<size_t>(u));
  std::fill(out, out + (hi - lo), 0.f);
  for (int pi : unit.params) {
    const ParamInfo& p = params_[static_cast<size_t>(pi)];
    // This tensor's elements inside [lo, hi): [a, b) of the tensor, at out + (offset + a - lo).
    const int64_t a = std::max<int64_t>(0, lo - p.unit_offset), b = std::min(p.numel, hi - p.unit_offset);
    if (b <= a) continue;
    ckpt.read_range(stored_name(ckpt, name_prefix, recipe_.optional_prefix, p), p.shape, a, b,
                    out + (p.unit_offset + a - lo), DType::f32);
  }
}

void Transformer::read_param(const HfCheckpoint& ckpt, const std::string& name, const ParamInfo& p, float* dst,
                             const WholeTensorFn& whole) const {
  if (p.split.dim < 0 || !tp_.on()) {
    ckpt.read_into(name, p.shape, dst, DType::f32);
    if (whole) whole(p, dst);
    return;
  }
  // Tensor parallel: this rank's part, a run of the HF tensor at a time (tp_runs); where the
  // caller wants the whole tensor too (a frozen base's crc), the whole, then the part.
  if (!whole) {
    tp_runs(p, tp_.rank, tp_.size, [&](int64_t local, int64_t full, int64_t n) {
      ckpt.read_range(name, p.full_shape, full, full + n, dst + local, DType::f32);
    });
    return;
  }
  int64_t numel = 1;
  for (int64_t x : p.full_shape) numel *= x;
  std::vector<float> all(static_cast<size_t>(numel));
  ckpt.read_into(name, p.full_shape, all.data(), DType::f32);
  tp_runs(p, tp_.rank, tp_.size, [&](int64_t local, int64_t full, int64_t n) {
    std::memcpy(dst + local, all.data() + full, static_cast<size_t>(n) * sizeof(float));
  });
  if (whole) whole(p, all.data());
}

const BlockActs& Transformer::acts_for(int64_t layer) const {
  if (!holds_layer(layer))
    throw std::logic_error("Transformer: layer " + std::to_string(layer) + " belongs to another pipeline stage");
  return ckpt_.at(layer) ? shared_acts_ : acts_[static_cast<size_t>(slot_ * dims_.L + layer)];
}

void Transformer::select_slot(int slot) {
  if (slot < 0 || slot >= pp_.slots)
    throw std::logic_error("Transformer: micro-batch slot " + std::to_string(slot) + " of " + std::to_string(pp_.slots));
  slot_ = slot;
}

namespace {
// --pp-layers "5,7": the layers per stage (empty: none given).
std::vector<int64_t> parse_pp_layers(const std::string& text) {
  std::vector<int64_t> out;
  if (text.empty()) return out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    char* end = nullptr;
    const long long v = item.empty() ? -1 : std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > (int64_t{1} << 20))
      throw std::invalid_argument("--pp-layers " + text + ": expected positive layer counts separated by commas, e.g. 5,7");
    out.push_back(v);
    at = comma + 1;
  }
  return out;
}

}  // namespace

std::vector<int64_t> pipeline_layers(int64_t L, int size, const std::string& text) {
  const std::vector<int64_t> layers = parse_pp_layers(text);
  int64_t sum = 0;
  for (int64_t n : layers) sum += n;  // (each >= 1)
  if (static_cast<int>(layers.size()) != size || sum != L)
    throw std::invalid_argument("--pp-layers " + text + ": give " + std::to_string(size) +
                                " counts (one per --pp stage) that sum to the model's " + std::to_string(L) + " layers");
  return layers;
}

PipelineStage pipeline_stage(const std::vector<int64_t>& layers, int rank, int64_t micro_batches, Communicator* comm) {
  PipelineStage s;
  s.size = static_cast<int>(layers.size());
  s.rank = rank;
  for (int k = 0; k < rank; ++k) s.first += layers[static_cast<size_t>(k)];
  s.end = s.first + layers.at(static_cast<size_t>(rank));
  s.slots = static_cast<int>(std::min<int64_t>(s.size - rank, micro_batches));
  s.comm = comm;
  return s;
}

void Transformer::need_group() const {
  if (tp_.on() && !tp_.comm)
    throw std::logic_error("Transformer: a tensor-parallel rank's part sized without its group (a plan) cannot run");
}

BlockCtx Transformer::base_ctx(kernels::Stream& s) const {
  need_group();
  BlockCtx c;
  c.ops = &rt_.ops();
  c.stream = &s;
  c.cfg = &cfg_;
  c.dims = &dims_;
  c.dtype = dtype_;
  c.tp_comm = tp_.on() ? tp_.comm : nullptr;
  c.sp_norm_grads = sp_norm_grads_;
  return c;
}

BlockCtx Transformer::block_ctx(kernels::Stream& s, int64_t layer, const void* w, float* g, const void* w_lora,
                                float* g_lora) const {
  BlockCtx c = base_ctx(s);
  if (lora()) {
    if (!w_lora) throw std::logic_error("Transformer: layer " + std::to_string(layer) + " without its LoRA adapters");
    c.lora = &lora_layout_;
    c.lora_w = w_lora;
    c.lora_g = g_lora;
    c.lora_u = lora_u_;
    c.lora_du = lora_du_;
    c.lora_x = lora_x_;
    c.lora_t = lora_t_;
    // Each layer its own stream of masks (0 stays 0: no dropout).
    c.lora_dropout_key = lora_dropout_key_ ? lora_dropout_key_ * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(layer) + 1 : 0;
  }
  c.w = w;
  c.g = g;
  c.layout = &layout_;
  if (rope_) {
    c.rope_cos = rope_;
    c.rope_sin = rope_ + dims_.T * (dims_.D / 2);
  }
  c.scratch = &scratch_;
  c.pos = doc_pos_;
  c.seg_start = doc_seg_;
  return c;
}

void Transformer::zero_ranges(kernels::Stream& s, const std::vector<UnitRange>& ranges, float* g) const {
  for (const UnitRange& r : ranges) s.memset_async(g + r.offset, 0, static_cast<size_t>(r.numel) * sizeof(float));
}

void Transformer::embed_forward(kernels::Stream& s, const int32_t* ids, const void* w, void* x0) {
  assert(bound_);
  need_group();
  const ModelDims& d = dims_;
  const DType dt = dtype_;
  kernels::Ops& ops = rt_.ops();
  // Tensor parallel: each token's row from the rank holding it, zero elsewhere, summed over the
  // group (exact: one non-zero term), before the positions are added as without. Sequence
  // parallel: every row looked up into a scratch (dlnf, unused until the head's backward), and
  // this rank's rows of the sum kept.
  const bool sp = tp_.sequence;  // (only with tp: the constructor checks)
  void* whole = sp ? dlnf_ : x0;
  ops.embedding(s, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = d.V, .ids = ids, .table = at(w, outer_.wte, dt),
                    .out = whole, .accumulate = false, .row0 = d.vocab_start,
                    .full_vocab = tp_.on() ? d.full_vocab : 0});
  if (sp) {
    void* mine = at(whole, d.res_row0 * d.C, dt);
    tp_.comm->reduce_scatter(whole, mine, static_cast<size_t>(d.res_rows * d.C), dt, s);
    s.memcpy_async(x0, mine, input_bytes());
  } else if (tp_.on()) {
    tp_.comm->all_reduce(x0, x0, static_cast<size_t>(d.N * d.C), dt, s);
  }
  if (outer_.wpe >= 0)
    ops.embedding(s, {.dtype = dt, .n_tokens = d.res_rows, .dim = d.C, .vocab = cfg_.max_position_embeddings,
                      .ids = (doc_pos_ ? doc_pos_ : pos_ids_) + d.res_row0, .table = at(w, outer_.wpe, dt), .out = x0,
                      .accumulate = true});
}

void Transformer::block_forward(kernels::Stream& s, int64_t layer, const void* w, const void* x, void* y,
                                const void* w_lora) {
  assert(bound_);
  recipe_.block_forward(block_ctx(s, layer, w, nullptr, w_lora), x, acts_for(layer), y);
}

void Transformer::head(kernels::Stream& s, const int32_t* targets, const void* w_fn, const void* w_head_unit,
                       float* g_fn, float* g_head_unit, float grad_scale, bool first, bool frozen_backward) {
  assert(bound_);
  if (!pp_.last_stage()) throw std::logic_error("Transformer: the head belongs to the last pipeline stage");
  const ModelDims& d = dims_;
  const DType dt = dtype_;
  const bool backward = g_fn != nullptr || frozen_backward;
  need_group();
  kernels::Ops& ops = rt_.ops();
  const float eps = static_cast<float>(cfg_.norm_eps);
  const void* w_head = at(w_head_unit, outer_.head, dt);
  if (g_fn && first) {  // this step's first writes of these units' grads
    zero_ranges(s, units_[static_cast<size_t>(final_norm_unit())].accum_only, g_fn);
    zero_ranges(s, units_[static_cast<size_t>(head_unit_)].accum_only, g_head_unit);
  }

  // lnf (N, C) = final norm of the last residual (sequence parallel: this rank's rows, gathered)
  const bool sp = tp_.sequence;  // (only with tp: the constructor checks)
  void* lnf_mine = at(lnf_, d.res_row0 * d.C, dt);
  kernels::NormArgs nf{.dtype = dt, .rows = d.res_rows, .cols = d.C, .eps = eps, .x = final_res_,
                       .weight = at(w_fn, outer_.lnf_w, dt),
                       .bias = outer_.lnf_b >= 0 ? at(w_fn, outer_.lnf_b, dt) : nullptr, .y = lnf_mine,
                       .mean = lnf_mean_, .rstd = lnf_rstd_};
  recipe_.norm_forward(ops, s, nf);
  if (sp) tp_.comm->all_gather(lnf_mine, lnf_, static_cast<size_t>(d.res_rows * d.C), dt, s);

  // LM head + cross-entropy, chunk_rows rows at a time: logits (R, V) = lnf[r] · Wheadᵀ.
  for (int64_t r0 = 0; r0 < d.N; r0 += d.chunk_rows) {
    const int64_t R = std::min(d.chunk_rows, d.N - r0);
    kernels::MatmulArgs mm;
    mm.a = at(static_cast<const void*>(lnf_), r0 * d.C, dt);
    mm.b = w_head;
    mm.c = logits_;
    mm.ab_dtype = dt;
    mm.c_dtype = logits_dtype_;
    mm.m = R;
    mm.n = d.V;
    mm.k = d.C;
    mm.trans_b = true;
    ops.matmul(s, mm);
    if (!tp_.on()) {
      ops.cross_entropy(s, {.dtype = logits_dtype_, .rows = R, .vocab = d.V, .logits = logits_,
                            .targets = targets + r0, .losses = losses_ + r0, .dlogits = backward ? logits_ : nullptr,
                            .grad_scale = grad_scale});
    } else {
      // Vocabulary-parallel cross-entropy (Megatron-LM): each rank's (max, Σ exp, target logit)
      // per row over its columns, gathered over the group (3 floats a row, never the logits),
      // then every rank the same loss and its columns' dlogits.
      ops.cross_entropy_stats(s, {.dtype = logits_dtype_, .rows = R, .vocab = d.V, .ld = 0,
                                  .vocab_start = d.vocab_start, .full_vocab = d.full_vocab, .logits = logits_,
                                  .targets = targets + r0, .stats = ce_stats_});
      tp_.comm->all_gather(ce_stats_, ce_all_, static_cast<size_t>(3 * R), DType::f32, s);
      ops.cross_entropy_finish(s, {.dtype = logits_dtype_, .rows = R, .vocab = d.V, .ld = 0,
                                   .vocab_start = d.vocab_start, .full_vocab = d.full_vocab, .parts = tp_.size,
                                   .logits = logits_, .targets = targets + r0, .all_stats = ce_all_,
                                   .losses = losses_ + r0, .dlogits = backward ? logits_ : nullptr,
                                   .grad_scale = grad_scale});
    }
    if (!backward) continue;
    const void* dl = logits_;
    if (logits_dtype_ != dt) {  // fp16 runs: fp32 logits, dlogits cast for the fp16 matmuls
      ops.cast(s, {.n = R * d.V, .src = logits_, .src_dtype = logits_dtype_, .dst = dlogits_lp_, .dst_dtype = dt});
      dl = dlogits_lp_;
    }
    // dlnf[r] (R, C) = dlogits (R, V) · Whead (V, C)
    kernels::MatmulArgs dx;
    dx.a = dl;
    dx.b = w_head;
    dx.c = at(dlnf_, r0 * d.C, dt);
    dx.ab_dtype = dt;
    dx.c_dtype = dt;
    dx.m = R;
    dx.n = d.C;
    dx.k = d.V;
    ops.matmul(s, dx);
    if (!g_head_unit) continue;  // a frozen head
    // dWhead (V, C) += dlogitsᵀ · lnf[r] (the step's first chunk writes it; a head tied to wte
    // comes before the embedding backward, which then adds to it)
    kernels::MatmulArgs dw;
    dw.a = dl;
    dw.b = at(static_cast<const void*>(lnf_), r0 * d.C, dt);
    dw.c = g_head_unit + outer_.head;
    dw.ab_dtype = dt;
    dw.c_dtype = DType::f32;
    dw.m = d.V;
    dw.n = d.C;
    dw.k = R;
    dw.trans_a = true;
    dw.beta = !first || r0 > 0 ? 1.f : 0.f;
    ops.matmul(s, dw);
  }
  if (!backward) return;
  // Tensor parallel: dlnf is this rank's columns' part of the sum over the vocabulary (sequence
  // parallel: summed into this rank's rows).
  void* dlnf_mine = at(dlnf_, d.res_row0 * d.C, dt);
  if (sp)
    tp_.comm->reduce_scatter(dlnf_, dlnf_mine, static_cast<size_t>(d.res_rows * d.C), dt, s);
  else if (tp_.on())
    tp_.comm->all_reduce(dlnf_, dlnf_, static_cast<size_t>(d.N * d.C), dt, s);

  // dres (N, C) = final norm backward (overwrites). Sequence parallel: this rank's rows, its norm
  // grads summed over the group.
  float* gw = g_fn ? g_fn + outer_.lnf_w : nullptr;
  float* gb = g_fn && outer_.lnf_b >= 0 ? g_fn + outer_.lnf_b : nullptr;
  const BlockCtx c = base_ctx(s);
  const model_detail::NormGrads ng = model_detail::norm_grads(c, gw, gb);
  kernels::NormBackwardArgs nb{.dtype = dt, .rows = d.res_rows, .cols = d.C, .x = final_res_,
                               .weight = at(w_fn, outer_.lnf_w, dt), .dy = dlnf_mine, .mean = lnf_mean_,
                               .rstd = lnf_rstd_, .dx = dres_, .dweight = ng.w, .dbias = ng.b};
  recipe_.norm_backward(ops, s, nb);
  model_detail::norm_grads_done(c, gw, gb);
}

void Transformer::block_backward(kernels::Stream& s, int64_t layer, const void* w, const void* x, float* g,
                                 bool first, const void* w_lora, float* g_lora) {
  assert(bound_);
  if (first && g) zero_ranges(s, units_[static_cast<size_t>(block_unit(layer))].accum_only, g);
  BlockCtx c = block_ctx(s, layer, w, g, w_lora, g_lora);
  const BlockActs& a = acts_for(layer);
  if (ckpt_.at(layer)) recipe_.block_forward(c, x, a, recompute_out_);  // the activations it did not keep
  c.accumulate_grads = !first;
  recipe_.block_backward(c, x, a, dres_);
}

void Transformer::embed_backward(kernels::Stream& s, const int32_t* ids, float* g, bool first) {
  assert(bound_);
  need_group();
  const ModelDims& d = dims_;
  const DType dt = dtype_;
  kernels::Ops& ops = rt_.ops();
  if (first && !tied_head()) zero_ranges(s, units_[0].accum_only, g);
  // Pipeline parallel, a tied head on the last stage: this stage's copy of the unit is written
  // by this backward alone (its sum with the head's comes after the step's last micro-batch).
  if (first && tied_head() && !pp_.last_stage())
    s.memset_async(g, 0, static_cast<size_t>(units_[0].n_real) * sizeof(float));
  // Sequence parallel: every rank's rows of the residual gradient, gathered into dlnf (spent).
  const void* dout = dres_;
  if (tp_.sequence) {
    tp_.comm->all_gather(dres_, dlnf_, static_cast<size_t>(d.res_rows * d.C), dt, s);
    dout = dlnf_;
  }
  ops.embedding_backward(s, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = d.V, .ids = ids, .dout = dout,
                             .dtable = g + outer_.wte, .row0 = d.vocab_start,
                             .full_vocab = tp_.on() ? d.full_vocab : 0});
  if (outer_.wpe >= 0)
    ops.embedding_backward(s, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = cfg_.max_position_embeddings,
                               .ids = doc_pos_ ? doc_pos_ : pos_ids_, .dout = dout, .dtable = g + outer_.wpe});
}

void Transformer::grad_sum_squares(kernels::Stream& s, int u, const float* g, double* out) const {
  grad_sum_squares(rt_.ops(), s, u, g, 0, units_.at(static_cast<size_t>(u)).n_real, out);
}

void Transformer::grad_sum_squares(kernels::Ops& ops, kernels::Stream& s, int u, const float* g, int64_t lo,
                                   int64_t hi, double* out) const {
  const Unit& unit = units_.at(static_cast<size_t>(u));
  hi = std::min(hi, unit.n_real);
  if (hi <= lo) return;
  if (!tp_.on() || tp_.rank == 0) {
    ops.sum_squares(s, {.dtype = DType::f32, .n = hi - lo, .x = g, .out = out});
    return;
  }
  // The split tensors only, in runs of adjacent ones (the unsplit ones are tp rank 0's).
  int64_t run0 = 0, run1 = 0;
  auto flush = [&] {
    const int64_t a = std::max(run0, lo), b = std::min(run1, hi);
    if (b > a) ops.sum_squares(s, {.dtype = DType::f32, .n = b - a, .x = g + (a - lo), .out = out});
    run0 = run1 = 0;
  };
  for (int pi : unit.params) {
    const ParamInfo& p = params_[static_cast<size_t>(pi)];
    if (p.split.dim < 0) {
      flush();
      continue;
    }
    if (run1 == run0) run0 = p.unit_offset;
    run1 = p.unit_offset + p.numel;
  }
  flush();
}

}  // namespace strata
