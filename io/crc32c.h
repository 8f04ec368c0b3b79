// crc32c (Castagnoli), the checksum SwapSpace records per extent write and verifies on read.
// SSE4.2 crc32 instructions where the CPU has them, a slicing table otherwise.
#pragma once
#include <cstddef>
#include <cstdint>

namespace strata::io {

// crc32c of [data, data+bytes), continuing from `crc` (0 to start). Standard init/final xor.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
// The portable path, exposed so tests can check the hardware path against it.
uint32_t crc32c_table(const void* data, size_t bytes, uint32_t crc = 0);
bool crc32c_hardware();

}  // namespace strata::io
