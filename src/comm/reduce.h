// The fixed-order sum every communicator's reduce_scatter/all_reduce is defined by (see
// communicator.h): element i is the fp32 sum of the N contributions in rank order, rounded once.
// Host code; the mpi communicator runs it on the stream's worker, tests use it as the reference.
#pragma once
#include <cstddef>

#include "kernels/dtype.h"

namespace strata {

// dst[i] = dtype( ((float(src[0][i]) + float(src[1][i])) + ...) + float(src[n-1][i]) ), for
// i < count. dst may be one of the sources at the same address (in place); other overlaps are
// not allowed. n >= 1.
void sum_in_rank_order(const void* const* srcs, int n, void* dst, size_t count, kernels::DType dtype);

}  // namespace strata
