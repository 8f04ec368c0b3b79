// cuda matmul on cuBLASLt: row-major C = alpha·op(A)·op(B) + beta·C is column-major Cᵀ =
// op(B)ᵀ·op(A)ᵀ, so B's storage is cuBLASLt's "A" and A's is its "B". A plan (descriptors,
// layouts and the heuristic's algorithm) is built once per distinct problem and cached; the
// workspace is the stream's scratch (cuda_ops.h), so concurrent streams never share one.
// Problems cuBLASLt has no algorithm for go to cublasGemmStridedBatchedEx instead.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/matmul_engine.h"

namespace strata::kernels::cuda {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// Largest power of two (up to 256) dividing the byte address / offset.
uint32_t alignment_of(uint64_t v) {
  if (v == 0) return 256;
  const uint32_t a = uint32_t{1} << std::countr_zero(v);
  return a > 256 ? 256 : a;
}

}  // namespace

size_t MatmulEngine::KeyHash::operator()(const Key& k) const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (int64_t v : {k.m, k.n, k.k, k.batch, k.lda, k.ldb, k.ldc, k.stride_a, k.stride_b, k.stride_c}) mix(uint64_t(v));
  mix(uint64_t(k.trans_a) | uint64_t(k.trans_b) << 1 | uint64_t(k.ab) << 8 | uint64_t(k.c) << 16);
  mix(uint64_t(k.align_a) | uint64_t(k.align_b) << 16 | uint64_t(k.align_c) << 32);
  return static_cast<size_t>(h);
}

// The cuBLASLt objects of one problem (RAII: destroyed with the plan).
struct MatmulEngine::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A (our B), B (our A), C = D
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool fallback = false;  // cuBLASLt has no algorithm: run_fallback
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

MatmulEngine::MatmulEngine(int device) {
  STRATA_CUDA_CHECK(cudaSetDevice(device));
  STRATA_CUBLAS_CHECK(cublasLtCreate(&handle_));
}
MatmulEngine::~MatmulEngine() {
  cache_.clear();
  if (fallback_) cublasDestroy(fallback_);
  cublasLtDestroy(handle_);
}

MatmulEngine::Key MatmulEngine::resolve(const MatmulArgs& a) {
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
  const uint64_t es = dtype_size(a.ab_dtype), cs = dtype_size(a.c_dtype);
  // Every batch item's pointer must have the alignment promised: the base and the stride both.
  k.align_a = std::min(alignment_of(reinterpret_cast<uintptr_t>(a.a)), alignment_of(uint64_t(k.stride_a) * es));
  k.align_b = std::min(alignment_of(reinterpret_cast<uintptr_t>(a.b)), alignment_of(uint64_t(k.stride_b) * es));
  k.align_c = std::min(alignment_of(reinterpret_cast<uintptr_t>(a.c)), alignment_of(uint64_t(k.stride_c) * cs));
  return k;
}

std::unique_ptr<MatmulEngine::Plan> MatmulEngine::build(const Key& k) const {
  auto p = std::make_unique<Plan>();
  const cudaDataType_t tab = cuda_type(k.ab), tc = cuda_type(k.c);
  STRATA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
  const cublasOperation_t op_b = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B is our A
  STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  // Column-major views of the row-major storage: (stored cols, stored rows), ld = row stride.
  const uint64_t la_rows = k.trans_b ? k.k : k.n, la_cols = k.trans_b ? k.n : k.k;  // our B stored
  const uint64_t lb_rows = k.trans_a ? k.m : k.k, lb_cols = k.trans_a ? k.k : k.m;  // our A stored
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, tab, la_rows, la_cols, k.ldb));
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, tab, lb_rows, lb_cols, k.lda));
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, tc, k.n, k.m, k.ldc));
  if (k.batch > 1) {
    const int32_t count = static_cast<int32_t>(k.batch);
    for (auto [layout, stride] : {std::pair{p->a, k.stride_b}, std::pair{p->b, k.stride_a}, std::pair{p->c, k.stride_c}}) {
      STRATA_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      const int64_t s = stride;
      STRATA_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s, sizeof(s)));
    }
  }
  cublasLtMatmulPreference_t pref = nullptr;
  STRATA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
  } guard{pref};
  const uint64_t ws = kWorkspaceBytes;
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t al_a = k.align_b, al_b = k.align_a, al_c = k.align_c;
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  STRATA_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle_, p->op, p->a, p->b, p->c, p->c, pref, 1, &result, &returned);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && returned == 0)) {
    p->fallback = true;
    return p;
  }
  STRATA_CUBLAS_CHECK(st);
  p->algo = result.algo;
  p->workspace = result.workspaceSize;
  return p;
}

const MatmulEngine::Plan& MatmulEngine::plan(const Key& k) {
  {
    std::lock_guard lock(mu_);
    auto it = cache_.find(k);
    if (it != cache_.end()) return *it->second;
  }
  auto p = build(k);  // outside the lock: the heuristic query can take a while
  std::lock_guard lock(mu_);
  auto [it, inserted] = cache_.emplace(k, std::move(p));
  return *it->second;
}

size_t MatmulEngine::plans_built() {
  std::lock_guard lock(mu_);
  return cache_.size();
}

// Legacy cuBLAS with the same column-major mapping. One handle, so the stream and workspace
// are set under a lock for each call; the workspace is this stream's scratch, which keeps the
// result independent of which stream ran before (cuBLAS's determinism condition).
void MatmulEngine::run_fallback(StreamContext& ctx, const MatmulArgs& a, const Key& k) {
  constexpr size_t kFallbackWorkspace = size_t{4} << 20;
  const int64_t big = INT32_MAX;
  if (k.m > big || k.n > big || k.k > big || k.lda > big || k.ldb > big || k.ldc > big || k.batch > big)
    throw std::invalid_argument("matmul: dimensions above 2^31 with a layout cuBLASLt cannot take");
  std::lock_guard lock(fallback_mu_);
  if (!fallback_) STRATA_CUBLAS_CHECK(cublasCreate(&fallback_));
  STRATA_CUBLAS_CHECK(cublasSetStream(fallback_, ctx.stream()));
  STRATA_CUBLAS_CHECK(cublasSetWorkspace(fallback_, ctx.scratch(kFallbackWorkspace), kFallbackWorkspace));
  const cudaDataType_t tab = cuda_type(k.ab), tc = cuda_type(k.c);
  STRATA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      fallback_, k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(k.n),
      static_cast<int>(k.m), static_cast<int>(k.k), &a.alpha, a.b, tab, static_cast<int>(k.ldb), k.stride_b, a.a, tab,
      static_cast<int>(k.lda), k.stride_a, &a.beta, a.c, tc, static_cast<int>(k.ldc), k.stride_c,
      static_cast<int>(k.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void MatmulEngine::run(StreamContext& ctx, const MatmulArgs& a) {
  const Key key = resolve(a);
  const Plan& p = plan(key);
  if (p.fallback) return run_fallback(ctx, a, key);
  void* ws = p.workspace ? ctx.scratch(p.workspace) : nullptr;
  // Our B is cuBLASLt's A and our A its B.
  STRATA_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &a.alpha, a.b, p.a, a.a, p.b, &a.beta, a.c, p.c, a.c, p.c, &p.algo,
                                     ws, p.workspace, ctx.stream()));
}

CudaOps::CudaOps(int device) : device_(device), matmul_(std::make_unique<MatmulEngine>(device)) {}
CudaOps::~CudaOps() = default;

void CudaOps::do_matmul(Stream& s, const MatmulArgs& a) { matmul_->run(context(s), a); }

}  // namespace strata::kernels::cuda
