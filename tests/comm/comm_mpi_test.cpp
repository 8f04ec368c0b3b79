// The mpi communicator across real processes: run by CTest as `mpirun -n 2` and `-n 3`. Every
// collective in every dtype against values computed here, fixed-order sums bit for bit,
// all_reduce == reduce_scatter + all_gather, overlap with compute, and process groups. With a
// mode argument it is the failing job that test_comm's Failure tests start (throw, kill).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/runtime.h"
#include "src/comm/communicator.h"
#include "src/comm/grid.h"
#include "tests/comm/mpi_check.h"

using namespace strata;
using kernels::DType;
using Clock = std::chrono::steady_clock;

namespace {

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};

struct Env {
  Communicator& comm;
  kernels::Runtime& rt;
  kernels::Stream& stream;
};

std::string dt(DType t) { return std::string(kernels::dtype_name(t)); }

uint32_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return static_cast<uint32_t>(x >> 32);
}

float quantize(float v, DType t) {
  uint16_t h[1];
  if (t == DType::f32) return v;
  kernels::store_from_f32(h, t, 0, v);
  return kernels::load_as_f32(h, t, 0);
}

// Rank r's input element i, exactly representable in t. Chosen so a sum's order matters: of
// three consecutive ranks one holds a large value, one a small one, one a large negative one,
// rotating with i, as in (1 + 1e8) - 1e8 != (-1e8 + 1e8) + 1.
float input(int r, size_t i, DType t) {
  const uint32_t h = mix((static_cast<uint64_t>(r) << 40) ^ i);
  const float mant = 1.f + static_cast<float>(h % 1024) / 1024.f;
  const float big = t == DType::f16 ? 1000.f : 1e7f;  // fp16 tops out at 65504
  float v = 0;
  switch ((i + static_cast<size_t>(r)) % 3) {
    case 0: v = big * mant; break;
    case 1: v = 0.37f * mant; break;
    default: v = -big * mant * 0.999f; break;
  }
  return quantize((h >> 16) & 1 ? v : -v, t);
}

// The reference: element i's contributions from ranks[0], ranks[1], ... summed in that order in
// fp32, rounded once to t; written to bytes.
std::vector<std::byte> expected_sums(DType t, size_t offset, size_t n, const std::vector<int>& ranks) {
  std::vector<std::byte> out(n * kernels::dtype_size(t));
  for (size_t i = 0; i < n; ++i) {
    float acc = input(ranks[0], offset + i, t);
    for (size_t k = 1; k < ranks.size(); ++k) acc += input(ranks[k], offset + i, t);
    kernels::store_from_f32(out.data(), t, i, acc);
  }
  return out;
}

std::vector<int> all_ranks(int world) {
  std::vector<int> r(static_cast<size_t>(world));
  for (int k = 0; k < world; ++k) r[static_cast<size_t>(k)] = k;
  return r;
}

void fill(void* buf, DType t, size_t n, int r, size_t offset) {
  for (size_t i = 0; i < n; ++i) kernels::store_from_f32(buf, t, i, input(r, offset + i, t));
}

size_t first_difference(const void* a, const void* b, size_t bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (size_t i = 0; i < bytes; ++i)
    if (x[i] != y[i]) return i;
  return bytes;
}

void expect_bytes(const void* got, const void* want, size_t bytes, const std::string& what) {
  const size_t at = first_difference(got, want, bytes);
  CHECK(at == bytes, what + ": first differing byte " + std::to_string(at) + " of " + std::to_string(bytes));
}

// A blocking rendezvous on the host (the tests use it to line the ranks up before timing).
void host_sync(Communicator& c) {
  int x = c.rank(), all[64];
  c.host_all_gather(&x, all, sizeof x);
}

void test_identity(Env& e) {
  Communicator& c = e.comm;
  CHECK(c.backend() == CommBackend::mpi, "backend");
  const Launch l = detect_launch();
  CHECK(l.by_launcher && l.world == c.world() && l.rank == c.rank(), "rank/world agree with the launcher");
  // One node: every rank is local, in the same order.
  CHECK(c.local_world() == c.world() && c.local_rank() == c.rank(),
        "local " + std::to_string(c.local_rank()) + "/" + std::to_string(c.local_world()));
  CHECK(comm_mpi_active(), "MPI is initialised");
}

