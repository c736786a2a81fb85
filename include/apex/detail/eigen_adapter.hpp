// SPDX-License-Identifier: MIT
// The one place apex uses what Eigen does not publish: the GEMM building blocks behind every large
// Eigen product (gemm_pack_lhs, gemm_pack_rhs, gebp_kernel and the serial
// general_matrix_matrix_product of Eigen/src/Core/products/) and the packet primitives (pload,
// pmadd, pexp, pselect, ...). They are fast and they let apex fix the blocking of every product,
// but they are not Eigen's API, so they are used only for the Eigen versions they were written
// against (3.4.x) and only unless APEX_EIGEN_PUBLIC_ONLY is defined. Otherwise every function
// below falls back to Eigen's public products and plain loops: the same results to rounding,
// slower, and (for matmul_serial) subject to Eigen's own threading.
//
// What the kernels get from here, in the compute type C (float or double):
//   TileGemm<C>       the two products of a tile: S = Qs·Kᵀ and acc += P·V, with packed operands
//   stream_scores     S(r, j) = q_r · k_j reading each key row once, in memory order
//   stream_update     acc_r += Σ_j P(r, j) v_j reading each value row once, in memory order
//   forbid_unless_positive, exp_weights   the selects and the exponential of the softmax
//   matmul_serial     C = A·B on one thread with a blocking that depends on the shapes only
#pragma once

#include <apex/config.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if !defined(APEX_EIGEN_PUBLIC_ONLY) && EIGEN_VERSION_AT_LEAST(3, 4, 0) && \
    !EIGEN_VERSION_AT_LEAST(3, 4, 90)
/// 1 when apex calls Eigen's internal GEMM blocks and packets (Eigen 3.4.x, and
/// APEX_EIGEN_PUBLIC_ONLY not defined); 0 when it uses public products only.
#define APEX_EIGEN_INTERNALS 1
#else
#define APEX_EIGEN_INTERNALS 0
#endif

// Not part of the public API: BLAS-style (pointer, leading dimension, rows, columns) lists, as in
// Eigen's and every GEMM's own signatures; each has one or two callers in flash_attention.hpp.
// NOLINTBEGIN(bugprone-easily-swappable-parameters)
namespace apex::detail {

template <class C>
using RowMap = Eigen::Map<RowMatrix<C>, 0, Eigen::OuterStride<>>;
template <class C>
using ConstRowMap = Eigen::Map<const RowMatrix<C>, 0, Eigen::OuterStride<>>;

// ---------------------------------------------------------------------------------------------
// The products of one tile
// ---------------------------------------------------------------------------------------------

/// S = Qs·Kᵀ and acc += P·V for one tile of `rows` stacked query rows and n keys. With Eigen's
/// internals both run on its register-blocked micro-kernel (gebp) over operands packed into its
/// panel layout: Qs once per task (pack_queries), each key and value block once. gebp writes
/// column-major results, so both are computed transposed, leaving S and acc row-major (one query
/// row per contiguous row, which the softmax wants):
///   Sᵀ (n × rows)    = K (n × d_qk) · Qsᵀ (d_qk × rows)
///   accᵀ (d_v × rows) += Vᵀ (d_v × n) · Pᵀ (n × rows)
/// Without them, both are Eigen lazy (coefficient-based) products: no packing, no allocation.
template <class C>
struct TileGemm {
  /// Whether the packed buffers are used (the kernel sizes its scratch by it).
  static constexpr bool kPacks = APEX_EIGEN_INTERNALS == 1;

  /// Packs Qs [rows × d] (row-major) as the right-hand side Qsᵀ of every score product.
  static void pack_queries(C* packed, const C* q, Index rows, Index d) {
#if APEX_EIGEN_INTERNALS
    Gemm<Eigen::RowMajor, Eigen::ColMajor>::pack_rhs(packed, q, d, d, rows);
#else
    (void)packed, (void)q, (void)rows, (void)d;
#endif
  }

