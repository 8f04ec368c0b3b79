// src/comm without MPI: the fixed-order sum (the definition every backend is held to), the
// local communicator (identity collectives on a stream, copies only when out of place), the
// argument checks every backend shares, launch detection, and report_fatal_error off mpirun.
// CommFailure2Ranks starts 2-rank jobs of comm_mpi_test in which one rank fails (throws, or is
// killed) and checks every rank is gone within 30 s; comm_mpi_test itself covers the rest.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/runtime.h"
#include "src/comm/comm_internal.h"
#include "src/comm/communicator.h"
#include "src/comm/grid.h"
#include "src/comm/reduce.h"

using namespace strata;
using kernels::DType;

namespace {

// Sets or unsets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) ::setenv(name_, old_.c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// Runs `body` with every launcher variable detect_launch() reads unset, plus `extra` set.
template <class F>
void without_launcher(F body) {
  ScopedEnv a("OMPI_COMM_WORLD_SIZE", nullptr), b("OMPI_COMM_WORLD_RANK", nullptr), c("PMIX_RANK", nullptr),
      d("PMI_RANK", nullptr), e("PMI_SIZE", nullptr), f("PMIX_SIZE", nullptr);
  body();
}

std::vector<uint16_t> to_16(const std::vector<float>& x, DType t) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = t == DType::bf16 ? kernels::f32_to_bf16(x[i]) : kernels::f32_to_f16(x[i]);
  return out;
}
float from_16(const std::vector<uint16_t>& x, DType t, size_t i) {
  return t == DType::bf16 ? kernels::bf16_to_f32(x[i]) : kernels::f16_to_f32(x[i]);
}

// A communicator that reports a world of 4 (rank 1) and records which do_* ran: the argument
// checks live in the base class, so every backend gets them; this tests them at world > 1
// without MPI.
class FakeWorld4 final : public Communicator {
 public:
  FakeWorld4() : Communicator(CommBackend::mpi, 1, 4, 1, 4) {}
  int calls = 0;

 protected:
  void do_all_gather(const void*, void*, size_t, DType, kernels::Stream&) override { ++calls; }
  void do_reduce_scatter(const void*, void*, size_t, DType, kernels::Stream&) override { ++calls; }
  void do_all_reduce(const void*, void*, size_t, DType, kernels::Stream&) override { ++calls; }
  void do_broadcast(void*, size_t, DType, int, kernels::Stream&) override { ++calls; }
  void do_barrier(kernels::Stream&) override { ++calls; }
  void do_send(const void*, size_t, DType, int, kernels::Stream&) override { ++calls; }
  void do_send_recv(const void*, size_t, int, void*, size_t, int, DType, kernels::Stream&) override { ++calls; }
  void do_recv(void*, size_t, DType, int, kernels::Stream&) override { ++calls; }
  void do_host_broadcast(void*, size_t, int) override { ++calls; }
  void do_host_all_gather(const void*, void*, size_t) override { ++calls; }
  void do_host_gather(const void*, void*, size_t, int) override { ++calls; }
  std::unique_ptr<Communicator> do_split(int, int) override { return nullptr; }
};

void expect_invalid(const std::function<void()>& f, std::initializer_list<const char*> needles) {
  try {
    f();
    ADD_FAILURE() << "no std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    for (const char* n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << n << " not in: " << e.what();
  }
}

}  // namespace