void test_all_gather(Env& e) {
  Communicator& c = e.comm;
  const int world = c.world(), me = c.rank();
  for (DType t : kDtypes)
    for (size_t n : {size_t{1}, size_t{7}, size_t{3000}, size_t{70001}})
      for (bool in_place : {false, true}) {
        const size_t es = kernels::dtype_size(t), bytes = n * es;
        kernels::DeviceBuffer recv(e.rt, bytes * world), own(e.rt, bytes);
        std::memset(recv.data(), 0xab, recv.bytes());
        void* send = in_place ? recv.as<std::byte>() + me * bytes : own.data();
        fill(send, t, n, me, 0);
        c.all_gather(send, recv.data(), n, t, e.stream);
        e.stream.synchronize();
        std::vector<std::byte> want(bytes * world);
        for (int k = 0; k < world; ++k) fill(want.data() + k * bytes, t, n, k, 0);
        expect_bytes(recv.data(), want.data(), want.size(),
                     "all_gather " + dt(t) + " n=" + std::to_string(n) + (in_place ? " in place" : ""));
      }
}

void test_reduce_scatter(Env& e) {
  Communicator& c = e.comm;
  const int world = c.world(), me = c.rank();
  // With 8 KiB pieces: 4099 fp32 is three pieces with a short tail, 20000 bf16 five.
  for (DType t : kDtypes)
    for (size_t n : {size_t{1}, size_t{5}, size_t{4099}, size_t{20000}})
      for (bool in_place : {false, true}) {
        const size_t es = kernels::dtype_size(t), bytes = n * es;
        kernels::DeviceBuffer send(e.rt, bytes * world), out(e.rt, bytes);
        fill(send.data(), t, n * world, me, 0);
        void* recv = in_place ? send.as<std::byte>() + me * bytes : out.data();
        c.reduce_scatter(send.data(), recv, n, t, e.stream);
        e.stream.synchronize();
        const auto want = expected_sums(t, me * n, n, all_ranks(world));
        expect_bytes(recv, want.data(), bytes,
                     "reduce_scatter " + dt(t) + " n=" + std::to_string(n) + (in_place ? " in place" : ""));
        if (in_place) {  // the other shards of send are left as they were
          std::vector<std::byte> mine(bytes * world);
          fill(mine.data(), t, n * world, me, 0);
          for (int k = 0; k < world; ++k)
            if (k != me) expect_bytes(send.as<std::byte>() + k * bytes, mine.data() + k * bytes, bytes, "untouched shard");
        }
      }
}

void test_all_reduce(Env& e) {
  Communicator& c = e.comm;
  const int world = c.world(), me = c.rank();
  const size_t w = static_cast<size_t>(world);
  // Counts below world (some ranks own nothing), not multiples of world, and multi-piece.
  for (DType t : kDtypes)
    for (size_t n : {size_t{1}, size_t{2}, size_t{3}, 5 * w + 1, size_t{10007}, 4096 * w})
      for (bool in_place : {false, true}) {
        const size_t bytes = n * kernels::dtype_size(t);
        kernels::DeviceBuffer a(e.rt, bytes), b(e.rt, bytes);
        fill(a.data(), t, n, me, 0);
        void* recv = in_place ? a.data() : b.data();
        c.all_reduce(a.data(), recv, n, t, e.stream);
        e.stream.synchronize();
        const auto want = expected_sums(t, 0, n, all_ranks(world));
        expect_bytes(recv, want.data(), bytes,
                     "all_reduce " + dt(t) + " n=" + std::to_string(n) + (in_place ? " in place" : ""));
      }
}

