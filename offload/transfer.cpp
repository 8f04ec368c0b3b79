// TransferEngine: copy streams for PCIe, two in-order lanes for NVMe, a pinned staging pool.
#include "offload/transfer.h"

#include <cassert>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <stdexcept>
#include <functional>
#include <thread>
#include <vector>

#include "kernels/runtime.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

// An in-order worker thread: jobs run one after another, in the order pushed.
class Lane {
 public:
  Lane() : thread_([this] { run(); }) {}
  ~Lane() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(std::function<void()> job) {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back(std::move(job));
      ++pending_;
    }
    cv_.notify_all();
  }
  void drain() {
    std::unique_lock lock(mu_);
    idle_cv_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();  // jobs catch their own errors
      {
        std::lock_guard lock(mu_);
        --pending_;
      }
      idle_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> jobs_;
  size_t pending_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

// Wall time with at least one transfer in flight, and bytes, for one link. A link's clock may
// also run a shared one (`also`: both NVMe directions run the disk's), which is then busy while
// any of its links is.
class LinkClock {
 public:
  LinkClock* also = nullptr;
  void begin() {
    {
      std::lock_guard lock(mu_);
      if (in_flight_++ == 0) since_ = Clock::now();
    }
    if (also) also->begin();
  }
  void end(uint64_t bytes) {
    {
      std::lock_guard lock(mu_);
      assert(in_flight_ > 0);
      stats_.bytes += bytes;
      ++stats_.transfers;
      if (--in_flight_ == 0) stats_.ms_busy += std::chrono::duration<double, std::milli>(Clock::now() - since_).count();
    }
    if (also) also->end(bytes);
  }
  LinkStats stats() const {
    std::lock_guard lock(mu_);
    return stats_;
  }

 private:
  mutable std::mutex mu_;
  int in_flight_ = 0;
  Clock::time_point since_;
  LinkStats stats_;
};

}  // namespace

struct TransferEngine::Impl {
  kernels::Runtime& rt;
  NvmeStore* store;
  TransferConfig cfg;
  EventPool events;
  std::unique_ptr<kernels::Stream> h2d, d2h, staging_stream;
  kernels::PinnedBuffer staging;               // n_staging x staging_bytes
  std::vector<std::unique_ptr<kernels::Event>> staging_done;  // per chunk: its last PCIe copy finished
  std::array<LinkClock, kNumLinks> clocks;
  LinkClock disk;  // either NVMe direction in flight
  // NVMe: waits + submissions, completions in order; device copies issued late; device<->NVMe.
  Lane submit, complete, deferred, staged;

  Impl(kernels::Runtime& r, NvmeStore* s, TransferConfig c) : rt(r), store(s), cfg(c), events(r) {
    clock(Link::host_to_nvme).also = clock(Link::nvme_to_host).also = &disk;
    h2d = rt.create_stream();
    d2h = rt.create_stream();
    if (store && cfg.device_nvme) {
      assert(cfg.staging_bytes % kAlign == 0 && cfg.n_staging >= 2);
      staging_stream = rt.create_stream();
      staging = kernels::PinnedBuffer(rt, cfg.staging_total());
      store->register_buffer(staging.data(), staging.bytes());
      for (int i = 0; i < cfg.n_staging; ++i) staging_done.push_back(rt.create_event());
    }
  }

  // The staging buffer is freed after this: its registration must go first, or a later buffer at
  // the same address would be read into through the old pinned pages. Members are destroyed
  // after this body, and the lanes (their threads) are drained by ~TransferEngine before it.
  ~Impl() {
    if (store && staging.data()) store->unregister_buffer(staging.data());
  }

  LinkClock& clock(Link l) { return clocks[static_cast<int>(l)]; }

  // Enqueues one device<->host copy on its stream behind deps' events (their host sides are
  // complete), and records `done` after it.
  void enqueue_copy(kernels::Stream& s, LinkClock* c, const Place& src, const Place& dst, uint64_t bytes,
                    const Fence& deps, kernels::Event& done) {
    deps.enqueue_wait(s);
    s.host_fn([c] { c->begin(); });  // host functions only keep time: they never wait
    s.memcpy_async(dst.ptr, src.ptr, bytes);
    s.host_fn([c, bytes] { c->end(bytes); });
    s.record(done);
  }

