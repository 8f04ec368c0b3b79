// Every CUDA op against the CPU backend on fresh random inputs (fp32, bf16, fp16), bounded by a
// normalised mean squared error per op and dtype, forward and backward, with the awkward cases
// (transposes, leading dims, batches, accumulate flags, ignored targets, in-place, shapes that
// are not multiples of a tile), plus bitwise determinism of every reduction and the device-side
// bad-id report. Attention is in test_cuda_attention.cpp. All skip without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "tests/kernels/cuda_test_util.h"

using namespace strata::kernels;
using namespace strata::kernels::cudatest;

namespace {

class CudaOpsTest : public ::testing::TestWithParam<DType> {
 protected:
  static DType dtype() { return GetParam(); }
};
INSTANTIATE_TEST_SUITE_P(DTypes, CudaOpsTest, ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         dtype_param_name);

// ---- matmul ----------------------------------------------------------------------------------

TEST_P(CudaOpsTest, MatmulMatchesCpuOverTransposesLeadingDimsBatchesAndBeta) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t m = 37, n = 45, k = 70, batch = 3, pad = 5;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (DType ct : {DType::f32, dtype()})
        for (int64_t bt : {int64_t{1}, batch}) {
          MatmulArgs a;
          a.ab_dtype = dtype(), a.c_dtype = ct, a.m = m, a.n = n, a.k = k, a.trans_a = ta, a.trans_b = tb;
          const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
          a.lda = a_cols + pad, a.ldb = b_cols + pad, a.ldc = n + pad, a.batch = bt;
          a.stride_a = a_rows * a.lda + 3, a.stride_b = b_rows * a.ldb + 7, a.stride_c = m * a.ldc + 2;
          a.alpha = 0.5f, a.beta = ct == DType::f32 ? 0.75f : 0.f;
          HostBuf A = HostBuf::random(dtype(), a.stride_a * bt, 1), B = HostBuf::random(dtype(), a.stride_b * bt, 2);
          HostBuf C = HostBuf::random(ct, a.stride_c * bt, 3);
          DeviceBuffer dA = gpu.up(A), dB = gpu.up(B), dC = gpu.up(C);
          MatmulArgs ga = a;
          ga.a = dA.data(), ga.b = dB.data(), ga.c = dC.data();
          gpu.ops().matmul(gpu.stream(), ga);
          a.a = A.data(), a.b = B.data(), a.c = C.data();
          cpu::matmul(a);
          const std::string what = "matmul ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " c=" +
                                   std::string(dtype_name(ct)) + " batch=" + std::to_string(bt);
          EXPECT_NMSE(gpu.down(dC, C), C, dtype() == DType::f32 ? 1e-10 : rounding_bound(ct) + 1e-9, what);
        }
}

// The LM-head and MLP shapes of a small model, packed (what the trainer calls).
TEST_P(CudaOpsTest, MatmulMatchesCpuAtModelShapes) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  struct S { int64_t m, n, k; bool ta, tb; };
  for (S sh : {S{128, 768, 256, false, true}, S{768, 256, 128, true, false}, S{128, 1000, 64, false, true}}) {
    MatmulArgs a;
    a.ab_dtype = dtype(), a.c_dtype = DType::f32, a.m = sh.m, a.n = sh.n, a.k = sh.k, a.trans_a = sh.ta,
    a.trans_b = sh.tb, a.beta = 1.f;
    HostBuf A = HostBuf::random(dtype(), sh.m * sh.k, 4), B = HostBuf::random(dtype(), sh.k * sh.n, 5);
    HostBuf C = HostBuf::random(DType::f32, sh.m * sh.n, 6);
    DeviceBuffer dA = gpu.up(A), dB = gpu.up(B), dC = gpu.up(C);
    MatmulArgs ga = a;
    ga.a = dA.data(), ga.b = dB.data(), ga.c = dC.data();
    gpu.ops().matmul(gpu.stream(), ga);
    a.a = A.data(), a.b = B.data(), a.c = C.data();
    cpu::matmul(a);
    EXPECT_NMSE(gpu.down(dC, C), C, 1e-10, "matmul " + std::to_string(sh.m) + "x" + std::to_string(sh.n));
  }
}

// ---- bias -----------------------------------------------------------------------------------

TEST_P(CudaOpsTest, BiasAddAndDeterministicBiasBackward) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t rows = 1031, cols = 77;
  HostBuf y = HostBuf::random(dtype(), rows * cols, 1), bias = HostBuf::random(dtype(), cols, 2);
  DeviceBuffer dy_ = gpu.up(y), dbias_ = gpu.up(bias);
  gpu.ops().bias_add(gpu.stream(), {dtype(), rows, cols, dy_.data(), dbias_.data()});
  cpu::bias_add({dtype(), rows, cols, y.data(), bias.data()});
  EXPECT_NMSE(gpu.down(dy_, y), y, rounding_bound(dtype()), "bias_add");

  HostBuf g = HostBuf::random(dtype(), rows * cols, 3), db = HostBuf::random(DType::f32, cols, 4);
  DeviceBuffer dg = gpu.up(g), ddb = gpu.up(db);
  HostBuf db0 = db;
  gpu.ops().bias_backward(gpu.stream(), {dtype(), rows, cols, dg.data(), ddb.as<float>()});
  cpu::bias_backward({dtype(), rows, cols, g.data(), db.as<float>()});
  const HostBuf first = gpu.down(ddb, db);
  EXPECT_NMSE(first, db, 1e-10, "bias_backward (accumulates into dbias)");
  DeviceBuffer ddb2 = gpu.up(db0);
  gpu.ops().bias_backward(gpu.stream(), {dtype(), rows, cols, dg.data(), ddb2.as<float>()});
  EXPECT_TRUE(bitwise_equal(gpu.down(ddb2, db), first)) << "bias_backward is not bitwise reproducible";
}

