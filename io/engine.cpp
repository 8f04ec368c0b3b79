// The engine-independent half of io/: errors, IoHandle, request splitting and result judging
// (EngineBase), and the factory that picks io_uring or the thread-pool fallback.
#include <liburing.h>

#include <cassert>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "io/engine_base.h"
#include "io/errors.h"

namespace strata::io {

std::unique_ptr<IoEngine> make_uring_engine(const EngineOptions& opts);    // uring_engine.cpp
std::unique_ptr<IoEngine> make_thread_engine(const EngineOptions& opts);   // thread_engine.cpp

namespace {
std::string io_message(const std::string& op, const std::string& path, uint64_t offset, uint64_t length, int err,
                       const std::string& hint) {
  std::string m = op + " " + (path.empty() ? std::string("<no path>") : path) + " at offset " + std::to_string(offset) +
                  " length " + std::to_string(length);
  if (err) m += ": " + std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
  if (!hint.empty()) m += ": " + hint;
  return m;
}
std::atomic<uint64_t> g_fallbacks{0};
}  // namespace

IoError::IoError(const std::string& what_op, std::string path, uint64_t offset, uint64_t length, int err,
                 const std::string& hint)
    : std::runtime_error(io_message(what_op, path, offset, length, err, hint)),
      path_(std::move(path)), offset_(offset), length_(length), errno_(err) {}

namespace {
std::string checksum_message(const ChecksumError::Where& w) {
  char crcs[64];
  std::snprintf(crcs, sizeof crcs, "crc32c expected %08x got %08x", w.expected, w.actual);
  return "checksum mismatch reading swap file " + w.path + " at byte offset " + std::to_string(w.file_offset) + " (" +
         std::to_string(w.block_bytes) + "-byte block " + std::to_string(w.block_bytes ? w.extent_offset / w.block_bytes : 0) +
         " of extent " + std::to_string(w.extent_id) + ", extent offset " + std::to_string(w.extent_offset) +
         (w.bad_blocks > 1 ? "; " + std::to_string(w.bad_blocks) + " bad blocks in this read" : std::string()) + "): " +
         crcs + (w.context.empty() ? std::string() : "; " + w.context) +
         "; the disk returned other bytes than were written: check the drive (dmesg, smartctl) and its filesystem";
}
}  // namespace

ChecksumError::ChecksumError(Where w) : std::runtime_error(checksum_message(w)), w_(std::move(w)) {}

ChecksumError ChecksumError::with_context(const std::string& context) const {
  Where w = w_;
  w.context = w.context.empty() ? context : w.context + ", " + context;
  return ChecksumError(std::move(w));
}

const char* to_string(EngineKind k) {
  switch (k) {
    case EngineKind::automatic: return "auto";
    case EngineKind::uring: return "uring";
    case EngineKind::threads: return "threads";
  }
  return "?";
}

EngineKind parse_engine_kind(const std::string& s) {
  if (s == "auto") return EngineKind::automatic;
  if (s == "uring" || s == "io_uring") return EngineKind::uring;
  if (s == "threads") return EngineKind::threads;
  throw std::invalid_argument("unknown I/O engine '" + s + "' (expected auto, uring or threads)");
}

// ---- IoHandle ----

bool IoHandle::ready() const {
  if (!r_) return false;
  if (!r_->done.load(std::memory_order_acquire) && r_->reaper) r_->reaper->poll();  // caller-reaped: make progress
  return r_->done.load(std::memory_order_acquire) != 0;
}

void IoHandle::wait() {
  assert(r_ && "wait() on an empty IoHandle");
  detail::Request& r = *r_;
  if (!r.done.load(std::memory_order_acquire)) {
    if (r.reaper) {
      r.reaper->reap_until(r);
    } else {
      while (!r.done.load(std::memory_order_acquire)) r.done.wait(0, std::memory_order_acquire);
    }
  }
  if (r.error) {
    const detail::Request::Failure& f = *r.error;
    throw IoError(f.op, f.path, f.offset, f.length, f.err, f.hint);
  }
  if (r.verify) {
    std::call_once(r.verify_once, [&r] {
      try {
        r.verify();
      } catch (...) {
        r.verify_error = std::current_exception();
      }
    });
    if (r.verify_error) std::rethrow_exception(r.verify_error);
  }
}

uint64_t IoHandle::bytes() const { return r_ ? r_->bytes : 0; }
double IoHandle::latency_us() const { return r_ ? r_->latency_ns.load(std::memory_order_relaxed) / 1e3 : 0.0; }

// ---- IoEngine ----

IoHandle IoEngine::read(FileId f, uint64_t offset, uint64_t length, void* buf) {
  IoSpan s{f, offset, length, buf};
  return submit(IoOp::read, std::span<const IoSpan>(&s, 1));
}

IoHandle IoEngine::write(FileId f, uint64_t offset, uint64_t length, const void* buf) {
  IoSpan s{f, offset, length, const_cast<void*>(buf)};  // never written through on IoOp::write
  return submit(IoOp::write, std::span<const IoSpan>(&s, 1));
}

bool uring_available(std::string* why) {
  io_uring ring;
  int ret = io_uring_queue_init(4, &ring, 0);
  if (ret < 0) {
    if (why) *why = std::string("io_uring_queue_init failed: ") + std::strerror(-ret) +
                    (ret == -EPERM ? " (io_uring disabled by sysctl kernel.io_uring_disabled or seccomp)" : "");
    return false;
  }
  io_uring_queue_exit(&ring);
  return true;
}

uint64_t fallback_count() { return g_fallbacks.load(); }

std::unique_ptr<IoEngine> make_engine(const EngineOptions& opts) {
  if (opts.queue_depth == 0 || opts.block_bytes == 0 || opts.block_bytes % kDirectAlign || opts.block_bytes > (1u << 30))
    throw std::invalid_argument("EngineOptions: queue_depth must be > 0 and block_bytes a multiple of 4 KiB up to 1 GiB");
  if (opts.kind == EngineKind::threads) return make_thread_engine(opts);
  std::string why;
  if (uring_available(&why)) return make_uring_engine(opts);
  if (opts.kind == EngineKind::uring) throw std::runtime_error("io_uring engine requested but " + why);
  static std::once_flag warned;
  std::call_once(warned, [&why] {
    std::fprintf(stderr, "strata: warning: %s; falling back to the threads I/O engine (pread/pwrite)\n", why.c_str());
  });
  g_fallbacks.fetch_add(1);
  return make_thread_engine(opts);
}

namespace detail {

EngineBase::EngineBase(const EngineOptions& opts) : opts_(opts) {}

FileId EngineBase::add_file(int fd, const std::string& path) {
  if (fd < 0) throw std::invalid_argument("IoEngine::add_file: bad fd for " + path);
  int slot = register_fd(fd);
  std::unique_lock lk(files_mu_);
  FileEntry e{fd, slot, path};
  if (!free_ids_.empty()) {
    FileId id = free_ids_.back();
    free_ids_.pop_back();
    files_[id] = std::move(e);
    return id;
  }
  files_.push_back(std::move(e));
  return static_cast<FileId>(files_.size() - 1);
}

void EngineBase::remove_file(FileId f) {
  int slot;
  {
    std::unique_lock lk(files_mu_);
    assert(f >= 0 && static_cast<size_t>(f) < files_.size() && files_[f].fd >= 0);
    slot = files_[f].fixed;
    files_[f] = FileEntry{};
    free_ids_.push_back(f);
  }
  if (slot >= 0) unregister_fd(slot);
}

std::string EngineBase::file_path(FileId f) const {
  std::shared_lock lk(files_mu_);
  return (f >= 0 && static_cast<size_t>(f) < files_.size()) ? files_[f].path : std::string();
}

EngineStats EngineBase::stats() const {
  EngineStats s;
  s.requests = st_.requests.load();
  s.pieces = st_.pieces.load();
  s.bytes_read = st_.bytes_read.load();
  s.bytes_written = st_.bytes_written.load();
  s.short_requeues = st_.short_requeues.load();
  s.retries = st_.retries.load();
  s.errors = st_.errors.load();
  s.submit_calls = st_.submit_calls.load();
  s.fixed_pieces = st_.fixed_pieces.load();
  return s;
}

std::shared_ptr<Request> EngineBase::make_request(IoOp op, std::span<const IoSpan> spans, RequestOptions&& ropts) {
  auto r = std::make_shared<Request>();
  r->op = op;
  r->label = std::move(ropts.label);
  r->verify = std::move(ropts.verify);
  if (op == IoOp::read) r->check_piece = std::move(ropts.check_piece);
  size_t n_pieces = 0;
  for (const IoSpan& s : spans) {
    if (!is_aligned(s.buf) || !is_aligned(s.offset) || !is_aligned(s.length)) {
      throw AlignmentError(std::string(op == IoOp::read ? "read" : "write") + " of " + file_path(s.file) +
                           ": buffer, offset and length must be multiples of 4096 for O_DIRECT (buffer " +
                           std::to_string(reinterpret_cast<uintptr_t>(s.buf) % kDirectAlign) + " past alignment, offset " +
                           std::to_string(s.offset) + ", length " + std::to_string(s.length) + ")");
    }
    n_pieces += (s.length + opts_.block_bytes - 1) / opts_.block_bytes;
    r->bytes += s.length;
  }
  r->pieces.reserve(n_pieces);
  {
    std::shared_lock lk(files_mu_);
    for (const IoSpan& s : spans) {
      if (s.file < 0 || static_cast<size_t>(s.file) >= files_.size() || files_[s.file].fd < 0)
        throw std::invalid_argument("IoEngine: unknown file id " + std::to_string(s.file));
      const FileEntry& fe = files_[s.file];
      for (uint64_t done = 0; done < s.length; done += opts_.block_bytes) {
        Piece p;
        p.req = r.get();
        p.op = op;
        p.file = s.file;
        p.fd = fe.fd;
        p.fixed_file = fe.fixed;
        p.offset = s.offset + done;
        p.length = std::min<uint64_t>(opts_.block_bytes, s.length - done);
        p.buf = static_cast<char*>(s.buf) + done;
        p.start = p.buf;
        p.total = p.length;
        r->pieces.push_back(p);
      }
    }
  }
  r->pieces_left.store(static_cast<uint32_t>(r->pieces.size()), std::memory_order_relaxed);
  r->t_submit = std::chrono::steady_clock::now();
  st_.requests.fetch_add(1, std::memory_order_relaxed);
  st_.pieces.fetch_add(r->pieces.size(), std::memory_order_relaxed);
  if (r->pieces.empty()) {
    r->done.store(1, std::memory_order_release);
  } else {
    r->self = r;
  }
  return r;
}

Outcome EngineBase::on_result(Piece& p, int64_t res) {
  if (opts_.completion_hook) res = opts_.completion_hook(p.op, p.offset, p.length, res);
  const char* op = p.op == IoOp::read ? "read" : "write";
  auto fail = [&](int err, const std::string& hint) {
    std::string h = hint;
    if (!p.req->label.empty()) h += (h.empty() ? "" : "; ") + p.req->label;
    if (err == ENOSPC) h += (h.empty() ? "" : "; ") + std::string("the disk is full");
    p.req->fail({op, file_path(p.file), h, p.offset, p.length, err});
    st_.errors.fetch_add(1, std::memory_order_relaxed);
    return Outcome::failed;
  };
  if (res == -EAGAIN || res == -EINTR) {
    st_.retries.fetch_add(1, std::memory_order_relaxed);
    return Outcome::requeue;
  }
  if (res < 0) return fail(static_cast<int>(-res), "");
  if (static_cast<uint64_t>(res) > p.length) return fail(EIO, "kernel reported more bytes than requested");
  if (res == 0) {
    if (p.op == IoOp::read) return fail(0, "unexpected end of file (short read, nothing zero-filled)");
    if (++p.zero_progress > 16) return fail(EIO, "write made no progress after 16 attempts");
    return Outcome::requeue;
  }
  p.zero_progress = 0;
  (p.op == IoOp::read ? st_.bytes_read : st_.bytes_written).fetch_add(static_cast<uint64_t>(res), std::memory_order_relaxed);
  if (static_cast<uint64_t>(res) < p.length) {
    p.offset += static_cast<uint64_t>(res);
    p.buf += res;
    p.length -= static_cast<uint64_t>(res);
    st_.short_requeues.fetch_add(1, std::memory_order_relaxed);
    return Outcome::requeue;
  }
  return Outcome::done;
}

}  // namespace detail
}  // namespace strata::io
