# SPDX-License-Identifier: MIT
# The caches, the layers and the stack (python/src/models.cpp) against references written here
# from the formulas, in float64 numpy loops.
#
# Tolerances (max |apex − reference| ≤ tol · max |reference|):
#   float32 attention over a cache: 1e-5; float32 layers (four products and a softmax): 2e-5;
#   float32 stack (a few layers, norms, the LM head): 1e-4; float64: 1e-12.
#   Formats: float16 / bfloat16 store each value within half a step (2^-11 / 2^-8 relative);
#   q8_0 within d/2 + 127·d·2^-11 (d = amax/127 of the 32-value block, stored as float16);
#   q4_0 within |d|·(1 + 2^-8) (d = m/−8; the code of −m clamps to 15, a step off);
#   fp8 within half an fp8 step of x/s, s = amax/448 (e4m3) or amax/57344 (e5m2) per 128 values.
import numpy as np
import pytest

import apex

RNG = np.random.default_rng(20260)


def close(actual, reference, tol):
    actual = np.asarray(actual, dtype=np.float64)
    err = np.max(np.abs(actual - reference)) if reference.size else 0.0
    scale = max(np.max(np.abs(reference)) if reference.size else 0.0, 1e-30)
    assert actual.shape == reference.shape, (actual.shape, reference.shape)
    assert err <= tol * scale, f"max error {err:.3e} > {tol:.1e} x {scale:.3e}"


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def allowed(sq, sk, causal=False, window=None, prefix=0, q0=None):
    """[sq, sk] booleans of the position rule; queries at q0 + i (default: the last sq of sk)."""
    q0 = sk - sq if q0 is None else q0
    qp = q0 + np.arange(sq)[:, None]
    kp = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), dtype=bool)
    if causal:
        ok = (qp - kp) >= 0
        if window is not None:
            ok &= (qp - kp) < window
    return ok | ((qp < prefix) & (kp < prefix))


