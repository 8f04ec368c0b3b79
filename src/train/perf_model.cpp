// FLOP counts and the rate probes behind `strata plan`'s prediction.
#include "src/train/perf_model.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "src/optim/adamw.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

// Matmul parameters of one block: fused qkv, output, fc (gate|up or fc) and down projections.
double block_matmul_params(const ModelDims& d) {
  return static_cast<double>(d.QKV * d.C + d.Q * d.C + d.FC * d.C + d.I * d.C);
}
// Causal attention FLOPs of one block's forward over the micro-batch: q·kᵀ and p·v, each
// 2·T·Q per token, halved for the lower triangle.
double attention_forward_flops(int64_t batch, int64_t seq, int64_t q_width) {
  return 2.0 * 2.0 * static_cast<double>(seq) * static_cast<double>(q_width) * static_cast<double>(batch * seq) / 2.0;
}

// Repeats fn (enqueued on s, 8 calls per synchronisation so small calls are not timed as the
// round trip) for about `seconds` after a warm-up; returns seconds per call.
template <class F>
double time_per_call(kernels::Stream& s, double seconds, F&& fn) {
  fn();
  s.synchronize();
  int calls = 0;
  const auto t0 = Clock::now();
  double elapsed = 0;
  do {
    for (int i = 0; i < 8; ++i) fn();
    s.synchronize();
    calls += 8;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (elapsed < seconds);
  return elapsed / calls;
}

}  // namespace

double step_flops(const ModelConfig& c, int64_t n_params, int64_t batch, int64_t seq) {
  const double tokens = static_cast<double>(batch * seq);
  const int64_t q = c.n_heads * c.effective_head_dim();
  return 6.0 * static_cast<double>(n_params) * tokens +
         3.0 * static_cast<double>(c.n_layers) * attention_forward_flops(batch, seq, q);
}

double step_flops(const Transformer& model) {
  const ModelDims& d = model.dims();
  const ModelConfig& c = model.config();
  double flops = step_flops(c, model.n_params(), d.B, d.T);
  // A frozen parameter's weight gradient is never computed: 4 FLOPs per token, not 6.
  flops -= 2.0 * static_cast<double>(model.n_params() - model.n_trainable_params()) * static_cast<double>(d.N);
  for (int64_t l = 0; l < d.L; ++l)
    if (model.checkpointing().at(l))
      flops += 2.0 * block_matmul_params(d) * static_cast<double>(d.N) + attention_forward_flops(d.B, d.T, d.Q);
  return flops;
}

double probe_adamw_params_per_s(kernels::Runtime& rt, DType dt, int64_t n, double seconds) {
  kernels::DeviceBuffer p(rt, static_cast<size_t>(n) * 4), m(rt, static_cast<size_t>(n) * 4),
      v(rt, static_cast<size_t>(n) * 4), g(rt, static_cast<size_t>(n) * 4),
      w(rt, static_cast<size_t>(n) * kernels::dtype_size(dt));
  auto s = rt.create_stream();
  for (auto* b : {&p, &m, &v, &g}) s->memset_async(b->data(), 0, b->bytes());
  AdamWStep st;
  st.lr = 1e-4f;
  const double sec = time_per_call(*s, seconds, [&] {
    adamw_range(rt.ops(), *s, st, true, n, p.as<float>(), m.as<float>(), v.as<float>(), g.as<float>(),
                dt == DType::f32 ? nullptr : w.data(), dt);
  });
  return static_cast<double>(n) / sec;
}

