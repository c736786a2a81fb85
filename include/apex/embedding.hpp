// SPDX-License-Identifier: MIT
// Input embedding with √d scaling (§2) and the weight-tied LM head (§2.5).
//
//   tokens [B, S] (integer ids)      table W_E [V, d]
//        │ lookup + scale                 │
//        ▼                                │ shared (weight tying)
//   X [B*S, d]   row b*S + s = W_E[tokens(b, s)] · scale          logits = h · W_Eᵀ  [tokens, V]
#pragma once

#include <apex/config.hpp>
#include <apex/detail/matmul.hpp>
#include <apex/detail/parallel.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace apex {

/// Token ids [B, S], one sequence per row.
using TokenMatrix = Eigen::Matrix<std::int64_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Parameters of the embedding lookup.
struct EmbeddingParams {
  /// Multiplier applied to every looked-up row. Unset means √d with d = table.cols(), as §2.2
  /// prescribes (X = Embed(tokens) · √d); set it to 1 for a plain lookup (GPT-2, Llama) or to
  /// any other factor a checkpoint was trained with. Must be finite.
  std::optional<double> scale;
};

namespace detail {

/// Throws unless every id lies in [0, V), naming the first one that does not, in the type and
/// with the value the caller gave (an unsigned 2^64 − 1 is not reported as -1).
template <class TokensDerived>
void check_token_ids(const Eigen::MatrixBase<TokensDerived>& tokens, Index vocab,
                     const char* op = "embed") {
  using Id = typename TokensDerived::Scalar;
  for (Index b = 0; b < tokens.rows(); ++b) {
    for (Index s = 0; s < tokens.cols(); ++s) {
      const Id id = tokens(b, s);
      bool in_range = false;
      if constexpr (std::is_signed_v<Id>) {
        in_range = id >= 0 && static_cast<std::int64_t>(id) < static_cast<std::int64_t>(vocab);
      } else {
        in_range = static_cast<std::uint64_t>(id) < static_cast<std::uint64_t>(vocab);
      }
      APEX_CHECK(in_range, "[" << op << "] token id (" << +id << ") at position (b=" << b
                               << ", s=" << s << ") must be in [0, " << vocab << "), V = " << vocab
                               << " being the table's row count");
    }
  }
}

}  // namespace detail

/// How a backward pass writes a weight's gradient: kWrite replaces what the output holds, kAdd
/// adds to it (the tied table's gradient from the embedding and from the LM head, or gradients
/// accumulated over micro-batches).
enum class GradientUpdate {
  kWrite,  ///< the gradient replaces the output's contents
  kAdd     ///< the gradient is added to the output's contents
};

/// Embedding lookup with scaling (§2.2): out[b*S + s, :] = table[tokens(b, s), :] · scale.
/// table: [V, d], tokens: [B, S] of any integer type, out: [B*S, d] (the documents' [B, S, d]
/// as B blocks of S rows). Every id is checked to lie in [0, V) before anything is written.
/// The table and out may each be float, double, Eigen::half or Eigen::bfloat16 (storage.hpp):
/// a 16-bit table is widened row by row as it is read, never converted whole. The products are
/// formed in the compute type C (float, or double when the table or out is double): the scale
/// is rounded to C once and applied in C, unless C cannot represent it (a float scale of 1e40 or
/// 1e-50), in which case each product is formed in double; each result is rounded once to out's
/// type. So any finite scale means what it says.
/// out (a row-major matrix, Map, Ref or block with contiguous rows, written in place) must not
/// overlap table. Allocates nothing unless table is not row-major or tokens is not a row-major
/// int64 matrix (Eigen::Ref then copies it). Threads over rows for large outputs.
template <class TableDerived, class TokensDerived, class OutDerived>
void embed(const Eigen::MatrixBase<TableDerived>& table,
           const Eigen::MatrixBase<TokensDerived>& tokens, const EmbeddingParams& params,
           const Eigen::MatrixBase<OutDerived>& out_) {
  using TT = typename TableDerived::Scalar;
  using TO = typename OutDerived::Scalar;
  using C = wider_t<compute_t<TT>, compute_t<TO>>;
  using Id = typename TokensDerived::Scalar;
  detail::require_storage_type<TT>();
  detail::require_storage_type<TO>();
  static_assert(std::is_integral_v<Id> && !std::is_same_v<Id, bool>,
                "[embed] token ids must be an integer matrix");
  // Written through a Ref to its storage (Eigen's idiom for output parameters that may be
  // temporaries, such as blocks and maps).
  RowRef<TO> out(const_cast<OutDerived&>(out_.derived()));

  const ConstRowRef<TT> w(table.derived());
  const Index vocab = w.rows();
  const Index d = w.cols();
  const Index batch = tokens.rows();
  const Index seq = tokens.cols();

  const double scale = params.scale.value_or(std::sqrt(static_cast<double>(d)));
  APEX_CHECK(std::isfinite(scale), "[embed] scale (" << scale << ") must be finite");
  APEX_CHECK(out.rows() == batch * seq && out.cols() == d,
             "[embed] out (" << out.rows() << " x " << out.cols() << ") must be " << batch * seq
                             << " x " << d << " (B*S tokens x d)");
  detail::check_token_ids(tokens, vocab);
  // Every id is now in [0, V), so its conversion to int64 keeps its value.
  const Eigen::Ref<const TokenMatrix> ids(tokens.derived().template cast<std::int64_t>());

  // The scale is applied in C when C represents it, else in double.
  const bool in_compute = detail::representable_in<C>(scale);
  // A lookup is a copy: threads pay off only once there are some 32K elements to move.
  const Index min_parallel_rows = std::max<Index>(2, (Index{1} << 15) / std::max<Index>(d, 1));
  detail::parallel_for(
      batch * seq,
      [&](Index row) {
        const auto source = w.row(static_cast<Index>(ids(row / seq, row % seq))).array();
        if (in_compute) {
          out.row(row) = rounded<TO>(source.template cast<C>() * static_cast<C>(scale)).matrix();
        } else {
          out.row(row) = rounded<TO>(source.template cast<double>() * scale).matrix();
        }
      },
      min_parallel_rows);
}

