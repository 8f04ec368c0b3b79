// AlignedBuffer: an owned host buffer aligned for O_DIRECT (4 KiB), the unit io/ reads into
// and writes from when the caller has no pinned buffer of its own.
#pragma once
#include <cstddef>
#include <cstdint>

namespace strata::io {

constexpr size_t kDirectAlign = 4096;

inline bool is_aligned(uint64_t v, size_t align = kDirectAlign) { return v % align == 0; }
inline bool is_aligned(const void* p, size_t align = kDirectAlign) {
  return reinterpret_cast<uintptr_t>(p) % align == 0;
}
inline uint64_t round_up(uint64_t v, uint64_t align = kDirectAlign) { return (v + align - 1) / align * align; }

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes, size_t align = kDirectAlign);
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  void* data() const { return p_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace strata::io
