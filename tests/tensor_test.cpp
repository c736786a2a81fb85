// SPDX-License-Identifier: MIT
#include <apex/tensor.hpp>

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "test_util.hpp"

namespace tensor_test {
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

// Class 7, "a view larger than its buffer": the factories that take the buffer itself check that
// it holds what the shape addresses; the pointer forms cannot.

// Expects two views of the same elements: same pointer, extents and strides.
template <class T, class U>
void expect_same_view(const apex::HeadsView<T>& checked, const apex::HeadsView<U>& raw) {
  EXPECT_EQ(checked.data(), raw.data());
  EXPECT_EQ(checked.shape(), raw.shape());
  EXPECT_EQ(checked.batch_stride(), raw.batch_stride());
  EXPECT_EQ(checked.head_stride(), raw.head_stride());
  EXPECT_EQ(checked.row_stride(), raw.row_stride());
}

// A [rows, cols] matrix whose element (r, c) is 1000 r + c.
apex::RowMatrix<float> numbered(Index rows, Index cols) {
  apex::RowMatrix<float> m(rows, cols);
  for (Index r = 0; r < rows; ++r)
    for (Index c = 0; c < cols; ++c) m(r, c) = static_cast<float>(1000 * r + c);
  return m;
}

TEST(Tensor, ViewLargerThanBuffer_TokenMajorOfAMatrixIsThePointerFormChecked) {
  const Index batch = 2, seq = 3, heads = 4, dim = 5;
  const apex::HeadsShape shape{batch, heads, seq, dim};
  apex::RowMatrix<float> projected = numbered(batch * seq, heads * dim);
  const auto raw = apex::HeadsView<const float>::token_major(projected.data(), shape);
  expect_same_view(apex::HeadsView<const float>::token_major(projected, shape), raw);
  const apex::RowMatrix<float>& read_only = projected;
  expect_same_view(apex::HeadsView<const float>::token_major(read_only, shape), raw);
  const Eigen::Map<const apex::RowMatrix<float>> map(projected.data(), batch * seq, heads * dim);
  expect_same_view(apex::HeadsView<const float>::token_major(map, shape), raw);
  const apex::ConstRowRef<float> ref(projected);
  expect_same_view(apex::HeadsView<const float>::token_major(ref, shape), raw);

  // Writable views of the matrix (writing into it), of a Ref and of a Map to it.
  const auto writable = apex::HeadsView<float>::token_major(projected, shape);
  expect_same_view(writable, raw);
  writable.head(1, 2)(0, 4) = -1.0f;
  EXPECT_EQ(projected(1 * seq + 0, 2 * dim + 4), -1.0f);
  apex::RowRef<float> writable_ref(projected);
  expect_same_view(apex::HeadsView<float>::token_major(writable_ref, shape), raw);
  Eigen::Map<apex::RowMatrix<float>> writable_map(projected.data(), batch * seq, heads * dim);
  expect_same_view(apex::HeadsView<float>::token_major(writable_map, shape), raw);

  // A range or a pointer with a count holding B·S·H·D elements.
  std::vector<float> flat(projected.data(), projected.data() + projected.size());
  expect_same_view(apex::HeadsView<float>::token_major(flat, shape),
                   apex::HeadsView<float>::token_major(flat.data(), shape));
  expect_same_view(
      apex::HeadsView<const float>::token_major(flat.data(), Index(flat.size()), shape),
      apex::HeadsView<const float>::token_major(flat.data(), shape));
}

TEST(Tensor, ViewLargerThanBuffer_TokenMajorOfABlockOfColumnsUsesItsOuterStride) {
  // A fused projection [B*S, (H_q + 2 H_kv)*D]: Q, K and V side by side in every row.
  const Index batch = 2, seq = 3, q_heads = 4, kv_heads = 2, dim = 3;
  apex::RowMatrix<float> qkv = numbered(batch * seq, (q_heads + 2 * kv_heads) * dim);
  const auto k = apex::HeadsView<const float>::token_major(
      qkv.middleCols(q_heads * dim, kv_heads * dim), {batch, kv_heads, seq, dim});
  EXPECT_EQ(k.row_stride(), qkv.cols());
  EXPECT_EQ(k.batch_stride(), seq * qkv.cols());
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < kv_heads; ++h)
      EXPECT_EQ(k.head(b, h), qkv.block(b * seq, (q_heads + h) * dim, seq, dim));
  // A writable view of a temporary block writes into the matrix, and apex may write through it.
  const auto v = apex::HeadsView<float>::token_major(qkv.rightCols(kv_heads * dim),
                                                     {batch, kv_heads, seq, dim});
  EXPECT_TRUE(apex::detail::elements_distinct(v));
  v.head(1, 1)(2, 0) = -1.0f;
  EXPECT_EQ(qkv(1 * seq + 2, (q_heads + kv_heads + 1) * dim), -1.0f);
}

