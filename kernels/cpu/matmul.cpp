// cpu::matmul on oneDNN's matmul primitive. A primitive is built once per distinct problem
// (shape, transposes, leading dims, batch strides, dtypes, alpha, beta) and kept in a
// thread-safe cache, so a step loop only looks it up and executes it; fp16 inputs, which this
// CPU's oneDNN cannot multiply natively, are widened to fp32 in k-tiles through a reusable
// per-thread scratch buffer.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/act_types.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"

namespace strata::kernels::cpu {
namespace {

using dnnl::memory;
using Dims = memory::dims;

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}
// One oneDNN stream per calling thread (a CPU stream's worker, a test, a benchmark).
dnnl::stream& dnnl_stream() {
  thread_local dnnl::stream s(engine());
  return s;
}

memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::f32: return memory::data_type::f32;
    case DType::bf16: return memory::data_type::bf16;
    case DType::f16: return memory::data_type::f16;
  }
  return memory::data_type::undef;
}

// A fully resolved problem: leading dims and batch strides are explicit (never 0).
struct Key {
  int64_t m = 0, n = 0, k = 0, batch = 0;
  int64_t lda = 0, ldb = 0, ldc = 0, stride_a = 0, stride_b = 0, stride_c = 0;
  bool trans_a = false, trans_b = false;
  DType ab = DType::f32, c = DType::f32;
  float alpha = 1.f, beta = 0.f;
  // Field by field (padding bytes are not part of the value); alpha/beta compared as bits.
  auto tie() const {
    return std::tie(m, n, k, batch, lda, ldb, ldc, stride_a, stride_b, stride_c, trans_a, trans_b, ab, c);
  }
  bool operator==(const Key& o) const {
    return tie() == o.tie() && std::bit_cast<uint32_t>(alpha) == std::bit_cast<uint32_t>(o.alpha) &&
           std::bit_cast<uint32_t>(beta) == std::bit_cast<uint32_t>(o.beta);
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (int64_t v : {k.m, k.n, k.k, k.batch, k.lda, k.ldb, k.ldc, k.stride_a, k.stride_b, k.stride_c}) mix(uint64_t(v));
    mix(uint64_t(k.trans_a) | uint64_t(k.trans_b) << 1 | uint64_t(k.ab) << 8 | uint64_t(k.c) << 16);
    mix(uint64_t(std::bit_cast<uint32_t>(k.alpha)) << 32 | std::bit_cast<uint32_t>(k.beta));
    return static_cast<size_t>(h);
  }
};

struct Entry {
  memory::desc a_md, b_md, c_md;
  dnnl::matmul prim;
};

Key resolve(const MatmulArgs& a) {
  Key k;
  k.m = a.m, k.n = a.n, k.k = a.k, k.batch = a.batch;
  k.trans_a = a.trans_a, k.trans_b = a.trans_b;
  const int64_t a_rows = a.trans_a ? a.k : a.m, a_cols = a.trans_a ? a.m : a.k;
  const int64_t b_rows = a.trans_b ? a.n : a.k, b_cols = a.trans_b ? a.k : a.n;
  k.lda = a.lda ? a.lda : a_cols;
  k.ldb = a.ldb ? a.ldb : b_cols;
  k.ldc = a.ldc ? a.ldc : a.n;
  k.stride_a = a.batch == 1 ? 0 : (a.stride_a ? a.stride_a : a_rows * k.lda);
  k.stride_b = a.batch == 1 ? 0 : (a.stride_b ? a.stride_b : b_rows * k.ldb);
  k.stride_c = a.batch == 1 ? 0 : (a.stride_c ? a.stride_c : a.m * k.ldc);
  k.ab = a.ab_dtype, k.c = a.c_dtype;
  k.alpha = a.alpha, k.beta = a.beta;
  return k;
}

