// The NVMe tier: random schedules with blocks homed on NVMe (host<->NVMe through the store,
// device<->NVMe staged through small pinned buffers), I/O errors reaching the waiting acquire,
// and the production store over io/'s SwapSpace and IoEngine.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "io/engine.h"
#include "io/errors.h"
#include "io/swap_space.h"
#include "kernels/runtime.h"
#include "offload/manager.h"
#include "offload/planner.h"
#include "offload_test_util.h"

using namespace strata::offload;
using namespace strata::offload::testing;
namespace kernels = strata::kernels;
namespace io = strata::io;

namespace {

ManagerConfig small_staging(uint64_t device_bytes, uint64_t host_bytes) {
  ManagerConfig cfg;
  cfg.device_bytes = device_bytes;
  cfg.host_bytes = host_bytes;
  cfg.transfer.staging_bytes = 2 * kAlign;  // blocks span several chunks: the pipeline runs
  cfg.transfer.n_staging = 2;
  return cfg;
}

// Two NVMe-homed blocks and room for one on host: every acquire reads from NVMe.
struct Thrash {
  std::unique_ptr<kernels::Runtime> rt = kernels::make_runtime(kernels::Backend::cpu);
  std::unique_ptr<BlockManager> mgr;
  std::vector<uint64_t> versions{0, 0};
  explicit Thrash(std::unique_ptr<NvmeStore> store) {
    mgr = std::make_unique<BlockManager>(*rt, small_staging(3 * kAlign, 3 * kAlign), std::move(store));
    mgr->add_block("a", 3 * kAlign - 100, Tier::nvme);
    mgr->add_block("b", 3 * kAlign, Tier::nvme);
    init_blocks(*mgr, versions);
  }
};

}  // namespace

TEST(Nvme, RandomSchedulesWithBlocksHomedOnNvme) {
  auto rt = kernels::make_runtime(kernels::Backend::cpu);
  std::mt19937_64 rng(99);
  for (int iter = 0; iter < 25; ++iter) {
    size_t n = 2 + rng() % 7;
    std::vector<BlockSpec> blocks;
    uint64_t nvme_bytes = 0;
    for (size_t i = 0; i < n; ++i) {
      Tier home = rng() % 3 ? Tier::nvme : Tier::host;
      std::string name = "p";
      name += std::to_string(i);
      blocks.push_back({name, 1 + rng() % (10 * kAlign), home});
      if (home == Tier::nvme) nvme_bytes += align_up(blocks.back().bytes);
    }
    Schedule s = random_schedule(rng, n, 20 + rng() % 40, 1 + static_cast<int>(rng() % 3));
    Residency r({1ull << 30, 1ull << 30, nvme_bytes + kAlign});
    for (const auto& b : blocks) r.add_block(b);
    uint64_t dev = min_budget(r, s, Tier::device);
    uint64_t host = min_budget(r.cold({dev, 1ull << 30, nvme_bytes + kAlign}), s, Tier::host);
    uint64_t host_homes = 0, largest = 0;  // init_blocks writes NVMe-homed blocks through host
    for (const auto& b : blocks) {
      if (b.home == Tier::host) host_homes += align_up(b.bytes);
      if (b.home == Tier::nvme) largest = std::max(largest, align_up(b.bytes));
    }
    host = std::max(host, host_homes + largest);
    BlockManager mgr(*rt, small_staging(dev, host), std::make_unique<MemStore>(nvme_bytes + kAlign));
    for (const auto& b : blocks) mgr.add_block(b.name, b.bytes, b.home);
    std::vector<uint64_t> versions(n, 0);
    init_blocks(mgr, versions);
    mgr.set_schedule(s);
    for (int step = 0; step < 3; ++step) {
      run_step(mgr, s, versions);
      if (::testing::Test::HasFatalFailure()) return;
    }
    OffloadStats st = mgr.stats();
    EXPECT_LE(st.tiers[0].bytes_peak, dev);
    EXPECT_LE(st.tiers[1].bytes_peak, host);
  }
}