  // device<->host: the copy stream waits for deps' events, copies, and records the fence's
  // event. When deps still wait on host work (an NVMe read), the copy is issued by the deferred
  // lane once that is done: the stream never waits on anything but events.
  Fence copy_on_stream(const Place& src, const Place& dst, uint64_t bytes, const Fence& deps) {
    Link link = dst.tier == Tier::device ? Link::h2d : Link::d2h;
    kernels::Stream& s = link == Link::h2d ? *h2d : *d2h;
    LinkClock* c = &clock(link);
    if (deps.host_ready()) {
      try {
        deps.wait_host();  // complete: rethrows if an input failed
      } catch (...) {
        auto failed = std::make_shared<Signal>();
        failed->set(std::current_exception());
        return Fence(failed);
      }
      std::shared_ptr<EventPart> part = events.take();
      enqueue_copy(s, c, src, dst, bytes, deps, part->event());
      return Fence(part);
    }
    auto part = std::make_shared<DeferredEventPart>(events.take());
    deferred.push([=, this, &s] {
      try {
        deps.wait_host();
      } catch (...) {
        part->failed(std::current_exception());  // an input failed: so does this move
        return;
      }
      enqueue_copy(s, c, src, dst, bytes, deps, part->event());
      part->recorded();
    });
    return Fence(part);
  }

  // Starts one host<->NVMe I/O with its link clock running; a submit that throws stops the
  // clock again, so in-flight counts stay balanced on every error path.
  std::shared_ptr<Waitable> start_io(LinkClock* c, bool to_nvme, const Place& src, const Place& dst, uint64_t len) {
    c->begin();
    try {
      return to_nvme ? store->write(dst.nvme_offset, len, src.ptr) : store->read(src.nvme_offset, len, dst.ptr);
    } catch (...) {
      c->end(0);
      throw;
    }
  }

  // host<->NVMe: the submit lane waits for deps and submits; the completion lane waits for the
  // I/O and completes the fence, so several moves are in flight at once.
  Fence host_nvme(const Place& src, const Place& dst, uint64_t bytes, const Fence& deps) {
    uint64_t len = align_up(bytes);
    bool to_nvme = dst.tier == Tier::nvme;
    LinkClock* c = &clock(to_nvme ? Link::host_to_nvme : Link::nvme_to_host);
    if (deps.ready()) {
      // Nothing to wait for: submit from here and hand out the I/O itself, so the waiter is woken
      // by the engine's completion, not by two lane hops. The completion lane only keeps time.
      try {
        deps.wait();  // completed; rethrows if an input failed
        std::shared_ptr<Waitable> io = start_io(c, to_nvme, src, dst, len);
        complete.push([io, c, len] {
          try {
            io->wait();
            c->end(len);
          } catch (...) {
            c->end(0);
          }
        });
        return Fence(io);
      } catch (...) {
        auto failed = std::make_shared<Signal>();
        failed->set(std::current_exception());
        return Fence(failed);
      }
    }
    auto done = std::make_shared<Signal>();
    submit.push([=, this] {
      std::shared_ptr<Waitable> io;
      try {
        deps.wait();
        io = start_io(c, to_nvme, src, dst, len);
      } catch (...) {
        done->set(std::current_exception());
        return;
      }
      complete.push([io, done, c, len] {
        try {
          io->wait();
          c->end(len);
          done->set();
        } catch (...) {
          c->end(0);
          done->set(std::current_exception());
        }
      });
    });
    return Fence(done);
  }

  // device->NVMe, one window of chunks at a time: each chunk's device->staging copy on the
  // staging stream, then its NVMe write as soon as the copy is done; a chunk is refilled only
  // once its last write finished. Up to n_staging writes in flight.
  void device_to_nvme(const Place& src, const Place& dst, uint64_t bytes, uint64_t len,
                      std::vector<std::shared_ptr<Waitable>>& io) {
    auto* base = static_cast<char*>(staging.data());
    const uint64_t chunk = cfg.staging_bytes;
    const uint64_t n_chunks = (len + chunk - 1) / chunk;
    const auto slots = static_cast<uint64_t>(cfg.n_staging);
    for (uint64_t w0 = 0; w0 < n_chunks; w0 += slots) {
      const uint64_t w1 = std::min(n_chunks, w0 + slots);
      for (uint64_t k = w0; k < w1; ++k) {
        const size_t slot = static_cast<size_t>(k % slots);
        if (io[slot]) io[slot]->wait();  // the chunk's previous write is done
        const uint64_t off = k * chunk;
        if (off < bytes)
          staging_stream->memcpy_async(base + slot * chunk, static_cast<const char*>(src.ptr) + off,
                                       std::min(chunk, bytes - off));
        staging_stream->record(*staging_done[slot]);
      }
      for (uint64_t k = w0; k < w1; ++k) {
        const size_t slot = static_cast<size_t>(k % slots);
        staging_done[slot]->synchronize();
        io[slot] = store->write(dst.nvme_offset + k * chunk, std::min(chunk, len - k * chunk), base + slot * chunk);
      }
    }
  }

