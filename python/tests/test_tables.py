# SPDX-License-Identifier: MIT
"""apex's per-token formulas (RMSNorm, LayerNorm, RoPE and YaRN tables, the embedding and the
tied head, bfloat16 conversion) against float64 numpy and PyTorch."""
import math

import numpy as np
import pytest

import apex
import reference
from conftest import ROW, assert_rows_close


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_rms_norm_matches_the_formula(rng, dtype):
    x = (rng.standard_normal((3, 5, 16)) * 3).astype(dtype)
    gamma = rng.standard_normal(16).astype(np.float32)
    name = np.dtype(dtype).name
    out = apex.rms_norm(x, gamma, eps=1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_rows_close(out, reference.rms_norm(x, gamma, 1e-5), ROW[name])
    gemma = apex.rms_norm(x, gamma, one_plus_gamma=True)
    assert_rows_close(gemma, reference.rms_norm(x, gamma, 1e-6, one_plus_gamma=True), ROW[name])


def test_rms_norm_of_bfloat16_bits(rng):
    x = apex.to_bfloat16(rng.standard_normal((4, 8)))
    out = apex.rms_norm(x, np.ones(8), dtype="bfloat16")
    assert out.dtype == np.uint16
    assert_rows_close(apex.from_bfloat16(out), reference.rms_norm(apex.from_bfloat16(x), np.ones(8)),
                      ROW["bfloat16"])


def test_rope_table_entries_are_the_formula():
    table = apex.RopeTable(64, 8, base=100.0, pairing="half_split", dtype="float64")
    theta = 100.0 ** (-np.arange(4) * 2 / 8)
    angles = np.arange(64)[:, None] * theta[None, :]
    assert table.cos.shape == (64, 8) and not table.cos.flags.writeable
    assert_rows_close(table.cos, np.cos(np.concatenate([angles, angles], axis=1)), 1e-15)
    assert_rows_close(table.sin, np.sin(np.concatenate([angles, angles], axis=1)), 1e-15)
    assert (table.max_positions, table.head_dim, table.rotary_dim, table.pairing) == (64, 8, 8, "half_split")


@pytest.mark.parametrize("pairing", ["interleaved", "half_split"])
def test_apply_rope_rotates_every_head_in_place(rng, pairing):
    table = apex.RopeTable(128, 8, rotary_dim=6, pairing=pairing)
    x = rng.standard_normal((2, 5, 24)).astype(np.float32)  # 2 slices, 5 tokens, 3 heads of 8
    expected = [reference.rope(s, range(7, 12), rotary_dim=6, pairing=pairing, head_dim=8) for s in x]
    result = apex.apply_rope(table, x, offset=7)
    assert result is x
    assert_rows_close(x, np.stack(expected), ROW["float32"])
    y = rng.standard_normal((4, 8)).astype(np.float16)
    positions = np.array([3, 0, 99, 5])
    expected = reference.rope(y, positions, rotary_dim=6, pairing=pairing)
    assert_rows_close(apex.apply_rope(table, y, positions=positions), expected, ROW["float16"])


def hf_yarn_inverse_frequencies(dim, base, factor, original, beta_fast=32, beta_slow=1):
    """HuggingFace's _compute_yarn_parameters (modeling_rope_utils.py), in float64."""
    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    return (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation


def test_yarn_table_is_huggingfaces(rng):
    inv = hf_yarn_inverse_frequencies(64, 10000.0, 4.0, 256)
    factor = 0.1 * math.log(4.0) + 1.0
    table = apex.RopeTable.yarn(1024, 64, scale=4.0, original_context=256, pairing="half_split",
                                dtype="float64")
    angles = np.arange(1024)[:, None] * inv[None, :]
    assert_rows_close(table.cos, factor * np.cos(np.concatenate([angles, angles], 1)), 1e-12)
    assert apex.yarn_attention_factor(4.0) == pytest.approx(factor, rel=1e-15)
    config = {"rope_theta": 10000.0, "head_dim": 64, "max_position_embeddings": 1024,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 256}}
    from_config = apex.RopeTable.from_config(config, 1024, dtype="float64")
    np.testing.assert_array_equal(from_config.cos, table.cos)
    with pytest.raises(ValueError, match="rope_scaling key 'facter'"):
        apex.RopeTable.from_config({"head_dim": 64, "rope_scaling": {"facter": 2.0}}, 16)


def test_embedding_and_tied_head(rng):
    table = rng.standard_normal((10, 6)).astype(np.float32)
    ids = np.array([[1, 9, 0], [3, 3, 2]])
    out = apex.embed(table, ids)
    assert out.shape == (2, 3, 6)
    assert_rows_close(out, table.astype(np.float64)[ids] * math.sqrt(6), ROW["float32"])
    np.testing.assert_array_equal(apex.embed(table, ids, scale=1.0), table[ids])
    h = rng.standard_normal((4, 6)).astype(np.float64)
    assert_rows_close(apex.lm_head(h, table.astype(np.float64)), h @ table.astype(np.float64).T, 1e-14)
    logits = apex.lm_head(h.astype(np.float32), apex.to_bfloat16(table), dtype="bfloat16")
    wide = apex.from_bfloat16(apex.to_bfloat16(table)).astype(np.float64)
    assert_rows_close(logits, h.astype(np.float32).astype(np.float64) @ wide.T, 6 * 2.0**-24 * 8)


torch = pytest.importorskip("torch")


def test_norms_and_rope_match_pytorch(rng):
    x = rng.standard_normal((6, 32))
    gamma, beta = rng.standard_normal(32), rng.standard_normal(32)
    t = torch.from_numpy(x)
    rms = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.from_numpy(gamma)
    assert_rows_close(apex.rms_norm(x, gamma), rms.numpy(), ROW["float64"])
    ln = torch.nn.functional.layer_norm(t, (32,), torch.from_numpy(gamma), torch.from_numpy(beta))
    assert_rows_close(apex.layer_norm(x, gamma, beta), ln.numpy(), 1e-13)
    # HuggingFace's rotate_half RoPE, in torch.
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    freqs = torch.outer(torch.arange(6, dtype=torch.float64) + 4, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    rotated = torch.cat([-t[:, 16:], t[:, :16]], dim=-1)
    hf = (t * emb.cos() + rotated * emb.sin()).numpy()
    table = apex.RopeTable(64, 32, pairing="half_split", dtype="float64")
    assert_rows_close(apex.apply_rope(table, x.copy(), offset=4), hf, ROW["float64"])


def test_bfloat16_rounding_is_pytorchs(rng):
    x = np.concatenate([rng.standard_normal(1000) * 1e3, [0.0, -0.0, np.inf, -np.inf, 1e-40]])
    bits = apex.to_bfloat16(x.astype(np.float32))
    theirs = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(bits, theirs.view(np.uint16))
    np.testing.assert_array_equal(apex.from_bfloat16(bits),
                                  torch.from_numpy(theirs).view(torch.bfloat16).float().numpy())
