// The Communicator's public calls (argument checks shared by every backend, then the backend's
// do_*), CommHandle, launch detection, the factory, and the failure hooks that stop every rank.
#include "src/comm/communicator.h"

#include <unistd.h>

#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "src/comm/comm_internal.h"

namespace strata {

std::string_view comm_backend_name(CommBackend b) {
  switch (b) {
    case CommBackend::local: return "local";
    case CommBackend::mpi: return "mpi";
    case CommBackend::nccl: return "nccl";
  }
  return "?";
}

namespace {

[[noreturn]] void bad(std::string_view call, const std::string& what) {
  throw std::invalid_argument(std::string(call) + ": " + what);
}

size_t element_size(std::string_view call, DType t) {
  if (t != DType::f32 && t != DType::bf16 && t != DType::f16)
    bad(call, "unknown dtype " + std::to_string(static_cast<int>(t)));
  return kernels::dtype_size(t);
}

// count * size * factor bytes, throwing instead of overflowing.
size_t bytes_of(std::string_view call, size_t count, size_t size, size_t factor) {
  const size_t max = std::numeric_limits<size_t>::max();
  if (count != 0 && (size > max / count || factor > max / (count * size)))
    bad(call, std::to_string(count) + " elements of " + std::to_string(size) + " bytes × " + std::to_string(factor) +
                  " overflow the address space");
  return count * size * factor;
}

void need_pointer(std::string_view call, const char* name, const void* p, size_t bytes) {
  if (p == nullptr && bytes > 0) bad(call, std::string(name) + " is null with " + std::to_string(bytes) + " bytes to move");
}

bool overlap(const void* a, size_t na, const void* b, size_t nb) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return na > 0 && nb > 0 && x < y + nb && y < x + na;
}

std::string range(const void* p, size_t bytes) {
  std::ostringstream s;
  s << '[' << p << ", +" << bytes << " bytes)";
  return s.str();
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end && *end == '\0' && x >= 0 && x <= std::numeric_limits<int>::max()) ? static_cast<int>(x) : fallback;
}

}  // namespace

Communicator::Communicator(CommBackend backend, int rank, int world, int local_rank, int local_world)
    : backend_(backend), rank_(rank), world_(world), local_rank_(local_rank), local_world_(local_world) {
  assert(world >= 1 && rank >= 0 && rank < world && local_world >= 1 && local_rank >= 0 && local_rank < local_world);
}

void Communicator::all_gather(const void* send, void* recv, size_t send_count, DType dtype, kernels::Stream& stream) {
  constexpr std::string_view call = "all_gather";
  const size_t es = element_size(call, dtype);
  const size_t send_bytes = bytes_of(call, send_count, es, 1);
  const size_t recv_bytes = bytes_of(call, send_count, es, static_cast<size_t>(world_));
  need_pointer(call, "send", send, send_bytes);
  need_pointer(call, "recv", recv, recv_bytes);
  const bool in_place = send == static_cast<const std::byte*>(recv) + static_cast<size_t>(rank_) * send_bytes;
  if (!in_place && overlap(send, send_bytes, recv, recv_bytes))
    bad(call, "send " + range(send, send_bytes) + " overlaps recv " + range(recv, recv_bytes) +
                  "; in place means send == recv + rank × send bytes (rank " + std::to_string(rank_) + ")");
  sent_bytes_ += send_bytes * static_cast<size_t>(world_ - 1);
  if (send_bytes > 0) do_all_gather(send, recv, send_count, dtype, stream);
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                  kernels::Stream& stream) {
  constexpr std::string_view call = "reduce_scatter";
  const size_t es = element_size(call, dtype);
  const size_t recv_bytes = bytes_of(call, recv_count, es, 1);
  const size_t send_bytes = bytes_of(call, recv_count, es, static_cast<size_t>(world_));
  need_pointer(call, "send", send, send_bytes);
  need_pointer(call, "recv", recv, recv_bytes);
  const bool in_place = recv == static_cast<const std::byte*>(send) + static_cast<size_t>(rank_) * recv_bytes;
  if (!in_place && overlap(send, send_bytes, recv, recv_bytes))
    bad(call, "send " + range(send, send_bytes) + " overlaps recv " + range(recv, recv_bytes) +
                  "; in place means recv == send + rank × recv bytes (rank " + std::to_string(rank_) + ")");
  sent_bytes_ += recv_bytes * static_cast<size_t>(world_ - 1);
  if (recv_bytes > 0) do_reduce_scatter(send, recv, recv_count, dtype, stream);
}

void Communicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, kernels::Stream& stream) {
  constexpr std::string_view call = "all_reduce";
  const size_t bytes = bytes_of(call, count, element_size(call, dtype), 1);
  need_pointer(call, "send", send, bytes);
  need_pointer(call, "recv", recv, bytes);
  if (send != recv && overlap(send, bytes, recv, bytes))
    bad(call, "send " + range(send, bytes) + " partially overlaps recv " + range(recv, bytes) +
                  "; pass send == recv for in place");
  sent_bytes_ += 2 * bytes * static_cast<size_t>(world_ - 1) / static_cast<size_t>(world_);
  if (bytes > 0) do_all_reduce(send, recv, count, dtype, stream);
}

