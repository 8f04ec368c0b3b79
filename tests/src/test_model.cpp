// The Transformer against a float64 model written here from the HF definitions: the loss, and
// every element of every parameter's gradient against central finite differences of the
// float64 loss — for llama (GQA, head_dim ≠ C/H, qwen2-style q/k/v bias, llama3 rope scaling,
// untied and tied heads) and gpt2 (Conv1D layouts, learned positions, gelu_new, tied head).
// Also: bf16 tracks fp32, gradient accumulation equals the big batch, HF RoPE frequencies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/runtime.h"
#include "src/model/transformer.h"
#include "tests/src/model_test_util.h"

using namespace strata;

namespace {

using Vec = std::vector<double>;
using Weights = std::map<std::string, Vec>;

ModelConfig tiny_llama(bool tied) {
  ModelConfig c;
  c.family = Family::llama;
  c.model_type = "qwen2";
  c.vocab_size = 23;
  c.hidden_size = 12;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;  // GQA
  c.head_dim = 6;    // ≠ hidden/heads = 3
  c.intermediate_size = 20;
  c.max_position_embeddings = 32;
  c.norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 16};  // wavelengths 6.3 (medium), 136 and 2917 (low)
  c.tie_word_embeddings = tied;
  c.attention_bias = true;  // qwen2: q/k/v bias
  c.activation = "silu";
  return c;
}

ModelConfig tiny_gpt2() {
  ModelConfig c;
  c.family = Family::gpt2;
  c.model_type = "gpt2";
  c.vocab_size = 19;
  c.hidden_size = 12;
  c.n_layers = 2;
  c.n_heads = 3;
  c.n_kv_heads = 3;
  c.intermediate_size = 48;
  c.max_position_embeddings = 16;
  c.norm_eps = 1e-5;
  c.tie_word_embeddings = true;
  c.activation = "gelu_new";
  return c;
}

