// The MPI hooks of a build without MPI (cmake found none): only the local communicator
// exists, MPI is never active, and make_mpi_communicator() says how to get it.
#include <cstdlib>
#include <stdexcept>

#include "src/comm/comm_internal.h"

namespace strata::comm_detail {

bool mpi_built() { return false; }
std::unique_ptr<Communicator> make_mpi(const CommOptions&) {
  throw std::runtime_error("strata was built without MPI");
}
bool mpi_active() { return false; }
int mpi_world_rank() { return 0; }
void mpi_abort(int exit_code) { std::_Exit(exit_code); }

}  // namespace strata::comm_detail
