// The Transformer's units, parameter table, buffers (planned and allocated once) and the
// whole-model forward/backward: embedding, blocks, final norm, then the LM head and
// cross-entropy chunked over rows so the (N, V) logits never exist at once.
#include "src/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cpu/parallel.h"
#include "src/model/linear.h"

namespace strata {
using model_detail::at;

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Carves aligned sub-buffers out of one allocation; run once with base = null to size it.
struct Carver {
  char* base = nullptr;
  size_t off = 0;
  void* take(size_t bytes) {
    off = (off + 63) / 64 * 64;
    void* p = base ? base + off : nullptr;
    off += bytes;
    return p;
  }
  float* take_f32(int64_t n) { return static_cast<float*>(take(static_cast<size_t>(n) * 4)); }
  void* take_dt(int64_t n, DType t) { return take(static_cast<size_t>(n) * kernels::dtype_size(t)); }
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Standard normal numbers 2·pair and 2·pair+1 of stream `key` (Box-Muller on a counter-based
// hash: the same values for any thread count).
void normal_pair(uint64_t key, uint64_t pair, float* out) {
  const uint64_t r = splitmix64(key ^ splitmix64(pair));
  const double u1 = (static_cast<double>(r >> 40) + 1.0) / 16777217.0;  // (0, 1]
  const double u2 = static_cast<double>(r & 0xffffffull) / 16777216.0;   // [0, 1)
  const double rad = std::sqrt(-2.0 * std::log(u1)), ang = 2.0 * M_PI * u2;
  out[0] = static_cast<float>(rad * std::cos(ang));
  out[1] = static_cast<float>(rad * std::sin(ang));
}

}  // namespace

Transformer::Transformer(const ModelConfig& cfg, DType dtype, int64_t batch, int64_t seq, kernels::Runtime& rt,
                         int64_t logits_chunk_bytes)
    : cfg_(cfg), dtype_(dtype), rt_(rt) {
  cfg_.validate();
  if (batch <= 0) throw std::invalid_argument("batch must be positive, got " + std::to_string(batch));
  if (seq <= 0) throw std::invalid_argument("seq must be positive, got " + std::to_string(seq));
  if (seq > cfg_.max_position_embeddings)
    throw std::invalid_argument("--seq " + std::to_string(seq) + " exceeds the model's max_position_embeddings " +
                                std::to_string(cfg_.max_position_embeddings));
  ModelDims& d = dims_;
  d.B = batch;
  d.T = seq;
  d.N = batch * seq;
  d.C = cfg_.hidden_size;
  d.L = cfg_.n_layers;
  d.V = cfg_.vocab_size;
  d.Hq = cfg_.n_heads;
  d.Hkv = cfg_.family == Family::gpt2 ? cfg_.n_heads : cfg_.n_kv_heads;
  d.D = cfg_.effective_head_dim();
  d.Q = d.Hq * d.D;
  d.QKV = (d.Hq + 2 * d.Hkv) * d.D;
  d.I = cfg_.intermediate_size > 0 ? cfg_.intermediate_size : 4 * d.C;
  d.FC = cfg_.family == Family::gpt2 ? d.I : 2 * d.I;
  if (cfg_.family == Family::gpt2 && d.Q != d.C)
    throw std::invalid_argument("gpt2: n_head must divide n_embd (head_dim is not configurable)");
  // LM-head chunks: at most logits_chunk_bytes of logits at once, split evenly so each chunk's
  // matmuls stay large. Each chunk re-reads and re-writes the fp32 head gradient (V, C), so
  // fewer, larger chunks are cheaper; bf16 runs keep logits in bf16 (half the bytes per row),
  // with the cross-entropy's math in fp32 as llm.c does.
  logits_dtype_ = dtype_ == DType::bf16 ? DType::bf16 : DType::f32;
  const int64_t row_bytes = d.V * static_cast<int64_t>(kernels::dtype_size(logits_dtype_));
  const int64_t max_rows = std::max<int64_t>(logits_chunk_bytes / row_bytes, 1);
  const int64_t n_chunks = (d.N + max_rows - 1) / max_rows;
  d.chunk_rows = (d.N + n_chunks - 1) / n_chunks;
  build_layout();
  allocate();
}

Transformer::~Transformer() = default;

void Transformer::build_layout() {
  const ModelDims& d = dims_;
  const bool gpt2 = cfg_.family == Family::gpt2;
  int64_t flat = 0;
  auto begin_unit = [&](std::string name) {
    units_.push_back(Unit{std::move(name), flat, 0, {}});
  };
  // Adds a tensor to the current unit; returns its offset relative to the unit's start.
  auto add = [&](const std::string& name, std::vector<int64_t> shape, char init) -> int64_t {
    Unit& u = units_.back();
    ParamInfo p;
    p.name = name;
    p.numel = 1;
    for (int64_t s : shape) p.numel *= s;
    p.shape = std::move(shape);
    p.unit = static_cast<int>(units_.size() - 1);
    p.offset = u.offset + u.numel;
    p.decay = p.shape.size() == 2;
    p.ones = init == '1';
    p.zeros = init == '0';
    u.numel += p.numel;
    u.params.push_back(static_cast<int>(params_.size()));
    params_.push_back(p);
    return p.offset - u.offset;
  };
  auto end_unit = [&] {
    Unit& u = units_.back();
    u.numel = round_up(u.numel, kUnitAlignElems);
    flat += u.numel;
  };

  const std::string pre = gpt2 ? "transformer." : "model.";
  begin_unit("embed");
  if (gpt2) {
    wte_ = add(pre + "wte.weight", {d.V, d.C}, 'n');
    wpe_ = add(pre + "wpe.weight", {cfg_.max_position_embeddings, d.C}, 'n');
  } else {
    wte_ = add(pre + "embed_tokens.weight", {d.V, d.C}, 'n');
  }
  wte_ += units_.back().offset;
  if (wpe_ >= 0) wpe_ += units_.back().offset;
  end_unit();

  for (int64_t l = 0; l < d.L; ++l) {
    begin_unit("block." + std::to_string(l));
    BlockLayout b;
    if (gpt2) {
      const std::string h = pre + "h." + std::to_string(l) + ".";
      b.ln1_w = add(h + "ln_1.weight", {d.C}, '1');
      b.ln1_b = add(h + "ln_1.bias", {d.C}, '0');
      b.qkv_w = add(h + "attn.c_attn.weight", {d.C, d.QKV}, 'n');
      b.qkv_b = add(h + "attn.c_attn.bias", {d.QKV}, '0');
      b.o_w = add(h + "attn.c_proj.weight", {d.Q, d.C}, 'n');
      b.o_b = add(h + "attn.c_proj.bias", {d.C}, '0');
      b.ln2_w = add(h + "ln_2.weight", {d.C}, '1');
      b.ln2_b = add(h + "ln_2.bias", {d.C}, '0');
      b.fc_w = add(h + "mlp.c_fc.weight", {d.C, d.I}, 'n');
      b.fc_b = add(h + "mlp.c_fc.bias", {d.I}, '0');
      b.proj_w = add(h + "mlp.c_proj.weight", {d.I, d.C}, 'n');
      b.proj_b = add(h + "mlp.c_proj.bias", {d.C}, '0');
    } else {
      const std::string h = pre + "layers." + std::to_string(l) + ".";
      const int64_t kv = d.Hkv * d.D;
      b.ln1_w = add(h + "input_layernorm.weight", {d.C}, '1');
      b.qkv_w = add(h + "self_attn.q_proj.weight", {d.Q, d.C}, 'n');  // q, k, v stacked = fused qkv
      add(h + "self_attn.k_proj.weight", {kv, d.C}, 'n');
      add(h + "self_attn.v_proj.weight", {kv, d.C}, 'n');
      if (cfg_.attention_bias) {
        b.qkv_b = add(h + "self_attn.q_proj.bias", {d.Q}, '0');
        add(h + "self_attn.k_proj.bias", {kv}, '0');
        add(h + "self_attn.v_proj.bias", {kv}, '0');
      }
      b.o_w = add(h + "self_attn.o_proj.weight", {d.C, d.Q}, 'n');
      if (cfg_.o_bias) b.o_b = add(h + "self_attn.o_proj.bias", {d.C}, '0');
      b.ln2_w = add(h + "post_attention_layernorm.weight", {d.C}, '1');
      b.fc_w = add(h + "mlp.gate_proj.weight", {d.I, d.C}, 'n');  // gate, up stacked = fused (2I, C)
      add(h + "mlp.up_proj.weight", {d.I, d.C}, 'n');
      if (cfg_.mlp_bias) {
        b.fc_b = add(h + "mlp.gate_proj.bias", {d.I}, '0');
        add(h + "mlp.up_proj.bias", {d.I}, '0');
      }
      b.proj_w = add(h + "mlp.down_proj.weight", {d.C, d.I}, 'n');
      if (cfg_.mlp_bias) b.proj_b = add(h + "mlp.down_proj.bias", {d.C}, '0');
    }
    if (l == 0) layout_ = b;
    block_units_.push_back(static_cast<int>(units_.size() - 1));
    end_unit();
  }

  begin_unit("final_norm");
  const int64_t u0 = units_.back().offset;
  if (gpt2) {
    lnf_w_ = u0 + add(pre + "ln_f.weight", {d.C}, '1');
    lnf_b_ = u0 + add(pre + "ln_f.bias", {d.C}, '0');
  } else {
    lnf_w_ = u0 + add(pre + "norm.weight", {d.C}, '1');
  }
  end_unit();

  if (!gpt2 && !cfg_.tie_word_embeddings) {
    begin_unit("lm_head");
    head_ = units_.back().offset + add("lm_head.weight", {d.V, d.C}, 'n');
    end_unit();
  } else {
    head_ = wte_;  // tied
  }
  n_flat_ = flat;

  // The grads that matmuls write whole (dW with beta = 0 in a non-accumulating backward): each
  // block's fused qkv, o, fc and proj matrices and the head. Everything else only accumulates.
  std::vector<std::pair<int64_t, int64_t>> by_matmul{{head_, d.V * d.C}};
  for (int unit : block_units_) {
    const int64_t u = units_[static_cast<size_t>(unit)].offset;
    by_matmul.insert(by_matmul.end(), {{u + layout_.qkv_w, d.QKV * d.C},
                                       {u + layout_.o_w, d.C * d.Q},
                                       {u + layout_.fc_w, d.FC * d.C},
                                       {u + layout_.proj_w, d.I * d.C}});
  }
  for (const ParamInfo& p : params_) {
    const bool written = std::any_of(by_matmul.begin(), by_matmul.end(), [&](const auto& r) {
      return p.offset >= r.first && p.offset + p.numel <= r.first + r.second;
    });
    if (written) continue;
    if (!accum_only_grads_.empty() && accum_only_grads_.back().first + accum_only_grads_.back().second == p.offset)
      accum_only_grads_.back().second += p.numel;
    else
      accum_only_grads_.emplace_back(p.offset, p.numel);
  }
}

void Transformer::allocate() {
  const ModelDims& d = dims_;
  const DType dt = dtype_;
  const bool gpt2 = cfg_.family == Family::gpt2;
  const size_t flat_f32 = static_cast<size_t>(n_flat_) * 4;
  auto alloc = [&](kernels::DeviceBuffer& b, size_t bytes) {
    b = kernels::DeviceBuffer(rt_, std::max<size_t>(bytes, 64));
    bytes_allocated_ += b.bytes();
  };
  alloc(master_, flat_f32);
  if (dt != DType::f32) alloc(working_, static_cast<size_t>(n_flat_) * kernels::dtype_size(dt));
  alloc(grads_, flat_f32);

  // Activations: L+1 residual streams, then each block's saved tensors.
  auto plan_acts = [&](Carver& cv) {
    residual_.assign(static_cast<size_t>(d.L + 1), nullptr);
    for (auto& r : residual_) r = cv.take_dt(d.N * d.C, dt);
    acts_.assign(static_cast<size_t>(d.L), BlockActs{});
    for (BlockActs& a : acts_) {
      a.ln1 = cv.take_dt(d.N * d.C, dt);
      if (gpt2) a.mean1 = cv.take_f32(d.N);
      a.rstd1 = cv.take_f32(d.N);
      a.qkv = cv.take_dt(d.N * d.QKV, dt);
      a.att = cv.take_dt(d.N * d.Q, dt);
      a.lse = cv.take_f32(d.B * d.Hq * d.T);
      a.res_mid = cv.take_dt(d.N * d.C, dt);
      a.ln2 = cv.take_dt(d.N * d.C, dt);
      if (gpt2) a.mean2 = cv.take_f32(d.N);
      a.rstd2 = cv.take_f32(d.N);
      a.fc = cv.take_dt(d.N * d.FC, dt);
      a.act = cv.take_dt(d.N * d.I, dt);
    }
  };
  auto plan_scratch = [&](Carver& cv) {
    scratch_.tmp_c = cv.take_dt(d.N * d.C, dt);
    scratch_.d_c = cv.take_dt(d.N * d.C, dt);
    scratch_.d_q = cv.take_dt(d.N * d.Q, dt);
    scratch_.d_fc = cv.take_dt(d.N * std::max(d.FC, d.QKV), dt);
    scratch_.d_act = cv.take_dt(d.N * d.I, dt);
    lnf_ = cv.take_dt(d.N * d.C, dt);
    lnf_mean_ = cv.take_f32(d.N);
    lnf_rstd_ = cv.take_f32(d.N);
    dres_ = cv.take_dt(d.N * d.C, dt);
    dlnf_ = cv.take_dt(d.N * d.C, dt);
    logits_ = cv.take_dt(d.chunk_rows * d.V, logits_dtype_);
    dlogits_lp_ = dt == DType::f16 ? cv.take_dt(d.chunk_rows * d.V, dt) : nullptr;
  };
  Carver size_acts, size_scratch;
  plan_acts(size_acts);
  plan_scratch(size_scratch);
  alloc(acts_buf_, size_acts.off);
  alloc(scratch_buf_, size_scratch.off);
  Carver ca{static_cast<char*>(acts_buf_.data())}, cs{static_cast<char*>(scratch_buf_.data())};
  plan_acts(ca);
  plan_scratch(cs);
  alloc(losses_, static_cast<size_t>(d.N) * 4);

  // Fault every page in now (DESIGN.md "Memory is allocated once") and zero the grads.
  auto s = rt_.create_stream();
  s->memset_async(master_.data(), 0, master_.bytes());
  if (working_.data()) s->memset_async(working_.data(), 0, working_.bytes());
  s->memset_async(grads_.data(), 0, grads_.bytes());
  s->memset_async(acts_buf_.data(), 0, acts_buf_.bytes());
  s->memset_async(scratch_buf_.data(), 0, scratch_buf_.bytes());
  s->memset_async(losses_.data(), 0, losses_.bytes());

  if (gpt2) {  // position ids (N): t for row b·T + t
    std::vector<int32_t> pos(static_cast<size_t>(d.N));
    for (int64_t i = 0; i < d.N; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i % d.T);
    alloc(pos_ids_, pos.size() * 4);
    s->memcpy_async(pos_ids_.data(), pos.data(), pos.size() * 4);
    s->synchronize();
  } else {  // RoPE tables (T, D/2): cos/sin of fp32 t · inv_freq, as HF computes them
    const std::vector<float> inv = rope_inv_freq(cfg_);
    const int64_t half = d.D / 2;
    std::vector<float> table(static_cast<size_t>(2 * d.T * half));
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(t) * inv[static_cast<size_t>(i)];
        table[static_cast<size_t>(t * half + i)] = static_cast<float>(std::cos(static_cast<double>(angle)));
        table[static_cast<size_t>((d.T + t) * half + i)] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
    alloc(rope_, table.size() * 4);
    s->memcpy_async(rope_.data(), table.data(), table.size() * 4);
    s->synchronize();
  }
}

const ParamInfo* Transformer::find_param(const std::string& name) const {
  for (const ParamInfo& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

int64_t Transformer::n_params() const {
  int64_t n = 0;
  for (const ParamInfo& p : params_) n += p.numel;
  return n;
}

void* Transformer::weights() const { return dtype_ == DType::f32 ? master_.data() : working_.data(); }

void Transformer::init_random(uint64_t seed) {
  // Host-visible master weights: the CPU backend's device memory is host memory.
  if (rt_.info().backend != kernels::Backend::cpu)
    throw std::runtime_error("init_random: only the cpu backend is supported for now");
  float* w = master();
  for (size_t pi = 0; pi < params_.size(); ++pi) {
    const ParamInfo& p = params_[pi];
    float* dst = w + p.offset;
    if (p.ones || p.zeros) {
      std::fill(dst, dst + p.numel, p.ones ? 1.f : 0.f);
      continue;
    }
    const uint64_t key = splitmix64(seed * 0x100000001b3ull + pi);
    kernels::cpu::parallel_for(0, (p.numel + 1) / 2, 1 << 15, [&](int64_t lo, int64_t hi) {
      float z[2];
      for (int64_t j = lo; j < hi; ++j) {
        normal_pair(key, static_cast<uint64_t>(j), z);
        dst[2 * j] = 0.02f * z[0];
        if (2 * j + 1 < p.numel) dst[2 * j + 1] = 0.02f * z[1];
      }
    });
  }
}

void Transformer::load(const HfCheckpoint& ckpt) {
  if (rt_.info().backend != kernels::Backend::cpu)
    throw std::runtime_error("load: only the cpu backend is supported for now");
  for (const ParamInfo& p : params_) {
    std::string name = p.name;
    // gpt2 checkpoints on the Hub often omit the "transformer." prefix.
    if (!ckpt.find(name) && name.rfind("transformer.", 0) == 0 && ckpt.find(name.substr(12))) name = name.substr(12);
    ckpt.read_into(name, p.shape, master() + p.offset, DType::f32);
  }
}

std::vector<TensorToSave> Transformer::tensors_to_save() const {
  std::vector<TensorToSave> out;
  for (const ParamInfo& p : params_) {
    const float* src = master() + p.offset;
    const size_t bytes = static_cast<size_t>(p.numel) * 4;
    out.push_back({p.name, p.shape, DType::f32, [src, bytes](void* dst) { std::memcpy(dst, src, bytes); }});
  }
  return out;
}

void Transformer::sync_weights(kernels::Stream& s) {
  if (dtype_ == DType::f32) return;
  rt_.ops().cast(s, {.n = n_flat_, .src = master(), .src_dtype = DType::f32, .dst = working_.data(),
                     .dst_dtype = dtype_});
}

void Transformer::zero_grads(kernels::Stream& s) { s.memset_async(grads_.data(), 0, grads_.bytes()); }

BlockCtx Transformer::block_ctx(kernels::Stream& s, int layer) const {
  const Unit& u = units_[static_cast<size_t>(block_units_[static_cast<size_t>(layer)])];
  BlockCtx c;
  c.ops = &rt_.ops();
  c.stream = &s;
  c.cfg = &cfg_;
  c.dims = &dims_;
  c.dtype = dtype_;
  c.w = at(static_cast<const void*>(weights()), u.offset, dtype_);
  c.g = grads() + u.offset;
  c.layout = &layout_;
  if (rope_.data()) {
    c.rope_cos = rope_.as<float>();
    c.rope_sin = rope_.as<float>() + dims_.T * (dims_.D / 2);
  }
  c.scratch = &scratch_;
  return c;
}

void Transformer::forward(kernels::Stream& s, const int32_t* ids, const int32_t* targets) {
  run(s, ids, targets, false, 1.f, true);
}

void Transformer::forward_backward(kernels::Stream& s, const int32_t* ids, const int32_t* targets,
                                   float grad_scale, bool accumulate) {
  run(s, ids, targets, true, grad_scale, accumulate);
}

void Transformer::run(kernels::Stream& s, const int32_t* ids, const int32_t* targets, bool backward,
                      float grad_scale, bool accumulate) {
  const ModelDims& d = dims_;
  const DType dt = dtype_;
  const bool gpt2 = cfg_.family == Family::gpt2;
  kernels::Ops& ops = rt_.ops();
  const void* w = weights();
  float* g = grads();
  const float eps = static_cast<float>(cfg_.norm_eps);

  // residual[0] (N, C) = wte[ids] (+ wpe[t])
  ops.embedding(s, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = d.V, .ids = ids, .table = at(w, wte_, dt),
                    .out = residual_[0]});
  if (gpt2)
    ops.embedding(s, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = cfg_.max_position_embeddings,
                      .ids = pos_ids_.as<int32_t>(), .table = at(w, wpe_, dt), .out = residual_[0],
                      .accumulate = true});
  if (backward && !accumulate)  // the grads no matmul overwrites (this stream runs them in order)
    for (const auto& [off, n] : accum_only_grads_) s.memset_async(g + off, 0, static_cast<size_t>(n) * sizeof(float));
  for (int l = 0; l < d.L; ++l) {
    const BlockCtx c = block_ctx(s, l);
    const size_t i = static_cast<size_t>(l);
    if (gpt2)
      gpt2_block_forward(c, residual_[i], acts_[i], residual_[i + 1]);
    else
      llama_block_forward(c, residual_[i], acts_[i], residual_[i + 1]);
  }
  // lnf (N, C) = final norm of residual[L]
  const void* x_last = residual_[static_cast<size_t>(d.L)];
  kernels::NormArgs nf{.dtype = dt, .rows = d.N, .cols = d.C, .eps = eps, .x = x_last, .weight = at(w, lnf_w_, dt),
                       .bias = lnf_b_ >= 0 ? at(w, lnf_b_, dt) : nullptr, .y = lnf_, .mean = lnf_mean_,
                       .rstd = lnf_rstd_};
  if (gpt2)
    ops.layernorm(s, nf);
  else
    ops.rmsnorm(s, nf);

  // LM head + cross-entropy, chunk_rows rows at a time: logits (R, V) = lnf[r] · Wheadᵀ.
  for (int64_t r0 = 0; r0 < d.N; r0 += d.chunk_rows) {
    const int64_t R = std::min(d.chunk_rows, d.N - r0);
    kernels::MatmulArgs mm;
    mm.a = at(static_cast<const void*>(lnf_), r0 * d.C, dt);
    mm.b = at(w, head_, dt);
    mm.c = logits_;
    mm.ab_dtype = dt;
    mm.c_dtype = logits_dtype_;
    mm.m = R;
    mm.n = d.V;
    mm.k = d.C;
    mm.trans_b = true;
    ops.matmul(s, mm);
    ops.cross_entropy(s, {.dtype = logits_dtype_, .rows = R, .vocab = d.V, .logits = logits_, .targets = targets + r0,
                          .losses = loss_rows() + r0, .dlogits = backward ? logits_ : nullptr,
                          .grad_scale = grad_scale});
    if (!backward) continue;
    const void* dl = logits_;
    if (logits_dtype_ != dt) {  // fp16 runs: fp32 logits, dlogits cast for the fp16 matmuls
      ops.cast(s, {.n = R * d.V, .src = logits_, .src_dtype = logits_dtype_, .dst = dlogits_lp_, .dst_dtype = dt});
      dl = dlogits_lp_;
    }
    // dlnf[r] (R, C) = dlogits (R, V) · Whead (V, C)
    kernels::MatmulArgs dx;
    dx.a = dl;
    dx.b = at(w, head_, dt);
    dx.c = at(dlnf_, r0 * d.C, dt);
    dx.ab_dtype = dt;
    dx.c_dtype = dt;
    dx.m = R;
    dx.n = d.C;
    dx.k = d.V;
    ops.matmul(s, dx);
    // dWhead (V, C) += dlogitsᵀ · lnf[r] (the first chunk writes it when not accumulating; a
    // head tied to wte comes before the embedding backward, which then adds to it)
    kernels::MatmulArgs dw;
    dw.a = dl;
    dw.b = at(static_cast<const void*>(lnf_), r0 * d.C, dt);
    dw.c = g + head_;
    dw.ab_dtype = dt;
    dw.c_dtype = DType::f32;
    dw.m = d.V;
    dw.n = d.C;
    dw.k = R;
    dw.trans_a = true;
    dw.beta = accumulate || r0 > 0 ? 1.f : 0.f;
    ops.matmul(s, dw);
  }
  if (!backward) return;

  // dres (N, C) = final norm backward (overwrites)
  kernels::NormBackwardArgs nb{.dtype = dt, .rows = d.N, .cols = d.C, .x = x_last, .weight = at(w, lnf_w_, dt),
                               .dy = dlnf_, .mean = lnf_mean_, .rstd = lnf_rstd_, .dx = dres_,
                               .dweight = g + lnf_w_, .dbias = lnf_b_ >= 0 ? g + lnf_b_ : nullptr};
  if (gpt2)
    ops.layernorm_backward(s, nb);
  else
    ops.rmsnorm_backward(s, nb);
  for (int l = static_cast<int>(d.L) - 1; l >= 0; --l) {
    BlockCtx c = block_ctx(s, l);
    c.accumulate_grads = accumulate;
    const size_t i = static_cast<size_t>(l);
    if (gpt2)
      gpt2_block_backward(c, residual_[i], acts_[i], dres_);
    else
      llama_block_backward(c, residual_[i], acts_[i], dres_);
  }
  ops.embedding_backward(s, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = d.V, .ids = ids, .dout = dres_,
                             .dtable = g + wte_});
  if (gpt2)
    ops.embedding_backward(s, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = cfg_.max_position_embeddings,
                               .ids = pos_ids_.as<int32_t>(), .dout = dres_, .dtable = g + wpe_});
}

}  // namespace strata