// HF's inverse frequencies, in float64 (the model computes them in fp32).
Vec ref_inv_freq(const ModelConfig& c) {
  const int64_t D = c.effective_head_dim();
  Vec inv(static_cast<size_t>(D / 2));
  for (int64_t i = 0; i < D / 2; ++i) inv[static_cast<size_t>(i)] = 1.0 / std::pow(c.rope_theta, 2.0 * i / D);
  if (c.rope_scaling.type != "llama3") return inv;
  const RopeScaling& s = c.rope_scaling;
  const double old = static_cast<double>(s.original_max_position_embeddings);
  const double low_wl = old / s.low_freq_factor, high_wl = old / s.high_freq_factor;
  for (double& f : inv) {
    const double wl = 2 * M_PI / f;
    if (wl < high_wl) continue;                 // high frequency: unchanged
    if (wl > low_wl) { f /= s.factor; continue; }  // low frequency: divided by factor
    const double smooth = (old / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    f = (1 - smooth) * f / s.factor + smooth * f;
  }
  return inv;
}

// The float64 model. x: (N, C) row-major everywhere.
struct Ref {
  ModelConfig c;
  int64_t B, T;
  const Weights* w;
  // Rows of documents (Transformer::set_documents): each token's position and the first slot
  // of its row it may attend to; null: positions t and causal attention over the whole row.
  const std::vector<int32_t>* pos = nullptr;
  const std::vector<int32_t>* seg = nullptr;
  const Vec& W(const std::string& n) const { return w->at(n); }
  double position(int64_t r) const { return pos ? (*pos)[static_cast<size_t>(r)] : static_cast<double>(r % T); }
  int64_t first_key(int64_t b, int64_t t) const { return seg ? (*seg)[static_cast<size_t>(b * T + t)] : 0; }

  static void norm(Vec& y, const Vec& x, int64_t rows, int64_t C, const Vec& g, const Vec* b, double eps, bool ln) {
    y.assign(x.size(), 0);
    for (int64_t r = 0; r < rows; ++r) {
      const double* xr = &x[static_cast<size_t>(r * C)];
      double mean = 0, ms = 0;
      if (ln)
        for (int64_t i = 0; i < C; ++i) mean += xr[i] / C;
      for (int64_t i = 0; i < C; ++i) ms += (xr[i] - mean) * (xr[i] - mean) / C;
      const double rstd = 1 / std::sqrt(ms + eps);
      for (int64_t i = 0; i < C; ++i)
        y[static_cast<size_t>(r * C + i)] = (xr[i] - mean) * rstd * g[static_cast<size_t>(i)] + (b ? (*b)[static_cast<size_t>(i)] : 0);
    }
  }
  // y (rows, out) = x (rows, in) · W; W stored (out, in) unless in_out.
  static Vec linear(const Vec& x, int64_t rows, int64_t in, int64_t out, const Vec& w, const Vec* b, bool in_out) {
    Vec y(static_cast<size_t>(rows * out), 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double s = b ? (*b)[static_cast<size_t>(o)] : 0;
        for (int64_t i = 0; i < in; ++i)
          s += x[static_cast<size_t>(r * in + i)] * w[static_cast<size_t>(in_out ? i * out + o : o * in + i)];
        y[static_cast<size_t>(r * out + o)] = s;
      }
    return y;
  }
  // Causal GQA attention; q (N, Hq·D), k, v (N, Hkv·D) -> (N, Hq·D).
  Vec attention(const Vec& q, const Vec& k, const Vec& v, int64_t Hq, int64_t Hkv, int64_t D) const {
    Vec out(static_cast<size_t>(B * T * Hq * D), 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kh = h / (Hq / Hkv);
        for (int64_t t = 0; t < T; ++t) {
          const int64_t u0 = first_key(b, t);
          Vec s(static_cast<size_t>(t + 1), -INFINITY);
          double mx = -1e300;
          for (int64_t u = u0; u <= t; ++u) {
            double d = 0;
            for (int64_t i = 0; i < D; ++i)
              d += q[static_cast<size_t>(((b * T + t) * Hq + h) * D + i)] * k[static_cast<size_t>(((b * T + u) * Hkv + kh) * D + i)];
            s[static_cast<size_t>(u)] = d / std::sqrt(static_cast<double>(D));
            mx = std::max(mx, s[static_cast<size_t>(u)]);
          }
          double z = 0;
          for (double& e : s) z += (e = std::exp(e - mx));
          for (int64_t u = u0; u <= t; ++u)
            for (int64_t i = 0; i < D; ++i)
              out[static_cast<size_t>(((b * T + t) * Hq + h) * D + i)] +=
                  s[static_cast<size_t>(u)] / z * v[static_cast<size_t>(((b * T + u) * Hkv + kh) * D + i)];
        }
      }
    return out;
  }
  void rope(Vec& x, int64_t H, int64_t D, const Vec& inv) const {
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D / 2; ++i) {
          const double ang = position(r) * inv[static_cast<size_t>(i)];
          double& a = x[static_cast<size_t>((r * H + h) * D + i)];
          double& b = x[static_cast<size_t>((r * H + h) * D + i + D / 2)];
          const double a0 = a, b0 = b;
          a = a0 * std::cos(ang) - b0 * std::sin(ang);
          b = b0 * std::cos(ang) + a0 * std::sin(ang);
        }
  }

  double loss(const std::vector<int32_t>& ids, const std::vector<int32_t>& tg) const {
    const bool gpt2 = c.family == Family::gpt2;
    const int64_t N = B * T, C = c.hidden_size, V = c.vocab_size, Hq = c.n_heads;
    const int64_t Hkv = gpt2 ? Hq : c.n_kv_heads, D = c.effective_head_dim(), I = c.intermediate_size;
    const double eps = c.norm_eps;
    const std::string pre = gpt2 ? "transformer." : "model.";
    Vec x(static_cast<size_t>(N * C));
    const Vec& wte = W(pre + (gpt2 ? "wte.weight" : "embed_tokens.weight"));
    for (int64_t r = 0; r < N; ++r)
      for (int64_t i = 0; i < C; ++i) {
        x[static_cast<size_t>(r * C + i)] = wte[static_cast<size_t>(ids[static_cast<size_t>(r)] * C + i)];
        if (gpt2)
          x[static_cast<size_t>(r * C + i)] += W(pre + "wpe.weight")[static_cast<size_t>(position(r)) * C + i];
      }
    const Vec inv = ref_inv_freq(c);
    Vec h;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      Vec q, k, v, att, o;
      if (gpt2) {
        const std::string p = pre + "h." + std::to_string(l) + ".";
        norm(h, x, N, C, W(p + "ln_1.weight"), &W(p + "ln_1.bias"), eps, true);
        const Vec qkv = linear(h, N, C, 3 * C, W(p + "attn.c_attn.weight"), &W(p + "attn.c_attn.bias"), true);
        q.resize(static_cast<size_t>(N * C)), k.resize(q.size()), v.resize(q.size());
        for (int64_t r = 0; r < N; ++r)
          for (int64_t i = 0; i < C; ++i) {
            q[static_cast<size_t>(r * C + i)] = qkv[static_cast<size_t>(r * 3 * C + i)];
            k[static_cast<size_t>(r * C + i)] = qkv[static_cast<size_t>(r * 3 * C + C + i)];
            v[static_cast<size_t>(r * C + i)] = qkv[static_cast<size_t>(r * 3 * C + 2 * C + i)];
          }
        att = attention(q, k, v, Hq, Hq, D);
        o = linear(att, N, C, C, W(p + "attn.c_proj.weight"), &W(p + "attn.c_proj.bias"), true);
        for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
        norm(h, x, N, C, W(p + "ln_2.weight"), &W(p + "ln_2.bias"), eps, true);
        Vec f = linear(h, N, C, I, W(p + "mlp.c_fc.weight"), &W(p + "mlp.c_fc.bias"), true);
        for (double& e : f) e = 0.5 * e * (1 + std::tanh(std::sqrt(2 / M_PI) * (e + 0.044715 * e * e * e)));
        o = linear(f, N, I, C, W(p + "mlp.c_proj.weight"), &W(p + "mlp.c_proj.bias"), true);
      } else {
        const std::string p = pre + "layers." + std::to_string(l) + ".";
        auto bias = [&](const std::string& n) { return w->count(n) ? &W(n) : nullptr; };
        norm(h, x, N, C, W(p + "input_layernorm.weight"), nullptr, eps, false);
        q = linear(h, N, C, Hq * D, W(p + "self_attn.q_proj.weight"), bias(p + "self_attn.q_proj.bias"), false);
        k = linear(h, N, C, Hkv * D, W(p + "self_attn.k_proj.weight"), bias(p + "self_attn.k_proj.bias"), false);
        v = linear(h, N, C, Hkv * D, W(p + "self_attn.v_proj.weight"), bias(p + "self_attn.v_proj.bias"), false);
        rope(q, Hq, D, inv);
        rope(k, Hkv, D, inv);
        att = attention(q, k, v, Hq, Hkv, D);
        o = linear(att, N, Hq * D, C, W(p + "self_attn.o_proj.weight"), nullptr, false);
        for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
        norm(h, x, N, C, W(p + "post_attention_layernorm.weight"), nullptr, eps, false);
        const Vec g = linear(h, N, C, I, W(p + "mlp.gate_proj.weight"), nullptr, false);
        Vec u = linear(h, N, C, I, W(p + "mlp.up_proj.weight"), nullptr, false);
        for (size_t i = 0; i < u.size(); ++i) u[i] *= g[i] / (1 + std::exp(-g[i]));
        o = linear(u, N, I, C, W(p + "mlp.down_proj.weight"), nullptr, false);
      }
      for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    }
    if (gpt2)
      norm(h, x, N, C, W(pre + "ln_f.weight"), &W(pre + "ln_f.bias"), eps, true);
    else
      norm(h, x, N, C, W(pre + "norm.weight"), nullptr, eps, false);
    const Vec& head = (gpt2 || c.tie_word_embeddings) ? wte : W("lm_head.weight");
    const Vec logits = linear(h, N, C, V, head, nullptr, false);
    double total = 0;
    int64_t count = 0;  // trained targets (-1: not trained)
    for (int64_t r = 0; r < N; ++r) {
      if (tg[static_cast<size_t>(r)] < 0) continue;
      ++count;
      double mx = -1e300, z = 0;
      for (int64_t j = 0; j < V; ++j) mx = std::max(mx, logits[static_cast<size_t>(r * V + j)]);
      for (int64_t j = 0; j < V; ++j) z += std::exp(logits[static_cast<size_t>(r * V + j)] - mx);
      total += mx + std::log(z) - logits[static_cast<size_t>(r * V + tg[static_cast<size_t>(r)])];
    }
    return total / static_cast<double>(count);
  }
};