// ZeRO stage 0 (all-reduce the gradient) and stage 2 (reduce-scatter it, all-gather the
// updated shards) must agree bit for bit: rank r's shard of the all-reduce is its reduce-scatter.
void test_all_reduce_matches_reduce_scatter(Env& e) {
  Communicator& c = e.comm;
  const int world = c.world(), me = c.rank();
  for (DType t : kDtypes) {
    const size_t shard = 6000, n = shard * world, es = kernels::dtype_size(t);
    kernels::DeviceBuffer grads(e.rt, n * es), reduced(e.rt, n * es), rs(e.rt, shard * es), gathered(e.rt, n * es);
    fill(grads.data(), t, n, me, 0);
    c.all_reduce(grads.data(), reduced.data(), n, t, e.stream);
    c.reduce_scatter(grads.data(), rs.data(), shard, t, e.stream);
    c.all_gather(rs.data(), gathered.data(), shard, t, e.stream);
    e.stream.synchronize();
    expect_bytes(rs.data(), reduced.as<std::byte>() + me * shard * es, shard * es, "all_reduce shard vs reduce_scatter " + dt(t));
    expect_bytes(gathered.data(), reduced.data(), n * es, "all_reduce vs reduce_scatter+all_gather " + dt(t));
  }
}

// The same inputs give the same bits whatever the arrival order: ranks enter each repeat at
// different times. With 3+ ranks the test data also checks that the order is the rank order.
void test_determinism(Env& e, Communicator& default_pieces) {
  Communicator& c = e.comm;
  const int world = c.world(), me = c.rank();
  const size_t n = 50000 * static_cast<size_t>(world);
  for (DType t : {DType::f32, DType::bf16}) {
    const size_t bytes = n * kernels::dtype_size(t);
    kernels::DeviceBuffer x(e.rt, bytes), first(e.rt, bytes), again(e.rt, bytes);
    fill(x.data(), t, n, me, 0);
    c.all_reduce(x.data(), first.data(), n, t, e.stream);
    e.stream.synchronize();
    for (int rep = 0; rep < 4; ++rep) {
      std::this_thread::sleep_for(std::chrono::milliseconds(15 * ((rep + me) % world)));
      Communicator& which = rep % 2 ? default_pieces : c;  // piece size does not change the bits
      which.all_reduce(x.data(), again.data(), n, t, e.stream);
      e.stream.synchronize();
      expect_bytes(again.data(), first.data(), bytes, "repeat " + std::to_string(rep) + " " + dt(t));
    }
    const auto want = expected_sums(t, 0, n, all_ranks(world));
    expect_bytes(first.data(), want.data(), bytes, "rank-order sum " + dt(t));
    if (world >= 3) {
      std::vector<int> reversed = all_ranks(world);
      std::reverse(reversed.begin(), reversed.end());
      const auto other = expected_sums(t, 0, n, reversed);
      CHECK(first_difference(other.data(), want.data(), bytes) < bytes, "the data tells rank orders apart");
    }
  }
}

void test_broadcast(Env& e) {
  Communicator& c = e.comm;
  for (int root = 0; root < c.world(); ++root)
    for (DType t : kDtypes)
      for (size_t n : {size_t{1}, size_t{5000}, size_t{300000}}) {
        const size_t bytes = n * kernels::dtype_size(t);
        kernels::DeviceBuffer buf(e.rt, bytes);
        if (c.rank() == root) fill(buf.data(), t, n, root, 7);
        else std::memset(buf.data(), 0, bytes);
        c.broadcast(buf.data(), n, t, root, e.stream);
        e.stream.synchronize();
        std::vector<std::byte> want(bytes);
        fill(want.data(), t, n, root, 7);
        expect_bytes(buf.data(), want.data(), bytes, "broadcast from " + std::to_string(root) + " " + dt(t));
      }
}

// A barrier completes nowhere before the last rank reaches it.
void test_barrier(Env& e) {
  Communicator& c = e.comm;
  const int last = c.world() - 1;
  host_sync(c);
  const auto t0 = Clock::now();
  if (c.rank() == last) std::this_thread::sleep_for(std::chrono::milliseconds(400));
  c.barrier(e.stream);
  e.stream.synchronize();
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (c.rank() != last) CHECK(ms >= 300, "barrier returned after " + std::to_string(ms) + " ms");
}

