// The mpi communicator: collectives between processes over MPI point-to-point messages, run on
// the stream's worker thread, with sums done here in rank order (never MPI_Allreduce) so results
// are bitwise fixed; plus MPI's process lifetime (init with MPI_THREAD_MULTIPLE, finalize, abort).
#define OMPI_SKIP_MPICXX 1  // the C API only: no deprecated C++ bindings, no libmpi_cxx
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "src/comm/comm_internal.h"
#include "src/comm/reduce.h"

namespace strata {
namespace {

using kernels::DType;

// MPI counts are int: larger transfers go as several messages of at most this many bytes.
constexpr size_t kMaxMessageBytes = size_t{1} << 30;
constexpr size_t kMaxWorkspaceBytes = size_t{64} << 20;

std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<size_t>(len));
}

// Every MPI call goes through this: communicators use MPI_ERRORS_RETURN, so errors come back
// as codes and become exceptions naming the call.
void check(int rc, const char* call, const std::string& context = {}) {
  if (rc == MPI_SUCCESS) return;
  throw std::runtime_error(std::string(call) + (context.empty() ? "" : " (" + context + ")") +
                           " failed: " + mpi_error_string(rc));
}

bool unwinding() { return std::uncaught_exceptions() > 0; }

bool mpi_is_active() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

// MPI's lifetime in this process: initialised by the first mpi communicator, finalised when
// the last one is destroyed on the normal path (never while unwinding: the other ranks may be
// waiting for this one in a collective, and MPI_Finalize would wait for them).
class MpiEnv {
 public:
  static std::shared_ptr<MpiEnv> acquire() {
    static std::mutex mu;
    static std::weak_ptr<MpiEnv> current;
    std::lock_guard lock(mu);
    if (auto env = current.lock()) return env;
    auto env = std::shared_ptr<MpiEnv>(new MpiEnv());
    current = env;
    return env;
  }
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;
  ~MpiEnv() {
    if (!we_initialised_ || unwinding() || std::this_thread::get_id() != init_thread_ || !mpi_is_active()) return;
    MPI_Finalize();
  }

 private:
  MpiEnv() : init_thread_(std::this_thread::get_id()) {
    int init = 0, fin = 0;
    check(MPI_Finalized(&fin), "MPI_Finalized");
    if (fin)
      throw std::runtime_error(
          "MPI was already finalised in this process (the last mpi communicator was destroyed); keep one world "
          "communicator for the whole run");
    check(MPI_Initialized(&init), "MPI_Initialized");
    int provided = MPI_THREAD_SINGLE;
    if (!init) {
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
      we_initialised_ = true;
    } else {
      check(MPI_Query_thread(&provided), "MPI_Query_thread");
    }
    check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    if (provided < MPI_THREAD_MULTIPLE)
      throw std::runtime_error("the MPI library provides thread level " + std::to_string(provided) +
                               ", but strata needs MPI_THREAD_MULTIPLE (" + std::to_string(MPI_THREAD_MULTIPLE) +
                               "): collectives run on stream worker threads while the host thread also calls MPI. "
                               "Use an MPI built with thread support (Debian's OpenMPI is)");
  }

  std::thread::id init_thread_;
  bool we_initialised_ = false;
};

// An owned MPI_Comm. Freed on the normal path; left to the process's end while unwinding.
class OwnedComm {
 public:
  OwnedComm() = default;
  explicit OwnedComm(MPI_Comm c) : c_(c) {}
  OwnedComm(OwnedComm&& o) noexcept : c_(std::exchange(o.c_, MPI_COMM_NULL)) {}
  OwnedComm& operator=(OwnedComm&&) = delete;
  ~OwnedComm() {
    if (c_ != MPI_COMM_NULL && !unwinding() && mpi_is_active()) MPI_Comm_free(&c_);
  }
  MPI_Comm get() const { return c_; }

 private:
  MPI_Comm c_ = MPI_COMM_NULL;
};

