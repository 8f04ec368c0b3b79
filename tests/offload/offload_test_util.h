// Helpers for the offload tests: deterministic block contents, random schedules that respect the
// cross-tier rule, a schedule runner that checks every acquire's bytes, and an in-memory NVMe
// store with fault injection.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "offload/manager.h"

namespace strata::offload::testing {

// Contents of block b at version v: a splitmix64 stream, so any stale or torn copy shows.
inline void fill_pattern(void* p, uint64_t bytes, BlockId b, uint64_t v) {
  uint64_t x = (uint64_t{b} << 32) ^ (v * 0x9e3779b97f4a7c15ull) ^ 0x1234567ull;
  auto* out = static_cast<unsigned char*>(p);
  for (uint64_t i = 0; i < bytes; i += 8) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(out + i, &z, std::min<uint64_t>(8, bytes - i));
  }
}

inline uint64_t checksum(const void* p, uint64_t bytes) {
  uint64_t h = 1469598103934665603ull;
  auto* c = static_cast<const unsigned char*>(p);
  for (uint64_t i = 0; i < bytes; ++i) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

inline uint64_t expected_checksum(uint64_t bytes, BlockId b, uint64_t v) {
  std::vector<unsigned char> buf(bytes);
  fill_pattern(buf.data(), bytes, b, v);
  return checksum(buf.data(), bytes);
}

// Random accesses on device and host, up to max_open held at once, released in random order.
inline Schedule random_schedule(std::mt19937_64& rng, size_t n_blocks, size_t n_acquires, int max_open,
                                bool use_device = true) {
  Schedule s;
  struct Open {
    size_t event;
    BlockId b;
    Tier t;
    Mode m;
  };
  std::vector<Open> open;
  size_t acquired = 0;
  while (acquired < n_acquires || !open.empty()) {
    bool do_acquire = acquired < n_acquires && (open.empty() || (static_cast<int>(open.size()) < max_open && rng() % 2));
    if (!do_acquire) {
      size_t k = rng() % open.size();
      s.release(open[k].event);
      open.erase(open.begin() + static_cast<long>(k));
      continue;
    }
    for (int attempt = 0; attempt < 20; ++attempt) {
      BlockId b = static_cast<BlockId>(rng() % n_blocks);
      Tier t = use_device && rng() % 3 != 0 ? Tier::device : Tier::host;
      int r = static_cast<int>(rng() % 10);
      Mode m = r < 6 ? Mode::read : r < 8 ? Mode::read_write : Mode::write;
      bool conflict = false;
      for (const Open& o : open)
        if (o.b == b && o.t != t && (writes(m) || writes(o.m))) conflict = true;
      if (conflict) continue;
      open.push_back({s.acquire(b, t, m), b, t, m});
      break;
    }
    ++acquired;
  }
  return s;
}

// Runs one step of `s` on `mgr`, checking every read's bytes and writing a new version on every
// write. versions[b] is the version block b holds.
inline void run_step(BlockManager& mgr, const Schedule& s, std::vector<uint64_t>& versions) {
  mgr.begin_step();
  std::map<size_t, Handle> held;
  for (size_t i = 0; i < s.size(); ++i) {
    const ScheduleEvent& e = s.events()[i];
    if (e.release) {
      mgr.release(held.at(e.acquire_event), nullptr, e.discard);
      held.erase(e.acquire_event);
      continue;
    }
    Handle h = mgr.acquire(e.block, e.tier, e.mode);
    h.wait();
    if (reads(e.mode)) {
      ASSERT_EQ(checksum(h.data(), h.bytes()), expected_checksum(h.bytes(), e.block, versions[e.block]))
          << s.describe(i) << " read stale or torn bytes (version " << versions[e.block] << ")";
    }
    if (writes(e.mode)) fill_pattern(h.data(), h.bytes(), e.block, ++versions[e.block]);
    held[i] = h;
  }
  mgr.end_step();
}

// Writes version 1 of every block through its home tier (host or device; NVMe via host).
inline void init_blocks(BlockManager& mgr, std::vector<uint64_t>& versions) {
  mgr.begin_step();
  for (BlockId b = 0; b < mgr.residency().n_blocks(); ++b) {
    Tier t = mgr.block(b).home == Tier::device ? Tier::device : Tier::host;
    Handle h = mgr.acquire(b, t, Mode::write);
    h.wait();
    fill_pattern(h.data(), h.bytes(), b, ++versions[b]);
    mgr.release(h);
  }
  mgr.end_step();
}

// An NVMe tier in memory, completing on its own thread; reads or writes at chosen offsets fail.
class MemStore final : public NvmeStore {
 public:
  explicit MemStore(uint64_t bytes) : data_(bytes), worker_([this] { run(); }) {}
  ~MemStore() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  uint64_t capacity() const override { return data_.size(); }
  std::shared_ptr<Waitable> read(uint64_t off, uint64_t len, void* buf) override { return submit(false, off, len, buf); }
  std::shared_ptr<Waitable> write(uint64_t off, uint64_t len, const void* buf) override {
    return submit(true, off, len, const_cast<void*>(buf));
  }
  void fail_reads_at(uint64_t off) {
    std::lock_guard lock(mu_);
    fail_read_offset_ = off;
  }
  void fail_writes_at(uint64_t off) {
    std::lock_guard lock(mu_);
    fail_write_offset_ = off;
  }
  uint64_t reads_done() {
    std::lock_guard lock(mu_);
    return n_reads_;
  }

 private:
  struct Job {
    bool write;
    uint64_t off, len;
    void* buf;
    std::shared_ptr<Signal> done;
  };
  std::shared_ptr<Waitable> submit(bool write, uint64_t off, uint64_t len, void* buf) {
    if (off % kAlign || len % kAlign || reinterpret_cast<uintptr_t>(buf) % kAlign || off + len > data_.size())
      throw std::invalid_argument("MemStore: misaligned or out-of-range I/O");
    auto done = std::make_shared<Signal>();
    {
      std::lock_guard lock(mu_);
      jobs_.push_back({write, off, len, buf, done});
    }
    cv_.notify_all();
    return done;
  }
  void run() {
    for (;;) {
      Job j;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        j = jobs_.front();
        jobs_.pop_front();
        if (!j.write) ++n_reads_;
        uint64_t fail_at = j.write ? fail_write_offset_ : fail_read_offset_;
        if (fail_at >= j.off && fail_at < j.off + j.len) {
          j.done->set(std::make_exception_ptr(std::runtime_error(
              std::string("MemStore: injected EIO ") + (j.write ? "writing " : "reading ") + std::to_string(j.len) +
              " bytes at offset " + std::to_string(j.off))));
          continue;
        }
      }
      if (j.write)
        std::memcpy(data_.data() + j.off, j.buf, j.len);
      else
        std::memcpy(j.buf, data_.data() + j.off, j.len);
      j.done->set();
    }
  }
  std::vector<char> data_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  uint64_t fail_read_offset_ = UINT64_MAX;
  uint64_t fail_write_offset_ = UINT64_MAX;
  uint64_t n_reads_ = 0;
  std::thread worker_;
};

}  // namespace strata::offload::testing
