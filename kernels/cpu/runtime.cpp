// The CPU runtime: "device" memory is host memory, a stream is one in-order worker thread,
// an event is a flag set when the worker reaches the point where it was recorded.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/runtime.h"

namespace strata::kernels {
namespace cpu {
namespace {

// One recorded point of an event: completed by the worker, with the stream's error (if any).
// It is also what another runtime's stream waits on (EventPoint): callbacks registered with
// on_complete run on the worker when it reaches the point (a CUDA stream's flag write).
struct Marker final : EventPoint {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::vector<std::function<void(std::exception_ptr)>> callbacks;  // run once, at completion
  void complete(std::exception_ptr e) {
    std::vector<std::function<void(std::exception_ptr)>> run;
    {
      std::lock_guard lock(mu);
      done = true;
      error = e;
      run.swap(callbacks);
      cv.notify_all();
    }
    for (auto& fn : run) fn(e);
  }
  void wait() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  std::exception_ptr wait_host() override {
    wait();
    std::lock_guard lock(mu);
    return error;
  }
  void on_complete(std::function<void(std::exception_ptr)> fn) override {
    std::exception_ptr e;
    {
      std::lock_guard lock(mu);
      if (!done) {
        callbacks.push_back(std::move(fn));
        return;
      }
      e = error;
    }
    fn(e);
  }
};

class CpuEvent final : public Event {
 public:
  explicit CpuEvent(Runtime& rt) : rt_(rt) {}
  Runtime& runtime() const override { return rt_; }
  void synchronize() override {
    auto m = current();
    if (!m) return;
    m->wait();
    if (m->error) std::rethrow_exception(m->error);
  }
  bool query() override {
    auto m = current();
    if (!m) return true;
    std::lock_guard lock(m->mu);
    return m->done;
  }
  Backend backend() const override { return Backend::cpu; }
  std::shared_ptr<EventPoint> point() override { return current(); }
  std::shared_ptr<Marker> current() {
    std::lock_guard lock(mu_);
    return marker_;
  }
  void set(std::shared_ptr<Marker> m) {
    std::lock_guard lock(mu_);
    marker_ = std::move(m);
  }

 private:
  Runtime& rt_;
  std::mutex mu_;
  std::shared_ptr<Marker> marker_;
};

// Stress hook for the tests: STRATA_TEST_STREAM_JITTER_US=N makes every CPU stream sleep a
// random 0..N µs before each task, so streams that are ordered only by events run in ever
// different interleavings (a missing event shows up as a wrong result, not as luck).
int stream_jitter_us() {
  static const int us = [] {
    const char* e = std::getenv("STRATA_TEST_STREAM_JITTER_US");
    return e ? std::max(0, std::atoi(e)) : 0;
  }();
  return us;
}

class CpuStream final : public Stream {
 public:
  explicit CpuStream(Runtime& rt)
      : rt_(rt), jitter_us_(stream_jitter_us()), rng_(std::random_device{}()), worker_([this] { run(); }) {}
  Runtime& runtime() const override { return rt_; }
  ~CpuStream() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  void record(Event& e) override {
    if (&e.runtime() != &rt_)
      throw std::invalid_argument("Stream::record: the event belongs to another runtime (create it from this one)");
    auto m = std::make_shared<Marker>();
    static_cast<CpuEvent&>(e).set(m);
    push([this, m] { m->complete(error_); }, /*always=*/true);
  }
  // Any runtime's event: the worker blocks until the point completes (a CUDA event: in
  // cudaEventSynchronize) and adopts the producer's error.
  void wait(Event& e) override {
    auto p = e.point();
    if (!p) return;
    push([this, p] {
      std::exception_ptr err;
      try {
        err = p->wait_host();
      } catch (...) {  // the wait itself failed (a CUDA error): the stream fails with it
        err = std::current_exception();
      }
      if (err && !error_) error_ = err;
    }, /*always=*/true);
  }
  void synchronize() override {
    auto m = std::make_shared<Marker>();
    push([this, m] { m->complete(error_); error_ = nullptr; }, /*always=*/true);
    m->wait();
    if (m->error) std::rethrow_exception(m->error);
  }
  void memcpy_async(void* dst, const void* src, size_t bytes) override {
    push([=] { std::memcpy(dst, src, bytes); });
  }
  void memset_async(void* dst, int value, size_t bytes) override {
    push([=] { std::memset(dst, value, bytes); });
  }
  void host_fn(std::function<void()> fn) override { push(std::move(fn)); }
  double busy_ms() const override { return static_cast<double>(busy_ns_.load(std::memory_order_relaxed)) / 1e6; }

