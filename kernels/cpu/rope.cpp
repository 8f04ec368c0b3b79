// CPU rotary position embedding (HF "rotate half" convention), in place on q or k, which may
// sit inside a fused qkv buffer (token_stride), at positions pos0 + t or per-token positions
// (packed documents). The backward is the inverse rotation (negative angle) applied to the
// gradient in place.
#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"

namespace strata::kernels::cpu {
namespace {

template <class E>
void rope_impl(const RopeArgs& a) {
  using T = typename E::T;
  const int64_t heads = a.heads, head_dim = a.head_dim, half = head_dim / 2, seq = a.seq;
  const int64_t token_stride = a.token_stride ? a.token_stride : heads * head_dim;
  T* x = static_cast<T*>(a.x);  // (batch, seq, heads, head_dim), token_stride between tokens
  const float sign = a.backward ? -1.f : 1.f;  // backward rotates by -angle: sin -> -sin
  parallel_simd(a.batch * seq, row_grain(heads * head_dim), [&](int64_t lo, int64_t hi) STRATA_SIMD_BODY {
    for (int64_t bt = lo; bt < hi; ++bt) {
      const int64_t pos = a.pos ? int64_t{a.pos[bt]} : a.pos0 + bt % seq;  // pos: (batch·seq)
      const float* cos = a.cos + pos * half;  // (head_dim/2)
      const float* sin = a.sin + pos * half;
      T* tok = x + bt * token_stride;
      for (int64_t h = 0; h < heads; ++h) {
        T* lo_half = tok + h * head_dim;
        T* hi_half = lo_half + half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = E::load(lo_half[i]), x2 = E::load(hi_half[i]);
          const float c = cos[i], s = sign * sin[i];
          lo_half[i] = E::store(x1 * c - x2 * s);
          hi_half[i] = E::store(x2 * c + x1 * s);
        }
      }
    }
  });
}

}  // namespace

void rope(const RopeArgs& a) {
  dispatch_dtype(a.dtype, [&](auto e) { rope_impl<decltype(e)>(a); });
}

}  // namespace strata::kernels::cpu