// ---- elementwise -----------------------------------------------------------------------------

TEST_P(CudaOpsTest, SwigluFusedForwardBackwardInPlace) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t rows = 67, cols = 130, ld = 2 * cols;  // a fused [gate | up] projection
  HostBuf gu = HostBuf::random(dtype(), rows * ld, 1, -4, 4), dout = HostBuf::random(dtype(), rows * cols, 2);
  HostBuf out(dtype(), rows * cols);
  DeviceBuffer dgu = gpu.up(gu), ddout = gpu.up(dout), dout_ = gpu.up(out);
  auto* g0 = static_cast<char*>(dgu.data());
  const size_t half = cols * dtype_size(dtype());
  gpu.ops().swiglu(gpu.stream(), {dtype(), rows, cols, ld, g0, g0 + half, dout_.data()});
  cpu::swiglu({dtype(), rows, cols, ld, gu.data(), gu.as<char>() + half, out.data()});
  EXPECT_NMSE(gpu.down(dout_, out), out, rounding_bound(dtype()), "swiglu");
  // Backward in place: dgate/dup overwrite gate/up.
  gpu.ops().swiglu_backward(gpu.stream(), {dtype(), rows, cols, ld, g0, g0 + half, ddout.data(), g0, g0 + half});
  cpu::swiglu_backward({dtype(), rows, cols, ld, gu.data(), gu.as<char>() + half, dout.data(), gu.data(),
                        gu.as<char>() + half});
  EXPECT_NMSE(gpu.down(dgu, gu), gu, 4 * rounding_bound(dtype()), "swiglu_backward in place");
}

TEST_P(CudaOpsTest, GeluExactAndTanhForwardBackwardWithAccumulate) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n = 10007;
  for (bool tanh_approx : {false, true})
    for (bool acc : {false, true}) {
      HostBuf x = HostBuf::random(dtype(), n, 1, -5, 5), y(dtype(), n), dy = HostBuf::random(dtype(), n, 2);
      HostBuf dx = HostBuf::random(dtype(), n, 3);
      DeviceBuffer dx_ = gpu.up(x), dy_out = gpu.up(y), ddy = gpu.up(dy), ddx = gpu.up(dx);
      gpu.ops().gelu(gpu.stream(), {dtype(), n, tanh_approx, dx_.data(), dy_out.data()});
      cpu::gelu({dtype(), n, tanh_approx, x.data(), y.data()});
      const std::string what = std::string(tanh_approx ? "gelu_tanh" : "gelu") + (acc ? " accumulate" : "");
      EXPECT_NMSE(gpu.down(dy_out, y), y, rounding_bound(dtype()) + 1e-11, what);
      gpu.ops().gelu_backward(gpu.stream(), {dtype(), n, tanh_approx, dx_.data(), ddy.data(), ddx.data(), acc});
      cpu::gelu_backward({dtype(), n, tanh_approx, x.data(), dy.data(), dx.data(), acc});
      EXPECT_NMSE(gpu.down(ddx, dx), dx, rounding_bound(dtype()) + 1e-11, what + " backward");
    }
}

TEST_P(CudaOpsTest, AddInPlaceScaleAndRope) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n = 4099;
  HostBuf a = HostBuf::random(dtype(), n, 1), b = HostBuf::random(dtype(), n, 2);
  DeviceBuffer da = gpu.up(a), db = gpu.up(b);
  gpu.ops().add(gpu.stream(), {dtype(), n, da.data(), db.data(), da.data()});  // out aliases a
  cpu::add({dtype(), n, a.data(), b.data(), a.data()});
  EXPECT_NMSE(gpu.down(da, a), a, rounding_bound(dtype()), "add");
  gpu.ops().scale(gpu.stream(), {dtype(), n, da.data(), -0.37f});
  cpu::scale({dtype(), n, a.data(), -0.37f});
  EXPECT_NMSE(gpu.down(da, a), a, rounding_bound(dtype()), "scale");

  // RoPE on q and k inside a fused qkv buffer, positions from pos0, then the backward.
  const int64_t B = 2, T = 19, Hq = 4, Hkv = 2, D = 24, stride = (Hq + 2 * Hkv) * D, max_pos = 64;
  HostBuf qkv = HostBuf::random(dtype(), B * T * stride, 3);
  HostBuf cs(DType::f32, max_pos * D / 2), sn(DType::f32, max_pos * D / 2);
  for (int64_t p = 0; p < max_pos; ++p)
    for (int64_t i = 0; i < D / 2; ++i) {
      const double ang = p * std::pow(10000.0, -2.0 * i / D);
      cs.set(p * D / 2 + i, std::cos(ang)), sn.set(p * D / 2 + i, std::sin(ang));
    }
  DeviceBuffer dqkv = gpu.up(qkv), dcs = gpu.up(cs), dsn = gpu.up(sn);
  const size_t es = dtype_size(dtype());
  // pos0 = 5 (pos null), or per-token positions that restart at each 7-token packed document.
  auto rotate = [&](int64_t pos0, const int32_t* pos, const int32_t* dpos) {
    for (bool backward : {false, true})
      for (auto [off, heads] : {std::pair<int64_t, int64_t>{0, Hq}, {Hq * D, Hkv}}) {
        RopeArgs r{dtype(), B, T, heads, D, stride, pos0, max_pos, nullptr, nullptr, nullptr, backward, pos};
        RopeArgs gr = r;
        gr.x = static_cast<char*>(dqkv.data()) + off * es, gr.cos = dcs.as<float>(), gr.sin = dsn.as<float>();
        gr.pos = dpos;
        gpu.ops().rope(gpu.stream(), gr);
        r.x = qkv.as<char>() + off * es, r.cos = cs.as<float>(), r.sin = sn.as<float>();
        cpu::rope(r);
      }
  };
  rotate(5, nullptr, nullptr);
  EXPECT_NMSE(gpu.down(dqkv, qkv), qkv, 4 * rounding_bound(dtype()), "rope forward+backward in fused qkv");
  std::vector<int32_t> pos(B * T);
  for (int64_t i = 0; i < B * T; ++i) pos[i] = static_cast<int32_t>(i % T % 7);
  DeviceBuffer dpos = gpu.up_bytes(pos.data(), pos.size() * sizeof(int32_t));
  rotate(0, pos.data(), dpos.as<int32_t>());
  EXPECT_NMSE(gpu.down(dqkv, qkv), qkv, 8 * rounding_bound(dtype()), "rope with per-token positions");
}

