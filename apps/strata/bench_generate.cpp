// `strata bench generate`: prefill tokens/s and GFLOP/s, decode tokens/s at batch 1 and at a
// batch, the weights' bytes and a measured memory read bandwidth (a multi-threaded streaming
// sum, STREAM-style), so decode can be stated as a fraction of bandwidth ÷ weight bytes (the
// ceiling of matrix-vector decode). One JSON line.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/strata/commands.h"
#include "kernels/cpu/parallel.h"
#include "kernels/dtype.h"
#include "offload/size.h"
#include "src/checkpoint/hf.h"
#include "src/infer/generator.h"
#include "src/infer/sampler.h"
#include "src/train/perf_model.h"

namespace strata::app {

namespace {
using kernels::DType;

struct BenchGenerateOptions {
  std::string model, preset = "llama-350m";
  std::string backend = "cpu", dtype = "bf16";
  int threads = 0;
  int64_t prompt_tokens = 128, new_tokens = 16, batch = 4;
  std::string offload_params = "none", device_mem, host_mem;
  std::vector<std::string> nvme_paths;
  int64_t bandwidth_mib = 1024;
};

using clock = std::chrono::steady_clock;
double ms_since(clock::time_point t0) { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); }

// GB/s of a multi-threaded read of `bytes` (sum of 64-bit words), best of 5.
double read_bandwidth(uint64_t bytes) {
  const auto n = static_cast<int64_t>(bytes / 8);
  std::vector<uint64_t> buf(static_cast<size_t>(n));
  kernels::cpu::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) buf[static_cast<size_t>(i)] = static_cast<uint64_t>(i);
  });
  std::vector<uint64_t> sums(256, 0);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = clock::now();
    kernels::cpu::parallel_for(0, n, 1 << 18, [&](int64_t lo, int64_t hi) {
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      int64_t i = lo;
      for (; i + 4 <= hi; i += 4)
        s0 += buf[static_cast<size_t>(i)], s1 += buf[static_cast<size_t>(i + 1)], s2 += buf[static_cast<size_t>(i + 2)],
            s3 += buf[static_cast<size_t>(i + 3)];
      for (; i < hi; ++i) s0 += buf[static_cast<size_t>(i)];
      sums[static_cast<size_t>(kernels::cpu::thread_index() % 256)] += s0 + s1 + s2 + s3;
    });
    best = std::min(best, ms_since(t0));
  }
  uint64_t all = 0;
  for (uint64_t s : sums) all += s;
  if (all == 1) std::printf(" ");  // keeps the reads
  return static_cast<double>(bytes) / (best / 1e3) / 1e9;
}

// GB/s of weight bytes read by the decode's matrix-vector products: y (1, n) = x (1, k) · Wᵀ for
// (n, k) weights in dtype dt, cycling through enough weight matrices (> 256 MiB) that none stays
// in cache, as a decode step sees them. Median of 5 passes.
double matvec_bandwidth(kernels::Runtime& rt, kernels::Stream& s, DType dt, int64_t k, int64_t n) {
  const size_t w_bytes = static_cast<size_t>(k * n) * kernels::dtype_size(dt);
  const int64_t count = std::max<int64_t>(2, static_cast<int64_t>((256u << 20) / w_bytes) + 1);
  kernels::DeviceBuffer w(rt, w_bytes * static_cast<size_t>(count)), x(rt, static_cast<size_t>(k) * 4),
      y(rt, static_cast<size_t>(n) * 4);
  s.memset_async(w.data(), 0, w.bytes());
  s.memset_async(x.data(), 0, x.bytes());
  std::vector<double> each;
  for (int rep = 0; rep < 6; ++rep) {
    s.synchronize();
    const auto t0 = clock::now();
    for (int64_t i = 0; i < count; ++i) {
      kernels::MatmulArgs m;
      m.a = x.data();
      m.b = static_cast<const char*>(w.data()) + static_cast<size_t>(i) * w_bytes;
      m.c = y.data();
      m.ab_dtype = dt;
      m.c_dtype = dt;
      m.m = 1, m.n = n, m.k = k;
      m.trans_b = true;
      rt.ops().matmul(s, m);
    }
    s.synchronize();
    if (rep > 0) each.push_back(ms_since(t0));
  }
  return static_cast<double>(w_bytes * static_cast<size_t>(count)) / (median(each) / 1e3) / 1e9;
}

// Median ms per decode step over `steps` greedy steps after a prefill of `prompts`.
double decode_ms(Generator& gen, const std::vector<std::vector<int32_t>>& prompts, int64_t steps) {
  const int64_t V = gen.config().vocab_size;
  const std::vector<float>* logits = &gen.prefill(prompts);
  std::vector<double> each;
  std::vector<int32_t> next(prompts.size());
  for (int64_t s = 0; s < steps; ++s) {
    for (size_t i = 0; i < prompts.size(); ++i)
      next[i] = argmax(std::span<const float>(logits->data() + static_cast<int64_t>(i) * V, static_cast<size_t>(V)));
    const auto t0 = clock::now();
    logits = &gen.step(next);
    each.push_back(ms_since(t0));
  }
  return median(each);
}

}  // namespace

