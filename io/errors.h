// Errors raised by io/: every failure names the file, the byte range and the errno, so a
// disk-full, a short read or a bad block can be traced to the extent that hit it.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace strata::io {

// A failed read/write/allocation. errno_value() is 0 when the failure is not a syscall's
// (unexpected end of file, misalignment reported by us).
class IoError : public std::runtime_error {
 public:
  IoError(const std::string& what_op, std::string path, uint64_t offset, uint64_t length, int err,
          const std::string& hint = "");
  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }
  uint64_t length() const { return length_; }
  int errno_value() const { return errno_; }

 private:
  std::string path_;
  uint64_t offset_ = 0;
  uint64_t length_ = 0;
  int errno_ = 0;
};

// Buffer, offset or length not 4 KiB aligned: rejected before the kernel sees it.
class AlignmentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Data read back from swap does not match the crc32c recorded when it was written. Names the
// swap file and the byte offset in it of the first bad checksum block (4 KiB), which block of
// which extent that is, and how many blocks of the read were bad. with_context() adds what the
// caller knows about the bytes (e.g. the offload block that owns them).
class ChecksumError : public std::runtime_error {
 public:
  struct Where {
    std::string path;            // the swap file
    uint64_t file_offset = 0;    // byte offset of the first bad checksum block in that file
    uint64_t extent_id = 0;
    uint64_t extent_offset = 0;  // byte offset of that block in its extent
    uint64_t block_bytes = 0;    // checksum block size
    uint64_t bad_blocks = 0;     // bad checksum blocks in the read
    uint32_t expected = 0, actual = 0;  // crc32c of the first bad block: recorded, read back
    std::string context;
  };
  explicit ChecksumError(Where w);
  ChecksumError with_context(const std::string& context) const;
  const Where& where() const { return w_; }
  const std::string& path() const { return w_.path; }
  uint64_t file_offset() const { return w_.file_offset; }
  uint64_t extent_id() const { return w_.extent_id; }
  uint64_t extent_offset() const { return w_.extent_offset; }
  uint64_t block_index() const { return w_.block_bytes ? w_.extent_offset / w_.block_bytes : 0; }
  uint32_t expected() const { return w_.expected; }
  uint32_t actual() const { return w_.actual; }

 private:
  Where w_;
};

}  // namespace strata::io
