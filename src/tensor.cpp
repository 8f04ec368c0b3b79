// Tensor views and shape checks.
#include "src/tensor.h"

#include <stdexcept>

namespace strata {

Shape::Shape(std::initializer_list<int64_t> dims) {
  if (dims.size() > kMaxDims) throw std::invalid_argument("Shape: more than " + std::to_string(kMaxDims) + " dims");
  for (int64_t d : dims) {
    if (d < 0) throw std::invalid_argument("Shape: negative dimension " + std::to_string(d));
    dims_[rank_++] = d;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + ")";
}

Tensor::Tensor(void* data, DType dtype, Shape shape) : data_(data), dtype_(dtype), shape_(shape) {
  int64_t st = 1;
  for (int d = shape_.rank() - 1; d >= 0; --d) {
    strides_[d] = st;
    st *= shape_[d];
  }
}

bool Tensor::is_contiguous() const {
  int64_t st = 1;
  for (int d = rank() - 1; d >= 0; --d) {
    if (shape_[d] != 1 && strides_[d] != st) return false;
    st *= shape_[d];
  }
  return true;
}

Tensor Tensor::slice(int dim, int64_t start, int64_t length) const {
  if (dim < 0 || dim >= rank()) throw std::invalid_argument("slice: dim " + std::to_string(dim) + " of " + str());
  if (start < 0 || length < 0 || start + length > shape_[dim])
    throw std::invalid_argument("slice: [" + std::to_string(start) + ", " + std::to_string(start + length) +
                                ") outside dim " + std::to_string(dim) + " of " + str());
  Tensor t = *this;
  t.data_ = static_cast<char*>(data_) + start * strides_[dim] * static_cast<int64_t>(kernels::dtype_size(dtype_));
  t.shape_[dim] = length;
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  if (!is_contiguous()) throw std::invalid_argument("reshape: " + str() + " is not contiguous");
  if (shape.numel() != numel())
    throw std::invalid_argument("reshape: " + str() + " has " + std::to_string(numel()) + " elements, " +
                                shape.str() + " needs " + std::to_string(shape.numel()));
  return Tensor(data_, dtype_, shape);
}

Tensor Tensor::transpose(int d0, int d1) const {
  if (d0 < 0 || d0 >= rank() || d1 < 0 || d1 >= rank())
    throw std::invalid_argument("transpose: dims " + std::to_string(d0) + ", " + std::to_string(d1) + " of " + str());
  Tensor t = *this;
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

int64_t Tensor::offset_of(std::initializer_list<int64_t> index) const {
  if (static_cast<int>(index.size()) != rank())
    throw std::invalid_argument("index of rank " + std::to_string(index.size()) + " for " + str());
  int64_t off = 0;
  int d = 0;
  for (int64_t i : index) {
    if (i < 0 || i >= shape_[d]) throw std::invalid_argument("index " + std::to_string(i) + " out of range in " + str());
    off += i * strides_[d++];
  }
  return off;
}

float Tensor::get(std::initializer_list<int64_t> index) const {
  return kernels::load_as_f32(data_, dtype_, static_cast<size_t>(offset_of(index)));
}
void Tensor::set(std::initializer_list<int64_t> index, float value) const {
  kernels::store_from_f32(data_, dtype_, static_cast<size_t>(offset_of(index)), value);
}

std::string Tensor::str() const { return std::string(kernels::dtype_name(dtype_)) + shape_.str(); }

void check_shape(const Tensor& t, const Shape& expected, const char* what) {
  if (!(t.shape() == expected))
    throw std::invalid_argument(std::string(what) + ": expected shape " + expected.str() + ", got " + t.shape().str());
}
void check_dtype(const Tensor& t, DType expected, const char* what) {
  if (t.dtype() != expected)
    throw std::invalid_argument(std::string(what) + ": expected dtype " + std::string(kernels::dtype_name(expected)) +
                                ", got " + std::string(kernels::dtype_name(t.dtype())));
}

}  // namespace strata
