// Byte sizes as users write them on the command line ("24G", "512M", "1.5G", "4096").
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace strata::offload {

// Binary units (K = 1024). Throws std::invalid_argument naming the text and the expected form.
uint64_t parse_size(std::string_view text);
std::string format_size(uint64_t bytes);  // "1.50 GiB"

}  // namespace strata::offload