// Random weights large enough that every path carries signal (std 0.02 would hide bugs).
void randomize(TestModel& m, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (const ParamInfo& p : m.params()) {
    float* w = m.master() + p.offset;
    const float scale = p.shape.size() == 2 ? 1.f / std::sqrt(static_cast<float>(p.shape[1])) * 1.5f : 0.3f;
    for (int64_t i = 0; i < p.numel; ++i) w[i] = (p.ones ? 1.f : 0.f) + scale * u(rng);
  }
}

Weights weights_of(const TestModel& m) {
  Weights w;
  for (const ParamInfo& p : m.params()) w[p.name] = Vec(m.master() + p.offset, m.master() + p.offset + p.numel);
  return w;
}

struct Batch {
  std::vector<int32_t> ids, tg;
  std::vector<int32_t> pos, seg;  // rows of documents (empty: a stream)
  int64_t trained() const { return std::count_if(tg.begin(), tg.end(), [](int32_t t) { return t >= 0; }); }
};
Batch random_batch(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int64_t i = 0; i < n; ++i) {
    b.ids.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
    b.tg.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
  }
  return b;
}

// Every parameter's grad elements set to NaN (unit padding stays zero): a backward that does
// not accumulate must overwrite all of them, so a grad it forgets shows up as NaN.
void poison_grads(TestModel& m) {
  for (const ParamInfo& p : m.params())
    std::fill(m.grads() + p.offset, m.grads() + p.offset + p.numel, std::numeric_limits<float>::quiet_NaN());
}

// Runs forward+backward with grad_scale 1/(trained targets) (the masked mean loss); returns
// that mean loss. The grads are written by a non-accumulating backward over poisoned grads, or
// (accumulate) zeroed and then accumulated into.
double model_loss_and_grads(TestModel& m, kernels::Runtime& rt, const Batch& b, bool backward = true,
                            bool accumulate = false) {
  (void)rt;
  const int64_t N = m.dims().N, count = b.trained();
  m.model().set_documents(b.pos.empty() ? nullptr : b.pos.data(), b.seg.empty() ? nullptr : b.seg.data());
  m.sync_weights();
  if (accumulate)
    m.zero_grads();
  else
    poison_grads(m);
  if (backward)
    m.forward_backward(b.ids.data(), b.tg.data(), 1.f / static_cast<float>(count), accumulate);
  else
    m.forward(b.ids.data(), b.tg.data());
  m.synchronize();
  double sum = 0;
  for (int64_t i = 0; i < N; ++i) sum += m.loss_rows()[i];
  return sum / static_cast<double>(count);
}

