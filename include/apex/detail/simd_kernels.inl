// SPDX-License-Identifier: MIT
// The body of apex's float kernels for one instruction set, included once per level by
// simd_kernels.hpp inside that level's namespace and target region, after the level's vector
// operations (V, Mask, kLanes, kTileRows, load, store, set1, fmadd, ...). Not a header of its
// own: it has no include guard and no includes, and is written once for every level.
//
// Every function computes each element the same way wherever it lies in a tile (full panels and
// tails use the same operations, tails through masks), so a result does not depend on how its
// rows or columns were cut: the bits of a row are the same in a tile of 1 row or of 256.

// BLAS-style (pointer, leading dimension, rows, columns) lists, as in every GEMM's signatures.
// NOLINTBEGIN(bugprone-easily-swappable-parameters)

/// Columns of one panel of a product: two vectors.
constexpr Index kPanel = 2 * kLanes;

#if !defined(APEX_SIMD_LOADS_OF_AVX512)
/// The values [p, p + kLanes) of a run of blocks (kReadsBlocks): the values of their codes times
/// the block's scale (the level's block_codes and block_scale); and the lanes of m of them.
template <class Block>
V load(BlockValues<Block> p) {
  const Block& b = p.block();
  return mul(block_codes(b, p.offset()), block_scale(b));
}
template <class Block>
V load(BlockValues<Block> p, Mask m) {
  return select(m, load(p), zero());
}
#endif

/// The factor a(i, k) as madd_tile broadcasts it, and its multiply-add with a row of b: for float,
/// set1 and one fused multiply-add. A level with bfloat16 dot products declares the same two for
/// Bf16Pair (a vector lane then holds a pair, and one step adds both of its products).
APEX_ALWAYS_INLINE V broadcast(const float* a) { return set1(*a); }
APEX_ALWAYS_INLINE V madd(const float* /*a*/, V x, V b, V acc) { return fmadd(x, b, acc); }

#if !defined(APEX_SIMD_LOADS_OF_AVX512)
/// first, second = a block's values [at, at + kLanes) and [at + kLanes, at + 2·kLanes): its codes'
/// values times its scale, widened once for the two. A level may declare an overload for a block
/// type that forms the same bits with fewer operations (AVX-512's for q4_0).
template <class Block>
APEX_ALWAYS_INLINE void block_pair(const Block& b, Index at, V& first, V& second) {
  const V scale = block_scale(b);
  first = mul(block_codes(b, at), scale);
  second = mul(block_codes(b, at + kLanes), scale);
}
/// block_pair for fp8 blocks: the codes' halves are their values over fp8_half_unit (2^8 for
/// e4m3), and the unit goes into the scale, once for the pair, instead of into every value. The
/// same bits: both products are the exact value times the scale, rounded once; where the scale
/// times the unit would overflow, each value is multiplied by the unit first, as block_codes does.
template <Fp8Kind K, int B>
APEX_ALWAYS_INLINE void block_pair(const BlockFp8<K, B>& b, Index at, V& first, V& second) {
  constexpr float kUnit = fp8_half_unit<K>();
  V low = fp8_half_values<K>(b.code + at);
  V high = fp8_half_values<K>(b.code + at + kLanes);
  float scale = b.scale;
  if (std::fabs(scale) <= std::numeric_limits<float>::max() / kUnit) {
    scale *= kUnit;
  } else {
    low = mul(low, set1(kUnit));
    high = mul(high, set1(kUnit));
  }
  first = mul(low, set1(scale));
  second = mul(high, set1(scale));
}
#endif

/// first, second = the vectors at p and p + kLanes; for values of blocks (p at a multiple of
/// 2·kLanes values, so both lie in one block) the block's scale is widened once for the two.
template <class P>
APEX_ALWAYS_INLINE void load_pair(V& first, V& second, P p) {
  first = load(p);
  second = load(p + kLanes);
}
template <class Block>
APEX_ALWAYS_INLINE void load_pair(V& first, V& second, BlockValues<Block> p) {
  static_assert(Block::kValues % (2 * kLanes) == 0, "a pair of vectors lies in one block");
  APEX_ASSERT(p.offset() % (2 * kLanes) == 0);
  block_pair(p.block(), p.offset(), first, second);
}