  /// s [rows × n] (row-major, leading dimension ld_s) = Qs · kᵀ for the n key rows k (contiguous,
  /// n × d); k_packed is scratch for n·d values, q_packed what pack_queries made of q.
  static void scores(C* s, Index ld_s, const C* k, C* k_packed, const C* q_packed, const C* q,
                     Index rows, Index n, Index d) {
#if APEX_EIGEN_INTERNALS
    (void)q;
    for (Index r = 0; r < rows; ++r) std::fill(s + r * ld_s, s + r * ld_s + n, C(0));
    if (d == 0) return;
    using ScoreGemm = Gemm<Eigen::RowMajor, Eigen::ColMajor>;
    ScoreGemm::pack_lhs(k_packed, k, d, n, d);
    ScoreGemm::kernel(s, ld_s, k_packed, q_packed, n, d, rows);
#else
    (void)k_packed, (void)q_packed;
    RowMap<C>(s, rows, n, Eigen::OuterStride<>(ld_s)) =
        ConstRowMap<C>(q, rows, d, Eigen::OuterStride<>(d))
            .lazyProduct(ConstRowMap<C>(k, n, d, Eigen::OuterStride<>(d)).transpose());
#endif
  }

  /// acc [rows × d_v] (row-major, ld_acc) += p [rows × n] (ld_p) · v [n × d_v] (contiguous);
  /// v_packed and p_packed are scratch for n·d_v and rows·n values.
  static void update(C* acc, Index ld_acc, const C* p, Index ld_p, C* p_packed, const C* v,
                     C* v_packed, Index rows, Index n, Index d_v) {
    if (d_v == 0 || n == 0) return;
#if APEX_EIGEN_INTERNALS
    using UpdateGemm = Gemm<Eigen::ColMajor, Eigen::ColMajor>;
    UpdateGemm::pack_lhs(v_packed, v, d_v, d_v, n);
    UpdateGemm::pack_rhs(p_packed, p, ld_p, n, rows);
    UpdateGemm::kernel(acc, ld_acc, v_packed, p_packed, d_v, n, rows);
#else
    (void)p_packed, (void)v_packed;
    RowMap<C>(acc, rows, d_v, Eigen::OuterStride<>(ld_acc)).noalias() +=
        ConstRowMap<C>(p, rows, n, Eigen::OuterStride<>(ld_p))
            .lazyProduct(ConstRowMap<C>(v, n, d_v, Eigen::OuterStride<>(d_v)));
#endif
  }

#if APEX_EIGEN_INTERNALS
 private:
  /// Eigen 3.4's GEMM building blocks for R += A·B with a column-major R.
  template <int LhsOrder, int RhsOrder>
  struct Gemm {
    using Traits = Eigen::internal::gebp_traits<C, C>;
    using LhsMapper = Eigen::internal::const_blas_data_mapper<C, Index, LhsOrder>;
    using RhsMapper = Eigen::internal::const_blas_data_mapper<C, Index, RhsOrder>;
    using ResMapper = Eigen::internal::blas_data_mapper<C, Index, Eigen::ColMajor>;

