// `strata bench io`: drive the NVMe engine the way fio does (fixed block size, queue depth,
// sequential or random, O_DIRECT) through SwapSpace, and print one JSON line that
// bench/io/compare_fio.sh sets beside fio's numbers.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <functional>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/strata/commands.h"
#include "io/aligned_buffer.h"
#include "io/engine.h"
#include "io/swap_space.h"
#include "offload/size.h"

namespace strata::app {
namespace {

struct BenchIoArgs {
  std::vector<std::string> paths;
  std::string file;
  std::string size = "4G";
  std::string block = "1M";
  unsigned qd = 32;
  std::string mode = "read";
  std::string engine = "uring";
  std::string reap = "caller";
  bool allow_buffered = false;
};

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

struct PassResult {
  double seconds = 0, cpu_s = 0;
  std::vector<double> lat_us;
};

// One pass over the extent: `qd` block-sized requests in flight, each slot re-issued as soon as
// it completes (slots are waited round-robin: for one device completions come nearly in order).
// `submit(op, offset, buf)` issues one block: through SwapSpace, or on a given file.
using Submit = std::function<io::IoHandle(io::IoOp, uint64_t, char*)>;

// `mixed`: even-numbered blocks of the order are written and odd ones read (the step's traffic:
// write-backs and reads in flight together); otherwise every block is `op`.
PassResult run_pass(const Submit& submit, io::IoOp op, const std::vector<uint64_t>& order, uint64_t block, unsigned qd,
                    char* pool, bool mixed = false) {
  PassResult r;
  r.lat_us.reserve(order.size());
  std::vector<io::IoHandle> slot(qd);
  size_t next = 0;
  auto issue = [&](unsigned s) {
    const uint64_t i = next++;
    const uint64_t off = order[i] * block;
    char* buf = pool + uint64_t{s} * block;
    slot[s] = submit(mixed ? (i % 2 ? io::IoOp::read : io::IoOp::write) : op, off, buf);
  };
  double cpu0 = cpu_seconds();
  auto t0 = std::chrono::steady_clock::now();
  for (unsigned s = 0; s < qd && next < order.size(); ++s) issue(s);
  for (size_t done = 0; done < order.size();) {
    for (unsigned s = 0; s < qd; ++s) {
      if (!slot[s].valid()) continue;
      slot[s].wait();
      r.lat_us.push_back(slot[s].latency_us());
      slot[s] = io::IoHandle();
      ++done;
      if (next < order.size()) issue(s);
    }
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.cpu_s = cpu_seconds() - cpu0;
  return r;
}

// A size flag parsed, its own name in the error.
uint64_t parse_size_flag(const std::string& flag, const std::string& text) {
  try {
    return offload::parse_size(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument("bench io " + flag + ": " + e.what());
  }
}

int bench_io(const BenchIoArgs& a) {
  // Each flag checked on its own first, so the error names the one to change.
  constexpr uint64_t kMaxBlock = 1ull << 30;   // the engine's largest request
  constexpr unsigned kMaxQd = 4096;            // io_uring's queue entries (the ring holds --qd + 1)
  const uint64_t size = parse_size_flag("--size", a.size), block = parse_size_flag("--block", a.block);
  if (size < io::kDirectAlign)
    throw std::invalid_argument("bench io --size " + a.size + ": give at least 4K bytes to move, e.g. --size 4G");
  if (block == 0 || block % io::kDirectAlign || block > kMaxBlock)
    throw std::invalid_argument("bench io --block " + a.block +
                                ": give a request size that is a multiple of 4 KiB, from 4K to 1G, e.g. --block 1M");
  if (size < block)
    throw std::invalid_argument("bench io --size " + a.size + " is smaller than --block " + a.block +
                                ": give a --size of at least one block");
  if (a.qd == 0 || a.qd > kMaxQd)
    throw std::invalid_argument("bench io --qd " + std::to_string(a.qd) + ": give 1 to " + std::to_string(kMaxQd) +
                                " requests in flight (io_uring's limit is " + std::to_string(kMaxQd) + " entries)");
  // The staging buffers, one block per request in flight, are pinned in RAM.
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  const uint64_t ram = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
  if (ram && uint64_t{a.qd} * block > ram / 2)
    throw std::invalid_argument("bench io --qd " + std::to_string(a.qd) + " x --block " + a.block + " needs " +
                                offload::format_size(uint64_t{a.qd} * block) + " of staging buffers, more than half of "
                                "this machine's RAM (" + offload::format_size(ram) + "); lower --qd or --block");
  const bool random = a.mode == "randread" || a.mode == "randwrite";
  const bool mixed = a.mode == "rw";
  const io::IoOp op = (a.mode == "read" || a.mode == "randread" || mixed) ? io::IoOp::read : io::IoOp::write;
  if (!random && !mixed && a.mode != "read" && a.mode != "write")
    throw std::invalid_argument("--mode must be read, write, rw, randread or randwrite");

  io::EngineOptions eo;
  eo.kind = io::parse_engine_kind(a.engine);
  eo.queue_depth = a.qd;
  eo.block_bytes = std::min<uint64_t>(block, 1 << 30);
  eo.n_threads = a.qd;  // the threads engine's depth is its thread count
  eo.reaper_thread = a.reap == "thread";
  auto engine = io::make_engine(eo);
  const uint64_t n_blocks = size / block;
  io::AlignedBuffer pool(uint64_t{a.qd} * block);  // (qd, block) staging buffers, registered once
  for (uint64_t i = 0; i < pool.size() / 8; ++i) pool.as<uint64_t>()[i] = i * 0x9E3779B97F4A7C15ull;
  bool registered = engine->register_buffer(pool.data(), pool.size());
  std::vector<uint64_t> order(n_blocks);
  std::iota(order.begin(), order.end(), 0);
  auto shuffle = [&] {
    if (random) std::shuffle(order.begin(), order.end(), std::mt19937_64(42));
  };
  PassResult r;
  bool buffered = false;
  if (!a.file.empty()) {
    // An existing file (e.g. the one fio laid out), so both tools read the same blocks.
    int flags = O_RDWR | O_DIRECT | O_CLOEXEC | (op == io::IoOp::write ? O_CREAT : 0);
    int fd = ::open(a.file.c_str(), flags, 0600);
    if (fd < 0) throw io::IoError("open", a.file, 0, 0, errno, "--file must exist (reads) on a filesystem with O_DIRECT");
    struct stat st{};
    if (::fstat(fd, &st) != 0 || (op == io::IoOp::read && static_cast<uint64_t>(st.st_size) < n_blocks * block)) {
      ::close(fd);
      throw io::IoError("open", a.file, 0, n_blocks * block, 0, "--file is smaller than --size");
    }
    io::FileId f = engine->add_file(fd, a.file);
    shuffle();
    r = run_pass([&](io::IoOp o, uint64_t off, char* buf) {
      return o == io::IoOp::read ? engine->read(f, off, block, buf) : engine->write(f, off, block, buf);
    }, op, order, block, a.qd, pool.as<char>(), mixed);
    engine->remove_file(f);
    ::close(fd);
  } else {
    if (a.paths.empty()) throw std::invalid_argument("bench io needs --path DIR (or --file FILE)");
    io::SwapOptions so;
    so.paths = a.paths;
    so.stripe_bytes = block;
    so.allow_buffered = a.allow_buffered;
    so.path_flag = "--path";
    io::SwapSpace swap(so, *engine);
    io::Extent ext = swap.allocate(n_blocks * block);
    Submit through_swap = [&](io::IoOp o, uint64_t off, char* buf) {
      return o == io::IoOp::read ? swap.read(ext, off, block, buf) : swap.write(ext, off, block, buf);
    };
    if (op == io::IoOp::read) {  // fallocated space reads as zeros without touching the disk: fill it first
      run_pass(through_swap, io::IoOp::write, order, block, a.qd, pool.as<char>());
    }
    shuffle();
    r = run_pass(through_swap, op, order, block, a.qd, pool.as<char>(), mixed);
    buffered = swap.stats().buffered;
    swap.free(ext);
  }

  std::vector<double> lat = r.lat_us;
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) { return lat.empty() ? 0.0 : lat[std::min(lat.size() - 1, static_cast<size_t>(p * lat.size()))]; };
  const double bytes = static_cast<double>(n_blocks * block);
  nlohmann::json j;
  j["bench"] = "io";
  j["engine"] = io::to_string(engine->kind());
  j["reap"] = a.reap;
  j["mode"] = a.mode;
  j["paths"] = a.paths.size();
  j["size_bytes"] = n_blocks * block;
  j["block_bytes"] = block;
  j["qd"] = a.qd;
  j["registered_buffers"] = registered;
  j["buffered"] = buffered;
  j["target"] = a.file.empty() ? "swap" : "file";
  j["seconds"] = r.seconds;
  j["mb_per_s"] = bytes / 1e6 / r.seconds;
  j["iops"] = n_blocks / r.seconds;
  j["p50_us"] = pct(0.50);
  j["p99_us"] = pct(0.99);
  j["cpu_s_per_gb"] = r.cpu_s / (bytes / 1e9);
  io::EngineStats st = engine->stats();
  j["short_requeues"] = st.short_requeues;
  j["retries"] = st.retries;
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

void register_bench_io(CLI::App& bench, Run& run) {
  auto args = std::make_shared<BenchIoArgs>();
  CLI::App* cmd = bench.add_subcommand("io", "Sequential/random O_DIRECT I/O through the NVMe engine (compare with fio)");
  cmd->add_option("--path", args->paths, "Directory for the swap file; repeat once per SSD to stripe");
  cmd->add_option("--file", args->file, "Instead of --path: an existing file to read (or a file to write), e.g. fio's");
  cmd->add_option("--size", args->size, "Bytes to move, e.g. 4G")->capture_default_str();
  cmd->add_option("--block", args->block, "Request size, e.g. 1M (also the stripe unit)")->capture_default_str();
  cmd->add_option("--qd", args->qd, "Requests in flight")->capture_default_str();
  cmd->add_option("--mode", args->mode, "read | write | rw (half the blocks written, half read, in flight together) | randread | randwrite")->capture_default_str();
  cmd->add_option("--engine", args->engine, "uring | threads | auto")->capture_default_str();
  cmd->add_option("--reap", args->reap, "Who reaps completions: caller (this thread) | thread (a reaper thread)")
      ->capture_default_str();
  cmd->add_flag("--allow-buffered-io", args->allow_buffered, "Fall back to buffered I/O where O_DIRECT is rejected");
  cmd->callback([&run, args] { run = [args] { return bench_io(*args); }; });
}

}  // namespace strata::app