// Memory descriptors of op(A): (m, k), op(B): (k, n), C: (m, n), with a leading batch
// dimension when batch > 1. A transpose is just swapped strides.
std::unique_ptr<Entry> build(const Key& k) {
  auto e = std::make_unique<Entry>();
  const auto ta = dnnl_type(k.ab), tc = dnnl_type(k.c);
  if (k.batch == 1) {
    e->a_md = memory::desc(Dims{k.m, k.k}, ta, k.trans_a ? Dims{1, k.lda} : Dims{k.lda, 1});
    e->b_md = memory::desc(Dims{k.k, k.n}, ta, k.trans_b ? Dims{1, k.ldb} : Dims{k.ldb, 1});
    e->c_md = memory::desc(Dims{k.m, k.n}, tc, Dims{k.ldc, 1});
  } else {
    e->a_md = memory::desc(Dims{k.batch, k.m, k.k}, ta,
                           k.trans_a ? Dims{k.stride_a, 1, k.lda} : Dims{k.stride_a, k.lda, 1});
    e->b_md = memory::desc(Dims{k.batch, k.k, k.n}, ta,
                           k.trans_b ? Dims{k.stride_b, 1, k.ldb} : Dims{k.stride_b, k.ldb, 1});
    e->c_md = memory::desc(Dims{k.batch, k.m, k.n}, tc, Dims{k.stride_c, k.ldc, 1});
  }
  dnnl::primitive_attr attr;
  if (k.alpha != 1.f) attr.set_output_scales(0, {k.alpha});
  if (k.beta != 0.f) {
    dnnl::post_ops po;
    po.append_sum(k.beta);  // C = alpha·A·B + beta·C
    attr.set_post_ops(po);
  }
  try {
    dnnl::matmul::desc desc(e->a_md, e->b_md, e->c_md);
    dnnl::matmul::primitive_desc pd(desc, attr, engine());
    e->prim = dnnl::matmul(pd);
  } catch (const dnnl::error& err) {
    throw std::runtime_error("matmul: oneDNN cannot build m=" + std::to_string(k.m) + " n=" + std::to_string(k.n) +
                             " k=" + std::to_string(k.k) + " batch=" + std::to_string(k.batch) + " " +
                             std::string(dtype_name(k.ab)) + "->" + std::string(dtype_name(k.c)) + ": " +
                             err.what());
  }
  return e;
}

// Process-wide primitive cache. Entries are never evicted: a training run has a few dozen
// distinct shapes, each built once.
class Cache {
 public:
  const Entry& get(const Key& k) {
    {
      std::lock_guard lock(mu_);
      auto it = map_.find(k);
      if (it != map_.end()) return *it->second;
    }
    auto e = build(k);  // outside the lock: building can take milliseconds
    std::lock_guard lock(mu_);
    auto [it, inserted] = map_.emplace(k, std::move(e));
    return *it->second;
  }
  size_t size() {
    std::lock_guard lock(mu_);
    return map_.size();
  }

 private:
  std::mutex mu_;
  std::unordered_map<Key, std::unique_ptr<Entry>, KeyHash> map_;
};
Cache& cache() {
  static Cache c;
  return c;
}

