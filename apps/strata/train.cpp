// `strata train`: every TrainOptions field as a flag (CLI11 shows each default in --help), then
// the Trainer runs and prints a header, a progress line per step and a summary.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>

#include <fmt/format.h>

#include "apps/strata/commands.h"
#include "src/comm/communicator.h"
#include "src/train/stop_signal.h"
#include "src/train/trainer.h"

namespace strata::app {

void add_train_flags(CLI::App* cmd, TrainOptions& o) {
  cmd->option_defaults()->always_capture_default();
  cmd->add_option("--model", o.model,
                  "HF model directory (config.json + *.safetensors); config.json alone = random init from --seed; "
                  "empty = the embedded default model");
  cmd->add_option("--preset", o.preset, "a named config instead of --model: gpt2-124m | default | llama-1b | llama-1.5b | llama-350m | llama-8b")
      ->excludes(cmd->get_option("--model"));
  cmd->add_option("--data", o.data,
                  "token-shard glob (llm.c format; with the NAME.docs/NAME.mask that `strata data` writes, rows are "
                  "built from documents and masked targets are not trained); empty = the embedded byte-level corpus");
  cmd->add_option("--pack", o.pack,
                  "documents: off = one per row (cut to --seq + 1 tokens, padded); on = packed first-fit, attention "
                  "and positions restart at each document");
  cmd->add_flag("--shuffle", o.shuffle, "documents: a new order each epoch, drawn from --seed");
  cmd->add_option("--epochs", o.epochs,
                  "documents: passes over the data (0 = until --steps); without --steps, as many steps as they take");
  cmd->add_option("--val-data", o.val_data,
                  "held-out token shards (e.g. the val_*.bin of `strata data --val-docs`): mean masked loss and "
                  "perplexity at the start, every --eval-every steps and at the end");
  cmd->add_option("--eval-every", o.eval_every, "steps between validations (0 = only at the start and the end)");
  cmd->add_option("--eval-batches", o.eval_batches, "micro-batches per validation (0 = the whole held-out set)");
  cmd->add_option("--backend", o.backend, "cpu | cuda");
  cmd->add_option("--dtype", o.dtype, "working weights/activations: fp32 | bf16 | fp16 (fp32 master and grads)");
  cmd->add_option("--batch", o.batch, "sequences per micro-batch (B)");
  cmd->add_option("--seq", o.seq, "tokens per sequence (T), at most max_position_embeddings");
  cmd->add_option("--grad-accum", o.grad_accum, "micro-batches per optimizer step (gradient = their mean)");
  cmd->add_option("--steps", o.steps, "optimizer steps");
  cmd->add_option("--lr", o.lr, "peak learning rate");
  cmd->add_option("--lr-schedule", o.lr_schedule, "constant | cosine (to --min-lr at the last step)");
  cmd->add_option("--warmup", o.warmup, "linear warmup steps");
  cmd->add_option("--min-lr", o.min_lr, "final learning rate of the cosine schedule");
  cmd->add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay (2-D tensors only)");
  cmd->add_option("--beta1", o.beta1, "AdamW beta1");
  cmd->add_option("--beta2", o.beta2, "AdamW beta2");
  cmd->add_option("--eps", o.eps, "AdamW epsilon");
  cmd->add_option("--grad-clip", o.grad_clip,
                 "clip the global gradient L2 norm to this (0 = off: then, bf16 or fp32 at ZeRO stage 0-1, each unit "
                 "updates in the backward as soon as its gradient is final)");
  cmd->add_option("--loss-scale", o.loss_scale, "fp16: the dynamic loss scaler's starting scale (a power of 2)");
  cmd->add_option("--seed", o.seed, "seed of the random init (0 to 2^64-1)")
      ->check([](const std::string& v) -> std::string {
        // CLI11 would wrap -1 and saturate 2^64 to 2^64-1: two different seeds would train the same.
        errno = 0;
        if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos ||
            (std::strtoull(v.c_str(), nullptr, 10), errno == ERANGE))
          return v + " is not a whole number from 0 to 18446744073709551615 (2^64-1)";
        return "";
      });
  cmd->add_option("--metrics", o.metrics, "write one JSON object per optimizer step to this file");
  cmd->add_option("--out", o.out, "save the final model here (HF layout: config.json + safetensors)");
  cmd->add_flag("--overwrite-model", o.overwrite_model,
                "let --out be the input --model directory, replacing the model the run started from");
  cmd->add_option("--log-every", o.log_every, "print a progress line every n steps");
  cmd->add_option("--threads", o.threads, "CPU compute threads (0 = all available cores)");
  cmd->add_option("--offload-params", o.offload_params,
                  "where the working weights live: none (the compute device) | cpu (pinned host RAM) | nvme");
  cmd->add_option("--offload-grads", o.offload_grads, "where the fp32 gradients live: none | cpu | nvme");
  cmd->add_option("--offload-optimizer", o.offload_optimizer,
                  "where the fp32 master weights and AdamW state live (AdamW runs next to them): none | cpu | nvme");
  cmd->add_option("--offload-activations", o.offload_activations,
                  "where checkpointed blocks' kept inputs live: none | cpu | nvme");
  cmd->add_option("--checkpoint-activations", o.checkpoint_activations,
                  "none | full (every block keeps only its input and recomputes in backward) | every:N (blocks 0, N, "
                  "2N, ...)");
  cmd->add_option("--nvme-path", o.nvme_paths, "directory for NVMe swap files (repeat: one per SSD, striped)");
  cmd->add_option("--device-mem", o.device_mem, "device memory budget, e.g. 24G (empty: what the plan needs)");
  cmd->add_option("--host-mem", o.host_mem,
                  "pinned host memory budget, e.g. 64G (empty: what the plan needs, within physical RAM)");
  cmd->add_option("--checkpoint-dir", o.checkpoint_dir,
                  "write training checkpoints here (step-N directories and 'latest'): every --checkpoint-every "
                  "steps, at the end, and when SIGINT/SIGTERM stops the run");
  cmd->add_option("--checkpoint-every", o.checkpoint_every, "steps between checkpoints (0 = only at the end and on a signal)");
  cmd->add_option("--keep", o.keep, "how many of the newest checkpoints to keep");
  cmd->add_option("--zero-stage", o.zero_stage,
                  "ZeRO stage across the ranks of an mpirun job: 0 = data parallel (grads all-reduced), 1 = master "
                  "weights and AdamW state sharded across ranks, 2 = grads reduce-scattered and sharded too, 3 = working "
                  "weights sharded too (each unit all-gathered before forward and before backward)");
  cmd->add_option("--resume", o.resume,
                  "continue from a checkpoint: its path, a --checkpoint-dir (its newest), or auto (the newest under "
                  "--checkpoint-dir; a fresh start when there is none)");
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
