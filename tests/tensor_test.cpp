// SPDX-License-Identifier: MIT
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

namespace {

using apex::Index;

// Element (b, h, s, d) of a [B, H, S, D] tensor stored contiguously.
Index contiguous_offset(Index b, Index h, Index s, Index d, Index heads, Index seq, Index dim) {
  return ((b * heads + h) * seq + s) * dim + d;
}

TEST(Tensor, ContiguousViewAddressesEveryElementOnce) {
  const Index batch = 2, heads = 3, seq = 5, dim = 4;
  std::vector<double> data(static_cast<size_t>(batch * heads * seq * dim));
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<double>(i);
  const auto view = apex::HeadsView<const double>::contiguous(data.data(), batch, heads, seq, dim);
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
      apex::HeadsView<const float>::token_major(projected.data(), batch, seq, heads, dim);
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
  apex::HeadsTensor<double> tensor(2, 2, 3, 4);
  EXPECT_TRUE(tensor.head(1, 1).isZero());
  tensor.view().head(1, 0)(2, 3) = 42.0;
  EXPECT_EQ(tensor.data()[contiguous_offset(1, 0, 2, 3, 2, 3, 4)], 42.0);
  const apex::HeadsView<const double> read_only = tensor.view();
  EXPECT_EQ(read_only.head(1, 0)(2, 3), 42.0);
}

}  // namespace