// Loss and every gradient element against the float64 model and central differences (a random
// stream batch, or the given rows of documents).
void check_against_float64(const ModelConfig& cfg, int64_t B, int64_t T, const Batch* docs = nullptr) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  TestModel m(cfg, DType::f32, B, T, *rt);
  randomize(m, 7);
  const Batch b = docs ? *docs : random_batch(B * T, cfg.vocab_size, 11);
  const double loss = model_loss_and_grads(m, *rt, b);

  Weights w = weights_of(m);
  Ref ref{cfg, B, T, &w};
  if (docs) ref.pos = &b.pos, ref.seg = &b.seg;
  const double ref_loss = ref.loss(b.ids, b.tg);
  EXPECT_NEAR(loss, ref_loss, 2e-5 * std::max(1.0, std::abs(ref_loss)));

  const double h = 1e-5;
  for (const ParamInfo& p : m.params()) {
    Vec& t = w[p.name];
    double max_ref = 0, max_err = 0;
    int64_t worst = -1;
    for (int64_t i = 0; i < p.numel; ++i) {
      const double keep = t[static_cast<size_t>(i)];
      t[static_cast<size_t>(i)] = keep + h;
      const double lp = ref.loss(b.ids, b.tg);
      t[static_cast<size_t>(i)] = keep - h;
      const double lm = ref.loss(b.ids, b.tg);
      t[static_cast<size_t>(i)] = keep;
      const double fd = (lp - lm) / (2 * h);
      const double g = m.grads()[p.offset + i];
      max_ref = std::max(max_ref, std::abs(fd));
      // !(err <= max_err) also catches a NaN grad, which a plain > comparison would skip.
      if (!(std::abs(g - fd) <= max_err)) max_err = std::abs(g - fd), worst = i;
    }
    EXPECT_GT(max_ref, 1e-6) << p.name << ": no gradient signal (test would be vacuous)";
    EXPECT_LE(max_err, 1e-4 * max_ref + 1e-7)
        << p.name << ": max |grad - finite difference| " << max_err << " at element " << worst
        << " (max |fd| " << max_ref << ")";
  }
}

TEST(Model, LlamaGqaBiasLlama3RopeMatchesFloat64) { check_against_float64(tiny_llama(false), 2, 7); }

// LoRA: the loss equals the float64 model whose adapted weights are W + s·B·A (B random, so every
// path carries signal), each adapter's gradient equals central differences of that loss, and the
// frozen base gets no gradient (its grads stay as poisoned: nothing writes them).
void check_lora_against_float64(const ModelConfig& cfg, const std::string& targets, bool rslora) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  LoraSpec lora{.rank = 3, .alpha = 5, .rslora = rslora, .targets = parse_lora_targets(targets), .base_dtype = "", .dropout = 0};
  TestModel m(cfg, DType::f32, 2, 7, *rt, kLogitsChunkBytes, {}, lora);
  randomize(m, 7);
  const Batch b = random_batch(14, cfg.vocab_size, 11);
  const double loss = model_loss_and_grads(m, *rt, b);
  const double s = lora.scale();
  EXPECT_FLOAT_EQ(lora.scale(), static_cast<float>(rslora ? 5 / std::sqrt(3.0) : 5 / 3.0));

  Weights w = weights_of(m);
  const bool in_out = cfg.family == Family::gpt2;  // Conv1D base weights (in, out)
  const auto merged = [&] {
    Weights e = w;
    for (const auto& [name, a] : w) {
      const size_t at = name.find(".lora_A.weight");
      if (at == std::string::npos) continue;
      const std::string mod = name.substr(0, at);
      const Vec& bm = w[mod + ".lora_B.weight"];
      Vec& base = e[mod + ".weight"];
      const int64_t r = 3, in = static_cast<int64_t>(a.size()) / r, out = static_cast<int64_t>(bm.size()) / r;
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double d = 0;
          for (int64_t k = 0; k < r; ++k) d += bm[static_cast<size_t>(o * r + k)] * a[static_cast<size_t>(k * in + i)];
          base[static_cast<size_t>(in_out ? i * out + o : o * in + i)] += s * d;
        }
    }
    return e;
  };
  Weights e = merged();
  Ref ref{cfg, 2, 7, &e};
  EXPECT_NEAR(loss, ref.loss(b.ids, b.tg), 2e-5 * std::max(1.0, std::abs(loss)));

  int adapters = 0;
  for (const ParamInfo& p : m.params()) {
    if (!m.units()[static_cast<size_t>(p.unit)].trainable) {
      EXPECT_TRUE(std::isnan(m.grads()[p.offset])) << p.name << ": a frozen weight's grad was written";
      continue;
    }
    ++adapters;
    Vec& t = w[p.name];
    double max_ref = 0, max_err = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      const double keep = t[static_cast<size_t>(i)], h = 1e-5;
      t[static_cast<size_t>(i)] = keep + h;
      e = merged();
      const double lp = ref.loss(b.ids, b.tg);
      t[static_cast<size_t>(i)] = keep - h;
      e = merged();
      const double lm = ref.loss(b.ids, b.tg);
      t[static_cast<size_t>(i)] = keep;
      const double fd = (lp - lm) / (2 * h), g = m.grads()[p.offset + i];
      max_ref = std::max(max_ref, std::abs(fd));
      if (!(std::abs(g - fd) <= max_err)) max_err = std::abs(g - fd);
    }
    EXPECT_GT(max_ref, 1e-6) << p.name << ": no gradient signal";
    EXPECT_LE(max_err, 1e-4 * max_ref + 1e-7) << p.name << ": max |grad - finite difference| " << max_err;
  }
  EXPECT_GT(adapters, 0);
}