TEST(Nvme, ReadErrorReachesTheWaitingAcquire) {
  auto store = std::make_unique<MemStore>(8 * kAlign);
  MemStore* raw = store.get();
  Thrash t(std::move(store));
  // Both versions are on NVMe after this step (each acquire evicts the other).
  Schedule s;
  s.use(0, Tier::host, Mode::read);
  s.use(1, Tier::host, Mode::read);
  for (int step = 0; step < 2; ++step) run_step(*t.mgr, s, t.versions);
  raw->fail_reads_at(t.mgr->residency().copy(1, Tier::nvme).offset);
  t.mgr->begin_step();
  Handle a = t.mgr->acquire(0, Tier::host, Mode::read);
  a.wait();
  t.mgr->release(a);
  Handle b = t.mgr->acquire(1, Tier::host, Mode::read);
  try {
    b.wait();
    FAIL() << "a failed NVMe read was not reported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("injected EIO"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("offset " + std::to_string(t.mgr->residency().copy(1, Tier::nvme).offset)),
              std::string::npos)
        << e.what();
  }
  t.mgr->release(b);
  t.mgr->end_step();
}

// The device copy is loaded from a host copy that is itself still arriving from NVMe: the copy
// stream waits for it, and the NVMe error reaches the device acquire through the fences.
TEST(Nvme, ReadErrorFlowsThroughAHostCopyToTheDevice) {
  auto store = std::make_unique<MemStore>(8 * kAlign);
  MemStore* raw = store.get();
  Thrash t(std::move(store));
  Schedule s;
  s.use(0, Tier::host, Mode::read);
  s.use(1, Tier::host, Mode::read);
  for (int step = 0; step < 2; ++step) run_step(*t.mgr, s, t.versions);
  raw->fail_reads_at(t.mgr->residency().copy(1, Tier::nvme).offset);
  t.mgr->begin_step();
  Handle h = t.mgr->acquire(1, Tier::host, Mode::read);
  Handle d = t.mgr->acquire(1, Tier::device, Mode::read);
  for (Handle* x : {&d, &h}) {
    try {
      x->wait();
      FAIL() << "a failed NVMe read was not reported";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("injected EIO"), std::string::npos) << e.what();
    }
  }
  t.mgr->release(d);
  t.mgr->release(h);
  t.mgr->end_step();
}

TEST(Nvme, ReadErrorReachesADeviceAcquireThroughStaging) {
  auto store = std::make_unique<MemStore>(8 * kAlign);
  MemStore* raw = store.get();
  Thrash t(std::move(store));
  Schedule s;
  s.use(0, Tier::device, Mode::read);
  s.use(1, Tier::device, Mode::read);
  s.use(0, Tier::host, Mode::read);
  s.use(1, Tier::host, Mode::read);
  for (int step = 0; step < 2; ++step) run_step(*t.mgr, s, t.versions);
  // Staging chunks are 2·kAlign: fail the second one, after the first has already been copied.
  const uint64_t second_chunk = t.mgr->residency().copy(0, Tier::nvme).offset + 2 * kAlign;
  raw->fail_reads_at(second_chunk);
  t.mgr->begin_step();
  Handle a = t.mgr->acquire(0, Tier::device, Mode::read);
  try {
    a.wait();
    FAIL() << "a failed NVMe read of the second staging chunk was not reported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("injected EIO reading " + std::to_string(kAlign) + " bytes at offset " +
                                         std::to_string(second_chunk)),
              std::string::npos)
        << e.what();
  }
  t.mgr->release(a);
  t.mgr->end_step();
}

// A failed write-back leaves the NVMe copy bad: the next acquire that needs it gets the error,
// never stale bytes.
TEST(Nvme, WriteBackErrorReachesTheNextAcquire) {
  auto store = std::make_unique<MemStore>(8 * kAlign);
  MemStore* raw = store.get();
  Thrash t(std::move(store));
  raw->fail_writes_at(t.mgr->residency().copy(0, Tier::nvme).offset);
  t.mgr->begin_step();
  Handle a = t.mgr->acquire(0, Tier::host, Mode::read_write);  // dirty on host
  a.wait();
  t.mgr->release(a);
  Handle b = t.mgr->acquire(1, Tier::host, Mode::read);  // evicts a: its write-back fails
  b.wait();
  t.mgr->release(b);
  Handle again = t.mgr->acquire(0, Tier::host, Mode::read);  // must come from NVMe: fails
  try {
    again.wait();
    FAIL() << "read bytes whose write-back had failed";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("injected EIO writing"), std::string::npos) << e.what();
  }
  t.mgr->release(again);
  t.mgr->end_step();
}