/// Embedding lookup (§2.2) returning a new [B*S, d] matrix of the table's type; see the overload
/// above.
template <class TableDerived, class TokensDerived>
RowMatrix<typename TableDerived::Scalar> embed(const Eigen::MatrixBase<TableDerived>& table,
                                               const Eigen::MatrixBase<TokensDerived>& tokens,
                                               const EmbeddingParams& params = {}) {
  using Scalar = typename TableDerived::Scalar;
  detail::require_storage_type<Scalar>();
  const Index rows = detail::checked_product(tokens.rows(), tokens.cols(), "embed", "B*S");
  detail::checked_product({rows, table.cols(), static_cast<Index>(sizeof(Scalar))}, "embed",
                          "B*S*d bytes of the output");
  RowMatrix<Scalar> out(rows, table.cols());
  embed(table, tokens, params, out);
  return out;
}

/// Embedding lookup (§2.2) of one sequence of S ids: out is [S, d].
template <class TableDerived, class OutDerived>
void embed(const Eigen::MatrixBase<TableDerived>& table, const std::vector<std::int64_t>& tokens,
           const EmbeddingParams& params, const Eigen::MatrixBase<OutDerived>& out) {
  const Eigen::Map<const TokenMatrix> ids(tokens.data(), 1, static_cast<Index>(tokens.size()));
  embed(table, ids, params, out);
}

/// Embedding lookup (§2.2) of one sequence of S ids, returning a new [S, d] matrix.
template <class TableDerived>
RowMatrix<typename TableDerived::Scalar> embed(const Eigen::MatrixBase<TableDerived>& table,
                                               const std::vector<std::int64_t>& tokens,
                                               const EmbeddingParams& params = {}) {
  const Eigen::Map<const TokenMatrix> ids(tokens.data(), 1, static_cast<Index>(tokens.size()));
  return embed(table, ids, params);
}

/// LM head with weight tying (§2.5): logits = h · W_Eᵀ, reusing the embedding table as the
/// output projection. h: [tokens, d], table: [V, d], out: [tokens, V].
/// One product (detail::matmul: fixed tiles spread over the threads, bit-identical for any
/// number of threads), written straight into out, which must not overlap h or table. Note that the
/// table is used as stored: the √d of embed() is not undone here (Gemma, which also scales by √d,
/// ties the weights the same way). A 16-bit table (Eigen::half or Eigen::bfloat16) is widened
/// to h's type as the product reads it. Allocates nothing beyond Eigen's GEMM packing buffers, a
/// 16-bit table's panel scratch for more than a few rows (detail/matmul.hpp), and a copy of an
/// input that is not row-major.
template <class HiddenDerived, class TableDerived>
void lm_head(const Eigen::MatrixBase<HiddenDerived>& h,
             const Eigen::MatrixBase<TableDerived>& table,
             RowRef<typename HiddenDerived::Scalar> out) {
  using Scalar = typename HiddenDerived::Scalar;
  detail::require_supported_scalar<Scalar>();
  using Weight = typename TableDerived::Scalar;
  detail::require_weight_type<Scalar, Weight>();

  const ConstRowRef<Scalar> hr(h.derived());
  const ConstRowRef<Weight> w(table.derived());
  APEX_CHECK(hr.cols() == w.cols(), "[lm_head] h width ("
                                        << hr.cols() << ") must equal the table's d (" << w.cols()
                                        << ")");
  APEX_CHECK(out.rows() == hr.rows() && out.cols() == w.rows(),
             "[lm_head] out (" << out.rows() << " x " << out.cols() << ") must be " << hr.rows()
                               << " x " << w.rows() << " (tokens x V)");
  detail::matmul_transposed<Scalar>(hr, w, out);
}