// A unit's random init in pieces (any cut, across tensors and into the padding) is its whole
// init, bit for bit: what a frozen base's init streams in pieces.
TEST(Model, InitInPiecesIsTheWholeInit) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  LoraSpec lora{.rank = 2, .alpha = 4, .rslora = false, .targets = parse_lora_targets("all-linear"), .base_dtype = "", .dropout = 0};
  Transformer m(tiny_llama(false), DType::f32, 1, 4, *rt, {}, kLogitsChunkBytes, 1, lora);
  for (int u : {m.embed_unit(), m.block_unit(1), m.lora_unit(0), m.final_norm_unit()}) {
    const int64_t n = m.units()[static_cast<size_t>(u)].numel;
    std::vector<float> whole(static_cast<size_t>(n)), pieces(static_cast<size_t>(n), -1.f);
    m.init_unit(u, 42, whole.data());
    for (int64_t lo = 0; lo < n; lo += 37) m.init_range(u, 42, lo, std::min(n, lo + 37), pieces.data() + lo);
    EXPECT_TRUE(std::memcmp(whole.data(), pieces.data(), whole.size() * 4) == 0) << m.units()[static_cast<size_t>(u)].name;
  }
}

// LoRA dropout: with the masks fixed (one key), every adapter's gradient is the derivative of
// the model's own loss (central differences in fp32 of its forward, which draws the same masks),
// and the masks matter (another key, another loss).
TEST(Model, LoraDropoutGradientsAreTheLossDerivative) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  LoraSpec lora{.rank = 3, .alpha = 5, .rslora = false, .targets = parse_lora_targets("all-linear"), .base_dtype = "",
                .dropout = 0.3};
  TestModel m(tiny_llama(false), DType::f32, 2, 7, *rt, kLogitsChunkBytes, {}, lora);
  randomize(m, 7);
  const Batch b = random_batch(14, 23, 11);
  m.model().set_lora_dropout_key(12345);
  model_loss_and_grads(m, *rt, b);
  const std::vector<float> g(m.grads(), m.grads() + m.n_flat());
  const auto loss = [&] { return model_loss_and_grads(m, *rt, b, /*backward=*/false); };
  int checked = 0;
  for (const ParamInfo& p : m.params()) {
    if (!m.units()[static_cast<size_t>(p.unit)].trainable) continue;
    for (int64_t i = 0; i < p.numel; i += 7) {
      float& w = m.master()[p.offset + i];
      const float keep = w, h = 2e-3f;
      w = keep + h;
      const double lp = loss();
      w = keep - h;
      const double lm = loss();
      w = keep;
      const double fd = (lp - lm) / (2.0 * h);
      EXPECT_NEAR(g[static_cast<size_t>(p.offset + i)], fd, 2e-3 + 2e-2 * std::abs(fd)) << p.name << " " << i;
      ++checked;
    }
  }
  EXPECT_GT(checked, 50);
  const double l1 = loss();
  m.model().set_lora_dropout_key(999);
  EXPECT_NE(loss(), l1);
}

TEST(Model, LoraLlamaAllLinearMatchesFloat64) { check_lora_against_float64(tiny_llama(false), "all-linear", false); }
TEST(Model, LoraLlamaSomeTargetsRsloraMatchesFloat64) {
  check_lora_against_float64(tiny_llama(true), "k_proj,up_proj,o_proj", true);
}
TEST(Model, LoraGpt2MatchesFloat64) { check_lora_against_float64(tiny_gpt2(), "c_attn,c_proj,c_fc", false); }
TEST(Model, LlamaTiedMatchesFloat64) {
  ModelConfig c = tiny_llama(true);
  c.model_type = "llama";
  c.rope_scaling = {};
  c.attention_bias = false;
  c.n_kv_heads = 4;
  c.head_dim = 0;  // = hidden / heads = 16 / 4
  c.hidden_size = 16;
  check_against_float64(c, 1, 9);
}
TEST(Model, Gpt2MatchesFloat64) { check_against_float64(tiny_gpt2(), 2, 7); }

// Rows of documents as src/data/doc_rows.h lays them out: each row's documents from slot 0 on
// (T + 1 slots: a document's last token is only a target), the rest padding (token 0, target
// -1, a segment of its own). A target is trained unless `untrained(document, j)` says its token
// j + 1 is masked.
Batch document_rows(const std::vector<std::vector<std::vector<int32_t>>>& rows, int64_t T,
                    const std::function<bool(size_t, int64_t)>& untrained = {}) {
  Batch b;
  size_t doc = 0;
  for (const auto& row : rows) {
    int64_t s = 0;
    for (const auto& d : row) {
      const auto len = static_cast<int64_t>(d.size());
      for (int64_t j = 0; j < len && s + j < T; ++j) {
        b.ids.push_back(d[static_cast<size_t>(j)]);
        const bool trained = j + 1 < len && !(untrained && untrained(doc, j + 1));
        b.tg.push_back(trained ? d[static_cast<size_t>(j + 1)] : -1);
        b.pos.push_back(static_cast<int32_t>(j));
        b.seg.push_back(static_cast<int32_t>(s));
      }
      s += len;
      ++doc;
    }
    for (; s < T; ++s) {
      b.ids.push_back(0);
      b.tg.push_back(-1);
      b.pos.push_back(0);
      b.seg.push_back(static_cast<int32_t>(s));
    }
  }
  return b;
}

std::vector<int32_t> random_doc(int64_t len, int64_t vocab, std::mt19937_64& rng) {
  std::vector<int32_t> d(static_cast<size_t>(len));
  for (int32_t& t : d) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return d;
}

