// The run loop of `strata train`: the header, validation at the start, every --eval-every steps
// and at the end, the steps with their progress and --metrics lines, checkpoints on schedule and
// when a signal asks, a stop between steps, the summary and the final save.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "src/checkpoint/train_checkpoint.h"
#include "src/train/stop_signal.h"
#include "src/train/trainer_impl.h"

namespace strata {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }
}  // namespace

int Trainer::run(std::FILE* rank0_out) {
  Impl& m = *impl_;
  const TrainOptions& o = m.o;
  // Rank 0 alone prints; the others run the same program (every collective matched).
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> null_out(nullptr, &std::fclose);
  if (!m.rank0()) {
    null_out.reset(std::fopen("/dev/null", "w"));
    if (!null_out) throw std::runtime_error("cannot open /dev/null: " + errno_text());
  }
  std::FILE* out = m.rank0() ? rank0_out : null_out.get();
  // Output that cannot be written (a closed pipe: `strata train | head`, a full disk) stops the
  // run as SIGTERM would, checkpoint included, instead of killing it or going on blind; what it
  // would have said then goes to stderr.
  bool out_ok = true;
  const auto lose_stdout = [&](int err) {
    out_ok = false;
    request_stop(SIGPIPE);
    fmt::print(stderr, "strata: cannot write to stdout ({}): stopping after this step\n", errno_text(err));
  };
  const auto print = [&](const std::string& text) {
    if (out_ok && (std::fputs(text.c_str(), out) < 0 || std::fflush(out) != 0)) lose_stdout(errno);
  };
  // Every rank leaves together: mpirun takes the job down when the first rank exits non-zero,
  // which must not happen while rank 0 still writes the checkpoint.
  const auto all_ranks_done = [&] {
    if (m.comm->world() <= 1) return;
    int mine = 1;
    std::vector<int> all(static_cast<size_t>(m.comm->world()));
    m.comm->host_all_gather(&mine, all.data(), sizeof(int));
  };
  try {
    print_header(out);
  } catch (const std::system_error& e) {  // fmt reports a failed write as system_error
    lose_stdout(e.code().value());
  }
  const auto t_start = Clock::now();
  RunTally tally;
  // Validation at the start, every --eval-every steps and at the end: a line, and val_loss in
  // the metrics line of that step (a line of its own for step 0).
  int64_t last_eval = -1;
  double last_val = NAN;
  const auto validate = [&] {
    const EvalStats ev = evaluate();
    last_eval = m.steps_done;
    last_val = ev.loss;
    return ev;
  };
  const auto print_eval = [&](const EvalStats& ev) { print(eval_line(ev, last_eval, o.steps)); };
  if (has_validation()) {
    const EvalStats ev = validate();
    print_eval(ev);
    if (m.steps_done == 0) m.metrics.write(eval_metrics(ev, m.run_id), 0);
  }
  while (m.steps_done < o.steps) {
    // A stop (SIGINT, SIGTERM, SIGHUP, stdout gone) and a checkpoint request (SIGUSR1), agreed by
    // every rank: a signal may reach one rank first, and each must stop after the same step.
    int req[2] = {stop_requested(), take_checkpoint_request() ? 1 : 0};
    if (m.comm->world() > 1) {
      std::vector<int> all(2 * static_cast<size_t>(m.comm->world()));
      m.comm->host_all_gather(req, all.data(), sizeof(req));
      for (size_t r = 0; r < all.size(); r += 2) {
        req[0] = req[0] ? req[0] : all[r];
        req[1] = req[1] | all[r + 1];
      }
    }
    if (req[1] && !req[0] && m.steps_done > 0) {
      if (o.checkpoint_dir.empty()) {
        if (m.rank0()) fmt::print(stderr, "strata: SIGUSR1 asked for a checkpoint, but there is no --checkpoint-dir; going on\n");
      } else if (m.last_checkpoint_step != m.steps_done) {
        const std::string path = save_checkpoint();
        print(fmt::format("checkpoint {} (asked by SIGUSR1)\n", path));
      }
    }
    if (const int sig = req[0]) {  // stop between steps
      std::string saved = "nothing saved to --out (the run did not finish)";
      if (!o.checkpoint_dir.empty() && m.steps_done > 0)
        saved = "checkpoint " +
                (m.last_checkpoint_step == m.steps_done
                     ? (fs::path(o.checkpoint_dir) / checkpoint_name(m.steps_done)).string()
                     : save_checkpoint()) +
                " (continue with --resume auto)";
      else if (o.checkpoint_dir.empty())
        saved += "; --checkpoint-dir DIR makes runs resumable";
      const std::string line =
          fmt::format("stopped by {} after step {} of {}; {}\n", stop_signal_name(sig), m.steps_done, o.steps, saved);
      print(line);
      if (!out_ok && m.rank0()) fmt::print(stderr, "strata: {}", line);
      all_ranks_done();
      return 128 + sig;
    }
    const StepStats st = step();
    const bool evaluate_now = has_validation() && !st.diverged &&
                              ((o.eval_every > 0 && st.step % o.eval_every == 0) || st.step == o.steps);
    if (st.trained_tokens == 0) {
      if (m.rank0())
        fmt::print(stderr, "strata: warning: step {}: no trained target in the global batch (every target masked or "
                           "padding): skipped, nothing applied\n", st.step);
    }
    std::optional<EvalStats> ev;
    if (evaluate_now) ev = validate();
    // A diverged step is never checkpointed (below, the run stops): with the update in the
    // backward its units have already updated.
    if (o.checkpoint_every > 0 && st.step % o.checkpoint_every == 0 && st.step < o.steps && !st.diverged) {
      const std::string path = save_checkpoint();
      print(fmt::format("checkpoint {}\n", path));
    }
    tally.add(st);
    m.metrics.write(step_metrics(st, m.last_stats, ev, m.run_id), st.step);
    // (the step that ends --speculate auto's trial says its verdict whatever --log-every)
    if (st.step == 1 || st.step == o.steps || st.step % o.log_every == 0 || st.speculation_trial)
      print(step_line(st, o.steps, m.placement.uses_nvme() || st.bytes_moved() > 0, m.scaler.scale()));
    if (ev) print_eval(*ev);
    if (st.diverged)
      throw std::runtime_error(fmt::format(
          "step {}: loss {} and grad norm {}: the run diverged (not finite); {}nothing was saved to --out; lower "
          "--lr, add --warmup or set --grad-clip",
          st.step, st.loss, st.grad_norm,
          // In the backward, each unit's update ran as its gradient became final.
          // Speculative: it ran, then was rolled back like any step that is not applied.
          m.placement.update_in_backward() && !m.placement.speculate ? "" : "the step was not applied and "));
  }
  m.flush();  // the last step's update
  if (has_validation() && last_eval != m.steps_done) print_eval(validate());  // (not reached in the loop)
  if (!o.checkpoint_dir.empty() && m.last_checkpoint_step != m.steps_done) {
    const std::string path = save_checkpoint();
    print(fmt::format("checkpoint {}\n", path));
  }
  std::string extra;
  if (m.data->documents()) extra += fmt::format("; {} trained targets", m.trained_done);
  if (const std::string lost = m.data->losses(); !lost.empty()) extra += "; " + lost;
  if (std::isfinite(last_val)) extra += fmt::format("; val loss {:.4f} (ppl {:.2f})", last_val, std::exp(last_val));
  print(tally.done_line(o.steps, m.tokens_done, tokens_per_step(), ms_since(t_start) / 1e3, extra));
  if (!o.out.empty()) {
    save(o.out);
    const char* what = !m.model->lora()     ? "the model to {} (HF layout)\n"
                       : o.merge_adapter ? "the merged model (base + adapters) to {} (HF layout)\n"
                                         : "the LoRA adapter to {} (PEFT layout)\n";
    print("saved " + fmt::format(fmt::runtime(what), o.out));
  }
  // A signal during the last step: the run is complete and saved (status 0), say so.
  if (const int sig = stop_requested(); sig && sig != SIGPIPE)
    print(fmt::format("{} came during the last step: the run finished and was saved\n", stop_signal_name(sig)));
  return 0;
}

}  // namespace strata