OwnedComm dup_comm(MPI_Comm base) {
  MPI_Comm c = MPI_COMM_NULL;
  check(MPI_Comm_dup(base, &c), "MPI_Comm_dup");
  OwnedComm owned(c);
  check(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  return owned;
}

// Nonblocking sends and receives of one phase of a collective. Large buffers go as several
// messages; between two ranks, messages with one tag match in posting order (MPI's
// non-overtaking rule), which is what keeps the pieces of a collective in step.
class Requests {
 public:
  Requests() = default;
  Requests(const Requests&) = delete;
  Requests& operator=(const Requests&) = delete;
  // Still-pending requests here mean a collective failed half way: cancel what can be
  // cancelled and release the rest (the workspace they point into is never reused).
  ~Requests() {
    if (!mpi_is_active()) return;
    for (MPI_Request& r : recvs_)
      if (r != MPI_REQUEST_NULL) {
        MPI_Cancel(&r);
        MPI_Request_free(&r);
      }
    for (MPI_Request& r : sends_)
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  }

  void recv(void* buf, size_t bytes, int peer, int tag, MPI_Comm comm) {
    auto* p = static_cast<std::byte*>(buf);
    do {
      const size_t n = std::min(bytes, kMaxMessageBytes);
      recvs_.push_back(MPI_REQUEST_NULL);
      check(MPI_Irecv(p, static_cast<int>(n), MPI_BYTE, peer, tag, comm, &recvs_.back()), "MPI_Irecv",
            "from rank " + std::to_string(peer) + ", " + std::to_string(n) + " bytes");
      p += n;
      bytes -= n;
    } while (bytes > 0);
  }
  void send(const void* buf, size_t bytes, int peer, int tag, MPI_Comm comm) {
    const auto* p = static_cast<const std::byte*>(buf);
    do {
      const size_t n = std::min(bytes, kMaxMessageBytes);
      sends_.push_back(MPI_REQUEST_NULL);
      check(MPI_Isend(p, static_cast<int>(n), MPI_BYTE, peer, tag, comm, &sends_.back()), "MPI_Isend",
            "to rank " + std::to_string(peer) + ", " + std::to_string(n) + " bytes");
      p += n;
      bytes -= n;
    } while (bytes > 0);
  }

  // Waits for all of them. Polls with MPI_Testall, yielding for the first 200 µs and then
  // sleeping with backoff up to 1 ms, so a rank waiting for a slow peer leaves the cores to
  // compute (on the CPU backend the comm worker shares them with the op threads).
  void wait() {
    wait_list(recvs_, "MPI_Testall (receives)");
    wait_list(sends_, "MPI_Testall (sends)");
  }

 private:
  static void wait_list(std::vector<MPI_Request>& list, const char* call) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto nap = std::chrono::microseconds(20);
    for (;;) {
      int done = 0;
      check(MPI_Testall(static_cast<int>(list.size()), list.data(), &done, MPI_STATUSES_IGNORE), call);
      if (done) break;
      if (clock::now() - start < std::chrono::microseconds(200)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, std::chrono::microseconds(1000));
      }
    }
    list.clear();  // all are MPI_REQUEST_NULL now; capacity is kept for the next collective
  }

  std::vector<MPI_Request> recvs_, sends_;
};

// Scratch for one running collective: two piece slots of (world-1) incoming pieces each, the
// requests of each slot, and the per-rank source pointers of the sum. Reused across calls.
struct Workspace {
  Workspace(int world, size_t piece_bytes)
      : bytes_per_slot(static_cast<size_t>(world - 1) * piece_bytes),
        staging(static_cast<std::byte*>(std::aligned_alloc(4096, std::max<size_t>(2 * bytes_per_slot, 4096)))),
        srcs(static_cast<size_t>(world)) {
    if (!staging) throw std::runtime_error("mpi communicator: out of memory for " + std::to_string(2 * bytes_per_slot) +
                                           " bytes of staging");
  }
  ~Workspace() { std::free(staging); }
  std::byte* slot(int s, int peer_index, size_t piece_bytes) const {
    return staging + static_cast<size_t>(s) * bytes_per_slot + static_cast<size_t>(peer_index) * piece_bytes;
  }

  size_t bytes_per_slot;
  std::byte* staging;
  Requests requests[2];
  Requests direct;  // whole-buffer phases (all-gather, broadcast, barrier)
  std::vector<const void*> srcs;
};

// Workspaces for collectives running at the same time (one per stream in flight). Grows to the
// peak concurrency once; after that the step loop allocates nothing here.
class WorkspacePool {
 public:
  WorkspacePool(int world, size_t piece_bytes) : world_(world), piece_bytes_(piece_bytes) {}
  class Lease {
   public:
    Lease(WorkspacePool& pool, Workspace* ws) : pool_(pool), ws_(ws) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (!poisoned_) pool_.release(ws_);
    }
    Workspace& operator*() const { return *ws_; }
    void poison() { poisoned_ = true; }  // a failed collective may still have receives landing in it

   private:
    WorkspacePool& pool_;
    Workspace* ws_;
    bool poisoned_ = false;
  };
  Workspace* acquire() {
    std::lock_guard lock(mu_);
    if (!free_.empty()) {
      Workspace* ws = free_.back();
      free_.pop_back();
      return ws;
    }
    all_.push_back(std::make_unique<Workspace>(world_, piece_bytes_));
    free_.reserve(all_.size());
    return all_.back().get();
  }
  void release(Workspace* ws) {
    std::lock_guard lock(mu_);
    free_.push_back(ws);
  }
  size_t bytes() const {
    std::lock_guard lock(mu_);
    return all_.size() * std::max<size_t>(2 * static_cast<size_t>(world_ - 1) * piece_bytes_, 4096);
  }

 private:
  int world_;
  size_t piece_bytes_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Workspace>> all_;
  std::vector<Workspace*> free_;
};