TEST(CudaOps, CastMatchesCpuBitForBitOnFiniteValues) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  // Normal values, fp16 subnormals and overflow, bf16 rounding ties.
  const int64_t n = 6000;
  HostBuf src(DType::f32, n);
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> d(-1, 1);
  for (int64_t i = 0; i < n; ++i) {
    const double scale = i % 3 == 0 ? 1e-6 : i % 3 == 1 ? 1.0 : 7e4;
    src.set(i, d(rng) * scale);
  }
  src.as<uint32_t>()[0] = 0x3f808000u;  // exactly halfway between two bf16 values
  for (DType from : {DType::f32, DType::bf16, DType::f16})
    for (DType to : {DType::f32, DType::bf16, DType::f16}) {
      HostBuf s(from, n);
      cpu::cast({n, src.data(), DType::f32, s.data(), from});
      HostBuf want(to, n);
      cpu::cast({n, s.data(), from, want.data(), to});
      DeviceBuffer ds = gpu.up(s), dd(gpu.rt(), want.size_bytes());
      gpu.ops().cast(gpu.stream(), {n, ds.data(), from, dd.data(), to});
      EXPECT_TRUE(bitwise_equal(gpu.down(dd, want), want))
          << "cast " << dtype_name(from) << " -> " << dtype_name(to) << " differs from the CPU";
    }
}

// LoRA's stored base: every format decoded on the GPU as on the CPU, bit for bit (fp32, bf16,
// fp16 out), whole and as a row slice cut through NF4's 64-element blocks, from random bytes
// (any bytes decode: codes, 8-bit absmax codes, scales and tables are all just values here).
TEST(CudaOps, DequantizeMatchesCpuBitForBit) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t rows = 37, cols = 100, n = rows * cols;
  std::mt19937 rng(11);
  std::vector<uint8_t> codes(static_cast<size_t>(2 * n)), absmax_codes(static_cast<size_t>((n + 63) / 64));
  for (auto& c : codes) c = static_cast<uint8_t>(rng());
  for (auto& c : absmax_codes) c = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> scales(static_cast<size_t>(rows + 1)), levels(16), map(256);
  for (auto& v : scales) v = d(rng) * 0.05f;
  for (auto& v : levels) v = d(rng);
  for (auto& v : map) v = d(rng);
  // bf16 and fp16 codes must be finite values: the low bytes random, the high ones moderate.
  for (int64_t i = 0; i < n; ++i) codes[static_cast<size_t>(2 * i + 1)] = static_cast<uint8_t>(0x30 + rng() % 0x10);
  DeviceBuffer dcodes = gpu.up_bytes(codes.data(), codes.size()), dabs = gpu.up_bytes(absmax_codes.data(), absmax_codes.size());
  DeviceBuffer dscales = gpu.up_bytes(scales.data(), scales.size() * 4);
  for (StoredFormat f : {StoredFormat::bf16, StoredFormat::fp16, StoredFormat::int8, StoredFormat::nf4})
    for (DType to : {DType::f32, DType::bf16, DType::f16})
      for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, rows}, {5, 29}}) {
        DequantizeArgs a{.format = f, .rows = rows, .cols = cols, .row_lo = lo, .row_hi = hi, .codes = codes.data(),
                         .absmax_codes = absmax_codes.data(), .scales = scales.data(), .levels = levels.data(),
                         .map = map.data(), .out = nullptr, .out_dtype = to};
        HostBuf want(to, static_cast<size_t>((hi - lo) * cols));
        a.out = want.data();
        cpu::dequantize(a);
        DeviceBuffer dout(gpu.rt(), want.size_bytes());
        a.codes = dcodes.data();
        a.absmax_codes = static_cast<const uint8_t*>(dabs.data());
        a.scales = static_cast<const float*>(dscales.data());
        a.out = dout.data();
        gpu.ops().dequantize(gpu.stream(), a);
        EXPECT_TRUE(bitwise_equal(gpu.down(dout, want), want))
            << "dequantize format " << static_cast<int>(f) << " -> " << dtype_name(to) << " rows [" << lo << ", " << hi
            << ") differs from the CPU";
      }
}

