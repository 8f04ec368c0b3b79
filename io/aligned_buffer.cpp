// AlignedBuffer allocation (large buffers advised as huge pages).
#include "io/aligned_buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace strata::io {

AlignedBuffer::AlignedBuffer(size_t bytes, size_t align) : bytes_(bytes) {
  size_t rounded = round_up(bytes ? bytes : 1, align);
  p_ = std::aligned_alloc(align, rounded);
  if (!p_) throw std::runtime_error("AlignedBuffer: cannot allocate " + std::to_string(bytes) + " bytes");
  if (rounded >= (size_t{2} << 20)) madvise(p_, rounded, MADV_HUGEPAGE);  // advisory
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(p_);
    p_ = std::exchange(o.p_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(p_); }

}  // namespace strata::io
