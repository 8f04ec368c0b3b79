// crc32c: carry-less multiply folding (VPCLMULQDQ, 256 bytes a step in 512-bit registers or 128
// in 256-bit ones), SSE4.2 crc32 over 8-byte words (three independent streams to hide the
// instruction's 3-cycle latency on large buffers), and a slicing-by-8 table for CPUs with none.
#include "io/crc32c.h"

#include <array>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
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

// A hint for the line `ahead` bytes past p, which may lie past the buffer's end: the address is
// formed as an integer (no out-of-range pointer), and a prefetch never faults.
inline void prefetch_ahead(const unsigned char* p, size_t ahead) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + ahead), _MM_HINT_T0);
}

// Three whole blocks at once (block_bytes a multiple of 8): three dependency chains in flight,
// each line of the next three blocks fetched as the same line of these is summed (over 512 MiB
// of cold 4 KiB blocks: 14 GB/s without, 20-21 with, on the 2-vCPU EPYC VM).
__attribute__((target("sse4.2"))) void hw_three_blocks(const unsigned char* p, size_t block_bytes, uint32_t* out) {
  uint64_t c0 = ~0u, c1 = ~0u, c2 = ~0u;
  const unsigned char* p1 = p + block_bytes;
  const unsigned char* p2 = p + 2 * block_bytes;
  const size_t next = 3 * block_bytes;
  for (size_t i = 0; i < block_bytes; i += 8) {
    if (i % 64 == 0)
      for (const unsigned char* line : {p + i, p1 + i, p2 + i}) prefetch_ahead(line, next);
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

// Folding (Intel's "Fast CRC Computation Using PCLMULQDQ", reflected form). A 64-bit lane loaded
// little-endian holds message bits with the highest power at bit 0, and a carry-less product of
// two such lanes multiplies their polynomials with the same orientation. So a 128-bit chunk X
// moves D bits further down the message, keeping its value mod P, as
//   clmul(X.lo, rev32(x^(D+31) mod P)) ^ clmul(X.hi, rev32(x^(D-33) mod P)),
// a 95-bit result laid out as a chunk at the new place, to be xored into the data there. The last
// 16-byte chunk then holds the whole message mod P, and two crc32 instructions from a zero
// register finish it. The start value goes in by xoring it into the first four bytes.
uint32_t xpow_mod_reflected(unsigned n) {
  uint64_t r = 1;  // x^0, normal (unreflected) form of the remainder
  for (unsigned i = 0; i < n; ++i) {
    r <<= 1;
    if (r & (uint64_t{1} << 32)) r ^= 0x11EDC6F41ull;  // x^32 + the Castagnoli polynomial
  }
  uint32_t rev = 0;
  for (int b = 0; b < 32; ++b)
    if (r & (uint64_t{1} << b)) rev |= uint32_t{1} << (31 - b);
  return rev;
}

struct FoldConstants {
  uint64_t lo, hi;  // for X.lo and X.hi
  explicit FoldConstants(unsigned bits) : lo(xpow_mod_reflected(bits + 31)), hi(xpow_mod_reflected(bits - 33)) {}
};

struct ClmulConstants {
  FoldConstants by2048{2048}, by1024{1024}, by512{512}, by384{384}, by256{256}, by128{128};
};
const ClmulConstants& clmul_constants() {
  static const ClmulConstants k;
  return k;
}

constexpr size_t kClmulStep = 256;     // four 512-bit accumulators
constexpr size_t kClmul256Step = 128;  // four 256-bit accumulators
// Lines fetched this far ahead: what SwapSpace checksums has mostly just come from the disk by DMA
// and is in no cache, and the prefetcher alone left the fold at 19-21 GB/s over 512 MiB where a
// plain read ran at 30; with this, 27-33 GB/s (2-vCPU EPYC VM).
constexpr size_t kClmulPrefetch = 1024;

__attribute__((target("avx512f,vpclmulqdq,pclmul"))) inline __m512i fold512(__m512i x, __m512i k, __m512i into) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), into, 0x96);
}
__attribute__((target("pclmul,sse4.2"))) inline __m128i fold128(__m128i x, const FoldConstants& f) {
  const __m128i k = _mm_set_epi64x(static_cast<long long>(f.hi), static_cast<long long>(f.lo));
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

// The last 16-byte chunk, holding the whole message mod P, summed from a zero register.
__attribute__((target("sse4.2"))) inline uint32_t finish(__m128i x) {
  const uint64_t r = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  return static_cast<uint32_t>(_mm_crc32_u64(r, static_cast<uint64_t>(_mm_extract_epi64(x, 1))));
}

// Folds the first n - n % step bytes with `fold` (n >= step), then the rest with crc32.
uint32_t fold_then_hw(const unsigned char* p, size_t n, uint32_t c, size_t step,
                      uint32_t (*fold)(const unsigned char*, size_t, uint32_t)) {
  if (n < step) return hw_raw(p, n, c);
  const size_t head = n - n % step;
  return hw_raw(p + head, n - head, fold(p, n, c));
}

__attribute__((target("avx512f"))) inline __m512i in_every_lane(const FoldConstants& f) {
  const auto lo = static_cast<long long>(f.lo), hi = static_cast<long long>(f.hi);
  return _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
}

// Raw register c advanced over the first n - n % 256 bytes (n >= 256); the caller finishes the rest.
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) uint32_t clmul_raw(const unsigned char* p, size_t n, uint32_t c) {
  const ClmulConstants& kc = clmul_constants();
  const __m512i k2048 = in_every_lane(kc.by2048), k512 = in_every_lane(kc.by512);
  __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));
  __m512i a1 = _mm512_loadu_si512(p + 64), a2 = _mm512_loadu_si512(p + 128), a3 = _mm512_loadu_si512(p + 192);
  for (size_t done = kClmulStep; done + kClmulStep <= n; done += kClmulStep) {
    const unsigned char* q = p + done;
    for (size_t line = 0; line < kClmulStep; line += 64) prefetch_ahead(q + line, kClmulPrefetch);
    a0 = fold512(a0, k2048, _mm512_loadu_si512(q));
    a1 = fold512(a1, k2048, _mm512_loadu_si512(q + 64));
    a2 = fold512(a2, k2048, _mm512_loadu_si512(q + 128));
    a3 = fold512(a3, k2048, _mm512_loadu_si512(q + 192));
  }
  a1 = fold512(a0, k512, a1);
  a2 = fold512(a1, k512, a2);
  a3 = fold512(a2, k512, a3);
  // a3's four 128-bit chunks sit 48, 32, 16 and 0 bytes before the last one.
  __m128i x = _mm512_maskz_extracti32x4_epi32(0xF, a3, 3);
  x = _mm_xor_si128(x, fold128(_mm512_maskz_extracti32x4_epi32(0xF, a3, 0), kc.by384));
  x = _mm_xor_si128(x, fold128(_mm512_maskz_extracti32x4_epi32(0xF, a3, 1), kc.by256));
  x = _mm_xor_si128(x, fold128(_mm512_maskz_extracti32x4_epi32(0xF, a3, 2), kc.by128));
  return finish(x);
}