// Collectives are asynchronous (the call returns before the peers have even joined) and run on
// their stream while another stream computes: the compute task below keeps computing until the
// collective, enqueued after it on another stream, has finished — impossible if the two were
// serialised.
void test_overlap(Env& e) {
  Communicator& c = e.comm;
  const int late = c.world() - 1;
  auto compute = e.rt.create_stream();
  CommHandle done(e.rt);
  const size_t n = 200000;
  kernels::DeviceBuffer grads(e.rt, n * 4);
  fill(grads.data(), DType::f32, n, c.rank(), 0);
  std::atomic<bool> comm_finished{false};
  std::atomic<bool> saw_comm_finish{false};
  double acc = 0;
  compute->host_fn([&] {  // "backward of the next layer"
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (!comm_finished && Clock::now() < deadline)
      for (int i = 0; i < 10000; ++i) acc += 1e-9 * i;
    saw_comm_finish = comm_finished.load();
  });
  host_sync(c);
  if (c.rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int64_t t_call = Clock::now().time_since_epoch().count();
  c.all_reduce(grads.data(), grads.data(), n, DType::f32, e.stream);
  const int64_t t_returned = Clock::now().time_since_epoch().count();
  done.record(e.stream);
  e.stream.host_fn([&] { comm_finished = true; });
  compute->synchronize();
  done.synchronize();
  CHECK(saw_comm_finish, "the compute stream ran the whole time the collective did");
  CHECK(acc > 0, "compute happened");
  // steady_clock is CLOCK_MONOTONIC, one clock for every process on the machine.
  std::vector<int64_t> calls(static_cast<size_t>(c.world()));
  c.host_all_gather(&t_call, calls.data(), sizeof t_call);
  if (c.rank() != late)
    CHECK(t_returned < calls[static_cast<size_t>(late)], "all_reduce returned before rank " + std::to_string(late) +
                                                              " called it (asynchronous)");
  const auto want = expected_sums(DType::f32, 0, n, all_ranks(c.world()));
  expect_bytes(grads.data(), want.data(), n * 4, "overlapped all_reduce");
}

// Collectives on two streams run in different orders on different ranks (each rank delays the
// other stream), yet match: they pair up by issue order, not by arrival.
void test_two_streams(Env& e) {
  Communicator& c = e.comm;
  const int world = c.world(), me = c.rank();
  auto a = e.rt.create_stream(), b = e.rt.create_stream();
  const size_t n = 3000 * static_cast<size_t>(world), shard = 3000;
  kernels::DeviceBuffer x(e.rt, n * 4), y(e.rt, n * 2), g(e.rt, n * 4), r(e.rt, shard * 4);
  fill(x.data(), DType::f32, n, me, 0);
  fill(y.data(), DType::bf16, n, me, 0);
  kernels::Stream& slow = me % 2 ? *a : *b;
  slow.host_fn([] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); });
  c.all_reduce(x.data(), x.data(), n, DType::f32, *a);     // issue 1
  c.all_reduce(y.data(), y.data(), n, DType::bf16, *b);    // issue 2
  c.all_gather(x.as<float>() + me * shard, g.data(), shard, DType::f32, *a);  // issue 3 (in a's order)
  kernels::DeviceBuffer z(e.rt, n * 4);
  fill(z.data(), DType::f32, n, me, 0);
  c.reduce_scatter(z.data(), r.data(), shard, DType::f32, *b);  // issue 4
  a->synchronize();
  b->synchronize();
  const auto want_x = expected_sums(DType::f32, 0, n, all_ranks(world));
  expect_bytes(x.data(), want_x.data(), n * 4, "stream a all_reduce");
  expect_bytes(g.data(), want_x.data(), n * 4, "stream a all_gather");
  const auto want_y = expected_sums(DType::bf16, 0, n, all_ranks(world));
  expect_bytes(y.data(), want_y.data(), n * 2, "stream b all_reduce");
  expect_bytes(r.data(), want_x.data() + me * shard * 4, shard * 4, "stream b reduce_scatter");
}

