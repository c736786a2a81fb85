# SPDX-License-Identifier: MIT
"""Plain float64 references of the formulas, written for clarity rather than speed: the
independent computations apex's Python module is checked against."""
import math

import numpy as np


def allowed_pair(qp, kp, *, causal=False, window=None, chunk=None, prefix=0, documents=None):
    """The position rule of apex::PositionMask on absolute positions (mask.hpp)."""
    if 0 <= qp < prefix and 0 <= kp < prefix:
        return True
    if documents is not None and documents[qp] != documents[kp]:
        return False
    if not causal:
        return True
    distance = qp - kp
    if distance < 0 or (window is not None and distance >= window):
        return False
    return chunk is None or math.floor(qp / chunk) == math.floor(kp / chunk)


def sdpa(q, k, v, *, causal=False, window=None, chunk=None, prefix=0, documents=None,
         query_offset=None, key_offset=0, mask=None, bias=None, scale=None, softcap=0.0,
         sinks=None, alibi_slopes=None):
    """Attention of [B, H_q, S_q, D] queries over [B, H_kv, S_k, D] keys, one score at a time,
    in float64. mask and bias are [B', H', S_q, S_k] with B' in {1, B}, H' in {1, H_q}. Returns
    (out, lse)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    batch, heads, s_q, d = q.shape
    group = heads // k.shape[1]
    s_k = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    first = key_offset + s_k - s_q if query_offset is None else query_offset
    out = np.zeros((batch, heads, s_q, v.shape[3]))
    lse = np.full((batch, heads, s_q), -np.inf)
    for b in range(batch):
        for h in range(heads):
            for i in range(s_q):
                logits, values = [], []
                for j in range(s_k):
                    qp, kp = first + i, key_offset + j
                    ok = allowed_pair(qp, kp, causal=causal, window=window, chunk=chunk,
                                      prefix=prefix, documents=documents)
                    if mask is not None:
                        ok = ok and bool(mask[min(b, mask.shape[0] - 1), min(h, mask.shape[1] - 1), i, j])
                    if not ok:
                        continue
                    s = scale * float(q[b, h, i] @ k[b, h // group, j])
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if alibi_slopes is not None:
                        s += alibi_slopes[h] * (kp - qp)
                    if bias is not None:
                        s += float(bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1), i, j])
                    if s == -math.inf:
                        continue
                    logits.append(s)
                    values.append(v[b, h // group, j])
                if sinks is not None:
                    logits.append(sinks[h])
                    values.append(np.zeros(v.shape[3]))
                if not logits:
                    continue
                m = max(logits)
                weights = np.exp(np.array(logits) - m)
                out[b, h, i] = weights @ np.array(values) / weights.sum()
                lse[b, h, i] = m + math.log(weights.sum())
    return out, lse


def rms_norm(x, gamma, eps=1e-6, one_plus_gamma=False):
    x = np.asarray(x, dtype=np.float64)
    g = np.asarray(gamma, dtype=np.float64)
    g = 1.0 + g if one_plus_gamma else g
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rope(x, positions, base=10000.0, rotary_dim=None, pairing="interleaved", head_dim=None):
    """RoPE of rows x [S, W] (heads of head_dim side by side) at the given positions, in float64,
    pair by pair (§4.4)."""
    x = np.array(x, dtype=np.float64)
    head_dim = x.shape[1] if head_dim is None else head_dim
    rotary_dim = head_dim if not rotary_dim else rotary_dim
    half = rotary_dim // 2
    for t, m in enumerate(positions):
        for h0 in range(0, x.shape[1], head_dim):
            for i in range(half):
                theta = base ** (-2.0 * i / rotary_dim)
                a, b = (h0 + 2 * i, h0 + 2 * i + 1) if pairing == "interleaved" else (h0 + i, h0 + i + half)
                c, s = math.cos(m * theta), math.sin(m * theta)
                x[t, a], x[t, b] = x[t, a] * c - x[t, b] * s, x[t, a] * s + x[t, b] * c
    return x
