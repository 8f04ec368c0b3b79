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

std::atomic<int> g_signal{0};

void say(const char* text) {
  const ssize_t n = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)n;
}

void on_signal(int sig) {
  int expected = 0;
  if (g_signal.compare_exchange_strong(expected, sig)) {
    say(sig == SIGINT ? "\nstrata: SIGINT: stopping after the current step (again to stop now)\n"
                      : "\nstrata: SIGTERM: stopping after the current step (again to stop now)\n");
    return;
  }
  io::emergency_cleanup();
  say("strata: stopped at once; swap files removed\n");
  ::_exit(128 + sig);
}

}  // namespace

void install_stop_handlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

int stop_requested() { return g_signal.load(); }
void clear_stop_request() { g_signal.store(0); }

}  // namespace strata