// Contiguous shards of `total` elements over `world` ranks: the first total % world shards
// hold one element more. With total a multiple of world every shard holds total / world.
struct Partition {
  size_t total;
  int world;
  size_t size(int k) const { return total / world + (static_cast<size_t>(k) < total % world ? 1 : 0); }
  size_t offset(int k) const { return static_cast<size_t>(k) * (total / world) + std::min<size_t>(k, total % world); }
};

// One process group: the MPI communicators and what the collectives running on stream workers
// share. Held by the Communicator and by every enqueued collective, so it outlives both.
struct Group {
  Group(std::shared_ptr<MpiEnv> env_, MPI_Comm base, size_t piece_bytes_wanted)
      : env(std::move(env_)), data(dup_comm(base)), ctrl(dup_comm(base)), p2p(dup_comm(base)) {
    check(MPI_Comm_rank(data.get(), &rank), "MPI_Comm_rank");
    check(MPI_Comm_size(data.get(), &world), "MPI_Comm_size");
    int* ub = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found), "MPI_Comm_get_attr(MPI_TAG_UB)");
    tag_ub = found && ub ? *ub : 32767;  // the standard guarantees at least 32767
    MPI_Comm node = MPI_COMM_NULL;
    check(MPI_Comm_split_type(ctrl.get(), MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
    OwnedComm node_owned(node);
    check(MPI_Comm_rank(node, &local_rank), "MPI_Comm_rank(node)");
    check(MPI_Comm_size(node, &local_world), "MPI_Comm_size(node)");
    // Pieces: a multiple of 4 KiB, shrunk so one workspace (2 slots × (world-1) pieces) stays
    // under kMaxWorkspaceBytes on large worlds.
    size_t piece = std::max<size_t>(piece_bytes_wanted / 4096 * 4096, 4096);
    if (world > 1) piece = std::min(piece, std::max<size_t>(kMaxWorkspaceBytes / (2 * (world - 1)) / 4096 * 4096, 4096));
    piece_bytes = piece;
    pool = std::make_unique<WorkspacePool>(world, piece_bytes);
    sends_to.assign(static_cast<size_t>(world), 0);
    recvs_from.assign(static_cast<size_t>(world), 0);
  }

  // Tags: collective number k (in issue order, the same on every rank) uses tag k mod (tag_ub+1).
  int tag(uint64_t issue) const { return static_cast<int>(issue % (static_cast<uint64_t>(tag_ub) + 1)); }

  void fail_fast() const {
    std::lock_guard lock(broken_mu);
    if (!broken.empty())
      throw std::runtime_error("mpi communicator unusable after an earlier transfer error: " + broken);
  }
  void mark_broken(const std::string& why) {
    std::lock_guard lock(broken_mu);
    if (broken.empty()) broken = why;
  }

  std::shared_ptr<MpiEnv> env;  // declared first: destroyed last, after the comms are freed
  OwnedComm data;               // point-to-point traffic of stream-ordered collectives
  OwnedComm ctrl;               // host-thread collectives (host_broadcast, split)
  OwnedComm p2p;                // send/recv: tagged by each pair's own count, apart from the collectives
  int rank = 0, world = 1, local_rank = 0, local_world = 1, tag_ub = 32767;
  size_t piece_bytes = 0;
  std::unique_ptr<WorkspacePool> pool;
  std::atomic<uint64_t> issued{0};  // collectives enqueued so far (host thread)
  std::vector<uint64_t> sends_to, recvs_from;  // per peer: sends / recvs enqueued so far (host thread)
  mutable std::mutex broken_mu;
  std::string broken;
};