    /// A: rows × depth, stored in LhsOrder with leading dimension ld.
    static void pack_lhs(C* packed, const C* a, Index ld, Index rows, Index depth) {
      Eigen::internal::gemm_pack_lhs<C, Index, LhsMapper, Traits::mr, Traits::LhsProgress,
                                     typename Traits::LhsPacket4Packing, LhsOrder>
          pack;
      pack(packed, LhsMapper(a, ld), depth, rows);
    }
    /// B: depth × cols, stored in RhsOrder with leading dimension ld.
    static void pack_rhs(C* packed, const C* b, Index ld, Index depth, Index cols) {
      Eigen::internal::gemm_pack_rhs<C, Index, RhsMapper, Traits::nr, RhsOrder> pack;
      pack(packed, RhsMapper(b, ld), depth, cols);
    }
    /// R (rows × cols, column-major, leading dimension ldr) += A·B from the packed panels.
    static void kernel(C* r, Index ldr, const C* a_packed, const C* b_packed, Index rows,
                       Index depth, Index cols) {
      Eigen::internal::gebp_kernel<C, C, Index, ResMapper, Traits::mr, Traits::nr> gebp;
      gebp(ResMapper(r, ldr), a_packed, b_packed, rows, depth, cols, C(1));
    }
  };
#endif
};

// ---------------------------------------------------------------------------------------------
// The streaming products (a few stacked rows: bound by reading K and V, not by arithmetic)
// ---------------------------------------------------------------------------------------------

#if APEX_EIGEN_INTERNALS
namespace packet {
template <class C>
using Type = typename Eigen::internal::packet_traits<C>::type;
template <class C>
constexpr Index kSize = Eigen::internal::unpacket_traits<Type<C>>::size;

/// Whether a float packet loads from 16-bit elements of T with a vector conversion in registers:
/// bfloat16 with AVX or AVX-512 (a zero-extend and a shift), half when the compiler also targets
/// F16C (vcvtph2ps; called directly, as Eigen 3.4.0 enables its own F16C path for clang only).
template <class T>
constexpr bool kWidensInRegisters =
#if defined(EIGEN_VECTORIZE_AVX512) || defined(EIGEN_VECTORIZE_AVX)
#if defined(__F16C__)
    std::is_same_v<T, Eigen::half> ||
#endif
    std::is_same_v<T, Eigen::bfloat16>;
#else
    false;
#endif

/// Asks for the row kAhead rows after `row` (rows `stride` elements apart, d elements each) when
/// T is narrower than C. Streaming 16-bit rows leaves the thread waiting on memory more often
/// than streaming float rows (half the bytes per instruction), and prefetching them 16 rows ahead
/// helps them while it slows float rows, which are left to the hardware prefetcher
/// (docs/performance.md, "How the block sizes were chosen").
template <class C, class T>
APEX_ALWAYS_INLINE void prefetch_ahead(const T* row, Index stride, Index d) {
  if constexpr (sizeof(T) < sizeof(C)) {
    constexpr Index kAhead = 16;
    constexpr Index kPerLine = 64 / static_cast<Index>(sizeof(T));
    for (Index c = 0; c < d; c += kPerLine) Eigen::internal::prefetch(row + kAhead * stride + c);
  }
}

/// A packet of C from kSize<C> consecutive elements of T (unaligned), widened in registers.
template <class C, class T>
APEX_ALWAYS_INLINE Type<C> load(const T* from) {
  namespace ei = Eigen::internal;
  if constexpr (std::is_same_v<C, T>) {
    return ei::ploadu<Type<C>>(from);
  } else {
    static_assert(std::is_same_v<C, float> && kWidensInRegisters<T>, "no widening load");
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (std::is_same_v<T, Eigen::half>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
    } else {
      return ei::Bf16ToF32(ei::ploadu<ei::Packet16bf>(from));
    }
#elif defined(EIGEN_VECTORIZE_AVX)
    if constexpr (std::is_same_v<T, Eigen::half>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
    } else {
      return ei::Bf16ToF32(ei::ploadu<ei::Packet8bf>(from));
    }
#else
    return Type<C>();
#endif
  }
}
}  // namespace packet
#endif

/// a·b + c, fused where the target has FMA: the scalar tails of the streaming products use it, so
/// that they round the same way whatever the storage type of the row (a compiler contracts
/// a·b + c into an FMA, or not, case by case).
template <class C>
APEX_ALWAYS_INLINE C madd(C a, C b, C c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

/// Whether the streaming products read rows of T in place for a compute type C (widening each
/// packet in registers), rather than rows first widened by widen().
template <class C, class T>
constexpr bool kStreamsFrom = std::is_same_v<C, T>
#if APEX_EIGEN_INTERNALS
                              || (std::is_same_v<C, float> && packet::kWidensInRegisters<T>)
#endif
    ;

/// s(r, j) = q_r · k_j for `rows` query rows q (contiguous, rows × d) and n key rows k (row j at
/// k + j·k_stride): each key row is read once, in memory order, and used at once by every query
/// row (four at a time), so the prefetcher streams the keys while the thread computes. The keys
/// are C, or a type T with kStreamsFrom<C, T>, widened packet by packet.
template <class C, class T>
void stream_scores(C* s, Index ld_s, const C* q, Index rows, const T* k, Index k_stride, Index n,
                   Index d) {
  static_assert(kStreamsFrom<C, T>, "stream_scores: keys of this type are widened first");
#if APEX_EIGEN_INTERNALS
  namespace ei = Eigen::internal;
  using P = packet::Type<C>;
  constexpr Index kP = packet::kSize<C>;
  const Index vectorised = d / kP * kP;
  for (Index j = 0; j < n; ++j) {
    const T* key = k + j * k_stride;
    packet::prefetch_ahead<C>(key, k_stride, d);
    Index r = 0;
    for (; r + 4 <= rows; r += 4) {
      const C* qr = q + r * d;
      P a0 = ei::pset1<P>(C(0)), a1 = a0, a2 = a0, a3 = a0;
      for (Index c = 0; c < vectorised; c += kP) {
        const P kc = packet::load<C>(key + c);
        a0 = ei::pmadd(ei::ploadu<P>(qr + c), kc, a0);
        a1 = ei::pmadd(ei::ploadu<P>(qr + d + c), kc, a1);
        a2 = ei::pmadd(ei::ploadu<P>(qr + 2 * d + c), kc, a2);
        a3 = ei::pmadd(ei::ploadu<P>(qr + 3 * d + c), kc, a3);
      }
      C s0 = ei::predux(a0), s1 = ei::predux(a1), s2 = ei::predux(a2), s3 = ei::predux(a3);
      for (Index c = vectorised; c < d; ++c) {
        const auto kc = static_cast<C>(key[c]);
        s0 = madd(qr[c], kc, s0);
        s1 = madd(qr[d + c], kc, s1);
        s2 = madd(qr[2 * d + c], kc, s2);
        s3 = madd(qr[3 * d + c], kc, s3);
      }
      s[r * ld_s + j] = s0;
      s[(r + 1) * ld_s + j] = s1;
      s[(r + 2) * ld_s + j] = s2;
      s[(r + 3) * ld_s + j] = s3;
    }
    for (; r < rows; ++r) {
      const C* qr = q + r * d;
      P a = ei::pset1<P>(C(0));
      for (Index c = 0; c < vectorised; c += kP) {
        a = ei::pmadd(ei::ploadu<P>(qr + c), packet::load<C>(key + c), a);
      }
      C sum = ei::predux(a);
      for (Index c = vectorised; c < d; ++c) sum = madd(qr[c], static_cast<C>(key[c]), sum);
      s[r * ld_s + j] = sum;
    }
  }
#else
  RowMap<C>(s, rows, n, Eigen::OuterStride<>(ld_s)) =
      ConstRowMap<C>(q, rows, d, Eigen::OuterStride<>(d))
          .lazyProduct(ConstRowMap<C>(k, n, d, Eigen::OuterStride<>(k_stride)).transpose());
#endif
}

#if APEX_EIGEN_INTERNALS
namespace packet {
/// acc[i][c .. c + kWidth·kP) += Σ_{j in [j0, j1)} p[i][j] · v_j[c ..] for four rows i, with the
/// 4 × kWidth packets of acc held in registers across the keys.
template <class C, int kWidth, class T>
APEX_ALWAYS_INLINE void update_four_rows(C* acc, Index ld_acc, const C* p, Index ld_p, const T* v,
                                         Index v_stride, Index j0, Index j1, Index c) {
  namespace ei = Eigen::internal;
  using P = Type<C>;
  constexpr Index kP = kSize<C>;
  P block[4][kWidth];
  for (int i = 0; i < 4; ++i) {
    for (int u = 0; u < kWidth; ++u) block[i][u] = ei::pload<P>(acc + i * ld_acc + c + u * kP);
  }
  for (Index j = j0; j < j1; ++j) {
    const T* value = v + (j - j0) * v_stride + c;
    P vv[kWidth];
    for (int u = 0; u < kWidth; ++u) vv[u] = load<C>(value + u * kP);
    for (int i = 0; i < 4; ++i) {
      const P w = ei::pset1<P>(p[i * ld_p + j]);
      for (int u = 0; u < kWidth; ++u) block[i][u] = ei::pmadd(w, vv[u], block[i][u]);
    }
  }
  for (int i = 0; i < 4; ++i) {
    for (int u = 0; u < kWidth; ++u) ei::pstore(acc + i * ld_acc + c + u * kP, block[i][u]);
  }
}
}  // namespace packet
#endif

/// acc_r += Σ_j p(r, j) v_j for `rows` rows (acc row-major with ld_acc, a multiple of the packet
/// size; p with ld_p) and n value rows v (row j at v + j·v_stride), in groups of 8 keys so that
/// the accumulator packets being updated stay in registers. The values are C, or a type T with
/// kStreamsFrom<C, T>, widened packet by packet.
template <class C, class T>
void stream_update(C* acc, Index ld_acc, const C* p, Index ld_p, Index rows, const T* v,
                   Index v_stride, Index n, Index d_v) {
  static_assert(kStreamsFrom<C, T>, "stream_update: values of this type are widened first");
#if APEX_EIGEN_INTERNALS
  constexpr Index kP = packet::kSize<C>;
  constexpr Index kKeys = 8;
  for (Index j0 = 0; j0 < n; j0 += kKeys) {
    const Index j1 = std::min(n, j0 + kKeys);
    const T* values = v + j0 * v_stride;
    for (Index j = 0; j < kKeys; ++j)
      packet::prefetch_ahead<C>(values + j * v_stride, v_stride, d_v);
    Index r = 0;
    for (; r + 4 <= rows; r += 4) {
      C* a = acc + r * ld_acc;
      const C* pr = p + r * ld_p;
      Index c = 0;
      for (; c + 4 * kP <= d_v; c += 4 * kP) {
        packet::update_four_rows<C, 4>(a, ld_acc, pr, ld_p, values, v_stride, j0, j1, c);
      }
      for (; c + kP <= d_v; c += kP) {
        packet::update_four_rows<C, 1>(a, ld_acc, pr, ld_p, values, v_stride, j0, j1, c);
      }
      for (; c < d_v; ++c) {
        for (Index j = j0; j < j1; ++j) {
          const auto value = static_cast<C>(values[(j - j0) * v_stride + c]);
          for (int i = 0; i < 4; ++i) {
            a[i * ld_acc + c] = madd(pr[i * ld_p + j], value, a[i * ld_acc + c]);
          }
        }
      }
    }
    for (; r < rows; ++r) {  // one row at a time: a += p(r, j) · v_j, packet by packet
      namespace ei = Eigen::internal;
      using P = packet::Type<C>;
      C* a = acc + r * ld_acc;
      for (Index j = j0; j < j1; ++j) {
        const P w = ei::pset1<P>(p[r * ld_p + j]);
        const T* value = values + (j - j0) * v_stride;
        Index c = 0;
        for (; c + kP <= d_v; c += kP) {
          ei::pstore(a + c, ei::pmadd(w, packet::load<C>(value + c), ei::pload<P>(a + c)));
        }
        for (; c < d_v; ++c) a[c] = madd(p[r * ld_p + j], static_cast<C>(value[c]), a[c]);
      }
    }
  }
#else
  RowMap<C>(acc, rows, d_v, Eigen::OuterStride<>(ld_acc)).noalias() +=
      ConstRowMap<C>(p, rows, n, Eigen::OuterStride<>(ld_p))
          .lazyProduct(ConstRowMap<C>(v, n, d_v, Eigen::OuterStride<>(v_stride)));
#endif
}

// ---------------------------------------------------------------------------------------------
// The element-wise steps of the softmax
// ---------------------------------------------------------------------------------------------

/// s_j = -inf where keep_j is not > 0, s_j unchanged elsewhere, whatever s_j holds (NaN
/// included): a select, as Eigen 3.4's Array::select is not vectorised.
template <class C>
void forbid_unless_positive(C* s, const C* keep, Index n) {
  constexpr C kNegInf = -std::numeric_limits<C>::infinity();
  Index j = 0;
#if APEX_EIGEN_INTERNALS
  namespace ei = Eigen::internal;
  using P = packet::Type<C>;
  constexpr Index kP = packet::kSize<C>;
  const P zero = ei::pset1<P>(C(0));
  const P neg_inf = ei::pset1<P>(kNegInf);
  for (; j + kP <= n; j += kP) {
    const P allowed = ei::pcmp_lt(zero, ei::ploadu<P>(keep + j));
    ei::pstoreu(s + j, ei::pselect(allowed, ei::ploadu<P>(s + j), neg_inf));
  }
#endif
  for (; j < n; ++j) {
    if (!(keep[j] > C(0))) s[j] = kNegInf;
  }
}

/// s_j = exp(s_j − max) where s_j > -inf, and s_j = -0.0 exactly where s_j = -inf. The sign of
/// zero marks a key that takes no part in the row: exp never returns -0.0, so a weight that
/// merely underflows is +0.0 and the value update can tell the two apart (online_softmax.hpp).
/// (Eigen's vectorised exp also clamps its argument, exp(-inf) = 5.6e-309 in double, so -inf
/// must be selected, not exponentiated.) Sets `hidden` when some s_j was -inf (some key takes
/// no part).
template <class C>
APEX_ALWAYS_INLINE void exp_weights(C* s, Index n, C max, bool& hidden) {
  constexpr C kNegInf = -std::numeric_limits<C>::infinity();
  Index j = 0;
#if APEX_EIGEN_INTERNALS
  namespace ei = Eigen::internal;
  using P = packet::Type<C>;
  constexpr Index kP = packet::kSize<C>;
  const P minus_zero = ei::pset1<P>(C(-0.0));
  const P neg_inf = ei::pset1<P>(kNegInf);
  const P m = ei::pset1<P>(max);
  P any = ei::pzero(m);
  for (; j + kP <= n; j += kP) {
    const P x = ei::ploadu<P>(s + j);
    const P is_hidden = ei::pcmp_eq(x, neg_inf);
    any = ei::por(any, is_hidden);
    ei::pstoreu(s + j, ei::pselect(is_hidden, minus_zero, ei::pexp(ei::psub(x, m))));
  }
  hidden = hidden || ei::predux_any(any);
#endif
  for (; j < n; ++j) {
    hidden = hidden || s[j] == kNegInf;
    s[j] = s[j] == kNegInf ? C(-0.0) : std::exp(s[j] - max);
  }
}

/// Whether every element of a rows × n block (row-major, leading dimension ld) is finite: the
/// sum of x·0 over a row is 0, or NaN if some x is ±inf or NaN. A vectorised reduction (Eigen's
/// allFinite() on a strided block runs element by element). 16-bit values are read as their
/// bits: one is not finite when its magnitude bits reach those of infinity (0x7F80 for bfloat16,
/// 0x7C00 for half), a max of 16-bit integers that any SIMD level vectorises.
template <class T>
bool all_finite(const T* x, Index rows, Index n, Index ld) {
  if constexpr (std::is_same_v<T, Eigen::bfloat16> || std::is_same_v<T, Eigen::half>) {
    constexpr std::int16_t kInfinity = std::is_same_v<T, Eigen::half> ? 0x7C00 : 0x7F80;
    for (Index r = 0; r < rows; ++r) {
      std::int16_t largest = 0;
      for (Index j = 0; j < n; ++j) {
        const auto bits = Eigen::numext::bit_cast<std::uint16_t>(x[r * ld + j]);
        largest = std::max(largest, static_cast<std::int16_t>(bits & 0x7FFFU));
      }
      if (largest >= kInfinity) return false;
    }
    return true;
  }
  for (Index r = 0; r < rows; ++r) {
    const auto row = Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>>(x + r * ld, n);
    if (!((row * T(0)).sum() == T(0))) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// One product on one thread
// ---------------------------------------------------------------------------------------------

/// c [rows × cols] (row-major, leading dimension ldc) = a [rows × depth] (stored in LhsOrder with
/// leading dimension lda: a column-major a is the transpose of a row-major depth × rows matrix) ·
/// b [depth × cols] (stored in RhsOrder with leading dimension ldb), computed on the calling
/// thread with a blocking that depends on the shapes (and the CPU's cache sizes) only, never on
/// the number of threads: Eigen's own products choose theirs from the thread count, so their
/// last bits change with it. One row is a matrix-vector product, which Eigen never threads.
/// With `accumulate` the product is added to c (c += a·b) instead of replacing it.
/// Without Eigen's internals this is Eigen's public product, which Eigen may thread itself
/// (define EIGEN_DONT_PARALLELIZE to keep results independent of the thread count then).
template <class C, int RhsOrder, int LhsOrder = Eigen::RowMajor>
void matmul_serial(Index rows, Index cols, Index depth, const C* a, Index lda, const C* b,
                   Index ldb, C* c, Index ldc, bool accumulate = false) {
  using Lhs = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, LhsOrder>;
  using Rhs = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, RhsOrder>;
  RowMap<C> out(c, rows, cols, Eigen::OuterStride<>(ldc));
  const Eigen::Map<const Lhs, 0, Eigen::OuterStride<>> lhs(a, rows, depth,
                                                           Eigen::OuterStride<>(lda));
  const Eigen::Map<const Rhs, 0, Eigen::OuterStride<>> rhs(b, depth, cols,
                                                           Eigen::OuterStride<>(ldb));
#if APEX_EIGEN_INTERNALS
  if (rows > 1 && cols > 1 && depth > 0) {
    namespace ei = Eigen::internal;
    if (!accumulate) out.setZero();
    ei::gemm_blocking_space<Eigen::RowMajor, C, C, Eigen::Dynamic, Eigen::Dynamic, Eigen::Dynamic,
                            1, false>
        blocking(rows, cols, depth, 1, true);
    ei::general_matrix_matrix_product<Index, C, LhsOrder, false, C, RhsOrder, false,
                                      Eigen::RowMajor, 1>::run(rows, cols, depth, a, lda, b, ldb, c,
                                                               1, ldc, C(1), blocking, nullptr);
    return;
  }
#endif
  if (accumulate) {
    out.noalias() += lhs * rhs;
  } else {
    out.noalias() = lhs * rhs;
  }
}

}  // namespace apex::detail
// NOLINTEND(bugprone-easily-swappable-parameters)