TEST(CommSum, IsTheLeftToRightFp32SumRoundedOnce) {
  // Order matters: (1 + 1e8) - 1e8 == 0 in fp32 (1e8 + 1 rounds to 1e8), (-1e8 + 1e8) + 1 == 1.
  const float a[] = {1.f, 3.f, 0.5f}, b[] = {1e8f, 1e-8f, 0.25f}, c[] = {-1e8f, -3.f, 0.125f};
  const void* srcs[] = {a, b, c};
  float out[3];
  sum_in_rank_order(srcs, 3, out, 3, DType::f32);
  for (int i = 0; i < 3; ++i) {
    float acc = a[i];
    acc += b[i];
    acc += c[i];
    EXPECT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(acc)) << i;
  }
  EXPECT_EQ(out[0], 0.f);
  const float reversed = (c[0] + b[0]) + a[0];
  EXPECT_EQ(reversed, 1.f) << "the test data must tell the orders apart";

  // One source: the identity, in place included.
  float x[5] = {1, -2, 3.5f, 0, 7};
  const void* one[] = {x};
  sum_in_rank_order(one, 1, x, 5, DType::f32);
  EXPECT_EQ(x[2], 3.5f);
}

TEST(CommSum, SixteenBitTypesAccumulateInFp32AndRoundOnce) {
  // bf16: 256 + 1 + 1 rounds to 256 at each step in bf16 arithmetic (8 mantissa bits) but to
  // 258 when accumulated in fp32 and rounded once.
  for (DType t : {DType::bf16, DType::f16}) {
    const float big = t == DType::bf16 ? 256.f : 2048.f;  // where +1 is below half an ulp
    const auto x0 = to_16({big, 1.5f, -0.f}, t), x1 = to_16({1.f, 2.25f, 0.f}, t), x2 = to_16({1.f, -4.f, -0.f}, t);
    const void* srcs[] = {x0.data(), x1.data(), x2.data()};
    std::vector<uint16_t> out(3);
    sum_in_rank_order(srcs, 3, out.data(), 3, t);
    EXPECT_EQ(from_16(out, t, 0), big + 2.f) << kernels::dtype_name(t);
    EXPECT_EQ(from_16(out, t, 1), -0.25f);
    // In place on source 1, over more than one 1024-element block.
    std::vector<float> f0(3000), f1(3000);
    for (size_t i = 0; i < f0.size(); ++i) f0[i] = static_cast<float>(i % 97) * 0.5f, f1[i] = -static_cast<float>(i % 13);
    auto h0 = to_16(f0, t), h1 = to_16(f1, t);
    const void* two[] = {h0.data(), h1.data()};
    sum_in_rank_order(two, 2, h1.data(), h1.size(), t);
    for (size_t i = 0; i < f0.size(); ++i) {
      const float want = from_16(to_16({f0[i] + f1[i]}, t), t, 0);
      ASSERT_EQ(from_16(h1, t, i), want) << i;
    }
  }
}

// Megatron's order: tp fastest, then pp, then dp; every rank has one place and back.
TEST(Grid, RanksAreTensorFastestThenPipelineThenData) {
  const GridShape g = grid_shape(8, 2, 2);
  EXPECT_EQ(g.dp, 2);
  EXPECT_EQ(grid_name(g), "dp 2 × pp 2 × tp 2");
  const GridCoord c5 = grid_coord(g, 5);  // 5 = (1·2 + 0)·2 + 1
  EXPECT_EQ(c5.tp, 1);
  EXPECT_EQ(c5.pp, 0);
  EXPECT_EQ(c5.dp, 1);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(grid_rank(g, grid_coord(g, r)), r);
  EXPECT_EQ(grid_shape(1, 1, 1).world(), 1);
  EXPECT_THROW(grid_shape(6, 4, 1), std::invalid_argument);
  EXPECT_THROW(grid_shape(4, 0, 1), std::invalid_argument);
  EXPECT_THROW(grid_shape(4, 1, -1), std::invalid_argument);
}

TEST(Grid, OneRankIsItsOwnGroupOnEveryAxis) {
  auto world = make_local_communicator();
  ProcessGroups g(*world, 1, 1);
  EXPECT_EQ(g.tp().world(), 1);
  EXPECT_EQ(g.pp().world(), 1);
  EXPECT_EQ(&g.dp(), world.get());  // tp = pp = 1: ZeRO on the world itself
  EXPECT_THROW(ProcessGroups(*world, 2, 1), std::invalid_argument);
}

