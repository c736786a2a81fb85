// SPDX-License-Identifier: MIT
// Paged KV caches (vLLM's PagedAttention): the page bookkeeping (PagePool, PagedKvCache,
// PagedLatentCache, BlockTables; page_pool.hpp, whose top draws the layout) and the attention
// over them (sdpa_paged, sdpa_block_tables; paged_attention.hpp). Include this header for both.
#pragma once

#include <apex/page_pool.hpp>
#include <apex/paged_attention.hpp>
