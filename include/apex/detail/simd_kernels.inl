// SPDX-License-Identifier: MIT
// The body of apex's float kernels for one instruction set, included once per level by
// simd_kernels.hpp inside that level's namespace and target region, after the level's vector
// operations (V, Mask, kLanes, kTileRows, load, store, set1, fmadd, ...). Not a header of its
// own: it has no include guard and no includes, and is written once for every level.
//
// Every function computes each element the same way wherever it lies in a tile (full panels and
// tails use the same operations, tails through masks), so a result does not depend on how its
// rows or columns were cut: the bits of a row are the same in a tile of 1 row or of 256.

/// Columns of one panel of a product: two vectors.
constexpr Index kPanel = 2 * kLanes;

/// c[R × (kVecs·kLanes)] (+)= a[R × depth] · b[depth × kVecs·kLanes], the register-blocked micro
/// kernel: the R·kVecs accumulators stay in registers across the whole depth, a broadcasts, b is
/// loaded a row of vectors at a time. Row i of a at a + i·lda, row k of b at b + k·ldb, row i of c
/// at c + i·ldc. Each c(i, j) is one chain of fused multiply-adds over k = 0, 1, …, depth − 1,
/// starting from c(i, j) when `add` is set, else from 0. The last vector reads and writes only
/// the lanes of `last` (kMasked).
template <int R, int kVecs, bool kMasked>
APEX_ALWAYS_INLINE void madd_tile(float* c, Index ldc, const float* a, Index lda, const float* b,
                                  Index ldb, Index depth, bool add, Mask last) {
  V acc[R][kVecs];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int u = 0; u < kVecs; ++u) {
      const bool part = kMasked && u == kVecs - 1;
      acc[i][u] = !add   ? zero()
                  : part ? load(c + i * ldc + u * kLanes, last)
                         : load(c + i * ldc + u * kLanes);
    }
  }
  for (Index k = 0; k < depth; ++k) {
    V row[kVecs];
#pragma GCC unroll 2
    for (int u = 0; u < kVecs; ++u) {
      const bool part = kMasked && u == kVecs - 1;
      row[u] = part ? load(b + k * ldb + u * kLanes, last) : load(b + k * ldb + u * kLanes);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const V x = set1(a[i * lda + k]);
#pragma GCC unroll 2
      for (int u = 0; u < kVecs; ++u) acc[i][u] = fmadd(x, row[u], acc[i][u]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int u = 0; u < kVecs; ++u) {
      if (kMasked && u == kVecs - 1) {
        store(c + i * ldc + u * kLanes, acc[i][u], last);
      } else {
        store(c + i * ldc + u * kLanes, acc[i][u]);
      }
    }
  }
}

/// madd_tile for a panel of `cols` <= kPanel columns: full, or with its last vector masked.
template <int R>
void madd_panel(float* c, Index ldc, const float* a, Index lda, const float* b, Index ldb,
                Index depth, bool add, Index cols) {
  if (cols == kPanel) {
    madd_tile<R, 2, false>(c, ldc, a, lda, b, ldb, depth, add, Mask{});
  } else if (cols > kLanes) {
    madd_tile<R, 2, true>(c, ldc, a, lda, b, ldb, depth, add, first_lanes(cols - kLanes));
  } else {
    madd_tile<R, 1, true>(c, ldc, a, lda, b, ldb, depth, add, first_lanes(cols));
  }
}

/// The rows of a row block below kTileRows: madd_panel with R = rows.
template <int R = kTileRows - 1>
void madd_panel_rows(Index rows, float* c, Index ldc, const float* a, Index lda, const float* b,
                     Index ldb, Index depth, bool add, Index cols) {
  if constexpr (R > 0) {
    if (rows == R) {
      madd_panel<R>(c, ldc, a, lda, b, ldb, depth, add, cols);
    } else {
      madd_panel_rows<R - 1>(rows, c, ldc, a, lda, b, ldb, depth, add, cols);
    }
  }
}

/// c [rows × cols] (+)= a [rows × depth] · b, b given as panels of kPanel columns: panel p
/// (columns [p·kPanel, p·kPanel + kPanel)) starts at b + p·panel_step, its row k at + k·ldb.
/// Row blocks of kTileRows rows, each through every panel while its rows of a stay in L1.
/// Allocates nothing.
inline void gemm(float* c, Index ldc, const float* a, Index lda, const float* b, Index ldb,
                 Index panel_step, Index rows, Index cols, Index depth, bool add) {
  for (Index r = 0; r < rows; r += kTileRows) {
    const Index block = std::min<Index>(kTileRows, rows - r);
    for (Index j = 0, p = 0; j < cols; j += kPanel, ++p) {
      const Index width = std::min(kPanel, cols - j);
      float* cp = c + r * ldc + j;
      const float* ap = a + r * lda;
      const float* bp = b + p * panel_step;
      if (block == kTileRows) {
        madd_panel<kTileRows>(cp, ldc, ap, lda, bp, ldb, depth, add, width);
      } else {
        madd_panel_rows(block, cp, ldc, ap, lda, bp, ldb, depth, add, width);
      }
    }
  }
}

