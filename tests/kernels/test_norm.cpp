// RMSNorm and LayerNorm on the CPU backend: forward (y, saved mean/rstd) against a float64
// reference; backward (dx, dweight, dbias) against float64 central finite differences of
// L = Σ w·y, with the accumulate (dx +=) and always-accumulating dweight/dbias checked.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "kernels/cpu/cpu_ops.h"
#include "layer_test_util.h"

using namespace strata::kernels;
using namespace strata::kernels::test;

namespace {

struct Shape {
  int64_t rows, cols;
};
const Shape kShapes[] = {{1, 1}, {3, 3}, {2, 17}, {5, 129}, {70, 64}};
constexpr float kEps = 1e-5f;

// y = norm(x)·weight (+ bias), float64.
std::vector<double> norm_ref(bool layernorm, int64_t rows, int64_t cols, const std::vector<double>& x,
                             const std::vector<double>& weight, const std::vector<double>& bias,
                             std::vector<double>* mean_out = nullptr, std::vector<double>* rstd_out = nullptr) {
  std::vector<double> y(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x.data() + r * cols;
    double mean = 0, var = 0;
    if (layernorm) {
      for (int64_t c = 0; c < cols; ++c) mean += xr[c];
      mean /= cols;
    }
    for (int64_t c = 0; c < cols; ++c) var += (xr[c] - mean) * (xr[c] - mean);
    const double rstd = 1 / std::sqrt(var / cols + kEps);
    if (mean_out) (*mean_out)[r] = mean;
    if (rstd_out) (*rstd_out)[r] = rstd;
    for (int64_t c = 0; c < cols; ++c)
      y[r * cols + c] = (xr[c] - mean) * rstd * weight[c] + (bias.empty() ? 0.0 : bias[c]);
  }
  return y;
}

// (dtype, LayerNorm rather than RMSNorm, AVX-512 path on).
class NormTest : public ::testing::TestWithParam<std::tuple<DType, bool, bool>> {
 protected:
  void SetUp() override { cpu::set_avx512_enabled(std::get<2>(GetParam())); }
  void TearDown() override { cpu::set_avx512_enabled(true); }
};

TEST_P(NormTest, ForwardAndBackwardMatchFloat64) {
  const auto [t, layernorm, simd] = GetParam();
  const double rtol = t == DType::f32 ? 1e-5 : (t == DType::bf16 ? 1.5e-2 : 3e-3);
  uint32_t seed = layernorm ? 100 : 200;
  for (const Shape s : kShapes) {
    const int64_t rows = s.rows, cols = s.cols, n = rows * cols;
    const std::string what = std::string(layernorm ? "layernorm " : "rmsnorm ") + std::to_string(rows) + "x" +
                             std::to_string(cols) + " " + std::string(dtype_name(t));
    // A non-zero mean per row makes LayerNorm's centring matter.
    std::vector<double> x0 = random_vec(n, seed++, -2, 2);
    for (int64_t i = 0; i < n; ++i) x0[i] += 0.5 * static_cast<double>(i / cols % 3);
    TypedBuf x(t, x0), weight(t, random_vec(cols, seed++, 0.5, 1.5)), bias(t, random_vec(cols, seed++));
    const auto xv = x.values(), wv = weight.values();
    const auto bv = layernorm ? bias.values() : std::vector<double>{};
    std::vector<double> mean_ref(rows), rstd_ref(rows);
    const auto y_ref = norm_ref(layernorm, rows, cols, xv, wv, bv, &mean_ref, &rstd_ref);

    TypedBuf y(t, n);
    std::vector<float> mean(rows), rstd(rows);
    NormArgs fa{.dtype = t, .rows = rows, .cols = cols, .eps = kEps, .x = x.data(), .weight = weight.data(),
                .bias = layernorm ? bias.data() : nullptr, .y = y.data(), .mean = layernorm ? mean.data() : nullptr,
                .rstd = rstd.data()};
    if (layernorm) cpu::layernorm(fa);
    else cpu::rmsnorm(fa);
    expect_close(y.values(), y_ref, 1e-5, rtol, what + " y");
    expect_close(std::vector<double>(rstd.begin(), rstd.end()), rstd_ref, 0, 1e-5, what + " rstd");
    if (layernorm) expect_close(std::vector<double>(mean.begin(), mean.end()), mean_ref, 1e-6, 1e-6, what + " mean");

    // Backward: L = Σ w·y.
    TypedBuf wgt(t, random_vec(n, seed++));
    const auto lw = wgt.values();
    const auto fd_x = finite_diff(xv, [&](const auto& v) { return dot(lw, norm_ref(layernorm, rows, cols, v, wv, bv)); });
    const auto fd_w = finite_diff(wv, [&](const auto& v) { return dot(lw, norm_ref(layernorm, rows, cols, xv, v, bv)); });
    std::vector<double> fd_b;
    if (layernorm)
      fd_b = finite_diff(bv, [&](const auto& v) { return dot(lw, norm_ref(layernorm, rows, cols, xv, wv, v)); });

    const auto dw0 = random_vec(cols, seed++), db0 = random_vec(cols, seed++);
    std::vector<float> dweight(dw0.begin(), dw0.end()), dbias(db0.begin(), db0.end());
    TypedBuf dx(t, random_vec(n, seed++));  // garbage: overwritten
    NormBackwardArgs ba{.dtype = t, .rows = rows, .cols = cols, .x = x.data(), .weight = weight.data(),
                        .dy = wgt.data(), .mean = layernorm ? mean.data() : nullptr, .rstd = rstd.data(),
                        .dx = dx.data(), .dweight = dweight.data(), .dbias = layernorm ? dbias.data() : nullptr};
    auto run = [&] {
      if (layernorm) cpu::layernorm_backward(ba);
      else cpu::rmsnorm_backward(ba);
    };
    run();
    const double dx_atol = 1e-5 + rtol * max_abs(fd_x);
    expect_close(dx.values(), fd_x, dx_atol, rtol, what + " dx");
    std::vector<double> want_dw(cols), want_db(cols);
    for (int64_t c = 0; c < cols; ++c) want_dw[c] = dw0[c] + fd_w[c];
    if (layernorm)
      for (int64_t c = 0; c < cols; ++c) want_db[c] = db0[c] + fd_b[c];
    const double dw_atol = 1e-4 + rtol * max_abs(fd_w);
    expect_close(std::vector<double>(dweight.begin(), dweight.end()), want_dw, dw_atol, rtol, what + " dweight +=");
    if (layernorm)
      expect_close(std::vector<double>(dbias.begin(), dbias.end()), want_db, 1e-4, 1e-5, what + " dbias +=");
    else
      EXPECT_EQ(std::vector<float>(db0.begin(), db0.end()), dbias) << what << ": rmsnorm must not touch dbias";

    // accumulate: dx += grad (so dx = 2·grad), and the parameter grads accumulate a second time.
    ba.accumulate = true;
    run();
    std::vector<double> twice(fd_x);
    for (auto& v : twice) v *= 2;
    expect_close(dx.values(), twice, 2 * dx_atol, 2 * rtol, what + " dx accumulate");
    for (int64_t c = 0; c < cols; ++c) want_dw[c] += fd_w[c];
    expect_close(std::vector<double>(dweight.begin(), dweight.end()), want_dw, 2 * dw_atol, rtol,
                 what + " dweight += twice");
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, NormTest,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16),
                                            ::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<1>(info.param) ? "layernorm_" : "rmsnorm_") +
                                  std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<2>(info.param) ? "_simd" : "_portable");
                         });

