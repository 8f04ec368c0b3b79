// Helpers for tests that run the built `strata` binary (STRATA_BIN): read a file whole, run a
// command line with its stdout and stderr captured.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <regex>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "src/checkpoint/hf.h"

namespace strata::test {

// A fresh directory under the test temp dir ("<name>_XXXXXX"); empty on failure.
inline std::filesystem::path make_scratch_dir(const std::string& name) {
  std::string t = (std::filesystem::path(::testing::TempDir()) / (name + "_XXXXXX")).string();
  return ::mkdtemp(t.data()) ? std::filesystem::path(t) : std::filesystem::path();
}

// DIR/config.json of a small byte-level llama (random init from --seed): every step is quick.
inline void write_tiny_llama(const std::filesystem::path& dir, int hidden, int layers, int intermediate) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json")
      << "{\"model_type\": \"llama\", \"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 256, "
      << "\"hidden_size\": " << hidden << ", \"num_hidden_layers\": " << layers
      << ", \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"intermediate_size\": " << intermediate
      << ", \"max_position_embeddings\": 64, \"rms_norm_eps\": 1e-5, \"rope_theta\": 10000.0, "
      << "\"tie_word_embeddings\": false, \"hidden_act\": \"silu\"}";
}

#ifdef STRATA_MPIEXEC
#define STRATA_TEST_MPIEXEC STRATA_MPIEXEC
constexpr bool kHaveMpi = true;
#else
#define STRATA_TEST_MPIEXEC ""  // built without MPI or mpirun: the multi-rank tests skip
constexpr bool kHaveMpi = false;
#endif
// How `strata` starts as an np-rank mpirun job: "env <root and oversubscribe variables> ENV
// mpirun -np NP " (oversubscribed: the test machine may have fewer cores than ranks); np 0:
// plainly ("env ENV " or "").
inline std::string launch_prefix(int np, const std::string& env) {
  if (np > 0)
    return "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 " + env +
           " " + STRATA_TEST_MPIEXEC + " -np " + std::to_string(np) + " ";
  return env.empty() ? "" : "env " + env + " ";
}

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

// Every line of a --metrics file, parsed.
inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& p) {
  std::vector<nlohmann::json> v;
  std::ifstream f(p);
  for (std::string line; std::getline(f, line);) v.push_back(nlohmann::json::parse(line));
  return v;
}

// The bit-exact part of each --metrics line: step, loss, grad norm, lr, tokens (as printed,
// which is the shortest text that round-trips the double).
inline std::vector<std::string> exact_metrics(const std::filesystem::path& p) {
  std::vector<std::string> rows;
  std::istringstream in(slurp(p));
  std::string line;
  static const std::regex keys[] = {std::regex(R"re("step":(\d+))re"), std::regex(R"re("loss":([^,}]+))re"),
                                    std::regex(R"re("grad_norm":([^,}]+))re"), std::regex(R"re("lr":([^,}]+))re"),
                                    std::regex(R"re("tokens":([^,}]+))re")};
  while (std::getline(in, line)) {
    std::string row;
    for (const auto& k : keys) {
      std::smatch m;
      row += std::regex_search(line, m, k) ? m[1].str() : std::string("?");
      row += " ";
    }
    rows.push_back(row);
  }
  return rows;
}

// Every tensor of a checkpoint, by name, as fp32.
inline std::map<std::string, std::vector<float>> tensors_of(const HfCheckpoint& ck) {
  std::map<std::string, std::vector<float>> w;
  for (const auto& t : ck.tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    ck.read_into(t.name, t.shape, v.data(), kernels::DType::f32);
    w[t.name] = std::move(v);
  }
  return w;
}

}  // namespace strata::test
