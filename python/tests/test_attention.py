# SPDX-License-Identifier: MIT
"""apex.sdpa, apex.sdpa_varlen, apex.merge_attention against the float64 loops of reference.py
and against PyTorch's attention."""
import math

import numpy as np
import pytest

import apex
import reference
from conftest import ATTENTION, assert_normwise


def qkv(rng, b, hq, hkv, sq, sk, d, dv=None, dtype=np.float32):
    dv = d if dv is None else dv
    q = rng.standard_normal((b, hq, sq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, sk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, sk, dv)).astype(dtype)
    return q, k, v


def check(q, k, v, dtype_name="float32", **options):
    out, lse = apex.sdpa(q, k, v, return_lse=True, **options)
    as_float = (lambda a: apex.from_bfloat16(a)) if dtype_name == "bfloat16" else (lambda a: a)
    ref_options = {key: value for key, value in options.items() if key != "dtype"}
    ref_out, ref_lse = reference.sdpa(as_float(q), as_float(k), as_float(v), **ref_options)
    tol = ATTENTION[dtype_name]
    assert_normwise(as_float(out), ref_out, tol)
    assert_normwise(as_float(lse), ref_lse, tol, floor=1.0)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_every_rule_and_score_term_matches_the_float64_loops(rng, dtype):
    q, k, v = qkv(rng, 2, 4, 2, 7, 11, 16, 8, dtype)
    name = np.dtype(dtype).name
    check(q, k, v, name)
    check(q, k, v, name, causal=True)
    check(q, k, v, name, causal=True, window=3)
    check(q, k, v, name, causal=True, chunk=4)
    check(q, k, v, name, causal=True, prefix=5)
    check(q, k, v, name, causal=True, query_offset=0)
    check(q, k, v, name, causal=True, key_offset=3)
    check(q, k, v, name, causal=True, documents=np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]))
    check(q, k, v, name, scale=0.3, softcap=2.0)
    check(q, k, v, name, sinks=[0.5, -1.0, 2.0, 0.0])
    check(q, k, v, name, causal=True, alibi_slopes=apex.alibi_slopes(4))
    mask = rng.random((1, 4, 7, 11)) < 0.6
    check(q, k, v, name, mask=mask)
    bias = rng.standard_normal((2, 1, 7, 11)).astype(dtype)
    check(q, k, v, name, bias=bias, causal=True)


def test_bfloat16_over_uint16_bits(rng):
    q, k, v = (apex.to_bfloat16(a) for a in qkv(rng, 1, 4, 4, 5, 9, 8))
    assert q.dtype == np.uint16
    out = check(q, k, v, "bfloat16", dtype="bfloat16", causal=True)
    assert out.dtype == np.uint16


def test_ranks_two_and_three_are_one_batch_and_one_head(rng):
    q, k, v = qkv(rng, 1, 3, 3, 5, 6, 8)
    full = apex.sdpa(q, k, v, causal=True)
    np.testing.assert_array_equal(apex.sdpa(q[0], k[0], v[0], causal=True), full[0])
    np.testing.assert_array_equal(apex.sdpa(q[0, 1], k[0, 1], v[0, 1], causal=True), full[0, 1])


def test_a_row_without_keys_is_zeros_with_lse_minus_infinity(rng):
    q, k, v = qkv(rng, 1, 1, 1, 2, 3, 4)
    mask = np.array([[True, False, True], [False, False, False]])
    out, lse = apex.sdpa(q, k, v, mask=mask, return_lse=True)
    assert np.all(out[0, 0, 1] == 0) and lse[0, 0, 1] == -np.inf and np.isfinite(lse[0, 0, 0])