TEST(Tensor, ViewLargerThanBuffer_ContiguousOfABufferIsThePointerFormChecked) {
  const apex::HeadsShape shape{2, 3, 4, 5};
  const Index elements = 2 * 3 * 4 * 5;
  apex::RowMatrix<double> rows(2 * 3 * 4, 5);  // [B*H*S, D]
  rows.setRandom();
  expect_same_view(apex::HeadsView<double>::contiguous(rows, shape),
                   apex::HeadsView<double>::contiguous(rows.data(), shape));
  apex::Vector<double> column(elements);
  expect_same_view(apex::HeadsView<const double>::contiguous(column, shape),
                   apex::HeadsView<const double>::contiguous(column.data(), shape));
  std::vector<double> vector(static_cast<size_t>(elements));
  expect_same_view(apex::HeadsView<double>::contiguous(vector, shape),
                   apex::HeadsView<double>::contiguous(vector.data(), shape));
  const std::array<double, 2 * 3 * 4 * 5> array{};
  expect_same_view(apex::HeadsView<const double>::contiguous(array, shape),
                   apex::HeadsView<const double>::contiguous(array.data(), shape));
  expect_same_view(apex::HeadsView<double>::contiguous(vector.data(), elements, shape),
                   apex::HeadsView<double>::contiguous(vector.data(), shape));
  // Whole rows of a bigger matrix are contiguous too.
  apex::RowMatrix<double> taller(2 * 3 * 4 + 7, 5);
  expect_same_view(apex::HeadsView<double>::contiguous(taller.topRows(2 * 3 * 4), shape),
                   apex::HeadsView<double>::contiguous(taller.data(), shape));
  // An empty shape over an empty buffer.
  const apex::RowMatrix<float> none(0, 64);
  EXPECT_EQ(apex::HeadsView<const float>::token_major(none, {1, 1, 0, 64}).seq(), 0);
  EXPECT_EQ(apex::HeadsView<const float>::contiguous(none, {1, 8, 0, 64}).heads(), 8);
}

TEST(Tensor, ViewLargerThanBuffer_EightHeadsViewedAsThirtyTwoThrow) {
  // The hazard this class is named after: a buffer of 8 heads viewed as 32 would read 4 times
  // past its end through the pointer form.
  const Index n = 5;
  const apex::HeadsShape thirty_two{1, 32, n, 64};
  const apex::RowMatrix<float> eight_heads(n, 8 * 64);
  expect_invalid([&] { apex::HeadsView<const float>::token_major(eight_heads, thirty_two); },
                 {"[heads_view] token_major matrix cols (512)",
                  "must be heads * dim (32 * 64 = 2048) for shape [1, 32, 5, 64]"});
  const std::vector<float> flat(static_cast<size_t>(n * 8 * 64));
  expect_invalid([&] { apex::HeadsView<const float>::token_major(flat, thirty_two); },
                 {"[heads_view] token_major buffer size (2560)",
                  "must be B*H*S*D (10240) for shape [1, 32, 5, 64]"});
  expect_invalid(
      [&] {
        apex::HeadsView<const float>::token_major(flat.data(), Index(flat.size()), thirty_two);
      },
      "[heads_view] token_major buffer size (2560) must be B*H*S*D (10240)");
  expect_invalid([&] { apex::HeadsView<const float>::contiguous(eight_heads, thirty_two); },
                 "[heads_view] contiguous matrix size (2560) must be B*H*S*D (10240)");
  expect_invalid([&] { apex::HeadsView<const float>::contiguous(flat, thirty_two); },
                 "[heads_view] contiguous buffer size (2560) must be B*H*S*D (10240)");
}

TEST(Tensor, ViewLargerThanBuffer_TokenMajorRowsAndColsMustMatchTheShape) {
  apex::RowMatrix<float> m(6, 12);
  // Too few columns, too few rows, and too many of either: a [B*S, H*D] matrix fits one shape.
  expect_invalid(
      [&] {
        apex::HeadsView<float>::token_major(m, {2, 4, 3, 4});
      },
      "[heads_view] token_major matrix cols (12) must be heads * dim (4 * 4 = 16)");
  expect_invalid(
      [&] {
        apex::HeadsView<float>::token_major(m, {2, 3, 4, 4});
      },
      "[heads_view] token_major matrix rows (6) must be batch * seq (2 * 4 = 8)");
  expect_invalid(
      [&] {
        apex::HeadsView<float>::token_major(m, {1, 3, 3, 4});
      },
      "[heads_view] token_major matrix rows (6) must be batch * seq (1 * 3 = 3)");
  expect_invalid(
      [&] {
        apex::HeadsView<float>::token_major(m, {2, 2, 3, 4});
      },
      "[heads_view] token_major matrix cols (12) must be heads * dim (2 * 4 = 8)");
  expect_invalid(
      [&] {
        apex::HeadsView<float>::token_major(m, {2, -3, 3, 4});
      },
      "[heads_view] token_major shape [2, -3, 3, 4] must have no negative extent");
  // The right shape passes.
  EXPECT_EQ(apex::HeadsView<float>::token_major(m, {2, 3, 3, 4}).row_stride(), 12);
}

