// The fixed-order sum (reduce.h): blocks of elements summed source by source into an fp32
// accumulator, so the loops vectorise across elements while each element's order stays 0..n-1.
#include "src/comm/reduce.h"

#include <algorithm>
#include <cassert>
#include <cstdint>

namespace strata {

namespace {

using kernels::DType;

constexpr size_t kBlock = 1024;  // elements per accumulator block (4 KiB of fp32, on the stack)

void load(const void* src, DType t, size_t m, float* acc) {
  switch (t) {
    case DType::f32: std::copy_n(static_cast<const float*>(src), m, acc); return;
    case DType::bf16: {
      const auto* p = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < m; ++i) acc[i] = kernels::bf16_to_f32(p[i]);
      return;
    }
    case DType::f16: {
      const auto* p = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < m; ++i) acc[i] = kernels::f16_to_f32(p[i]);
      return;
    }
  }
}

void accumulate(const void* src, DType t, size_t m, float* acc) {
  switch (t) {
    case DType::f32: {
      const auto* p = static_cast<const float*>(src);
      for (size_t i = 0; i < m; ++i) acc[i] += p[i];
      return;
    }
    case DType::bf16: {
      const auto* p = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < m; ++i) acc[i] += kernels::bf16_to_f32(p[i]);
      return;
    }
    case DType::f16: {
      const auto* p = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < m; ++i) acc[i] += kernels::f16_to_f32(p[i]);
      return;
    }
  }
}

void store(const float* acc, DType t, size_t m, void* dst) {
  switch (t) {
    case DType::f32: std::copy_n(acc, m, static_cast<float*>(dst)); return;
    case DType::bf16: {
      auto* p = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < m; ++i) p[i] = kernels::f32_to_bf16(acc[i]);
      return;
    }
    case DType::f16: {
      auto* p = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < m; ++i) p[i] = kernels::f32_to_f16(acc[i]);
      return;
    }
  }
}

}  // namespace

void sum_in_rank_order(const void* const* srcs, int n, void* dst, size_t count, DType dtype) {
  assert(n >= 1);
  const size_t es = kernels::dtype_size(dtype);
  float acc[kBlock];
  for (size_t i0 = 0; i0 < count; i0 += kBlock) {
    const size_t m = std::min(kBlock, count - i0);
    const size_t off = i0 * es;
    // The whole block is read before any of it is written, so dst may be one of the sources.
    load(static_cast<const std::byte*>(srcs[0]) + off, dtype, m, acc);
    for (int k = 1; k < n; ++k) accumulate(static_cast<const std::byte*>(srcs[k]) + off, dtype, m, acc);
    store(acc, dtype, m, static_cast<std::byte*>(dst) + off);
  }
}

}  // namespace strata