// Packed documents with a loss mask: the masked mean loss (Σ CE over trained targets / their
// count) and every gradient element against the float64 model with block-diagonal attention
// and positions restarting at each document.
TEST(Model, PackedMaskedDocumentsMatchFloat64) {
  for (const ModelConfig& cfg : {tiny_llama(false), tiny_gpt2()}) {
    std::mt19937_64 rng(3);
    const int64_t V = cfg.vocab_size, T = 9;
    // Row 0: a document of 4 and one of 6 (the last token a target only); row 1: 7 then padding.
    const Batch b = document_rows({{random_doc(4, V, rng), random_doc(6, V, rng)}, {random_doc(7, V, rng)}}, T,
                                  [](size_t doc, int64_t j) { return (doc + static_cast<size_t>(j)) % 3 == 0; });
    ASSERT_GT(b.trained(), 6);
    ASSERT_LT(b.trained(), 2 * T);
    check_against_float64(cfg, 2, T, &b);
  }
}

// The same documents packed two to a row or one per row: the same masked mean loss and the same
// gradients (fp32 rounding apart).
TEST(Model, PackedEqualsOnePerRow) {
  for (const ModelConfig& cfg : {tiny_llama(false), tiny_gpt2()}) {
    std::mt19937_64 rng(5);
    const int64_t V = cfg.vocab_size, T = 10;
    std::vector<std::vector<int32_t>> d;
    for (int64_t len : {4, 7, 5, 3, 8}) d.push_back(random_doc(len, V, rng));
    const auto mask = [](size_t doc, int64_t j) { return (doc * 7 + static_cast<size_t>(j)) % 4 == 0; };
    const Batch packed = document_rows({{d[0], d[1]}, {d[2], d[3]}, {d[4]}}, T, mask);
    const Batch single = document_rows({{d[0]}, {d[1]}, {d[2]}, {d[3]}, {d[4]}}, T, mask);
    ASSERT_EQ(packed.trained(), single.trained());
    auto rt = kernels::make_runtime(kernels::Backend::cpu);
    TestModel a(cfg, DType::f32, 3, T, *rt), b(cfg, DType::f32, 5, T, *rt);
    randomize(a, 17);
    randomize(b, 17);
    const double la = model_loss_and_grads(a, *rt, packed), lb = model_loss_and_grads(b, *rt, single);
    EXPECT_NEAR(la, lb, 1e-6 * std::abs(lb)) << cfg.model_type;
    double gmax = 0;
    for (int64_t i = 0; i < a.n_flat(); ++i) gmax = std::max(gmax, static_cast<double>(std::abs(b.grads()[i])));
    for (const ParamInfo& p : a.params())
      for (int64_t i = 0; i < p.numel; ++i)
        ASSERT_NEAR(a.grads()[p.offset + i], b.grads()[p.offset + i], 1e-5 * gmax) << cfg.model_type << " " << p.name;
  }
}

// No attention weight crosses a document boundary: changing every token of one packed document
// leaves the other documents' final hidden states and losses bitwise unchanged.
TEST(Model, PackedDocumentsDoNotSeeEachOther) {
  for (DType dt : {DType::f32, DType::bf16})
    for (const ModelConfig& cfg : {tiny_llama(false), tiny_gpt2()}) {
      std::mt19937_64 rng(9);
      const int64_t V = cfg.vocab_size, T = 12;
      const auto a = random_doc(5, V, rng), b = random_doc(4, V, rng), c = random_doc(4, V, rng);
      auto b2 = b;
      for (int32_t& t : b2) t = (t + 1) % static_cast<int32_t>(V);
      const Batch one = document_rows({{a, b, c}}, T), two = document_rows({{a, b2, c}}, T);
      auto rt = kernels::make_runtime(kernels::Backend::cpu);
      TestModel m(cfg, dt, 1, T, *rt);
      randomize(m, 23);
      const int64_t C = cfg.hidden_size;
      const size_t row = static_cast<size_t>(C) * kernels::dtype_size(dt);
      std::vector<std::vector<char>> hidden;
      std::vector<std::vector<float>> losses;
      for (const Batch* batch : {&one, &two}) {
        model_loss_and_grads(m, *rt, *batch, /*backward=*/false);
        const char* h = static_cast<const char*>(m.model().final_residual());
        hidden.emplace_back(h, h + T * static_cast<int64_t>(row));
        losses.emplace_back(m.loss_rows(), m.loss_rows() + T);
      }
      for (int64_t t = 0; t < T; ++t) {
        const bool in_b = t >= 5 && t < 9;
        const bool same = std::memcmp(hidden[0].data() + t * static_cast<int64_t>(row),
                                      hidden[1].data() + t * static_cast<int64_t>(row), row) == 0;
        if (in_b) {
          EXPECT_FALSE(same) << "token " << t << " of the changed document";
        } else {
          EXPECT_TRUE(same) << cfg.model_type << " " << kernels::dtype_name(dt) << ": token " << t
                            << " saw the changed document";
          if (t != 4) {
            EXPECT_EQ(losses[0][static_cast<size_t>(t)], losses[1][static_cast<size_t>(t)]) << t;
          }
        }
      }
    }
}

TEST(Model, RopeInvFreqMatchesHf) {
  ModelConfig c = tiny_llama(false);
  c.head_dim = 64;
  c.rope_theta = 500000.0;
  c.rope_scaling = {"llama3", 32.0, 1.0, 4.0, 8192};  // Llama 3.2
  const std::vector<float> got = rope_inv_freq(c);
  const Vec want = ref_inv_freq(c);
  ASSERT_EQ(got.size(), want.size());
  int n_low = 0, n_medium = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 2e-6 * want[i]) << i;
    const double wl = 2 * M_PI * std::pow(500000.0, 2.0 * static_cast<double>(i) / 64);
    n_low += wl > 8192;
    n_medium += wl >= 2048 && wl <= 8192;
  }
  EXPECT_GT(n_low, 0);
  EXPECT_GT(n_medium, 0);
  c.rope_scaling.type = "yarn";
  EXPECT_THROW(rope_inv_freq(c), std::invalid_argument);
}

