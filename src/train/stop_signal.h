// Stopping a run cleanly on SIGINT/SIGTERM: the first signal asks the training loop to stop
// after the current step (it then saves a checkpoint when one is configured, removes its swap
// files and exits 130 / 143); a second SIGINT or SIGTERM stops at once, still removing the swap
// files (io/cleanup.h), and exits with the same status.
#pragma once

namespace strata {

void install_stop_handlers();
// 0, or the signal that asked the run to stop.
int stop_requested();
// Tests: forget a request.
void clear_stop_request();

}  // namespace strata
