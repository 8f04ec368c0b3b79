// The CUDA runtime through the public interface: memory, copies, stream order, events across
// streams, host functions. Skips (with the reason) where no CUDA device is visible.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/ops.h"
#include "kernels/runtime.h"

using namespace strata::kernels;

namespace {
std::unique_ptr<Runtime> cuda_or_skip() {
  if (!cuda_available()) return nullptr;
  return make_runtime(Backend::cuda);
}
}  // namespace

TEST(CudaRuntime, CopiesRoundTripThroughDeviceMemory) {
  auto rt = cuda_or_skip();
  if (!rt) GTEST_SKIP() << "no CUDA device visible (or built without CUDA)";
  EXPECT_EQ(rt->info().backend, Backend::cuda);
  const size_t n = 3u << 20;
  PinnedBuffer src(*rt, n), dst(*rt, n);
  DeviceBuffer dev(*rt, n);
  for (size_t i = 0; i < n; ++i) src.as<unsigned char>()[i] = static_cast<unsigned char>(i * 7 + 3);
  auto s = rt->create_stream();
  s->memcpy_async(dev.data(), src.data(), n);
  s->memset_async(dst.data(), 0, n);
  s->memcpy_async(dst.data(), dev.data(), n);
  s->synchronize();
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0);
}

TEST(CudaRuntime, EventsOrderTwoStreamsAndHostFunctionsRunInOrder) {
  auto rt = cuda_or_skip();
  if (!rt) GTEST_SKIP() << "no CUDA device visible (or built without CUDA)";
  const size_t n = 64u << 20;
  PinnedBuffer host(*rt, n), back(*rt, n);
  DeviceBuffer a(*rt, n), b(*rt, n);
  std::memset(host.data(), 0x5a, n);
  auto producer = rt->create_stream(), consumer = rt->create_stream();
  auto ev = rt->create_event();
  producer->memcpy_async(a.data(), host.data(), n);
  producer->record(*ev);
  consumer->wait(*ev);
  consumer->memcpy_async(b.data(), a.data(), n);
  consumer->memcpy_async(back.data(), b.data(), n);
  std::atomic<int> order{0};
  int seen_first = -1, seen_second = -1;
  consumer->host_fn([&] { seen_first = order++; });
  consumer->host_fn([&] { seen_second = order++; });
  consumer->synchronize();
  EXPECT_TRUE(ev->query());
  EXPECT_EQ(back.as<unsigned char>()[n - 1], 0x5a);
  EXPECT_EQ(back.as<unsigned char>()[0], 0x5a);
  EXPECT_EQ(seen_first, 0);
  EXPECT_EQ(seen_second, 1);
}

// A large pinned buffer (faulted in by every core, then registered with CUDA) copies to and from
// the device like a small one (cudaHostAlloc), and frees.
TEST(CudaRuntime, LargePinnedBuffersRoundTrip) {
  auto rt = cuda_or_skip();
  if (!rt) GTEST_SKIP() << "no CUDA device visible (or built without CUDA)";
  const size_t n = size_t{300} << 20;
  for (int round = 0; round < 2; ++round) {
    PinnedBuffer src(*rt, n), dst(*rt, n);
    DeviceBuffer dev(*rt, n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(src.data()) % 4096, 0u);
    EXPECT_EQ(src.as<unsigned char>()[n - 1], 0);  // zeroed
    for (size_t i = 0; i < n; i += 4093) src.as<unsigned char>()[i] = static_cast<unsigned char>(i / 4093 + round);
    auto s = rt->create_stream();
    s->memcpy_async(dev.data(), src.data(), n);
    s->memcpy_async(dst.data(), dev.data(), n);
    s->synchronize();
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0);
  }
}

TEST(CudaRuntime, OversizedAllocationIsAClearError) {
  auto rt = cuda_or_skip();
  if (!rt) GTEST_SKIP() << "no CUDA device visible (or built without CUDA)";
  try {
    rt->alloc_device(rt->info().total_bytes * 4);
    FAIL() << "allocating 4x the device memory succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaMalloc"), std::string::npos) << e.what();
  }
  // The failure is not left behind for the next kernel's launch check (the first GPU run saw an
  // attention test fail with this allocation's "out of memory").
  DeviceBuffer x(*rt, 1024 * sizeof(float));
  auto s = rt->create_stream();
  ScaleArgs a;
  a.n = 1024, a.x = x.data(), a.s = 2.f;
  EXPECT_NO_THROW(rt->ops().scale(*s, a));
  EXPECT_NO_THROW(s->synchronize());
}