// The same over 256-bit registers, for CPUs with VPCLMULQDQ but no AVX-512 (Intel's client cores
// since Alder Lake, AMD's Zen 3).
__attribute__((target("avx2,vpclmulqdq,pclmul"))) inline __m256i fold256(__m256i x, __m256i k, __m256i into) {
  return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11)), into);
}
__attribute__((target("avx2"))) inline __m256i in_both_lanes(const FoldConstants& f) {
  const auto lo = static_cast<long long>(f.lo), hi = static_cast<long long>(f.hi);
  return _mm256_set_epi64x(hi, lo, hi, lo);
}

__attribute__((target("avx2"))) inline __m256i load(const unsigned char* at) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
}

// Raw register c advanced over the first n - n % 128 bytes (n >= 128).
__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2"))) uint32_t clmul256_raw(const unsigned char* p, size_t n, uint32_t c) {
  const ClmulConstants& kc = clmul_constants();
  const __m256i k1024 = in_both_lanes(kc.by1024), k256 = in_both_lanes(kc.by256);
  __m256i a0 = _mm256_xor_si256(load(p), _mm256_zextsi128_si256(_mm_cvtsi32_si128(static_cast<int>(c))));
  __m256i a1 = load(p + 32), a2 = load(p + 64), a3 = load(p + 96);
  for (size_t done = kClmul256Step; done + kClmul256Step <= n; done += kClmul256Step) {
    const unsigned char* q = p + done;
    for (size_t line = 0; line < kClmul256Step; line += 64) prefetch_ahead(q + line, kClmulPrefetch);
    a0 = fold256(a0, k1024, load(q));
    a1 = fold256(a1, k1024, load(q + 32));
    a2 = fold256(a2, k1024, load(q + 64));
    a3 = fold256(a3, k1024, load(q + 96));
  }
  a1 = fold256(a0, k256, a1);
  a2 = fold256(a1, k256, a2);
  a3 = fold256(a2, k256, a3);
  return finish(_mm_xor_si128(_mm256_extracti128_si256(a3, 1), fold128(_mm256_castsi256_si128(a3), kc.by128)));
}
#endif