void register_bench_generate(CLI::App& bench, Run& run) {
  auto opts = std::make_shared<BenchGenerateOptions>();
  BenchGenerateOptions& o = *opts;
  CLI::App* cmd = bench.add_subcommand("generate", "Prefill and decode throughput against memory bandwidth");
  cmd->option_defaults()->always_capture_default();
  auto* model = cmd->add_option("--model", o.model, "HF model directory (else --preset, random weights)");
  cmd->add_option("--preset", o.preset, "named config: default | gpt2-124m | llama-350m | llama-1b | ...")
      ->excludes(model);
  cmd->add_option("--backend", o.backend, "cpu | cuda");
  cmd->add_option("--dtype", o.dtype, "working weights: fp32 | bf16");
  cmd->add_option("--threads", o.threads, "CPU compute threads (0 = all available cores)");
  cmd->add_option("--prompt-tokens", o.prompt_tokens, "prefill length");
  cmd->add_option("--new-tokens", o.new_tokens, "timed decode steps");
  cmd->add_option("--batch", o.batch, "the batched decode's batch size");
  cmd->add_option("--offload-params", o.offload_params, "none | cpu | nvme");
  cmd->add_option("--nvme-path", o.nvme_paths, "directory for the NVMe swap file");
  cmd->add_option("--device-mem", o.device_mem, "device memory budget");
  cmd->add_option("--host-mem", o.host_mem, "pinned host memory budget");
  cmd->add_option("--bandwidth-mib", o.bandwidth_mib, "buffer the read-bandwidth probe streams through");
  cmd->callback([&run, opts] {
    run = [opts]() -> int {
      const BenchGenerateOptions& b = *opts;
      if (b.prompt_tokens < 1 || b.new_tokens < 1 || b.batch < 1)
        throw std::invalid_argument("bench generate: --prompt-tokens, --new-tokens and --batch must be >= 1");
      if (b.threads > 0) kernels::cpu::set_num_threads(b.threads);
      const ModelConfig cfg = b.model.empty() ? preset_model_config(b.preset) : read_hf_config(b.model + "/config.json");
      auto rt = kernels::make_runtime(kernels::parse_backend(b.backend));
      auto stream = rt->create_stream();
      const WeightPlacement pl = weight_placement(b.offload_params, b.nvme_paths, b.device_mem, b.host_mem);
      const GenerateShape shape{b.batch, b.prompt_tokens, b.prompt_tokens + b.new_tokens + 1};
      Generator gen(cfg, kernels::parse_dtype(b.dtype), *rt, *stream, pl, shape);
      if (b.model.empty())
        gen.init_random(1234);
      else
        gen.load(*HfCheckpoint::open(b.model));
      std::vector<int32_t> prompt(static_cast<size_t>(b.prompt_tokens));
      for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % cfg.vocab_size);

      gen.prefill({prompt});  // warm-up
      std::vector<double> pre;
      for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = clock::now();
        gen.prefill({prompt});
        pre.push_back(ms_since(t0));
      }
      const double prefill_ms = median(pre);
      const double stall0 = gen.stall_ms();
      const double dec1 = decode_ms(gen, {prompt}, b.new_tokens);
      const double stall_per_step = (gen.stall_ms() - stall0) / static_cast<double>(b.new_tokens);
      const double decb = decode_ms(gen, std::vector<std::vector<int32_t>>(static_cast<size_t>(b.batch), prompt),
                                    b.new_tokens);
      const double bw = read_bandwidth(static_cast<uint64_t>(b.bandwidth_mib) << 20);
      const int64_t I = cfg.intermediate_size > 0 ? cfg.intermediate_size : 4 * cfg.hidden_size;
      const double mv = matvec_bandwidth(*rt, *stream, kernels::parse_dtype(b.dtype), cfg.hidden_size, 2 * I);
      // The training forward's FLOP count of the prompt (a third of a step's), as bench step counts.
      const Transformer counted(cfg, kernels::parse_dtype(b.dtype), 1, 1, *rt);
      const double flops = step_flops(cfg, counted.n_params(), 1, b.prompt_tokens) / 3.0;
      const double wbytes = static_cast<double>(gen.weight_bytes());
      const double ceiling = bw * 1e9 / wbytes;  // tokens/s if each step read the weights once at bw
      nlohmann::json j;
      j["bench"] = "generate";
      j["model"] = b.model.empty() ? b.preset : b.model;
      j["params"] = counted.n_params();
      j["backend"] = b.backend;
      j["dtype"] = b.dtype;
      j["threads"] = kernels::cpu::num_threads();
      j["offload_params"] = b.offload_params;
      j["weight_bytes"] = gen.weight_bytes();
      j["prompt_tokens"] = b.prompt_tokens;
      j["prefill_ms"] = prefill_ms;
      j["prefill_tokens_per_s"] = static_cast<double>(b.prompt_tokens) / (prefill_ms / 1e3);
      j["prefill_gflops"] = flops / 1e9 / (prefill_ms / 1e3);
      j["decode_ms_per_step_b1"] = dec1;
      j["decode_tokens_per_s_b1"] = 1e3 / dec1;
      j["decode_stall_ms_per_step_b1"] = stall_per_step;
      j["batch"] = b.batch;
      j["decode_ms_per_step_batch"] = decb;
      j["decode_tokens_per_s_batch"] = 1e3 * static_cast<double>(b.batch) / decb;
      j["read_bandwidth_gbs"] = bw;
      j["bandwidth_ceiling_tokens_per_s"] = ceiling;
      j["decode_b1_vs_ceiling"] = (1e3 / dec1) / ceiling;
      j["matvec_shape"] = "1x" + std::to_string(cfg.hidden_size) + "x" + std::to_string(2 * I);
      j["matvec_weight_gbs"] = mv;  // the fc projection's matmul at m = 1, weights streamed from RAM
      std::printf("%s\n", j.dump().c_str());
      return 0;
    };
  });
}

}  // namespace strata::app
