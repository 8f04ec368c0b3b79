// LoRA targets and the adapters' forward and backward GEMMs on the op set.
#include "src/model/lora.h"

#include <cmath>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "kernels/counter_rng.h"
#include "src/comm/communicator.h"
#include "src/checkpoint/safetensors.h"
#include "src/model/linear.h"
#include "src/model/transformer.h"

namespace strata {

float LoraSpec::scale() const {
  const double r = static_cast<double>(rank);
  return static_cast<float>(rslora ? alpha / std::sqrt(r) : alpha / r);
}

std::vector<std::string> parse_lora_targets(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    std::string t = text.substr(start, comma - start);
    if (t.empty())
      throw std::invalid_argument("--lora-targets '" + text +
                                  "': an empty module name (expected names such as q_proj,v_proj, or all-linear)");
    out.push_back(std::move(t));
    start = comma + 1;
  }
  for (const std::string& t : out)
    if (t == "all-linear" && out.size() > 1)
      throw std::invalid_argument("--lora-targets '" + text + "': all-linear stands alone");
  return out;
}

std::vector<LinearModule> match_lora_targets(const std::vector<LinearModule>& modules,
                                             const std::vector<std::string>& targets) {
  const auto names = [&] {
    std::string s;
    for (const LinearModule& m : modules) s += (s.empty() ? "" : ", ") + m.name;
    return s;
  };
  const auto matches = [](const std::string& name, const std::string& t) {
    return name == t || (name.size() > t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0 &&
                         name[name.size() - t.size() - 1] == '.');
  };
  const bool all = targets.size() == 1 && targets[0] == "all-linear";
  for (const std::string& t : targets) {
    if (all) break;
    bool any = false;
    for (const LinearModule& m : modules) any = any || matches(m.name, t);
    if (!any)
      throw std::invalid_argument("--lora-targets: '" + t + "' names no linear module of this model's layers (" +
                                  names() + "; or all-linear). The embedding and the LM head stay frozen.");
  }
  std::vector<LinearModule> out;
  for (const LinearModule& m : modules) {
    bool on = all;
    for (const std::string& t : targets) on = on || matches(m.name, t);
    if (on) out.push_back(m);
  }
  return out;
}

LoraSpec read_peft_config(const std::filesystem::path& dir) {
  const std::filesystem::path file = dir / "adapter_config.json";
  if (!std::filesystem::is_regular_file(dir / "adapter_model.safetensors") || !std::filesystem::is_regular_file(file))
    throw std::invalid_argument(dir.string() +
                                ": not a PEFT adapter directory (it needs adapter_config.json and adapter_model.safetensors)");
  const auto bad = [&](const std::string& what) { return std::invalid_argument(file.string() + ": " + what); };
  LoraSpec l;
  try {
    const nlohmann::json c = safetensors::read_json_file(file);
    if (c.value("peft_type", std::string()) != "LORA") throw bad("peft_type is not LORA");
    l.rank = c.at("r").get<int64_t>();
    if (l.rank <= 0) throw bad("r must be positive");
    l.alpha = c.at("lora_alpha").get<double>();
    l.rslora = c.value("use_rslora", false);
    const auto& t = c.at("target_modules");
    if (t.is_string()) {
      if (t.get<std::string>() != "all-linear")
        throw bad("target_modules is the pattern '" + t.get<std::string>() + "'; only a list of names or all-linear is read");
      l.targets = {"all-linear"};
    } else {
      l.targets = t.get<std::vector<std::string>>();
    }
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("malformed: ") + e.what());
  }
  return l;
}

double peft_scale(const LoraSpec& l) {
  return l.rslora ? l.alpha / std::sqrt(static_cast<double>(l.rank)) : l.alpha / static_cast<double>(l.rank);
}

void add_lora_delta(float* w, const float* A, const float* B, int64_t r, int64_t in, int64_t out, double s,
                    bool w_in_out) {
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double d = 0;
      for (int64_t k = 0; k < r; ++k) d += static_cast<double>(B[o * r + k]) * A[k * in + i];
      float& x = w[w_in_out ? i * out + o : o * in + i];
      x = static_cast<float>(static_cast<double>(x) + s * d);
    }
}

bool lora_dropout_keeps(uint64_t key, int64_t i, float p) { return kernels::counter_uniform(key, i) >= p; }

