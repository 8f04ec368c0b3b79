// `strata train`: every option of the table (src/train/options.h) as a flag (CLI11 shows each
// default in --help), then the Trainer runs and prints a header, a progress line per step and a
// summary.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <type_traits>
#include <variant>

#include <fmt/format.h>

#include "apps/strata/commands.h"
#include "src/comm/communicator.h"
#include "src/train/auto_placement.h"
#include "src/train/stop_signal.h"
#include "src/train/trainer.h"

namespace strata::app {

void add_train_flags(CLI::App* cmd, TrainOptions& o) {
  cmd->option_defaults()->always_capture_default();
  for (const OptionSpec& spec : option_table()) {
    if (!(spec.uses & OptionSpec::cli)) continue;
    std::visit(
        [&](auto field) {
          if constexpr (std::is_same_v<std::decay_t<decltype(o.*field)>, bool>)
            cmd->add_flag(spec.flag, o.*field, spec.help);
          else
            cmd->add_option(spec.flag, o.*field, spec.help);
        },
        spec.field);
  }
  cmd->get_option("--preset")->excludes(cmd->get_option("--model"));
  cmd->get_option("--seed")->check([](const std::string& v) -> std::string {
    // CLI11 would wrap -1 and saturate 2^64 to 2^64-1: two different seeds would train the same.
    errno = 0;
    if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos ||
        (std::strtoull(v.c_str(), nullptr, 10), errno == ERANGE))
      return v + " is not a whole number from 0 to 18446744073709551615 (2^64-1)";
    return "";
  });
}

void apply_offload_auto(const CLI::App& cmd, TrainOptions& o) {
  if (o.offload != "auto") return;
  const std::pair<const char*, std::string*> flags[] = {{"--offload-params", &o.offload_params},
                                                        {"--offload-grads", &o.offload_grads},
                                                        {"--offload-optimizer", &o.offload_optimizer},
                                                        {"--offload-activations", &o.offload_activations},
                                                        {"--checkpoint-activations", &o.checkpoint_activations}};
  for (const auto& [flag, field] : flags)
    if (cmd.count(flag) == 0) *field = "auto";
}

void register_train(CLI::App& app, Run& run) {
  auto opts = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train or fine-tune a llama/gpt2-family model on token shards");
  add_train_flags(cmd, *opts);
  cmd->callback([&run, opts, cmd] {
    // --epochs alone sets the run's length; with --steps too, whichever ends first.
    if (cmd->count("--epochs") > 0 && cmd->count("--steps") == 0) opts->steps = 0;
    // A --warmup longer than the run is allowed (the schedule is well defined) but is almost
    // always a mistake: warned when given explicitly (the default of 5 is not worth a warning).
    const bool warn_warmup = cmd->count("--warmup") > 0 && opts->steps > 0 && opts->warmup > opts->steps;
    // A cosine floor above the peak climbs the rate: an error when given, a warning for the default.
    const bool min_lr_given = cmd->count("--min-lr") > 0;
    const bool min_lr_above = opts->lr_schedule == "cosine" && opts->min_lr > opts->lr;
    if (min_lr_above && min_lr_given)
      throw CLI::ValidationError(fmt::format("--min-lr {:g} is above --lr {:g}: the cosine schedule would "
                                                         "raise the rate over the run; give --min-lr at most --lr",
                                                         opts->min_lr, opts->lr));
    apply_offload_auto(*cmd, *opts);
    if (cmd->count("--keep") > 0 && opts->checkpoint_dir.empty())
      throw CLI::ValidationError("--keep counts checkpoints under --checkpoint-dir; give --checkpoint-dir DIR "
                                           "too");
    run = [opts, warn_warmup, min_lr_above]() -> int {
      if (min_lr_above)
        std::fprintf(stderr,
                     "strata: warning: the default --min-lr %g is above --lr %g: the cosine schedule climbs from %g "
                     "to %g; pass --min-lr (e.g. %g)\n",
                     opts->min_lr, opts->lr, opts->lr, opts->min_lr, opts->lr / 10);
      if (warn_warmup)
        std::fprintf(stderr,
                     "strata: warning: --warmup %lld is longer than --steps %lld: the learning rate never reaches "
                     "--lr %g\n",
                     static_cast<long long>(opts->warmup), static_cast<long long>(opts->steps), opts->lr);
      install_stop_handlers();  // Ctrl-C / SIGTERM: stop after the current step, swap files removed
      std::unique_ptr<Trainer> trainer;
      try {
        if (wants_auto_placement(*opts)) {
          // Each rank would probe and search on its own, and could pick differently.
          if (const Launch launch = detect_launch(); launch.world > 1)
            throw std::invalid_argument(fmt::format(
                "--offload auto in a job of {} ranks: each rank would pick on its own probe; run `strata plan "
                "--offload auto --world {}` with the same flags and pass the placement it picks by hand",
                launch.world, launch.world));
          fmt::print("{}\n", resolve_offload_auto(*opts));
        }
        if (opts->optimizer_on_device == "auto") {
          // (The same refusal: a probe per rank could pick different splits.)
          if (const Launch launch = detect_launch();
              launch.world > 1 && opts->offload_optimizer != "none" && opts->backend != "cpu")
            throw std::invalid_argument(fmt::format(
                "--optimizer-on-device auto in a job of {} ranks: each rank would pick on its own probe; run `strata "
                "plan --optimizer-on-device auto --world {}` with the same flags and pass the fraction it picks",
                launch.world, launch.world));
          fmt::print("{}\n", resolve_optimizer_on_device(*opts));
        }
        trainer = std::make_unique<Trainer>(*opts);
        return trainer->run(stdout);
      } catch (const std::exception& e) {
        // In an mpirun job, take every rank down here, before unwinding into the Trainer: its
        // streams may be inside a collective that waits for a rank that will never reach it.
        // (Outside a job this prints the one-line error and returns, as main would.)
        return report_fatal_error(e.what());
      }
    };
  });
}

}  // namespace strata::app
