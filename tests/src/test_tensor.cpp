// Tensor views: strides, slices, reshape, transpose, element access, shape errors.
#include <gtest/gtest.h>

#include <vector>

#include "src/tensor.h"

using namespace strata;

TEST(Tensor, ContiguousStridesAndViews) {
  std::vector<float> buf(2 * 3 * 4);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i);
  Tensor t(buf.data(), DType::f32, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.stride(2), 1);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.get({1, 2, 3}), 23.f);

  Tensor s = t.slice(1, 1, 2);
  EXPECT_EQ(s.shape(), Shape({2, 2, 4}));
  EXPECT_EQ(s.get({0, 0, 0}), 4.f);
  EXPECT_EQ(s.get({1, 1, 3}), 23.f);
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_THROW(s.reshape({16}), std::invalid_argument);

  Tensor tr = t.transpose(0, 2);
  EXPECT_EQ(tr.shape(), Shape({4, 3, 2}));
  EXPECT_EQ(tr.get({3, 2, 1}), 23.f);
  EXPECT_EQ(tr.get({1, 0, 1}), 13.f);

  Tensor r = t.reshape({6, 4});
  EXPECT_EQ(r.get({5, 3}), 23.f);
  EXPECT_THROW(t.reshape({5, 5}), std::invalid_argument);
  EXPECT_THROW(t.slice(1, 2, 2), std::invalid_argument);
  EXPECT_THROW(t.get({2, 0, 0}), std::invalid_argument);
}

TEST(Tensor, Bf16ElementsRoundToNearestEven) {
  std::vector<uint16_t> buf(4);
  Tensor t(buf.data(), DType::bf16, {4});
  t.set({0}, 1.0f);
  t.set({1}, 1.00390625f);  // exactly halfway between bf16 1.0 and 1.0078125: ties to even
  EXPECT_EQ(t.get({0}), 1.0f);
  EXPECT_EQ(t.get({1}), 1.0f);
  EXPECT_EQ(t.nbytes(), 8u);
}

TEST(Tensor, ShapeAndDtypeChecksNameTheTensor) {
  std::vector<float> buf(6);
  Tensor t(buf.data(), DType::f32, {2, 3});
  EXPECT_NO_THROW(check_shape(t, {2, 3}, "x"));
  try {
    check_shape(t, {3, 2}, "attn.q");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("attn.q: expected shape (3, 2), got (2, 3)"), std::string::npos);
  }
  EXPECT_THROW(check_dtype(t, DType::bf16, "w"), std::invalid_argument);
  EXPECT_THROW(Shape({1, 2, 3, 4, 5, 6, 7}), std::invalid_argument);
}
