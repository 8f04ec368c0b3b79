// The CUDA backend's GEMM engine (internal): one cuBLASLt handle per runtime and a thread-safe
// cache of per-problem plans, so a step loop only looks a plan up and launches it. A problem
// cuBLASLt has no algorithm for (unusual leading dims or alignment) falls back to cuBLAS's
// cublasGemmStridedBatchedEx, which takes any layout.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"

namespace strata::kernels::cuda {

class MatmulEngine {
 public:
  // Workspace offered to the heuristic (NVIDIA recommends 32 MiB on Hopper); taken from the
  // stream's scratch only when the chosen algorithm needs it.
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  explicit MatmulEngine(int device);
  ~MatmulEngine();
  MatmulEngine(const MatmulEngine&) = delete;
  MatmulEngine& operator=(const MatmulEngine&) = delete;

  void run(StreamContext& ctx, const MatmulArgs& a);
  size_t plans_built();

 private:
  // A fully resolved problem: leading dims and batch strides explicit, plus the alignments the
  // heuristic was asked for (a strided view inside a fused buffer may be less aligned).
  struct Key {
    int64_t m = 0, n = 0, k = 0, batch = 0;
    int64_t lda = 0, ldb = 0, ldc = 0, stride_a = 0, stride_b = 0, stride_c = 0;
    bool trans_a = false, trans_b = false;
    DType ab = DType::f32, c = DType::f32;
    uint32_t align_a = 0, align_b = 0, align_c = 0;
    auto tie() const {
      return std::tie(m, n, k, batch, lda, ldb, ldc, stride_a, stride_b, stride_c, trans_a, trans_b, ab, c, align_a,
                      align_b, align_c);
    }
    bool operator==(const Key& o) const { return tie() == o.tie(); }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  struct Plan;
  static Key resolve(const MatmulArgs& a);
  std::unique_ptr<Plan> build(const Key& k) const;
  const Plan& plan(const Key& k);

  void run_fallback(StreamContext& ctx, const MatmulArgs& a, const Key& k);

  cublasLtHandle_t handle_ = nullptr;
  cublasHandle_t fallback_ = nullptr;  // created on first use; calls serialised by fallback_mu_
  std::mutex fallback_mu_;
  std::mutex mu_;
  std::unordered_map<Key, std::unique_ptr<Plan>, KeyHash> cache_;
};

}  // namespace strata::kernels::cuda