/// row[u] = the vector at p + u·kLanes for u < kVecs, the last one only the lanes of `last` when
/// kMasked, each kept in a register: compilers otherwise fold its load into every multiply-add
/// that reads it, reading it R times in madd_tile (measured: a 4-row streaming update at half
/// speed).
template <int kVecs, bool kMasked, class P>
APEX_ALWAYS_INLINE void load_vectors(V* row, P p, Mask last) {
#pragma GCC unroll 4
  for (int u = 0; u < kVecs; ++u) {
    row[u] = kMasked && u == kVecs - 1 ? load(p + u * kLanes, last) : load(p + u * kLanes);
    asm("" : "+v"(row[u]));
  }
}
/// The same for values of blocks, a pair of vectors at a time (load_pair: p at a multiple of
/// 2·kLanes values, as stream_group's wide tiles are) where kVecs is even and none is masked.
template <int kVecs, bool kMasked, class Block>
APEX_ALWAYS_INLINE void load_vectors(V* row, BlockValues<Block> p, Mask last) {
  if constexpr (kVecs % 2 != 0 || kMasked) {
    load_vectors<kVecs, kMasked, BlockValues<Block>>(row, p, last);
  } else {
#pragma GCC unroll 4
    for (int u = 0; u < kVecs; u += 2) {
      load_pair(row[u], row[u + 1], p + u * kLanes);
      asm("" : "+v"(row[u]), "+v"(row[u + 1]));
    }
  }
}

