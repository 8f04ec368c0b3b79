// Bandwidth of strata's collectives across ranks, one JSON line per (op, dtype, size), in
// nccl-tests' terms (algbw = bytes / time; busbw scales it to what each link carried), next to
// MPI's own unordered MPI_Allreduce as the price of fixed-order sums. Fixed iteration counts,
// not Google Benchmark's adaptive ones: every rank must run the same collectives.
//   mpirun -n 2 build/bin/bench_comm [max_mib]
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/runtime.h"
#include "src/comm/communicator.h"

using namespace strata;
using kernels::DType;

namespace {

// Median of `iters` timed runs (after 2 warm-up runs) of fn, each ended by a stream sync and a
// host rendezvous, so every rank times the same collective.
double median_ms(Communicator& c, kernels::Stream& s, int iters, const std::function<void()>& fn) {
  std::vector<double> ms;
  int token = 0, all[256];
  for (int i = 0; i < iters + 2; ++i) {
    c.host_all_gather(&token, all, sizeof token);
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    s.synchronize();
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void line(Communicator& c, const char* op, DType t, size_t bytes, double ms, double bus_factor) {
  if (c.rank() != 0) return;
  const double algbw = static_cast<double>(bytes) / (ms * 1e6);  // GB/s
  std::printf(
      "{\"bench\":\"comm\",\"op\":\"%s\",\"dtype\":\"%s\",\"world\":%d,\"bytes\":%zu,\"ms\":%.3f,"
      "\"algbw_gbps\":%.3f,\"busbw_gbps\":%.3f}\n",
      op, std::string(kernels::dtype_name(t)).c_str(), c.world(), bytes, ms, algbw, algbw * bus_factor);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const size_t max_bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 64) << 20;
    auto rt = kernels::make_runtime(kernels::Backend::cpu);
    auto comm = make_communicator();
    if (comm->backend() != CommBackend::mpi) throw std::runtime_error("run under mpirun: mpirun -n 2 bench_comm");
    auto stream = rt->create_stream();
    Communicator& c = *comm;
    const int n = c.world();
    const double ring = static_cast<double>(n - 1) / n;
    kernels::DeviceBuffer a(*rt, max_bytes), b(*rt, max_bytes);
    std::memset(a.data(), 0, max_bytes);  // zeros: valid in every dtype, and faulted in before timing
    std::memset(b.data(), 0, max_bytes);
    for (size_t bytes = size_t{64} << 10; bytes <= max_bytes; bytes *= 4) {
      const int iters = bytes >= (size_t{16} << 20) ? 5 : 20;
      for (DType t : {DType::f32, DType::bf16}) {
        const size_t count = bytes / kernels::dtype_size(t), shard = count / static_cast<size_t>(n);
        const size_t shard_bytes = shard * kernels::dtype_size(t);
        double ms = median_ms(c, *stream, iters, [&] { c.all_gather(a.data(), b.data(), shard, t, *stream); });
        line(c, "all_gather", t, shard_bytes * n, ms, ring);
        ms = median_ms(c, *stream, iters, [&] { c.reduce_scatter(a.data(), b.data(), shard, t, *stream); });
        line(c, "reduce_scatter", t, shard_bytes * n, ms, ring);
        ms = median_ms(c, *stream, iters, [&] { c.all_reduce(a.data(), b.data(), count, t, *stream); });
        line(c, "all_reduce", t, bytes, ms, 2 * ring);
        if (t == DType::f32) {  // the reference: MPI's own all-reduce, order unspecified
          ms = median_ms(c, *stream, iters, [&] {
            if (MPI_Allreduce(a.data(), b.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS)
              throw std::runtime_error("MPI_Allreduce failed");
          });
          line(c, "mpi_allreduce_unordered", t, bytes, ms, 2 * ring);
        }
      }
    }
    stream.reset();
    comm.reset();
    return 0;
  } catch (const std::exception& e) {
    return report_fatal_error(e.what());
  }
}
