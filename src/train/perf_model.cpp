// FLOP counts and the rate probes behind `strata plan`'s prediction.
#include "src/train/perf_model.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "io/bandwidth.h"
#include "src/comm/communicator.h"
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
// One block's forward over the micro-batch: its matmuls and attention.
double block_forward_flops(const ModelDims& d) {
  return 2.0 * block_matmul_params(d) * static_cast<double>(d.N) + attention_forward_flops(d.B, d.T, d.Q);
}
// Its backward: input and weight gradients (input only for a frozen block), attention's twice.
double block_backward_flops(const ModelDims& d, bool frozen) {
  return (frozen ? 2.0 : 4.0) * block_matmul_params(d) * static_cast<double>(d.N) +
         2.0 * attention_forward_flops(d.B, d.T, d.Q);
}
// The head's logits matmul (its backward and the cross-entropy scale with it).
double head_flops(const ModelDims& d) {
  return 2.0 * static_cast<double>(d.N) * static_cast<double>(d.C) * static_cast<double>(d.V);
}

// The one-layer config a probe of shape s builds: s.vocab rows, and the block s.width_div
// times narrower with head_dim kept.
ModelConfig probe_config(const ModelConfig& cfg, const ProbeShape& s) {
  ModelConfig c = cfg;
  c.n_layers = 1;
  c.vocab_size = s.vocab;
  if (s.width_div > 1) {
    c.head_dim = cfg.effective_head_dim();
    c.hidden_size /= s.width_div;
    c.n_heads /= s.width_div;
    c.n_kv_heads /= s.width_div;
    c.intermediate_size /= s.width_div;
  }
  return c;
}

// Whether the block of `s` can be made twice narrower still (every width even, at least 256
// wide after, a valid config, each split over tp ranks still whole).
bool can_halve_width(const ModelConfig& cfg, const ProbeShape& s, int tp) {
  ProbeShape t = s;
  t.width_div *= 2;
  const int64_t k = t.width_div;
  // (tensor parallel: the narrower block must still split over the tp ranks)
  if (cfg.hidden_size % k || cfg.n_heads % (k * tp) || cfg.n_kv_heads % (k * tp) ||
      cfg.intermediate_size % (k * tp) || cfg.hidden_size / k < 256)
    return false;
  try {
    probe_config(cfg, t).validate();
  } catch (const std::invalid_argument&) {
    return false;
  }
  return true;
}

