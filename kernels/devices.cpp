// cuda_device_count, apart from runtime.cpp: the communicator asks it (src/comm), and the fuzz
// targets link the communicator without the runtimes.
#include "kernels/runtime.h"

namespace strata::kernels {

#ifdef STRATA_HAVE_CUDA
namespace cuda {
int device_count();
}  // namespace cuda
#endif

int cuda_device_count() {
#ifdef STRATA_HAVE_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

}  // namespace strata::kernels