  // Enqueues fn; if an earlier task failed, fn is skipped (unless `always`).
  void push(std::function<void()> fn, bool always = false) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back({std::move(fn), always});
    }
    cv_.notify_one();
  }

 private:
  struct Task {
    std::function<void()> fn;
    bool always;
  };
  void run() {
    for (;;) {
      Task t;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      if (jitter_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(rng_() % (jitter_us_ + 1)));
      if (t.always) {
        t.fn();
      } else if (!error_) {
        const auto t0 = std::chrono::steady_clock::now();
        try {
          t.fn();
        } catch (...) {
          error_ = std::current_exception();
        }
        busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                           std::memory_order_relaxed);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  std::exception_ptr error_;  // touched only by the worker
  std::atomic<int64_t> busy_ns_{0};  // time in non-wait tasks
  Runtime& rt_;
  const int jitter_us_;
  std::minstd_rand rng_;  // the worker's
  std::thread worker_;
};

size_t physical_ram() {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

bool cpu_has_bf16() { return __builtin_cpu_supports("avx512bf16"); }

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      auto pos = line.find(':');
      if (pos != std::string::npos) return line.substr(pos + 2);
    }
  return "cpu";
}

constexpr size_t kHuge = size_t{2} << 20;

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and we touch the pages
#endif

// Faults [p, p + bytes) in, writable. Fresh pages are slow to fault in (on the VMs we measured,
// 0.3-0.7 GiB/s for one thread, the hypervisor backing each page on first touch), and the
// pools are allocated once and then used at once: so all of it now, from every core at once
// (DESIGN.md "Memory is allocated once"). Throws when the kernel cannot back the pages.
void populate(char* p, size_t bytes) {
  auto fault_in = [](char* lo, size_t len) -> int {
    if (madvise(lo, len, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno != EINVAL) return errno;
    for (size_t off = 0; off < len; off += 4096)  // an old kernel: a write per page (they are zero)
      reinterpret_cast<volatile char*>(lo)[off] = 0;
    return 0;
  };
  const size_t n_threads = bytes >= (size_t{64} << 20) ? static_cast<size_t>(std::max(1, num_threads())) : 1;
  const size_t chunk = (bytes / n_threads + kHuge - 1) / kHuge * kHuge;  // whole huge pages each
  std::vector<int> errs(n_threads, 0);
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < n_threads && t * chunk < bytes; ++t)
    helpers.emplace_back([&, t] { errs[t] = fault_in(p + t * chunk, std::min(chunk, bytes - t * chunk)); });
  errs[0] = fault_in(p, std::min(chunk, bytes));
  for (auto& h : helpers) h.join();
  for (int err : errs)
    if (err != 0)
      throw std::runtime_error("cpu runtime: cannot back " + std::to_string(bytes) + " bytes of memory (" +
                               std::strerror(err) + ")");
}

// Host memory, 4 KiB aligned, zeroed and faulted in. Allocations of 2 MiB or more are their own
// mapping (zero pages), 2 MiB aligned, advised as huge pages and faulted in now (populate);
// smaller ones come from malloc, zeroed.
class HostMemory {
 public:
  void* alloc(size_t bytes, bool lock) {
    if (bytes < kHuge) {
      void* p = std::aligned_alloc(4096, std::max<size_t>(4096, (bytes + 4095) / 4096 * 4096));
      if (!p) throw std::runtime_error("cpu runtime: out of memory allocating " + std::to_string(bytes) + " bytes");
      std::memset(p, 0, bytes);  // zeroed like the mappings below, so no caller needs a pass of its own
      return remember(p, {p, 0, bytes, lock});
    }
    const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge, len = rounded + kHuge;  // room to align
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
      throw std::runtime_error("cpu runtime: cannot map " + std::to_string(bytes) + " bytes: " + std::strerror(errno));
    char* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge);
    madvise(p, rounded, MADV_HUGEPAGE);  // advisory (THP may be off); failure is harmless
    try {
      populate(p, rounded);
    } catch (...) {
      munmap(base, len);  // nothing else holds it; a failure here would only leak address space
      throw;
    }
    return remember(p, {base, len, bytes, lock});
  }
  void free(void* p) {
    if (!p) return;
    Block b;
    {
      std::lock_guard lock(mu_);
      auto it = blocks_.find(p);
      if (it == blocks_.end()) return;  // not ours: nothing to free
      b = it->second;
      blocks_.erase(it);
    }
    if (b.locked) munlock(p, b.bytes);  // fails only if it was never locked
    if (b.map_len == 0)
      std::free(p);
    else if (munmap(b.map_base, b.map_len) != 0)
      std::fprintf(stderr, "strata: warning: munmap of %zu bytes failed (%s)\n", b.map_len, std::strerror(errno));
  }

