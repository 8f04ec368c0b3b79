// NvmeStore: the seam between offload/ and io/. One fixed region of NVMe swap space (allocated
// once, sub-allocated by the nvme arena) read and written asynchronously at 4 KiB-aligned
// offsets. The production store is a SwapSpace extent driven by an IoEngine; tests inject faults
// through their own store.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "offload/fence.h"

namespace strata::io {
class SwapSpace;
}

namespace strata::offload {

class NvmeStore {
 public:
  virtual ~NvmeStore() = default;
  virtual uint64_t capacity() const = 0;  // bytes at offsets [0, capacity)
  // Offset, length and buffer 4 KiB aligned. The returned part completes when the bytes are in
  // `buf` / on disk; waiting on it rethrows the I/O error (path and offset in the message).
  virtual std::shared_ptr<Waitable> read(uint64_t offset, uint64_t length, void* buf) = 0;
  virtual std::shared_ptr<Waitable> write(uint64_t offset, uint64_t length, const void* buf) = 0;
  // Makes [offset, offset + length) (4 KiB aligned, nothing in flight on it) read as zeros, now.
  // The production store records the range as zeros without writing it; this default writes
  // zeros through write().
  virtual void zero(uint64_t offset, uint64_t length);
  // A long-lived staging buffer the engine may register (io_uring fixed buffers). Best effort.
  virtual void register_buffer(void* /*p*/, size_t /*bytes*/) {}
  virtual void unregister_buffer(void* /*p*/) {}  // before the buffer is freed, nothing in flight
  // Names the block whose home is [offset, offset + bytes), so a read that fails verification
  // says which block's bytes were corrupt. Called before any I/O on the range.
  virtual void name_range(uint64_t /*offset*/, uint64_t /*bytes*/, const std::string& /*name*/) {}
};

// The production store: one extent of `bytes` in `space` (fallocated now, so a full disk fails
// here with the path), freed on destruction. `space` must outlive the store. Reads are verified
// against the crc32c of what was written when the space has checksums on; a mismatch is an
// io::ChecksumError naming the swap file, the byte offset and the block (name_range).
std::unique_ptr<NvmeStore> make_swap_store(io::SwapSpace& space, uint64_t bytes);

}  // namespace strata::offload
