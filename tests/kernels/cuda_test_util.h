// Helpers for the CUDA-vs-CPU op tests (ggml's test-backend-ops idea): typed host buffers with
// seeded random data, device copies through the public runtime, and the normalised mean squared
// error Σ(got - want)² / Σ want² that each op is bounded by per dtype. Tests skip without a GPU.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/ops.h"
#include "kernels/runtime.h"

namespace strata::kernels::cudatest {

#define STRATA_SKIP_WITHOUT_CUDA()                                                              \
  do {                                                                                          \
    if (!::strata::kernels::cuda_available())                                                   \
      GTEST_SKIP() << "no CUDA device visible (or strata built without CUDA): CUDA op tests run on a GPU machine"; \
  } while (0)

// n elements of one dtype in host memory.
struct HostBuf {
  DType t = DType::f32;
  size_t n = 0;
  std::vector<uint8_t> bytes;
  HostBuf() = default;
  HostBuf(DType type, size_t count) : t(type), n(count), bytes(count * dtype_size(type), 0) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  size_t size_bytes() const { return bytes.size(); }
  double get(size_t i) const { return load_as_f32(bytes.data(), t, i); }
  void set(size_t i, double v) { store_from_f32(bytes.data(), t, i, static_cast<float>(v)); }
  template <class T> T* as() { return reinterpret_cast<T*>(bytes.data()); }
  static HostBuf random(DType t, size_t n, uint32_t seed, double lo = -1.0, double hi = 1.0) {
    HostBuf b(t, n);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> d(lo, hi);
    for (size_t i = 0; i < n; ++i) b.set(i, d(rng));
    return b;
  }
};

// Σ(got - want)² / Σ want² over all elements (0 when both are all zero; inf on a NaN).
inline double nmse(const HostBuf& got, const HostBuf& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.n; ++i) {
    const double g = got.get(i), w = want.get(i);
    if (std::isnan(g) != std::isnan(w)) return INFINITY;
    num += (g - w) * (g - w);
    den += w * w;
  }
  if (num == 0) return 0;
  return den > 0 ? num / den : INFINITY;
}

#define EXPECT_NMSE(got, want, bound, what)                                                                 \
  do {                                                                                                      \
    const double strata_e_ = ::strata::kernels::cudatest::nmse(got, want);                                  \
    EXPECT_LE(strata_e_, bound) << (what) << ": normalised MSE " << strata_e_ << " above " << (bound);      \
  } while (0)

inline bool bitwise_equal(const HostBuf& a, const HostBuf& b) { return a.bytes == b.bytes; }

// Per-dtype bounds for an op whose every output is one rounding of an fp32 result on both
// backends (elementwise, norms, GEMM outputs): the two may differ by an ulp of the dtype.
inline double rounding_bound(DType t) {
  switch (t) {
    case DType::f32: return 1e-10;
    case DType::f16: return 1e-6;
    case DType::bf16: return 5e-5;
  }
  return 0;
}

// The CUDA runtime, one stream, and device copies of host buffers.
class Gpu {
 public:
  Gpu() : rt_(make_runtime(Backend::cuda)), s_(rt_->create_stream()) {}
  Runtime& rt() { return *rt_; }
  Ops& ops() { return rt_->ops(); }
  Stream& stream() { return *s_; }
  // A device buffer holding a copy of b (at least 256 bytes so empty-ish buffers are valid).
  DeviceBuffer up(const HostBuf& b) {
    DeviceBuffer d(*rt_, b.size_bytes() < 256 ? 256 : b.size_bytes());
    s_->memcpy_async(d.data(), b.data(), b.size_bytes());
    s_->synchronize();
    return d;
  }
  DeviceBuffer up_bytes(const void* p, size_t bytes) {
    DeviceBuffer d(*rt_, bytes < 256 ? 256 : bytes);
    s_->memcpy_async(d.data(), p, bytes);
    s_->synchronize();
    return d;
  }
  // Waits for the stream, then copies n elements of dtype t back.
  HostBuf down(const DeviceBuffer& d, DType t, size_t n) {
    HostBuf b(t, n);
    s_->memcpy_async(b.data(), d.data(), b.size_bytes());
    s_->synchronize();
    return b;
  }
  HostBuf down(const DeviceBuffer& d, const HostBuf& like) { return down(d, like.t, like.n); }

 private:
  std::unique_ptr<Runtime> rt_;
  std::unique_ptr<Stream> s_;
};

inline std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return std::string(dtype_name(info.param));
}

}  // namespace strata::kernels::cudatest
