// crc32c (Castagnoli), the checksum SwapSpace records per 4 KiB block written and verifies on read.
// Carry-less multiply folding (VPCLMULQDQ over 512-bit registers with AVX-512, over 256-bit ones
// with AVX2) where the CPU has it, SSE4.2 crc32 instructions otherwise, a slicing table on CPUs
// with none of these.
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

// Each implementation by name, so tests and benchmarks can run every one this CPU has against the
// table. crc32c() and crc32c_blocks() use crc32c_fastest().
enum class Crc32cPath { table, sse42, vpclmulqdq_avx2, vpclmulqdq_avx512 };
bool crc32c_supported(Crc32cPath path);
Crc32cPath crc32c_fastest();
const char* crc32c_name(Crc32cPath path);
// Throws std::invalid_argument where the CPU lacks `path`.
uint32_t crc32c_with(Crc32cPath path, const void* data, size_t bytes, uint32_t crc = 0);
void crc32c_blocks_with(Crc32cPath path, const void* data, size_t n_blocks, size_t block_bytes, uint32_t* out);

}  // namespace strata::io
