// SPDX-License-Identifier: MIT
// Umbrella header: every public apex header, nothing else.
#pragma once

#include <apex/attention_layer.hpp>
#include <apex/attention_rules.hpp>
#include <apex/cache_memory.hpp>
#include <apex/cached_attention.hpp>
#include <apex/config.hpp>
#include <apex/cpu.hpp>
#include <apex/embedding.hpp>
#include <apex/gqa.hpp>
#include <apex/kv_cache.hpp>
#include <apex/kv_format.hpp>
#include <apex/layer_norm.hpp>
#include <apex/mask.hpp>
#include <apex/merge_attention.hpp>
#include <apex/mha.hpp>
#include <apex/mla.hpp>
#include <apex/mrope.hpp>
#include <apex/page_pool.hpp>
#include <apex/paged_attention.hpp>
#include <apex/paged_cache.hpp>
#include <apex/precompiled_kernels.hpp>
#include <apex/reference_attention.hpp>
#include <apex/rms_norm.hpp>
#include <apex/rope.hpp>
#include <apex/rope_config.hpp>
#include <apex/rope_scaling.hpp>
#include <apex/sdpa.hpp>
#include <apex/sdpa_params.hpp>
#include <apex/serving_cache.hpp>
#include <apex/stack.hpp>
#include <apex/stack_serving.hpp>
#include <apex/storage.hpp>
#include <apex/tensor.hpp>
#include <apex/varlen.hpp>
#include <apex/yarn.hpp>