def attention(q, k, v, ok, scale=None):
    """softmax(scale·q·kᵀ, forbidden → −inf)·v for one head, and the lse."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.where(ok, scale * q @ k.T, -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]
    return (p / p.sum(axis=1, keepdims=True)) @ v, lse


def grouped_attention(q, k, v, ok, scale=None):
    """q [B, Hq, Sq, d], k/v [B, Hkv, Sk, d]: head h reads kv head h // (Hq / Hkv)."""
    b_n, hq = q.shape[:2]
    group = hq // k.shape[1]
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    lse = np.zeros(q.shape[:3])
    for b in range(b_n):
        for h in range(hq):
            out[b, h], lse[b, h] = attention(q[b, h], k[b, h // group], v[b, h // group], ok, scale)
    return out, lse


def rope(x, positions, head_dim, base=10000.0, rotary_dim=0, pairing="interleaved"):
    """x [S, H·head_dim] rotated row by row at `positions` (§4): pairs (2i, 2i+1) or (i, i+r/2)."""
    x = np.array(x, dtype=np.float64)
    r = rotary_dim or head_dim
    theta = base ** (-2.0 * np.arange(r // 2) / r)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * theta[None, :]
    c, s = np.cos(angle), np.sin(angle)
    heads = x.reshape(x.shape[0], -1, head_dim)
    if pairing == "interleaved":
        a, b = heads[:, :, 0:r:2].copy(), heads[:, :, 1:r:2].copy()
        heads[:, :, 0:r:2] = a * c[:, None] - b * s[:, None]
        heads[:, :, 1:r:2] = b * c[:, None] + a * s[:, None]
    else:
        a, b = heads[:, :, : r // 2].copy(), heads[:, :, r // 2 : r].copy()
        heads[:, :, : r // 2] = a * c[:, None] - b * s[:, None]
        heads[:, :, r // 2 : r] = b * c[:, None] + a * s[:, None]
    return heads.reshape(x.shape)


def rms_norm(x, gamma, eps):
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def gqa_reference(x, w, cfg, ok, offset=0, rope_args=None, scale=None):
    """The GQA layer on x [B, S, d]: Q = RoPE(norm(x·W_Q)), K likewise, V = x·W_V, attention
    per head with its kv head, Concat·W_O (gqa.hpp)."""
    hq, hkv, dh = cfg["num_q_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    out = []
    for xb in np.asarray(x, dtype=np.float64):
        q, k, v = xb @ w["w_q"], xb @ w["w_k"], xb @ w["w_v"]
        if w["q_norm"] is not None:
            q = rms_norm(q.reshape(-1, hq, dh), w["q_norm"], w["qk_norm_eps"]).reshape(q.shape)
            k = rms_norm(k.reshape(-1, hkv, dh), w["k_norm"], w["qk_norm_eps"]).reshape(k.shape)
        if rope_args is not None:
            pos = offset + np.arange(xb.shape[0])
            q, k = rope(q, pos, dh, **rope_args), rope(k, pos, dh, **rope_args)
        heads = lambda m, h: m.reshape(-1, h, dh).transpose(1, 0, 2)[None]  # noqa: E731
        o, _ = grouped_attention(heads(q, hq), heads(k, hkv), heads(v, hkv), ok, scale)
        out.append(o[0].transpose(1, 0, 2).reshape(xb.shape[0], -1) @ w["w_o"])
    return np.stack(out)


def mla_reference(x, w, cfg, ok, rope_args):
    """The MLA layer on x [B, S, d] (mla.hpp): per head [Q_h ‖ Q_rope,h]·[K_g ‖ K_rope,g']ᵀ."""
    hq, hkv, dh, dr = cfg["num_q_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["rope_dim"]
    hkr = cfg["num_rope_key_heads"]
    out = []
    for xb in np.asarray(x, dtype=np.float64):
        pos = np.arange(xb.shape[0])
        c_kv = xb @ w["w_dkv"]
        k, v = (c_kv @ w["w_uk"]).reshape(-1, hkv, dh), (c_kv @ w["w_uv"]).reshape(-1, hkv, dh)
        q = (xb @ w["w_dq"] @ w["w_uq"]).reshape(-1, hq, dh)
        qr = rope(xb @ w["w_qr"], pos, dr, **rope_args).reshape(-1, hq, dr)
        kr = rope(xb @ w["w_kr"], pos, dr, **rope_args).reshape(-1, hkr, dr)
        group = hq // hkv
        heads = []
        for h in range(hq):
            g = h // group
            qf = np.concatenate([q[:, h], qr[:, h]], axis=1)
            kf = np.concatenate([k[:, g], kr[:, g if hkr > 1 else 0]], axis=1)
            heads.append(attention(qf, kf, v[:, g], ok)[0])
        out.append(np.concatenate(heads, axis=1) @ w["w_o"])
    return np.stack(out)


# ---------------------------------------------------------------------------------------------
# KvCache
# ---------------------------------------------------------------------------------------------

FORMAT_BYTES = {  # bytes of a row of d values
    "float32": lambda d: 4 * d,
    "float64": lambda d: 8 * d,
    "float16": lambda d: 2 * d,
    "bfloat16": lambda d: 2 * d,
    "q8_0": lambda d: 34 * d // 32,
    "q4_0": lambda d: 18 * d // 32,
    "fp8_e4m3": lambda d: 132 * d // 128,
    "fp8_e5m2": lambda d: 132 * d // 128,
}


def stored_bound(x, fmt):
    """The largest |stored − x| each value of x [..., d] may have in `fmt` (see the top)."""
    x = np.asarray(x, dtype=np.float64)
    if fmt in ("float32", "float64"):
        return np.abs(x) * 2.0**-24 if fmt == "float32" else np.zeros_like(x)
    if fmt in ("float16", "bfloat16"):
        return np.abs(x) * (2.0**-11 if fmt == "float16" else 2.0**-8)
    block = 32 if fmt in ("q8_0", "q4_0") else 128
    blocks = x.reshape(x.shape[:-1] + (-1, block))
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    if fmt == "q8_0":
        d = amax / 127
        bound = np.broadcast_to(d * (0.5 + 127 * 2.0**-11), blocks.shape)
    elif fmt == "q4_0":
        bound = np.broadcast_to(amax / 8 * (1 + 2.0**-8), blocks.shape)
    else:
        top, mantissa, subnormal = (448.0, 3, 2.0**-9) if fmt == "fp8_e4m3" else (57344.0, 2, 2.0**-16)
        s = amax / top
        bound = np.abs(blocks) * 2.0 ** -(mantissa + 1) * 1.0001 + s * subnormal / 2
    return bound.reshape(x.shape)


@pytest.mark.parametrize("fmt", list(FORMAT_BYTES))
def test_kv_cache_stores_attends_and_counts(fmt):
    b, h, d, cap = 2, 2, 128, 12
    dtype = np.float64 if fmt == "float64" else np.float32
    cache = apex.KvCache(b, h, d, cap, format=fmt)
    assert (cache.format, cache.dtype, cache.size, cache.capacity) == (fmt, np.dtype(dtype).name, 0, cap)
    assert cache.bytes == 2 * b * h * cap * FORMAT_BYTES[fmt](d)
    k1, v1 = randn(b, h, 5, d, dtype=dtype), randn(b, h, 5, d, dtype=dtype)
    k2, v2 = randn(b, h, 3, d, dtype=dtype), randn(b, h, 3, d, dtype=dtype)
    cache.append(k1, v1)
    cache.append(k2[:, :, ::1], v2, position=5)
    assert cache.size == len(cache) == cache.next_position == 8
    k, v = np.concatenate([k1, k2], 2), np.concatenate([v1, v2], 2)
    keys, values = cache.keys(), cache.values()
    assert keys.dtype == dtype and keys.shape == (b, h, 8, d)
    assert np.all(np.abs(keys - k) <= stored_bound(k, fmt))
    assert np.all(np.abs(values - v) <= stored_bound(v, fmt))
    if fmt in ("float32", "float64"):
        assert np.array_equal(keys, k) and np.array_equal(values, v)
    # Attention reads the stored values: the reference over keys() and values() themselves.
    q = randn(b, 4, 3, d, dtype=dtype)
    out, lse = cache.attend(q, causal=True, return_lse=True)
    ref, ref_lse = grouped_attention(q, keys, values, allowed(3, 8, causal=True))
    tol = 1e-12 if fmt == "float64" else 1e-5
    close(out, ref, tol)
    close(lse, ref_lse, tol)
    assert out.dtype == dtype and cache.size == 8  # attend changes nothing
    assert cache.bytes == 2 * b * h * cap * FORMAT_BYTES[fmt](d)


def test_kv_cache_attend_rule_scale_softcap_and_layouts():
    cache = apex.KvCache(1, 1, 8, 10)
    k, v = randn(1, 1, 7, 8), randn(1, 1, 7, 8)
    cache.append(k[0, 0], v[0, 0])  # [n, d] for B = H = 1
    q = randn(4, 2, 8).transpose(1, 0, 2)  # [H_q = 2, S_q = 4, d], strided: read in place
    out = cache.attend(q, causal=True, window=3, scale=0.3)
    ref, _ = grouped_attention(q[None], k, v, allowed(4, 7, causal=True, window=3), scale=0.3)
    close(out, ref[0], 1e-5)
    capped = cache.attend(q, softcap=0.5)
    s = 0.5 * np.tanh(q.astype(np.float64) @ k[0, 0].T.astype(np.float64) / np.sqrt(8) / 0.5)
    p = np.exp(s - s.max(-1, keepdims=True))
    close(capped, (p / p.sum(-1, keepdims=True)) @ v[0, 0], 1e-5)


def test_kv_cache_rejections_change_nothing():
    cache = apex.KvCache(1, 2, 32, 4, format="q8_0")
    k = randn(1, 2, 3, 32)
    cache.append(k, k)
    before = cache.keys()
    cases = [
        ((randn(1, 1, 1, 32), randn(1, 1, 1, 32)), {}, r"\[kv_cache\] chunk heads"),
        ((randn(1, 2, 2, 32), randn(1, 2, 2, 32)), {}, r"\[kv_cache\] appending 2 tokens at position 3 would exceed the capacity \(4\)"),
        ((randn(1, 2, 1, 32), randn(1, 2, 1, 32)), {"position": 5}, r"\[kv_cache\] .*position"),
        ((randn(1, 2, 1, 32).astype(np.float64), randn(1, 2, 1, 32)), {}, r"\[kv_cache\] k dtype \(float64\) must be float32"),
        ((randn(2, 32), randn(2, 32)), {}, r"\[kv_cache\]"),
    ]
    for (kk, vv), kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            cache.append(kk, vv, **kwargs)
        assert cache.size == 3
        assert np.array_equal(cache.keys(), before)
    with pytest.raises(ValueError, match=r"\[kv_cache\] .*head_dim|\[kv_cache\] .*multiple"):
        apex.KvCache(1, 1, 30, 4, format="q8_0")
    with pytest.raises(ValueError, match=r"format \('int8'\) must be one of"):
        apex.KvCache(1, 1, 32, 4, format="int8")
    with pytest.raises(ValueError, match=r"\[kv_cache\] capacity \(0\)|capacity"):
        apex.KvCache(1, 1, 32, 0)
    with pytest.raises(ValueError, match=r"truncate size \(5\) must lie in \[0, 3\]"):
        cache.truncate(5)
    cache.truncate(1)
    assert cache.size == 1 and np.array_equal(cache.keys(), before[:, :, :1])
    cache.reserve(9)
    assert cache.capacity == 9 and cache.bytes == 2 * 2 * 9 * 34
    assert np.array_equal(cache.keys(), before[:, :, :1])
    cache.clear()
    assert cache.size == 0 and cache.keys().shape == (1, 2, 0, 32)


# ---------------------------------------------------------------------------------------------
# GroupedQueryAttention
# ---------------------------------------------------------------------------------------------

GQA = dict(d_model=24, num_q_heads=4, num_kv_heads=2, head_dim=8)


def gqa_weights(dtype=np.float32, qk_norm=False):
    d, hq, hkv, dh = GQA["d_model"], GQA["num_q_heads"], GQA["num_kv_heads"], GQA["head_dim"]
    w = dict(w_q=randn(d, hq * dh, dtype=dtype) / 5, w_k=randn(d, hkv * dh, dtype=dtype) / 5,
             w_v=randn(d, hkv * dh, dtype=dtype) / 5, w_o=randn(hq * dh, d, dtype=dtype) / 5)
    if qk_norm:
        w.update(q_norm=1 + randn(dh, dtype=dtype) / 4, k_norm=1 + randn(dh, dtype=dtype) / 4)
    return w


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("pairing", ["interleaved", "half_split"])
def test_gqa_forward_matches_reference(dtype, tol, pairing):
    w = gqa_weights(dtype, qk_norm=True)
    rope_args = dict(base=500.0, rotary_dim=6, pairing=pairing)
    layer = apex.GroupedQueryAttention(
        **GQA, **w, qk_norm_eps=1e-5, max_positions=32, rope_theta=500.0, rotary_dim=6,
        rope_pairing=pairing, dtype=np.dtype(dtype).name)
    got = layer.weights
    assert np.array_equal(got["w_q"], w["w_q"]) and np.array_equal(got["k_norm"], w["k_norm"])
    assert layer.parameter_count == 24 * 8 * (2 * 4 + 2 * 2)
    assert layer.weight_bytes == layer.parameter_count * np.dtype(dtype).itemsize
    x = randn(2, 6, 24, dtype=dtype)
    out = layer.forward(x, causal=True, window=4, position_offset=3)
    ref = gqa_reference(x, got, GQA, allowed(6, 6, causal=True, window=4), 3, rope_args)
    close(out, ref, tol)
    flat = layer.forward(x.reshape(12, 24), batch=2, causal=True, window=4, position_offset=3)
    assert flat.shape == (12, 24) and np.array_equal(flat, out.reshape(12, 24))


def test_gqa_random_sinks_prefix_and_no_rope():
    layer = apex.GroupedQueryAttention.random(**GQA, seed=7)
    again = apex.GroupedQueryAttention.random(**GQA, seed=7)
    w = layer.weights
    assert np.array_equal(w["w_o"], again.weights["w_o"]) and w["q_norm"] is None
    assert abs(np.std(w["w_q"]) - 1 / np.sqrt(24)) < 0.05  # N(0, 1/rows)
    x = randn(1, 5, 24)
    close(layer.forward(x, prefix=3, causal=True),
          gqa_reference(x, w, GQA, allowed(5, 5, causal=True, prefix=3)), 2e-5)
    sinks = [0.5, -1.0, 2.0, 0.0]
    sunk = apex.GroupedQueryAttention(**GQA, w_q=w["w_q"], w_k=w["w_k"], w_v=w["w_v"],
                                      w_o=w["w_o"], sinks=sinks)
    # A sink joins each head's softmax denominator: softmax over [scores, sink] without its value.
    xb = x[0].astype(np.float64)
    q = (xb @ w["w_q"]).reshape(5, 4, 8)
    k, v = (xb @ w["w_k"]).reshape(5, 2, 8), (xb @ w["w_v"]).reshape(5, 2, 8)
    heads = []
    for h in range(4):
        s = q[:, h] @ k[:, h // 2].T / np.sqrt(8)
        e = np.exp(s - s.max(1, keepdims=True))
        sink = np.exp(sinks[h] - s.max(1, keepdims=True))
        heads.append(e @ v[:, h // 2] / (e.sum(1, keepdims=True) + sink))
    close(sunk.forward(x), (np.concatenate(heads, 1) @ w["w_o"])[None], 2e-5)


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "q8_0"])
def test_gqa_forward_cached_in_chunks(fmt):
    layer = apex.GroupedQueryAttention.random(d_model=32, num_q_heads=4, num_kv_heads=2,
                                              head_dim=32, seed=3, max_positions=16)
    cache = layer.make_cache(2, 10, format=fmt)
    assert isinstance(cache, apex.KvCache) and cache.format == fmt and cache.num_kv_heads == 2
    x = randn(2, 7, 32)
    outs = [layer.forward_cached(x[:, a:b], cache, causal=True) for a, b in [(0, 4), (4, 5), (5, 7)]]
    assert cache.size == 7
    # The reference attends over what the cache stored (keys() holds RoPE'd K as stored).
    w = layer.weights
    keys, values = cache.keys(), cache.values()
    out = np.concatenate(outs, axis=1)
    for bi in range(2):
        xb = x[bi].astype(np.float64)
        q = rope(xb @ w["w_q"], np.arange(7), 32)
        k_exact = rope(xb @ w["w_k"], np.arange(7), 32).reshape(7, 2, 32).transpose(1, 0, 2)
        assert np.all(np.abs(keys[bi] - k_exact) <= stored_bound(k_exact, fmt) + 1e-5 * np.abs(k_exact).max())
        o, _ = grouped_attention(q.reshape(7, 4, 32).transpose(1, 0, 2)[None], keys[bi:bi + 1],
                                 values[bi:bi + 1], allowed(7, 7, causal=True))
        close(out[bi], o[0].transpose(1, 0, 2).reshape(7, -1) @ w["w_o"], 2e-5)
    if fmt == "float32":
        close(out, layer.forward(x, causal=True).astype(np.float64), 2e-5)


def test_gqa_rejections_change_nothing():
    layer = apex.GroupedQueryAttention.random(**GQA, seed=1, max_positions=8)
    cache = layer.make_cache(1, 4)
    layer.forward_cached(randn(1, 3, 24), cache, causal=True)
    keys = cache.keys()
    with pytest.raises(ValueError, match=r"\[kv_cache\] appending 2 tokens at position 3 would exceed"):
        layer.forward_cached(randn(1, 2, 24), cache, causal=True)
    with pytest.raises(ValueError, match=r"\[gqa\] x width \(23\) must equal d_model \(24\)"):
        layer.forward_cached(randn(1, 1, 23), cache)
    with pytest.raises(ValueError, match=r"x's first extent \(2\) must equal the batch \(1\)"):
        layer.forward_cached(randn(2, 1, 24), cache)
    with pytest.raises(ValueError, match=r"\[gqa\] x dtype \(float64\) must be float32"):
        layer.forward_cached(randn(1, 1, 24, dtype=np.float64), cache)
    other = apex.GroupedQueryAttention.random(d_model=24, num_q_heads=4, num_kv_heads=4,
                                              head_dim=8, seed=1)
    with pytest.raises(ValueError, match=r"\[gqa\]"):
        other.forward_cached(randn(1, 1, 24), cache)
    assert cache.size == 3 and np.array_equal(cache.keys(), keys)
    with pytest.raises(ValueError, match=r"computes in float64, the layer in float32"):
        layer.forward_cached(randn(1, 1, 24), apex.KvCache(1, 2, 8, 4, format="float64"))
    with pytest.raises(ValueError, match=r"format 'float64' does not suit a float32 layer"):
        layer.make_cache(1, 4, format="float64")
    with pytest.raises(ValueError, match=r"\[gqa\] num_q_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        apex.GroupedQueryAttention.random(24, 3, 2, 8, seed=0)
    w = gqa_weights()
    w["w_k"] = w["w_k"][:, :8]
    with pytest.raises(ValueError, match=r"\[gqa\] w_k shape \[24, 8\] must be"):
        apex.GroupedQueryAttention(**GQA, **w)
    with pytest.raises(ValueError, match=r"dtype \('float16'\) must be 'float32' or 'float64'"):
        apex.GroupedQueryAttention.random(**GQA, seed=0, dtype="float16")
    with pytest.raises(ValueError, match=r"\[gqa\] .*position"):
        layer.forward(randn(1, 9, 24))  # past the RoPE table's 8 positions


# ---------------------------------------------------------------------------------------------
# LatentCache and MultiHeadLatentAttention
# ---------------------------------------------------------------------------------------------

MLA = dict(d_model=32, d_q=24, d_kv=32, num_q_heads=4, num_kv_heads=2, head_dim=8, rope_dim=32)


@pytest.mark.parametrize("hkr", [0, 1])
def test_mla_forward_and_cached_paths(hkr):
    layer = apex.MultiHeadLatentAttention.random(**MLA, num_rope_key_heads=hkr, seed=5,
                                                 max_positions=16)
    cfg = layer.config
    assert cfg["num_rope_key_heads"] == (2 if hkr == 0 else 1)
    w = layer.weights
    x = randn(2, 6, 32)
    ref = mla_reference(x, w, cfg, allowed(6, 6, causal=True, prefix=2), {})
    close(layer.forward(x, causal=True, prefix=2), ref, 2e-5)
    for absorbed in (False, True):
        cache = layer.make_cache(2, 8)
        assert cache.row_width == 32 + cfg["num_rope_key_heads"] * 32
        out = np.concatenate([layer.forward_cached(x[:, :3], cache, absorbed=absorbed, causal=True, prefix=2),
                              layer.forward_cached(x[:, 3:], cache, absorbed=absorbed, causal=True, prefix=2)], 1)
        close(out, ref, 5e-5)
        assert cache.size == 6
        # The cache holds [c_kv ‖ RoPE(x·W_KR)].
        xb = x[1].astype(np.float64)
        row = np.concatenate([xb @ w["w_dkv"], rope(xb @ w["w_kr"], np.arange(6), 32)], 1)
        close(cache.rows()[1], row, 1e-5)


def test_mla_weights_roundtrip_and_rejections():
    layer = apex.MultiHeadLatentAttention.random(**MLA, seed=2, max_positions=8)
    w = layer.weights
    copy = apex.MultiHeadLatentAttention(**MLA, weights=w, max_positions=8)
    x = randn(1, 4, 32)
    assert np.array_equal(copy.forward(x), layer.forward(x))
    bad = dict(w, w_uq=w["w_uq"][:, :-1])
    with pytest.raises(ValueError, match=r"\[mla\] W_UQ shape \[24, 31\] must be \[24, 32\]"):
        apex.MultiHeadLatentAttention(**MLA, weights=bad, max_positions=8)
    with pytest.raises(ValueError, match=r"\[mla\] rope_dim d_r \(3\) must be even"):
        apex.MultiHeadLatentAttention.random(**dict(MLA, rope_dim=3), seed=0, max_positions=8)
    cache = layer.make_cache(1, 3, format="q8_0")
    layer.forward_cached(x[:, :2], cache, causal=True)
    rows = cache.rows()
    with pytest.raises(ValueError, match=r"\[latent_cache\] appending 2 tokens at position 2 would exceed the capacity \(3\)"):
        layer.forward_cached(x[:, 2:], cache, absorbed=True, causal=True)
    assert cache.size == 2 and np.array_equal(cache.rows(), rows)
    assert cache.bytes == 1 * 3 * (32 + 2 * 32) // 32 * 34


def test_latent_cache_append_and_formats():
    cache = apex.LatentCache(2, 64, 1, 32, 5, format="bfloat16")
    c_kv, k_rope = randn(2, 3, 64), randn(2, 3, 32)
    cache.append(c_kv, k_rope)
    assert cache.size == 3 and cache.bytes == 2 * 5 * 96 * 2
    row = np.concatenate([c_kv, k_rope], -1)
    assert np.all(np.abs(cache.rows() - row) <= stored_bound(row, "bfloat16"))
    with pytest.raises(ValueError, match=r"\[latent_cache\] k_rope width \(31\) must equal H_kr\*d_r \(32\)"):
        cache.append(randn(2, 1, 64), randn(2, 1, 31))
    assert cache.size == 3


# ---------------------------------------------------------------------------------------------
# AttentionStack
# ---------------------------------------------------------------------------------------------

STACK = dict(vocab_size=40, d_model=32, num_layers=3, window=3, global_every=3, max_positions=24,
             rope_theta=1000.0, local_num_q_heads=4, local_num_kv_heads=2, local_head_dim=8,
             global_d_q=16, global_d_kv=16, global_num_q_heads=4, global_num_kv_heads=2,
             global_head_dim=8, global_rope_dim=8, global_num_rope_key_heads=1)


def stack_reference(stack, tokens, prefix):
    """The stack on tokens [B, S] from its own weights (stack.hpp's formula)."""
    cfg = stack.config
    d, s_n = cfg["d_model"], tokens.shape[1]
    e = stack.embedding.astype(np.float64)
    x = e[tokens] * np.sqrt(d)
    for l in range(cfg["num_layers"]):
        layer = stack.layer(l)
        normed = rms_norm(x, stack.norm_gammas[l].astype(np.float64), cfg["norm_eps"])
        if stack.is_global(l):
            ok = allowed(s_n, s_n, causal=True, prefix=prefix)
            x = x + mla_reference(normed, layer.weights, layer.config, ok, dict(base=cfg["rope_theta"]))
        else:
            ok = allowed(s_n, s_n, causal=True, window=cfg["window"], prefix=prefix)
            x = x + gqa_reference(normed, layer.weights, layer.config, ok, 0, dict(base=cfg["rope_theta"]))
    return rms_norm(x, stack.final_gamma.astype(np.float64), cfg["norm_eps"]) @ e.T


def test_stack_forward_prefill_decode_generate():
    stack = apex.AttentionStack.random(seed=11, **STACK)
    assert all(np.array_equal(g, np.ones(32, np.float32)) for g in stack.norm_gammas + [stack.final_gamma])
    assert stack.config["window"] == 3 and [stack.is_global(l) for l in range(3)] == [False, False, True]
    tokens = RNG.integers(0, 40, size=(2, 9))
    ref = stack_reference(stack, tokens, prefix=2)
    full = stack.forward(tokens, prefix=2)
    close(full, ref, 1e-4)
    cache = stack.make_cache(2, 12)
    assert cache.bytes == stack.cache_memory(2, 12)["total_bytes"] == cache.local_bytes + cache.global_bytes
    assert cache.local_bytes == 2 * 2 * 3 * (2 * 2 * 8) * 4  # 2 layers · B · W · 2·H_kv·d_h · 4
    assert cache.global_bytes == 2 * 12 * (16 + 8) * 4
    logits = [stack.prefill(tokens[:, :5], cache, prefix=2)]
    logits.append(stack.extend(tokens[:, 5:7], cache))
    logits += [stack.decode_step(list(tokens[:, t]), cache)[:, None] for t in (7, 8)]
    assert cache.next_position == 9 and cache.prefix == 2
    close(np.concatenate(logits, 1), ref, 1e-4)
    last = stack.make_cache(2, 12)
    close(stack.prefill(tokens[:, :5], last, prefix=2, last_only=True, mla_path="absorbed"), ref[:, 4], 1e-4)
    # Greedy generation: each new token is the argmax of the reference logits before it.
    new = stack.generate(tokens[:1, :4], 4, prefix=2)
    assert new.dtype == np.int64 and new.shape == (1, 4)
    seq = tokens[:1, :4]
    for t in range(4):
        nxt = int(np.argmax(stack_reference(stack, seq, prefix=2)[0, -1]))
        assert new[0, t] == nxt
        seq = np.concatenate([seq, [[nxt]]], 1)
    assert np.array_equal(stack.generate(tokens[0, :4], 4, prefix=2), new[0])


def test_stack_from_arrays_and_quantized_cache():
    base = apex.AttentionStack.random(seed=4, **STACK)
    layers = [base.layer(l) for l in range(3)]
    gammas = [1 + randn(32) / 4 for _ in range(3)]
    final = 1 + randn(32) / 4
    stack = apex.AttentionStack(embedding=base.embedding, norm_gammas=gammas, final_gamma=final,
                                layers=layers, **STACK)
    tokens = RNG.integers(0, 40, size=(1, 6))
    assert len(stack.norm_gammas) == 3 and all(np.array_equal(a, b) for a, b in zip(stack.norm_gammas, gammas))
    assert np.array_equal(stack.final_gamma, final)
    close(stack.forward(tokens), stack_reference(stack, tokens, 0), 1e-4)
    # A bfloat16 cache: its bytes, and logits near the float ones (a loose bound: each cached
    # value is within 2^-8 relative, and the stack is 3 layers deep).
    cache = stack.make_cache(1, 6, format="bfloat16")
    assert cache.format == "bfloat16"
    assert cache.bytes == stack.cache_memory(1, 6, format="bfloat16")["total_bytes"]
    assert cache.local_bytes == 2 * 3 * (2 * 2 * 8) * 2 and cache.global_bytes == 6 * (16 + 8) * 2
    close(stack.prefill(tokens, cache), stack.forward(tokens).astype(np.float64), 3e-2)
    # q8_0 needs head widths of whole 32-value blocks.
    with pytest.raises(ValueError, match=r"\[stack\] local head_dim \(8\) must be a multiple of the 32"):
        stack.make_cache(1, 6, format="q8_0")
    with pytest.raises(ValueError, match=r"\[stack\] layers\[0\] must be a GroupedQueryAttention"):
        apex.AttentionStack(embedding=base.embedding, norm_gammas=gammas, final_gamma=final,
                            layers=[1, 2, 3], **STACK)


def test_stack_rejections_change_nothing():
    stack = apex.AttentionStack.random(seed=2, **STACK)
    cache = stack.make_cache(1, 6)
    stack.prefill([1, 2, 3], cache)
    with pytest.raises(ValueError, match=r"\[stack\]"):
        stack.prefill([1, 2], cache)  # not empty
    with pytest.raises(ValueError, match=r"\[stack\]"):
        stack.extend([[1, 2, 3, 4]], cache)  # past the capacity
    with pytest.raises(ValueError, match=r"\[.*\] .*40"):
        stack.decode_step([40], cache)  # id out of range
    with pytest.raises(ValueError, match=r"\[stack\]"):
        stack.decode_step([1, 2], cache)  # batch 2 against 1
    assert cache.next_position == 3
    with pytest.raises(ValueError, match=r"\[stack\] unknown config field 'windows'"):
        apex.AttentionStack.random(seed=0, **dict(STACK, windows=3))
    with pytest.raises(ValueError, match=r"\[stack\] vocab_size \(0\) must be >= 1"):
        apex.AttentionStack.random(seed=0, **dict(STACK, vocab_size=0))
    with pytest.raises(ValueError, match=r"tokens dtype \(float64\) must be an integer dtype"):
        stack.forward(np.zeros((1, 2)))