// Process groups: even and odd ranks, ordered by descending global rank within each group.
void test_split(Env& e) {
  Communicator& c = e.comm;
  auto sub = c.split(c.rank() % 2, -c.rank());
  std::vector<int> members;  // global ranks in sub-rank order
  for (int k = c.world() - 1; k >= 0; --k)
    if (k % 2 == c.rank() % 2) members.push_back(k);
  CHECK(sub->world() == static_cast<int>(members.size()), "group size");
  CHECK(members[static_cast<size_t>(sub->rank())] == c.rank(), "group rank follows the key");
  CHECK(sub->backend() == CommBackend::mpi, "group backend");
  const size_t n = 5001;
  kernels::DeviceBuffer x(e.rt, n * 4);
  fill(x.data(), DType::f32, n, c.rank(), 0);
  sub->all_reduce(x.data(), x.data(), n, DType::f32, e.stream);
  e.stream.synchronize();
  const auto want = expected_sums(DType::f32, 0, n, members);  // summed in the group's rank order
  expect_bytes(x.data(), want.data(), n * 4, "group all_reduce");
  int leader = c.rank();
  sub->host_broadcast(&leader, sizeof leader, 0);
  CHECK(leader == members[0], "group host_broadcast");
}

// The (dp, pp, tp) grid: every factorisation of the world, each group holding the ranks that
// differ from this one in its axis alone, ordered along it, and summing over exactly them.
void test_grid(Env& e) {
  Communicator& c = e.comm;
  const int world = c.world();
  for (int tp = 1; tp <= world; ++tp)
    for (int pp = 1; tp * pp <= world; ++pp) {
      if (world % (tp * pp) != 0) continue;
      ProcessGroups g(c, tp, pp);
      const GridShape& s = g.shape();
      const GridCoord me = g.coord();
      CHECK(s.dp == world / (tp * pp) && grid_rank(s, me) == c.rank(), "grid coordinates");
      struct Axis {
        Communicator* comm;
        int size, index;
        GridCoord (*at)(GridCoord, int);
      };
      const Axis axes[] = {
          {&g.tp(), s.tp, me.tp, [](GridCoord k, int i) { return GridCoord{i, k.pp, k.dp}; }},
          {&g.pp(), s.pp, me.pp, [](GridCoord k, int i) { return GridCoord{k.tp, i, k.dp}; }},
          {&g.dp(), s.dp, me.dp, [](GridCoord k, int i) { return GridCoord{k.tp, k.pp, i}; }},
      };
      for (const Axis& a : axes) {
        CHECK(a.comm->world() == a.size && a.comm->rank() == a.index, "group size and rank follow the axis");
        std::vector<int> members;  // global ranks in group-rank order
        for (int i = 0; i < a.size; ++i) members.push_back(grid_rank(s, a.at(me, i)));
        const int mine = c.rank();
        std::vector<int> got(static_cast<size_t>(a.size));
        a.comm->host_all_gather(&mine, got.data(), sizeof mine);
        CHECK(got == members, "group members");
        const size_t n = 777;
        kernels::DeviceBuffer x(e.rt, n * 4), g(e.rt, n * 4 * static_cast<size_t>(a.size));
        fill(x.data(), DType::f32, n, c.rank(), 0);
        const uint64_t sent0 = a.comm->sent_bytes();
        a.comm->all_reduce(x.data(), x.data(), n, DType::f32, e.stream);
        e.stream.synchronize();
        const auto want = expected_sums(DType::f32, 0, n, members);
        expect_bytes(x.data(), want.data(), n * 4, "group all_reduce");
        const auto w = static_cast<uint64_t>(a.size);
        CHECK(a.comm->sent_bytes() - sent0 == 2 * n * 4 * (w - 1) / w, "an all_reduce counts 2·(w−1)/w of its bytes sent");
        a.comm->all_gather(x.data(), g.data(), n, DType::f32, e.stream);
        e.stream.synchronize();
        CHECK(a.comm->sent_bytes() - sent0 == 2 * n * 4 * (w - 1) / w + n * 4 * (w - 1),
              "an all_gather counts its part sent to every other rank");
      }
    }
  bool threw = false;
  try {
    ProcessGroups bad(c, world + 1, 1);
  } catch (const std::invalid_argument& err) {
    threw = std::string(err.what()).find("--tp") != std::string::npos;
  }
  CHECK(threw, "a --tp that does not divide the world is refused, naming it");
}

