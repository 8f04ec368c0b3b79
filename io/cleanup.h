// Files strata must not leave behind even when the process is stopped by a signal: swap files
// and their private directories register here, and a signal handler that cannot wait for the
// normal path (a second Ctrl-C) removes them with async-signal-safe unlink/rmdir only.
#pragma once
#include <string>

namespace strata::io {

// Remembers a file or an (empty once its files are gone) directory to remove on an emergency
// exit. Returns a slot for unregister_cleanup; -1 when the table is full (then only the
// normal path removes it). Thread-safe.
int register_cleanup(const std::string& path, bool directory);
// The same for a flat directory being written (a checkpoint's or a save's temporary
// directory): on an emergency exit every entry in it is unlinked, then the directory removed.
int register_cleanup_tree(const std::string& path);
void unregister_cleanup(int slot);
// Removes every registered path: files first, then directories. Async-signal-safe.
void emergency_cleanup() noexcept;

}  // namespace strata::io