PhaseTimes probe_phases(const ModelConfig& cfg, DType dt, int64_t batch, int64_t seq, kernels::Runtime& rt,
                        double seconds, const LoraSpec& lora) {
  ModelConfig c1 = cfg;
  c1.n_layers = 1;
  Transformer m(c1, dt, batch, seq, rt, {}, kLogitsChunkBytes, 1, lora);
  const ModelDims& d = m.dims();
  auto s = rt.create_stream();
  kernels::DeviceBuffer ws(rt, m.workspace_bytes());
  m.bind_workspace(*s, ws.data());
  // Every unit's weights from the model's own init (cast to dt), and its fp32 grads.
  const size_t esz = kernels::dtype_size(dt);
  std::vector<kernels::DeviceBuffer> w, g;
  int64_t max_numel = 0;
  for (const Unit& u : m.units()) max_numel = std::max(max_numel, u.numel);
  std::vector<float> host(static_cast<size_t>(max_numel));
  kernels::DeviceBuffer master(rt, static_cast<size_t>(max_numel) * 4);
  for (int u = 0; u < static_cast<int>(m.units().size()); ++u) {
    const int64_t n = m.units()[static_cast<size_t>(u)].numel;
    w.emplace_back(rt, static_cast<size_t>(n) * esz);
    g.emplace_back(rt, static_cast<size_t>(n) * 4);
    m.init_unit(u, 1337, host.data());
    s->memcpy_async(master.data(), host.data(), static_cast<size_t>(n) * 4);
    rt.ops().cast(*s, {.n = n, .src = master.data(), .src_dtype = DType::f32, .dst = w.back().data(), .dst_dtype = dt});
    s->synchronize();  // `host` is refilled for the next unit
  }
  std::vector<int32_t> tok(static_cast<size_t>(2 * d.N));
  uint32_t x = 12345;
  for (auto& t : tok) {
    x = x * 1664525u + 1013904223u;
    t = static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(d.V));
  }
  kernels::DeviceBuffer ids(rt, tok.size() * 4), x0(rt, m.input_bytes());
  s->memcpy_async(ids.data(), tok.data(), tok.size() * 4);
  const auto* in = ids.as<int32_t>();
  const int32_t* targets = in + d.N;
  auto wp = [&](int u) { return w[static_cast<size_t>(u)].data(); };
  // A frozen unit (LoRA's base) has no grads: its phases compute input gradients only.
  auto gp = [&](int u) {
    return m.units()[static_cast<size_t>(u)].trainable ? g[static_cast<size_t>(u)].as<float>() : nullptr;
  };
  const int blk = m.block_unit(0), fn = m.final_norm_unit(), hd = m.head_unit(), emb = m.embed_unit();
  const int lu = m.lora_unit(0);
  const void* wl = lu >= 0 ? wp(lu) : nullptr;
  float* gl = lu >= 0 ? gp(lu) : nullptr;
  const bool frozen_head = !m.units()[static_cast<size_t>(fn)].trainable;
  auto head = [&] { m.head(*s, targets, wp(fn), wp(hd), gp(fn), gp(hd), 1.0f, true, frozen_head); };
  auto block_forward = [&] { m.block_forward(*s, 0, wp(blk), x0.data(), m.final_residual(), wl); };
  auto block_backward = [&] { m.block_backward(*s, 0, wp(blk), x0.data(), gp(blk), true, wl, gl); };
  auto micro_batch = [&] {
    m.embed_forward(*s, in, wp(emb), x0.data());
    block_forward();
    head();
    block_backward();
    if (gp(emb)) m.embed_backward(*s, in, gp(emb), !m.tied_head());
  };
  kernels::DeviceBuffer sums(rt, 8);
  s->memset_async(sums.data(), 0, 8);
  std::vector<int> edges{emb, fn};
  if (!m.tied_head()) edges.push_back(hd);
  const double each = seconds / 5;
  PhaseTimes t;
  const double whole = time_per_call(*s, each, micro_batch) * 1e3;
  t.block_forward_ms = time_per_call(*s, each, block_forward) * 1e3;
  const double head_ms = time_per_call(*s, each, head) * 1e3;
  // The backward reads the residual gradient the head left, so each repeat starts behind a head.
  t.block_backward_ms = std::max(0.0, time_per_call(*s, each, [&] {
                                        head();
                                        block_backward();
                                      }) * 1e3 - head_ms);
  t.edge_ms = std::max(0.0, whole - t.block_forward_ms - t.block_backward_ms);
  const int trained_blk = lu >= 0 ? lu : blk;  // a layer's trained unit: its adapters under LoRA
  t.sum_squares_ms = time_per_call(*s, each / 2, [&] {
                       m.grad_sum_squares(*s, trained_blk, gp(trained_blk), sums.as<double>());
                     }) * 1e3;
  t.edge_sum_squares_ms = time_per_call(*s, each / 2, [&] {
                            for (int u : edges)
                              if (gp(u)) m.grad_sum_squares(*s, u, gp(u), sums.as<double>());
                          }) * 1e3;
  s->synchronize();
  return t;
}

double step_compute_ms(const PhaseTimes& t, const Transformer& model, int grad_accum) {
  const ModelDims& d = model.dims();
  double micro = t.edge_ms;
  for (int64_t l = 0; l < d.L; ++l)
    micro += t.block_forward_ms * (model.checkpointing().at(l) ? 2 : 1) + t.block_backward_ms;
  return micro * grad_accum + t.edge_sum_squares_ms + t.sum_squares_ms * static_cast<double>(d.L);
}

}  // namespace strata
