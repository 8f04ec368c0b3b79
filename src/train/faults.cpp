// STRATA_FAULT: the one place test faults are read.
#include "src/train/faults.h"

#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace strata {

namespace {
int64_t number(const std::string& text, const std::string& item) {
  size_t used = 0;
  long long v = -1;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
  }
  if (used != text.size() || v < 0)
    throw std::invalid_argument("STRATA_FAULT: '" + item + "': expected a whole number after the ':'");
  return v;
}
}  // namespace

Faults parse_faults(const std::string& text) {
  Faults f;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    const std::string kind = item.substr(0, colon), arg = colon == std::string::npos ? "" : item.substr(colon + 1);
    if (kind == "separate-optimizer" && arg.empty()) {
      f.separate_optimizer = true;
    } else if (kind == "trial-verdicts" && !arg.empty() && arg.find_first_not_of("01") == std::string::npos) {
      f.trial_verdicts = arg;
    } else if (kind == "kill" && arg.find(':') != std::string::npos) {
      const size_t c = arg.find(':');
      f.kill_rank = static_cast<int>(number(arg.substr(0, c), item));
      f.kill_step = number(arg.substr(c + 1), item);
    } else if ((kind == "io-read" || kind == "io-write" || kind == "io-flip") && !arg.empty()) {
      f.io = kind.substr(3);
      f.io_nth = number(arg, item);
    } else if (kind == "save-fill" && !arg.empty()) {
      f.save_fill_nth = number(arg, item);
    } else {
      throw std::invalid_argument("STRATA_FAULT: '" + item + "' is not a fault (kill:RANK:STEP, io-read:N, "
                                  "io-write:N, io-flip:N, separate-optimizer, trial-verdicts:BITS, save-fill:N; see "
                                  "src/train/faults.h)");
    }
  }
  return f;
}

const Faults& faults() {
  static const Faults f = [] {
    const char* e = std::getenv("STRATA_FAULT");
    return e ? parse_faults(e) : Faults{};
  }();
  return f;
}

}  // namespace strata