// LoRA's adapter dropout: the same mask and the same bits as the CPU (every dtype; plain and
// accumulating into what is there).
TEST_P(CudaOpsTest, DropoutMatchesCpuBitForBit) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n = 10007;
  const HostBuf x = HostBuf::random(dtype(), n, 3), base = HostBuf::random(dtype(), n, 4);
  for (const bool accumulate : {false, true}) {
    HostBuf want = base;
    cpu::dropout({.dtype = dtype(), .n = n, .x = x.data(), .out = want.data(), .key = 0x1234567ull, .p = 0.1f,
                  .accumulate = accumulate});
    DeviceBuffer dx = gpu.up(x), dout = gpu.up(base);
    gpu.ops().dropout(gpu.stream(), {.dtype = dtype(), .n = n, .x = dx.data(), .out = dout.data(), .key = 0x1234567ull,
                                     .p = 0.1f, .accumulate = accumulate});
    EXPECT_TRUE(bitwise_equal(gpu.down(dout, want), want)) << "dropout, accumulate " << accumulate;
  }
  // A column slice of a wider mask (tensor parallelism): columns [40, 71) of 113.
  const int64_t cols = 31, rows = 17;
  const HostBuf xs = HostBuf::random(dtype(), rows * cols, 5);
  HostBuf want = HostBuf::random(dtype(), rows * cols, 6);
  DeviceBuffer dxs = gpu.up(xs), douts = gpu.up(want);
  const DropoutArgs slice{.dtype = dtype(), .n = rows * cols, .x = xs.data(), .out = want.data(), .key = 9, .p = 0.2f,
                          .accumulate = false, .cols = cols, .mask_cols = 113, .mask_col0 = 40};
  cpu::dropout(slice);
  DropoutArgs on_gpu = slice;
  on_gpu.x = dxs.data();
  on_gpu.out = douts.data();
  gpu.ops().dropout(gpu.stream(), on_gpu);
  EXPECT_TRUE(bitwise_equal(gpu.down(douts, want), want)) << "dropout of a mask slice";
}

// ---- embedding -------------------------------------------------------------------------------

TEST_P(CudaOpsTest, EmbeddingForwardAccumulateAndDeterministicBackward) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n_tokens = 777, dim = 300, vocab = 97;  // many repeated ids
  std::vector<int32_t> ids(n_tokens);
  for (int64_t t = 0; t < n_tokens; ++t) ids[t] = static_cast<int32_t>((t * 37 + t / 5) % vocab);
  ids[3] = ids[4] = ids[5] = 11;
  HostBuf table = HostBuf::random(dtype(), vocab * dim, 1), out = HostBuf::random(dtype(), n_tokens * dim, 2);
  DeviceBuffer dids = gpu.up_bytes(ids.data(), ids.size() * 4), dtable = gpu.up(table), dout_ = gpu.up(out);
  for (bool acc : {false, true}) {
    gpu.ops().embedding(gpu.stream(), {dtype(), n_tokens, dim, vocab, dids.as<int32_t>(), dtable.data(), dout_.data(), acc});
    cpu::embedding({dtype(), n_tokens, dim, vocab, ids.data(), table.data(), out.data(), acc});
    EXPECT_NMSE(gpu.down(dout_, out), out, rounding_bound(dtype()), acc ? "embedding accumulate" : "embedding");
  }
  HostBuf g = HostBuf::random(dtype(), n_tokens * dim, 3), dt = HostBuf::random(DType::f32, vocab * dim, 4);
  const HostBuf dt0 = dt;
  DeviceBuffer dg = gpu.up(g), ddt = gpu.up(dt);
  gpu.ops().embedding_backward(gpu.stream(), {dtype(), n_tokens, dim, vocab, dids.as<int32_t>(), dg.data(), ddt.as<float>()});
  cpu::embedding_backward({dtype(), n_tokens, dim, vocab, ids.data(), g.data(), dt.as<float>()});
  const HostBuf first = gpu.down(ddt, dt);
  EXPECT_NMSE(first, dt, 1e-11, "embedding_backward (accumulates into dtable)");
  DeviceBuffer ddt2 = gpu.up(dt0);
  gpu.ops().embedding_backward(gpu.stream(), {dtype(), n_tokens, dim, vocab, dids.as<int32_t>(), dg.data(), ddt2.as<float>()});
  EXPECT_TRUE(bitwise_equal(gpu.down(ddt2, dt), first)) << "embedding_backward is not bitwise reproducible";
}

// One vocabulary shard of the table (rows [30, 70) of 97): other shards' tokens get zero rows
// (accumulating: left as they were) and add nothing to dtable.
TEST_P(CudaOpsTest, ShardedEmbeddingMatchesCpu) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n_tokens = 777, dim = 300, full_vocab = 97, row0 = 30, vocab = 40;
  std::vector<int32_t> ids(n_tokens);
  for (int64_t t = 0; t < n_tokens; ++t) ids[t] = static_cast<int32_t>((t * 37 + t / 5) % full_vocab);
  HostBuf table = HostBuf::random(dtype(), vocab * dim, 1), out = HostBuf::random(dtype(), n_tokens * dim, 2);
  DeviceBuffer dids = gpu.up_bytes(ids.data(), ids.size() * 4), dtable = gpu.up(table), dout_ = gpu.up(out);
  for (bool acc : {false, true}) {
    EmbeddingArgs c{.dtype = dtype(), .n_tokens = n_tokens, .dim = dim, .vocab = vocab, .ids = ids.data(),
                    .table = table.data(), .out = out.data(), .accumulate = acc, .row0 = row0,
                    .full_vocab = full_vocab};
    EmbeddingArgs g = c;
    g.ids = dids.as<int32_t>(), g.table = dtable.data(), g.out = dout_.data();
    gpu.ops().embedding(gpu.stream(), g);
    cpu::embedding(c);
    EXPECT_NMSE(gpu.down(dout_, out), out, rounding_bound(dtype()), acc ? "sharded embedding accumulate" : "sharded embedding");
  }
  HostBuf dy = HostBuf::random(dtype(), n_tokens * dim, 3), dt = HostBuf::random(DType::f32, vocab * dim, 4);
  const HostBuf dt0 = dt;
  DeviceBuffer ddy = gpu.up(dy), ddt = gpu.up(dt);
  EmbeddingBackwardArgs c{.dtype = dtype(), .n_tokens = n_tokens, .dim = dim, .vocab = vocab, .ids = ids.data(),
                          .dout = dy.data(), .dtable = dt.as<float>(), .row0 = row0, .full_vocab = full_vocab};
  EmbeddingBackwardArgs g = c;
  g.ids = dids.as<int32_t>(), g.dout = ddy.data(), g.dtable = ddt.as<float>();
  gpu.ops().embedding_backward(gpu.stream(), g);
  cpu::embedding_backward(c);
  EXPECT_NMSE(gpu.down(ddt, dt), dt, 1e-11, "sharded embedding_backward");
  // Rows the shard's tokens never reach keep their starting values exactly.
  const HostBuf got = gpu.down(ddt, dt);
  for (int64_t row = 0; row < vocab; ++row) {
    bool used = false;
    for (int32_t id : ids) used = used || id == row0 + row;
    if (!used) {
      for (int64_t i = row * dim; i < (row + 1) * dim; ++i) ASSERT_EQ(got.get(i), dt0.get(i)) << "row " << row;
    }
  }
}

