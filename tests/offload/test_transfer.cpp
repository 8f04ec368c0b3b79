// The transfer engine's ordering rules (DESIGN.md "Nothing blocks inside a stream"): a copy
// whose inputs are still host work (an NVMe read) never stalls its copy stream for the copies
// behind it; a quiet fence of a stream event orders a stream without the host; events are
// pooled; a device<->NVMe move waiting for its inputs never holds up host<->NVMe moves.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "kernels/runtime.h"
#include "offload/fence.h"
#include "offload/transfer.h"
#include "tests/offload/offload_test_util.h"

namespace strata::offload {
namespace {

using testing::MemStore;

struct Buffers {
  explicit Buffers(kernels::Runtime& rt) : dev(rt, 4 * kAlign), host(rt, 4 * kAlign) {}
  kernels::DeviceBuffer dev;
  kernels::PinnedBuffer host;
  char* d(int i) const { return dev.as<char>() + i * kAlign; }
  char* h(int i) const { return host.as<char>() + i * kAlign; }
};

bool eventually(const std::function<bool()>& pred, double seconds = 5) {
  const auto t0 = std::chrono::steady_clock::now();
  while (!pred()) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(seconds)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A copy whose input is an unfinished host signal is issued later by a lane: the copy stream
// is free meanwhile, so an independent copy behind it completes first; once the signal is set,
// the first copy lands too.
TEST(Transfer, CopyWaitingOnHostWorkDoesNotStallItsStream) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  TransferEngine te(*rt, nullptr);
  Buffers b(*rt);
  std::memset(b.h(0), 1, kAlign);
  std::memset(b.h(1), 2, kAlign);
  auto input = std::make_shared<Signal>();
  const auto t0 = std::chrono::steady_clock::now();
  Fence first = te.move({Tier::host, b.h(0)}, {Tier::device, b.d(0)}, kAlign, Fence(input));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));  // the caller did not wait
  EXPECT_FALSE(first.host_ready());
  Fence second = te.move({Tier::host, b.h(1)}, {Tier::device, b.d(1)}, kAlign, Fence());
  EXPECT_TRUE(eventually([&] { return second.ready(); })) << "the copy stream is blocked by a host wait";
  EXPECT_EQ(b.d(1)[0], 2);
  EXPECT_FALSE(first.ready());
  input->set();
  first.wait();
  EXPECT_EQ(b.d(0)[0], 1);
  // A failed input fails the copy, and the bytes are not copied.
  auto bad = std::make_shared<Signal>();
  std::memset(b.h(2), 3, kAlign);
  std::memset(b.d(2), 0, kAlign);
  Fence third = te.move({Tier::host, b.h(2)}, {Tier::device, b.d(2)}, kAlign, Fence(bad));
  bad->set(std::make_exception_ptr(std::runtime_error("input failed")));
  EXPECT_THROW(third.wait(), std::runtime_error);
  te.drain();
  EXPECT_EQ(b.d(2)[0], 0);
}

// quiet() of a stream event is still a stream event: a stream waits on it by itself (the host
// side is ready at once), and the wait holds that stream until the event's work is done.
TEST(Transfer, QuietEventFenceOrdersAStreamWithoutTheHost) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  auto producer = rt->create_stream(), consumer = rt->create_stream();
  std::atomic<bool> release{false}, consumed{false};
  producer->host_fn([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  auto ev = std::make_shared<EventPart>(rt->create_event());
  producer->record(ev->event());
  const Fence quiet = Fence(ev).quiet();
  EXPECT_TRUE(quiet.host_ready());
  const auto t0 = std::chrono::steady_clock::now();
  quiet.enqueue_wait(*consumer);  // must not wait on this thread
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  consumer->host_fn([&] { consumed = true; });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(consumed) << "the consumer ran before the event it waits for";
  release = true;
  consumer->synchronize();
  EXPECT_TRUE(consumed);
}

// Copies take their events from a pool: a thousand moves create only a handful of events.
TEST(Transfer, EventsArePooled) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  TransferEngine te(*rt, nullptr);
  Buffers b(*rt);
  for (int i = 0; i < 1000; ++i) te.move({Tier::host, b.h(0)}, {Tier::device, b.d(0)}, kAlign, Fence()).wait();
  EXPECT_LE(te.events().size(), 4u);
}

// A device->NVMe move waiting for its input occupies only its own lane: host->NVMe moves
// issued after it complete meanwhile.
TEST(Transfer, DeviceNvmeMoveDoesNotHoldUpHostNvmeMoves) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  MemStore store(16 * kAlign);
  TransferConfig cfg;
  cfg.staging_bytes = kAlign;
  cfg.n_staging = 2;
  TransferEngine te(*rt, &store, cfg);
  Buffers b(*rt);
  auto input = std::make_shared<Signal>();
  Place nvme0{Tier::nvme}, nvme1{Tier::nvme};
  nvme1.nvme_offset = 8 * kAlign;
  Fence staged = te.move({Tier::device, b.d(0)}, nvme0, 3 * kAlign, Fence(input));
  std::memset(b.h(1), 7, kAlign);
  // A host->NVMe move with a pending input of its own goes through the submit lane too.
  auto other = std::make_shared<Signal>();
  Fence direct = te.move({Tier::host, b.h(1)}, nvme1, kAlign, Fence(other));
  other->set();
  EXPECT_TRUE(eventually([&] { return direct.ready(); })) << "host->NVMe queued behind a device->NVMe move";
  EXPECT_FALSE(staged.ready());
  input->set();
  staged.wait();
  te.drain();
}

// device -> NVMe -> device through several staging chunks, with the chunk count not a multiple
// of the pool: the bytes survive the round trip.
TEST(Transfer, DeviceNvmeRoundTripThroughManyChunks) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  MemStore store(64 * kAlign);
  TransferConfig cfg;
  cfg.staging_bytes = kAlign;
  cfg.n_staging = 3;
  TransferEngine te(*rt, &store, cfg);
  kernels::DeviceBuffer src(*rt, 11 * kAlign), dst(*rt, 11 * kAlign);
  testing::fill_pattern(src.data(), 11 * kAlign - 100, 5, 1);
  Fence w = te.move({Tier::device, src.data()}, {Tier::nvme}, 11 * kAlign - 100, Fence());
  Fence r = te.move({Tier::nvme}, {Tier::device, dst.data()}, 11 * kAlign - 100, w);
  r.wait();
  EXPECT_EQ(testing::checksum(dst.data(), 11 * kAlign - 100), testing::checksum(src.data(), 11 * kAlign - 100));
}

}  // namespace
}  // namespace strata::offload
