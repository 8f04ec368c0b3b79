// `strata bench ops`: one JSON line per op case (name, shape, ms, gflops or gb_per_s).
#include "apps/strata/commands.h"

#include <stdexcept>

namespace strata::app {

void register_bench_ops(CLI::App& bench, Run& run) {
  CLI::App* cmd = bench.add_subcommand("ops", "Time the CPU/CUDA op set at GPT-2-124M shapes");
  cmd->callback([&run] {
    run = [] () -> int { throw std::runtime_error("bench ops: not implemented yet"); };
  });
}

}  // namespace strata::app
