// SwapSpace: 4 KiB-aligned extents in preallocated swap files, one file per --nvme-path
// directory (one per SSD), large extents striped RAID-0 across them. crc32c per 4 KiB block
// written, verified on every read of it, so corruption on disk is an error, never training data. Files live in a private 0700 directory and are removed on destruction.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/engine.h"

namespace strata::io {

inline constexpr uint64_t kChecksumBlock = 4096;  // bytes per crc32c (the O_DIRECT alignment)

struct SwapOptions {
  std::vector<std::string> paths;      // directories, one per SSD; at least one
  uint64_t stripe_bytes = 1 << 20;     // RAID-0 stripe unit across paths (multiple of 4 KiB)
  // crc32c per 4 KiB block, computed on the writing thread and verified on every read (whole or
  // sub-range) by the first thread to wait for it. Costs 5 bytes of RAM per 4 KiB of extent.
  bool checksums = true;
  bool allow_buffered = false;         // a path whose filesystem rejects O_DIRECT: use buffered I/O (warns)
  std::string path_flag = "--nvme-path";  // the flag that gave `paths`, as errors name it
  bool test_reject_direct = false;     // tests: act as if every path's filesystem rejected O_DIRECT
  bool test_no_zero_range = false;     // tests: act as if no filesystem could fallocate ZERO_RANGE
};

// A handle to allocated swap bytes. `bytes` is the allocation rounded up to 4 KiB.
struct Extent {
  uint64_t id = 0;
  uint64_t bytes = 0;
  explicit operator bool() const { return id != 0; }
};

struct SwapStats {
  uint64_t bytes_allocated = 0;   // live extents
  uint64_t bytes_reserved = 0;    // file space preallocated, all paths
  uint64_t extents = 0;
  uint64_t checksum_failures = 0;
  double checksum_ms = 0;         // time summing and checking checksums since start, summed over threads
  bool buffered = false;          // some path fell back to buffered I/O
};

class SwapSpace {
 public:
  // Creates a private directory + swap file under each path. Throws IoError naming the path if it
  // is missing, not writable, or rejects O_DIRECT (unless allow_buffered).
  SwapSpace(const SwapOptions& opts, IoEngine& engine);
  ~SwapSpace();  // waits for nothing: the caller must have waited on its handles
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Reserve `bytes` (rounded up to 4 KiB); space is fallocate'd now, so a full disk fails here
  // (IoError with path and errno) and leaves every existing extent intact.
  Extent allocate(uint64_t bytes);
  void free(Extent& e);  // no I/O may be in flight on it; resets e

  // Whole-extent I/O: buf is 4 KiB aligned and holds e.bytes. With checksums on, a write records
  // the crc32c of each 4 KiB block of buf and a read verifies every block it covers that was ever
  // written, in wait(): a ChecksumError names the swap file, the byte offset in it and the block.
  IoHandle write(const Extent& e, const void* buf);
  IoHandle read(const Extent& e, void* buf);
  // Sub-range I/O (aligned offset/length inside the extent), checksummed the same way.
  IoHandle write(const Extent& e, uint64_t offset, uint64_t length, const void* buf);
  IoHandle read(const Extent& e, uint64_t offset, uint64_t length, void* buf);
  // Makes [offset, offset + length) (aligned) read as zeros, and with checksums on verify as
  // zeros: state that starts as zeros (AdamW's moments) then costs no write. Where the
  // filesystem can, without writing them (fallocate ZERO_RANGE: the range becomes unwritten
  // extents, a metadata change); elsewhere by writing zeros. Synchronous; nothing may be in
  // flight on the range. Throws IoError with the path and offset.
  void zero(const Extent& e, uint64_t offset, uint64_t length);

  IoEngine& engine() { return engine_; }
  SwapStats stats() const;
  std::vector<std::string> files() const;  // the swap files, one per path

 private:
  struct Impl;
  IoHandle extent_io(IoOp op, const Extent& e, uint64_t offset, uint64_t length, void* buf);
  std::unique_ptr<Impl> impl_;
  IoEngine& engine_;
};

}  // namespace strata::io
