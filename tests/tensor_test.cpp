// SPDX-License-Identifier: MIT
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <vector>

#include "test_util.hpp"

namespace {

using apex::Index;
using apex::testing::expect_invalid;

// Element (b, h, s, d) of a [B, H, S, D] tensor stored contiguously.
Index contiguous_offset(Index b, Index h, Index s, Index d, Index heads, Index seq, Index dim) {
  return ((b * heads + h) * seq + s) * dim + d;
}

TEST(Tensor, ContiguousViewAddressesEveryElementOnce) {
  const Index batch = 2, heads = 3, seq = 5, dim = 4;
  std::vector<double> data(static_cast<size_t>(batch * heads * seq * dim));
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<double>(i);
  const auto view =
      apex::HeadsView<const double>::contiguous(data.data(), {batch, heads, seq, dim});
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < heads; ++h)
      for (Index s = 0; s < seq; ++s)
        for (Index d = 0; d < dim; ++d)
          EXPECT_EQ(view.head(b, h)(s, d),
                    static_cast<double>(contiguous_offset(b, h, s, d, heads, seq, dim)));
}

TEST(Tensor, TokenMajorViewReadsHeadsSideBySide) {
  // A projection output [B*S, H*D]: row b*S + s holds head h in columns [h*D, (h+1)*D).
  const Index batch = 2, seq = 3, heads = 4, dim = 2;
  apex::RowMatrix<float> projected(batch * seq, heads * dim);
  for (Index r = 0; r < projected.rows(); ++r)
    for (Index c = 0; c < projected.cols(); ++c) projected(r, c) = static_cast<float>(100 * r + c);
  const auto view =
      apex::HeadsView<const float>::token_major(projected.data(), {batch, heads, seq, dim});
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < heads; ++h)
      EXPECT_EQ(view.head(b, h), projected.block(b * seq, h * dim, seq, dim));
}

TEST(Tensor, SizeOneAxesBroadcast) {
  apex::RowMatrix<float> mask = apex::RowMatrix<float>::Random(3, 5);
  const auto view = apex::as_heads_view(mask);
  EXPECT_EQ(view.head(7, 11), mask);
}

TEST(Tensor, OwningTensorIsZeroedAndWritableThroughItsViews) {
  apex::HeadsTensor<double> tensor({2, 2, 3, 4});
  EXPECT_TRUE(tensor.head(1, 1).isZero());
  tensor.view().head(1, 0)(2, 3) = 42.0;
  EXPECT_EQ(tensor.data()[contiguous_offset(1, 0, 2, 3, 2, 3, 4)], 42.0);
  const apex::HeadsView<const double> read_only = tensor.view();
  EXPECT_EQ(read_only.head(1, 0)(2, 3), 42.0);
}

TEST(Tensor, OwningTensorRejectsNegativeOrOverflowingShapes) {
  expect_invalid(
      [] {
        apex::HeadsTensor<float> t({-1, 1, 1, 1});
      },
      {"[heads_tensor] shape [-1, 1, 1, 1]", "no negative extent"});
  expect_invalid(
      [] {
        apex::HeadsTensor<float> t({2, 3, 4, -5});
      },
      {"[heads_tensor] shape [2, 3, 4, -5]", "no negative extent"});
  // 2^62 · 4 wraps to 0 in 64 bits: the tensor would claim a shape over no storage.
  const Index huge = Index{1} << 62;
  expect_invalid(
      [&] {
        apex::HeadsTensor<float> t({huge, 4, 1, 1});
      },
      {"[heads_tensor] B*H*S*D", "overflows 64 bits"});
  // 2^61 doubles fit in an Index but their 2^64 bytes do not.
  expect_invalid(
      [] {
        apex::HeadsTensor<double> t({1, 1, 1, Index{1} << 61});
      },
      {"[heads_tensor] B*H*S*D bytes", "overflows 64 bits"});
  // A zero extent is a valid, empty tensor, whatever the other extents.
  const apex::HeadsTensor<float> empty({huge, huge, 0, 3});
  EXPECT_EQ(empty.seq(), 0);
  EXPECT_EQ(empty.head(5, 7).size(), 0);
}

TEST(Tensor, EmptyHeadsAreNotOffsetFromTheirData) {
  // The data of an empty Eigen matrix is null; a head with no elements must keep the view's own
  // pointer rather than offset it (offsetting null is undefined even if nothing is read).
  const apex::HeadsView<const double> no_rows(nullptr, {3, 2, 0, 4}, {100, 50, 4});
  const auto head = no_rows.head(2, 1);
  EXPECT_EQ(head.data(), nullptr);
  EXPECT_EQ(head.rows(), 0);
  EXPECT_EQ(head.cols(), 4);
  const apex::HeadsView<const double> no_cols(nullptr, {3, 2, 5, 0}, {100, 50, 0});
  EXPECT_EQ(no_cols.head(1, 1).data(), nullptr);
  // An empty shape has strides 0: its extents' products (here 2^124) are never formed.
  const Index huge = Index{1} << 62;
  const auto empty = apex::HeadsView<const float>::contiguous(nullptr, {0, 1, huge, huge});
  EXPECT_EQ(empty.batch_stride(), 0);
  EXPECT_EQ(empty.head_stride(), 0);
  const auto empty_rows = apex::HeadsView<const float>::token_major(nullptr, {1, huge, 0, huge});
  EXPECT_EQ(empty_rows.row_stride(), 0);
  EXPECT_EQ(empty_rows.head(0, 3).data(), nullptr);
  // A non-empty head is still found at its offset.
  std::vector<double> data(24, 0.0);
  const auto view = apex::HeadsView<const double>::contiguous(data.data(), {2, 3, 2, 2});
  EXPECT_EQ(view.head(1, 2).data(), data.data() + 20);
}

}  // namespace
