// What communicator.cpp needs from the backends it cannot include directly: the local
// communicator's factory, and the MPI hooks (defined in mpi.cpp, or as stubs in a build
// without MPI, so the rest of src/ never sees mpi.h).
#pragma once
#include <memory>

#include "src/comm/communicator.h"

namespace strata::comm_detail {

std::unique_ptr<Communicator> make_local();

bool mpi_built();
std::unique_ptr<Communicator> make_mpi(const CommOptions& options);
bool mpi_active();
int mpi_world_rank();                    // MPI_COMM_WORLD rank; call only when mpi_active()
[[noreturn]] void mpi_abort(int exit_code);  // MPI_Abort(MPI_COMM_WORLD, exit_code)

// The nccl communicator (nccl.cpp, or nccl_none.cpp in a build without CUDA or MPI): made over
// `control` (an mpi communicator of the same ranks, or a local one for a world of one), which
// keeps the control plane; each rank on GPU control->local_rank().
bool nccl_built();
std::unique_ptr<Communicator> make_nccl(std::unique_ptr<Communicator> control, const CommOptions& options);

}  // namespace strata::comm_detail
