// CHECK(cond, what) for the tests that run as their own mpirun jobs (no GoogleTest: every rank
// reports its own failure): throws naming the file, line, condition and `what`.
#pragma once
#include <stdexcept>
#include <string>

#define CHECK(cond, what)                                                                                          \
  do {                                                                                                             \
    if (!(cond))                                                                                                   \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": check failed: " #cond \
                               " — " + (what));                                                                     \
  } while (0)