TEST(Tensor, ViewLargerThanBuffer_WrongElementCountThrows) {
  apex::RowMatrix<double> m(24, 5);
  std::vector<double> v(120);
  const apex::HeadsShape more{2, 3, 4, 6}, fewer{2, 3, 4, 4};
  expect_invalid([&] { apex::HeadsView<double>::contiguous(m, more); },
                 "[heads_view] contiguous matrix size (120) must be B*H*S*D (144)");
  expect_invalid([&] { apex::HeadsView<double>::contiguous(m, fewer); },
                 "[heads_view] contiguous matrix size (120) must be B*H*S*D (96)");
  expect_invalid([&] { apex::HeadsView<double>::contiguous(v, more); },
                 "[heads_view] contiguous buffer size (120) must be B*H*S*D (144)");
  expect_invalid([&] { apex::HeadsView<double>::contiguous(v.data(), 100, fewer); },
                 "[heads_view] contiguous buffer size (100) must be B*H*S*D (96)");
  expect_invalid([&] { apex::HeadsView<double>::token_major(v, fewer); },
                 "[heads_view] token_major buffer size (120) must be B*H*S*D (96)");
}

TEST(Tensor, ViewLargerThanBuffer_StridedMatricesAreViewedOrRejected) {
  apex::RowMatrix<float> wide(24, 9);
  // Some columns of a wider matrix are not [B, H, S, D] storage: their rows have gaps.
  expect_invalid(
      [&] {
        apex::HeadsView<float>::contiguous(wide.leftCols(5), {2, 3, 4, 5});
      },
      {"[heads_view] contiguous matrix outer stride (9) must be cols (5)", "token_major"});
  // A column of a row-major matrix steps over whole rows.
  expect_invalid(
      [&] {
        apex::HeadsView<float>::contiguous(wide.col(0), {1, 1, 24, 1});
      },
      "[heads_view] contiguous matrix inner stride (9) must be 1");
  // A map with gaps between the elements of a row, and one whose rows overlap.
  using Strided =
      Eigen::Map<apex::RowMatrix<float>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;
  const Strided gaps(wide.data(), 4, 4, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(9, 2));
  expect_invalid(
      [&] {
        apex::HeadsView<const float>::token_major(gaps, {1, 2, 4, 2});
      },
      "[heads_view] token_major matrix inner stride (2) must be 1");
  const Strided overlapping(wide.data(), 4, 4, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(2, 1));
  expect_invalid(
      [&] {
        apex::HeadsView<const float>::token_major(overlapping, {2, 2, 2, 2});
      },
      "[heads_view] token_major matrix outer stride (2) must be at least cols (4)");
}

// Unchecked arithmetic on sizes that users give: the byte range and the distinctness test of
// a view whose strides span more than 64 bits do not wrap (signed overflow, undefined
// behaviour); the range covers all of memory, so the view overlaps everything, and such a view
// is never called distinct.
TEST(Tensor, UncheckedArithmetic_StridesBeyond64BitsDoNotWrap) {
  constexpr Index kMax = std::numeric_limits<Index>::max();
  float x[4] = {};
  const apex::HeadsView<float> huge(x, {3, 1, 1, 1}, {kMax, 1, 1});
  const apex::HeadsView<float> backwards(x, {1, 3, 1, 1}, {1, -kMax, 1});
  const apex::HeadsView<float> bytes(x, {2, 1, 1, 1}, {kMax / 2, 1, 1});  // elements fit, bytes not
  const apex::HeadsView<float> own(x, {1, 1, 1, 1}, {1, 1, 1});
  float elsewhere = 0.0F;
  const apex::HeadsView<float> other(&elsewhere, {1, 1, 1, 1}, {1, 1, 1});
  for (const auto& view : {huge, backwards, bytes}) {
    const apex::detail::ByteRange range = apex::detail::byte_range(view);
    EXPECT_EQ(range.first, 0U);
    EXPECT_EQ(range.last, std::numeric_limits<std::uintptr_t>::max());
    EXPECT_TRUE(range.overlaps(apex::detail::byte_range(other)));
  }
  EXPECT_FALSE(apex::detail::elements_distinct(huge));  // 2·kMax + 1 elements apart
  EXPECT_FALSE(apex::detail::elements_distinct(
      apex::HeadsView<float>(x, {2, 1, 1, 1}, {std::numeric_limits<Index>::min(), 1, 1})));
  EXPECT_FALSE(apex::detail::byte_range(own).overlaps(apex::detail::byte_range(other)));
}

}  // namespace
}  // namespace tensor_test
