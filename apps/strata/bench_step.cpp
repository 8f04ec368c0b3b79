// `strata bench step`: a few warm-up and timed training steps (forward, backward, AdamW) of a
// model on fixed random tokens, printed as one JSON line with tokens/s, ms/step and achieved
// GFLOP/s (6·N·tokens + attention), next to a bare fp32 GEMM measured in the same run.
#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/strata/commands.h"
#include "src/train/perf_model.h"
#include "src/train/trainer.h"

namespace strata::app {

namespace {

struct BenchStepOptions {
  std::string model;
  std::string preset = "gpt2-124m";
  int64_t batch = 4, seq = 64;
  std::string backend = "cpu", dtype = "fp32";
  int threads = 0;
  int warmup = 2, steps = 5;
};

constexpr int kMaxSteps = 1'000'000;  // --warmup and --steps each

}  // namespace

void register_bench_step(CLI::App& bench, Run& run) {
  auto opts = std::make_shared<BenchStepOptions>();
  BenchStepOptions& o = *opts;
  CLI::App* cmd = bench.add_subcommand("step", "Time full training steps (forward+backward+AdamW) of a model");
  cmd->option_defaults()->always_capture_default();
  auto* model = cmd->add_option("--model", o.model, "HF model directory (config.json; weights optional)");
  cmd->add_option("--preset", o.preset, "named config when --model is not given: gpt2-124m | default")
      ->excludes(model);
  cmd->add_option("--batch", o.batch, "sequences per step (B)");
  cmd->add_option("--seq", o.seq, "tokens per sequence (T)");
  cmd->add_option("--backend", o.backend, "cpu | cuda");
  cmd->add_option("--dtype", o.dtype, "fp32 | bf16 | fp16");
  cmd->add_option("--threads", o.threads, "CPU compute threads (0 = all available cores)");
  cmd->add_option("--warmup", o.warmup, "untimed steps first");
  cmd->add_option("--steps", o.steps, "timed steps");
  cmd->callback([&run, opts] {
    run = [opts]() -> int {
      const BenchStepOptions& b = *opts;
      // Its own flags checked here, each error naming its flag: the trainer sees only their sum
      // (a negative --warmup would be reported as a bad --steps).
      if (b.warmup < 0 || b.warmup > kMaxSteps)
        throw std::invalid_argument("bench step --warmup " + std::to_string(b.warmup) + ": give 0 to " +
                                    std::to_string(kMaxSteps) + " untimed steps");
      if (b.steps < 1 || b.steps > kMaxSteps)
        throw std::invalid_argument("bench step --steps " + std::to_string(b.steps) + ": give 1 to " +
                                    std::to_string(kMaxSteps) + " timed steps");
      TrainOptions t;
      t.model = b.model;
      t.preset = b.model.empty() ? b.preset : "";
      t.synthetic_data = true;
      t.backend = b.backend;
      t.dtype = b.dtype;
      t.batch = b.batch;
      t.seq = b.seq;
      t.threads = b.threads;
      t.steps = b.warmup + b.steps;
      t.warmup = 0;
      t.lr = 1e-4;
      t.lr_schedule = "constant";
      Trainer trainer(t);
      for (int i = 0; i < b.warmup; ++i) trainer.step();
      std::vector<double> each;
      double last_loss = 0;
      for (int i = 0; i < b.steps; ++i) {
        const StepStats st = trainer.step();
        each.push_back(st.step_ms);
        last_loss = st.loss;
      }
      double ms = 0;
      for (double x : each) ms += x;
      ms /= b.steps;
      const double flops = step_flops(trainer.config(), trainer.n_params(), b.batch, b.seq);
      const double gemm = trainer.matmul_gflops_probe(256, 3072, 768, 20);
      nlohmann::json j;
      j["bench"] = "step";
      j["model"] = b.model.empty() ? b.preset : b.model;
      j["params"] = trainer.n_params();
      j["backend"] = b.backend;
      j["dtype"] = b.dtype;
      j["batch"] = b.batch;
      j["seq"] = b.seq;
      j["threads"] = b.threads;
      j["steps"] = b.steps;
      j["ms_per_step"] = ms;
      // Median and minimum too: on a shared 2-core VM one slow step moves the mean.
      j["ms_per_step_median"] = median(each);
      j["ms_per_step_min"] = *std::min_element(each.begin(), each.end());
      j["tokens_per_s"] = static_cast<double>(b.batch * b.seq) / (ms / 1e3);
      j["gflop_per_step"] = flops / 1e9;
      j["gflops"] = flops / 1e9 / (ms / 1e3);
      j["gemm_f32_256x3072x768_gflops"] = gemm;
      j["gflops_vs_gemm"] = flops / 1e9 / (ms / 1e3) / gemm;
      j["loss"] = last_loss;
      j["device_bytes"] = trainer.device_bytes();
      std::printf("%s\n", j.dump().c_str());
      return 0;
    };
  });
}

}  // namespace strata::app
