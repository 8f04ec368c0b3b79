// Communicator: the collectives ZeRO needs (all-gather, reduce-scatter, all-reduce, broadcast,
// barrier) between the ranks of one process group, enqueued on a runtime stream like NCCL's, so
// communication overlaps compute; plus launch detection and the hook that stops every rank.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kernels/dtype.h"
#include "kernels/runtime.h"

namespace strata {

using kernels::DType;

// local: one rank, no MPI. mpi: OpenMPI between processes, CPU ("device" = host) buffers.
// nccl: GPU buffers (not written yet; it slots in as a third subclass, see below).
enum class CommBackend : uint8_t { local, mpi, nccl };
std::string_view comm_backend_name(CommBackend b);

// ---------------------------------------------------------------------------------------------
// The contract every implementation keeps.
//
// Stream order. A collective validates its arguments on the calling (host) thread, throwing
// std::invalid_argument naming the call and the argument, then enqueues the communication on
// `stream` and returns at once. It reads its inputs and writes its outputs when the stream
// reaches it; the caller orders it against compute with events (llm.c / FSDP: a communication
// stream that waits on a "grads ready" event; compute waits on a "gathered" event, see
// CommHandle). Errors during the transfer surface at the stream's next synchronize(). Buffers
// are runtime memory of the communicator's backend (CPU: host memory).
//
// Issue order. Every rank of the group enqueues the same collectives, with the same counts and
// dtypes, in the same order, from one host thread (as NCCL requires). Collectives may run on
// different streams; each is matched across ranks by its place in that order, not by timing.
//
// Fixed-order sums (DESIGN.md "Reductions have a fixed order"). reduce_scatter and all_reduce
// compute element i of the result as
//     acc = float(x_0[i]); acc += float(x_1[i]); ... acc += float(x_{N-1}[i]); out[i] = dtype(acc)
// — x_r is rank r's input, the sum runs in rank order 0..N-1 in fp32 and 16-bit types are
// rounded once (round to nearest even). So the result is a fixed function of the inputs, bit
// for bit, whatever the message timing, and independent of how the buffer is chunked:
// all_reduce(x) restricted to rank r's shard is bitwise reduce_scatter(x) on rank r, so ZeRO
// stage 0 (all-reduce) and stage 2 (reduce-scatter) give identical gradients. Implementations
// may not use MPI_Allreduce/MPI_Reduce_scatter or NCCL's ring sums, which do not promise this.
//
// Shapes (NCCL's): counts are elements of `dtype`; the flat buffer of `world * n` elements is
// split into `world` contiguous shards, shard r belonging to rank r.
//   all_gather:     send n elements -> recv world*n; rank r's send lands at recv[r*n].
//                   In place when send == recv + rank*n*size.
//   reduce_scatter: send world*n elements -> recv n = sum over ranks of shard `rank` of send.
//                   In place when recv == send + rank*n*size.
//   all_reduce:     send n -> recv n (any n; callers that also reduce-scatter pad n to a
//                   multiple of world, as the trainer pads units to world × 4 KiB).
//                   In place when send == recv.
//   broadcast:      buf (n elements) of rank `root` is copied to every rank's buf.
// Any other overlap of send and recv is rejected. Null pointers are allowed only with n == 0.
//
// Failure. A rank that fails must take the job down (abort_all / report_fatal_error below), and
// must not MPI_Finalize: the other ranks may be waiting in a collective for it.
//
// NCCL is the third subclass (src/comm/nccl.cpp), behind this interface: ncclAllGather /
// ncclSend+ncclRecv take a cudaStream_t as these take a Stream; its communicator is made from
// an mpi one (rank 0 calls ncclGetUniqueId, host_broadcast()s its 128 bytes, every rank calls
// ncclCommInitRank(world, id, rank) on GPU local_rank()); split() is ncclCommSplit. Its sums
// keep the fixed order: shards exchanged with grouped ncclSend/ncclRecv, then a kernel that
// sums the N contributions in rank order (Ops::rank_order_sum), as the mpi implementation does
// on the host.
// ---------------------------------------------------------------------------------------------
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  CommBackend backend() const { return backend_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int local_rank() const { return local_rank_; }    // rank among this group's ranks on this node
  int local_world() const { return local_world_; }  // this group's ranks on this node

  // Stream-ordered collectives (see the contract above).
  void all_gather(const void* send, void* recv, size_t send_count, DType dtype, kernels::Stream& stream);
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, kernels::Stream& stream);
  void all_reduce(const void* send, void* recv, size_t count, DType dtype, kernels::Stream& stream);
  void broadcast(void* buf, size_t count, DType dtype, int root, kernels::Stream& stream);
  void barrier(kernels::Stream& stream);  // completes on each rank once every rank has reached it
  // Point-to-point (pipeline parallelism's activations and their gradients between neighbour
  // stages): `count` elements of buf to / from rank `peer` of this group, stream-ordered like a
  // collective. Matched by order per pair, not with the group's collectives: the k-th send from
  // rank p to rank q meets the k-th recv on q from p, whatever else either issues (two ranks
  // alone take part; the others' collectives are not affected). A send completes on its stream
  // once its bytes are handed over, a recv once they have arrived.
  void send(const void* buf, size_t count, DType dtype, int peer, kernels::Stream& stream);
  void recv(void* buf, size_t count, DType dtype, int peer, kernels::Stream& stream);
  // A send to send_peer and a receive from recv_peer posted together, done when both are
  // (Megatron-LM's send_forward_recv_backward): two neighbours that each send to the other and
  // then receive would otherwise both wait in their sends. Each half keeps its pair's order
  // with send and recv. The two buffers must not overlap.
  void send_recv(const void* send_buf, size_t send_count, int send_peer, void* recv_buf, size_t recv_count,
                 int recv_peer, DType dtype, kernels::Stream& stream);