void execute(const Entry& e, const void* a, const void* b, void* c) {
  // The caller's OpenMP team size follows num_threads() (omp_set_num_threads is per thread).
  if (omp_get_max_threads() != num_threads()) omp_set_num_threads(num_threads());
  memory am(e.a_md, engine(), const_cast<void*>(a));
  memory bm(e.b_md, engine(), const_cast<void*>(b));
  memory cm(e.c_md, engine(), c);
  e.prim.execute(dnnl_stream(), {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  dnnl_stream().wait();
}

// Per-thread scratch that only grows (fp16 and bf16 operands widened into it; split-k's fp32 C).
float* scratch(size_t floats) { return thread_scratch<struct MatmulScratch>(floats); }

constexpr int64_t kWidenTileFloats = int64_t{1} << 22;  // 16 MiB of widened A and B per k-tile

// Converts a rows x cols matrix (row strides ld_src / ld_dst, in elements): one cast when both
// are packed, else one per row.
void cast_rows(const void* src, DType st, int64_t ld_src, void* dst, DType dt, int64_t ld_dst, int64_t rows,
               int64_t cols) {
  if (ld_src == cols && ld_dst == cols) return cast(CastArgs{rows * cols, src, st, dst, dt});
  for (int64_t r = 0; r < rows; ++r)
    cast(CastArgs{cols, static_cast<const char*>(src) + r * ld_src * dtype_size(st), st,
                  static_cast<char*>(dst) + r * ld_dst * dtype_size(dt), dt});
}
// Whether oneDNN builds bf16 matmuls on this CPU: it needs AVX-512 (avx512_core) or AMX for
// them, and an AVX2-only CPU (many desktop and cloud parts) refuses every bf16 primitive. Asked
// once, by building a small one.
bool native_bf16() {
  static const bool yes = [] {
    try {
      const memory::desc md(Dims{16, 16}, memory::data_type::bf16, Dims{16, 1});
      const memory::desc cd(Dims{16, 16}, memory::data_type::f32, Dims{16, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(md, md, cd), dnnl::primitive_attr(), engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return yes;
}

// Operands oneDNN does not multiply here (fp16 always, bf16 where !native_bf16()): per batch
// item and k-tile, widen op(A)[:, k0:k1] and op(B)[k0:k1, :] to fp32 (exactly: every fp16 and
// bf16 value is an fp32 one), keeping their stored orientation, and run an fp32 primitive; the
// first tile applies the caller's beta, later ones accumulate (beta = 1). A narrow C is widened
// once and rounded back once at the end, as oneDNN's fp32-accumulating kernels do.
void matmul_widened(const MatmulArgs& a, const Key& key) {
  const DType ab = a.ab_dtype;
  const int64_t kt = std::max<int64_t>(1, std::min<int64_t>(a.k, kWidenTileFloats / (a.m + a.n)));
  const bool narrow_c = a.c_dtype != DType::f32;
  float* tile = scratch(static_cast<size_t>((a.m + a.n) * kt + (narrow_c ? a.m * a.n : 0)));
  float* ta = tile;                 // op(A) tile, stored (m, kt) or (kt, m) when trans_a
  float* tb = tile + a.m * kt;      // op(B) tile, stored (kt, n) or (n, kt) when trans_b
  float* tc = tb + a.n * kt;        // (m, n) fp32 copy of a narrow C
  const auto widen = [ab](const uint16_t* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
    cast_rows(src, ab, ld, dst, DType::f32, cols, rows, cols);
  };
  for (int64_t bi = 0; bi < a.batch; ++bi) {
    const auto* A = static_cast<const uint16_t*>(a.a) + bi * key.stride_a;
    const auto* B = static_cast<const uint16_t*>(a.b) + bi * key.stride_b;
    void* C = static_cast<char*>(a.c) + bi * key.stride_c * dtype_size(a.c_dtype);
    float* c_out = static_cast<float*>(C);
    int64_t ldc = key.ldc;
    if (narrow_c) {
      c_out = tc, ldc = a.n;
      if (a.beta != 0.f) cast_rows(C, a.c_dtype, key.ldc, tc, DType::f32, a.n, a.m, a.n);
    }
    for (int64_t k0 = 0; k0 < a.k; k0 += kt) {
      const int64_t kk = std::min(kt, a.k - k0);
      if (a.trans_a) widen(A + k0 * key.lda, kk, a.m, key.lda, ta);  // (kk, m)
      else widen(A + k0, a.m, kk, key.lda, ta);                       // (m, kk)
      if (a.trans_b) widen(B + k0, a.n, kk, key.ldb, tb);             // (n, kk)
      else widen(B + k0 * key.ldb, kk, a.n, key.ldb, tb);             // (kk, n)
      MatmulArgs t;
      t.ab_dtype = DType::f32, t.c_dtype = DType::f32;
      t.m = a.m, t.n = a.n, t.k = kk, t.trans_a = a.trans_a, t.trans_b = a.trans_b, t.ldc = ldc;
      t.alpha = a.alpha, t.beta = k0 == 0 ? a.beta : 1.f;
      execute(cache().get(resolve(t)), ta, tb, c_out);
    }
    if (narrow_c) cast_rows(tc, DType::f32, a.n, C, a.c_dtype, key.ldc, a.m, a.n);
  }
}

// oneDNN's brgemm matmul (v2.6) runs far below its usual rate when one dimension is huge, as at
// the LM head: dW (V, C) = dlogitsᵀ·lnf with m = V = 50,257 ran at 337 GFLOP/s in bf16 (beta 0)
// against 673 in 8,192-row blocks, and dlnf = dlogits·W with k = V at 222 GFLOP/s in fp32
// against 319 in 8,192-wide k blocks (2-core EPYC, bench/RESULTS.md). So single (batch 1)
// problems are split: m into near-equal blocks of at most kMaxBlockM rows, or else k into blocks
// of at most kMaxBlockK accumulated in order into an fp32 C (a bf16 C goes through an fp32 scratch
// and is rounded once at the end, so the result keeps one rounding like the unsplit product).
constexpr int64_t kMaxBlockM = 8192;
constexpr int64_t kMaxBlockK = 8192;

// Near-equal blocks of at most `limit`, rounded up to 64 (at most two distinct block shapes).
int64_t block_size(int64_t total, int64_t limit) {
  const int64_t n_blocks = (total + limit - 1) / limit;
  return std::min(limit, ((total + n_blocks - 1) / n_blocks + 63) / 64 * 64);
}

void matmul_split_k(const MatmulArgs& a, const Key& key) {
  const int64_t kb = block_size(a.k, kMaxBlockK);
  const size_t ab = dtype_size(a.ab_dtype);
  float* c32 = static_cast<float*>(a.c);
  int64_t ldc = key.ldc;
  const bool narrow = a.c_dtype != DType::f32;
  if (narrow) {  // fp32 C for the partial sums (the caller's beta applied by the first block)
    c32 = scratch(static_cast<size_t>(a.m * a.n));
    ldc = a.n;
    if (a.beta != 0.f) cast_rows(a.c, a.c_dtype, key.ldc, c32, DType::f32, a.n, a.m, a.n);
  }
  for (int64_t k0 = 0; k0 < a.k; k0 += kb) {
    MatmulArgs t = a;
    t.k = std::min(kb, a.k - k0);
    t.lda = key.lda, t.ldb = key.ldb, t.ldc = ldc;
    t.c_dtype = DType::f32;
    t.beta = k0 == 0 ? a.beta : 1.f;
    const char* A = static_cast<const char*>(a.a) + (a.trans_a ? k0 * key.lda : k0) * ab;
    const char* B = static_cast<const char*>(a.b) + (a.trans_b ? k0 : k0 * key.ldb) * ab;
    execute(cache().get(resolve(t)), A, B, c32);
  }
  if (narrow) cast_rows(c32, DType::f32, a.n, a.c, a.c_dtype, key.ldc, a.m, a.n);
}

void matmul_split_m(const MatmulArgs& a, const Key& key) {
  const int64_t mb = block_size(a.m, kMaxBlockM);
  const size_t ab = dtype_size(a.ab_dtype), cb = dtype_size(a.c_dtype);
  for (int64_t m0 = 0; m0 < a.m; m0 += mb) {
    MatmulArgs t = a;
    t.m = std::min(mb, a.m - m0);
    t.lda = key.lda, t.ldb = key.ldb, t.ldc = key.ldc;
    t.a = static_cast<const char*>(a.a) + (a.trans_a ? m0 : m0 * key.lda) * ab;
    t.c = static_cast<char*>(a.c) + m0 * key.ldc * cb;
    execute(cache().get(resolve(t)), t.a, t.b, t.c);
  }
}

}  // namespace

size_t matmul_primitives_built() { return cache().size(); }

namespace {
std::atomic<bool> g_widen_bf16{false};
}
bool bf16_widened() { return g_widen_bf16.load(std::memory_order_relaxed) || !native_bf16(); }
void widen_bf16_for_tests(bool on) { g_widen_bf16.store(on, std::memory_order_relaxed); }

void matmul(const MatmulArgs& a) {
  const Key key = resolve(a);
  if (a.ab_dtype == DType::f16 || (a.ab_dtype == DType::bf16 && bf16_widened())) {
    matmul_widened(a, key);
    return;
  }
  if (a.batch == 1 && a.m > kMaxBlockM) return matmul_split_m(a, key);
  if (a.batch == 1 && a.k > kMaxBlockK) return matmul_split_k(a, key);
  execute(cache().get(key), a.a, a.b, a.c);
}

}  // namespace strata::kernels::cpu
