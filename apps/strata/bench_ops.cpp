// `strata bench ops`: times the op set through the Ops interface on a stream and prints one JSON
// line per case. CPU (default): GPT-2-124M shapes. `--backend cuda`: ~1B llama shapes timed with
// CUDA events, TFLOP/s or GB/s and the share of the device's peak. Where a reference exists (a
// bare oneDNN primitive or bare cuBLASLt GEMM, the plain OpenMP AdamW loop) it runs in the same
// process, alternating rep by rep with ours, and our line carries `ratio` (our throughput / the
// reference's, the median over reps of adjacent pairs), so one run compares like with like.
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "apps/strata/commands.h"
#include "bench/reference/reference.h"
#include "kernels/cpu/parallel.h"
#include "kernels/ops.h"
#include "kernels/runtime.h"
#ifdef STRATA_HAVE_CUDA
#include "kernels/cuda/bench.h"
#endif

namespace strata::app {
namespace {

using kernels::DType;

struct Options {
  std::string backend = "cpu";
  int device = 0;
  int threads = 0;
  std::string filter;
  int reps = 10;
  int64_t adamw_params = 100'000'000;
  double peak_bf16_tflops = 0, peak_gbs = 0;  // CUDA: 0 = from the device name
};

// A flag's value as the user would write it: integers whole, doubles in %g.
template <typename T>
std::string fmt_number(T v) {
  if constexpr (std::is_integral_v<T>) {
    return std::to_string(v);
  } else {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    return buf;
  }
}

// The numeric flags checked before any case runs, each error naming its flag and range (CLI11's
// PositiveNumber would print the range's bounds as 300-digit doubles).
void check_options(const Options& o) {
  const auto range = [](const std::string& flag, auto v, auto lo, auto hi, const std::string& what) {
    if (!(v >= lo && v <= hi))  // also NaN
      throw std::invalid_argument("bench ops " + flag + " " + fmt_number(v) + ": give " + what + ", from " +
                                  fmt_number(lo) + " to " + fmt_number(hi));
  };
  range("--reps", o.reps, 1, 1'000'000, "the timed repetitions per case");
  range("--threads", o.threads, 0, 4096, "the compute threads (0: all available cores)");
  range("--device", o.device, 0, 1023, "the CUDA device index");
  range("--adamw-params", o.adamw_params, int64_t{1}, int64_t{10'000'000'000}, "the parameters in the AdamW cases");
  range("--peak-bf16-tflops", o.peak_bf16_tflops, 0.0, 1e6, "the bf16 peak in TFLOP/s (0: from the device name)");
  range("--peak-gbs", o.peak_gbs, 0.0, 1e6, "the memory bandwidth peak in GB/s (0: from the device name)");
  // The CPU AdamW cases hold fp32 params, grads, m, v and bf16 grads: 18 bytes per parameter.
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  const double ram = pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0;
  if (o.backend == "cpu" && ram > 0 && 18.0 * static_cast<double>(o.adamw_params) > ram / 2)
    throw std::invalid_argument("bench ops --adamw-params " + std::to_string(o.adamw_params) + ": the AdamW cases "
                                "would hold " + fmt_number(18.0 * static_cast<double>(o.adamw_params) / 1e9) +
                                " GB (18 bytes per parameter), more than half of this machine's RAM; give fewer");
}

// What one case measures: `work` per call, and how its throughput is reported.
struct Metric {
  double flops = 0;   // -> gflops
  double bytes = 0;   // -> gb_per_s
  double params = 0;  // -> params_per_s (and gb_per_s from bytes)
};

struct Timing {
  std::vector<double> ms;
  std::string error;
  double median() const { return app::median(ms); }
  double min() const { return ms.empty() ? 0 : *std::min_element(ms.begin(), ms.end()); }
};

std::vector<uint16_t> random_bits(int64_t n, DType t, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<uint16_t> v(n * kernels::dtype_size(t) / 2);
  for (int64_t i = 0; i < n; ++i) kernels::store_from_f32(v.data(), t, i, d(rng));
  return v;
}

class Bench {
 public:
  explicit Bench(const Options& o) : opt_(o) {
    if (o.threads > 0) kernels::cpu::set_num_threads(o.threads);
    rt_ = kernels::make_runtime(kernels::Backend::cpu);
    s_ = rt_->create_stream();
  }
  kernels::Ops& ops() { return rt_->ops(); }
  kernels::Stream& stream() { return *s_; }
  bool selected(const std::string& name, const std::string& shape) const {
    return opt_.filter.empty() || (name + " " + shape).find(opt_.filter) != std::string::npos;
  }

  // Times `ours` (and `ref`, alternating, when given): one warm-up call each, then reps.
  // Each call is enqueued on the stream and waited for, so both run on the stream's worker.
  void compare(const std::string& name, const std::string& shape, const Metric& metric,
               const std::function<void()>& ours, const std::string& ref_name = {},
               const std::function<void()>& ref = {}) {
    if (!selected(name, shape) && !(ref && selected(ref_name, shape))) return;
    Timing t_ours, t_ref;
    const bool ours_ok = timed(ours, nullptr, t_ours);
    const bool ref_ok = ref && timed(ref, nullptr, t_ref);
    for (int r = 0; r < opt_.reps; ++r) {
      if (ours_ok) timed(ours, &t_ours.ms, t_ours);
      if (ref_ok) timed(ref, &t_ref.ms, t_ref);
    }
    nlohmann::json line = report(name, shape, metric, t_ours);
    if (ref && ours_ok && ref_ok && !t_ours.ms.empty() && t_ours.ms.size() == t_ref.ms.size()) {
      // Median over reps of ref/ours from adjacent calls, which saw about the same machine load.
      std::vector<double> paired;
      for (size_t i = 0; i < t_ours.ms.size(); ++i) paired.push_back(t_ref.ms[i] / t_ours.ms[i]);
      std::sort(paired.begin(), paired.end());
      line["ratio"] = round3(paired[paired.size() / 2]);
      line["ratio_of_medians"] = round3(t_ref.median() / t_ours.median());
      line["ratio_of_mins"] = round3(t_ref.min() / t_ours.min());
    }
    std::printf("%s\n", line.dump().c_str());
    if (ref) std::printf("%s\n", report(ref_name, shape, metric, t_ref).dump().c_str());
    std::fflush(stdout);
  }

  void print(const nlohmann::json& j) {
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  int reps() const { return opt_.reps; }
  const Options& options() const { return opt_; }

  // One enqueued call, waited for; returns false (and records the error) if it threw.
  bool timed(const std::function<void()>& fn, std::vector<double>* out, Timing& t) {
    try {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      s_->synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      if (out) out->push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      return true;
    } catch (const std::exception& e) {
      t.error = e.what();
      return false;
    }
  }

  static double round3(double x) { return std::round(x * 1000.0) / 1000.0; }

 private:
  nlohmann::json report(const std::string& name, const std::string& shape, const Metric& m, const Timing& t) {
    nlohmann::json j;
    j["name"] = name;
    j["shape"] = shape;
    j["threads"] = kernels::cpu::num_threads();
    if (!t.error.empty()) {
      j["error"] = t.error;
      return j;
    }
    const double ms = t.median();
    j["ms"] = round3(ms);
    j["ms_min"] = round3(t.min());
    j["reps"] = t.ms.size();
    if (m.flops > 0) j["gflops"] = round3(m.flops / (ms * 1e6));
    if (m.bytes > 0) j["gb_per_s"] = round3(m.bytes / (ms * 1e6));
    if (m.params > 0) j["params_per_s"] = std::round(m.params / (ms * 1e-3));
    return j;
  }

  Options opt_;
  std::unique_ptr<kernels::Runtime> rt_;
  std::unique_ptr<kernels::Stream> s_;
};

std::string dims(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t x : d) {  // appended piece by piece: GCC 12's -Wrestrict misfires on s += a + b here
    if (!s.empty()) s += 'x';
    s += std::to_string(x);
  }
  return s;
}

// GPT-2-124M projections at 256 tokens, (m, k, n): qkv, mlp up, mlp down.
void bench_matmul(Bench& b) {
  for (DType t : {DType::f32, DType::bf16})
    for (auto [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{256, 768, 2304}, {256, 768, 3072}, {256, 3072, 768}}) {
      const std::string suffix = t == DType::f32 ? "_fp32" : "_bf16";
      const std::string shape = dims({m, k, n});
      if (!b.selected("matmul" + suffix, shape) && !b.selected("onednn_matmul" + suffix, shape)) continue;
      auto A = random_bits(m * k, t, 1), B = random_bits(k * n, t, 2);
      std::vector<float> C(m * n), C_ref(m * n);
      kernels::MatmulArgs a;
      a.a = A.data(), a.b = B.data(), a.c = C.data(), a.ab_dtype = t, a.m = m, a.n = n, a.k = k;
      auto ref = std::make_shared<bench_ref::OnednnMatmul>(m, n, k, t == DType::bf16);
      b.compare("matmul" + suffix, shape, {.flops = 2.0 * m * n * k}, [&] { b.ops().matmul(b.stream(), a); },
                "onednn_matmul" + suffix,
                [&] { b.stream().host_fn([&] { ref->run(A.data(), B.data(), C_ref.data()); }); });
    }
}

// AdamW over n fp32 params, strata vs the plain OpenMP loop, on the same buffers.
void bench_adamw(Bench& b) {
  const int64_t n = b.options().adamw_params;
  const std::string shape = std::to_string(n);
  const bool any = b.selected("adamw_fp32", shape) || b.selected("omp_adamw_fp32", shape) ||
                   b.selected("adamw_bf16grad", shape) || b.selected("omp_adamw_bf16grad", shape);
  if (!any) return;
  std::vector<float> p(n, 0.5f), g(n, 1e-3f), m(n, 0.f), v(n, 0.f);  // touched once, here
  std::vector<uint16_t> g16(n, kernels::f32_to_bf16(1e-3f));
  for (bool bf16 : {false, true}) {
    int64_t step = 0;
    kernels::AdamWArgs a;
    a.n = n, a.param = p.data(), a.m = m.data(), a.v = v.data(), a.weight_decay = 0.1f;
    a.grad = bf16 ? static_cast<const void*>(g16.data()) : g.data();
    a.grad_dtype = bf16 ? DType::bf16 : DType::f32;
    // 16 B read + 12 B written per param (grad 2 B with bf16 grads).
    const Metric metric{.bytes = double(n) * (bf16 ? 26 : 28), .params = double(n)};
    const std::string suffix = bf16 ? "_bf16grad" : "_fp32";
    b.compare("adamw" + suffix, shape, metric,
              [&] {
                a.step = ++step;
                b.ops().adamw(b.stream(), a);
              },
              "omp_adamw" + suffix, [&] {
                const int64_t t = ++step;
                const int threads = kernels::cpu::num_threads();
                b.stream().host_fn([&, t, threads] {
                  bench_ref::adamw_plain_omp(n, p.data(), a.grad, bf16, m.data(), v.data(), a.lr, a.beta1, a.beta2,
                                             a.eps, a.weight_decay, t, threads);
                });
              });
  }
}

// Memory-bound reductions and casts over 64M elements.
void bench_memory_ops(Bench& b) {
  const int64_t n = int64_t{1} << 26;
  const std::string shape = std::to_string(n);
  if (!b.selected("sum_squares_fp32", shape) && !b.selected("cast", shape) && !b.selected("scale_fp32", shape)) return;
  std::vector<float> x(n, 0.25f), y(n);
  std::vector<uint16_t> h(n);
  double out = 0;
  b.compare("sum_squares_fp32", shape, {.bytes = 4.0 * n},
            [&] { b.ops().sum_squares(b.stream(), {DType::f32, n, x.data(), &out}); });
  b.compare("scale_fp32", shape, {.bytes = 8.0 * n}, [&] { b.ops().scale(b.stream(), {DType::f32, n, x.data(), 1.f}); });
  b.compare("cast_fp32_bf16", shape, {.bytes = 6.0 * n},
            [&] { b.ops().cast(b.stream(), {n, x.data(), DType::f32, h.data(), DType::bf16}); });
  b.compare("cast_bf16_fp32", shape, {.bytes = 6.0 * n},
            [&] { b.ops().cast(b.stream(), {n, h.data(), DType::bf16, y.data(), DType::f32}); });
}

// The other ops at GPT-2 shapes (written elsewhere; an op that is not there reports "error").
void bench_model_ops(Bench& b) {
  const int64_t B = 4, T = 256, H = 12, D = 64, C = H * D, V = 50257, rows_ce = 256;
  {
    auto q = random_bits(B * T * C, DType::f32, 5), k = random_bits(B * T * C, DType::f32, 6),
         v = random_bits(B * T * C, DType::f32, 7), dout = random_bits(B * T * C, DType::f32, 8);
    std::vector<float> out(B * T * C), lse(B * H * T), dq(B * T * C), dk(B * T * C), dv(B * T * C);
    kernels::AttentionArgs a;
    a.batch = B, a.seq = T, a.n_heads = H, a.n_kv_heads = H, a.head_dim = D;
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out.data(), a.lse = lse.data();
    const std::string shape = dims({B, T, H, D});
    b.compare("attention_fp32", shape, {.flops = 2.0 * B * H * T * T * D}, [&] { b.ops().attention(b.stream(), a); });
    kernels::AttentionBackwardArgs g;
    g.batch = B, g.seq = T, g.n_heads = H, g.n_kv_heads = H, g.head_dim = D;
    g.q = q.data(), g.k = k.data(), g.v = v.data(), g.out = out.data(), g.dout = dout.data(), g.lse = lse.data();
    g.dq = dq.data(), g.dk = dk.data(), g.dv = dv.data();
    b.compare("attention_backward_fp32", shape, {.flops = 5.0 * B * H * T * T * D},
              [&] { b.ops().attention_backward(b.stream(), g); });
  }
  {
    auto logits = random_bits(rows_ce * V, DType::f32, 9);
    std::vector<int32_t> targets(rows_ce);
    for (int64_t r = 0; r < rows_ce; ++r) targets[r] = static_cast<int32_t>((r * 7919) % V);
    std::vector<float> losses(rows_ce), dlogits(rows_ce * V);
    kernels::CrossEntropyArgs a;
    a.rows = rows_ce, a.vocab = V, a.logits = logits.data(), a.targets = targets.data(), a.losses = losses.data();
    a.dlogits = dlogits.data(), a.grad_scale = 1.f / rows_ce;
    b.compare("cross_entropy_fp32", dims({rows_ce, V}), {.bytes = 8.0 * rows_ce * V},
              [&] { b.ops().cross_entropy(b.stream(), a); });
  }
  {
    const int64_t rows = B * T;
    auto x = random_bits(rows * C, DType::f32, 10), w = random_bits(C, DType::f32, 11);
    std::vector<float> y(rows * C), mean(rows), rstd(rows);
    kernels::NormArgs a;
    a.rows = rows, a.cols = C, a.x = x.data(), a.weight = w.data(), a.bias = w.data(), a.y = y.data();
    a.mean = mean.data(), a.rstd = rstd.data();
    b.compare("layernorm_fp32", dims({rows, C}), {.bytes = 8.0 * rows * C}, [&] { b.ops().layernorm(b.stream(), a); });
    a.bias = nullptr;
    b.compare("rmsnorm_fp32", dims({rows, C}), {.bytes = 8.0 * rows * C}, [&] { b.ops().rmsnorm(b.stream(), a); });
  }
}

double process_cpu_ms() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-3;
}

// Does oneDNN's OpenMP team (spin-waiting after a matmul) slow the loop that follows, and vice
// versa? For each pool our loops can run on (the OpenMP team, the default; oneTBB, for
// comparison), alternating rep by rep: a matmul and a 16M-param AdamW each alone (after a
// 50 ms pause), then back to back. `ratio` = (alone + alone) / (back to back); < 1 means the
// pools got in each other's way. spin_cpu_ms_*: process CPU time burnt in the 50 ms pause after
// an op, i.e. what the idle threads of its pool spin. adamw_*_cpu_ms: process CPU time while
// AdamW runs; more after a matmul means another pool's threads were spinning on our cores.
void bench_interleave(Bench& b) {
  const int64_t m = 256, k = 768, n = 2304, np = int64_t{1} << 24;
  const std::string shape = dims({m, k, n}) + "+" + std::to_string(np);
  if (!b.selected("interleave_matmul_adamw", shape)) return;
  auto A = random_bits(m * k, DType::f32, 1), B = random_bits(k * n, DType::f32, 2);
  std::vector<float> C(m * n), p(np, 0.5f), g(np, 1e-3f), mm(np, 0.f), vv(np, 0.f);
  kernels::MatmulArgs ma;
  ma.a = A.data(), ma.b = B.data(), ma.c = C.data(), ma.m = m, ma.n = n, ma.k = k;
  kernels::AdamWArgs aa;
  aa.n = np, aa.param = p.data(), aa.grad = g.data(), aa.m = mm.data(), aa.v = vv.data();
  auto mat = [&] { b.ops().matmul(b.stream(), ma); };
  auto adam = [&] { b.ops().adamw(b.stream(), aa); };
  auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  struct PerPool {
    Timing mat, adam, mat_after, adam_after;
    std::vector<double> spin_after_mat, spin_after_adam, cpu_adam, cpu_adam_after;
  } res[2];
  // Process CPU time spent while fn runs (all threads: ours, and any pool spinning meanwhile).
  auto cpu_of = [&](const std::function<void()>& fn, Timing& t, std::vector<double>& cpu) {
    const double c0 = process_cpu_ms();
    b.timed(fn, &t.ms, t);
    cpu.push_back(process_cpu_ms() - c0);
  };
  const kernels::cpu::Pool pools[2] = {kernels::cpu::Pool::openmp, kernels::cpu::Pool::tbb};
  const kernels::cpu::Pool saved = kernels::cpu::pool();
  b.timed(mat, nullptr, res[0].mat);
  for (int r = 0; r < b.reps() * 3; ++r)
    for (int i = 0; i < 2; ++i) {
      kernels::cpu::set_pool(pools[i]);  // the stream is idle here
      PerPool& x = res[i];
      b.timed(adam, nullptr, x.adam);
      pause();
      b.timed(mat, &x.mat.ms, x.mat);
      double c0 = process_cpu_ms();
      pause();
      x.spin_after_mat.push_back(process_cpu_ms() - c0);
      cpu_of(adam, x.adam, x.cpu_adam);
      c0 = process_cpu_ms();
      pause();
      x.spin_after_adam.push_back(process_cpu_ms() - c0);
      b.timed(mat, nullptr, x.mat_after);
      cpu_of(adam, x.adam_after, x.cpu_adam_after);
      b.timed(mat, &x.mat_after.ms, x.mat_after);
    }
  kernels::cpu::set_pool(saved);
  auto r3 = Bench::round3;
  for (int i = 0; i < 2; ++i) {
    const PerPool& x = res[i];
    b.print({{"name", i == 0 ? "interleave_matmul_adamw_openmp_pool" : "interleave_matmul_adamw_tbb_pool"},
             {"shape", shape}, {"threads", kernels::cpu::num_threads()}, {"reps", x.mat.ms.size()},
             {"matmul_alone_ms", r3(x.mat.median())}, {"matmul_after_adamw_ms", r3(x.mat_after.median())},
             {"adamw_alone_ms", r3(x.adam.median())}, {"adamw_after_matmul_ms", r3(x.adam_after.median())},
             {"adamw_alone_ms_min", r3(x.adam.min())}, {"adamw_after_matmul_ms_min", r3(x.adam_after.min())},
             {"adamw_alone_cpu_ms", r3(median(x.cpu_adam))},
             {"adamw_after_matmul_cpu_ms", r3(median(x.cpu_adam_after))},
             {"spin_cpu_ms_after_matmul", r3(median(x.spin_after_mat))},
             {"spin_cpu_ms_after_adamw", r3(median(x.spin_after_adam))},
             {"ms", r3(x.adam_after.median() + x.mat_after.median())},
             {"ratio", r3((x.adam.median() + x.mat.median()) / (x.adam_after.median() + x.mat_after.median()))}});
  }
}

// ---- CUDA ---------------------------------------------------------------------------------------
#ifdef STRATA_HAVE_CUDA

// Dense peaks of known devices (bf16 tensor-core TFLOP/s, fp32 SIMT TFLOP/s, HBM GB/s), for
// `pct_peak`; 0 (not reported) for others unless given on the command line.
struct Peaks {
  double bf16_tflops = 0, fp32_tflops = 0, gbs = 0;
};
Peaks peaks_of(const std::string& name) {
  if (name.find("H200") != std::string::npos) return {989, 67, 4800};
  if (name.find("H100") != std::string::npos) return {989, 67, 3350};  // SXM
  if (name.find("A100") != std::string::npos) return {312, 19.5, 2039};
  return {};
}

// Device buffers with random contents, the stream, and event-timed, paired comparisons.
class CudaBench {
 public:
  explicit CudaBench(const Options& o)
      : opt_(o), rt_(kernels::make_runtime(kernels::Backend::cuda, o.device)), s_(rt_->create_stream()),
        timer_(*s_), peaks_(peaks_of(rt_->info().name)) {
    if (o.peak_bf16_tflops > 0) peaks_.bf16_tflops = o.peak_bf16_tflops;
    if (o.peak_gbs > 0) peaks_.gbs = o.peak_gbs;
  }
  kernels::Ops& ops() { return rt_->ops(); }
  kernels::Stream& stream() { return *s_; }
  kernels::Runtime& rt() { return *rt_; }
  const Peaks& peaks() const { return peaks_; }
  bool selected(const std::string& name, const std::string& shape) const {
    return opt_.filter.empty() || (name + " " + shape).find(opt_.filter) != std::string::npos;
  }
  // n elements of dtype t, uniform in [-1, 1]: at most 16M values generated on the host, tiled.
  kernels::DeviceBuffer random(DType t, int64_t n, uint32_t seed) {
    const int64_t piece = std::min<int64_t>(n, int64_t{1} << 24);
    auto host = random_bits(piece, t, seed);
    const size_t es = kernels::dtype_size(t);
    kernels::DeviceBuffer d(*rt_, static_cast<size_t>(n) * es);
    for (int64_t at = 0; at < n; at += piece)
      s_->memcpy_async(static_cast<char*>(d.data()) + at * es, host.data(), std::min(piece, n - at) * es);
    s_->synchronize();
    return d;
  }
  kernels::DeviceBuffer zeros(size_t bytes) {
    kernels::DeviceBuffer d(*rt_, bytes);
    s_->memset_async(d.data(), 0, bytes);
    return d;
  }

  // Times `ours` (and `ref`, alternating) with CUDA events: two warm-up calls each, then reps.
  // `peak` is the TFLOP/s (flops metric) or GB/s (bytes metric) that pct_peak refers to.
  void compare(const std::string& name, const std::string& shape, const Metric& metric, double peak,
               const std::function<void()>& ours, const std::string& ref_name = {},
               const std::function<void()>& ref = {}) {
    if (!selected(name, shape)) return;
    Timing t_ours, t_ref;
    const bool ours_ok = warm(ours, t_ours), ref_ok = ref && warm(ref, t_ref);
    for (int r = 0; r < opt_.reps; ++r) {
      if (ours_ok) timed(ours, t_ours);
      if (ref_ok) timed(ref, t_ref);
    }
    nlohmann::json line = report(name, shape, metric, peak, t_ours);
    if (ref && ours_ok && ref_ok && t_ours.ms.size() == t_ref.ms.size() && !t_ours.ms.empty()) {
      std::vector<double> paired;
      for (size_t i = 0; i < t_ours.ms.size(); ++i) paired.push_back(t_ref.ms[i] / t_ours.ms[i]);
      std::sort(paired.begin(), paired.end());
      line["ratio"] = Bench::round3(paired[paired.size() / 2]);
      line["ratio_ref"] = ref_name;
    }
    std::printf("%s\n", line.dump().c_str());
    if (ref) std::printf("%s\n", report(ref_name, shape, metric, peak, t_ref).dump().c_str());
    std::fflush(stdout);
  }

 private:
  bool warm(const std::function<void()>& fn, Timing& t) {
    try {
      for (int i = 0; i < 2; ++i) fn();
      s_->synchronize();
      return true;
    } catch (const std::exception& e) {
      t.error = e.what();
      return false;
    }
  }
  void timed(const std::function<void()>& fn, Timing& t) {
    timer_.start();
    fn();
    timer_.stop();
    t.ms.push_back(timer_.ms());
  }
  nlohmann::json report(const std::string& name, const std::string& shape, const Metric& m, double peak,
                        const Timing& t) {
    nlohmann::json j;
    j["name"] = name;
    j["shape"] = shape;
    j["backend"] = "cuda";
    j["device"] = rt_->info().name;
    if (!t.error.empty()) {
      j["error"] = t.error;
      return j;
    }
    const double ms = t.median();
    j["ms"] = Bench::round3(ms);
    j["ms_min"] = Bench::round3(t.min());
    j["reps"] = t.ms.size();
    if (m.flops > 0) {
      const double tflops = m.flops / (ms * 1e9);
      j["tflops"] = Bench::round3(tflops);
      if (peak > 0) j["pct_peak"] = Bench::round3(100.0 * tflops / peak);
    } else if (m.bytes > 0) {
      const double gbs = m.bytes / (ms * 1e6);
      j["gb_per_s"] = Bench::round3(gbs);
      if (peak > 0) j["pct_peak"] = Bench::round3(100.0 * gbs / peak);
    }
    if (m.params > 0) j["params_per_s"] = std::round(m.params / (ms * 1e-3));
    return j;
  }

  Options opt_;
  std::unique_ptr<kernels::Runtime> rt_;
  std::unique_ptr<kernels::Stream> s_;
  kernels::cuda_bench::Timer timer_;
  Peaks peaks_;
};

// The GEMMs of one training step of a ~1B llama (hidden 2048, 16 heads of 128 with 8 kv heads,
// MLP 8192, vocab 128256) at 8192 tokens (4 × 2048), weights stored (out, in) as in HF:
// forward y = x·Wᵀ, backward dX = dY·W and dW += dYᵀ·X (fp32 accumulation, beta 1).
void cuda_bench_matmul(CudaBench& b) {
  struct G {
    const char* name;
    int64_t m, n, k;
    bool ta, tb;
    DType ab, c;
    float beta;
  };
  const int64_t BT = 8192, C = 2048, F = 8192, V = 128256;
  const G cases[] = {
      {"qkv", BT, C + 2 * 1024, C, false, true, DType::bf16, DType::bf16, 0.f},
      {"attn_out", BT, C, C, false, true, DType::bf16, DType::bf16, 0.f},
      {"mlp_gate_up", BT, 2 * F, C, false, true, DType::bf16, DType::bf16, 0.f},
      {"mlp_down", BT, C, F, false, true, DType::bf16, DType::bf16, 0.f},
      {"mlp_down_dx", BT, F, C, false, false, DType::bf16, DType::bf16, 0.f},
      {"mlp_down_dw", C, F, BT, true, false, DType::bf16, DType::f32, 1.f},
      {"lm_head_chunk", 2048, V, C, false, true, DType::bf16, DType::bf16, 0.f},
      {"mlp_down_fp32", BT, C, F, false, true, DType::f32, DType::f32, 0.f},
  };
  for (const G& g : cases) {
    const std::string suffix = g.ab == DType::f32 ? "_fp32" : "_bf16";
    const std::string name = std::string("matmul_") + g.name + (g.ab == DType::f32 ? "" : suffix);
    std::string shape = dims({g.m, g.n, g.k});
    if (g.ta) shape += " ta";
    if (g.tb) shape += " tb";
    if (!b.selected(name, shape)) continue;
    auto A = b.random(g.ab, g.m * g.k, 1), B = b.random(g.ab, g.k * g.n, 2);
    auto Cm = b.zeros(static_cast<size_t>(g.m * g.n) * kernels::dtype_size(g.c));
    kernels::MatmulArgs a;
    a.a = A.data(), a.b = B.data(), a.c = Cm.data(), a.ab_dtype = g.ab, a.c_dtype = g.c, a.m = g.m, a.n = g.n,
    a.k = g.k, a.trans_a = g.ta, a.trans_b = g.tb, a.beta = g.beta;
    kernels::cuda_bench::BareGemm bare(b.rt(), a);
    const double peak = g.ab == DType::f32 ? b.peaks().fp32_tflops : b.peaks().bf16_tflops;
    b.compare(name, shape, {.flops = 2.0 * g.m * g.n * g.k}, peak, [&] { b.ops().matmul(b.stream(), a); },
              "cublaslt_bare" + suffix, [&] { bare.run(b.stream(), A.data(), B.data(), Cm.data()); });
  }
}

// Causal attention at T = 2048, head_dim 128, bf16 (16 query heads, 8 kv heads). Model FLOPs:
// forward 2·B·Hq·T²·D (QKᵀ and PV, halved by the mask), backward 2.5× that.
void cuda_bench_attention(CudaBench& b) {
  const int64_t B = 4, T = 2048, Hq = 16, Hkv = 8, D = 128;
  const std::string shape = dims({B, T, Hq, Hkv, D});
  if (!b.selected("attention", shape)) return;
  const DType t = DType::bf16;
  auto q = b.random(t, B * T * Hq * D, 1), k = b.random(t, B * T * Hkv * D, 2), v = b.random(t, B * T * Hkv * D, 3);
  auto dout = b.random(t, B * T * Hq * D, 4);
  auto out = b.zeros(B * T * Hq * D * 2), lse = b.zeros(B * Hq * T * 4), dq = b.zeros(B * T * Hq * D * 2),
       dk = b.zeros(B * T * Hkv * D * 2), dv = b.zeros(B * T * Hkv * D * 2);
  kernels::AttentionArgs a;
  a.dtype = t, a.batch = B, a.seq = T, a.n_heads = Hq, a.n_kv_heads = Hkv, a.head_dim = D;
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out.data(), a.lse = lse.as<float>();
  kernels::AttentionBackwardArgs g;
  g.dtype = t, g.batch = B, g.seq = T, g.n_heads = Hq, g.n_kv_heads = Hkv, g.head_dim = D;
  g.q = q.data(), g.k = k.data(), g.v = v.data(), g.out = out.data(), g.dout = dout.data(), g.lse = lse.as<float>();
  g.dq = dq.data(), g.dk = dk.data(), g.dv = dv.data();
  const double fwd = 2.0 * B * Hq * T * T * D, peak = b.peaks().bf16_tflops;
  b.compare("attention_fwd_bf16", shape, {.flops = fwd}, peak, [&] { b.ops().attention(b.stream(), a); });
  b.compare("attention_bwd_bf16", shape, {.flops = 2.5 * fwd}, peak, [&] { b.ops().attention_backward(b.stream(), g); });
  b.compare("attention_fwd_bwd_bf16", shape, {.flops = 3.5 * fwd}, peak, [&] {
    b.ops().attention(b.stream(), a);
    b.ops().attention_backward(b.stream(), g);
  });
}

// Memory-bound ops at the same model (8192 tokens × 2048, bf16 activations); bytes are what
// each op must move at least (read once, write once).
void cuda_bench_memory_ops(CudaBench& b) {
  const int64_t BT = 8192, C = 2048, F = 8192, V = 128256, rows_ce = 1024, np = 100'000'000;
  const DType t = DType::bf16;
  const double peak = b.peaks().gbs;
  {
    auto x = b.random(t, BT * C, 1), w = b.random(t, C, 2), dy = b.random(t, BT * C, 3);
    auto y = b.zeros(BT * C * 2), dx = b.zeros(BT * C * 2), rstd = b.zeros(BT * 4), dw = b.zeros(C * 4);
    kernels::NormArgs n{t, BT, C, 1e-5f, x.data(), w.data(), nullptr, y.data(), nullptr, rstd.as<float>()};
    b.compare("rmsnorm_bf16", dims({BT, C}), {.bytes = 4.0 * BT * C}, peak, [&] { b.ops().rmsnorm(b.stream(), n); });
    kernels::NormBackwardArgs nb{t, BT, C, x.data(), w.data(), dy.data(), nullptr, rstd.as<float>(), dx.data(),
                                 dw.as<float>(), nullptr, true};
    b.compare("rmsnorm_backward_bf16", dims({BT, C}), {.bytes = 8.0 * BT * C}, peak,
              [&] { b.ops().rmsnorm_backward(b.stream(), nb); });
    kernels::AddArgs ad{t, BT * C, x.data(), dy.data(), y.data()};
    b.compare("add_bf16", dims({BT, C}), {.bytes = 6.0 * BT * C}, peak, [&] { b.ops().add(b.stream(), ad); });
  }
  {
    auto gu = b.random(t, BT * 2 * F, 4), dout = b.random(t, BT * F, 5), out = b.zeros(BT * F * 2);
    auto dgu = b.zeros(BT * 2 * F * 2);
    auto* g0 = static_cast<char*>(gu.data());
    auto* d0 = static_cast<char*>(dgu.data());
    kernels::SwigluArgs sw{t, BT, F, 2 * F, g0, g0 + F * 2, out.data()};
    b.compare("swiglu_bf16", dims({BT, F}), {.bytes = 6.0 * BT * F}, peak, [&] { b.ops().swiglu(b.stream(), sw); });
    kernels::SwigluBackwardArgs sb{t, BT, F, 2 * F, g0, g0 + F * 2, dout.data(), d0, d0 + F * 2};
    b.compare("swiglu_backward_bf16", dims({BT, F}), {.bytes = 10.0 * BT * F}, peak,
              [&] { b.ops().swiglu_backward(b.stream(), sb); });
  }
  {
    auto logits = b.random(t, rows_ce * V, 6);
    std::vector<int32_t> host(rows_ce);
    for (int64_t r = 0; r < rows_ce; ++r) host[r] = static_cast<int32_t>((r * 7919) % V);
    auto targets = b.zeros(rows_ce * 4), losses = b.zeros(rows_ce * 4);
    b.stream().memcpy_async(targets.data(), host.data(), rows_ce * 4);
    kernels::CrossEntropyArgs ce;
    ce.dtype = t, ce.rows = rows_ce, ce.vocab = V, ce.logits = logits.data(), ce.targets = targets.as<int32_t>(),
    ce.losses = losses.as<float>(), ce.dlogits = logits.data(), ce.grad_scale = 1.f / rows_ce;
    b.compare("cross_entropy_bf16", dims({rows_ce, V}), {.bytes = 4.0 * rows_ce * V}, peak,
              [&] { b.ops().cross_entropy(b.stream(), ce); });
  }
  {
    auto p = b.random(DType::f32, np, 7), g = b.random(t, np, 8), m = b.zeros(np * 4), v = b.zeros(np * 4);
    auto copy = b.zeros(np * 2);
    kernels::AdamWArgs a;
    a.n = np, a.param = p.as<float>(), a.grad = g.data(), a.grad_dtype = t, a.m = m.as<float>(), a.v = v.as<float>(),
    a.param_copy = copy.data(), a.copy_dtype = t, a.weight_decay = 0.1f;
    int64_t step = 0;
    b.compare("adamw_bf16grad_bf16copy", std::to_string(np), {.bytes = 28.0 * np, .params = double(np)}, peak, [&] {
      a.step = ++step;
      b.ops().adamw(b.stream(), a);
    });
    auto out = b.zeros(sizeof(double));
    b.compare("sum_squares_fp32", std::to_string(np), {.bytes = 4.0 * np}, peak,
              [&] { b.ops().sum_squares(b.stream(), {DType::f32, np, p.data(), out.as<double>()}); });
    b.compare("cast_fp32_bf16", std::to_string(np), {.bytes = 6.0 * np}, peak,
              [&] { b.ops().cast(b.stream(), {np, p.data(), DType::f32, copy.data(), t}); });
  }
  {
    std::vector<int32_t> host(BT);
    for (int64_t i = 0; i < BT; ++i) host[i] = static_cast<int32_t>((i * 7919) % V);
    auto ids = b.zeros(BT * 4), dout = b.random(t, BT * C, 9), dtable = b.zeros(static_cast<size_t>(V) * C * 4);
    b.stream().memcpy_async(ids.data(), host.data(), BT * 4);
    kernels::EmbeddingBackwardArgs e{t, BT, C, V, ids.as<int32_t>(), dout.data(), dtable.as<float>()};
    b.compare("embedding_backward_bf16", dims({BT, C}), {.bytes = 10.0 * BT * C}, peak,
              [&] { b.ops().embedding_backward(b.stream(), e); });
  }
}

int run_cuda(const Options& o) {
  if (!kernels::cuda_available())
    throw std::runtime_error("bench ops --backend cuda: no CUDA device is visible");
  CudaBench b(o);
  cuda_bench_matmul(b);
  cuda_bench_attention(b);
  cuda_bench_memory_ops(b);
  return 0;
}
#else
int run_cuda(const Options&) {
  throw std::runtime_error("bench ops --backend cuda: this strata was built without CUDA");
}
#endif

}  // namespace

void register_bench_ops(CLI::App& bench, Run& run) {
  CLI::App* cmd = bench.add_subcommand(
      "ops", "Time the op set (JSON lines): CPU at GPT-2-124M shapes, CUDA at ~1B llama shapes");
  auto opt = std::make_shared<Options>();
  cmd->add_option("--backend", opt->backend, "cpu | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--device", opt->device, "CUDA device index");
  cmd->add_option("--peak-bf16-tflops", opt->peak_bf16_tflops,
                  "CUDA: dense bf16 peak for pct_peak (default: known for H200/H100/A100)");
  cmd->add_option("--peak-gbs", opt->peak_gbs, "CUDA: memory bandwidth peak for pct_peak (GB/s)");
  cmd->add_option("--threads", opt->threads, "Compute threads (0 = all available cores)");
  cmd->add_option("--filter", opt->filter, "Only cases whose \"name shape\" contains this text");
  cmd->add_option("--reps", opt->reps, "Timed repetitions per case (medians are reported)");
  cmd->add_option("--adamw-params", opt->adamw_params, "Parameters in the AdamW cases");
  cmd->callback([&run, opt] {
    run = [opt]() -> int {
      check_options(*opt);
      if (opt->backend == "cuda") return run_cuda(*opt);
      Bench b(*opt);
      bench_matmul(b);
      bench_adamw(b);
      bench_memory_ops(b);
      bench_model_ops(b);
      bench_interleave(b);
      return 0;
    };
  });
}

}  // namespace strata::app