// bf16 working weights/activations: loss and grads close to fp32's.
TEST(Model, Bf16TracksFp32) {
  for (const ModelConfig& cfg : {tiny_llama(false), tiny_gpt2()}) {
    auto rt = kernels::make_runtime(kernels::Backend::cpu);
    TestModel a(cfg, DType::f32, 2, 7, *rt), b(cfg, DType::bf16, 2, 7, *rt);
    randomize(a, 3);
    randomize(b, 3);
    const Batch batch = random_batch(14, cfg.vocab_size, 5);
    const double la = model_loss_and_grads(a, *rt, batch), lb = model_loss_and_grads(b, *rt, batch);
    EXPECT_NEAR(la, lb, 0.03 * la) << cfg.model_type;
    for (const ParamInfo& p : a.params()) {
      double num = 0, den = 0;
      for (int64_t i = 0; i < p.numel; ++i) {
        const double d = a.grads()[p.offset + i] - b.grads()[p.offset + i];
        num += d * d;
        den += static_cast<double>(a.grads()[p.offset + i]) * a.grads()[p.offset + i];
      }
      EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 0.1) << cfg.model_type << " " << p.name;
    }
  }
}

// Two micro-batches of B rows with grad_scale 1/(2·B·T) give the gradient of one 2B batch.
TEST(Model, GradAccumulationEqualsBigBatch) {
  const ModelConfig cfg = tiny_llama(false);
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  TestModel big(cfg, DType::f32, 4, 5, *rt), small(cfg, DType::f32, 2, 5, *rt);
  randomize(big, 9);
  randomize(small, 9);
  const Batch b = random_batch(20, cfg.vocab_size, 13);
  model_loss_and_grads(big, *rt, b);
  small.sync_weights();
  poison_grads(small);
  for (int k = 0; k < 2; ++k)
    small.forward_backward(b.ids.data() + 10 * k, b.tg.data() + 10 * k, 1.f / 20, /*accumulate=*/k > 0);
  small.synchronize();
  for (int64_t i = 0; i < big.n_flat(); ++i)
    ASSERT_NEAR(big.grads()[i], small.grads()[i], 1e-5 * (1 + std::abs(big.grads()[i]))) << i;
}

// The LM head + cross-entropy chunked over rows (a tiny logits budget: 3 rows per chunk, with a
// ragged last chunk) gives the same loss and gradients as one chunk, in fp32 and in bf16.
TEST(Model, ChunkedHeadMatchesOneChunk) {
  for (DType dt : {DType::f32, DType::bf16}) {
    const ModelConfig cfg = tiny_llama(false);
    auto rt = kernels::make_runtime(kernels::Backend::cpu);
    const int64_t row_bytes = cfg.vocab_size * static_cast<int64_t>(kernels::dtype_size(dt));
    TestModel one(cfg, dt, 2, 7, *rt), chunked(cfg, dt, 2, 7, *rt, 3 * row_bytes);
    EXPECT_EQ(one.dims().chunk_rows, 14);
    EXPECT_EQ(chunked.dims().chunk_rows, 3);
    randomize(one, 21);
    randomize(chunked, 21);
    const Batch b = random_batch(14, cfg.vocab_size, 5);
    const double l1 = model_loss_and_grads(one, *rt, b), l2 = model_loss_and_grads(chunked, *rt, b);
    EXPECT_NEAR(l1, l2, 1e-6 * std::abs(l1));
    const double tol = dt == DType::f32 ? 1e-5 : 1e-2;
    double gmax = 0;
    for (int64_t i = 0; i < one.n_flat(); ++i) gmax = std::max(gmax, static_cast<double>(std::abs(one.grads()[i])));
    for (int64_t i = 0; i < one.n_flat(); ++i)
      ASSERT_NEAR(one.grads()[i], chunked.grads()[i], tol * gmax) << kernels::dtype_name(dt) << " " << i;
  }
}

// The first micro-batch's backward (grads overwritten, old contents poisoned with NaN) equals
// zeroing the grads and accumulating, for every family and head layout, with the LM head in
// one chunk and in several (only the first chunk writes the head gradient).
TEST(Model, OverwritingBackwardEqualsZeroThenAccumulate) {
  for (const ModelConfig& cfg : {tiny_llama(false), tiny_llama(true), tiny_gpt2()}) {
    for (int64_t chunk_rows : {int64_t{0}, int64_t{3}}) {
      for (DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(cfg.model_type + (cfg.tie_word_embeddings ? " tied" : " untied") + " chunk_rows " +
                     std::to_string(chunk_rows) + " " + std::string(kernels::dtype_name(dt)));
        auto rt = kernels::make_runtime(kernels::Backend::cpu);
        const int64_t row_bytes = cfg.vocab_size * 4;
        const int64_t budget = chunk_rows ? chunk_rows * row_bytes : kLogitsChunkBytes;
        TestModel a(cfg, dt, 2, 7, *rt, budget), b(cfg, dt, 2, 7, *rt, budget);
        randomize(a, 31);
        randomize(b, 31);
        const Batch batch = random_batch(14, cfg.vocab_size, 17);
        model_loss_and_grads(a, *rt, batch, true, /*accumulate=*/true);
        model_loss_and_grads(b, *rt, batch, true, /*accumulate=*/false);
        for (const ParamInfo& p : a.params())
          for (int64_t i = 0; i < p.numel; ++i) {
            const float x = a.grads()[p.offset + i], y = b.grads()[p.offset + i];
            ASSERT_NEAR(x, y, 1e-6 * (1 + std::abs(x))) << p.name << "[" << i << "]";
          }
      }
    }
  }
}