  // Host-blocking control plane for small messages (NCCL's unique id, agreeing on a seed,
  // checking that every rank parsed the same config). Call from the host thread that issues
  // collectives, in the same order on every rank.
  void host_broadcast(void* bytes, size_t n_bytes, int root);
  // recv (world * n_bytes) gets every rank's n_bytes, in rank order.
  void host_all_gather(const void* send, void* recv, size_t n_bytes);
  // The same on `root` alone (recv may be null elsewhere), for large messages (a tensor's parts
  // gathered for a save): sent in pieces, no limit on n_bytes.
  void host_gather(const void* send, void* recv, size_t n_bytes, int root);

  // A communicator for a process group (MPI_Comm_split / ncclCommSplit): ranks with the same
  // color form a group, ordered by (key, rank). Collective over this communicator, host thread.
  std::unique_ptr<Communicator> split(int color, int key);

  // Bytes of host staging this communicator holds (counted in the host budget); mpi grows it to
  // one workspace per collective running at the same time, then reuses them.
  virtual size_t workspace_bytes() const { return 0; }
  // Milliseconds stream-ordered collectives have run (moving bytes, summing, and waiting for the
  // other ranks to arrive), since this communicator was made: on `stream` only, or on every
  // stream (null). 0 where the implementation does not keep it (local: nothing to move).
  virtual double busy_ms(const kernels::Stream* /*stream*/ = nullptr) const { return 0; }
  // Bytes this rank has sent to the others through stream-ordered collectives since this
  // communicator was made, by the algorithms' count (as many are received): all_reduce of S
  // bytes 2·(world−1)/world·S (a reduce-scatter, then an all-gather), reduce_scatter and
  // all_gather (world−1)/world of the whole buffer, broadcast (world−1)·S from the root, a send
  // its bytes.
  uint64_t sent_bytes() const { return sent_bytes_; }

 protected:
  Communicator(CommBackend backend, int rank, int world, int local_rank, int local_world);

  // Called after validation; counts are as in the public calls.
  virtual void do_all_gather(const void* send, void* recv, size_t send_count, DType dtype, kernels::Stream& s) = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, kernels::Stream& s) = 0;
  virtual void do_all_reduce(const void* send, void* recv, size_t count, DType dtype, kernels::Stream& s) = 0;
  virtual void do_broadcast(void* buf, size_t count, DType dtype, int root, kernels::Stream& s) = 0;
  virtual void do_barrier(kernels::Stream& s) = 0;
  virtual void do_send(const void* buf, size_t count, DType dtype, int peer, kernels::Stream& s) = 0;
  virtual void do_recv(void* buf, size_t count, DType dtype, int peer, kernels::Stream& s) = 0;
  virtual void do_send_recv(const void* send_buf, size_t send_count, int send_peer, void* recv_buf, size_t recv_count,
                            int recv_peer, DType dtype, kernels::Stream& s) = 0;
  virtual void do_host_broadcast(void* bytes, size_t n_bytes, int root) = 0;
  virtual void do_host_all_gather(const void* send, void* recv, size_t n_bytes) = 0;
  virtual void do_host_gather(const void* send, void* recv, size_t n_bytes, int root) = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key) = 0;

 private:
  CommBackend backend_;
  int rank_, world_, local_rank_, local_world_;
  uint64_t sent_bytes_ = 0;  // host thread only (collectives are issued from one)
};

