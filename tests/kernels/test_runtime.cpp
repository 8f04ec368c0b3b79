// The CPU runtime: streams run in order and asynchronously, events order streams, async
// errors surface at synchronize, allocations are aligned.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels/runtime.h"

using namespace strata::kernels;

TEST(CpuRuntime, InfoAndAlignedAllocations) {
  auto rt = make_runtime(Backend::cpu);
  EXPECT_EQ(rt->info().backend, Backend::cpu);
  EXPECT_GT(rt->info().total_bytes, 0u);
  EXPECT_GE(rt->info().n_threads, 1);
  DeviceBuffer d(*rt, 12345);
  PinnedBuffer p(*rt, 5 << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(d.data()) % 4096, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data()) % 4096, 0u);
  std::memset(p.data(), 1, p.bytes());
}

TEST(CpuRuntime, StreamRunsInOrderAndAsynchronously) {
  auto rt = make_runtime(Backend::cpu);
  auto s = rt->create_stream();
  std::atomic<bool> gate{false};
  std::vector<int> order;
  s->host_fn([&] {
    while (!gate.load()) std::this_thread::yield();
    order.push_back(1);
  });
  for (int i = 2; i <= 50; ++i) s->host_fn([&order, i] { order.push_back(i); });
  EXPECT_TRUE(order.empty());  // enqueue returned while the first task was blocked
  gate = true;
  s->synchronize();
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i + 1);
}

TEST(CpuRuntime, CopiesAndMemsetInStreamOrder) {
  auto rt = make_runtime(Backend::cpu);
  auto s = rt->create_stream();
  DeviceBuffer a(*rt, 1 << 20), b(*rt, 1 << 20);
  s->memset_async(a.data(), 7, a.bytes());
  s->memcpy_async(b.data(), a.data(), a.bytes());
  s->synchronize();
  for (size_t i = 0; i < b.bytes(); i += 4099) ASSERT_EQ(b.as<unsigned char>()[i], 7);
}

TEST(CpuRuntime, EventsOrderTwoStreams) {
  auto rt = make_runtime(Backend::cpu);
  auto producer = rt->create_stream(), consumer = rt->create_stream();
  auto ev = rt->create_event();
  EXPECT_TRUE(ev->query());  // never recorded
  std::mt19937 rng(7);
  for (int iter = 0; iter < 200; ++iter) {
    std::atomic<int> value{0};
    int seen = -1;
    int delay_us = static_cast<int>(rng() % 200);
    producer->host_fn([&, delay_us] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      value = iter + 1;
    });
    producer->record(*ev);
    consumer->wait(*ev);
    consumer->host_fn([&] { seen = value.load(); });
    consumer->synchronize();
    ASSERT_EQ(seen, iter + 1) << "consumer ran before the producer's recorded work";
    ev->synchronize();
    EXPECT_TRUE(ev->query());
  }
}

TEST(CpuRuntime, EventQueryReflectsProgress) {
  auto rt = make_runtime(Backend::cpu);
  auto s = rt->create_stream();
  auto ev = rt->create_event();
  std::atomic<bool> gate{false};
  s->host_fn([&] { while (!gate.load()) std::this_thread::yield(); });
  s->record(*ev);
  EXPECT_FALSE(ev->query());
  gate = true;
  ev->synchronize();
  EXPECT_TRUE(ev->query());
}

TEST(CpuRuntime, AsyncErrorSurfacesAtSynchronizeAndSkipsLaterWork) {
  auto rt = make_runtime(Backend::cpu);
  auto s = rt->create_stream();
  auto ev = rt->create_event();
  bool later_ran = false;
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
  EXPECT_FALSE(later_ran);
  // The error is reported once; the stream is usable again afterwards.
  bool ran = false;
  s->host_fn([&] { ran = true; });
  s->synchronize();
  EXPECT_TRUE(ran);
}

TEST(CpuRuntime, ErrorPropagatesAcrossAnEventWait) {
  auto rt = make_runtime(Backend::cpu);
  auto a = rt->create_stream(), b = rt->create_stream();
  auto ev = rt->create_event();
  a->host_fn([] { throw std::runtime_error("upstream failed"); });
  a->record(*ev);
  bool dependent_ran = false;
  b->wait(*ev);
  b->host_fn([&] { dependent_ran = true; });
  EXPECT_THROW(b->synchronize(), std::runtime_error);
  EXPECT_FALSE(dependent_ran);
  EXPECT_THROW(a->synchronize(), std::runtime_error);
}

TEST(CpuRuntime, BackendParsingAndCudaAbsence) {
  EXPECT_EQ(parse_backend("cpu"), Backend::cpu);
  EXPECT_THROW(parse_backend("tpu"), std::invalid_argument);
  if (!cuda_available()) {
    EXPECT_THROW(make_runtime(Backend::cuda), std::runtime_error);
  }
}

// An event is recorded only on a stream of the Runtime object that made it (a second CPU
// runtime is another runtime, as the optimizer's is next to a CUDA one); any stream may wait on it.
TEST(CpuRuntime, EventsAreRecordedOnlyOnTheirRuntimesStreams) {
  auto a = make_runtime(Backend::cpu), b = make_runtime(Backend::cpu);
  auto sa = a->create_stream(), sb = b->create_stream();
  auto eb = b->create_event();
  EXPECT_EQ(&sa->runtime(), a.get());
  EXPECT_EQ(&eb->runtime(), b.get());
  EXPECT_THROW(sa->record(*eb), std::invalid_argument);
  bool first = false, second = false;
  sb->host_fn([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    first = true;
  });
  sb->record(*eb);
  sa->wait(*eb);
  sa->host_fn([&] { second = first; });
  sa->synchronize();
  EXPECT_TRUE(second);
}
