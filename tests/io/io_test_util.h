// Shared helpers for the io/ tests: a scratch directory removed at the end, engine configurations
// to run every engine test against, and deterministic random bytes.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>

#include "io/engine.h"

namespace strata::io::testing {

// A fresh directory under /tmp (a real disk here; tmpfs elsewhere also works for most tests).
class ScratchDir {
 public:
  ScratchDir() {
    std::string t = "/tmp/strata-io-test-XXXXXX";
    if (!mkdtemp(t.data())) throw std::runtime_error("mkdtemp failed");
    path_ = t;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The engine configurations every engine-level test runs on.
enum class Config { uring_reaper, uring_caller, threads };

inline std::string config_name(const ::testing::TestParamInfo<Config>& i) {
  switch (i.param) {
    case Config::uring_reaper: return "uring_reaper";
    case Config::uring_caller: return "uring_caller";
    case Config::threads: return "threads";
  }
  return "?";
}

inline EngineOptions options_for(Config c) {
  EngineOptions o;
  o.kind = c == Config::threads ? EngineKind::threads : EngineKind::uring;
  o.reaper_thread = c != Config::uring_caller;
  o.queue_depth = 8;
  o.block_bytes = 64 << 10;  // small blocks so modest requests split into several pieces
  o.n_threads = 3;
  return o;
}

// Skips the running test when the configuration needs io_uring and the kernel forbids it.
#define STRATA_SKIP_WITHOUT_URING(cfg)                                                    \
  do {                                                                                    \
    std::string why_;                                                                     \
    if ((cfg) != ::strata::io::testing::Config::threads && !::strata::io::uring_available(&why_)) \
      GTEST_SKIP() << "io_uring not permitted here: " << why_;                            \
  } while (0)

inline void fill_random(void* p, size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* w = static_cast<uint64_t*>(p);
  for (size_t i = 0; i < bytes / 8; ++i) w[i] = rng();
}

}  // namespace strata::io::testing