  // NVMe->device: reads of up to n_staging chunks in flight; as each arrives, its
  // staging->device copy; a chunk is read into again once its copy has finished.
  void nvme_to_device(const Place& src, const Place& dst, uint64_t bytes, uint64_t len,
                      std::vector<std::shared_ptr<Waitable>>& io) {
    auto* base = static_cast<char*>(staging.data());
    const uint64_t chunk = cfg.staging_bytes;
    const uint64_t n_chunks = (len + chunk - 1) / chunk;
    const auto slots = static_cast<uint64_t>(cfg.n_staging);
    auto read = [&](uint64_t k) {
      const size_t slot = static_cast<size_t>(k % slots);
      staging_done[slot]->synchronize();  // its previous copy has left the chunk
      io[slot] = store->read(src.nvme_offset + k * chunk, std::min(chunk, len - k * chunk), base + slot * chunk);
    };
    uint64_t issued = 0;
    for (; issued < std::min(n_chunks, slots - 1); ++issued) read(issued);
    for (uint64_t k = 0; k < n_chunks; ++k) {
      const size_t slot = static_cast<size_t>(k % slots);
      io[slot]->wait();
      const uint64_t off = k * chunk;
      if (off < bytes)
        staging_stream->memcpy_async(static_cast<char*>(dst.ptr) + off, base + slot * chunk,
                                     std::min(chunk, bytes - off));
      staging_stream->record(*staging_done[slot]);
      if (issued < n_chunks) read(issued++);
    }
  }

  // device<->NVMe on the staged lane (not the submit lane: host<->NVMe moves never queue
  // behind it).
  Fence device_nvme(const Place& src, const Place& dst, uint64_t bytes, const Fence& deps) {
    auto done = std::make_shared<Signal>();
    uint64_t len = align_up(bytes);
    bool to_nvme = dst.tier == Tier::nvme;
    staged.push([=, this] {
      LinkClock& c_pcie = clock(to_nvme ? Link::d2h : Link::h2d);
      LinkClock& c_nvme = clock(to_nvme ? Link::host_to_nvme : Link::nvme_to_host);
      std::vector<std::shared_ptr<Waitable>> io(static_cast<size_t>(cfg.n_staging));  // last I/O per chunk
      bool clocks_running = false;  // a failed input (deps) never starts them
      try {
        deps.wait();
        c_pcie.begin();
        c_nvme.begin();
        clocks_running = true;
        if (to_nvme)
          device_to_nvme(src, dst, bytes, len, io);
        else
          nvme_to_device(src, dst, bytes, len, io);
        for (auto& w : io)
          if (w) w->wait();
        for (auto& e : staging_done) e->synchronize();
        c_pcie.end(bytes);
        c_nvme.end(len);
        done->set();
      } catch (...) {
        // Leave the staging chunks quiet before the next move reuses them.
        for (auto& w : io)
          try {
            if (w) w->wait();
          } catch (...) {
          }
        try {
          staging_stream->synchronize();
        } catch (...) {
        }
        if (clocks_running) {
          c_pcie.end(0);
          c_nvme.end(0);
        }
        done->set(std::current_exception());
      }
    });
    return Fence(done);
  }
};

TransferEngine::TransferEngine(kernels::Runtime& rt, NvmeStore* store, TransferConfig cfg)
    : impl_(std::make_unique<Impl>(rt, store, cfg)) {}

TransferEngine::~TransferEngine() { drain(); }

Fence TransferEngine::move(const Place& src, const Place& dst, uint64_t bytes, const Fence& deps) {
  assert(src.tier != dst.tier);
  bool nvme = src.tier == Tier::nvme || dst.tier == Tier::nvme;
  if (!nvme) return impl_->copy_on_stream(src, dst, bytes, deps);
  assert(impl_->store && "offload: an NVMe move without an NVMe store");
  bool device = src.tier == Tier::device || dst.tier == Tier::device;
  if (device && !impl_->staging.data())
    throw std::logic_error("offload: a device<->NVMe move with TransferConfig::device_nvme off");
  return device ? impl_->device_nvme(src, dst, bytes, deps) : impl_->host_nvme(src, dst, bytes, deps);
}

EventPool& TransferEngine::events() { return impl_->events; }

void TransferEngine::drain() {
  impl_->deferred.drain();
  impl_->staged.drain();
  impl_->submit.drain();
  impl_->complete.drain();
  auto quiet = [](kernels::Stream* s) {
    if (!s) return;
    try {
      s->synchronize();
    } catch (...) {  // the error stays with the fences of the moves that failed
    }
  };
  quiet(impl_->h2d.get());
  quiet(impl_->d2h.get());
  quiet(impl_->staging_stream.get());
}

double TransferEngine::nvme_busy_ms() const { return impl_->disk.stats().ms_busy; }

std::array<LinkStats, kNumLinks> TransferEngine::link_stats() const {
  std::array<LinkStats, kNumLinks> out;
  for (int i = 0; i < kNumLinks; ++i) out[i] = impl_->clocks[i].stats();
  return out;
}


}  // namespace strata::offload
