// The nccl communicator where a GPU is present. One GPU runs a world of one rank (NCCL refuses
// two ranks on one device) over a local control plane: its collectives on device buffers and on
// host buffers (staged through device memory), in fp32 and bf16, and a split. Skipped without a
// GPU or without NCCL; a multi-rank NCCL job needs a machine with several GPUs.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/runtime.h"
#include "src/comm/comm_internal.h"
#include "src/comm/communicator.h"

using namespace strata;
using kernels::DType;

namespace {

struct NcclWorld {
  std::unique_ptr<kernels::Runtime> rt = kernels::make_runtime(kernels::Backend::cuda);
  std::unique_ptr<kernels::Stream> s = rt->create_stream();
  std::unique_ptr<Communicator> comm = comm_detail::make_nccl(make_local_communicator(), CommOptions{});
};

#define STRATA_SKIP_WITHOUT_NCCL_GPU()                                                                       \
  do {                                                                                                       \
    if (!comm_detail::nccl_built()) GTEST_SKIP() << "strata was built without NCCL (needs the CUDA toolkit)"; \
    if (!kernels::cuda_available()) GTEST_SKIP() << "no CUDA device visible: the NCCL tests run on a GPU machine"; \
  } while (0)

// A world of one: every reduction is its input (the rank-order sum of one contribution, rounded
// once: itself), a gather and a broadcast copy it; on device buffers and on host ones.
TEST(NcclComm, OneRankCollectivesOnDeviceAndHostBuffers) {
  STRATA_SKIP_WITHOUT_NCCL_GPU();
  NcclWorld w;
  Communicator& c = *w.comm;
  EXPECT_EQ(c.backend(), CommBackend::nccl);
  EXPECT_EQ(c.world(), 1);
  for (DType t : {DType::f32, DType::bf16}) {
    const size_t n = 100003, es = kernels::dtype_size(t);
    std::vector<uint8_t> in(n * es), out(n * es, 0);
    for (size_t i = 0; i < n; ++i) kernels::store_from_f32(in.data(), t, i, static_cast<float>(i % 977) * 0.25f - 3.f);
    kernels::DeviceBuffer din(*w.rt, n * es), dout(*w.rt, n * es);
    w.s->memcpy_async(din.data(), in.data(), in.size());
    const auto back = [&](const void* d) {
      std::fill(out.begin(), out.end(), 0);
      w.s->memcpy_async(out.data(), d, out.size());
      w.s->synchronize();
      return std::memcmp(out.data(), in.data(), in.size()) == 0;
    };
    c.all_reduce(din.data(), dout.data(), n, t, *w.s);
    EXPECT_TRUE(back(dout.data())) << "all_reduce";
    c.reduce_scatter(din.data(), dout.data(), n, t, *w.s);
    EXPECT_TRUE(back(dout.data())) << "reduce_scatter";
    c.all_gather(din.data(), dout.data(), n, t, *w.s);
    EXPECT_TRUE(back(dout.data())) << "all_gather";
    c.broadcast(dout.data(), n, t, 0, *w.s);
    EXPECT_TRUE(back(dout.data())) << "broadcast";
    // Host buffers (a save's gathers) go through device memory.
    std::vector<uint8_t> host_out(n * es, 0);
    c.all_reduce(in.data(), host_out.data(), n, t, *w.s);
    w.s->synchronize();
    EXPECT_EQ(std::memcmp(host_out.data(), in.data(), in.size()), 0) << "all_reduce of host buffers";
    std::vector<uint8_t> inplace = in;
    c.all_reduce(inplace.data(), inplace.data(), n, t, *w.s);
    c.all_gather(in.data(), host_out.data(), n, t, *w.s);
    w.s->synchronize();
    EXPECT_EQ(std::memcmp(inplace.data(), in.data(), in.size()), 0) << "in-place all_reduce of a host buffer";
    EXPECT_EQ(std::memcmp(host_out.data(), in.data(), in.size()), 0) << "all_gather of host buffers";
  }
  c.barrier(*w.s);
  w.s->synchronize();
}

// A split gives a working communicator of the group (ncclCommSplit beside the control plane's).
TEST(NcclComm, SplitMakesAWorkingGroup) {
  STRATA_SKIP_WITHOUT_NCCL_GPU();
  NcclWorld w;
  std::unique_ptr<Communicator> g = w.comm->split(0, 0);
  EXPECT_EQ(g->backend(), CommBackend::nccl);
  EXPECT_EQ(g->world(), 1);
  std::vector<float> x(4096);
  std::iota(x.begin(), x.end(), 1.f);
  kernels::DeviceBuffer d(*w.rt, x.size() * 4);
  w.s->memcpy_async(d.data(), x.data(), x.size() * 4);
  g->all_reduce(d.data(), d.data(), x.size(), DType::f32, *w.s);
  std::vector<float> y(x.size());
  w.s->memcpy_async(y.data(), d.data(), y.size() * 4);
  w.s->synchronize();
  EXPECT_EQ(y, x);
  EXPECT_EQ(g->sent_bytes(), 0u);  // (one rank sends nothing)
}

}  // namespace
