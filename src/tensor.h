// Tensor: a shape, a dtype and strides over memory it does not own (the memory comes from the
// runtime's allocators, later from offload/'s pools). Views slice, reshape and transpose
// without copying.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernels/dtype.h"

namespace strata {

using kernels::DType;

constexpr int kMaxDims = 6;

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int rank() const { return rank_; }
  int64_t operator[](int d) const { return dims_[d]; }
  int64_t& operator[](int d) { return dims_[d]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "(2, 3, 4)"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

class Tensor {
 public:
  Tensor() = default;
  // A contiguous (row-major) view of `data`.
  Tensor(void* data, DType dtype, Shape shape);

  void* data() const { return data_; }
  template <class T> T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  int64_t size(int d) const { return shape_[d]; }
  int64_t stride(int d) const { return strides_[d]; }  // in elements
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * kernels::dtype_size(dtype_); }
  bool is_contiguous() const;

  // Views. Errors (bad dim, out of range, incompatible shape) throw std::invalid_argument.
  Tensor slice(int dim, int64_t start, int64_t length) const;
  Tensor reshape(Shape shape) const;  // requires a contiguous tensor
  Tensor transpose(int d0, int d1) const;
  Tensor flatten() const { return reshape(Shape{numel()}); }

  // Element access for tests and small host-side work (slow: one element at a time).
  float get(std::initializer_list<int64_t> index) const;
  void set(std::initializer_list<int64_t> index, float value) const;

  std::string str() const;  // "bf16(2, 3)"

 private:
  int64_t offset_of(std::initializer_list<int64_t> index) const;
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Shape shape_;
  std::array<int64_t, kMaxDims> strides_{};
};

// Throws std::invalid_argument "<what>: expected shape A, got B" when they differ.
void check_shape(const Tensor& t, const Shape& expected, const char* what);
void check_dtype(const Tensor& t, DType expected, const char* what);

}  // namespace strata