// A host function that throws does not terminate the process: the stream's synchronize (and an
// event recorded after it) rethrow it, later host functions are skipped, and the stream works
// again afterwards (as on the CPU backend).
TEST(CudaRuntime, HostFunctionErrorSurfacesAtSynchronize) {
  auto rt = cuda_or_skip();
  if (!rt) GTEST_SKIP() << "no CUDA device visible (or built without CUDA)";
  auto s = rt->create_stream();
  auto ev = rt->create_event();
  std::atomic<bool> later_ran{false};
  s->host_fn([] { throw std::runtime_error("disk on fire"); });
  s->host_fn([&] { later_ran = true; });
  s->record(*ev);
  EXPECT_THROW(ev->synchronize(), std::runtime_error);
  try {
    s->synchronize();
    FAIL() << "synchronize did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "disk on fire");
  }
  EXPECT_FALSE(later_ran.load());
  std::atomic<bool> ran{false};
  s->host_fn([&] { ran = true; });
  s->synchronize();
  EXPECT_TRUE(ran.load());
}

// Cross-runtime ordering: a CUDA stream waits on CPU-stream work (a flag the CPU worker writes,
// waited on by the GPU) and a CPU stream on CUDA work; a producer's error is adopted by the
// waiting stream; more waits in flight than the flag page has slots still complete.
TEST(CudaRuntime, StreamsWaitOnTheOtherRuntimesEvents) {
  auto rt = cuda_or_skip();
  if (!rt) GTEST_SKIP() << "no CUDA device visible (or built without CUDA)";
  auto cpu_rt = make_runtime(Backend::cpu);
  auto cs = cpu_rt->create_stream();
  auto ce = cpu_rt->create_event();
  auto gs = rt->create_stream();
  auto ge = rt->create_event();
  const size_t n = 1u << 20;
  PinnedBuffer host(*rt, n), back(*rt, n);
  DeviceBuffer dev(*rt, n);
  std::memset(host.data(), 0, n);
  std::memset(back.data(), 0, n);

  // CPU -> CUDA: the copy must not start before the (slow) CPU task has filled `host`.
  cs->host_fn([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::memset(host.data(), 0x7b, n);
  });
  cs->record(*ce);
  gs->wait(*ce);
  gs->memcpy_async(dev.data(), host.data(), n);
  gs->memcpy_async(back.data(), dev.data(), n);
  gs->synchronize();
  EXPECT_EQ(back.as<unsigned char>()[0], 0x7b);
  EXPECT_EQ(back.as<unsigned char>()[n - 1], 0x7b);

  // CUDA -> CPU: the CPU task must see what the GPU wrote.
  gs->memset_async(dev.data(), 0x21, n);
  gs->memcpy_async(back.data(), dev.data(), n);
  gs->record(*ge);
  cs->wait(*ge);
  int seen = -1;
  cs->host_fn([&] { seen = back.as<unsigned char>()[n - 1]; });
  cs->synchronize();
  EXPECT_EQ(seen, 0x21);

  // More outstanding waits than flag slots (256), each on a fresh CPU record.
  for (int i = 0; i < 600; ++i) {
    cs->host_fn([] {});
    cs->record(*ce);
    gs->wait(*ce);
  }
  gs->memset_async(dev.data(), 0x33, 16);
  gs->synchronize();
  cs->synchronize();

  // A failed CPU producer: the CUDA stream that waited on it rethrows at its synchronize.
  cs->host_fn([] { throw std::runtime_error("cpu producer failed"); });
  cs->record(*ce);
  gs->wait(*ce);
  EXPECT_THROW(gs->synchronize(), std::runtime_error);
  EXPECT_THROW(cs->synchronize(), std::runtime_error);
  gs->synchronize();  // both streams work again
  cs->synchronize();
}

// Recording one event over and over reuses pooled CUDA events; waits see the latest record.
TEST(CudaRuntime, ManyRecordsOfOneEvent) {
  auto rt = cuda_or_skip();
  if (!rt) GTEST_SKIP() << "no CUDA device visible (or built without CUDA)";
  auto a = rt->create_stream(), b = rt->create_stream();
  auto ev = rt->create_event();
  DeviceBuffer buf(*rt, 4096);
  for (int i = 0; i < 10000; ++i) {
    a->memset_async(buf.data(), i & 0xff, 4096);
    a->record(*ev);
    b->wait(*ev);
  }
  unsigned char last = 0;
  b->memcpy_async(&last, buf.data(), 1);
  b->synchronize();
  EXPECT_EQ(last, 9999 & 0xff);
  ev->synchronize();
  EXPECT_TRUE(ev->query());
}