/// LM head with weight tying (§2.5) returning a new [tokens, V] matrix of logits.
template <class HiddenDerived, class TableDerived>
RowMatrix<typename HiddenDerived::Scalar> lm_head(const Eigen::MatrixBase<HiddenDerived>& h,
                                                  const Eigen::MatrixBase<TableDerived>& table) {
  using Scalar = typename HiddenDerived::Scalar;
  detail::require_supported_scalar<Scalar>();
  RowMatrix<Scalar> out(h.rows(), table.rows());
  lm_head(h, table, out);
  return out;
}

/// The backward pass of the embedding lookup (§2.2), a scatter-add into the table's gradient:
///   d_table[v, :] = scale · Σ_{t : tokens_t = v} d_out[t, :]   (plus what d_table held, kAdd)
/// with scale as in embed (√d unless params says otherwise); rows of ids that do not occur are
/// zero (kWrite) or unchanged (kAdd). tokens: [B, S] of any integer type, d_out: [B*S, d],
/// d_table: [V, d], each of float, double, half or bfloat16. Each row is summed in double over
/// its tokens in token order and rounded once, so the result is bit-identical for any number of
/// threads. Every id is checked before anything is written; d_table must not overlap d_out.
/// Allocates V + 1 + B·S indices (the tokens sorted by id). Threads over the table's rows.
template <class TokensDerived, class DOutDerived, class DTableDerived>
void embed_backward(const Eigen::MatrixBase<TokensDerived>& tokens, const EmbeddingParams& params,
                    const Eigen::MatrixBase<DOutDerived>& d_out,
                    const Eigen::MatrixBase<DTableDerived>& d_table_,
                    GradientUpdate update = GradientUpdate::kWrite) {
  using TY = typename DOutDerived::Scalar;
  using TD = typename DTableDerived::Scalar;
  using Id = typename TokensDerived::Scalar;
  detail::require_storage_type<TY>();
  detail::require_storage_type<TD>();
  static_assert(std::is_integral_v<Id> && !std::is_same_v<Id, bool>,
                "[embed_backward] token ids must be an integer matrix");
  RowRef<TD> d_table(const_cast<DTableDerived&>(d_table_.derived()));
  const ConstRowRef<TY> dy(d_out.derived());
  const Index vocab = d_table.rows();
  const Index d = d_table.cols();
  const Index count = tokens.rows() * tokens.cols();
  const double scale = params.scale.value_or(std::sqrt(static_cast<double>(d)));
  APEX_CHECK(std::isfinite(scale), "[embed_backward] scale (" << scale << ") must be finite");
  APEX_CHECK(dy.rows() == count && dy.cols() == d,
             "[embed_backward] d_out (" << dy.rows() << " x " << dy.cols() << ") must be " << count
                                        << " x " << d << " (B*S tokens x d)");
  detail::check_token_ids(tokens, vocab, "embed_backward");
  APEX_CHECK(!detail::matrix_byte_range(dy).overlaps(detail::matrix_byte_range(d_table)),
             "[embed_backward] d_table must not overlap d_out");
  // The tokens sorted by id (a counting sort, stable): those of id v are order[first[v] ..
  // first[v + 1]), in token order.
  std::vector<Index> first(static_cast<std::size_t>(vocab) + 1, 0);
  std::vector<Index> order(static_cast<std::size_t>(count));
  const auto id_at = [&](Index t) {
    return static_cast<std::size_t>(tokens(t / tokens.cols(), t % tokens.cols()));
  };
  for (Index t = 0; t < count; ++t) ++first[id_at(t) + 1];
  for (std::size_t v = 0; v < static_cast<std::size_t>(vocab); ++v) first[v + 1] += first[v];
  std::vector<Index> next(first.begin(), first.end() - 1);
  for (Index t = 0; t < count; ++t) order[static_cast<std::size_t>(next[id_at(t)]++)] = t;
  const Index min_parallel_rows = std::max<Index>(2, (Index{1} << 15) / std::max<Index>(d, 1));
  detail::parallel_for(
      vocab,
      [&](Index v) {
        const auto begin = static_cast<std::size_t>(first[static_cast<std::size_t>(v)]);
        const auto end = static_cast<std::size_t>(first[static_cast<std::size_t>(v) + 1]);
        if (begin == end && update == GradientUpdate::kAdd) return;
        Eigen::Array<double, 1, Eigen::Dynamic> sum =
            Eigen::Array<double, 1, Eigen::Dynamic>::Zero(d);
        for (std::size_t i = begin; i < end; ++i) {
          sum += dy.row(order[i]).array().template cast<double>();
        }
        sum *= scale;
        if (update == GradientUpdate::kAdd) sum += d_table.row(v).array().template cast<double>();
        d_table.row(v) = rounded<TD>(sum).matrix();
      },
      min_parallel_rows);
}