TEST(CommLocal, IsRankZeroOfOne) {
  auto comm = make_local_communicator();
  EXPECT_EQ(comm->backend(), CommBackend::local);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world(), 1);
  EXPECT_EQ(comm->local_rank(), 0);
  EXPECT_EQ(comm->local_world(), 1);
  EXPECT_EQ(comm_backend_name(comm->backend()), "local");
  auto sub = comm->split(3, 0);
  EXPECT_EQ(sub->world(), 1);
  EXPECT_EQ(comm->workspace_bytes(), 0u);
}

TEST(CommLocal, CollectivesAreStreamOrderedCopies) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto comm = make_local_communicator();
  auto stream = rt->create_stream();
  const size_t n = 1000;
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    const size_t bytes = n * kernels::dtype_size(t);
    kernels::DeviceBuffer a(*rt, bytes), b(*rt, bytes);
    std::vector<float> vals(n);
    for (size_t i = 0; i < n; ++i) vals[i] = static_cast<float>(i % 64) * 0.5f - 16.f;  // exact in every dtype
    for (size_t i = 0; i < n; ++i) kernels::store_from_f32(a.data(), t, i, vals[i]);

    // The copy happens when the stream gets there, not on the calling thread.
    std::atomic<bool> gate{false};
    stream->host_fn([&] { while (!gate) std::this_thread::yield(); });
    std::memset(b.data(), 0xff, bytes);
    comm->all_reduce(a.data(), b.data(), n, t, *stream);
    EXPECT_NE(std::memcmp(a.data(), b.data(), bytes), 0);
    gate = true;
    stream->synchronize();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), bytes), 0) << kernels::dtype_name(t);

    std::memset(b.data(), 0, bytes);
    comm->reduce_scatter(a.data(), b.data(), n, t, *stream);
    stream->synchronize();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), bytes), 0);
    std::memset(b.data(), 0, bytes);
    comm->all_gather(a.data(), b.data(), n, t, *stream);
    stream->synchronize();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), bytes), 0);

    // In place: nothing to do, the data is untouched.
    comm->all_reduce(a.data(), a.data(), n, t, *stream);
    comm->reduce_scatter(a.data(), a.data(), n, t, *stream);
    comm->all_gather(a.data(), a.data(), n, t, *stream);
    comm->broadcast(a.data(), n, t, 0, *stream);
    comm->barrier(*stream);
    stream->synchronize();
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(kernels::load_as_f32(a.data(), t, i), vals[i]);
  }
  char id[128], got[128];
  for (int i = 0; i < 128; ++i) id[i] = static_cast<char>(i * 7);
  comm->host_broadcast(id, sizeof id, 0);
  comm->host_all_gather(id, got, sizeof id);
  EXPECT_EQ(std::memcmp(id, got, sizeof id), 0);
}

TEST(CommHandle, ComputeWaitsForTheCommunicationStream) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto comm = make_local_communicator();
  auto comm_stream = rt->create_stream(), compute = rt->create_stream();
  CommHandle gathered(*rt);
  std::vector<float> shard(256, 3.f), full(256, 0.f);
  std::atomic<bool> gate{false};
  comm_stream->host_fn([&] { while (!gate) std::this_thread::yield(); });
  comm->all_gather(shard.data(), full.data(), shard.size(), DType::f32, *comm_stream);
  gathered.record(*comm_stream);
  EXPECT_TRUE(gathered.pending());
  gathered.wait(*compute);
  float seen = -1;
  compute->host_fn([&] { seen = full[255]; });
  EXPECT_FALSE(gathered.done());
  gate = true;
  compute->synchronize();
  EXPECT_EQ(seen, 3.f);
  EXPECT_TRUE(gathered.done());
  EXPECT_FALSE(gathered.pending());

  // An error on the communication stream reaches whoever synchronises on the handle.
  comm_stream->host_fn([] { throw std::runtime_error("transfer failed"); });
  gathered.record(*comm_stream);
  EXPECT_THROW(gathered.synchronize(), std::runtime_error);
}

