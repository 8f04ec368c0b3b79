// The handlers do only async-signal-safe things: an atomic store, write(2), unlink/rmdir of
// registered paths, _exit.
#include "src/train/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "io/cleanup.h"

namespace strata {
namespace {

std::atomic<int> g_signal{0};    // the first stop signal received
std::atomic<int> g_internal{0};  // a stop asked by the program itself (stdout gone)
std::atomic<bool> g_checkpoint{false};

void say(const char* text) {
  const ssize_t n = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)n;
}

void on_signal(int sig) {
  int expected = 0;
  if (g_signal.compare_exchange_strong(expected, sig)) {
    say(sig == SIGINT    ? "\nstrata: SIGINT: stopping after the current step (again to stop now)\n"
        : sig == SIGHUP  ? "\nstrata: SIGHUP: stopping after the current step (again to stop now)\n"
        : sig == SIGUSR2 ? "\nstrata: SIGUSR2 (a stop relayed by the launcher): stopping after the current step\n"
                         : "\nstrata: SIGTERM: stopping after the current step (again to stop now)\n");
    return;
  }
  io::emergency_cleanup();
  say("strata: stopped at once; swap files and partial checkpoints removed\n");
  ::_exit(128 + sig);
}

void on_usr1(int) {
  g_checkpoint.store(true);
  say("\nstrata: SIGUSR1: a checkpoint after the current step\n");
}

// A signal the process was started with ignored stays ignored (nohup's SIGHUP, SIGINT of a
// background job in a script), as Python does for SIGINT.
void install(int sig, void (*handler)(int)) {
  struct sigaction old;
  std::memset(&old, 0, sizeof(old));
  if (sig != SIGPIPE && ::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) return;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(sig, &sa, nullptr);
}

}  // namespace

void install_stop_handlers() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR2}) install(sig, on_signal);
  install(SIGUSR1, on_usr1);
  install(SIGPIPE, SIG_IGN);
}

int stop_requested() {
  const int sig = g_signal.load();
  return sig ? sig : g_internal.load();
}
// Not counted as the first signal: a Ctrl-C after it still stops after the step, with a checkpoint.
void request_stop(int sig) {
  int expected = 0;
  g_internal.compare_exchange_strong(expected, sig);
}
bool take_checkpoint_request() { return g_checkpoint.exchange(false); }
void clear_stop_request() {
  g_signal.store(0);
  g_internal.store(0);
  g_checkpoint.store(false);
}

const char* stop_signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGPIPE: return "a write error on stdout";
    case SIGUSR2: return "SIGUSR2 (a stop relayed by the launcher)";
    default: return "a signal";
  }
}

}  // namespace strata