// reduce-scatter core: out (size(rank) elements) = fixed-order sum over ranks of shard `rank`
// of each rank's send (partition.total elements). Pieces of at most piece_bytes per peer are
// exchanged double-buffered: piece p+1 is in flight while piece p is summed.
void exchange_and_sum(Group& g, Workspace& ws, const std::byte* send, std::byte* out, const Partition& part, DType dt,
                      int tag) {
  const size_t es = kernels::dtype_size(dt);
  const size_t pe = g.piece_bytes / es;  // elements per piece
  const int me = g.rank, n = g.world;
  const MPI_Comm comm = g.data.get();
  auto pieces = [&](size_t elems) { return (elems + pe - 1) / pe; };
  auto piece_len = [&](size_t elems, size_t p) { return std::min(pe, elems - p * pe); };
  const size_t my_size = part.size(me), my_pieces = pieces(my_size);
  const size_t max_pieces = pieces(part.size(0));  // shard 0 is the largest

  auto post = [&](size_t p) {
    Requests& rq = ws.requests[p % 2];
    for (int j = 1; j < n; ++j) {  // peers in the order me+1, me+2, ...: spreads the load
      const int k = (me + j) % n;
      if (p < my_pieces) rq.recv(ws.slot(static_cast<int>(p % 2), j - 1, g.piece_bytes), piece_len(my_size, p) * es, k, tag, comm);
      const size_t k_size = part.size(k);
      if (p < pieces(k_size))
        rq.send(send + (part.offset(k) + p * pe) * es, piece_len(k_size, p) * es, k, tag, comm);
    }
  };

  if (max_pieces > 0) post(0);
  for (size_t p = 0; p < max_pieces; ++p) {
    if (p + 1 < max_pieces) post(p + 1);
    ws.requests[p % 2].wait();
    if (p >= my_pieces) continue;
    for (int k = 0; k < n; ++k) {
      const int j = (k - me + n) % n;  // k = me + j
      ws.srcs[static_cast<size_t>(k)] =
          j == 0 ? static_cast<const void*>(send + (part.offset(me) + p * pe) * es) : ws.slot(static_cast<int>(p % 2), j - 1, g.piece_bytes);
    }
    sum_in_rank_order(ws.srcs.data(), n, out + p * pe * es, piece_len(my_size, p), dt);
  }
}

// all-gather core: every rank's shard (partition over `buf`) reaches every rank. `mine` is this
// rank's shard (copied into place when it is not there already).
void gather_shards(Group& g, Workspace& ws, const std::byte* mine, std::byte* buf, const Partition& part, size_t es,
                   int tag) {
  const int me = g.rank, n = g.world;
  Requests& rq = ws.direct;
  for (int j = 1; j < n; ++j) {
    const int k = (me + j) % n;
    if (part.size(k) > 0) rq.recv(buf + part.offset(k) * es, part.size(k) * es, k, tag, g.data.get());
    if (part.size(me) > 0) rq.send(mine, part.size(me) * es, k, tag, g.data.get());
  }
  std::byte* dst = buf + part.offset(me) * es;
  if (dst != mine) std::memcpy(dst, mine, part.size(me) * es);
  rq.wait();
}

// Decrements the in-flight count of a communicator when the enqueued collective holding it is
// destroyed — after it ran, or when a failed stream skipped it.
struct Tracker {
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0;
  // Nanoseconds collectives have run (transfer, sums, waiting for peers), per stream they ran on.
  std::map<const kernels::Stream*, int64_t> busy_ns;  // under mu
  void add_busy(const kernels::Stream* s, std::chrono::steady_clock::time_point t0) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard lock(mu);
    busy_ns[s] += ns;
  }
  void wait_idle() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return in_flight == 0; });
  }
};
struct Ticket {
  Ticket(std::shared_ptr<Group> g, std::shared_ptr<Tracker> t) : group(std::move(g)), tracker(std::move(t)) {
    std::lock_guard lock(tracker->mu);
    ++tracker->in_flight;
  }
  Ticket(const Ticket&) = delete;
  Ticket& operator=(const Ticket&) = delete;
  ~Ticket() {
    group.reset();
    std::lock_guard lock(tracker->mu);
    if (--tracker->in_flight == 0) tracker->cv.notify_all();
  }
  std::shared_ptr<Group> group;
  std::shared_ptr<Tracker> tracker;
};

std::string describe(const char* call, uint64_t issue, const Group& g, size_t bytes, DType dt) {
  return std::string(call) + " #" + std::to_string(issue) + " (rank " + std::to_string(g.rank) + " of " +
         std::to_string(g.world) + ", " + std::to_string(bytes) + " bytes " + std::string(kernels::dtype_name(dt)) + ")";
}

// Device buffers. A collective on a stream of another backend than the CPU's (a CUDA stream)
// cannot run its MPI calls in that stream's host function: CUDA may run every stream's host
// functions on one driver thread, and one blocked in MPI until a peer arrives could hold up the
// work that peer waits for. So it runs on pinned host copies, on a CPU stream of the
// communicator's own (a worker per user stream), in the user stream's order:
//   user stream:  copy the inputs to its staging memory; open the gate; wait for `done`; copy
//                 the results back;
//   worker:       wait at the gate; the collective, as on a CPU stream; record `done`.
// The gate is opened by a host function of the user stream that only flags it (not an event of
// the user's runtime, which the worker could wait on: the communicator outlives that runtime, so
// it keeps none of its objects). A failed user
// stream skips its host functions, destroying them unrun: the gate then opens as cancelled and
// the worker fails the collective instead of waiting forever (the job is going down).
// STRATA_TEST_STAGED_COMM=1 stages CPU streams too, so the CPU tests drive this path.
bool staging_forced() {
  static const bool forced = [] {
    const char* e = std::getenv("STRATA_TEST_STAGED_COMM");
    return e && *e && std::string(e) != "0";
  }();
  return forced;
}

struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false, cancelled = false;
  void wait() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return open; });
    if (cancelled)
      throw std::runtime_error("the stream that enqueued this collective failed before its inputs were copied to "
                               "host memory");
  }
};
// Held only by the user stream's host function: destroyed run (opens the gate) or skipped
// (opens it cancelled).
struct GateKey {
  explicit GateKey(std::shared_ptr<Gate> g) : gate(std::move(g)) {}
  GateKey(const GateKey&) = delete;
  GateKey& operator=(const GateKey&) = delete;
  ~GateKey() {
    {
      std::lock_guard lock(gate->mu);
      gate->open = true;
      gate->cancelled = !turned;
    }
    gate->cv.notify_all();
  }
  std::shared_ptr<Gate> gate;
  bool turned = false;
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::shared_ptr<Group> g)
      : Communicator(CommBackend::mpi, g->rank, g->world, g->local_rank, g->local_world),
        group_(std::move(g)),
        tracker_(std::make_shared<Tracker>()) {}

  double busy_ms(const kernels::Stream* stream) const override {
    std::lock_guard lock(tracker_->mu);
    int64_t ns = 0;
    for (const auto& [s, n] : tracker_->busy_ns)
      if (!stream || s == stream) ns += n;
    return static_cast<double>(ns) / 1e6;
  }

  // Normal path: wait for enqueued collectives to finish (the caller should have synchronised
  // its streams), then free the comms; the last communicator finalises MPI. While unwinding:
  // neither wait nor finalise; enqueued collectives keep the group alive.
  ~MpiCommunicator() override {
    if (!unwinding()) tracker_->wait_idle();
  }

  size_t workspace_bytes() const override { return group_->pool->bytes(); }

 protected:
  void do_all_gather(const void* send, void* recv, size_t n, DType dt, kernels::Stream& s) override {
    const size_t es = kernels::dtype_size(dt), w = static_cast<size_t>(group_->world);
    staged(s, {send, n * es}, {recv, w * n * es, false}, [&](kernels::Stream& run, const void* in, void* out) {
      enqueue(run, s, "all_gather", 1, n * w * es, dt, [in, out, n, dt](Group& g, Workspace& ws, uint64_t issue) {
        gather_shards(g, ws, static_cast<const std::byte*>(in), static_cast<std::byte*>(out),
                      Partition{n * static_cast<size_t>(g.world), g.world}, kernels::dtype_size(dt), g.tag(issue));
      });
    });
  }
  void do_reduce_scatter(const void* send, void* recv, size_t n, DType dt, kernels::Stream& s) override {
    const size_t es = kernels::dtype_size(dt), w = static_cast<size_t>(group_->world);
    staged(s, {send, w * n * es}, {recv, n * es, false}, [&](kernels::Stream& run, const void* in, void* out) {
      enqueue(run, s, "reduce_scatter", 1, n * w * es, dt, [in, out, n, dt](Group& g, Workspace& ws, uint64_t issue) {
        exchange_and_sum(g, ws, static_cast<const std::byte*>(in), static_cast<std::byte*>(out),
                         Partition{n * static_cast<size_t>(g.world), g.world}, dt, g.tag(issue));
      });
    });
  }
  // all_reduce = reduce_scatter into this rank's shard of recv, then all_gather of the shards:
  // each element is still the rank-order sum, so the result equals reduce_scatter's bit for bit.
  void do_all_reduce(const void* send, void* recv, size_t n, DType dt, kernels::Stream& s) override {
    const size_t es = kernels::dtype_size(dt);
    staged(s, {send, n * es}, {recv, n * es, false}, [&](kernels::Stream& run, const void* in, void* out_buf) {
      enqueue(run, s, "all_reduce", 2, n * es, dt, [in, out_buf, n, dt](Group& g, Workspace& ws, uint64_t issue) {
        const Partition part{n, g.world};
        const size_t es = kernels::dtype_size(dt);
        auto* out = static_cast<std::byte*>(out_buf);
        std::byte* mine = out + part.offset(g.rank) * es;
        // Phase 1's sends read all of send; when send == recv, phase 2 overwrites it, so phase 1
        // is complete (every request waited) before phase 2 posts a receive.
        exchange_and_sum(g, ws, static_cast<const std::byte*>(in), mine, part, dt, g.tag(issue));
        gather_shards(g, ws, mine, out, part, es, g.tag(issue + 1));
      });
    });
  }
  void do_broadcast(void* buf, size_t n, DType dt, int root, kernels::Stream& s) override {
    const size_t bytes = n * kernels::dtype_size(dt);
    // (Staged: the root's buffer goes to host memory and comes back unchanged.)
    staged(s, {nullptr, 0}, {buf, bytes, true}, [&](kernels::Stream& run, const void*, void* out) {
      enqueue(run, s, "broadcast", 1, bytes, dt, [out, bytes, root](Group& g, Workspace& ws, uint64_t issue) {
        Requests& rq = ws.direct;
        if (g.rank == root) {
          for (int j = 1; j < g.world; ++j) rq.send(out, bytes, (root + j) % g.world, g.tag(issue), g.data.get());
        } else {
          rq.recv(out, bytes, root, g.tag(issue), g.data.get());
        }
        rq.wait();
      });
    });
  }
  // Dissemination barrier: in round d a rank signals rank+d and hears from rank-d; after
  // ceil(log2(world)) rounds every rank has (transitively) heard from every other.
  void do_barrier(kernels::Stream& s) override {
    staged(s, {nullptr, 0}, {nullptr, 0, false}, [&](kernels::Stream& run, const void*, void*) {
      enqueue(run, s, "barrier", 1, 0, DType::f32, [](Group& g, Workspace& ws, uint64_t issue) {
        static char token;
        for (int d = 1; d < g.world; d *= 2) {
          ws.direct.recv(&token, 0, (g.rank - d + g.world) % g.world, g.tag(issue), g.data.get());
          ws.direct.send(&token, 0, (g.rank + d) % g.world, g.tag(issue), g.data.get());
          ws.direct.wait();
        }
      });
    });
  }

  void do_send(const void* buf, size_t count, DType dt, int peer, kernels::Stream& s) override {
    const size_t bytes = count * kernels::dtype_size(dt);
    const int tag = group_->tag(group_->sends_to[static_cast<size_t>(peer)]++);
    staged(s, {buf, bytes}, {nullptr, 0, false}, [&](kernels::Stream& run, const void* in, void*) {
      enqueue_p2p(run, s, "send", peer, bytes, dt, [in, bytes, peer, tag](Group& g) {
        const auto* p = static_cast<const std::byte*>(in);
        for (size_t done = 0; done < bytes; done += kMaxMessageBytes) {  // pieces keep their order (one tag)
          const size_t n = std::min(kMaxMessageBytes, bytes - done);
          check(MPI_Send(p + done, static_cast<int>(n), MPI_BYTE, peer, tag, g.p2p.get()), "MPI_Send",
                "to rank " + std::to_string(peer) + ", " + std::to_string(n) + " bytes");
        }
      });
    });
  }
  void do_recv(void* buf, size_t count, DType dt, int peer, kernels::Stream& s) override {
    const size_t bytes = count * kernels::dtype_size(dt);
    const int tag = group_->tag(group_->recvs_from[static_cast<size_t>(peer)]++);
    staged(s, {nullptr, 0}, {buf, bytes, false}, [&](kernels::Stream& run, const void*, void* out) {
      enqueue_p2p(run, s, "recv", peer, bytes, dt, [out, bytes, peer, tag](Group& g) {
        auto* p = static_cast<std::byte*>(out);
        for (size_t done = 0; done < bytes; done += kMaxMessageBytes) {
          const size_t n = std::min(kMaxMessageBytes, bytes - done);
          check(MPI_Recv(p + done, static_cast<int>(n), MPI_BYTE, peer, tag, g.p2p.get(), MPI_STATUS_IGNORE),
                "MPI_Recv", "from rank " + std::to_string(peer) + ", " + std::to_string(n) + " bytes");
        }
      });
    });
  }

  // Every piece of both halves posted at once, then waited for together.
  void do_send_recv(const void* send_buf, size_t send_count, int send_peer, void* recv_buf, size_t recv_count,
                    int recv_peer, DType dt, kernels::Stream& s) override {
    const size_t es = kernels::dtype_size(dt), sb = send_count * es, rb = recv_count * es;
    const int stag = group_->tag(group_->sends_to[static_cast<size_t>(send_peer)]++);
    const int rtag = group_->tag(group_->recvs_from[static_cast<size_t>(recv_peer)]++);
    staged(s, {send_buf, sb}, {recv_buf, rb, false}, [&](kernels::Stream& run, const void* in, void* out) {
      enqueue_p2p(run, s, "send_recv", send_peer, sb + rb, dt, [in, sb, send_peer, stag, out, rb, recv_peer, rtag](Group& g) {
        std::vector<MPI_Request> rq;
        auto* rp = static_cast<std::byte*>(out);
        const auto* sp = static_cast<const std::byte*>(in);
        for (size_t done = 0; done < rb; done += kMaxMessageBytes) {
          rq.emplace_back();
          check(MPI_Irecv(rp + done, static_cast<int>(std::min(kMaxMessageBytes, rb - done)), MPI_BYTE, recv_peer,
                          rtag, g.p2p.get(), &rq.back()),
                "MPI_Irecv", "from rank " + std::to_string(recv_peer));
        }
        for (size_t done = 0; done < sb; done += kMaxMessageBytes) {
          rq.emplace_back();
          check(MPI_Isend(sp + done, static_cast<int>(std::min(kMaxMessageBytes, sb - done)), MPI_BYTE, send_peer,
                          stag, g.p2p.get(), &rq.back()),
                "MPI_Isend", "to rank " + std::to_string(send_peer));
        }
        check(MPI_Waitall(static_cast<int>(rq.size()), rq.data(), MPI_STATUSES_IGNORE), "MPI_Waitall",
              "send_recv with ranks " + std::to_string(send_peer) + " and " + std::to_string(recv_peer));
      });
    });
  }

  void do_host_broadcast(void* bytes, size_t n_bytes, int root) override {
    auto* p = static_cast<std::byte*>(bytes);
    for (size_t done = 0; done < n_bytes; done += kMaxMessageBytes) {
      const size_t n = std::min(kMaxMessageBytes, n_bytes - done);
      check(MPI_Bcast(p + done, static_cast<int>(n), MPI_BYTE, root, group_->ctrl.get()), "MPI_Bcast",
            "host_broadcast of " + std::to_string(n_bytes) + " bytes from rank " + std::to_string(root));
    }
  }
  void do_host_all_gather(const void* send, void* recv, size_t n_bytes) override {
    if (n_bytes > kMaxMessageBytes)
      throw std::invalid_argument("host_all_gather: " + std::to_string(n_bytes) +
                                  " bytes per rank; the control plane is for small messages (at most 1 GiB)");
    const bool in_place = send == static_cast<const std::byte*>(recv) + static_cast<size_t>(rank()) * n_bytes;
    check(MPI_Allgather(in_place ? MPI_IN_PLACE : send, static_cast<int>(n_bytes), MPI_BYTE, recv,
                        static_cast<int>(n_bytes), MPI_BYTE, group_->ctrl.get()),
          "MPI_Allgather", "host_all_gather of " + std::to_string(n_bytes) + " bytes");
  }
  // In pieces of 16 collective pieces per rank (16 MiB by default): the root stages world of
  // them, then places each rank's.
  void do_host_gather(const void* send, void* recv, size_t n_bytes, int root) override {
    const size_t piece = std::min(kMaxMessageBytes, 16 * group_->piece_bytes);
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    const bool on_root = rank() == root;
    std::vector<std::byte> staged(on_root ? piece * static_cast<size_t>(world()) : 0);
    for (size_t done = 0; done < n_bytes; done += piece) {
      const size_t n = std::min(piece, n_bytes - done);
      check(MPI_Gather(in + done, static_cast<int>(n), MPI_BYTE, on_root ? staged.data() : nullptr,
                       static_cast<int>(n), MPI_BYTE, root, group_->ctrl.get()),
            "MPI_Gather", "host_gather of " + std::to_string(n_bytes) + " bytes to rank " + std::to_string(root));
      if (on_root)
        for (int r = 0; r < world(); ++r)
          std::memcpy(out + static_cast<size_t>(r) * n_bytes + done, staged.data() + static_cast<size_t>(r) * n, n);
    }
  }
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    MPI_Comm c = MPI_COMM_NULL;
    check(MPI_Comm_split(group_->ctrl.get(), color, key, &c), "MPI_Comm_split",
          "color " + std::to_string(color) + ", key " + std::to_string(key));
    OwnedComm sub(c);  // the group dups its own comms from it
    return std::make_unique<MpiCommunicator>(
        std::make_shared<Group>(group_->env, sub.get(), group_->piece_bytes));
  }

 private:
  // Numbers the collective in issue order (host thread), then runs `body` on the stream's
  // worker with a workspace from the pool. A transfer error poisons the workspace, marks the
  // group broken (later collectives fail at once instead of mismatching) and fails the stream.
  // run: the stream whose worker runs it (the caller's, or its staging worker); s: the caller's,
  // which its busy time is counted against.
  template <class Fn>
  void enqueue(kernels::Stream& run, const kernels::Stream& s, const char* call, int n_tags, size_t bytes, DType dt,
               Fn body) {
    const uint64_t issue = group_->issued.fetch_add(static_cast<uint64_t>(n_tags));
    submit(
        run, s,
        [issue, body](Group& g) {
          WorkspacePool::Lease lease(*g.pool, g.pool->acquire());
          try {
            body(g, *lease, issue);
          } catch (...) {
            lease.poison();
            throw;
          }
        },
        [call, issue, bytes, dt](const Group& g) { return describe(call, issue, g, bytes, dt); });
  }

  // A send or recv on the stream's worker: as enqueue, but outside the collectives' numbering
  // (only two ranks take part) and without a workspace.
  template <class Fn>
  void enqueue_p2p(kernels::Stream& run, const kernels::Stream& s, const char* call, int peer, size_t bytes, DType dt,
                   Fn body) {
    submit(run, s, body, [call, peer, bytes, dt](const Group& g) {
      return std::string(call) + " of " + std::to_string(bytes) + " bytes (" + std::string(kernels::dtype_name(dt)) +
             ") with rank " + std::to_string(peer) + " of " + std::to_string(g.world);
    });
  }

  // Runs body(group) on the stream's worker, timed as the stream's busy time; an error marks the
  // group broken with what(group) and fails the stream.
  template <class Fn, class What>
  void submit(kernels::Stream& run, const kernels::Stream& s, Fn body, What what) {
    group_->fail_fast();
    auto ticket = std::make_shared<Ticket>(group_, tracker_);
    const kernels::Stream* sp = &s;
    run.host_fn([ticket, body, what, sp] {
      Group& g = *ticket->group;
      g.fail_fast();
      const auto t0 = std::chrono::steady_clock::now();
      try {
        body(g);
        ticket->tracker->add_busy(sp, t0);
      } catch (const std::exception& e) {
        const std::string why = what(g) + ": " + e.what();
        g.mark_broken(why);
        throw std::runtime_error(why);
      }
    });
  }

  // A collective's device memory: `in` is copied to host memory before it runs, `out` back
  // after (load: its old contents copied in first, as a broadcast's root needs).
  struct In {
    const void* p;
    size_t bytes;
  };
  struct Out {
    void* p;
    size_t bytes;
    bool load;
  };
  // Enqueues the collective through run(stream, in, out): on s itself with the caller's buffers
  // where s is a CPU stream, else staged (above).
  // Host buffers given with a device stream (a save's gathers) are used as they are, on the
  // worker, in the stream's order: a host-to-host cudaMemcpyAsync would run at once, not in order.
  template <class Run>
  void staged(kernels::Stream& s, In in, Out out, Run run) {
    const bool forced = staging_forced();
    if (s.runtime().info().backend == kernels::Backend::cpu && !forced) return run(s, in.p, out.p);
    const auto device = [&](const void* p, size_t bytes) { return bytes > 0 && (forced || s.runtime().device_memory(p)); };
    const bool stage_in = device(in.p, in.bytes), stage_out = device(out.p, out.bytes);
    Stager& st = stager(s);
    const size_t in_at = 0, out_at = stage_in ? (in.bytes + 4095) / 4096 * 4096 : 0;
    std::byte* host = stage_in || stage_out ? static_cast<std::byte*>(s.host_staging(out_at + (stage_out ? out.bytes : 0)))
                                            : nullptr;
    if (stage_in) s.memcpy_async(host + in_at, in.p, in.bytes);
    if (stage_out && out.load) s.memcpy_async(host + out_at, out.p, out.bytes);
    auto gate = std::make_shared<Gate>();
    auto key = std::make_shared<GateKey>(gate);
    s.host_fn([key] { key->turned = true; });  // (destroyed after: opens the gate)
    key.reset();
    st.worker->host_fn([gate] { gate->wait(); });
    run(*st.worker, stage_in ? host + in_at : in.p, stage_out ? host + out_at : out.p);
    st.worker->record(*st.done);
    s.wait(*st.done);
    if (stage_out) s.memcpy_async(out.p, host + out_at, out.bytes);
  }
  struct Stager {
    std::unique_ptr<kernels::Stream> worker;  // of cpu_
    std::unique_ptr<kernels::Event> done;     // of cpu_: the collective ran
  };
  Stager& stager(const kernels::Stream& s) {
    if (!cpu_) cpu_ = kernels::make_runtime(kernels::Backend::cpu);
    Stager& st = stagers_[&s];
    if (!st.worker) st.worker = cpu_->create_stream(), st.done = cpu_->create_event();
    return st;
  }

  std::shared_ptr<Group> group_;
  std::shared_ptr<Tracker> tracker_;
  // Staging workers (declared last: destroyed first, each stream's queue drained, then their
  // runtime). Keyed by the caller's stream, which must outlive its collectives' completion.
  std::unique_ptr<kernels::Runtime> cpu_;
  std::map<const kernels::Stream*, Stager> stagers_;
};

}  // namespace

namespace comm_detail {

bool mpi_built() { return true; }

std::unique_ptr<Communicator> make_mpi(const CommOptions& options) {
  auto env = MpiEnv::acquire();
  return std::make_unique<MpiCommunicator>(
      std::make_shared<Group>(std::move(env), MPI_COMM_WORLD, options.piece_bytes));
}

bool mpi_active() { return mpi_is_active(); }

int mpi_world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

void mpi_abort(int exit_code) {
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; if it ever did, still stop this rank
}

}  // namespace comm_detail
}  // namespace strata
