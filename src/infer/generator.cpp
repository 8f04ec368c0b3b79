// The Generator's weights (units in a BlockManager), workspace and KV cache, and its forward:
// embedding, the blocks (the training recipes with a KvStep), then the final norm and LM head
// on each item's last token only.
#include "src/infer/generator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

#include "io/engine.h"
#include "io/swap_space.h"
#include "kernels/dtype.h"
#include "kernels/ops.h"
#include "offload/manager.h"
#include "src/model/block_common.h"
#include "src/model/family.h"

namespace strata {
using kernels::DType;
using model_detail::at;
using model_detail::Carver;
using offload::Mode;
using offload::Tier;

// The workspace, carved from one device-homed block.
struct Generator::Buffers {
  ModelDims dims;          // B = shape.batch, T = shape.max_prompt: the largest forward
  void* x = nullptr;       // (N, C) residual in
  void* y = nullptr;       // (N, C) residual out
  BlockActs acts;          // one block's activations, reused by every block
  BlockScratch scratch;    // tmp_c (N, C) only
  void* last = nullptr;    // (B, C) each item's last residual row
  void* lnf = nullptr;     // (B, C) final norm of it
  float* lnf_mean = nullptr;
  float* lnf_rstd = nullptr;
  float* logits = nullptr;  // (B, V) fp32
  int32_t* ids = nullptr;   // (B, T) this forward's tokens
  int32_t* pos = nullptr;   // (B, T) their positions
  int32_t* seg = nullptr;   // (B, T) first visible cache slot
  float* rope = nullptr;    // (2, capacity, D/2) cos then sin (PositionKind::rope)
  std::vector<void*> kv;    // per layer (B, capacity, 2, Hkv, D)
  std::vector<float> rope_host;
};

struct Generator::Open {
  offload::Handle h;
};

namespace {

// Sizes (base null) or places the workspace.
size_t carve(Generator::Buffers& b, char* base, const FamilyRecipe& recipe, DType dt, const GenerateShape& sh) {
  const ModelDims& d = b.dims;
  Carver cv{base};
  b.x = cv.take_dt(d.N * d.C, dt);
  b.y = cv.take_dt(d.N * d.C, dt);
  b.acts = recipe.carve_acts(cv, d, dt);
  b.scratch.tmp_c = cv.take_dt(d.N * d.C, dt);
  b.last = cv.take_dt(d.B * d.C, dt);
  b.lnf = cv.take_dt(d.B * d.C, dt);
  b.lnf_mean = cv.take_f32(d.B);
  b.lnf_rstd = cv.take_f32(d.B);
  b.logits = cv.take_f32(d.B * d.V);
  b.ids = static_cast<int32_t*>(cv.take(static_cast<size_t>(d.N) * 4));
  b.pos = static_cast<int32_t*>(cv.take(static_cast<size_t>(d.N) * 4));
  b.seg = static_cast<int32_t*>(cv.take(static_cast<size_t>(d.N) * 4));
  b.rope = recipe.positions == PositionKind::rope ? cv.take_f32(2 * sh.capacity * (d.D / 2)) : nullptr;
  b.kv.resize(static_cast<size_t>(d.L));
  for (auto& k : b.kv) k = cv.take_dt(d.B * sh.capacity * 2 * d.Hkv * d.D, dt);
  return (cv.off + offload::kAlign - 1) / offload::kAlign * offload::kAlign;
}

uint64_t unit_bytes(const Unit& u, DType dt) { return offload::align_up(static_cast<uint64_t>(u.numel) * kernels::dtype_size(dt)); }

}  // namespace

Generator::Generator(const ModelConfig& cfg, DType dtype, kernels::Runtime& rt, kernels::Stream& s,
                     const WeightPlacement& placement, GenerateShape shape)
    : model_(cfg, dtype, 1, 1, rt), dtype_(dtype), rt_(rt), s_(s), shape_(shape), placement_(placement) {
  const ModelConfig& c = model_.config();
  if (shape.batch < 1 || shape.max_prompt < 1 || shape.capacity < shape.max_prompt)
    throw std::invalid_argument("generate: batch and prompt length must be >= 1 and the cache hold the prompt");
  if (shape.capacity > c.max_position_embeddings)
    throw std::invalid_argument("the prompt and the new tokens (" + std::to_string(shape.capacity) +
                                " tokens) exceed the model's max_position_embeddings " +
                                std::to_string(c.max_position_embeddings) + "; lower --max-new-tokens or shorten the prompt");
  buf_ = std::make_unique<Buffers>();
  ModelDims& d = buf_->dims;
  d = model_.dims();
  d.B = shape.batch;
  d.T = shape.max_prompt;
  d.N = d.B * d.T;
  d.res_rows = d.N;  // (no tensor parallelism here: every row)
  const size_t ws = carve(*buf_, nullptr, model_.recipe(), dtype, shape);

  // Budgets: all weights where they live, plus room on the compute tier for the unit in use
  // and the next one (prefetched) when they live elsewhere.
  const std::vector<Unit>& units = model_.units();
  const bool cpu = rt.info().backend == kernels::Backend::cpu;
  uint64_t total = 0, largest = 0;
  for (const Unit& u : units) total += unit_bytes(u, dtype), largest = std::max(largest, unit_bytes(u, dtype));
  const Tier home = placement.params;
  homes_.assign(units.size(), home);
  const uint64_t stream_room = 3 * largest;  // in use, next, one being evicted
  uint64_t device = ws + (home == Tier::device ? total : cpu ? 0 : stream_room);
  uint64_t host = home == Tier::host ? total : home == Tier::nvme ? stream_room : 0;
  if (placement.device_mem) device = placement.device_mem;
  if (placement.host_mem) host = placement.host_mem;

  std::unique_ptr<offload::NvmeStore> store;
  if (home == Tier::nvme) {
    if (placement.nvme_paths.empty())
      throw std::invalid_argument("--offload-params nvme needs --nvme-path DIR (a directory on the SSD)");
    engine_ = io::make_engine();
    io::SwapOptions so;
    so.paths = placement.nvme_paths;
    so.allow_buffered = true;  // tmpfs and other filesystems without O_DIRECT still work (warns)
    so.checksums = true;
    swap_ = std::make_unique<io::SwapSpace>(so, *engine_);
    store = offload::make_swap_store(*swap_, total);
  }
  offload::ManagerConfig mc;
  mc.device_bytes = device;
  mc.host_bytes = host;
  mc.transfer.device_nvme = !cpu && home == Tier::nvme;
  mgr_ = std::make_unique<offload::BlockManager>(rt, mc, std::move(store));
  for (const Unit& u : units) mgr_->add_block(u.name, unit_bytes(u, dtype), home);
  const auto ws_block = mgr_->add_block("generate.workspace", ws, Tier::device);
  // One forward: each unit in model order, the head's unit last (again, when tied).
  offload::Schedule sched;
  auto use = [&](int u) { sched.use(static_cast<offload::BlockId>(u), compute_tier(u), Mode::read); };
  use(model_.embed_unit());
  for (int64_t l = 0; l < d.L; ++l) use(model_.block_unit(l));
  use(model_.final_norm_unit());
  use(model_.head_unit());
  mgr_->set_schedule(std::move(sched));
  open_.resize(units.size());
  for (auto& o : open_) o = std::make_unique<Open>();
  carve(*buf_, static_cast<char*>(mgr_->home_data(ws_block)), model_.recipe(), dtype, shape);

  if (model_.recipe().positions == PositionKind::rope) {  // RoPE tables (2, capacity, D/2), as the training workspace's
    buf_->rope_host = rope_tables(c, shape.capacity);
    s_.memcpy_async(buf_->rope, buf_->rope_host.data(), buf_->rope_host.size() * sizeof(float));
    s_.synchronize();
  }
}

Generator::~Generator() {
  kernels::settle(s_);  // a failed read can leave kernels queued that use the buffers freed below
  if (mgr_) mgr_->drain();
}

uint64_t Generator::weight_bytes() const {
  uint64_t n = 0;
  for (const Unit& u : model_.units()) n += static_cast<uint64_t>(u.numel) * kernels::dtype_size(dtype_);
  return n;
}

Tier Generator::compute_tier(int unit) const {
  const Tier home = homes_[static_cast<size_t>(unit)];
  if (rt_.info().backend == kernels::Backend::cpu) return home == Tier::nvme ? Tier::host : home;  // CPU reads RAM
  return Tier::device;
}

void Generator::set_unit(int u, const std::vector<float>& master) {
  if (static_cast<int64_t>(master.size()) != model_.units().at(static_cast<size_t>(u)).numel)
    throw std::invalid_argument("Generator::set_unit: unit " + std::to_string(u) + " needs its padded numel values");
  std::vector<uint16_t> low;
  const void* src = master.data();
  const uint64_t bytes = static_cast<uint64_t>(master.size()) * kernels::dtype_size(dtype_);
  if (dtype_ != DType::f32) {
    low.resize(master.size());
    for (size_t i = 0; i < master.size(); ++i) kernels::store_from_f32(low.data(), dtype_, i, master[i]);
    src = low.data();
  }
  const auto b = static_cast<offload::BlockId>(u);
  mgr_->begin_step(offload::BlockManager::kAside);
  offload::Handle h = mgr_->acquire(b, compute_tier(u), Mode::write);
  h.wait();
  s_.memcpy_async(h.data(), src, bytes);
  s_.synchronize();
  mgr_->release(h);
  if (homes_[static_cast<size_t>(u)] != compute_tier(u)) mgr_->write_back(b);
  mgr_->end_step();
}

void Generator::load(const HfCheckpoint& ckpt, const std::filesystem::path& adapter) {
  if (adapter.empty()) {
    fill_units([&](int u, float* master) { model_.load_unit(u, ckpt, master); });
    return;
  }
  const double s = peft_scale(read_peft_config(adapter));
  const auto file = HfCheckpoint::open_file(adapter / "adapter_model.safetensors");
  const bool in_out = model_.config().family == Family::gpt2;  // HF Conv1D weights are (in, out)
  int merged = 0;
  std::vector<float> A, B;
  fill_units([&](int u, float* master) {
    model_.load_unit(u, ckpt, master);
    for (int pi : model_.units()[static_cast<size_t>(u)].params) {
      const ParamInfo& p = model_.params()[static_cast<size_t>(pi)];
      if (!p.name.ends_with(".weight")) continue;
      const std::string mod = "base_model.model." + p.name.substr(0, p.name.size() - 7);
      const StoredTensor* a = file->find(mod + ".lora_A.weight");
      const StoredTensor* b = file->find(mod + ".lora_B.weight");
      if (!a || !b) continue;
      if (a->shape.size() != 2 || b->shape.size() != 2 || a->shape[0] != b->shape[1] ||
          a->shape[1] * b->shape[0] != p.numel)
        throw std::invalid_argument(adapter.string() + ": " + mod + "'s lora_A/lora_B shapes do not fit " + p.name);
      A.resize(static_cast<size_t>(a->shape[0] * a->shape[1]));
      B.resize(static_cast<size_t>(b->shape[0] * b->shape[1]));
      file->read_into(a->name, a->shape, A.data(), DType::f32);
      file->read_into(b->name, b->shape, B.data(), DType::f32);
      add_lora_delta(master + p.unit_offset, A.data(), B.data(), a->shape[0], a->shape[1], b->shape[0], s, in_out);
      ++merged;
    }
  });
  if (merged == 0)
    throw std::invalid_argument(adapter.string() + ": the adapter adapts no weight of this model (its names do not "
                                "match; is it for another base?)");
}

void Generator::init_random(uint64_t seed) {
  fill_units([&](int u, float* master) { model_.init_unit(u, seed, master); });
}

void Generator::fill_units(const std::function<void(int, float*)>& fill) {
  std::vector<float> master;
  for (size_t u = 0; u < model_.units().size(); ++u) {
    master.assign(static_cast<size_t>(model_.units()[u].numel), 0.f);
    fill(static_cast<int>(u), master.data());
    set_unit(static_cast<int>(u), master);
  }
  mgr_->drain();
}

const void* Generator::acquire(int u) {
  offload::Handle& h = open_[static_cast<size_t>(u)]->h;
  h = mgr_->acquire(static_cast<offload::BlockId>(u), compute_tier(u), Mode::read);
  if (!h.host_ready()) {  // still coming from NVMe: the time from here is a real stall
    s_.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    h.wait_host();
    stall_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  } else {
    h.wait_host();  // rethrows a failed move
  }
  h.wait_on(s_);
  return h.data();
}

void Generator::release(int u) { mgr_->release(open_[static_cast<size_t>(u)]->h, &s_); }

const std::vector<float>& Generator::prefill(const std::vector<std::vector<int32_t>>& prompts) {
  const int64_t B = static_cast<int64_t>(prompts.size());
  if (B < 1 || B > shape_.batch)
    throw std::invalid_argument("generate: " + std::to_string(B) + " prompts, the generator holds 1.." +
                                std::to_string(shape_.batch));
  int64_t T = 0;
  for (const auto& p : prompts) T = std::max<int64_t>(T, static_cast<int64_t>(p.size()));
  if (T > shape_.max_prompt) throw std::invalid_argument("generate: a prompt is longer than the generator's max_prompt");
  batch_ = B;
  past_ = 0;
  pad_.assign(static_cast<size_t>(B), 0);
  std::vector<int32_t> ids(static_cast<size_t>(B * T), 0);
  for (int64_t b = 0; b < B; ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    if (p.empty()) throw std::invalid_argument("generate: prompt " + std::to_string(b) + " has no tokens");
    const int64_t pad = T - static_cast<int64_t>(p.size());
    pad_[static_cast<size_t>(b)] = static_cast<int32_t>(pad);
    std::copy(p.begin(), p.end(), ids.begin() + b * T + pad);
  }
  return forward(ids, T);
}

const std::vector<float>& Generator::step(const std::vector<int32_t>& tokens) {
  if (static_cast<int64_t>(tokens.size()) != batch_)
    throw std::invalid_argument("generate: step needs one token per batch item");
  if (past_ + 1 > shape_.capacity) throw std::invalid_argument("generate: the KV cache is full");
  return forward(tokens, 1);
}

// ids (B, T) host: the tokens at cache slots [past_, past_ + T) of each item.
const std::vector<float>& Generator::forward(const std::vector<int32_t>& ids, int64_t T) {
  const ModelConfig& cfg = model_.config();
  const DType dt = dtype_;
  const int64_t B = batch_;
  for (int32_t id : ids)
    if (id < 0 || id >= cfg.vocab_size)
      throw std::out_of_range("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                              std::to_string(cfg.vocab_size) + ")");
  Buffers& bf = *buf_;
  ModelDims d = bf.dims;
  d.B = B;
  d.T = T;
  d.N = B * T;
  d.res_rows = d.N;
  // Positions count from each item's first real token; pad slots sit at 0 and see only pads.
  host_ids_ = ids;
  host_pos_.resize(static_cast<size_t>(d.N));
  host_seg_.resize(static_cast<size_t>(d.N));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = past_ + t, pad = pad_[static_cast<size_t>(b)];
      const size_t i = static_cast<size_t>(b * T + t);
      host_pos_[i] = static_cast<int32_t>(slot < pad ? 0 : slot - pad);
      host_seg_[i] = static_cast<int32_t>(slot < pad ? 0 : pad);
    }
  const size_t n4 = static_cast<size_t>(d.N) * 4;
  s_.memcpy_async(bf.ids, host_ids_.data(), n4);
  s_.memcpy_async(bf.pos, host_pos_.data(), n4);
  s_.memcpy_async(bf.seg, host_seg_.data(), n4);
  kernels::Ops& ops = rt_.ops();
  const FamilyRecipe& recipe = model_.recipe();
  const OuterLayout& o = model_.outer_layout();
  mgr_->begin_step();