// The completion of collectives enqueued on a communication stream, as one handle (Megatron's
// start/finish pair): record() after enqueuing, then wait(compute_stream) — compute waits,
// the host does not — or synchronize() on the host. At most one record is outstanding:
// recording again before waiting asserts. Create handles up front; the step loop reuses them.
class CommHandle {
 public:
  explicit CommHandle(kernels::Runtime& rt) : event_(rt.create_event()) {}
  void record(kernels::Stream& comm_stream);
  void wait(kernels::Stream& stream);  // later work on `stream` waits for the recorded collectives
  void synchronize();                  // host waits; rethrows the communication stream's error
  bool done() { return event_->query(); }
  bool pending() const { return pending_; }

 private:
  std::unique_ptr<kernels::Event> event_;
  bool pending_ = false;
};

// ---------------------------------------------------------------------------------------------
// Launch detection and construction.

// How this process was started, from the environment only (never touches MPI).
struct Launch {
  bool by_launcher = false;  // OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_RANK is set
  int rank = 0;              // from OMPI_COMM_WORLD_RANK / PMIX_RANK / PMI_RANK (0 if unknown)
  int world = 1;             // from OMPI_COMM_WORLD_SIZE / PMI_SIZE (1 if unknown)
  std::string source;        // the variable that said so, for messages ("" when not launched)
};
Launch detect_launch();

// True when strata was built with MPI (otherwise only `local` exists).
bool comm_mpi_available();
// True while MPI is initialised and not finalised in this process.
bool comm_mpi_active();

struct CommOptions {
  // mpi: reduce_scatter/all_reduce exchange and sum shards in pieces of at most this many
  // bytes per peer, double-buffered; a workspace is 2 × (world-1) × piece bytes (the piece is
  // shrunk so one workspace stays under 64 MiB). Multiple of 4096.
  size_t piece_bytes = size_t{1} << 20;
};

// The world communicator for this process: `mpi` when started by mpirun (detect_launch()), and
// `local` otherwise, so a plain `strata ...` never calls MPI_Init. `device` is the runtime's
// backend: cuda with more than one rank gets the nccl communicator (src/comm/nccl.cpp: NCCL over
// an mpi control plane, one GPU per rank) where every rank of a node has a GPU of its own, else
// (ranks sharing GPUs, or a build without NCCL) the mpi one, its device buffers staged through
// pinned host memory; no GPU visible throws before MPI starts. mpi initialises
// MPI with MPI_THREAD_MULTIPLE (collectives run on stream worker threads) and throws if the
// library cannot provide it. Create it once per process, on the main thread, and destroy it
// there on the normal path: destroying the last mpi communicator calls MPI_Finalize (skipped
// while an exception is unwinding, so a failing rank never waits on the others).
std::unique_ptr<Communicator> make_communicator(kernels::Backend device = kernels::Backend::cpu,
                                                const CommOptions& options = {});
std::unique_ptr<Communicator> make_local_communicator();
// Throws when strata was built without MPI.
std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& options = {});

// ---------------------------------------------------------------------------------------------
// Failure: one failing rank stops the job, never hangs it.

// Prints "strata: rank R: error: <message>" to stderr in one write and stops every rank: with
// MPI active, MPI_Abort(MPI_COMM_WORLD, exit_code) (mpirun then kills the others, which may be
// blocked in a collective waiting for this rank); otherwise _exit(exit_code) — under mpirun a
// non-zero exit also makes mpirun kill the job. Safe from any thread, with collectives in flight.
[[noreturn]] void abort_all(int rank, std::string_view message, int exit_code = 1);

// For main's top-level catch: when this process is one rank of a launched job, abort_all(this
// rank, message) and never return; otherwise print "strata: error: <message>" and return
// exit_code, for main to return. Usage:  catch (const std::exception& e) {
//   return strata::report_fatal_error(e.what()); }
int report_fatal_error(std::string_view message, int exit_code = 1);

}  // namespace strata
