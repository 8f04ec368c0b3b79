// The nccl communicator (a --backend cuda job under mpirun): the collectives on NCCL, enqueued on
// the CUDA streams they are given; the control plane (the host_* calls, and the bootstrap of
// NCCL's unique id) on an mpi communicator of the same ranks. Sums keep the fixed rank order
// (communicator.h): reduce_scatter and all_reduce exchange each rank's shard of every rank's
// input with grouped ncclSend/ncclRecv into a workspace and sum the contributions in rank order
// on the device (Ops::rank_order_sum, the CPU's sum bit for bit); NCCL's own sums (ring, tree)
// do not promise an order. all_gather and broadcast only move bytes: ncclAllGather,
// ncclBroadcast. Buffers in host memory (a save's gathers) are staged through device memory.
// A rank whose peer died would wait in a collective forever: a watchdog polls
// ncclCommGetAsyncError and takes the job down (abort_all) naming the error, as the mpi side
// does for a failed rank.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/runtime.h"
#include "src/comm/comm_internal.h"

namespace strata {
namespace {

using kernels::DType;

void check_nccl(ncclResult_t r, const char* call, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return;
  std::string msg = std::string("NCCL error in ") + call + ": " + ncclGetErrorString(r);
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) msg += " (" + std::string(last) + ")";
  }
  throw std::runtime_error(msg);
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
  }
  throw std::invalid_argument("nccl: unknown dtype");
}

