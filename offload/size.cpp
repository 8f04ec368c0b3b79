// parse_size / format_size.
#include "offload/size.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace strata::offload {

uint64_t parse_size(std::string_view s) {
  auto bad = [&] {
    return std::invalid_argument("bad size '" + std::string(s) +
                                 "': expected a number with an optional unit K, M, G or T (e.g. 24G, 512M)");
  };
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) throw bad();
  double v;
  try {
    std::string num(s.substr(0, i));
    size_t used = 0;
    v = std::stod(num, &used);
    if (used != num.size()) throw bad();
  } catch (...) {
    throw bad();
  }
  std::string_view unit = s.substr(i);
  double mult = 1;
  if (!unit.empty()) {
    char u = static_cast<char>(std::toupper(static_cast<unsigned char>(unit[0])));
    if (u == 'K') mult = 1024.0;
    else if (u == 'M') mult = 1024.0 * 1024;
    else if (u == 'G') mult = 1024.0 * 1024 * 1024;
    else if (u == 'T') mult = 1024.0 * 1024 * 1024 * 1024;
    else if (u != 'B') throw bad();
    std::string_view rest = unit.substr(1);
    if (!(rest.empty() || rest == "B" || rest == "b" || rest == "iB" || rest == "ib") || (u == 'B' && !rest.empty()))
      throw bad();
  }
  double bytes = v * mult;
  if (!std::isfinite(bytes) || bytes < 0 || bytes >= 9.2e18) throw bad();  // llround must not overflow
  return static_cast<uint64_t>(std::llround(bytes));
}

std::string format_size(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace strata::offload