// Point-to-point around a ring (each rank sends to the next, receives from the previous),
// several messages in flight on two streams, one large enough for pieces, with an all-reduce
// of the whole group issued between them on a third stream: each pair matches by its own order,
// the collective by the group's.
void test_send_recv(Env& e) {
  Communicator& c = e.comm;
  const int me = c.rank(), n = c.world(), next = (me + 1) % n, prev = (me - 1 + n) % n;
  auto other = e.rt.create_stream(), third = e.rt.create_stream();
  const std::vector<size_t> sizes = {1, 4097, 3 * 1024 * 1024 + 5};
  std::vector<kernels::DeviceBuffer> out, in;
  for (size_t k = 0; k < sizes.size(); ++k) {
    out.emplace_back(e.rt, sizes[k] * 4);
    in.emplace_back(e.rt, sizes[k] * 4);
    fill(out.back().data(), DType::f32, sizes[k], me, k * 7919);
  }
  kernels::DeviceBuffer x(e.rt, 1000 * 4);
  fill(x.data(), DType::f32, 1000, me, 9);
  const uint64_t sent0 = c.sent_bytes();
  for (size_t k = 0; k < sizes.size(); ++k) {
    kernels::Stream& s = k % 2 ? *other : e.stream;
    if (me % 2 == 0) {  // even ranks send first, odd ones receive first: no order deadlocks either way
      c.send(out[k].data(), sizes[k], DType::f32, next, s);
      c.recv(in[k].data(), sizes[k], DType::f32, prev, s);
    } else {
      c.recv(in[k].data(), sizes[k], DType::f32, prev, s);
      c.send(out[k].data(), sizes[k], DType::f32, next, s);
    }
    if (k == 1) c.all_reduce(x.data(), x.data(), 1000, DType::f32, *third);
  }
  e.stream.synchronize();
  other->synchronize();
  third->synchronize();
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<unsigned char> want(sizes[k] * 4);
    fill(want.data(), DType::f32, sizes[k], prev, k * 7919);
    expect_bytes(in[k].data(), want.data(), sizes[k] * 4, "recv from the previous rank");
  }
  expect_bytes(x.data(), expected_sums(DType::f32, 9, 1000, all_ranks(n)).data(), 1000 * 4, "all_reduce between sends");
  const auto w = static_cast<uint64_t>(n);
  CHECK(c.sent_bytes() - sent0 == (1 + 4097 + 3 * 1024 * 1024 + 5) * 4 + 2 * 1000 * 4 * (w - 1) / w,
        "a send counts its bytes (beside the all-reduce's)");
  bool threw = false;
  try {
    c.send(out[0].data(), 1, DType::f32, me, e.stream);
  } catch (const std::invalid_argument& err) {
    threw = std::string(err.what()).find("peer") != std::string::npos;
  }
  CHECK(threw, "a send to itself is refused");
}

// The NCCL bootstrap shape: rank 0 makes an opaque 128-byte id, every rank receives it.
void test_host_plane(Env& e) {
  Communicator& c = e.comm;
  unsigned char id[128];
  for (int i = 0; i < 128; ++i) id[i] = c.rank() == 0 ? static_cast<unsigned char>(mix(static_cast<uint64_t>(i)) & 0xff) : 0;
  c.host_broadcast(id, sizeof id, 0);
  for (int i = 0; i < 128; ++i) CHECK(id[i] == (mix(static_cast<uint64_t>(i)) & 0xff), "id byte " + std::to_string(i));
  std::vector<unsigned char> all(128 * static_cast<size_t>(c.world()));
  c.host_all_gather(id, all.data(), sizeof id);
  for (int k = 0; k < c.world(); ++k) CHECK(std::memcmp(all.data() + 128 * k, id, 128) == 0, "gathered id");
  // host_gather: to the last rank only, in pieces (this job's 8 KiB collective pieces make them
  // 128 KiB: 300,001 bytes is 3 pieces, the last a short one).
  const size_t n = 300001;
  const int root = c.world() - 1;
  std::vector<unsigned char> mine(n), got(root == c.rank() ? n * static_cast<size_t>(c.world()) : 0);
  for (size_t i = 0; i < n; ++i) mine[i] = static_cast<unsigned char>(mix(i * 7 + static_cast<uint64_t>(c.rank())) & 0xff);
  c.host_gather(mine.data(), got.empty() ? nullptr : got.data(), n, root);
  if (c.rank() == root)
    for (int k = 0; k < c.world(); ++k)
      for (size_t i = 0; i < n; i += 997)
        CHECK(got[static_cast<size_t>(k) * n + i] == (mix(i * 7 + static_cast<uint64_t>(k)) & 0xff), "host_gather byte");
}