// Repeats fn (enqueued on s) for about `seconds` after a warm-up; returns seconds per call.
// Calls under 10 ms run 8 per synchronisation (so they are not timed as the round trip) and
// give the mean. Longer ones are timed one by one, at least 3 of them, and give the median: a
// large unit's phase costs four calls, not nine, and one call slowed by other work on the
// machine does not become the rate.
template <class F>
double time_per_call(kernels::Stream& s, double seconds, F&& fn) {
  const auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const auto w0 = Clock::now();
  fn();
  s.synchronize();
  const auto t0 = Clock::now();
  if (since(w0) >= 0.01) {
    std::vector<double> calls;
    do {
      const auto c0 = Clock::now();
      fn();
      s.synchronize();
      calls.push_back(since(c0));
    } while (calls.size() < 3 || since(t0) < seconds);
    std::sort(calls.begin(), calls.end());
    const size_t n = calls.size();
    return n % 2 ? calls[n / 2] : 0.5 * (calls[n / 2 - 1] + calls[n / 2]);
  }
  int calls = 0;
  double elapsed = 0;
  do {
    for (int i = 0; i < 8; ++i) fn();
    s.synchronize();
    calls += 8;
    elapsed = since(t0);
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

ProbeShape choose_probe_shape(const ModelConfig& cfg, int64_t batch, int64_t seq, double max_gflop, int tp) {
  ProbeShape s{.batch = batch, .seq = seq, .width_div = 1, .vocab = cfg.vocab_size, .gflop = 0, .model_gflop = 0};
  // One micro-batch of the probe's block and of its head, forward and backward (3× forward);
  // tensor parallel: one rank's part of them.
  const auto gflop = [&](const ProbeShape& p) {
    const ModelDims d = model_dims(probe_config(cfg, p), p.batch, p.seq, TensorParallel{tp, 0, nullptr});
    return std::pair{3 * block_forward_flops(d) / 1e9, 3 * head_flops(d) / 1e9};
  };
  const auto [model_block, model_head] = gflop(s);
  s.model_gflop = model_block + model_head;
  const int64_t min_vocab = std::min<int64_t>(cfg.vocab_size, 2048), min_seq = std::min<int64_t>(seq, 128);
  // Each pass halves one thing: the head's vocabulary while the head is over a quarter of the
  // budget (an 8B llama's block stays whole), then the block's batch, rows and width.
  for (;;) {
    const auto [block, head] = gflop(s);
    s.gflop = block + head;
    if (s.gflop <= max_gflop) break;
    const bool big_block = block > 0.75 * max_gflop;
    if (head > 0.25 * max_gflop && s.vocab > min_vocab) s.vocab = std::max(min_vocab, (s.vocab + 1) / 2);
    else if (big_block && s.batch > 1) s.batch = (s.batch + 1) / 2;
    else if (big_block && s.seq > min_seq) s.seq = std::max(min_seq, (s.seq + 1) / 2);
    else if (big_block && can_halve_width(cfg, s, tp)) s.width_div *= 2;
    else if (s.vocab > min_vocab) s.vocab = std::max(min_vocab, (s.vocab + 1) / 2);
    else break;
  }
  return s;
}

double step_flops(const Transformer& model) {
  const ModelDims& d = model.dims();
  // (d.Q: a tensor-parallel part's own heads)
  double flops = 6.0 * static_cast<double>(model.n_params()) * static_cast<double>(d.N) +
                 3.0 * static_cast<double>(d.L) * attention_forward_flops(d.B, d.T, d.Q);
  // A frozen parameter's weight gradient is never computed: 4 FLOPs per token, not 6.
  flops -= 2.0 * static_cast<double>(model.n_params() - model.n_trainable_params()) * static_cast<double>(d.N);
  for (int64_t l = 0; l < d.L; ++l)
    if (model.checkpointing().at(l)) flops += block_forward_flops(d);
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

Interference probe_interference(kernels::Runtime& rt, DType dt, const ModelConfig& cfg, int64_t rows,
                                io::SwapSpace& space, uint64_t piece_bytes, double seconds) {
  const DType ab = dt == DType::f32 ? DType::f32 : DType::bf16;
  const int64_t m = std::clamp<int64_t>(rows, 16, 2048), k = cfg.hidden_size, n = cfg.intermediate_size;
  const size_t esz = kernels::dtype_size(ab);
  kernels::DeviceBuffer a(rt, static_cast<size_t>(m * k) * esz), b(rt, static_cast<size_t>(k * n) * esz),
      c(rt, static_cast<size_t>(m * n) * esz);
  auto s = rt.create_stream();
  s->memset_async(a.data(), 0x3c, a.bytes());  // 0.0115 in bf16 and f32: no zeros, no denormals
  s->memset_async(b.data(), 0x3c, b.bytes());
  const kernels::MatmulArgs mm{.a = a.data(), .b = b.data(), .c = c.data(), .ab_dtype = ab, .c_dtype = ab,
                               .m = m, .n = n, .k = k};
  rt.ops().matmul(*s, mm);  // warm up: oneDNN's primitive and the pages
  s->synchronize();
  const auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  // GEMMs per second over `sec`, each one waited for, so the count follows the traffic's pace.
  const auto gemms = [&](double sec) {
    const auto t0 = Clock::now();
    int calls = 0;
    double elapsed = 0;
    do {
      rt.ops().matmul(*s, mm);
      s->synchronize();
      ++calls;
      elapsed = since(t0);
    } while (elapsed < sec);
    return calls / elapsed;
  };
  // Compute alone; then, with the traffic running, three rounds of the disk alone and both
  // together (the disk's own pace drifts by tens of percent within a second on a virtio disk,
  // so each round compares it with itself); then compute alone again.
  constexpr int kRounds = 3;
  const double alone_before = gemms(seconds / 6);
  Interference r;
  {
    io::BackgroundTraffic traffic(space, piece_bytes, 16);
    traffic.wait_started();
    double disk_alone_s = 0, beside_s = 0, calls = 0;
    uint64_t disk_alone_bytes = 0, beside_bytes = 0;
    for (int round = 0; round < kRounds; ++round) {
      auto t0 = Clock::now();
      uint64_t b0 = traffic.bytes_moved();
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds / 10));
      disk_alone_s += since(t0);
      disk_alone_bytes += traffic.bytes_moved() - b0;
      t0 = Clock::now();
      b0 = traffic.bytes_moved();
      const double rate = gemms(seconds / 6);
      const double el = since(t0);
      calls += rate * el;
      beside_s += el;
      beside_bytes += traffic.bytes_moved() - b0;
    }
    traffic.stop();
    r.compute = calls / beside_s;
    const double disk_alone = static_cast<double>(disk_alone_bytes) / disk_alone_s;
    r.disk = disk_alone > 0 ? std::clamp(static_cast<double>(beside_bytes) / beside_s / disk_alone, 0.05, 1.0) : 1;
  }
  const double alone = 0.5 * (alone_before + gemms(seconds / 6));
  r.compute = std::clamp(r.compute / alone, 0.05, 1.0);
  return r;
}

namespace {
// A tensor-parallel probe's group: tp ranks of which this process is rank 0, whose collectives
// do nothing. The probe times one rank's part of the phases; the group's traffic is counted
// apart (tp_comm_bytes_per_step), its time is the link's.
class ProbeGroup final : public Communicator {
 public:
  explicit ProbeGroup(int world) : Communicator(CommBackend::local, 0, world, 0, world) {}

 protected:
  void do_all_gather(const void*, void*, size_t, DType, kernels::Stream&) override {}
  void do_reduce_scatter(const void*, void*, size_t, DType, kernels::Stream&) override {}
  void do_all_reduce(const void*, void*, size_t, DType, kernels::Stream&) override {}
  void do_broadcast(void*, size_t, DType, int, kernels::Stream&) override {}
  void do_barrier(kernels::Stream&) override {}
  void do_send(const void*, size_t, DType, int, kernels::Stream&) override {}
  void do_send_recv(const void*, size_t, int, void*, size_t, int, DType, kernels::Stream&) override {}
  void do_recv(void*, size_t, DType, int, kernels::Stream&) override {}
  void do_host_broadcast(void*, size_t, int) override {}
  void do_host_all_gather(const void*, void*, size_t) override {}
  void do_host_gather(const void*, void*, size_t, int) override {}
  std::unique_ptr<Communicator> do_split(int, int) override { return std::make_unique<ProbeGroup>(1); }
};
}  // namespace

PhaseTimes probe_phases(const ModelConfig& cfg, DType dt, int64_t batch, int64_t seq, kernels::Runtime& rt,
                        double seconds, const LoraSpec& lora, const ProbeShape* shape, int tp, bool sequence) {
  ProbeGroup group(tp);
  const TensorParallel part{tp, 0, tp > 1 ? &group : nullptr, sequence && tp > 1};
  const ProbeShape exact{.batch = batch, .seq = seq, .width_div = 1, .vocab = cfg.vocab_size, .gflop = 0,
                         .model_gflop = 0};
  const ProbeShape& ps = shape ? *shape : exact;
  ModelConfig c1 = cfg;
  c1.n_layers = 1;
  // The model's one-block copy (sizes only, nothing allocated) and the probe. A narrower vocab
  // keeps the model's number of LM-head chunks: each re-reads the head's gradient, so the
  // head's cost stays in proportion to its rows.
  const Transformer full(c1, dt, batch, seq, rt, {}, kLogitsChunkBytes, 1, lora, part);
  const int64_t n_chunks = (full.dims().N + full.dims().chunk_rows - 1) / full.dims().chunk_rows;
  const int64_t probe_rows = ps.batch * ps.seq;
  const int64_t chunk_bytes = (probe_rows + n_chunks - 1) / n_chunks * ps.vocab *
                              static_cast<int64_t>(kernels::dtype_size(dt == DType::bf16 ? DType::bf16 : DType::f32));
  Transformer m(probe_config(cfg, ps), dt, ps.batch, ps.seq, rt, {}, ps.scaled() ? chunk_bytes : kLogitsChunkBytes,
                1, lora, part);
  const ModelDims& d = m.dims();
  auto s = rt.create_stream();
  kernels::DeviceBuffer ws(rt, m.workspace_bytes());
  m.bind_workspace(*s, ws.data());
  // Every unit's weights from the model's own init (cast to dt, a piece at a time), and its fp32 grads.
  const size_t esz = kernels::dtype_size(dt);
  std::vector<kernels::DeviceBuffer> w, g;
  constexpr int64_t kInitPiece = int64_t{1} << 22;
  std::vector<float> host(static_cast<size_t>(kInitPiece));
  kernels::DeviceBuffer master(rt, static_cast<size_t>(kInitPiece) * 4);
  for (int u = 0; u < static_cast<int>(m.units().size()); ++u) {
    const int64_t n = m.units()[static_cast<size_t>(u)].numel;
    w.emplace_back(rt, static_cast<size_t>(n) * esz);
    g.emplace_back(rt, static_cast<size_t>(n) * 4);
    for (int64_t lo = 0; lo < n; lo += kInitPiece) {
      const int64_t k = std::min(kInitPiece, n - lo);
      m.init_range(u, 1337, lo, lo + k, host.data());
      s->memcpy_async(master.data(), host.data(), static_cast<size_t>(k) * 4);
      rt.ops().cast(*s, {.n = k, .src = master.data(), .src_dtype = DType::f32,
                         .dst = static_cast<char*>(w.back().data()) + static_cast<size_t>(lo) * esz, .dst_dtype = dt});
      s->synchronize();  // `host` is refilled for the next piece
    }
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
  auto embed_forward = [&] { m.embed_forward(*s, in, wp(emb), x0.data()); };
  auto embed_backward = [&] {
    if (gp(emb)) m.embed_backward(*s, in, gp(emb), !m.tied_head());
  };
  auto micro_batch = [&] {
    embed_forward();
    block_forward();
    head();
    block_backward();
    embed_backward();
  };
  kernels::DeviceBuffer sums(rt, 8);
  s->memset_async(sums.data(), 0, 8);
  std::vector<int> edges{emb, fn};
  if (!m.tied_head()) edges.push_back(hd);
  const double each = seconds / 5;
  PhaseTimes t;
  // The model's own shape: the edges are the micro-batch less the block's phases. A scaled
  // probe times them directly instead: its head is small beside its block, so that difference
  // would be mostly the block's noise, multiplied by the extrapolation.
  const double whole = ps.scaled() ? 0 : time_per_call(*s, each, micro_batch) * 1e3;
  t.block_forward_ms = time_per_call(*s, each, block_forward) * 1e3;
  const double head_ms = time_per_call(*s, each, head) * 1e3;
  // The backward reads the residual gradient the head left, so each repeat starts behind a head.
  t.block_backward_ms = std::max(0.0, time_per_call(*s, each, [&] {
                                        head();
                                        block_backward();
                                      }) * 1e3 - head_ms);
  t.edge_ms = !ps.scaled() ? std::max(0.0, whole - t.block_forward_ms - t.block_backward_ms)
                           : time_per_call(*s, each, [&] {
                               embed_forward();
                               head();
                               embed_backward();
                             }) * 1e3;
  const int trained_blk = lu >= 0 ? lu : blk;  // a layer's trained unit: its adapters under LoRA
  t.sum_squares_ms = time_per_call(*s, each / 2, [&] {
                       m.grad_sum_squares(*s, trained_blk, gp(trained_blk), sums.as<double>());
                     }) * 1e3;
  t.edge_sum_squares_ms = time_per_call(*s, each / 2, [&] {
                            for (int u : edges)
                              if (gp(u)) m.grad_sum_squares(*s, u, gp(u), sums.as<double>());
                          }) * 1e3;
  s->synchronize();
  if (ps.scaled()) {
    // To the model's shape, phase by phase (a frozen base's backward computes input gradients only).
    const ModelDims& f = full.dims();
    const bool frozen = !m.units()[static_cast<size_t>(blk)].trainable;
    t.block_forward_ms *= block_forward_flops(f) / block_forward_flops(d);
    t.block_backward_ms *= block_backward_flops(f, frozen) / block_backward_flops(d, frozen);
    t.edge_ms *= head_flops(f) / head_flops(d);
    const auto elems = [](const Transformer& x, const std::vector<int>& us) {
      double n = 0;
      for (int u : us) n += static_cast<double>(x.units()[static_cast<size_t>(u)].n_real);
      return n;
    };
    t.sum_squares_ms *= elems(full, {trained_blk}) / elems(m, {trained_blk});
    t.edge_sum_squares_ms *= elems(full, edges) / elems(m, edges);
  }
  return t;
}

PhaseFlops phase_flops(const Transformer& model) {
  const ModelDims& d = model.dims();
  const auto unit = [&](int u) -> const Unit& { return model.units()[static_cast<size_t>(u)]; };
  const bool frozen = !unit(model.block_unit(0)).trainable, frozen_head = !unit(model.final_norm_unit()).trainable;
  // (The head forward and backward; a frozen head: its input gradient only.)
  return {block_forward_flops(d), block_backward_flops(d, frozen), (frozen_head ? 2.0 : 3.0) * head_flops(d)};
}

PhaseTimes model_phases(const Transformer& model, double flops_per_s, double mem_bytes_per_s) {
  const auto unit = [&](int u) -> const Unit& { return model.units()[static_cast<size_t>(u)]; };
  const auto grad_ms = [&](std::initializer_list<int> us) {
    double bytes = 0;
    for (int u : us)
      if (unit(u).trainable) bytes += 4.0 * static_cast<double>(unit(u).n_real);
    return mem_bytes_per_s > 0 ? bytes / mem_bytes_per_s * 1e3 : 0.0;
  };
  PhaseTimes t;
  const PhaseFlops f = phase_flops(model);
  t.block_forward_ms = f.block_forward / flops_per_s * 1e3;
  t.block_backward_ms = f.block_backward / flops_per_s * 1e3;
  // (The embedding's gather and scatter are memory-bound and small beside the head.)
  t.edge_ms = f.edge / flops_per_s * 1e3;
  t.sum_squares_ms = grad_ms({model.lora() ? model.lora_unit(0) : model.block_unit(0)});
  t.edge_sum_squares_ms = model.tied_head() ? grad_ms({model.embed_unit(), model.final_norm_unit()})
                                            : grad_ms({model.embed_unit(), model.final_norm_unit(), model.head_unit()});
  return t;
}

double step_compute_ms(const PhaseTimes& t, const Transformer& model, int grad_accum) {
  const ModelDims& d = model.dims();
  double micro = t.edge_ms;
  for (int64_t l = 0; l < d.L; ++l)
    micro += t.block_forward_ms * (model.checkpointing().at(l) ? 2 : 1) + t.block_backward_ms;
  return micro * grad_accum + t.edge_sum_squares_ms + t.sum_squares_ms * static_cast<double>(d.L);
}

double pipeline_compute_ms(const PhaseTimes& t, const Checkpointing& ckpt, const std::vector<int64_t>& layers,
                           int grad_accum) {
  double most = 0, sum = 0, most_sq = 0;
  int64_t first = 0;
  for (size_t s = 0; s < layers.size(); ++s) {
    double micro = s + 1 == layers.size() ? t.edge_ms : 0;
    for (int64_t l = first; l < first + layers[s]; ++l)
      micro += t.block_forward_ms * (ckpt.at(l) ? 2 : 1) + t.block_backward_ms;
    first += layers[s];
    sum += micro;
    if (micro > most) {
      most = micro;
      most_sq = t.sum_squares_ms * static_cast<double>(layers[s]) + (s == 0 || s + 1 == layers.size() ? t.edge_sum_squares_ms : 0);
    }
  }
  return static_cast<double>(grad_accum - 1) * most + sum + most_sq;
}

std::vector<int64_t> balanced_pipeline_layers(const PhaseTimes& t, const Checkpointing& ckpt, int64_t L, int stages) {
  if (stages < 1 || L < stages) return {};
  const auto S = static_cast<size_t>(stages), N = static_cast<size_t>(L);
  std::vector<double> prefix(N + 1, 0);
  for (size_t l = 0; l < N; ++l)
    prefix[l + 1] = prefix[l] + t.block_forward_ms * (ckpt.at(static_cast<int64_t>(l)) ? 2 : 1) + t.block_backward_ms;
  const auto cost = [&](size_t s, size_t a, size_t n) {  // stage s (of S, from 1) holding layers [a, n)
    return prefix[n] - prefix[a] + (s == S ? t.edge_ms : 0);
  };
  // Over contiguous splits, dynamic programming twice: the least slowest stage M, then among the
  // splits whose every stage is within M, the least Σ stage² (the most even, so a stage that
  // could take a layer more or less does not).
  const double inf = std::numeric_limits<double>::infinity();
  const auto solve = [&](const auto& value, const auto& combine, double bound) {
    std::vector<std::vector<double>> best(S + 1, std::vector<double>(N + 1, inf));
    std::vector<std::vector<size_t>> cut(S + 1, std::vector<size_t>(N + 1, 0));
    best[0][0] = 0;
    for (size_t s = 1; s <= S; ++s)
      for (size_t n = s; n + (S - s) <= N; ++n)
        for (size_t a = s - 1; a < n; ++a) {
          const double c = cost(s, a, n);
          if (c > bound || best[s - 1][a] == inf) continue;
          const double v = combine(best[s - 1][a], value(c));
          if (v < best[s][n]) {
            best[s][n] = v;
            cut[s][n] = a;
          }
        }
    std::vector<int64_t> out(S);
    for (size_t s = S, n = N; s > 0; --s) {
      out[s - 1] = static_cast<int64_t>(n - cut[s][n]);
      n = cut[s][n];
    }
    return std::pair{best[S][N], out};
  };
  const double most = solve([](double c) { return c; }, [](double x, double y) { return std::max(x, y); }, inf).first;
  return solve([](double c) { return c * c; }, [](double x, double y) { return x + y; }, most * (1 + 1e-12)).second;
}

std::vector<int64_t> pipeline_split(const ModelConfig& cfg, int64_t batch, int64_t seq, const TensorParallel& tp,
                                    const Checkpointing& ckpt, int stages, const std::string& given) {
  if (stages < 1) throw std::invalid_argument("--pp must be >= 1, got " + std::to_string(stages));
  if (cfg.n_layers < stages)
    throw std::invalid_argument("--pp " + std::to_string(stages) + " needs at least one layer per stage: the model has " +
                                std::to_string(cfg.n_layers) + " layers");
  if (!given.empty()) return pipeline_layers(cfg.n_layers, stages, given);
  if (stages == 1) return {cfg.n_layers};
  const ModelDims d = model_dims(cfg, batch, seq, tp);
  PhaseTimes flops;  // (FLOPs in place of milliseconds: only their ratios count)
  flops.block_forward_ms = block_forward_flops(d);
  flops.block_backward_ms = block_backward_flops(d, false);
  flops.edge_ms = 3.0 * head_flops(d);
  return balanced_pipeline_layers(flops, ckpt, d.L, stages);
}

}  // namespace strata
