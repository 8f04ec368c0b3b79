// The CUDA runtime through the public interface: memory, copies, stream order, events across
// streams, host functions. Skips (with the reason) where no CUDA device is visible.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <vector>

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

TEST(CudaRuntime, OversizedAllocationIsAClearError) {
  auto rt = cuda_or_skip();
  if (!rt) GTEST_SKIP() << "no CUDA device visible (or built without CUDA)";
  try {
    rt->alloc_device(rt->info().total_bytes * 4);
    FAIL() << "allocating 4x the device memory succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaMalloc"), std::string::npos) << e.what();
  }
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