/// c[R × (kVecs·kLanes)] (+)= a[R × depth] · b[depth × kVecs·kLanes], the register-blocked micro
/// kernel: the R·kVecs accumulators stay in registers across the whole depth, a broadcasts, b is
/// loaded a row of vectors at a time (widened to float in registers when b points to a 16-bit
/// format, or is BlockValues).
/// Row i of a at a + i·lda, row k of b at b + k·ldb, row i of c at c + i·ldc. Each c(i, j) is
/// one chain of multiply-adds (madd) over k = 0, 1, …, depth − 1, starting from c(i, j) when `add`
/// is set (times scale[i] where scale is given: the online softmax's rescaling, in registers),
/// else from 0. The last vector reads and writes only the lanes of `last` (kMasked). A is float
/// (b any), or Bf16Pair for a and b alike, depth then counting pairs.
template <int R, int kVecs, bool kMasked, class A, class P>
APEX_ALWAYS_INLINE void madd_tile(float* c, Index ldc, const A* a, Index lda, P b, Index ldb,
                                  Index depth, bool add, const float* scale, Mask last) {
  V acc[R][kVecs];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int u = 0; u < kVecs; ++u) {
      const bool part = kMasked && u == kVecs - 1;
      acc[i][u] = !add   ? zero()
                  : part ? load(c + i * ldc + u * kLanes, last)
                         : load(c + i * ldc + u * kLanes);
      if (add && scale != nullptr) acc[i][u] = mul(acc[i][u], set1(scale[i]));
    }
  }
  for (Index k = 0; k < depth; ++k) {
    V row[kVecs];
    load_vectors<kVecs, kMasked>(row, b + k * ldb, last);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const A* factor = a + i * lda + k;
      const V x = broadcast(factor);
#pragma GCC unroll 4
      for (int u = 0; u < kVecs; ++u) acc[i][u] = madd(factor, x, row[u], acc[i][u]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
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
template <int R, class A, class T>
void madd_panel(float* c, Index ldc, const A* a, Index lda, const T* b, Index ldb, Index depth,
                bool add, const float* scale, Index cols) {
  if (cols == kPanel) {
    madd_tile<R, 2, false>(c, ldc, a, lda, b, ldb, depth, add, scale, Mask{});
  } else if (cols > kLanes) {
    madd_tile<R, 2, true>(c, ldc, a, lda, b, ldb, depth, add, scale, first_lanes(cols - kLanes));
  } else {
    madd_tile<R, 1, true>(c, ldc, a, lda, b, ldb, depth, add, scale, first_lanes(cols));
  }
}

/// Rows of the tiles that take what is left below kTileRows rows, before single rows (three
/// tile heights in all keep the kernels' compile time down; a row's bits do not depend on it).
constexpr Index kMidRows = 4;

/// c [rows × cols] (+)= a [rows × depth] · b, b given as panels of kPanel columns: panel p
/// (columns [p·kPanel, p·kPanel + kPanel)) starts at b + p·panel_step, its row k at + k·ldb.
/// Row blocks of kTileRows rows (then kMidRows, then single rows), each through every panel
/// while its rows of a stay in L1.
template <class A, class T>
void gemm_pass(float* c, Index ldc, const A* a, Index lda, const T* b, Index ldb, Index panel_step,
               Index rows, Index cols, Index depth, bool add, const float* scale) {
  for (Index r = 0; r < rows;) {
    const Index left = rows - r;
    const Index block = left >= kTileRows ? kTileRows : left >= kMidRows ? kMidRows : 1;
    for (Index j = 0, p = 0; j < cols; j += kPanel, ++p) {
      const Index width = std::min(kPanel, cols - j);
      float* cp = c + r * ldc + j;
      const A* ap = a + r * lda;
      const T* bp = depth == 0 ? b : b + p * panel_step;  // b may be null with no depth
      const float* sp = scale == nullptr ? nullptr : scale + r;
      if (block == kTileRows) {
        madd_panel<kTileRows>(cp, ldc, ap, lda, bp, ldb, depth, add, sp, width);
      } else if (block == kMidRows) {
        madd_panel<kMidRows>(cp, ldc, ap, lda, bp, ldb, depth, add, sp, width);
      } else {
        madd_panel<1>(cp, ldc, ap, lda, bp, ldb, depth, add, sp, width);
      }
    }
    r += block;
  }
}

/// c (+)= a · b on the compute-bound path: gemm_pass over the whole depth at once, each block of
/// rows of a in L1 through every panel. b is float, or a 16-bit format widened as it is loaded;
/// or a and b are both Bf16Pair. Allocates nothing.
template <class A, class T>
void gemm(float* c, Index ldc, const A* a, Index lda, const T* b, Index ldb, Index panel_step,
          Index rows, Index cols, Index depth, bool add, const float* scale) {
  gemm_pass(c, ldc, a, lda, b, ldb, panel_step, rows, cols, depth, add, scale);
}

/// Vectors of columns of a streaming tile: four rows × four vectors (16 of AVX-512's 32
/// registers) or × two (8 of AVX2's 16). Fewer columns per tile measured slower: each loaded
/// value feeds fewer multiply-adds (a 4 × 2 tile of AVX-512 streamed at half the speed).
constexpr int kStreamVecs = kLanes == 16 ? 4 : 2;
/// Whether the streaming kernels take rows of P eight at a time (then four, then one): on
/// AVX-512 for rows widened in registers (16-bit formats and blocks), whose widening then serves
/// eight query rows instead of four (GQA groups of 8 and more). Eight rows × two vectors of
/// values (16 accumulators) is the streaming update's tile then.
template <class P>
constexpr bool kEightRows = kLanes == 16 && !std::is_same_v<P, const float*>;
/// Vectors of columns of the streaming update's tile of R rows.
template <int R>
constexpr int kStreamTileVecs = R > 4 ? 2 : kStreamVecs;
/// Keys of one group of the streaming update: every column of their rows before the next group.
constexpr Index kStreamGroup = 8;

/// acc [R × d_v] += p [R × n] · v [n × d_v] (value row j at v + j·stride) for n <= kStreamGroup
/// keys: tiles of kStreamVecs vectors across the columns, then single vectors, the last masked.
template <int R, class P>
void stream_group(float* acc, Index ld_acc, const float* p, Index ld_p, P v, Index stride, Index n,
                  Index d_v) {
  constexpr int kVecs = kStreamTileVecs<R>;
  constexpr Index kWide = kVecs * kLanes;
  Index c = 0;
  for (; c + kWide <= d_v; c += kWide) {
    madd_tile<R, kVecs, false>(acc + c, ld_acc, p, ld_p, v + c, stride, n, true, nullptr, Mask{});
  }
  for (; c + kLanes <= d_v; c += kLanes) {
    madd_tile<R, 1, false>(acc + c, ld_acc, p, ld_p, v + c, stride, n, true, nullptr, Mask{});
  }
  if (c < d_v) {
    madd_tile<R, 1, true>(acc + c, ld_acc, p, ld_p, v + c, stride, n, true, nullptr,
                          first_lanes(d_v - c));
  }
}

/// acc_r += Σ_j p(r, j) v_j for `rows` rows and n value rows (row j at v + j·stride): the
/// streaming update of decoding (a few rows, bound by reading v). Groups of kStreamGroup keys,
/// every column of them before the next group, so that each value row is read once, whole, in
/// memory order, for eight rows at a time where kEightRows, else four; rows are prefetched 16
/// ahead (prefetch_values), never past the n rows given (a cache's page ends there). v is a
/// pointer to rows of float or a 16-bit format, or BlockValues (stride then counts values). Each
/// acc(r, c) is one chain of fused multiply-adds over the keys in order, whatever the groups and
/// the rows beside it. Allocates nothing.
template <class P>
void stream_update(float* acc, Index ld_acc, const float* p, Index ld_p, Index rows, P v,
                   Index stride, Index n, Index d_v) {
  for (Index j0 = 0; j0 < n; j0 += kStreamGroup) {
    const Index m = std::min(kStreamGroup, n - j0);
    const P values = v + j0 * stride;
    for (Index j = 16; j < 16 + m && j0 + j < n; ++j) prefetch_values(values + j * stride, d_v);
    Index r = 0;
    if constexpr (kEightRows<P>) {
      for (; r + 8 <= rows; r += 8) {
        stream_group<8>(acc + r * ld_acc, ld_acc, p + r * ld_p + j0, ld_p, values, stride, m, d_v);
      }
    }
    for (; r + 4 <= rows; r += 4) {
      stream_group<4>(acc + r * ld_acc, ld_acc, p + r * ld_p + j0, ld_p, values, stride, m, d_v);
    }
    for (; r < rows; ++r) {
      stream_group<1>(acc + r * ld_acc, ld_acc, p + r * ld_p + j0, ld_p, values, stride, m, d_v);
    }
  }
}

/// sums[i] = the vector whose lanes add up to q_i · key, for R query rows q (row i at
/// q + i·d) and one key row of d elements widened in registers: two vector accumulators over
/// alternating chunks of d (the last chunk masked), added; the same operations for every row,
/// whatever R.
template <int R, class P>
APEX_ALWAYS_INLINE void dot_sums(V* sums, const float* q, Index d, P key) {
  V even[R];
  V odd[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) even[i] = odd[i] = zero();
  Index c = 0;
  for (; c + 2 * kLanes <= d; c += 2 * kLanes) {
    V k0, k1;
    load_pair(k0, k1, key + c);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      even[i] = fmadd(load(q + i * d + c), k0, even[i]);
      odd[i] = fmadd(load(q + i * d + c + kLanes), k1, odd[i]);
    }
  }
  if (c + kLanes <= d) {
    const V k0 = load(key + c);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) even[i] = fmadd(load(q + i * d + c), k0, even[i]);
    c += kLanes;
  }
  if (c < d) {
    const Mask lanes = first_lanes(d - c);
    const V k1 = load(key + c, lanes);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) odd[i] = fmadd(load(q + i * d + c, lanes), k1, odd[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) sums[i] = add(even[i], odd[i]);
}

/// s(i, j) = q_i · k_j for R query rows and m <= kLanes key rows (row j at k + j·k_stride),
/// stored at s + i·ld_s + j: each pair of keys' sums (dot_sums) folded once (pair_sums) as they
/// come, then summed across lanes for all m keys at once (reduce_pairs). Each score is
/// reduce_add's sum of its own lanes: its bits do not depend on the keys beside it.
template <int R, class P>
void dot_keys(float* s, Index ld_s, const float* q, Index d, P k, Index k_stride, Index m) {
  constexpr Index kPairs = kLanes / 2;
  V pairs[R * kPairs];
  for (Index j = 0; j < kLanes; j += 2) {
    V first[R], second[R];
    for (int i = 0; i < R; ++i) first[i] = second[i] = zero();
    if (j < m) dot_sums<R>(first, q, d, k + j * k_stride);
    if (j + 1 < m) dot_sums<R>(second, q, d, k + (j + 1) * k_stride);
    for (int i = 0; i < R; ++i) pairs[i * kPairs + j / 2] = pair_sums(first[i], second[i]);
  }
  for (int i = 0; i < R; ++i) {
    const V total = reduce_pairs(pairs + i * kPairs);
    if (m == kLanes) {
      store(s + i * ld_s, total);
    } else {
      store(s + i * ld_s, total, first_lanes(m));
    }
  }
}

/// s(r, j) = q_r · k_j for `rows` query rows q (contiguous, rows × d) and n key rows (row j at
/// k + j·k_stride): the streaming product of the scores (a few rows, bound by reading the keys).
/// Groups of kLanes keys, each read in memory order, widened in registers, used by eight query
/// rows at a time where kEightRows, else four, and summed across lanes together (dot_keys), the
/// same operations for every row whatever the rows beside it; rows are prefetched as
/// stream_update's. k as stream_update's v. Allocates nothing.
template <class P>
void dots(float* s, Index ld_s, const float* q, Index rows, P k, Index k_stride, Index n, Index d) {
  for (Index j0 = 0; j0 < n; j0 += kLanes) {
    const Index m = std::min(kLanes, n - j0);
    const P keys = k + j0 * k_stride;
    for (Index j = 16; j < 16 + m && j0 + j < n; ++j) prefetch_values(keys + j * k_stride, d);
    Index r = 0;
    if constexpr (kEightRows<P>) {
      for (; r + 8 <= rows; r += 8)
        dot_keys<8>(s + r * ld_s + j0, ld_s, q + r * d, d, keys, k_stride, m);
    }
    for (; r + 4 <= rows; r += 4)
      dot_keys<4>(s + r * ld_s + j0, ld_s, q + r * d, d, keys, k_stride, m);
    for (; r < rows; ++r) dot_keys<1>(s + r * ld_s + j0, ld_s, q + r * d, d, keys, k_stride, m);
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

/// stream_update and dots on rows of blocks (strides in blocks), read through BlockValues.
template <class Block>
void block_update(float* acc, Index ld_acc, const float* p, Index ld_p, Index rows, const Block* v,
                  Index stride, Index n, Index d_v) {
  stream_update(acc, ld_acc, p, ld_p, rows, BlockValues<Block>{v, 0}, stride * Block::kValues, n,
                d_v);
}
template <class Block>
void block_dots(float* s, Index ld_s, const float* q, Index rows, const Block* k, Index k_stride,
                Index n, Index d) {
  dots(s, ld_s, q, rows, BlockValues<Block>{k, 0}, k_stride * Block::kValues, n, d);
}

/// This level's kernels reading rows of E, as a table (simd_kernels.hpp's row_kernels); a block
/// format has the streaming kernels only.
template <class E>
const RowKernels<E>& row_table() {
  if constexpr (kReadsBlocks<E>) {
    static const RowKernels<E> table{nullptr, &block_update<E>, &block_dots<E>};
    return table;
  } else {
    static const RowKernels<E> table{&gemm<float, E>, &stream_update<const E*>, &dots<const E*>};
    return table;
  }
}

// The row tables of APEX_ROW_TABLE_ELEMENTS (simd_kernels.hpp) are compiled once, in
// apex::precompiled_kernels: declared here, defined in its translation unit. The bfloat16 level
// reads rows through AVX-512's tables and has none of its own.
#if defined(APEX_PRECOMPILED_KERNELS) && !defined(APEX_SIMD_LOADS_OF_AVX512)
APEX_ROW_TABLE_ELEMENTS(APEX_ROW_TABLE_DECLARE)
#if defined(APEX_INSTANTIATE_KERNELS)
APEX_ROW_TABLE_ELEMENTS(APEX_ROW_TABLE_DEFINE)
#endif
#endif

/// This level's float kernels, as a table (simd_kernels.hpp's float_kernels).
inline const FloatKernels& float_table() {
  static const FloatKernels table{
      kIsa, row_table<float>(), &pack_transposed, &max_of, &exp_sum, kPanel, nullptr};
  return table;
}

// NOLINTEND(bugprone-easily-swappable-parameters)
