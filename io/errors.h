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

// Data read back from an extent does not match the crc32c recorded when it was written.
class ChecksumError : public std::runtime_error {
 public:
  ChecksumError(uint64_t extent_id, uint64_t bytes, uint32_t expected, uint32_t actual, const std::string& where);
  uint64_t extent_id() const { return extent_id_; }
  uint32_t expected() const { return expected_; }
  uint32_t actual() const { return actual_; }

 private:
  uint64_t extent_id_;
  uint32_t expected_, actual_;
};

}  // namespace strata::io