  // x (N, C) = wte[ids] (+ wpe[pos])
  const void* we = acquire(model_.embed_unit());
  ops.embedding(s_, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = d.V, .ids = bf.ids, .table = at(we, o.wte, dt),
                     .out = bf.x});
  if (o.wpe >= 0)
    ops.embedding(s_, {.dtype = dt, .n_tokens = d.N, .dim = d.C, .vocab = cfg.max_position_embeddings, .ids = bf.pos,
                       .table = at(we, o.wpe, dt), .out = bf.x, .accumulate = true});
  release(model_.embed_unit());

  // Blocks: the training recipes, with this layer's cache.
  KvStep kv;
  kv.capacity = shape_.capacity;
  kv.past = past_;
  kv.pos = bf.pos;
  kv.max_pos = shape_.capacity;
  kv.seg_start = bf.seg;
  BlockCtx c;
  c.ops = &ops;
  c.stream = &s_;
  c.cfg = &cfg;
  c.dims = &d;
  c.dtype = dt;
  c.layout = &model_.block_layout();
  if (bf.rope) {
    c.rope_cos = bf.rope;
    c.rope_sin = bf.rope + shape_.capacity * (d.D / 2);
  }
  c.scratch = &bf.scratch;
  c.kv = &kv;
  void* x = bf.x;
  void* y = bf.y;
  for (int64_t l = 0; l < d.L; ++l) {
    kv.cache = bf.kv[static_cast<size_t>(l)];
    c.w = acquire(model_.block_unit(l));
    recipe.block_forward(c, x, bf.acts, y);
    release(model_.block_unit(l));
    std::swap(x, y);
  }

  // Each item's last row (every prompt ends at slot past_ + T - 1), final norm, head.
  const size_t row = static_cast<size_t>(d.C) * kernels::dtype_size(dt);
  for (int64_t b = 0; b < B; ++b) s_.memcpy_async(at(bf.last, b * d.C, dt), at(x, (b * T + T - 1) * d.C, dt), row);
  const void* wf = acquire(model_.final_norm_unit());
  kernels::NormArgs nf{.dtype = dt, .rows = B, .cols = d.C, .eps = static_cast<float>(cfg.norm_eps), .x = bf.last,
                       .weight = at(wf, o.lnf_w, dt), .bias = o.lnf_b >= 0 ? at(wf, o.lnf_b, dt) : nullptr,
                       .y = bf.lnf, .mean = bf.lnf_mean, .rstd = bf.lnf_rstd};
  recipe.norm_forward(ops, s_, nf);
  release(model_.final_norm_unit());
  const void* wh = acquire(model_.head_unit());
  kernels::MatmulArgs mm;  // logits (B, V) = lnf · Wheadᵀ, fp32
  mm.a = bf.lnf;
  mm.b = at(wh, o.head, dt);
  mm.c = bf.logits;
  mm.ab_dtype = dt;
  mm.c_dtype = DType::f32;
  mm.m = B;
  mm.n = d.V;
  mm.k = d.C;
  mm.trans_b = true;
  ops.matmul(s_, mm);
  release(model_.head_unit());
  logits_.resize(static_cast<size_t>(B * d.V));
  s_.memcpy_async(logits_.data(), bf.logits, logits_.size() * sizeof(float));
  s_.synchronize();
  mgr_->end_step();
  past_ += T;
  return logits_;
}

}  // namespace strata