// A bad id is found on the GPU and thrown at the stream's synchronize, naming the op; the
// stream works afterwards.
TEST(CudaOps, OutOfRangeIdsAreReportedAtSynchronize) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n = 8, dim = 16, vocab = 10;
  std::vector<int32_t> ids = {1, 2, 3, 4, 12, 5, 6, 7};
  HostBuf table = HostBuf::random(DType::f32, vocab * dim, 1), out(DType::f32, n * dim);
  DeviceBuffer dids = gpu.up_bytes(ids.data(), ids.size() * 4), dtable = gpu.up(table), dout_ = gpu.up(out);
  gpu.ops().embedding(gpu.stream(), {DType::f32, n, dim, vocab, dids.as<int32_t>(), dtable.data(), dout_.data(), false});
  try {
    gpu.stream().synchronize();
    FAIL() << "an id of 12 with vocab 10 was not reported";
  } catch (const std::out_of_range& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("embedding"), std::string::npos) << msg;
    EXPECT_NE(msg.find("12"), std::string::npos) << msg;
  }
  gpu.stream().synchronize();  // reported once, then cleared
  std::vector<int32_t> targets = {0, -1, 3, 99, 2, 1, 0, 0};
  HostBuf logits = HostBuf::random(DType::f32, n * vocab, 2), losses(DType::f32, n);
  DeviceBuffer dtg = gpu.up_bytes(targets.data(), targets.size() * 4), dl = gpu.up(logits), dls = gpu.up(losses);
  CrossEntropyArgs ce;
  ce.rows = n, ce.vocab = vocab, ce.logits = dl.data(), ce.targets = dtg.as<int32_t>(), ce.losses = dls.as<float>();
  gpu.ops().cross_entropy(gpu.stream(), ce);
  EXPECT_THROW(gpu.stream().synchronize(), std::out_of_range);
  gpu.stream().synchronize();
}

// ---- norms -----------------------------------------------------------------------------------