// The production store: SwapSpace + IoEngine (threads engine, so it runs where io_uring is not
// permitted), with an injected EIO on reads once armed.
TEST(Nvme, SwapSpaceStoreRoundTripsAndReportsIoErrors) {
  char tmpl[] = "/tmp/strata_offload_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::filesystem::path dir(tmpl);
  std::atomic<bool> fail{false};
  io::EngineOptions eo;
  eo.kind = io::EngineKind::threads;
  eo.completion_hook = [&](io::IoOp op, uint64_t, uint64_t, int64_t res) -> int64_t {
    return op == io::IoOp::read && fail.load() ? -EIO : res;
  };
  auto engine = io::make_engine(eo);
  {
    io::SwapOptions so;
    so.paths = {dir.string()};
    so.allow_buffered = true;
    io::SwapSpace space(so, *engine);
    Thrash t(make_swap_store(space, 8 * kAlign));
    Schedule s;
    s.use(0, Tier::host, Mode::read);
    s.use(1, Tier::device, Mode::read_write);
    s.use(1, Tier::host, Mode::read);
    s.use(0, Tier::device, Mode::read);
    for (int step = 0; step < 4; ++step) run_step(*t.mgr, s, t.versions);
    OffloadStats st = t.mgr->stats();
    EXPECT_GT(st.link(Link::nvme_to_host).bytes, 0u);
    EXPECT_GT(st.link(Link::host_to_nvme).bytes, 0u);
    for (Link l : {Link::nvme_to_host, Link::host_to_nvme, Link::h2d, Link::d2h}) {
      EXPECT_GT(st.link(l).transfers, 0u) << link_name(l);
      EXPECT_GT(st.link(l).ms_busy, 0.0) << link_name(l);
      if (l == Link::nvme_to_host || l == Link::host_to_nvme) {
        EXPECT_EQ(st.link(l).bytes % kAlign, 0u);
      }
    }
    EXPECT_EQ(st.tiers[index(Tier::nvme)].budget_bytes, 8 * kAlign);
    // The disk is busy while either direction is: at least each link's busy time, at most both
    // added (every interval closed: nothing in flight after the drain).
    t.mgr->drain();
    st = t.mgr->stats();
    const double w = st.link(Link::host_to_nvme).ms_busy, r = st.link(Link::nvme_to_host).ms_busy;
    EXPECT_GE(st.nvme_busy_ms, std::max(w, r) - 0.01);
    EXPECT_LE(st.nvme_busy_ms, w + r + 0.01);
    fail = true;
    t.mgr->begin_step();
    Handle a = t.mgr->acquire(0, Tier::host, Mode::read);
    Handle b;
    try {
      a.wait();
      t.mgr->release(a);
      b = t.mgr->acquire(1, Tier::device, Mode::read_write);
      b.wait();
      FAIL() << "an EIO from io/ was not reported";
    } catch (const io::IoError& e) {
      EXPECT_EQ(e.errno_value(), EIO);
      EXPECT_NE(std::string(e.what()).find(dir.string()), std::string::npos) << e.what();
    }
    if (a) t.mgr->release(a);
    if (b) t.mgr->release(b);
    t.mgr->end_step();
    t.mgr->drain();
  }
  std::filesystem::remove_all(dir);
}

