// Shared helpers for the layer-op tests: typed buffers holding fp32/bf16/fp16 data, seeded
// random data, tolerance checks, and float64 central finite differences for backward checks.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/simd.h"
#include "kernels/dtype.h"

namespace strata::kernels::test {

// Fixture parameter (dtype, AVX-512 path on): the layer ops compile their loops for the baseline
// ISA and for AVX-512, so each test runs on both (the second is the portable path when the CPU
// lacks AVX-512).
class DtypeIsaTest : public ::testing::TestWithParam<std::tuple<DType, bool>> {
 protected:
  void SetUp() override { cpu::set_avx512_enabled(std::get<1>(GetParam())); }
  void TearDown() override { cpu::set_avx512_enabled(true); }
  static DType dtype() { return std::get<0>(GetParam()); }
};
// Runs f with n compute threads, then restores the default (all cores), even if f throws.
template <class F>
void with_threads(int n, F&& f) {
  struct Restore {
    ~Restore() { cpu::set_num_threads(0); }
  } restore;
  cpu::set_num_threads(n);
  f();
}

inline auto dtype_isa_values() {
  return ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16), ::testing::Bool());
}
inline std::string dtype_isa_name(const ::testing::TestParamInfo<std::tuple<DType, bool>>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + (std::get<1>(info.param) ? "_simd" : "_portable");
}

// A buffer of n elements of one dtype; values read back as double (exactly what was stored).
class TypedBuf {
 public:
  TypedBuf(DType t, size_t n) : t_(t), bytes_(n * dtype_size(t)), n_(n) {}
  TypedBuf(DType t, const std::vector<double>& v) : TypedBuf(t, v.size()) {
    for (size_t i = 0; i < v.size(); ++i) set(i, v[i]);
  }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  size_t size() const { return n_; }
  DType dtype() const { return t_; }
  double get(size_t i) const { return load_as_f32(bytes_.data(), t_, i); }
  void set(size_t i, double v) { store_from_f32(bytes_.data(), t_, i, static_cast<float>(v)); }
  std::vector<double> values() const {
    std::vector<double> v(n_);
    for (size_t i = 0; i < n_; ++i) v[i] = get(i);
    return v;
  }

 private:
  DType t_;
  std::vector<unsigned char> bytes_;
  size_t n_;
};

inline std::vector<double> random_vec(size_t n, uint32_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// |got - want| <= atol + rtol·|want| element-wise; reports the first few failures.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, double atol, double rtol,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]);
    if (!(err <= atol + rtol * std::abs(want[i]))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " want " << want[i] << " (err " << err << ")";
      if (++failures >= 5) return;
    }
  }
}

// Central finite differences of a scalar loss L(x) in float64: dL/dx[i] for every i.
inline std::vector<double> finite_diff(std::vector<double> x, const std::function<double(const std::vector<double>&)>& loss,
                                       double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss(x);
    x[i] = x0 - h;
    const double lm = loss(x);
    x[i] = x0;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace strata::kernels::test
