// LoRA's ops on the GPU (kernels/ops.h), bit for bit the CPU backend's: dequantize, a frozen
// weight matrix as --base-dtype stores it decoded to the working dtype, and dropout, the
// adapters' input mask from the counter-based stream. Products and sums are explicitly rounded
// (__fmul_rn, __fadd_rn: nvcc would otherwise contract them into FMAs), then rounded to the
// output dtype as every cast is.
#include <cuda_runtime.h>

#include <cstring>

#include "kernels/counter_rng.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/device.cuh"

namespace strata::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kNf4Block = 64, kNf4AbsmaxBlock = 256;

// The NF4 levels and the 256-entry dynamic map, by value (kernel parameters: 1088 bytes).
struct Nf4Tables {
  float levels[16];
  float map[256];
};

// Elements [e_lo, e_hi) of the matrix; element e_lo lands at out[0].
template <class T>
__global__ void nf4_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ absmax_codes,
                           const float* __restrict__ scales, const Nf4Tables tables, int64_t e_lo, int64_t e_hi,
                           T* __restrict__ out) {
  const float offset = scales[0];
  for (int64_t i = e_lo + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < e_hi;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / kNf4Block;
    const float absmax = __fadd_rn(__fmul_rn(tables.map[absmax_codes[b]], scales[1 + b / kNf4AbsmaxBlock]), offset);
    const uint8_t byte = codes[i >> 1];
    const int code = (i & 1) ? (byte & 15) : (byte >> 4);
    out[i - e_lo] = from_f32<T>(__fmul_rn(tables.levels[code], absmax));
  }
}

template <class T>
__global__ void int8_kernel(const int8_t* __restrict__ codes, const float* __restrict__ scales, int64_t cols,
                            int64_t e_lo, int64_t e_hi, T* __restrict__ out) {
  for (int64_t i = e_lo + blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < e_hi;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i - e_lo] = from_f32<T>(__fmul_rn(static_cast<float>(codes[i]), scales[i / cols]));
}

// (cols, mask_cols, mask_col0: DropoutArgs' mask slice; mask_cols 0: element i draws mask element i)
template <class T>
__global__ void dropout_kernel(const T* __restrict__ x, T* out, int64_t n, uint64_t key, float p, float keep_scale,
                               bool accumulate, int64_t cols, int64_t mask_cols, int64_t mask_col0) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t m = mask_cols > 0 ? (i / cols) * mask_cols + mask_col0 + i % cols : i;
    const float v = counter_uniform(key, m) >= p ? __fmul_rn(to_f32(x[i]), keep_scale) : 0.f;
    out[i] = from_f32<T>(accumulate ? __fadd_rn(to_f32(out[i]), v) : v);
  }
}

}  // namespace

void CudaOps::do_dropout(Stream& s, const DropoutArgs& a) {
  StreamContext& ctx = context(s);
  const float keep_scale = 1.f / (1.f - a.p);  // on the host, as the CPU rounds it
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    dropout_kernel<T><<<grid_for(a.n, kThreads * 8), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(a.x), static_cast<T*>(a.out), a.n, a.key, a.p, keep_scale, a.accumulate, a.cols,
        a.mask_cols, a.mask_col0);
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

void CudaOps::do_dequantize(Stream& s, const DequantizeArgs& a) {
  const int64_t e_lo = a.row_lo * a.cols, e_hi = a.hi() * a.cols;
  if (a.format == StoredFormat::bf16 || a.format == StoredFormat::fp16) {  // a cast from the stored dtype
    const DType from = a.format == StoredFormat::bf16 ? DType::bf16 : DType::f16;
    do_cast(s, {.n = e_hi - e_lo,
                .src = static_cast<const uint16_t*>(a.codes) + e_lo,
                .src_dtype = from,
                .dst = a.out,
                .dst_dtype = a.out_dtype});
    return;
  }
  StreamContext& ctx = context(s);
  const unsigned grid = grid_for(e_hi - e_lo, kThreads * 8);
  dispatch_dtype(a.out_dtype, [&](auto tag) {
    using T = decltype(tag);
    if (a.format == StoredFormat::int8) {
      int8_kernel<T><<<grid, kThreads, 0, ctx.stream()>>>(static_cast<const int8_t*>(a.codes), a.scales, a.cols, e_lo,
                                                         e_hi, static_cast<T*>(a.out));
    } else {
      Nf4Tables t;
      std::memcpy(t.levels, a.levels, sizeof t.levels);
      std::memcpy(t.map, a.map, sizeof t.map);
      nf4_kernel<T><<<grid, kThreads, 0, ctx.stream()>>>(static_cast<const uint8_t*>(a.codes), a.absmax_codes,
                                                        a.scales, t, e_lo, e_hi, static_cast<T*>(a.out));
    }
    STRATA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace strata::kernels::cuda
