// SPDX-License-Identifier: MIT
// The attention kernel's common instantiations, named once: the list that
// apex/precompiled_kernels.hpp compiles in one translation unit and that every other translation
// unit built with APEX_PRECOMPILED_KERNELS declares `extern` (so it does not compile them again).
//
// APEX_KERNEL_INSTANCES(X) calls X(TQ, TKV, TB, TO, R) for each: queries TQ, keys and values
// TKV, bias TB, outputs TO, rules R. They are what sdpa, sdpa_varlen, the window and paged caches
// and the layers run for float and double models, with float, double, half and bfloat16 caches,
// and for float models with q8_0, q4_0 and fp8 caches (fp8 in blocks of the default 128
// values), without user rules (NoRules); and what the stack's serve and verify_drafts run for
// the draft trees of speculative decoding over float, double, half, bfloat16 and q8_0 caches
// (tree_rules, one sequence at a time: TreeRulesAtBatch). Any other combination (user rules, mixed
// key and value types, other fp8 block sizes) is compiled where it is used, as without the macro.
// The kernels' row tables that these read are compiled once as well (APEX_ROW_TABLE_ELEMENTS,
// simd_kernels.hpp).
#pragma once

#include <apex/attention_rules.hpp>
#include <apex/detail/flash_attention.hpp>
#include <apex/tree_mask.hpp>

#include <utility>

namespace apex::detail {

/// The rules of one sequence of a batch of draft trees: tree_rules(masks) at a batch index.
using TreeRulesAtBatch = RulesAtBatch<decltype(tree_rules(std::declval<const TreeMasks&>()))>;

}  // namespace apex::detail

// NOLINTBEGIN(cppcoreguidelines-macro-usage): an X-macro list, the one place it is spelled
#define APEX_KERNEL_INSTANCES(X)                                                       \
  X(float, float, float, float, apex::NoRules)                                         \
  X(double, double, double, double, apex::NoRules)                                     \
  X(float, Eigen::half, float, float, apex::NoRules)                                   \
  X(float, Eigen::bfloat16, float, float, apex::NoRules)                               \
  X(Eigen::half, Eigen::half, Eigen::half, Eigen::half, apex::NoRules)                 \
  X(Eigen::bfloat16, Eigen::bfloat16, Eigen::bfloat16, Eigen::bfloat16, apex::NoRules) \
  X(float, apex::BlockQ8_0, float, float, apex::NoRules)                               \
  X(float, apex::BlockQ4_0, float, float, apex::NoRules)                               \
  X(float, apex::BlockFp8E4m3<>, float, float, apex::NoRules)                          \
  X(float, apex::BlockFp8E5m2<>, float, float, apex::NoRules)                          \
  X(float, float, float, float, apex::detail::TreeRulesAtBatch)                        \
  X(double, double, double, double, apex::detail::TreeRulesAtBatch)                    \
  X(float, Eigen::half, float, float, apex::detail::TreeRulesAtBatch)                  \
  X(float, Eigen::bfloat16, float, float, apex::detail::TreeRulesAtBatch)              \
  X(float, apex::BlockQ8_0, float, float, apex::detail::TreeRulesAtBatch)

// `extern template` (a declaration) or `template` (the definition) of one instance.
#define APEX_KERNEL_INSTANCE(KIND, TQ, TKV, TB, TO, R)                                            \
  KIND template void                                                                              \
  apex::detail::flash_attention<apex::detail::AttentionProblem<TQ, TKV, TKV, TB, R>, TO>(         \
      const apex::detail::AttentionJob<apex::detail::AttentionProblem<TQ, TKV, TKV, TB, R>, TO>*, \
      apex::Index, const apex::detail::FlashBlocking&);
#define APEX_KERNEL_DECLARE(TQ, TKV, TB, TO, R) APEX_KERNEL_INSTANCE(extern, TQ, TKV, TB, TO, R)
#define APEX_KERNEL_DEFINE(TQ, TKV, TB, TO, R) APEX_KERNEL_INSTANCE(, TQ, TKV, TB, TO, R)
// NOLINTEND(cppcoreguidelines-macro-usage)

#if defined(APEX_PRECOMPILED_KERNELS)
APEX_KERNEL_INSTANCES(APEX_KERNEL_DECLARE)
#endif
