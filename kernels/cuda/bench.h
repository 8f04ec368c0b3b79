// What `strata bench ops --backend cuda` needs beyond the public runtime (CUDA-free header, so
// apps include it; the implementation exists only in CUDA builds, STRATA_HAVE_CUDA): a timer on
// CUDA events (the runtime's own events do not time) and a bare cuBLASLt GEMM (descriptors and
// algorithm built once, nothing of strata's in the way) to compare strata's matmul against.
#pragma once
#include <memory>

#include "kernels/ops.h"
#include "kernels/runtime.h"

namespace strata::kernels::cuda_bench {

// Elapsed GPU time between start() and stop() on one CUDA stream.
class Timer {
 public:
  explicit Timer(Stream& s);
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  void start();
  void stop();
  double ms();  // waits for stop()'s event

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One cuBLASLt matmul problem (the shape, transposes, dtypes, leading dims and alpha/beta of
// `shape`; pointers ignored), planned once; run() launches it on s with these pointers.
class BareGemm {
 public:
  BareGemm(Runtime& rt, const MatmulArgs& shape);
  ~BareGemm();
  BareGemm(const BareGemm&) = delete;
  BareGemm& operator=(const BareGemm&) = delete;
  void run(Stream& s, const void* a, const void* b, void* c);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::kernels::cuda_bench
