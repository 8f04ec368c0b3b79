// Helpers for tests that run the built `strata` binary (STRATA_BIN): read a file whole, run a
// command line with its stdout and stderr captured.
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace strata::test {

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

struct CliResult {
  int status = -1;  // exit status; -1 when killed by a signal
  std::string out, err;
};

// Runs `strata ARGS` (with `env` "K=V ..." set when given); stdout and stderr go through files
// in `scratch`.
inline CliResult run_strata(const std::filesystem::path& scratch, const std::string& args, const std::string& env = "") {
  const std::filesystem::path o = scratch / "stdout", e = scratch / "stderr";
  const std::string cmd = (env.empty() ? "" : "env " + env + " ") + std::string(STRATA_BIN) + " " + args + " >" +
                          o.string() + " 2>" + e.string();
  const int rc = std::system(cmd.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(o), slurp(e)};
}

}  // namespace strata::test