def test_varlen_equals_one_sdpa_call_per_sequence_bit_for_bit(rng):
    lengths_q, lengths_k = [3, 0, 5, 2], [4, 2, 5, 7]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)])
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)])
    q = rng.standard_normal((cu_q[-1], 4, 8)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], 2, 8)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], 2, 6)).astype(np.float32)
    out, lse = apex.sdpa_varlen(q, k, v, cu_q, cu_k, causal=True, window=3, return_lse=True)
    assert out.shape == (cu_q[-1], 4, 6) and lse.shape == (cu_q[-1], 4)
    for i in range(len(lengths_q)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        heads = lambda a: np.ascontiguousarray(a.transpose(1, 0, 2))  # noqa: E731
        o, l = apex.sdpa(heads(q[rows]), heads(k[keys]), heads(v[keys]), causal=True, window=3,
                         return_lse=True)
        np.testing.assert_array_equal(out[rows], o.transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[rows], l.T)
        ref, _ = reference.sdpa(heads(q[rows])[None], heads(k[keys])[None], heads(v[keys])[None],
                                causal=True, window=3)
        assert_normwise(out[rows], ref[0].transpose(1, 0, 2), ATTENTION["float32"])


def test_varlen_dense_mask_rows_are_the_packed_query_rows(rng):
    cu = np.array([0, 2, 5])
    q = rng.standard_normal((5, 2, 4)).astype(np.float32)
    k = rng.standard_normal((5, 2, 4)).astype(np.float32)
    v = rng.standard_normal((5, 2, 4)).astype(np.float32)
    mask = rng.random((5, 3)) < 0.7
    mask[:, 0] = True
    out = apex.sdpa_varlen(q, k, v, cu, cu, mask=mask)
    for i, (a, b) in enumerate([(0, 2), (2, 5)]):
        heads = lambda t: t[a:b].transpose(1, 0, 2)[None]  # noqa: E731
        ref, _ = reference.sdpa(heads(q), heads(k), heads(v), mask=mask[None, None, a:b, : b - a])
        assert_normwise(out[a:b], ref[0].transpose(1, 0, 2), ATTENTION["float32"])


def test_merge_of_two_key_halves_is_attention_over_all_keys(rng):
    q, k, v = qkv(rng, 1, 2, 2, 4, 10, 8, dtype=np.float64)
    whole, whole_lse = apex.sdpa(q, k, v, return_lse=True, query_offset=0)
    a, la = apex.sdpa(q, k[:, :, :6], v[:, :, :6], return_lse=True, query_offset=0)
    b, lb = apex.sdpa(q, k[:, :, 6:], v[:, :, 6:], return_lse=True, query_offset=0)
    out, lse = apex.merge_attention(a, la, b, lb)
    assert_normwise(out, whole, ATTENTION["float64"])
    assert_normwise(lse, whole_lse, ATTENTION["float64"], floor=1.0)


def test_the_reference_oracle_is_the_float64_loop_and_the_kernel_within_tolerance(rng):
    for dtype in (np.float32, np.float16):
        q, k, v = qkv(rng, 1, 4, 2, 6, 9, 8, dtype=dtype)
        options = dict(causal=True, window=4, softcap=3.0, sinks=[0.1, 0.2, -1.0, 0.0],
                       alibi_slopes=apex.alibi_slopes(4), mask=rng.random((6, 9)) < 0.8)
        oracle, lse = apex.reference_sdpa(q, k, v, return_lse=True, **options)
        assert oracle.dtype == np.float64 and lse.dtype == np.float64
        mask = options.pop("mask")
        ref, ref_lse = reference.sdpa(q, k, v, mask=mask[None, None], **options)
        assert_normwise(oracle, ref, 1e-12)
        assert_normwise(lse, ref_lse, 1e-12, floor=1.0)
        kernel = apex.sdpa(q, k, v, mask=mask, **options)
        assert_normwise(kernel, oracle, ATTENTION[np.dtype(dtype).name])
    with pytest.raises(ValueError, match=r"\[reference_sdpa\] out dtype \(float32\) must be float64"):
        apex.reference_sdpa(q, k, v, out=np.empty((1, 4, 6, 8), np.float32))


def test_alibi_slopes_are_the_geometric_sequence():
    assert apex.alibi_slopes(8) == [2.0 ** (-(h + 1)) for h in range(8)]
    assert len(apex.alibi_slopes(12)) == 12


torch = pytest.importorskip("torch")


def torch_attention(q, k, v, *, is_causal=False, attn_mask=None):
    """PyTorch's attention: its scaled_dot_product_attention (2.0 and later), else the same
    formula in torch operations."""
    q, k, v = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = None if attn_mask is None else torch.from_numpy(attn_mask)
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal).numpy()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    return (torch.softmax(scores, dim=-1) @ v).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_pytorch(rng, dtype):
    q, k, v = qkv(rng, 2, 8, 2, 33, 33, 32, dtype=dtype)
    tol = ATTENTION[np.dtype(dtype).name]
    assert_normwise(apex.sdpa(q, k, v), torch_attention(q, k, v), tol)
    assert_normwise(apex.sdpa(q, k, v, causal=True), torch_attention(q, k, v, is_causal=True), tol)
    # PyTorch's causal mask is top-left: apex's query_offset=0.
    qs = q[:, :, :9]
    assert_normwise(apex.sdpa(qs, k, v, causal=True, query_offset=0),
                    torch_attention(qs, k, v, is_causal=True), tol)
    mask = rng.random((33, 33)) < 0.5
    np.fill_diagonal(mask, True)
    assert_normwise(apex.sdpa(q, k, v, mask=mask), torch_attention(q, k, v, attn_mask=mask), tol)
    bias = rng.standard_normal((33, 33)).astype(dtype)
    assert_normwise(apex.sdpa(q, k, v, bias=bias), torch_attention(q, k, v, attn_mask=bias), tol)
