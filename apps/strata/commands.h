// Each subcommand registers its options on the CLI11 app and returns the function that runs it.
#pragma once
#include <CLI/CLI.hpp>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace strata {
struct TrainOptions;
struct WeightPlacement;
}

namespace strata::app {
using strata::TrainOptions;
using strata::WeightPlacement;

using Run = std::function<int()>;

// `strata bench <what>`: one registration per benchmark family.
void register_bench_ops(CLI::App& bench, Run& run);
void register_bench_io(CLI::App& bench, Run& run);
void register_bench_offload(CLI::App& bench, Run& run);
void register_bench_step(CLI::App& bench, Run& run);
void register_bench_tokenizer(CLI::App& bench, Run& run);
void register_bench_generate(CLI::App& bench, Run& run);

// Median of timings (mean of the middle two for an even count; 0 for none).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// `strata train`, and its flags (shared with `strata plan`).
void add_train_flags(CLI::App* cmd, TrainOptions& o);
void register_train(CLI::App& app, Run& run);
// --offload auto: every placement flag (--offload-*, --checkpoint-activations) not given on the
// command line becomes "auto", for the planner to choose. Explicit flags win, flag by flag.
void apply_offload_auto(const CLI::App& cmd, TrainOptions& o);
// `strata train` with an "auto" placement flag: the plan's search (plan.cpp) run on o, its pick
// applied to o; returns the header's line naming the pick and the runner-up.
std::string resolve_offload_auto(TrainOptions& o);
// `strata train --optimizer-on-device auto`: the fraction the plan predicts fastest within the
// device budget (0 on the CPU backend or with --offload-optimizer none) applied to o; returns
// the header's line naming it.
std::string resolve_optimizer_on_device(TrainOptions& o);
// `strata plan`: what a train command would hold and move, and its predicted step time.
void register_plan(CLI::App& app, Run& run);
// `strata inspect PATH`: a model directory, training checkpoint or .safetensors file summarised.
void register_inspect(CLI::App& app, Run& run);
// `strata data`: text/conversations -> token shards with loss masks; `strata tokenize`: check a tokenizer.
void register_data(CLI::App& app, Run& run);
void register_tokenize(CLI::App& app, Run& run);
// `strata generate`: sampling with a KV cache (src/infer/).
void register_generate(CLI::App& app, Run& run);
// The weights' placement from generate's flags (--offload-params, --nvme-path, --device-mem, --host-mem).
WeightPlacement weight_placement(const std::string& offload_params, const std::vector<std::string>& nvme_paths,
                                 const std::string& device_mem, const std::string& host_mem);

}  // namespace strata::app
