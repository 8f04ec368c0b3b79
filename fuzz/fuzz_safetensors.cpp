// libFuzzer: the safetensors header parser (src/checkpoint/safetensors.cpp) on arbitrary file
// bytes. It may throw std::runtime_error; anything else (a crash, a sanitizer report, a parse
// result that breaks its own invariants) is a bug.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#include "src/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  safetensors::Parsed p;
  try {
    p = safetensors::parse(data, size, "fuzz.safetensors");
  } catch (const std::runtime_error&) {
    return 0;
  }
  // What parse promises: entries sorted, disjoint, inside the data area, sized by shape × dtype.
  const uint64_t data_size = size - p.data_start;
  if (p.data_start < 8 || p.data_start > size) std::abort();
  uint64_t prev_end = 0;
  for (const safetensors::Entry& e : p.entries) {
    if (e.begin > e.end || e.end > data_size || e.begin < prev_end) std::abort();
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      if (d < 0) std::abort();
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * kernels::dtype_size(e.dtype) != e.end - e.begin) std::abort();
    prev_end = e.end;
  }
  // The writer's header for the same entries parses back to them.
  if (!p.entries.empty() && p.entries.size() < 64) {
    std::string file = safetensors::build_header(p.entries);
    file.resize(file.size() + p.entries.back().end, '\0');
    safetensors::Parsed q = safetensors::parse(file.data(), file.size(), "rebuilt.safetensors");
    if (q.entries.size() != p.entries.size()) std::abort();
    for (size_t i = 0; i < q.entries.size(); ++i)
      if (q.entries[i].begin != p.entries[i].begin || q.entries[i].end != p.entries[i].end ||
          q.entries[i].shape != p.entries[i].shape || q.entries[i].dtype != p.entries[i].dtype)
        std::abort();
  }
  return 0;
}