namespace model_detail {
namespace {

kernels::MatmulArgs gemm(DType ab, DType c) {
  kernels::MatmulArgs m;
  m.ab_dtype = ab;
  m.c_dtype = c;
  return m;
}

// u (N, kr) = x (N, in) · A_allᵀ: every target's A x at once.
void adapters_in(const BlockCtx& c, const LoraSlotLayout& sl, const void* x) {
  kernels::MatmulArgs m = gemm(c.dtype, c.dtype);
  m.a = x;
  m.b = at(c.lora_w, sl.a, c.dtype);
  m.c = c.lora_u;
  m.m = c.dims->N;
  m.n = sl.kr;
  m.k = sl.in;
  m.trans_b = true;  // A (kr, in) = (n, k)
  c.ops->matmul(*c.stream, m);
}

// The slots whose layer is row-parallel under tensor parallelism (its input split).
bool row_parallel(LoraSlot slot) { return slot == LoraSlot::o || slot == LoraSlot::proj; }

// Dropout: target t's mask key in this layer and slot.
uint64_t target_key(const BlockCtx& c, LoraSlot slot, size_t t) {
  return c.lora_dropout_key * 0xbf58476d1ce4e5b9ull + static_cast<uint64_t>(slot) * 64 + t + 1;
}

// out (N, in) = x ⊙ mask / (1 - p), or (accumulate) out += x ⊙ mask / (1 - p) (Ops::dropout).
// Tensor parallel, a row-parallel layer: x is this rank's columns of the layer's input, and the
// mask its columns of the whole input's, so every grid drops the same elements.
void masked(const BlockCtx& c, LoraSlot slot, uint64_t key, const void* x, void* out, int64_t in, bool accumulate) {
  kernels::DropoutArgs a{.dtype = c.dtype, .n = c.dims->N * in, .x = x, .out = out, .key = key, .p = c.lora->dropout,
                         .accumulate = accumulate};
  if (c.tp_comm && row_parallel(slot)) {
    a.cols = in;
    a.mask_cols = in * c.tp_comm->world();
    a.mask_col0 = in * c.tp_comm->rank();
  }
  c.ops->dropout(*c.stream, a);
}

// u_t (N, r) (columns t·r.. of lora_u) = xd · A_tᵀ.
void adapter_in(const BlockCtx& c, const LoraSlotLayout& sl, size_t t, const void* xd) {
  const int64_t r = c.lora->rank;
  kernels::MatmulArgs m = gemm(c.dtype, c.dtype);
  m.a = xd;
  m.b = at(c.lora_w, sl.a + static_cast<int64_t>(t) * r * sl.in, c.dtype);
  m.c = at(c.lora_u, static_cast<int64_t>(t) * r, c.dtype);
  m.ldc = sl.kr;
  m.m = c.dims->N;
  m.n = r;
  m.k = sl.in;
  m.trans_b = true;
  c.ops->matmul(*c.stream, m);
}

bool dropping(const BlockCtx& c) { return c.lora_dropout_key != 0 && c.lora->dropout > 0; }

}  // namespace

void lora_forward(const BlockCtx& c, LoraSlot slot, const void* x, void* y, int64_t ldy) {
  if (!c.lora) return;
  const LoraLayout& lay = *c.lora;
  const LoraSlotLayout& sl = lay.slots[static_cast<size_t>(slot)];
  if (sl.targets.empty()) return;
  if (dropping(c)) {  // each target its own mask: its own A GEMM
    for (size_t t = 0; t < sl.targets.size(); ++t) {
      masked(c, slot, target_key(c, slot, t), x, c.lora_x, sl.in, false);
      adapter_in(c, sl, t, c.lora_x);
    }
  } else {
    adapters_in(c, sl, x);
  }
  const int64_t r = lay.rank;
  for (size_t t = 0; t < sl.targets.size(); ++t) {
    const LoraTargetLayout& tl = sl.targets[t];
    // y[:, col..col+out] += s · u_t (N, r) · B_tᵀ
    kernels::MatmulArgs m = gemm(c.dtype, c.dtype);
    m.a = at(static_cast<const void*>(c.lora_u), static_cast<int64_t>(t) * r, c.dtype);
    m.lda = sl.kr;
    m.b = at(c.lora_w, tl.b, c.dtype);
    m.trans_b = true;  // B (out, r) = (n, k)
    m.c = at(y, tl.col, c.dtype);
    m.ldc = ldy;
    m.m = c.dims->N;
    m.n = tl.out;
    m.k = r;
    m.alpha = lay.scale;
    m.beta = 1.f;
    c.ops->matmul(*c.stream, m);
  }
}

void lora_backward(const BlockCtx& c, LoraSlot slot, const void* x, const void* dy, int64_t ldy, void* dx) {
  if (!c.lora) return;
  const LoraLayout& lay = *c.lora;
  const LoraSlotLayout& sl = lay.slots[static_cast<size_t>(slot)];
  if (sl.targets.empty()) return;
  const int64_t N = c.dims->N, r = lay.rank;
  const float beta = c.accumulate_grads ? 1.f : 0.f;
  const bool drop = dropping(c);
  if (!drop) adapters_in(c, sl, x);  // u again (recomputed, not kept: N × kr is cheap)
  // Tensor parallel, a row-parallel layer's adapters: u is this rank's input columns' part of
  // it; B is whole on every rank, so its gradient takes the whole u (as the forward's output
  // did, summed with the layer's).
  if (!drop && c.tp_comm && row_parallel(slot))
    c.tp_comm->all_reduce(c.lora_u, c.lora_u, static_cast<size_t>(N * sl.kr), c.dtype, *c.stream);
  for (size_t t = 0; t < sl.targets.size(); ++t) {
    const LoraTargetLayout& tl = sl.targets[t];
    const void* dy_t = at(dy, tl.col, c.dtype);
    void* du_t = at(c.lora_du, static_cast<int64_t>(t) * r, c.dtype);
    if (drop) {  // this target's dropped input and u_t again (tensor parallel, row-parallel: summed, as above)
      masked(c, slot, target_key(c, slot, t), x, c.lora_x, sl.in, false);
      adapter_in(c, sl, t, c.lora_x);
      if (c.tp_comm && row_parallel(slot))  // (the whole of u: the other targets' columns are spent or not yet made)
        c.tp_comm->all_reduce(c.lora_u, c.lora_u, static_cast<size_t>(N * sl.kr), c.dtype, *c.stream);
    }
    if (c.lora_g) {  // dB_t (out, r) (+)= s · dy_tᵀ · u_t
      kernels::MatmulArgs g = gemm(c.dtype, DType::f32);
      g.a = dy_t;
      g.lda = ldy;
      g.trans_a = true;  // dy_t stored (N, out) = (k, m)
      g.b = at(static_cast<const void*>(c.lora_u), static_cast<int64_t>(t) * r, c.dtype);
      g.ldb = sl.kr;
      g.c = c.lora_g + tl.b;
      g.m = tl.out;
      g.n = r;
      g.k = N;
      g.alpha = lay.scale;
      g.beta = beta;
      c.ops->matmul(*c.stream, g);
    }
    // du_t (N, r) = s · dy_t · B_t
    kernels::MatmulArgs m = gemm(c.dtype, c.dtype);
    m.a = dy_t;
    m.lda = ldy;
    m.b = at(c.lora_w, tl.b, c.dtype);  // (out, r) = (k, n)
    m.c = du_t;
    m.ldc = sl.kr;
    m.m = N;
    m.n = r;
    m.k = tl.out;
    m.alpha = lay.scale;
    c.ops->matmul(*c.stream, m);
    if (!drop) continue;
    if (dx) {  // dx += (du_t · A_t) ⊙ mask / (1 - p)
      kernels::MatmulArgs d = gemm(c.dtype, c.dtype);
      d.a = du_t;
      d.lda = sl.kr;
      d.b = at(c.lora_w, sl.a + static_cast<int64_t>(t) * r * sl.in, c.dtype);
      d.c = c.lora_t;
      d.m = N;
      d.n = sl.in;
      d.k = r;
      c.ops->matmul(*c.stream, d);
      masked(c, slot, target_key(c, slot, t), c.lora_t, dx, sl.in, true);
    }
    // Tensor parallel, column-parallel: du_t summed for A's gradient after dx took its part (as
    // below; the whole of du, the other targets' columns spent or not yet made).
    if (c.tp_comm && !row_parallel(slot))
      c.tp_comm->all_reduce(c.lora_du, c.lora_du, static_cast<size_t>(N * sl.kr), c.dtype, *c.stream);
    if (c.lora_g) {  // dA_t (r, in) (+)= du_tᵀ · xd
      kernels::MatmulArgs g = gemm(c.dtype, DType::f32);
      g.a = du_t;
      g.lda = sl.kr;
      g.trans_a = true;
      g.b = c.lora_x;
      g.c = c.lora_g + sl.a + static_cast<int64_t>(t) * r * sl.in;
      g.m = r;
      g.n = sl.in;
      g.k = N;
      g.beta = beta;
      c.ops->matmul(*c.stream, g);
    }
  }
  if (drop) return;
  if (dx) {  // dx (N, in) += du_all · A_all
    kernels::MatmulArgs m = gemm(c.dtype, c.dtype);
    m.a = c.lora_du;
    m.b = at(c.lora_w, sl.a, c.dtype);  // (kr, in) = (k, n)
    m.c = dx;
    m.m = N;
    m.n = sl.in;
    m.k = sl.kr;
    m.beta = 1.f;
    c.ops->matmul(*c.stream, m);
  }
  // Tensor parallel, a column-parallel layer's adapters: each rank's du is its output columns'
  // part. dx took its part (the layer's input gradient is summed over the group after); A is
  // whole on every rank, so its gradient takes the whole du.
  if (c.tp_comm && !row_parallel(slot))
    c.tp_comm->all_reduce(c.lora_du, c.lora_du, static_cast<size_t>(N * sl.kr), c.dtype, *c.stream);
  if (c.lora_g) {  // dA_all (kr, in) (+)= du_allᵀ · x
    kernels::MatmulArgs g = gemm(c.dtype, DType::f32);
    g.a = c.lora_du;
    g.trans_a = true;  // (N, kr) = (k, m)
    g.b = x;
    g.c = c.lora_g + sl.a;
    g.m = sl.kr;
    g.n = sl.in;
    g.k = N;
    g.beta = beta;
    c.ops->matmul(*c.stream, g);
  }
}

}  // namespace model_detail
}  // namespace strata