void Communicator::broadcast(void* buf, size_t count, DType dtype, int root, kernels::Stream& stream) {
  constexpr std::string_view call = "broadcast";
  const size_t bytes = bytes_of(call, count, element_size(call, dtype), 1);
  need_pointer(call, "buf", buf, bytes);
  if (root < 0 || root >= world_)
    bad(call, "root " + std::to_string(root) + " outside [0, " + std::to_string(world_) + ")");
  if (rank_ == root) sent_bytes_ += bytes * static_cast<size_t>(world_ - 1);
  if (bytes > 0) do_broadcast(buf, count, dtype, root, stream);
}

void Communicator::barrier(kernels::Stream& stream) { do_barrier(stream); }

void Communicator::send(const void* buf, size_t count, DType dtype, int peer, kernels::Stream& stream) {
  constexpr std::string_view call = "send";
  const size_t bytes = bytes_of(call, count, element_size(call, dtype), 1);
  need_pointer(call, "buf", buf, bytes);
  if (peer < 0 || peer >= world_ || peer == rank_)
    bad(call, "peer " + std::to_string(peer) + " is not another rank of [0, " + std::to_string(world_) + ")");
  sent_bytes_ += bytes;
  if (bytes > 0) do_send(buf, count, dtype, peer, stream);
}

void Communicator::recv(void* buf, size_t count, DType dtype, int peer, kernels::Stream& stream) {
  constexpr std::string_view call = "recv";
  const size_t bytes = bytes_of(call, count, element_size(call, dtype), 1);
  need_pointer(call, "buf", buf, bytes);
  if (peer < 0 || peer >= world_ || peer == rank_)
    bad(call, "peer " + std::to_string(peer) + " is not another rank of [0, " + std::to_string(world_) + ")");
  if (bytes > 0) do_recv(buf, count, dtype, peer, stream);
}

void Communicator::send_recv(const void* send_buf, size_t send_count, int send_peer, void* recv_buf,
                             size_t recv_count, int recv_peer, DType dtype, kernels::Stream& stream) {
  constexpr std::string_view call = "send_recv";
  const size_t es = element_size(call, dtype);
  const size_t sb = bytes_of(call, send_count, es, 1), rb = bytes_of(call, recv_count, es, 1);
  need_pointer(call, "send_buf", send_buf, sb);
  need_pointer(call, "recv_buf", recv_buf, rb);
  for (int peer : {send_peer, recv_peer})
    if (peer < 0 || peer >= world_ || peer == rank_)
      bad(call, "peer " + std::to_string(peer) + " is not another rank of [0, " + std::to_string(world_) + ")");
  const auto* s0 = static_cast<const std::byte*>(send_buf);
  const auto* r0 = static_cast<const std::byte*>(recv_buf);
  if (sb > 0 && rb > 0 && s0 < r0 + rb && r0 < s0 + sb) bad(call, "the send and receive buffers overlap");
  sent_bytes_ += sb;
  if (sb == 0 && rb == 0) return;
  if (rb == 0) return do_send(send_buf, send_count, dtype, send_peer, stream);
  if (sb == 0) return do_recv(recv_buf, recv_count, dtype, recv_peer, stream);
  do_send_recv(send_buf, send_count, send_peer, recv_buf, recv_count, recv_peer, dtype, stream);
}

void Communicator::host_broadcast(void* bytes, size_t n_bytes, int root) {
  constexpr std::string_view call = "host_broadcast";
  need_pointer(call, "bytes", bytes, n_bytes);
  if (root < 0 || root >= world_)
    bad(call, "root " + std::to_string(root) + " outside [0, " + std::to_string(world_) + ")");
  if (n_bytes > 0) do_host_broadcast(bytes, n_bytes, root);
}

void Communicator::host_all_gather(const void* send, void* recv, size_t n_bytes) {
  constexpr std::string_view call = "host_all_gather";
  const size_t recv_bytes = bytes_of(call, n_bytes, 1, static_cast<size_t>(world_));
  need_pointer(call, "send", send, n_bytes);
  need_pointer(call, "recv", recv, recv_bytes);
  const bool in_place = send == static_cast<const std::byte*>(recv) + static_cast<size_t>(rank_) * n_bytes;
  if (!in_place && overlap(send, n_bytes, recv, recv_bytes))
    bad(call, "send " + range(send, n_bytes) + " overlaps recv " + range(recv, recv_bytes));
  if (n_bytes > 0) do_host_all_gather(send, recv, n_bytes);
}

