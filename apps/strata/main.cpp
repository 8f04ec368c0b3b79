// strata: the command line. Parses with CLI11, dispatches to one subcommand, and turns any
// error into one clear line on stderr and a non-zero exit status.
#include <cstdio>
#include <exception>

#include "apps/strata/commands.h"
#include "src/comm/communicator.h"

int main(int argc, char** argv) {
  CLI::App app{"strata: train and fine-tune transformers across GPU memory, pinned host RAM and NVMe"};
  app.require_subcommand(1);
  strata::app::Run run;

  CLI::App* bench = app.add_subcommand("bench", "Measure kernels, I/O, offload and training steps (JSON lines)");
  bench->require_subcommand(1);
  strata::app::register_bench_ops(*bench, run);
  strata::app::register_bench_io(*bench, run);
  strata::app::register_bench_offload(*bench, run);
  strata::app::register_bench_step(*bench, run);
  strata::app::register_train(app, run);
  strata::app::register_plan(app, run);
  strata::app::register_inspect(app, run);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run ? run() : 0;
  } catch (const std::exception& e) {
    // One line naming the error; in an mpirun job, also which rank, and the job is taken down
    // (the other ranks may be waiting for this one in a collective).
    return strata::report_fatal_error(e.what());
  }
}