// Bad arguments throw on the calling thread before anything is enqueued, on every rank alike,
// and leave the communicator usable.
void test_bad_arguments(Env& e) {
  Communicator& c = e.comm;
  float x[8] = {};
  bool threw = false;
  try {
    c.broadcast(x, 8, DType::f32, c.world(), e.stream);
  } catch (const std::invalid_argument& err) {
    threw = std::string(err.what()).find("root") != std::string::npos;
  }
  CHECK(threw, "broadcast with root == world throws");
  c.barrier(e.stream);
  e.stream.synchronize();
  CHECK(c.workspace_bytes() > 0, "workspaces were made and kept");
}

// --- the failing jobs that test_comm's Failure tests start ---------------------------------

// Every rank all-reduces in a loop; rank `bad` fails at iteration 3 in the way `mode` says.
int run_failing(Env& e, const std::string& mode, int bad) {
  Communicator& c = e.comm;
  const size_t n = 1 << 20;
  kernels::DeviceBuffer x(e.rt, n * 4);
  fill(x.data(), DType::f32, n, c.rank(), 0);
  if (mode == "kill" && c.rank() == bad)
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::raise(SIGKILL);
    }).detach();
  for (int it = 0;; ++it) {
    if (c.rank() == bad && it == 3) {
      if (mode == "throw-host")  // bad input on one rank: partially overlapping buffers
        c.all_reduce(x.as<float>(), x.as<float>() + 1, 8, DType::f32, e.stream);
      if (mode == "throw-stream")  // an asynchronous error on the stream, as a full disk would be
        e.stream.host_fn([] { throw std::runtime_error("write /nvme/strata/swap.0 at offset 4096: No space left on device"); });
    }
    c.all_reduce(x.data(), x.data(), n, DType::f32, e.stream);
    e.stream.synchronize();
  }
}

}  // namespace

