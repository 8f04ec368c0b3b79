// Each subcommand registers its options on the CLI11 app and returns the function that runs it.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace strata::app {

using Run = std::function<int()>;

// `strata bench <what>`: one registration per benchmark family.
void register_bench_ops(CLI::App& bench, Run& run);
void register_bench_io(CLI::App& bench, Run& run);
void register_bench_offload(CLI::App& bench, Run& run);
void register_bench_step(CLI::App& bench, Run& run);

// `strata train`.
void register_train(CLI::App& app, Run& run);

}  // namespace strata::app
