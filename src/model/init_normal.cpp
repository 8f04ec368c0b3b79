// Box-Muller in float over SplitMix64, in blocks: a scalar pass hashes the counters, a second
// pass does the float math in loops the compiler vectorises (our own logf and sincos
// polynomials, cephes' coefficients: libm's are neither vectorisable here nor the same
// everywhere). Libm's double-precision version cost 44.6 ns per pair; the 1.5B model's random
// init spent 17 s in it.
#include "src/model/init_normal.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "kernels/counter_rng.h"

namespace strata {
namespace {

using kernels::kSplitMixGamma;
using kernels::splitmix64_mix;

constexpr int kBlock = 256;  // pairs per pass: the scratch stays in L1

// sqrt(-2 ln u) for u = (b + 1) / 2^31. u's exponent and mantissa come from its float bits,
// the mantissa folded into [sqrt(1/2), sqrt(2)) for cephes' logf polynomial (relative error
// ~1e-7). The exponent is taken relative to 2^31 rather than subtracting 31 ln 2 at the end.
inline float radius(int32_t b) {
  const float v = static_cast<float>(b) + 1.0f;  // [1, 2^31]
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  float m = std::bit_cast<float>((bits & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  int32_t e = static_cast<int32_t>(bits >> 23) - 127 - 31;               // u = m * 2^e
  const bool fold = m > 1.41421356f;
  m = fold ? m * 0.5f : m;
  e += fold ? 1 : 0;
  // u >= sqrt(1/2) (e == 0): x = u - 1 from the integer 2^31 - 1 - b, exact where the float u
  // near 1 would have rounded it away (the radius of u near 1 is small and sqrt(2 (1 - u))).
  const float near_one = -static_cast<float>(2147483647 - b) * 4.65661287e-10f;  // 2^-31
  const float x = e == 0 ? near_one : m - 1.0f, z = x * x, fe = static_cast<float>(e);
  float y = 7.0376836292e-2f;
  y = y * x - 1.1514610310e-1f;
  y = y * x + 1.1676998740e-1f;
  y = y * x - 1.2420140846e-1f;
  y = y * x + 1.4249322787e-1f;
  y = y * x - 1.6668057665e-1f;
  y = y * x + 2.0000714765e-1f;
  y = y * x - 2.4999993993e-1f;
  y = y * x + 3.3333331174e-1f;
  y = y * x * z;
  y = y + fe * -2.12194440e-4f;  // ln 2 split in two parts, so e * ln 2 adds no rounding error
  y = y - 0.5f * z;
  const float ln_u = (x + y) + fe * 0.693359375f;
  return std::sqrt(std::max(0.0f, -2.0f * ln_u));
}

}  // namespace

uint64_t init_stream_key(uint64_t seed, uint64_t param) {
  return splitmix64_mix(seed * 0x100000001b3ull + param + kSplitMixGamma);
}

float uniform_at(uint64_t key, int64_t i) { return kernels::counter_uniform(key, i); }

void fill_uniform(uint64_t key, int64_t first, int64_t n, float bound, float* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = bound * (2.0f * uniform_at(key, first + k) - 1.0f);
}

// One clone per x86-64 level (AVX-512 runs ~5x faster than SSE2): each does the same IEEE
// operations in the same order, so all give the same bits (tests/src/test_init_normal.cpp).
// Not under ThreadSanitizer: the clones' ifunc resolver runs during relocation, before the
// TSan runtime is up, and its instrumented entry crashed every test binary that links this.
#if !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void fill_normal(uint64_t key, int64_t first, int64_t n, float scale, float* out) {
  if (n <= 0) return;
  alignas(64) int32_t rbits[kBlock], abits[kBlock];
  alignas(64) float pairs[2 * kBlock];
  const int64_t end = first + n;
  for (int64_t j0 = first / 2; 2 * j0 < end; j0 += kBlock) {
    const int np = static_cast<int>(std::min<int64_t>(kBlock, (end + 1) / 2 - j0));
    // Output j of SplitMix64 seeded with `key`: 31 bits for the radius, 24 for the angle.
    for (int i = 0; i < np; ++i) {
      const uint64_t r = splitmix64_mix(key + (static_cast<uint64_t>(j0 + i) + 1) * kSplitMixGamma);
      rbits[i] = static_cast<int32_t>(r >> 33);
      abits[i] = static_cast<int32_t>(r & 0xffffffu);
    }
    for (int i = 0; i < np; ++i) {
      const float rad = radius(rbits[i]) * scale;
      // The angle a / 2^24 turns = q quarter turns + x radians, |x| <= pi/4, with exact integer
      // arithmetic up to the one rounding of x.
      const int32_t a = abits[i], q = (a + (1 << 21)) >> 22, f = a - (q << 22);
      const float x = static_cast<float>(f) * 3.74507028e-7f, z = x * x;  // 2 pi / 2^24
      float s = -1.9515295891e-4f;
      s = s * z + 8.3321608736e-3f;
      s = s * z - 1.6666654611e-1f;
      s = s * z * x + x;
      float c = 2.443315711809948e-5f;
      c = c * z - 1.388731625493765e-3f;
      c = c * z + 4.166664568298827e-2f;
      c = c * z * z - 0.5f * z + 1.0f;
      // sin and cos of q quarter turns + x: swap on odd q, signs by quadrant.
      const bool odd = (q & 1) != 0;
      const float sin_t = (odd ? c : s) * ((q & 2) ? -1.0f : 1.0f);
      const float cos_t = (odd ? s : c) * (((q + 1) & 2) ? -1.0f : 1.0f);
      pairs[2 * i] = rad * cos_t;
      pairs[2 * i + 1] = rad * sin_t;
    }
    const int64_t lo = std::max(first, 2 * j0), hi = std::min(end, 2 * (j0 + np));
    std::memcpy(out + (lo - first), pairs + (lo - 2 * j0), static_cast<size_t>(hi - lo) * sizeof(float));
  }
}

}  // namespace strata
