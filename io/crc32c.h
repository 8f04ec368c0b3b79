// crc32c (Castagnoli), the checksum SwapSpace records per 4 KiB block written and verifies on read.
// SSE4.2 crc32 instructions where the CPU has them, a slicing table otherwise.
#pragma once
#include <cstddef>
#include <cstdint>

namespace strata::io {

// crc32c of [data, data+bytes), continuing from `crc` (0 to start). Standard init/final xor.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
// crc32c of each `block_bytes`-sized block of [data, data + n_blocks·block_bytes) into out[0..n):
// what SwapSpace records per 4 KiB block. With SSE4.2, three blocks are summed side by side
// (independent streams, no combining), so small blocks run as fast as one long buffer.
void crc32c_blocks(const void* data, size_t n_blocks, size_t block_bytes, uint32_t* out);
// The portable path, exposed so tests can check the hardware path against it.
uint32_t crc32c_table(const void* data, size_t bytes, uint32_t crc = 0);
bool crc32c_hardware();

}  // namespace strata::io
