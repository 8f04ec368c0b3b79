// crc32c: SSE4.2 crc32 over 8-byte words (three independent streams to hide the instruction's
// 3-cycle latency on large buffers), and a slicing-by-8 table for CPUs without it.
#include "io/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace strata::io {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, reflected

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

uint32_t table_raw(const unsigned char* p, size_t n, uint32_t c) {
  const auto& t = tables().t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

#if defined(__x86_64__)
constexpr size_t kBlock = 4096;  // bytes per stream in the 3-way interleave

// c -> raw crc register advanced over kBlock zero bytes: linear over GF(2), so it is a table
// lookup per byte of c (built from the 32 basis vectors with the portable path).
struct ShiftTable {
  std::array<std::array<uint32_t, 256>, 4> t{};
  ShiftTable() {
    static const unsigned char zeros[kBlock] = {};
    uint32_t basis[32];
    for (int b = 0; b < 32; ++b) basis[b] = table_raw(zeros, kBlock, uint32_t{1} << b);
    for (int k = 0; k < 4; ++k)
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t r = 0;
        for (int bit = 0; bit < 8; ++bit)
          if (v & (1u << bit)) r ^= basis[8 * k + bit];
        t[k][v] = r;
      }
  }
  uint32_t shift(uint32_t c) const { return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24]; }
};
const ShiftTable& shift_table() {
  static const ShiftTable s;
  return s;
}

__attribute__((target("sse4.2"))) uint32_t hw_raw(const unsigned char* p, size_t n, uint32_t c) {
  uint64_t c0 = c;
  const ShiftTable& sh = shift_table();
  // Three interleaved streams over blocks of 3*kBlock bytes, combined by shifting.
  while (n >= 3 * kBlock) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char* p1 = p + kBlock;
    const unsigned char* p2 = p + 2 * kBlock;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p1 + i, 8);
      std::memcpy(&w2, p2 + i, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    // crc(A||B) = shift(crc(A), |B|) ^ crc0(B) for raw (no pre/post xor) crcs.
    uint32_t a = sh.shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = sh.shift(a) ^ static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c0 = _mm_crc32_u64(c0, w);
  }
  uint32_t c32 = static_cast<uint32_t>(c0);
  for (; n; --n) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

// Three whole blocks at once (block_bytes a multiple of 8): three dependency chains in flight.
__attribute__((target("sse4.2"))) void hw_three_blocks(const unsigned char* p, size_t block_bytes, uint32_t* out) {
  uint64_t c0 = ~0u, c1 = ~0u, c2 = ~0u;
  const unsigned char* p1 = p + block_bytes;
  const unsigned char* p2 = p + 2 * block_bytes;
  for (size_t i = 0; i < block_bytes; i += 8) {
    uint64_t w0, w1, w2;
    std::memcpy(&w0, p + i, 8);
    std::memcpy(&w1, p1 + i, 8);
    std::memcpy(&w2, p2 + i, 8);
    c0 = _mm_crc32_u64(c0, w0);
    c1 = _mm_crc32_u64(c1, w1);
    c2 = _mm_crc32_u64(c2, w2);
  }
  out[0] = ~static_cast<uint32_t>(c0);
  out[1] = ~static_cast<uint32_t>(c1);
  out[2] = ~static_cast<uint32_t>(c2);
}
#endif

}  // namespace

bool crc32c_hardware() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

uint32_t crc32c_table(const void* data, size_t bytes, uint32_t crc) {
  return ~table_raw(static_cast<const unsigned char*>(data), bytes, ~crc);
}

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
#if defined(__x86_64__)
  if (crc32c_hardware()) return ~hw_raw(static_cast<const unsigned char*>(data), bytes, ~crc);
#endif
  return crc32c_table(data, bytes, crc);
}

void crc32c_blocks(const void* data, size_t n_blocks, size_t block_bytes, uint32_t* out) {
  const auto* p = static_cast<const unsigned char*>(data);
  size_t k = 0;
#if defined(__x86_64__)
  if (crc32c_hardware() && block_bytes % 8 == 0)
    for (; k + 3 <= n_blocks; k += 3) hw_three_blocks(p + k * block_bytes, block_bytes, out + k);
#endif
  for (; k < n_blocks; ++k) out[k] = crc32c(p + k * block_bytes, block_bytes);
}

}  // namespace strata::io