// Activation checkpointing (full, every:2, every:3) recomputes each checkpointed block's
// forward inside its backward into one shared set of buffers: loss and every gradient bit for
// bit as without, for every family, in fp32 and bf16, first and accumulating micro-batches.
// The per-unit sums of squares (the global norm's parts) match a float64 sum of the grads.
TEST(Model, CheckpointingIsBitwiseIdentical) {
  for (const ModelConfig& base : {tiny_llama(false), tiny_llama(true), tiny_gpt2()}) {
    ModelConfig cfg = base;
    cfg.n_layers = 4;
    for (DType dt : {DType::f32, DType::bf16}) {
      auto rt = kernels::make_runtime(kernels::Backend::cpu);
      TestModel ref(cfg, dt, 2, 7, *rt);
      randomize(ref, 41);
      const Batch b0 = random_batch(14, cfg.vocab_size, 43), b1 = random_batch(14, cfg.vocab_size, 47);
      auto run = [&](TestModel& m) {
        m.sync_weights();
        poison_grads(m);
        m.forward_backward(b0.ids.data(), b0.tg.data(), 0.5f / 14, false);
        m.forward_backward(b1.ids.data(), b1.tg.data(), 0.5f / 14, true);
        m.synchronize();
      };
      run(ref);
      for (const char* policy : {"full", "every:2", "every:3"}) {
        SCOPED_TRACE(cfg.model_type + (cfg.tie_word_embeddings ? " tied " : " ") + policy + " " +
                     std::string(kernels::dtype_name(dt)));
        TestModel m(cfg, dt, 2, 7, *rt, kLogitsChunkBytes, parse_checkpointing(policy));
        randomize(m, 41);
        run(m);
        EXPECT_LT(m.model().workspace_bytes(), ref.model().workspace_bytes());
        for (int64_t r = 0; r < 14; ++r) ASSERT_EQ(m.loss_rows()[r], ref.loss_rows()[r]) << r;
        for (const ParamInfo& p : m.params())
          ASSERT_EQ(std::memcmp(m.grads() + p.offset, ref.grads() + p.offset, static_cast<size_t>(p.numel) * 4), 0)
              << p.name;
        for (size_t u = 0; u < m.units().size(); ++u) {
          ASSERT_EQ(m.unit_norm2()[u], ref.unit_norm2()[u]) << u;
          double want = 0;
          for (int pi : m.units()[u].params) {
            const ParamInfo& p = m.params()[static_cast<size_t>(pi)];
            for (int64_t i = 0; i < p.numel; ++i) want += static_cast<double>(m.grads()[p.offset + i]) * m.grads()[p.offset + i];
          }
          EXPECT_NEAR(m.unit_norm2()[u], want, 1e-9 * want) << u;
          EXPECT_GT(want, 0) << u;
        }
      }
    }
  }
  EXPECT_THROW(parse_checkpointing("every:0"), std::invalid_argument);
  EXPECT_THROW(parse_checkpointing("sometimes"), std::invalid_argument);
  EXPECT_EQ(parse_checkpointing("every:4").every, 4);
}

TEST(Model, SeqBeyondMaxPositionsThrows) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  EXPECT_THROW(Transformer(tiny_gpt2(), DType::f32, 1, 17, *rt), std::invalid_argument);
}

// Parameter table: HF names and shapes, units 4 KiB aligned, decay exactly on 2-D tensors.
TEST(Model, UnitsAndParamTable) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  TestModel g(tiny_gpt2(), DType::f32, 1, 4, *rt);
  const ParamInfo* c_attn = g.find_param("transformer.h.1.attn.c_attn.weight");
  ASSERT_NE(c_attn, nullptr);
  EXPECT_EQ(c_attn->shape, (std::vector<int64_t>{12, 36}));  // Conv1D (in, out)
  EXPECT_EQ(g.find_param("lm_head.weight"), nullptr);        // tied
  EXPECT_EQ(g.units().size(), 2u + 2u);                       // embed, 2 blocks, final norm
  TestModel l(tiny_llama(false), DType::f32, 1, 4, *rt);
  EXPECT_EQ(l.n_params(), tiny_llama(false).n_params());
  EXPECT_EQ(g.n_params(), tiny_gpt2().n_params());
  for (const Unit& u : l.units()) EXPECT_EQ(u.offset % kUnitAlignElems, 0) << u.name;
  for (const ParamInfo& p : l.params()) EXPECT_EQ(p.decay, p.shape.size() == 2) << p.name;
  EXPECT_NE(l.find_param("lm_head.weight"), nullptr);
  EXPECT_EQ(l.find_param("model.layers.0.self_attn.k_proj.weight")->shape, (std::vector<int64_t>{12, 12}));
}

}  // namespace