TEST_P(CudaOpsTest, NormsForwardBackwardAccumulateAndDeterministicParamGrads) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t rows = 203, cols = 333;
  for (bool layernorm : {false, true})
    for (bool with_bias : {false, true}) {
      if (!layernorm && with_bias) continue;
      const std::string what = std::string(layernorm ? "layernorm" : "rmsnorm") + (with_bias ? "+bias" : "");
      HostBuf x = HostBuf::random(dtype(), rows * cols, 1, -2, 3), w = HostBuf::random(dtype(), cols, 2);
      HostBuf bias = HostBuf::random(dtype(), cols, 3), y(dtype(), rows * cols);
      HostBuf mean(DType::f32, rows), rstd(DType::f32, rows);
      DeviceBuffer dx_ = gpu.up(x), dw = gpu.up(w), db = gpu.up(bias), dyo = gpu.up(y), dmean = gpu.up(mean),
                   drstd = gpu.up(rstd);
      NormArgs na{dtype(), rows, cols, 1e-5f, x.data(), w.data(), with_bias ? bias.data() : nullptr, y.data(),
                  layernorm ? mean.as<float>() : nullptr, rstd.as<float>()};
      NormArgs ga{dtype(), rows, cols, 1e-5f, dx_.data(), dw.data(), with_bias ? db.data() : nullptr, dyo.data(),
                  layernorm ? dmean.as<float>() : nullptr, drstd.as<float>()};
      if (layernorm) gpu.ops().layernorm(gpu.stream(), ga), cpu::layernorm(na);
      else gpu.ops().rmsnorm(gpu.stream(), ga), cpu::rmsnorm(na);
      EXPECT_NMSE(gpu.down(dyo, y), y, 4 * rounding_bound(dtype()), what);
      EXPECT_NMSE(gpu.down(drstd, rstd), rstd, 1e-11, what + " rstd");
      if (layernorm) EXPECT_NMSE(gpu.down(dmean, mean), mean, 1e-10, what + " mean");

      // The CPU's statistics feed both backwards, so the comparison isolates the backward.
      HostBuf g = HostBuf::random(dtype(), rows * cols, 4);
      DeviceBuffer dg = gpu.up(g), dm2 = gpu.up(mean), dr2 = gpu.up(rstd);
      for (bool acc : {false, true}) {
        HostBuf dxh = HostBuf::random(dtype(), rows * cols, 5);
        HostBuf dwh = HostBuf::random(DType::f32, cols, 6), dbh = HostBuf::random(DType::f32, cols, 7);
        const HostBuf dwh0 = dwh, dbh0 = dbh, dxh0 = dxh;
        DeviceBuffer ddx = gpu.up(dxh), ddw = gpu.up(dwh), ddb = gpu.up(dbh);
        NormBackwardArgs nb{dtype(), rows, cols, x.data(), w.data(), g.data(), layernorm ? mean.as<float>() : nullptr,
                            rstd.as<float>(), dxh.data(), dwh.as<float>(), layernorm ? dbh.as<float>() : nullptr, acc};
        NormBackwardArgs gb{dtype(), rows, cols, dx_.data(), dw.data(), dg.data(),
                            layernorm ? dm2.as<float>() : nullptr, dr2.as<float>(), ddx.data(), ddw.as<float>(),
                            layernorm ? ddb.as<float>() : nullptr, acc};
        if (layernorm) gpu.ops().layernorm_backward(gpu.stream(), gb), cpu::layernorm_backward(nb);
        else gpu.ops().rmsnorm_backward(gpu.stream(), gb), cpu::rmsnorm_backward(nb);
        const std::string wb = what + (acc ? " backward (dx +=)" : " backward");
        EXPECT_NMSE(gpu.down(ddx, dxh), dxh, 8 * rounding_bound(dtype()) + 1e-10, wb + " dx");
        const HostBuf first_dw = gpu.down(ddw, dwh);
        EXPECT_NMSE(first_dw, dwh, 1e-9, wb + " dweight (accumulates)");
        if (layernorm) EXPECT_NMSE(gpu.down(ddb, dbh), dbh, 1e-9, wb + " dbias (accumulates)");
        // Determinism: the same backward again from the same starting gradients.
        DeviceBuffer ddw2 = gpu.up(dwh0), ddb2 = gpu.up(dbh0), ddx2 = gpu.up(dxh0);
        gb.dweight = ddw2.as<float>(), gb.dbias = layernorm ? ddb2.as<float>() : nullptr, gb.dx = ddx2.data();
        if (layernorm) gpu.ops().layernorm_backward(gpu.stream(), gb);
        else gpu.ops().rmsnorm_backward(gpu.stream(), gb);
        EXPECT_TRUE(bitwise_equal(gpu.down(ddw2, dwh), first_dw)) << wb << " dweight not bitwise reproducible";
      }
    }
}

// ---- cross-entropy ---------------------------------------------------------------------------

TEST_P(CudaOpsTest, CrossEntropyIgnoredRowsStrideInPlaceAndForwardOnly) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  for (int64_t vocab : {int64_t{1000}, int64_t{50257}}) {
    const int64_t rows = 13, ld = vocab + 3;
    std::vector<int32_t> targets(rows);
    for (int64_t r = 0; r < rows; ++r) targets[r] = r % 4 == 1 ? -1 : static_cast<int32_t>((r * 7919) % vocab);
    targets[0] = static_cast<int32_t>(vocab - 1);
    HostBuf logits = HostBuf::random(dtype(), rows * ld, 1, -8, 8), losses(DType::f32, rows);
    DeviceBuffer dtg = gpu.up_bytes(targets.data(), targets.size() * 4), dl = gpu.up(logits), dls = gpu.up(losses);
    CrossEntropyArgs a;
    a.dtype = dtype(), a.rows = rows, a.vocab = vocab, a.ld = ld, a.targets = targets.data(),
    a.grad_scale = 1.f / 9.f;
    // Forward only first (dlogits null), then in place (dlogits aliases logits).
    for (bool in_place : {false, true}) {
      CrossEntropyArgs c = a, g = a;
      c.logits = logits.data(), c.losses = losses.as<float>(), c.dlogits = in_place ? logits.data() : nullptr;
      g.logits = dl.data(), g.targets = dtg.as<int32_t>(), g.losses = dls.as<float>(),
      g.dlogits = in_place ? dl.data() : nullptr;
      gpu.ops().cross_entropy(gpu.stream(), g);
      cpu::cross_entropy(c);
      const std::string what = "cross_entropy V=" + std::to_string(vocab) + (in_place ? " in place" : " forward");
      EXPECT_NMSE(gpu.down(dls, losses), losses, 1e-10, what + " losses");
      if (in_place) EXPECT_NMSE(gpu.down(dl, logits), logits, 4 * rounding_bound(dtype()) + 1e-10, what + " dlogits");
    }
  }
}

