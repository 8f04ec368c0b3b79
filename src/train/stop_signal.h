// Stopping a run cleanly on a signal: SIGINT, SIGTERM and SIGHUP (a dropped ssh session) ask the
// training loop to stop after the current step (it then saves a checkpoint when one is
// configured, removes its swap files and exits 128 + the signal); a second one stops at once,
// still removing the swap files and any checkpoint or save being written (io/cleanup.h), with
// the same status. SIGUSR1 asks for a checkpoint after the current step, and the run goes on
// (what a batch scheduler sends before it preempts a job). SIGUSR2 stops like SIGTERM: mpirun
// forwards it to every rank at once, where its own SIGINT/SIGTERM handling kills the ranks a
// second later (scripts/strata-mpirun turns Ctrl-C into SIGUSR2). SIGPIPE is ignored: a closed stdout
// (`strata train | head`) is a write error the loop sees, and it stops as on SIGTERM. A signal
// the process was started with ignored (nohup's SIGHUP) stays ignored.
#pragma once

namespace strata {

void install_stop_handlers();
// 0, or the signal that asked the run to stop.
int stop_requested();
// Asks the run to stop as `sig` would (a write error on stdout), unless a signal already did.
void request_stop(int sig);
// True once after each SIGUSR1: a checkpoint was asked for.
bool take_checkpoint_request();
// What stopped the run, for its last line: "SIGTERM", "a write error on stdout" (SIGPIPE), ...
const char* stop_signal_name(int sig);
// Tests: forget a request.
void clear_stop_request();

}  // namespace strata