void Communicator::host_gather(const void* send, void* recv, size_t n_bytes, int root) {
  constexpr std::string_view call = "host_gather";
  if (root < 0 || root >= world_)
    bad(call, "root " + std::to_string(root) + " outside [0, " + std::to_string(world_) + ")");
  need_pointer(call, "send", send, n_bytes);
  if (rank_ == root) {
    const size_t recv_bytes = bytes_of(call, n_bytes, 1, static_cast<size_t>(world_));
    need_pointer(call, "recv", recv, recv_bytes);
    if (overlap(send, n_bytes, recv, recv_bytes))
      bad(call, "send " + range(send, n_bytes) + " overlaps recv " + range(recv, recv_bytes));
  }
  if (n_bytes > 0) do_host_gather(send, recv, n_bytes, root);
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  if (color < 0) bad("split", "color " + std::to_string(color) + " is negative; every rank must join a group");
  return do_split(color, key);
}

void CommHandle::record(kernels::Stream& comm_stream) {
  assert(!pending_ && "CommHandle::record: the previous record was never waited on");
  comm_stream.record(*event_);
  pending_ = true;
}

void CommHandle::wait(kernels::Stream& stream) {
  stream.wait(*event_);
  pending_ = false;
}

void CommHandle::synchronize() {
  pending_ = false;
  event_->synchronize();
}

Launch detect_launch() {
  Launch l;
  // OpenMPI's mpirun sets OMPI_COMM_WORLD_*; PMIx launchers (OpenMPI 5, srun --mpi=pmix) set
  // PMIX_RANK; PMI-1/2 launchers (MPICH's hydra, srun --mpi=pmi2) set PMI_RANK / PMI_SIZE.
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) {
    l.source = "OMPI_COMM_WORLD_SIZE";
    l.world = env_int("OMPI_COMM_WORLD_SIZE", 1);
    l.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
  } else if (std::getenv("PMIX_RANK")) {
    l.source = "PMIX_RANK";
    l.rank = env_int("PMIX_RANK", 0);
    l.world = env_int("PMIX_SIZE", env_int("PMI_SIZE", 1));
  } else if (std::getenv("PMI_RANK")) {
    l.source = "PMI_RANK";
    l.rank = env_int("PMI_RANK", 0);
    l.world = env_int("PMI_SIZE", 1);
  } else {
    return l;
  }
  l.by_launcher = true;
  if (l.world < 1) l.world = 1;
  return l;
}

bool comm_mpi_available() { return comm_detail::mpi_built(); }
bool comm_mpi_active() { return comm_detail::mpi_active(); }

std::unique_ptr<Communicator> make_local_communicator() { return comm_detail::make_local(); }

std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& options) {
  if (!comm_detail::mpi_built())
    throw std::runtime_error(
        "this strata was built without MPI, so it cannot join a multi-rank job; install libopenmpi-dev "
        "(scripts/common.sh does) and rebuild");
  return comm_detail::make_mpi(options);
}

std::unique_ptr<Communicator> make_communicator(kernels::Backend device, const CommOptions& options) {
  const Launch l = detect_launch();
  if (!l.by_launcher) return make_local_communicator();
  if (device == kernels::Backend::cuda) {
    if (l.world == 1) return make_local_communicator();
    const std::string who = "started by a launcher (" + l.source + ") as rank " + std::to_string(l.rank) + " of " +
                            std::to_string(l.world) + " on the cuda backend";
    if (kernels::cuda_device_count() == 0)  // (before MPI_Init: the runtime would refuse anyway)
      throw std::runtime_error(who + ", but no CUDA device is visible here, or this strata was built without CUDA; "
                               "use --backend cpu");
    if (!comm_detail::mpi_built())
      throw std::runtime_error(who + ", and this strata was built without MPI, which both of its multi-rank "
                               "communicators need: install libopenmpi-dev and rebuild, or run one rank");
    // NCCL where each rank of a node has a GPU of its own; where ranks share GPUs (2 ranks on
    // one GPU: the multi-rank paths tested on a one-GPU machine) the mpi communicator, its
    // device buffers staged through pinned host memory (src/comm/mpi.cpp).
    auto mpi = make_mpi_communicator(options);
    if (comm_detail::nccl_built() && mpi->local_world() <= kernels::cuda_device_count())
      return comm_detail::make_nccl(std::move(mpi), options);
    return mpi;
  }
  if (!comm_detail::mpi_built() && l.world == 1) return make_local_communicator();
  return make_mpi_communicator(options);
}

namespace {

// One write(2), so lines from ranks sharing a terminal do not interleave mid-line.
void print_line(const std::string& line) {
  std::fflush(stdout);
  std::fflush(stderr);
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) break;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace

void abort_all(int rank, std::string_view message, int exit_code) {
  if (exit_code == 0) exit_code = 1;
  print_line("strata: rank " + std::to_string(rank) + ": error: " + std::string(message) + "\n");
  if (comm_detail::mpi_active()) comm_detail::mpi_abort(exit_code);
  std::fflush(nullptr);
  std::_Exit(exit_code);
}

int report_fatal_error(std::string_view message, int exit_code) {
  if (exit_code == 0) exit_code = 1;
  if (comm_detail::mpi_active()) abort_all(comm_detail::mpi_world_rank(), message, exit_code);
  const Launch l = detect_launch();
  if (l.by_launcher && l.world > 1) abort_all(l.rank, message, exit_code);
  print_line("strata: error: " + std::string(message) + "\n");
  return exit_code;
}

}  // namespace strata