// Raw register c advanced over [p, p + n) by `path`, which the caller has checked the CPU has.
uint32_t raw_with(Crc32cPath path, const unsigned char* p, size_t n, uint32_t c) {
  switch (path) {
    case Crc32cPath::table: break;
#if defined(__x86_64__)
    case Crc32cPath::sse42: return hw_raw(p, n, c);
    case Crc32cPath::vpclmulqdq_avx2: return fold_then_hw(p, n, c, kClmul256Step, clmul256_raw);
    case Crc32cPath::vpclmulqdq_avx512: return fold_then_hw(p, n, c, kClmulStep, clmul_raw);
#else
    default: break;
#endif
  }
  return table_raw(p, n, c);
}

void require(Crc32cPath path) {
  if (!crc32c_supported(path)) throw std::invalid_argument(std::string("crc32c: this CPU has no ") + crc32c_name(path));
}

}  // namespace

bool crc32c_supported(Crc32cPath path) {
  switch (path) {
    case Crc32cPath::table: return true;
#if defined(__x86_64__)
    case Crc32cPath::sse42: {
      static const bool has = __builtin_cpu_supports("sse4.2");
      return has;
    }
    case Crc32cPath::vpclmulqdq_avx2: {
      static const bool has = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") &&
                              __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
      return has;
    }
    case Crc32cPath::vpclmulqdq_avx512: {
      static const bool has = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") &&
                              __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
      return has;
    }
#else
    case Crc32cPath::sse42:
    case Crc32cPath::vpclmulqdq_avx2:
    case Crc32cPath::vpclmulqdq_avx512: return false;
#endif
  }
  return false;
}

Crc32cPath crc32c_fastest() {
  static const Crc32cPath best = [] {
    for (Crc32cPath path : {Crc32cPath::vpclmulqdq_avx512, Crc32cPath::vpclmulqdq_avx2, Crc32cPath::sse42})
      if (crc32c_supported(path)) return path;
    return Crc32cPath::table;
  }();
  return best;
}

const char* crc32c_name(Crc32cPath path) {
  switch (path) {
    case Crc32cPath::table: return "table";
    case Crc32cPath::sse42: return "sse4.2";
    case Crc32cPath::vpclmulqdq_avx2: return "vpclmulqdq-avx2";
    case Crc32cPath::vpclmulqdq_avx512: return "vpclmulqdq-avx512";
  }
  return "?";
}

uint32_t crc32c_table(const void* data, size_t bytes, uint32_t crc) {
  return ~table_raw(static_cast<const unsigned char*>(data), bytes, ~crc);
}

uint32_t crc32c_with(Crc32cPath path, const void* data, size_t bytes, uint32_t crc) {
  require(path);
  return ~raw_with(path, static_cast<const unsigned char*>(data), bytes, ~crc);
}

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) { return crc32c_with(crc32c_fastest(), data, bytes, crc); }

void crc32c_blocks_with(Crc32cPath path, const void* data, size_t n_blocks, size_t block_bytes, uint32_t* out) {
  require(path);
  const auto* p = static_cast<const unsigned char*>(data);
  size_t k = 0;
#if defined(__x86_64__)
  if (path == Crc32cPath::sse42 && block_bytes % 8 == 0)
    for (; k + 3 <= n_blocks; k += 3) hw_three_blocks(p + k * block_bytes, block_bytes, out + k);
#endif
  for (; k < n_blocks; ++k) out[k] = ~raw_with(path, p + k * block_bytes, block_bytes, ~0u);
}

void crc32c_blocks(const void* data, size_t n_blocks, size_t block_bytes, uint32_t* out) {
  crc32c_blocks_with(crc32c_fastest(), data, n_blocks, block_bytes, out);
}

}  // namespace strata::io
