# SPDX-License-Identifier: MIT
"""apex.PagedKvCache: its attention equals apex.sdpa_varlen over the same tokens held
contiguously, bit for bit, through appends, forks, keep_tokens and frees; the cascade agrees
within attention's tolerance; bad calls raise ValueError and change nothing."""
import numpy as np
import pytest

import apex
import reference
from conftest import ATTENTION, assert_normwise

H_KV, H_Q, D = 2, 4, 32


def tokens(rng, n, heads=H_KV):
    return rng.standard_normal((n, heads, D)).astype(np.float32)


def varlen_over(histories, queries, **rule):
    """apex.sdpa_varlen over each sequence's whole history: the contiguous form of the call."""
    k = np.concatenate([h[0] for h in histories])
    v = np.concatenate([h[1] for h in histories])
    cu_k = np.concatenate([[0], np.cumsum([len(h[0]) for h in histories])])
    cu_q = np.concatenate([[0], np.cumsum([len(q) for q in queries])])
    return apex.sdpa_varlen(np.concatenate(queries), k, v, cu_q, cu_k, **rule)


def test_attention_over_pages_is_attention_over_the_tokens_bit_for_bit(rng):
    cache = apex.PagedKvCache(H_KV, D, page_size=4, num_pages=32)
    ids, histories = [], []
    for length in (3, 9, 1, 12):
        sid = cache.add()
        k, v = tokens(rng, length), tokens(rng, length)
        cache.append(sid, k[:2], v[:2])  # in two parts: the second fills pages already begun
        cache.append(sid, k[2:], v[2:])
        ids.append(sid)
        histories.append((k, v))
        assert cache.length(sid) == length
        assert len(cache.block_table(sid)) == -(-length // 4)
    queries = [tokens(rng, min(2, len(h[0])), H_Q) for h in histories]
    cu_q = np.concatenate([[0], np.cumsum([len(q) for q in queries])])
    out, lse = cache.attend(np.concatenate(queries), ids, cu_q, causal=True, return_lse=True)
    want, want_lse = varlen_over(histories, queries, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    heads = lambda a: a.transpose(1, 0, 2)[None]  # noqa: E731
    for i, (k, v) in enumerate(histories):
        ref, _ = reference.sdpa(heads(queries[i]), heads(k), heads(v), causal=True)
        assert_normwise(out[cu_q[i]:cu_q[i + 1]], ref[0].transpose(1, 0, 2), ATTENTION["float32"])


def test_forks_share_pages_until_they_diverge_and_the_cascade_agrees(rng):
    cache = apex.PagedKvCache(H_KV, D, page_size=4, num_pages=64)
    root = cache.add()
    k, v = tokens(rng, 10), tokens(rng, 10)
    cache.append(root, k, v)
    forks = [cache.fork(root) for _ in range(3)]
    assert all(cache.references(page) == 4 for page in cache.block_table(root))
    histories, queries = [], []
    for sid in [root] + forks:
        nk, nv = tokens(rng, 1), tokens(rng, 1)
        cache.append(sid, nk, nv)  # copies the shared, half-full last page first
        histories.append((np.concatenate([k, nk]), np.concatenate([v, nv])))
        queries.append(tokens(rng, 1, H_Q))
    assert cache.block_table(root)[:2] == cache.block_table(forks[0])[:2]
    assert cache.block_table(root)[2] != cache.block_table(forks[0])[2]
    ids = [root] + forks
    cu = np.arange(5)
    plain = cache.attend(np.concatenate(queries), ids, cu, causal=True)
    np.testing.assert_array_equal(plain, varlen_over(histories, queries, causal=True))
    cascade = cache.attend(np.concatenate(queries), ids, cu, causal=True, cascade=True)
    assert_normwise(cascade, plain, ATTENTION["float32"])
    in_use = cache.pages_in_use
    for sid in forks:
        cache.free(sid)
    assert cache.pages_in_use == in_use - 3 and len(cache) == 1 and forks[0] not in cache


def test_keep_tokens_keeps_the_accepted_draft_rows_in_order(rng):
    cache = apex.PagedKvCache(H_KV, D, page_size=4, num_pages=16)
    sid = cache.add()
    k, v = tokens(rng, 9), tokens(rng, 9)
    cache.append(sid, k, v)
    cache.keep_tokens(sid, 5, [0, 2, 3])  # of the draft rows 5..8, keep 5, 7 and 8
    kept = [0, 1, 2, 3, 4, 5, 7, 8]
    assert cache.length(sid) == len(kept)
    q = tokens(rng, 1, H_Q)
    out = cache.attend(q, [sid], [0, 1])
    np.testing.assert_array_equal(out, varlen_over([(k[kept], v[kept])], [q]))


@pytest.mark.parametrize("format", ["float16", "bfloat16", "q8_0", "q4_0", "fp8_e4m3"])
def test_every_format_reads_as_the_contiguous_cache_of_that_format(rng, format):
    head_dim = 128  # whole blocks of every format
    paged = apex.PagedKvCache(H_KV, head_dim, page_size=8, num_pages=8, format=format)
    flat = apex.KvCache(1, H_KV, head_dim, 20, format=format)
    sid = paged.add()
    k = rng.standard_normal((20, H_KV, head_dim)).astype(np.float32)
    v = rng.standard_normal((20, H_KV, head_dim)).astype(np.float32)
    paged.append(sid, k, v)
    flat.append(k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None])
    q = rng.standard_normal((3, H_Q, head_dim)).astype(np.float32)
    out = paged.attend(q, [sid], [0, 3], causal=True)
    want = flat.attend(q.transpose(1, 0, 2)[None], causal=True)
    np.testing.assert_array_equal(out, want[0].transpose(1, 0, 2))
    assert paged.format == format and paged.bytes == 2 * 8 * H_KV * 8 * flat.bytes // (2 * H_KV * 20)


def test_rejected_calls_change_nothing(rng):
    cache = apex.PagedKvCache(H_KV, D, page_size=4, num_pages=2)
    sid = cache.add()
    cache.append(sid, tokens(rng, 5), tokens(rng, 5))
    table, free = cache.block_table(sid), cache.free_pages
    with pytest.raises(ValueError, match=r"\[paged_kv_cache\]"):
        cache.append(sid, tokens(rng, 4), tokens(rng, 4))  # 9 tokens need 3 pages of 2
    with pytest.raises(ValueError, match=r"\[paged_kv_cache\] k and v must be \[1, H_kv, n, d_h\]"):
        cache.append(sid, tokens(rng, 1, 3), tokens(rng, 1, 3))
    with pytest.raises(ValueError, match=r"\[paged_kv_cache\] k dtype \(float64\) must be float32"):
        cache.append(sid, tokens(rng, 1).astype(np.float64), tokens(rng, 1))
    with pytest.raises(ValueError, match=r"\[paged_kv_cache\]"):
        cache.append(sid + 7, tokens(rng, 1), tokens(rng, 1))
    with pytest.raises(ValueError, match=r"\[sdpa_paged\]"):
        cache.attend(tokens(rng, 6, H_Q), [sid], [0, 6])  # more queries than tokens held
    with pytest.raises(ValueError, match=r"\[paged_kv_cache\] format \('int3'\)"):
        apex.PagedKvCache(H_KV, D, 4, 2, format="int3")
    with pytest.raises(ValueError, match=r"head_dim"):
        apex.PagedKvCache(H_KV, 48, 4, 2, format="q8_0" if 48 % 32 else "q4_0")
    assert cache.length(sid) == 5 and cache.block_table(sid) == table and cache.free_pages == free