// Device buffers on a CUDA stream, where a GPU is visible (every rank of the job on it, or the
// node's GPUs shared): the mpi communicator stages them through pinned host memory and runs the
// collectives on worker streams of its own (src/comm/mpi.cpp). The same results, bit for bit, as
// host buffers on a CPU stream; host buffers given with the CUDA stream too. Skipped without a GPU.
void test_device_buffers(Env& e) {
  Communicator& c = e.comm;
  if (!kernels::cuda_available()) {
    if (c.rank() == 0) std::printf("comm_mpi_test: device_buffers skipped: no CUDA device visible\n");
    return;
  }
  const int world = c.world(), me = c.rank();
  auto rt = kernels::make_runtime(kernels::Backend::cuda, c.local_rank() % kernels::cuda_device_count());
  auto s = rt->create_stream();
  for (DType t : {DType::f32, DType::bf16}) {
    const size_t n = 70001, es = kernels::dtype_size(t), bytes = n * es;
    const std::string what = " of device buffers " + dt(t);
    std::vector<std::byte> host(bytes * world), got(bytes * world);
    kernels::DeviceBuffer in(*rt, bytes * world), out(*rt, bytes * world);
    const auto upload = [&](size_t b) {
      s->memcpy_async(in.data(), host.data(), b);
      s->synchronize();
    };
    const auto download = [&](const void* d, size_t b) {
      s->memcpy_async(got.data(), d, b);
      s->synchronize();
    };
    // all_reduce, out of place and in place
    fill(host.data(), t, n, me, 0);
    upload(bytes);
    c.all_reduce(in.data(), out.data(), n, t, *s);
    download(out.data(), bytes);
    expect_bytes(got.data(), expected_sums(t, 0, n, all_ranks(world)).data(), bytes, "all_reduce" + what);
    c.all_reduce(in.data(), in.data(), n, t, *s);
    download(in.data(), bytes);
    expect_bytes(got.data(), expected_sums(t, 0, n, all_ranks(world)).data(), bytes, "in-place all_reduce" + what);
    // reduce_scatter: world shards of n, this rank's summed
    fill(host.data(), t, n * world, me, 0);
    upload(bytes * world);
    c.reduce_scatter(in.data(), out.data(), n, t, *s);
    download(out.data(), bytes);
    expect_bytes(got.data(), expected_sums(t, static_cast<size_t>(me) * n, n, all_ranks(world)).data(), bytes,
                 "reduce_scatter" + what);
    // all_gather
    fill(host.data(), t, n, me, 0);
    upload(bytes);
    c.all_gather(in.data(), out.data(), n, t, *s);
    download(out.data(), bytes * world);
    std::vector<std::byte> want(bytes * world);
    for (int k = 0; k < world; ++k) fill(want.data() + static_cast<size_t>(k) * bytes, t, n, k, 0);
    expect_bytes(got.data(), want.data(), want.size(), "all_gather" + what);
    // broadcast from the last rank
    fill(host.data(), t, n, me, 0);
    upload(bytes);
    c.broadcast(in.data(), n, t, world - 1, *s);
    download(in.data(), bytes);
    fill(want.data(), t, n, world - 1, 0);
    expect_bytes(got.data(), want.data(), bytes, "broadcast" + what);
    // host buffers with the CUDA stream (a save's gathers): used in place, in the stream's order
    fill(host.data(), t, n, me, 0);
    c.all_reduce(host.data(), got.data(), n, t, *s);
    s->synchronize();
    expect_bytes(got.data(), expected_sums(t, 0, n, all_ranks(world)).data(), bytes, "all_reduce of host buffers " + dt(t));
  }
  c.barrier(*s);
  s->synchronize();
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int bad = argc > 2 ? std::atoi(argv[2]) : 1;
  try {
    auto rt = kernels::make_runtime(kernels::Backend::cpu);
    CommOptions small;
    small.piece_bytes = 8192;  // many pieces per collective: exercises the double-buffered exchange
    auto comm = make_communicator(kernels::Backend::cpu, small);
    if (comm->backend() != CommBackend::mpi)
      throw std::runtime_error("not started by mpirun: run as `mpirun -n 2 " + std::string(argv[0]) + "`");
    std::fprintf(stderr, "comm_mpi_test: rank %d pid %d\n", comm->rank(), static_cast<int>(::getpid()));
    auto stream = rt->create_stream();
    Env e{*comm, *rt, *stream};
    if (!mode.empty()) return run_failing(e, mode, bad);

    auto default_pieces = make_communicator(kernels::Backend::cpu);
    const std::vector<std::pair<const char*, std::function<void()>>> tests = {
        {"identity", [&] { test_identity(e); }},
        {"all_gather", [&] { test_all_gather(e); }},
        {"reduce_scatter", [&] { test_reduce_scatter(e); }},
        {"all_reduce", [&] { test_all_reduce(e); }},
        {"all_reduce_matches_reduce_scatter", [&] { test_all_reduce_matches_reduce_scatter(e); }},
        {"determinism", [&] { test_determinism(e, *default_pieces); }},
        {"broadcast", [&] { test_broadcast(e); }},
        {"barrier", [&] { test_barrier(e); }},
        {"overlap", [&] { test_overlap(e); }},
        {"two_streams", [&] { test_two_streams(e); }},
        {"split", [&] { test_split(e); }},
        {"grid", [&] { test_grid(e); }},
        {"send_recv", [&] { test_send_recv(e); }},
        {"host_plane", [&] { test_host_plane(e); }},
        {"bad_arguments", [&] { test_bad_arguments(e); }},
        {"device_buffers", [&] { test_device_buffers(e); }},
    };
    for (const auto& [name, fn] : tests) {
      const auto t0 = Clock::now();
      fn();
      host_sync(*comm);
      if (comm->rank() == 0)
        std::printf("comm_mpi_test: world %d: ok %s (%.0f ms)\n", comm->world(), name,
                    std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      std::fflush(stdout);
    }
    stream.reset();
    default_pieces.reset();
    comm.reset();  // the last mpi communicator: MPI_Finalize
    if (comm_mpi_active()) throw std::runtime_error("MPI still active after the last communicator");
    return 0;
  } catch (const std::exception& err) {
    return report_fatal_error(err.what());
  }
}