/// The backward pass of the tied LM head (§2.5), logits = h · W_Eᵀ:
///   d_h = d_logits · W_E                    [tokens, d]
///   d_table = d_logitsᵀ · h                 [V, d]  (plus what d_table held, kAdd)
/// With weight tying the table's whole gradient is this plus embed_backward's: call one with
/// kWrite and the other with kAdd. h, d_logits, d_h, d_table: Scalar (float or double); table:
/// Scalar or a 16-bit storage type, widened as it is read (as lm_head). Both products run in
/// fixed tiles (detail/matmul.hpp), bit-identical for any number of threads. d_h and d_table must
/// not overlap each other or an input; every check is made before anything is written. Allocates
/// nothing beyond Eigen's GEMM packing buffers and a 16-bit table's panel scratch.
template <class HiddenDerived, class TableDerived, class DLogitsDerived>
void lm_head_backward(const Eigen::MatrixBase<HiddenDerived>& h,
                      const Eigen::MatrixBase<TableDerived>& table,
                      const Eigen::MatrixBase<DLogitsDerived>& d_logits,
                      RowRef<typename HiddenDerived::Scalar> d_h,
                      RowRef<typename HiddenDerived::Scalar> d_table,
                      GradientUpdate update = GradientUpdate::kWrite) {
  using Scalar = typename HiddenDerived::Scalar;
  detail::require_supported_scalar<Scalar>();
  using Weight = typename TableDerived::Scalar;
  detail::require_weight_type<Scalar, Weight>();
  static_assert(std::is_same_v<typename DLogitsDerived::Scalar, Scalar>,
                "[lm_head_backward] d_logits must have h's scalar type");
  const ConstRowRef<Scalar> hr(h.derived());
  const ConstRowRef<Weight> w(table.derived());
  const ConstRowRef<Scalar> dl(d_logits.derived());
  const char* op = "lm_head_backward";
  APEX_CHECK(hr.cols() == w.cols(), "[" << op << "] h width (" << hr.cols()
                                        << ") must equal the table's d (" << w.cols() << ")");
  APEX_CHECK(dl.rows() == hr.rows() && dl.cols() == w.rows(),
             "[" << op << "] d_logits (" << dl.rows() << " x " << dl.cols() << ") must be "
                 << hr.rows() << " x " << w.rows() << " (tokens x V)");
  APEX_CHECK(d_h.rows() == hr.rows() && d_h.cols() == hr.cols(),
             "[" << op << "] d_h (" << d_h.rows() << " x " << d_h.cols() << ") must be "
                 << hr.rows() << " x " << hr.cols() << " like h");
  APEX_CHECK(d_table.rows() == w.rows() && d_table.cols() == w.cols(),
             "[" << op << "] d_table (" << d_table.rows() << " x " << d_table.cols() << ") must be "
                 << w.rows() << " x " << w.cols() << " like the table");
  const detail::ByteRange read[] = {detail::matrix_byte_range(hr), detail::matrix_byte_range(w),
                                    detail::matrix_byte_range(dl)};
  for (const detail::ByteRange written :
       {detail::matrix_byte_range(d_h), detail::matrix_byte_range(d_table)}) {
    for (const detail::ByteRange r : read) {
      APEX_CHECK(!written.overlaps(r),
                 "[" << op << "] d_h and d_table must not overlap h, the table or d_logits");
    }
  }
  APEX_CHECK(!detail::matrix_byte_range(d_h).overlaps(detail::matrix_byte_range(d_table)),
             "[" << op << "] d_h must not overlap d_table");
  detail::matmul<Scalar>(dl, table, d_h);
  detail::matmul_lhs_transposed<Scalar>(dl, hr, d_table, update == GradientUpdate::kAdd);
}

/// Parameters saved by tying the LM head to the embedding table (§2.5): V · d, the size of
/// the output projection that is not stored. 151,643 × 7,168 = 1,086,977,024 (≈ 1.09B).
/// Throws std::invalid_argument on a negative argument or a product beyond 64 bits.
inline std::int64_t tied_parameters_saved(std::int64_t vocab, std::int64_t d) {
  return detail::checked_product(vocab, d, "tied_parameters_saved", "vocab*d");
}

}  // namespace apex