// Whether NCCL can use p as it is: device (or managed) memory. Host memory, pinned or not, is
// staged.
bool on_device(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // (pageable memory on old drivers: an error, and host memory)
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

// A device copy of a host buffer for one collective, in stream order: `in` copies the host bytes
// in first, `out` copies the device bytes back after; freed (stream-ordered) when done. A device
// buffer passes through untouched.
class Staged {
 public:
  Staged(void* p, size_t bytes, bool in, bool out, cudaStream_t s) : host_(p), bytes_(bytes), out_(out), s_(s) {
    if (!p || bytes == 0 || on_device(p)) {
      dev_ = p;
      return;
    }
    STRATA_CUDA_CHECK(cudaMallocAsync(&dev_, bytes, s));
    owned_ = true;
    if (in) STRATA_CUDA_CHECK(cudaMemcpyAsync(dev_, p, bytes, cudaMemcpyHostToDevice, s));
  }
  // After the collective is enqueued: its result back to the host buffer.
  void finish() {
    if (owned_ && out_) STRATA_CUDA_CHECK(cudaMemcpyAsync(host_, dev_, bytes_, cudaMemcpyDeviceToHost, s_));
  }
  ~Staged() {
    if (owned_) (void)cudaFreeAsync(dev_, s_);  // (stream-ordered: after the copy back)
  }
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  void* get() const { return dev_; }
  std::byte* bytes() const { return static_cast<std::byte*>(dev_); }

 private:
  void* host_;
  void* dev_ = nullptr;
  size_t bytes_;
  bool out_, owned_ = false;
  cudaStream_t s_;
};

// One NCCL communicator and its watchdog.
class NcclHandle {
 public:
  NcclHandle(ncclComm_t comm, int rank) : comm_(comm) {
    watchdog_ = std::thread([this, rank] {
      while (!stop_.load()) {
        ncclResult_t err = ncclSuccess;
        if (ncclCommGetAsyncError(comm_, &err) == ncclSuccess && err != ncclSuccess && err != ncclInProgress) {
          const char* last = ncclGetLastError(comm_);
          abort_all(rank, std::string("NCCL communicator failed: ") + ncclGetErrorString(err) +
                              (last && *last ? std::string(" (") + last + ")" : std::string()) +
                              "; a rank of the job died or its network failed");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  ~NcclHandle() {
    stop_.store(true);
    watchdog_.join();
    // Normal path: NCCL waits for the enqueued work; while unwinding (a rank failing) abort, so
    // nothing waits on peers.
    if (std::uncaught_exceptions() > 0)
      (void)ncclCommAbort(comm_);
    else
      (void)ncclCommDestroy(comm_);
  }
  NcclHandle(const NcclHandle&) = delete;
  NcclHandle& operator=(const NcclHandle&) = delete;
  ncclComm_t get() const { return comm_; }

 private:
  ncclComm_t comm_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

// Group calls: ncclGroupStart/End around the sends and receives posted together.
class NcclGroup {
 public:
  explicit NcclGroup(ncclComm_t comm) : comm_(comm) { check_nccl(ncclGroupStart(), "ncclGroupStart"); }
  void end() {
    if (open_) check_nccl(ncclGroupEnd(), "ncclGroupEnd", comm_);
    open_ = false;
  }
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  ncclComm_t comm_;
  bool open_ = true;
};

class NcclCommunicator final : public Communicator {
 public:
  // control: the mpi communicator of the same ranks (the control plane); comm: made over them.
  NcclCommunicator(std::unique_ptr<Communicator> control, ncclComm_t comm, int device, size_t piece_bytes)
      : Communicator(CommBackend::nccl, control->rank(), control->world(), control->local_rank(),
                     control->local_world()),
        control_(std::move(control)),
        nccl_(std::make_unique<NcclHandle>(comm, control_->rank())),
        device_(device),
        piece_bytes_(piece_bytes) {}

  // The world's: rank 0's unique id broadcast over the control plane, then every rank's
  // ncclCommInitRank on GPU local_rank().
  static std::unique_ptr<Communicator> make(std::unique_ptr<Communicator> control, size_t piece_bytes) {
    if (!kernels::cuda_available())
      throw std::runtime_error("--backend cuda: no CUDA device is visible on rank " + std::to_string(control->rank()) +
                               " (use --backend cpu)");
    int devices = 0;
    STRATA_CUDA_CHECK(cudaGetDeviceCount(&devices));
    const int device = control->local_rank();
    if (device >= devices)
      throw std::runtime_error("nccl: rank " + std::to_string(control->rank()) + " is local rank " +
                               std::to_string(device) + " of " + std::to_string(control->local_world()) +
                               " on its node, which has " + std::to_string(devices) +
                               " GPU(s): NCCL needs one GPU per rank (start at most that many ranks per node)");
    STRATA_CUDA_CHECK(cudaSetDevice(device));
    ncclUniqueId id{};
    if (control->rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    control->host_broadcast(&id, sizeof id, 0);
    ncclComm_t comm = nullptr;
    check_nccl(ncclCommInitRank(&comm, control->world(), id, control->rank()), "ncclCommInitRank");
    return std::make_unique<NcclCommunicator>(std::move(control), comm, device, piece_bytes);
  }

 private:
  ncclComm_t comm() const { return nccl_->get(); }
  static cudaStream_t native(kernels::Stream& s) { return kernels::cuda::native(s); }
  static size_t esize(DType t) { return kernels::dtype_size(t); }
  // Elements of one piece of a reduction: the workspace holds world - 1 of them.
  size_t piece_elems(DType t, size_t n) const { return std::max<size_t>(1, std::min(n, piece_bytes_ / esize(t))); }

  void do_all_gather(const void* send, void* recv, size_t send_count, DType dt, kernels::Stream& s) override {
    const cudaStream_t cs = native(s);
    const size_t b = send_count * esize(dt);
    const bool in_place = send == static_cast<const std::byte*>(recv) + static_cast<size_t>(rank()) * b;
    Staged r(recv, b * static_cast<size_t>(world()), /*in=*/in_place, /*out=*/true, cs);
    Staged x(in_place ? nullptr : const_cast<void*>(send), b, true, false, cs);
    const void* src = in_place ? r.bytes() + static_cast<size_t>(rank()) * b : x.get();
    check_nccl(ncclAllGather(src, r.get(), send_count, nccl_type(dt), comm(), cs), "ncclAllGather", comm());
    r.finish();
  }

  // Shard `rank` of every rank's send, summed in rank order, into recv.
  void do_reduce_scatter(const void* send, void* recv, size_t recv_count, DType dt, kernels::Stream& s) override {
    const cudaStream_t cs = native(s);
    const size_t b = recv_count * esize(dt), W = static_cast<size_t>(world());
    const bool in_place = recv == static_cast<const std::byte*>(send) + static_cast<size_t>(rank()) * b;
    Staged x(const_cast<void*>(send), b * W, true, in_place, cs);
    Staged r(in_place ? nullptr : recv, b, false, true, cs);
    reduce_parts(s, dt, [&](int q) { return x.bytes() + static_cast<size_t>(q) * b; }, [&](int) { return recv_count; },
                 in_place ? x.bytes() + static_cast<size_t>(rank()) * b : r.bytes());
    r.finish();
    x.finish();
  }

  // Each rank reduces its part of the buffer (the count split into world nearly equal parts),
  // then every rank's summed part goes to every rank. Element by element the sum is the
  // rank-order sum whatever the split, so all_reduce restricted to a shard is reduce_scatter's
  // bits.
  void do_all_reduce(const void* send, void* recv, size_t count, DType dt, kernels::Stream& s) override {
    const cudaStream_t cs = native(s);
    const size_t es = esize(dt), W = static_cast<size_t>(world());
    const bool in_place = recv == send;
    Staged x(const_cast<void*>(send), count * es, true, in_place, cs);
    Staged r(in_place ? nullptr : recv, count * es, false, true, cs);
    std::byte* out = in_place ? x.bytes() : r.bytes();
    const auto at = [&](int q) {
      const auto k = static_cast<size_t>(q);
      return k * (count / W) + std::min(k, count % W);
    };
    const auto len = [&](int q) { return count / W + (static_cast<size_t>(q) < count % W ? 1 : 0); };
    reduce_parts(s, dt, [&](int q) { return x.bytes() + at(q) * es; }, len, out + at(rank()) * es);
    // Every rank's summed part to every rank (this rank's is in `out` already).
    if (world() > 1) {
      NcclGroup g(comm());
      for (int q = 0; q < world(); ++q) {
        if (q == rank()) continue;
        if (len(rank()) > 0)
          check_nccl(ncclSend(out + at(rank()) * es, len(rank()), nccl_type(dt), q, comm(), cs), "ncclSend", comm());
        if (len(q) > 0) check_nccl(ncclRecv(out + at(q) * es, len(q), nccl_type(dt), q, comm(), cs), "ncclRecv", comm());
      }
      g.end();
    }
    r.finish();
    x.finish();
  }

  // The core of both reductions. Rank q reduces a part of part_len(q) elements that starts at
  // part_of(q) in every rank's buffer; this rank's sum goes to `out`. In pieces of at most
  // piece_elems: piece k of part q goes to rank q, piece k of this rank's part comes from every
  // peer into a workspace (world - 1 pieces side by side), then the device sums the world
  // contributions in rank order. Every rank runs as many rounds (the longest part's), so the
  // grouped sends and receives pair up; the stream orders a round's sum before the next round's
  // receives overwrite the workspace.
  template <class PartOf, class PartLen>
  void reduce_parts(kernels::Stream& s, DType dt, PartOf part_of, PartLen part_len, std::byte* out) {
    const cudaStream_t cs = native(s);
    const size_t es = esize(dt), W = static_cast<size_t>(world());
    size_t longest = 0;
    for (int q = 0; q < world(); ++q) longest = std::max(longest, part_len(q));
    if (longest == 0) return;
    const size_t P = piece_elems(dt, longest);
    const auto piece = [&](int q, size_t lo) { return part_len(q) > lo ? std::min(P, part_len(q) - lo) : size_t{0}; };
    std::byte* ws = W > 1 ? static_cast<std::byte*>(kernels::cuda::context(s).scratch((W - 1) * P * es)) : nullptr;
    for (size_t lo = 0; lo < longest; lo += P) {
      const size_t mine = piece(rank(), lo);
      if (W > 1) {
        NcclGroup g(comm());
        for (int q = 0, k = 0; q < world(); ++q) {
          if (q == rank()) continue;
          if (const size_t n = piece(q, lo); n > 0)
            check_nccl(ncclSend(part_of(q) + lo * es, n, nccl_type(dt), q, comm(), cs), "ncclSend", comm());
          if (mine > 0)
            check_nccl(ncclRecv(ws + static_cast<size_t>(k) * P * es, mine, nccl_type(dt), q, comm(), cs), "ncclRecv",
                       comm());
          ++k;
        }
        g.end();
      }
      if (mine > 0)
        s.runtime().ops().rank_order_sum(
            s, {.dtype = dt, .n = static_cast<int64_t>(mine), .mine = part_of(rank()) + lo * es, .me = rank(),
                .world = world(), .others = ws, .others_stride = static_cast<int64_t>(P), .out = out + lo * es});
    }
  }

  void do_broadcast(void* buf, size_t count, DType dt, int root, kernels::Stream& s) override {
    const cudaStream_t cs = native(s);
    Staged b(buf, count * esize(dt), true, true, cs);
    check_nccl(ncclBroadcast(b.get(), b.get(), count, nccl_type(dt), root, comm(), cs), "ncclBroadcast", comm());
    b.finish();
  }
  void do_barrier(kernels::Stream& s) override {
    const cudaStream_t cs = native(s);
    void* one = kernels::cuda::context(s).scratch(sizeof(float));
    check_nccl(ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, comm(), cs), "ncclAllReduce (barrier)", comm());
  }
  void do_send(const void* buf, size_t count, DType dt, int peer, kernels::Stream& s) override {
    const cudaStream_t cs = native(s);
    Staged b(const_cast<void*>(buf), count * esize(dt), true, false, cs);
    check_nccl(ncclSend(b.get(), count, nccl_type(dt), peer, comm(), cs), "ncclSend", comm());
  }
  void do_recv(void* buf, size_t count, DType dt, int peer, kernels::Stream& s) override {
    const cudaStream_t cs = native(s);
    Staged b(buf, count * esize(dt), false, true, cs);
    check_nccl(ncclRecv(b.get(), count, nccl_type(dt), peer, comm(), cs), "ncclRecv", comm());
    b.finish();
  }
  void do_send_recv(const void* send_buf, size_t send_count, int send_peer, void* recv_buf, size_t recv_count,
                    int recv_peer, DType dt, kernels::Stream& s) override {
    const cudaStream_t cs = native(s);
    Staged x(const_cast<void*>(send_buf), send_count * esize(dt), true, false, cs);
    Staged r(recv_buf, recv_count * esize(dt), false, true, cs);
    NcclGroup g(comm());
    check_nccl(ncclSend(x.get(), send_count, nccl_type(dt), send_peer, comm(), cs), "ncclSend", comm());
    check_nccl(ncclRecv(r.get(), recv_count, nccl_type(dt), recv_peer, comm(), cs), "ncclRecv", comm());
    g.end();
    r.finish();
  }
  void do_host_broadcast(void* bytes, size_t n_bytes, int root) override { control_->host_broadcast(bytes, n_bytes, root); }
  void do_host_all_gather(const void* send, void* recv, size_t n_bytes) override {
    control_->host_all_gather(send, recv, n_bytes);
  }
  void do_host_gather(const void* send, void* recv, size_t n_bytes, int root) override {
    control_->host_gather(send, recv, n_bytes, root);
  }
  // The control plane split by MPI, NCCL's by ncclCommSplit (collective over this communicator).
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    std::unique_ptr<Communicator> control = control_->split(color, key);
    STRATA_CUDA_CHECK(cudaSetDevice(device_));
    ncclComm_t sub = nullptr;
    check_nccl(ncclCommSplit(comm(), color, key, &sub, nullptr), "ncclCommSplit", comm());
    return std::make_unique<NcclCommunicator>(std::move(control), sub, device_, piece_bytes_);
  }

  std::unique_ptr<Communicator> control_;
  std::unique_ptr<NcclHandle> nccl_;
  int device_;
  size_t piece_bytes_;
};

}  // namespace

namespace comm_detail {

bool nccl_built() { return true; }

std::unique_ptr<Communicator> make_nccl(std::unique_ptr<Communicator> control, const CommOptions& options) {
  return NcclCommunicator::make(std::move(control), options.piece_bytes);
}

}  // namespace comm_detail
}  // namespace strata