/// packed = kᵀ in panels for gemm: panel p is [d × kPanel], element (c, l) = k(p·kPanel + l, c)
/// (0 past the n rows), k [n × d] with row stride ld_k. Writes ⌈n / kPanel⌉ · d · kPanel floats.
inline void pack_transposed(float* packed, const float* k, Index ld_k, Index n, Index d) {
  for (Index j0 = 0; j0 < n; j0 += kPanel) {
    float* panel = packed + j0 * d;
    const Index width = std::min(kPanel, n - j0);
    for (Index l = 0; l < width; ++l) {
      const float* row = k + (j0 + l) * ld_k;
      for (Index c = 0; c < d; ++c) panel[c * kPanel + l] = row[c];
    }
    for (Index l = width; l < kPanel; ++l) {
      for (Index c = 0; c < d; ++c) panel[c * kPanel + l] = 0.0F;
    }
  }
}

/// max_j s_j over n scores, NaN when one is NaN, -inf when n = 0.
inline float max_of(const float* s, Index n) {
  V best = set1(-std::numeric_limits<float>::infinity());
  Mask nan = no_lanes();
  for (Index j = 0; j < n; j += kLanes) {
    const V x = j + kLanes <= n
                    ? load(s + j)
                    : load(s + j, first_lanes(n - j), -std::numeric_limits<float>::infinity());
    nan = mask_or(nan, is_nan(x));
    best = max(best, x);
  }
  return any_of(nan, first_lanes(kLanes)) ? std::numeric_limits<float>::quiet_NaN()
                                          : reduce_max(best);
}

/// e^x for x <= 0 (no NaN; -inf is selected before this is called), to about one ulp: the
/// reduction x = n·ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, Cody and Waite), a degree-6
/// polynomial for e^r (Cephes' expf), and 2^n put into the exponent. Below ln(2^-126) the result
/// is flushed to +0 (the weight of a key far below the row's maximum); NaN stays NaN.
APEX_ALWAYS_INLINE V exp_nonpositive(V x) {
  const V lowest = set1(-87.33654F);
  const Mask flushed = less(x, lowest);
  x = max(lowest, x);  // max(a, b) returns b when either is NaN
  const V n = round_nearest(fmadd(x, set1(1.44269504088896341F), zero()));
  V r = fmadd(n, set1(-0.693359375F), x);
  r = fmadd(n, set1(2.12194440e-4F), r);
  V p = set1(1.9875691500E-4F);
  p = fmadd(p, r, set1(1.3981999507E-3F));
  p = fmadd(p, r, set1(8.3334519073E-3F));
  p = fmadd(p, r, set1(4.1665795894E-2F));
  p = fmadd(p, r, set1(1.6666665459E-1F));
  p = fmadd(p, r, set1(5.0000001201E-1F));
  const V r2 = mul(r, r);
  p = fmadd(p, r2, add(r, set1(1.0F)));
  return select(flushed, zero(), mul(p, pow2(n)));
}

/// s_j = exp(s_j − max) where s_j > -inf, -0.0 exactly where s_j = -inf (exp_weights in
/// eigen_adapter.hpp says why), for n scores; returns Σ_j s_j after it and sets `hidden` when some
/// s_j was -inf. max is not NaN and no s_j is above it (a max of +inf makes the weights NaN).
inline float exp_sum(float* s, Index n, float max, bool& hidden) {
  const V m = set1(max);
  const V neg_inf = set1(-std::numeric_limits<float>::infinity());
  V sum = zero();
  bool any = false;
  for (Index j = 0; j < n; j += kLanes) {
    const bool full = j + kLanes <= n;
    const Mask lanes = first_lanes(n - j);
    const V x = full ? load(s + j) : load(s + j, lanes);
    const Mask is_hidden = equal(x, neg_inf);
    const V w = select(is_hidden, set1(-0.0F), exp_nonpositive(sub(x, m)));
    any = any || any_of(is_hidden, lanes);
    if (full) {
      store(s + j, w);
      sum = add(sum, w);
    } else {
      store(s + j, w, lanes);
      sum = add(sum, select(lanes, w, zero()));
    }
  }
  hidden = hidden || any;
  return reduce_add(sum);
}