// The vocabulary-parallel pair over three uneven shards of 1000 columns: each shard's stats,
// then each shard's finish (in place) from the CPU's all_stats, so each is compared on its own;
// a bad target is reported at synchronize naming the op.
TEST_P(CudaOpsTest, VocabParallelCrossEntropyMatchesCpu) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t rows = 13, full_vocab = 1000, pad = 3;
  const int parts = 3;
  const int64_t starts[parts] = {0, 400, 750}, widths[parts] = {400, 350, 250};
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = r % 4 == 1 ? -1 : static_cast<int32_t>((r * 7919) % full_vocab);
  targets[0] = 999, targets[2] = 400, targets[3] = 749;
  DeviceBuffer dtg = gpu.up_bytes(targets.data(), targets.size() * 4);
  HostBuf all_stats(DType::f32, parts * rows * 3);  // (parts, rows, 3), from the CPU
  std::vector<HostBuf> logits;
  for (int p = 0; p < parts; ++p) {
    const int64_t ld = widths[p] + pad;
    logits.push_back(HostBuf::random(dtype(), rows * ld, 10 + p, -8, 8));
    HostBuf st(DType::f32, rows * 3);
    DeviceBuffer dl = gpu.up(logits[p]), dst = gpu.up(st);
    CrossEntropyStatsArgs c{.dtype = dtype(), .rows = rows, .vocab = widths[p], .ld = ld, .vocab_start = starts[p],
                            .full_vocab = full_vocab, .logits = logits[p].data(), .targets = targets.data(),
                            .stats = st.as<float>()};
    CrossEntropyStatsArgs g = c;
    g.logits = dl.data(), g.targets = dtg.as<int32_t>(), g.stats = dst.as<float>();
    gpu.ops().cross_entropy_stats(gpu.stream(), g);
    cpu::cross_entropy_stats(c);
    EXPECT_NMSE(gpu.down(dst, st), st, 1e-10, "cross_entropy_stats shard " + std::to_string(p));
    std::memcpy(all_stats.as<float>() + p * rows * 3, st.data(), st.size_bytes());
  }
  DeviceBuffer dall = gpu.up(all_stats);
  for (int p = 0; p < parts; ++p) {
    const int64_t ld = widths[p] + pad;
    HostBuf losses(DType::f32, rows);
    DeviceBuffer dl = gpu.up(logits[p]), dls = gpu.up(losses);
    CrossEntropyFinishArgs c{.dtype = dtype(), .rows = rows, .vocab = widths[p], .ld = ld, .vocab_start = starts[p],
                             .full_vocab = full_vocab, .parts = parts, .logits = logits[p].data(),
                             .targets = targets.data(), .all_stats = all_stats.as<float>(),
                             .losses = losses.as<float>(), .dlogits = logits[p].data(), .grad_scale = 1.f / 9.f};
    CrossEntropyFinishArgs g = c;
    g.logits = dl.data(), g.targets = dtg.as<int32_t>(), g.all_stats = dall.as<float>(), g.losses = dls.as<float>(),
    g.dlogits = dl.data();
    gpu.ops().cross_entropy_finish(gpu.stream(), g);
    cpu::cross_entropy_finish(c);
    const std::string what = "cross_entropy_finish shard " + std::to_string(p);
    EXPECT_NMSE(gpu.down(dls, losses), losses, 1e-10, what + " losses");
    EXPECT_NMSE(gpu.down(dl, logits[p]), logits[p], 4 * rounding_bound(dtype()) + 1e-10, what + " dlogits");
  }
  std::vector<int32_t> bad = targets;
  bad[5] = static_cast<int32_t>(full_vocab);
  DeviceBuffer dbad = gpu.up_bytes(bad.data(), bad.size() * 4), dls = gpu.up(HostBuf(DType::f32, rows));
  gpu.ops().cross_entropy_finish(gpu.stream(), {.dtype = dtype(), .rows = rows, .vocab = widths[0],
                                                .vocab_start = 0, .full_vocab = full_vocab, .parts = parts,
                                                .targets = dbad.as<int32_t>(), .all_stats = dall.as<float>(),
                                                .losses = dls.as<float>()});
  try {
    gpu.stream().synchronize();
    ADD_FAILURE() << "a target of 1000 with full_vocab 1000 was not reported";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy_finish"), std::string::npos) << e.what();
  }
  gpu.stream().synchronize();  // reported once, then cleared
}

// ---- optimizer -------------------------------------------------------------------------------

TEST_P(CudaOpsTest, AdamWMatchesCpuOverStepsWithLowPrecisionCopies) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n = 5003;
  for (int copy = -1; copy < 3; ++copy) {  // -1: no param_copy
    const DType copy_t = copy < 0 ? DType::bf16 : static_cast<DType>(copy);
    HostBuf p = HostBuf::random(DType::f32, n, 1), m(DType::f32, n), v(DType::f32, n), pc(copy_t, n);
    DeviceBuffer dp = gpu.up(p), dm = gpu.up(m), dv = gpu.up(v), dpc = gpu.up(pc);
    for (int64_t step = 1; step <= 3; ++step) {
      HostBuf grad = HostBuf::random(dtype(), n, 10 + static_cast<uint32_t>(step));
      DeviceBuffer dg = gpu.up(grad);
      AdamWArgs a;
      a.n = n, a.grad_dtype = dtype(), a.copy_dtype = copy_t, a.lr = 3e-3f, a.weight_decay = 0.1f, a.step = step,
      a.grad_scale = 0.5f;
      AdamWArgs ga = a;
      ga.param = dp.as<float>(), ga.grad = dg.data(), ga.m = dm.as<float>(), ga.v = dv.as<float>(),
      ga.param_copy = copy < 0 ? nullptr : dpc.data();
      gpu.ops().adamw(gpu.stream(), ga);
      a.param = p.as<float>(), a.grad = grad.data(), a.m = m.as<float>(), a.v = v.as<float>(),
      a.param_copy = copy < 0 ? nullptr : pc.data();
      cpu::adamw(a);
    }
    const std::string what = "adamw copy=" + std::string(copy < 0 ? "none" : dtype_name(copy_t));
    // Bitwise: the two kernels do the same operations (AdamW's placement must not change a loss).
    auto same_bits = [&](const HostBuf& got, const HostBuf& want) {
      return got.bytes.size() == want.bytes.size() && std::memcmp(got.data(), want.data(), want.bytes.size()) == 0;
    };
    EXPECT_TRUE(same_bits(gpu.down(dp, p), p)) << what << " param";
    EXPECT_TRUE(same_bits(gpu.down(dm, m), m)) << what << " m";
    EXPECT_TRUE(same_bits(gpu.down(dv, v), v)) << what << " v";
    if (copy >= 0) {
      EXPECT_TRUE(same_bits(gpu.down(dpc, pc), pc)) << what << " copy";
    }
  }
}

