// The CUDA side of `strata bench ops --backend cuda` (kernels/cuda/bench.h): an event timer and
// the bare cuBLASLt GEMM reference, written straight against cuBLASLt so that the comparison
// measures what strata's matmul adds (plan lookup, scratch, layout mapping) and nothing else.
#include "kernels/cuda/bench.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"

namespace strata::kernels::cuda_bench {

using cuda::native;

struct Timer::Impl {
  cudaStream_t s = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  ~Impl() {
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
  }
};

Timer::Timer(Stream& s) : impl_(std::make_unique<Impl>()) {
  impl_->s = native(s);
  STRATA_CUDA_CHECK(cudaEventCreate(&impl_->a));
  STRATA_CUDA_CHECK(cudaEventCreate(&impl_->b));
}
Timer::~Timer() = default;
void Timer::start() { STRATA_CUDA_CHECK(cudaEventRecord(impl_->a, impl_->s)); }
void Timer::stop() { STRATA_CUDA_CHECK(cudaEventRecord(impl_->b, impl_->s)); }
double Timer::ms() {
  STRATA_CUDA_CHECK(cudaEventSynchronize(impl_->b));
  float ms = 0.f;
  STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms, impl_->a, impl_->b));
  return ms;
}

namespace {
cudaDataType_t cuda_type(DType t) {
  return t == DType::f32 ? CUDA_R_32F : t == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
}
}  // namespace

// Packed row-major operands only (what the bench uses); same column-major mapping as matmul.cpp.
struct BareGemm::Impl {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  void* workspace = nullptr;
  size_t workspace_bytes = size_t{32} << 20;
  float alpha = 1.f, beta = 0.f;
  ~Impl() {
    if (workspace) cudaFree(workspace);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    if (handle) cublasLtDestroy(handle);
  }
};

BareGemm::BareGemm(Runtime& rt, const MatmulArgs& s) : impl_(std::make_unique<Impl>()) {
  if (s.batch != 1 || s.lda || s.ldb || s.ldc) throw std::invalid_argument("BareGemm: packed, unbatched problems only");
  Impl& g = *impl_;
  STRATA_CUDA_CHECK(cudaSetDevice(rt.info().index));
  STRATA_CUBLAS_CHECK(cublasLtCreate(&g.handle));
  STRATA_CUDA_CHECK(cudaMalloc(&g.workspace, g.workspace_bytes));
  g.alpha = s.alpha, g.beta = s.beta;
  STRATA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, tb = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const uint64_t m = s.m, n = s.n, k = s.k;
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.la, cuda_type(s.ab_dtype), s.trans_b ? k : n, s.trans_b ? n : k,
                                                 s.trans_b ? k : n));
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.lb, cuda_type(s.ab_dtype), s.trans_a ? m : k, s.trans_a ? k : m,
                                                 s.trans_a ? m : k));
  STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.lc, cuda_type(s.c_dtype), n, m, n));
  cublasLtMatmulPreference_t pref = nullptr;
  STRATA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = g.workspace_bytes;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(g.handle, g.op, g.la, g.lb, g.lc, g.lc, pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  STRATA_CUBLAS_CHECK(st);
  if (returned == 0) throw std::runtime_error("BareGemm: cuBLASLt has no algorithm for this problem");
  g.algo = result.algo;
}
BareGemm::~BareGemm() = default;

void BareGemm::run(Stream& s, const void* a, const void* b, void* c) {
  Impl& g = *impl_;
  STRATA_CUBLAS_CHECK(cublasLtMatmul(g.handle, g.op, &g.alpha, b, g.la, a, g.lb, &g.beta, c, g.lc, c, g.lc, &g.algo,
                                     g.workspace, g.workspace_bytes, native(s)));
}

}  // namespace strata::kernels::cuda_bench
