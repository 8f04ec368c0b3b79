// Overflow-checked arithmetic for sizes that come from user input (flags, config.json, file
// headers): a product that does not fit is an error naming what was being computed, never a
// wrapped value (a byte count that wraps to 0 divides by zero later; one that wraps small
// under-allocates).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace strata {

// a · b, or std::invalid_argument("<what>: <a> x <b> overflows ...").
template <class T>
T checked_mul(T a, T b, const std::string& what) {
  T r;
  if (__builtin_mul_overflow(a, b, &r))
    throw std::invalid_argument(what + ": " + std::to_string(a) + " x " + std::to_string(b) +
                                " overflows a 64-bit count; use smaller values");
  return r;
}

// a + b, or std::invalid_argument naming `what`.
template <class T>
T checked_add(T a, T b, const std::string& what) {
  T r;
  if (__builtin_add_overflow(a, b, &r))
    throw std::invalid_argument(what + ": " + std::to_string(a) + " + " + std::to_string(b) +
                                " overflows a 64-bit count; use smaller values");
  return r;
}

}  // namespace strata