// A bit flipped in the swap file under a block's NVMe home: the acquire that reads it back
// fails with the checksum error from io/, which now names the block as well as the file.
TEST(Nvme, SwapSpaceStoreNamesTheCorruptBlock) {
  char tmpl[] = "/tmp/strata_offload_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::filesystem::path dir(tmpl);
  io::EngineOptions eo;
  eo.kind = io::EngineKind::threads;
  auto engine = io::make_engine(eo);
  {
    io::SwapOptions so;
    so.paths = {dir.string()};
    so.allow_buffered = true;
    io::SwapSpace space(so, *engine);
    Thrash t(make_swap_store(space, 8 * kAlign));  // the space's only extent: file offset = store offset
    Schedule s;
    s.use(0, Tier::host, Mode::read);
    s.use(1, Tier::host, Mode::read);
    for (int step = 0; step < 2; ++step) run_step(*t.mgr, s, t.versions);
    const uint64_t at = t.mgr->residency().copy(1, Tier::nvme).offset + kAlign + 123;
    {
      const int fd = ::open(space.files()[0].c_str(), O_RDWR);
      ASSERT_GE(fd, 0);
      char c = 0;
      ASSERT_EQ(::pread(fd, &c, 1, static_cast<off_t>(at)), 1);
      c ^= 1;
      ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(at)), 1);
      ::close(fd);
    }
    t.mgr->begin_step();
    Handle a = t.mgr->acquire(0, Tier::host, Mode::read);
    a.wait();
    t.mgr->release(a);
    Handle b = t.mgr->acquire(1, Tier::host, Mode::read);
    try {
      b.wait();
      FAIL() << "corruption under block 'b' was not reported";
    } catch (const io::ChecksumError& e) {
      const std::string m = e.what();
      EXPECT_EQ(e.path(), space.files()[0]);
      EXPECT_EQ(e.file_offset(), at / kAlign * kAlign);
      EXPECT_NE(m.find("offload block 'b' at byte " + std::to_string(kAlign)), std::string::npos) << m;
    }
    t.mgr->release(b);
    t.mgr->end_step();
    t.mgr->drain();
  }
  std::filesystem::remove_all(dir);
}

// How the trainer initialises blocks homed on NVMe: write_back starts each block's write home
// as soon as it is released, so evicting it later writes nothing more (each block crosses the
// link once); zero sets a block to zeros without writing it, and it reads back as verified
// zeros. zero refuses blocks with another copy, and blocks not homed on NVMe.
TEST(Nvme, WriteBackOnceAndZeroWithoutWriting) {
  char tmpl[] = "/tmp/strata_offload_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::filesystem::path dir(tmpl);
  io::EngineOptions eo;
  eo.kind = io::EngineKind::threads;
  auto engine = io::make_engine(eo);
  {
    io::SwapOptions so;
    so.paths = {dir.string()};
    so.allow_buffered = true;
    io::SwapSpace space(so, *engine);
    auto rt = kernels::make_runtime(kernels::Backend::cpu);
    BlockManager mgr(*rt, small_staging(kAlign, 4 * kAlign), make_swap_store(space, 8 * kAlign));
    const BlockId a = mgr.add_block("a", 3 * kAlign - 100, Tier::nvme);
    const BlockId b = mgr.add_block("b", 3 * kAlign, Tier::nvme);
    const BlockId h = mgr.add_block("h", kAlign, Tier::host);
    mgr.begin_step(BlockManager::kAside);
    for (BlockId x : {a, b}) {  // the host holds one of them: b's acquire evicts a
      Handle w = mgr.acquire(x, Tier::host, Mode::write);
      w.wait();
      fill_pattern(w.data(), w.bytes(), x, 1);
      mgr.release(w);
      mgr.write_back(x);
      mgr.write_back(x);  // home is current: nothing more to write
    }
    mgr.end_step();
    mgr.drain();
    LinkStats out = mgr.stats().link(Link::host_to_nvme);
    EXPECT_EQ(out.transfers, 2u);
    EXPECT_EQ(out.bytes, 6 * kAlign);

    mgr.begin_step(BlockManager::kAside);
    Handle r = mgr.acquire(a, Tier::host, Mode::read);  // evicts b: clean, no write
    r.wait();
    EXPECT_EQ(checksum(r.data(), r.bytes()), expected_checksum(r.bytes(), a, 1));
    EXPECT_THROW(mgr.zero(a), std::logic_error);  // a has a host copy
    mgr.release(r);
    mgr.zero(b);
    r = mgr.acquire(b, Tier::host, Mode::read);  // evicts a: clean, no write
    r.wait();
    const std::vector<char> zeros(r.bytes(), 0);
    EXPECT_EQ(std::memcmp(r.data(), zeros.data(), zeros.size()), 0);
    mgr.release(r);
    mgr.end_step();
    mgr.drain();
    EXPECT_EQ(mgr.stats().link(Link::host_to_nvme).bytes, 6 * kAlign);
    EXPECT_THROW(mgr.zero(h), std::invalid_argument);
    EXPECT_EQ(space.stats().checksum_failures, 0u);
  }
  std::filesystem::remove_all(dir);
}