TEST(CommChecks, RejectBadArgumentsBeforeEnqueueing) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto s = rt->create_stream();
  FakeWorld4 c;  // rank 1 of 4
  std::vector<float> buf(64);
  float* p = buf.data();
  // Legal shapes, in and out of place.
  c.all_gather(p + 4, p, 4, DType::f32, *s);        // in place: send == recv + rank*n
  c.all_gather(p + 48, p, 4, DType::f32, *s);       // disjoint (recv is p[0..16))
  c.reduce_scatter(p, p + 8, 8, DType::f32, *s);    // in place: recv == send + rank*n
  c.reduce_scatter(p, p + 32, 8, DType::bf16, *s);  // 32 bf16 = 16 floats of send, recv after it
  c.all_reduce(p, p, 64, DType::f32, *s);
  c.all_reduce(p, p + 32, 32, DType::f32, *s);
  c.all_reduce(p, p + 32, 3, DType::f16, *s);  // any count: the sum is elementwise
  c.broadcast(p, 64, DType::f32, 3, *s);
  c.barrier(*s);
  EXPECT_EQ(c.calls, 9);
  // Zero counts are no-ops, null pointers allowed.
  c.all_reduce(nullptr, nullptr, 0, DType::f32, *s);
  c.all_gather(nullptr, nullptr, 0, DType::bf16, *s);
  EXPECT_EQ(c.calls, 9);

  expect_invalid([&] { c.all_gather(p + 5, p, 4, DType::f32, *s); }, {"all_gather", "overlaps", "in place", "rank 1"});
  expect_invalid([&] { c.reduce_scatter(p, p + 9, 8, DType::f32, *s); }, {"reduce_scatter", "overlaps"});
  expect_invalid([&] { c.all_reduce(p, p + 1, 8, DType::f32, *s); }, {"all_reduce", "partially overlaps"});
  expect_invalid([&] { c.broadcast(p, 4, DType::f32, 4, *s); }, {"broadcast", "root 4", "[0, 4)"});
  expect_invalid([&] { c.broadcast(p, 4, DType::f32, -1, *s); }, {"root -1"});
  expect_invalid([&] { c.all_reduce(nullptr, p, 4, DType::f32, *s); }, {"send is null"});
  expect_invalid([&] { c.all_gather(p, nullptr, 4, DType::f32, *s); }, {"recv is null"});
  expect_invalid([&] { c.reduce_scatter(p, p + 32, SIZE_MAX / 8, DType::f32, *s); }, {"overflow"});
  expect_invalid([&] { c.all_reduce(p, p, 4, static_cast<DType>(9), *s); }, {"unknown dtype"});
  expect_invalid([&] { c.host_broadcast(p, 8, 7); }, {"host_broadcast", "root 7"});
  expect_invalid([&] { c.host_all_gather(p + 1, p, 8); }, {"host_all_gather", "overlaps"});
  expect_invalid([&] { c.split(-1, 0); }, {"split", "color -1"});
  EXPECT_EQ(c.calls, 9);
}

TEST(CommLaunch, DetectedFromTheEnvironmentOnly) {
  without_launcher([] {
    Launch l = detect_launch();
    EXPECT_FALSE(l.by_launcher);
    EXPECT_EQ(l.world, 1);
    {
      ScopedEnv w("OMPI_COMM_WORLD_SIZE", "4"), r("OMPI_COMM_WORLD_RANK", "3");
      l = detect_launch();
      EXPECT_TRUE(l.by_launcher);
      EXPECT_EQ(l.world, 4);
      EXPECT_EQ(l.rank, 3);
      EXPECT_EQ(l.source, "OMPI_COMM_WORLD_SIZE");
    }
    {
      ScopedEnv r("PMIX_RANK", "2"), w("PMI_SIZE", "8");
      l = detect_launch();
      EXPECT_TRUE(l.by_launcher);
      EXPECT_EQ(l.rank, 2);
      EXPECT_EQ(l.world, 8);
    }
    {
      ScopedEnv r("PMI_RANK", "1");
      l = detect_launch();
      EXPECT_TRUE(l.by_launcher);
      EXPECT_EQ(l.rank, 1);
      EXPECT_EQ(l.source, "PMI_RANK");
    }
  });
}