 private:
  struct Block {
    void* map_base = nullptr;  // the mapping (map_len 0: from aligned_alloc)
    size_t map_len = 0;
    size_t bytes = 0;          // what the caller asked for
    bool locked = false;       // mlock-ed (pinned)
  };
  void* remember(void* p, Block b) {
    if (b.locked && mlock(p, b.bytes) != 0) {
      b.locked = false;
      if (!mlock_warned_.exchange(true))
        std::fprintf(stderr,
                     "strata: warning: mlock of %zu bytes failed (%s): pinned host memory is pageable; raise "
                     "RLIMIT_MEMLOCK (ulimit -l) to pin it\n",
                     b.bytes, std::strerror(errno));
    }
    std::lock_guard lock(mu_);
    blocks_[p] = b;
    return p;
  }
  std::mutex mu_;
  std::map<void*, Block> blocks_;
  std::atomic<bool> mlock_warned_{false};
};

class CpuRuntime final : public Runtime {
 public:
  CpuRuntime() {
    info_.backend = Backend::cpu;
    info_.index = 0;
    info_.name = cpu_model_name();
    info_.total_bytes = physical_ram();
    info_.n_threads = num_threads();
    info_.has_bf16_matmul = cpu_has_bf16();
  }
  const DeviceInfo& info() const override { return info_; }
  void* alloc_device(size_t bytes) override { return memory_.alloc(bytes, /*lock=*/false); }
  void free_device(void* p) override { memory_.free(p); }
  void* alloc_pinned(size_t bytes) override { return memory_.alloc(bytes, /*lock=*/true); }
  void free_pinned(void* p) override { memory_.free(p); }
  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CpuStream>(*this); }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CpuEvent>(*this); }
  Ops& ops() override { return ops_; }

 private:
  DeviceInfo info_;
  CpuOps ops_;
  HostMemory memory_;
};

}  // namespace

void enqueue(Stream& s, std::function<void()> fn) { static_cast<CpuStream&>(s).push(std::move(fn)); }

namespace {
// Totals per op name; printed (largest first) when the process exits.
class OpProfile {
 public:
  void add(const char* name, double ms) {
    std::lock_guard lock(mu_);
    auto& [calls, total] = by_name_[name];
    ++calls;
    total += ms;
  }
  ~OpProfile() {
    std::vector<std::pair<std::string, std::pair<int64_t, double>>> rows(by_name_.begin(), by_name_.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
    double all = 0;
    for (const auto& r : rows) all += r.second.second;
    std::fprintf(stderr, "STRATA_PROFILE_OPS: CPU op wall time (%.1f ms in all)\n%-22s %8s %12s %7s\n", all, "op",
                 "calls", "total ms", "share");
    for (const auto& [name, v] : rows)
      std::fprintf(stderr, "%-22s %8lld %12.2f %6.1f%%\n", name.c_str(), static_cast<long long>(v.first), v.second,
                   all > 0 ? 100.0 * v.second / all : 0.0);
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::pair<int64_t, double>> by_name_;
};
OpProfile& op_profile() {
  static OpProfile p;
  return p;
}
}  // namespace

bool profiling_ops() {
  static const bool on = [] {
    const char* e = std::getenv("STRATA_PROFILE_OPS");
    if (!e || !*e || std::string(e) == "0") return false;
    op_profile();  // constructed before first use, so destroyed (and printed) after it
    return true;
  }();
  return on;
}
void record_op_time(const char* name, double ms) { op_profile().add(name, ms); }

std::unique_ptr<Runtime> make_cpu_runtime() { return std::make_unique<CpuRuntime>(); }

}  // namespace cpu
}  // namespace strata::kernels