// Out of place on the GPU (AdamWArgs::param_in, m_in, v_in): the CPU's in-place step, bit for
// bit, the inputs untouched.
TEST_P(CudaOpsTest, AdamWOutOfPlaceIsTheCpuInPlaceStep) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n = 5003;
  HostBuf p = HostBuf::random(DType::f32, n, 3), m = HostBuf::random(DType::f32, n, 4), v(DType::f32, n),
          pc(DType::bf16, n), grad = HostBuf::random(dtype(), n, 5);
  const HostBuf p0 = p, m0 = m;
  DeviceBuffer dp = gpu.up(p), dm = gpu.up(m), dv = gpu.up(v), dg = gpu.up(grad);
  DeviceBuffer dq = gpu.up(HostBuf(DType::f32, n)), dmq = gpu.up(HostBuf(DType::f32, n)),
               dvq = gpu.up(HostBuf(DType::f32, n)), dpc = gpu.up(pc);
  AdamWArgs a;
  a.n = n, a.grad_dtype = dtype(), a.copy_dtype = DType::bf16, a.lr = 3e-3f, a.weight_decay = 0.1f, a.step = 2,
  a.grad_scale = 0.5f;
  AdamWArgs ga = a;
  ga.param = dq.as<float>(), ga.m = dmq.as<float>(), ga.v = dvq.as<float>(), ga.grad = dg.data(),
  ga.param_copy = dpc.data();
  ga.param_in = dp.as<float>(), ga.m_in = dm.as<float>(), ga.v_in = dv.as<float>();
  gpu.ops().adamw(gpu.stream(), ga);
  a.param = p.as<float>(), a.grad = grad.data(), a.m = m.as<float>(), a.v = v.as<float>(), a.param_copy = pc.data();
  cpu::adamw(a);
  auto same_bits = [&](const HostBuf& got, const HostBuf& want) {
    return got.bytes.size() == want.bytes.size() && std::memcmp(got.data(), want.data(), want.bytes.size()) == 0;
  };
  EXPECT_TRUE(same_bits(gpu.down(dq, p), p)) << "param";
  EXPECT_TRUE(same_bits(gpu.down(dmq, m), m)) << "m";
  EXPECT_TRUE(same_bits(gpu.down(dvq, v), v)) << "v";
  EXPECT_TRUE(same_bits(gpu.down(dpc, pc), pc)) << "copy";
  EXPECT_TRUE(same_bits(gpu.down(dp, p0), p0)) << "param_in changed";
  EXPECT_TRUE(same_bits(gpu.down(dm, m0), m0)) << "m_in changed";
}

TEST_P(CudaOpsTest, SumSquaresAddsIntoOutAndIsDeterministic) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3'000'001}}) {
    HostBuf x = HostBuf::random(dtype(), n, 1);
    double want = 0.25;
    cpu::sum_squares({dtype(), n, x.data(), &want});
    DeviceBuffer dx = gpu.up(x);
    double start = 0.25;
    DeviceBuffer dout_ = gpu.up_bytes(&start, sizeof(double));
    gpu.ops().sum_squares(gpu.stream(), {dtype(), n, dx.data(), dout_.as<double>()});
    double got = 0;
    gpu.stream().memcpy_async(&got, dout_.data(), sizeof(double));
    gpu.stream().synchronize();
    EXPECT_NEAR(got, want, 1e-12 * want) << "sum_squares n=" << n;
    DeviceBuffer dout2 = gpu.up_bytes(&start, sizeof(double));
    gpu.ops().sum_squares(gpu.stream(), {dtype(), n, dx.data(), dout2.as<double>()});
    double again = 0;
    gpu.stream().memcpy_async(&again, dout2.data(), sizeof(double));
    gpu.stream().synchronize();
    EXPECT_EQ(std::memcmp(&got, &again, sizeof(double)), 0) << "sum_squares is not bitwise reproducible";
  }
}

// The communicators' fixed-order sum on the GPU is the CPU's, bit for bit (the NCCL
// communicator's reduce-scatter and all-reduce end with it; the mpi one sums on the host).
TEST_P(CudaOpsTest, RankOrderSumIsTheCpuSumBitForBit) {
  STRATA_SKIP_WITHOUT_CUDA();
  Gpu gpu;
  const int64_t n = 100003, stride = n + 13;
  for (int world : {1, 2, 4}) {
    for (int me = 0; me < world; ++me) {
      HostBuf mine = HostBuf::random(dtype(), static_cast<size_t>(n), 70 + static_cast<uint32_t>(me));
      HostBuf others = HostBuf::random(dtype(), static_cast<size_t>(std::max<int64_t>(1, (world - 1) * stride)), 80);
      HostBuf want(dtype(), static_cast<size_t>(n));
      RankOrderSumArgs a{.dtype = dtype(), .n = n, .mine = mine.data(), .me = me, .world = world,
                         .others = world > 1 ? others.data() : nullptr, .others_stride = stride, .out = want.data()};
      cpu::rank_order_sum(a);
      DeviceBuffer dm = gpu.up(mine), dothers = gpu.up(others);
      DeviceBuffer dout = gpu.up(HostBuf(dtype(), static_cast<size_t>(n)));
      a.mine = dm.data();
      a.others = world > 1 ? dothers.data() : nullptr;
      a.out = dout.data();
      gpu.ops().rank_order_sum(gpu.stream(), a);
      const HostBuf got = gpu.down(dout, want);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size_bytes()), 0) << "world " << world << " me " << me;
    }
  }
}

}  // namespace