TEST(CommLaunch, PlainProcessGetsLocalAndNeverInitialisesMpi) {
  without_launcher([] {
    auto comm = make_communicator();
    EXPECT_EQ(comm->backend(), CommBackend::local);
    EXPECT_FALSE(comm_mpi_active());
    auto cuda = make_communicator(kernels::Backend::cuda);  // one rank: local fits any backend
    EXPECT_EQ(cuda->backend(), CommBackend::local);
    EXPECT_FALSE(comm_mpi_active());
  });
}

// A build without NCCL refuses a multi-rank cuda job before touching MPI. (With NCCL such a job
// makes its NCCL communicator over MPI: tests/comm/test_nccl.cpp, on a GPU.)
// A multi-rank cuda job where no GPU is visible (or CUDA was not built) is refused before MPI
// starts, naming the rank and the fix.
TEST(CommLaunch, CudaWithSeveralRanksNeedsAGpu) {
  if (kernels::cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible: a multi-rank cuda job would start";
  without_launcher([] {
    ScopedEnv w("OMPI_COMM_WORLD_SIZE", "2"), r("OMPI_COMM_WORLD_RANK", "1");
    try {
      make_communicator(kernels::Backend::cuda);
      ADD_FAILURE() << "no error";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("no CUDA device is visible"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--backend cpu"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1 of 2"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(comm_mpi_active());
  });
}

TEST(CommFailure, ReportFatalErrorOffMpirunPrintsAndReturns) {
  without_launcher([] {
    testing::internal::CaptureStderr();
    const int code = report_fatal_error("disk full writing /nvme/x", 3);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(code, 3);
    EXPECT_EQ(err, "strata: error: disk full writing /nvme/x\n");
    testing::internal::CaptureStderr();
    EXPECT_EQ(report_fatal_error("x", 0), 1) << "an error never exits 0";
    testing::internal::GetCapturedStderr();
  });
}

TEST(CommFailure, AbortAllNamesTheRankAndExitsNonZero) {
  without_launcher([] {
    EXPECT_EXIT(abort_all(5, "bad shard"), testing::ExitedWithCode(1), "strata: rank 5: error: bad shard");
    ScopedEnv w("OMPI_COMM_WORLD_SIZE", "2"), r("OMPI_COMM_WORLD_RANK", "1");
    // Launched but before MPI started (e.g. a bad flag): still names the rank, still exits.
    EXPECT_EXIT(report_fatal_error("bad --seq", 2), testing::ExitedWithCode(2), "strata: rank 1: error: bad --seq");
  });
}

// --- Failure of one rank in a real job (needs MPI: starts comm_mpi_test under mpirun) --------

namespace {

struct Job {
  int status = -1;         // waitpid status of mpirun
  bool timed_out = false;  // still running after the limit (then killed)
  double seconds = 0;
  std::string output;      // stdout and stderr of every rank and of mpirun
  std::vector<int> pids;   // rank pids, from "comm_mpi_test: rank R pid P" lines
};

bool process_gone(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] == 'Z' || line[paren + 2] == 'X';
}

#ifdef STRATA_COMM_MPI_TEST
// Runs `mpirun -n np comm_mpi_test args...` in its own process group; kills the group if it
// is still running after limit_s (a hang: the test then fails, leaving nothing behind).
Job run_job(int np, const std::vector<std::string>& args, double limit_s) {
  Job job;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    ::setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    std::vector<std::string> argv_s = {STRATA_MPIEXEC, STRATA_MPIEXEC_NUMPROC_FLAG, std::to_string(np), STRATA_COMM_MPI_TEST};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(fds[1]);
  const auto deadline = t0 + std::chrono::duration<double>(limit_s);
  bool eof = false, exited = false;
  while (!(eof && exited)) {
    if (!exited && ::waitpid(pid, &job.status, WNOHANG) == pid) exited = true;
    if (std::chrono::steady_clock::now() > deadline) {
      job.timed_out = !exited;
      ::kill(-pid, SIGKILL);
      if (!exited) ::waitpid(pid, &job.status, 0);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (!eof && ::poll(&p, 1, 50) > 0) {
      char buf[4096];
      const ssize_t n = ::read(fds[0], buf, sizeof buf);
      if (n > 0) job.output.append(buf, static_cast<size_t>(n));
      else eof = true;
    } else if (eof) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ::close(fds[0]);
  job.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::istringstream lines(job.output);
  for (std::string line; std::getline(lines, line);) {
    int r = 0, p = 0;
    if (std::sscanf(line.c_str(), "comm_mpi_test: rank %d pid %d", &r, &p) == 2) job.pids.push_back(p);
  }
  if (job.timed_out)
    for (int p : job.pids) ::kill(p, SIGKILL);  // in case a rank left mpirun's process group
  return job;
}
#endif

// Every rank gone, mpirun non-zero, within 30 s of the start (start-up included).
void expect_job_stopped(const Job& job, int np) {
  EXPECT_FALSE(job.timed_out) << "the job hung:\n" << job.output;
  EXPECT_LT(job.seconds, 30.0) << job.output;
  EXPECT_FALSE(WIFEXITED(job.status) && WEXITSTATUS(job.status) == 0) << "mpirun exited 0:\n" << job.output;
  EXPECT_EQ(job.pids.size(), static_cast<size_t>(np)) << job.output;
  for (int pid : job.pids) EXPECT_TRUE(process_gone(pid)) << "rank pid " << pid << " still running";
}

}  // namespace

class CommFailure2Ranks : public ::testing::Test {
 protected:
  void SetUp() override {
#ifndef STRATA_COMM_MPI_TEST
    GTEST_SKIP() << "strata was built without MPI (or mpirun was not found): no multi-rank job to fail";
#endif
  }
  Job run(const std::vector<std::string>& args) {
#ifdef STRATA_COMM_MPI_TEST
    return run_job(2, args, 60);
#else
    (void)args;
    return {};
#endif
  }
};

TEST_F(CommFailure2Ranks, BadInputOnOneRankStopsEveryRank) {
  const Job job = run({"throw-host", "0"});  // rank 0 passes overlapping buffers at iteration 3
  expect_job_stopped(job, 2);
  EXPECT_NE(job.output.find("strata: rank 0: error: all_reduce: send"), std::string::npos) << job.output;
  std::cerr << "[ job took " << job.seconds << " s ]\n";
}

TEST_F(CommFailure2Ranks, AsyncErrorOnOneRanksStreamStopsEveryRank) {
  const Job job = run({"throw-stream", "1"});  // a "disk full" thrown on rank 1's stream
  expect_job_stopped(job, 2);
  EXPECT_NE(job.output.find("strata: rank 1: error: write /nvme/strata/swap.0 at offset 4096: No space left on device"),
            std::string::npos)
      << job.output;
  std::cerr << "[ job took " << job.seconds << " s ]\n";
}

TEST_F(CommFailure2Ranks, RankKilledMidCollectiveStopsEveryRank) {
  const Job job = run({"kill", "1"});  // rank 1 SIGKILLs itself while both loop over all_reduce
  expect_job_stopped(job, 2);
  EXPECT_TRUE(WIFSIGNALED(job.status) || (WIFEXITED(job.status) && WEXITSTATUS(job.status) != 0));
  std::cerr << "[ job took " << job.seconds << " s ]\n";
}