TEST(NormOps, RowsAreIndependentOfThreadingAndDeterministic) {
  // Many rows: the dweight reduction runs over several row blocks; runs on 1 and on 3 threads
  // (different partitions of the blocks) agree bitwise.
  const int64_t rows = 1000, cols = 96;
  const auto x = random_vec(rows * cols, 7), w = random_vec(cols, 8), dy = random_vec(rows * cols, 9);
  std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end()), dyf(dy.begin(), dy.end());
  std::vector<float> y(rows * cols), mean(rows), rstd(rows), dx(rows * cols);
  cpu::layernorm({.rows = rows, .cols = cols, .x = xf.data(), .weight = wf.data(), .y = y.data(),
                  .mean = mean.data(), .rstd = rstd.data()});
  std::vector<float> dw1(cols, 0.f), dw2(cols, 0.f);
  for (auto [dw, threads] : {std::pair{&dw1, 1}, std::pair{&dw2, 3}})
    with_threads(threads, [&] {
      cpu::layernorm_backward({.rows = rows, .cols = cols, .x = xf.data(), .weight = wf.data(), .dy = dyf.data(),
                               .mean = mean.data(), .rstd = rstd.data(), .dx = dx.data(), .dweight = dw->data()});
    });
  EXPECT_EQ(dw1, dw2);
  // And dweight equals the float64 column sums Σ_r dy·xhat.
  std::vector<double> want(cols, 0.0), got(dw1.begin(), dw1.end());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      want[c] += double(dyf[r * cols + c]) * (double(xf[r * cols + c]) - mean[r]) * rstd[r];
  expect_close(got, want, 1e-3, 1e-4, "layernorm dweight over 1000 rows");
}

}  // namespace
