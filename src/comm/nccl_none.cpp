// A build without NCCL (no CUDA toolkit, or no MPI to bootstrap it): a multi-rank --backend
// cuda job is refused saying so.
#include <stdexcept>

#include "src/comm/comm_internal.h"

namespace strata::comm_detail {

bool nccl_built() { return false; }
std::unique_ptr<Communicator> make_nccl(std::unique_ptr<Communicator>, const CommOptions&) {
  throw std::runtime_error(
      "this strata was built without NCCL, so a --backend cuda job cannot run on several ranks: build it with the CUDA "
      "toolkit (which ships NCCL) and MPI (libopenmpi-dev), or run multi-rank jobs with --backend cpu");
}

}  // namespace strata::comm_detail
