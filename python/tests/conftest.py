# SPDX-License-Identifier: MIT
"""Shared tolerances and helpers of the Python tests.

Every expected value is computed in float64 from the very same (already rounded) inputs, so a
tolerance bounds apex's arithmetic alone, as the C++ tests' tests/tolerances.hpp does:
  ATTENTION  one attention call against reference.sdpa, normwise:
             max |out - ref| <= tol * max |ref| (lse: tol * max(1, max |lse|)). float32 1e-5
             (about 170 units of the last place for dot products, an exp and sums of a few
             hundred terms), float64 1e-12; float16 and bfloat16 results are computed in float
             and rounded once, so half a unit of their last place is added: 2^-11 and 2^-8.
  ROW        per element, |a - b| <= tol * max(1, |b|), for the short chains of RMSNorm, RoPE
             and the embedding: float32 4e-6 (16 u * 4), float64 1e-14.
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

ATTENTION = {"float32": 1e-5, "float64": 1e-12, "float16": 1e-5 + 2.0**-11, "bfloat16": 1e-5 + 2.0**-8}
ROW = {"float32": 4e-6, "float64": 1e-14, "float16": 4e-6 + 2.0**-11, "bfloat16": 4e-6 + 2.0**-8}


def assert_normwise(actual, expected, tol, floor=0.0):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    assert np.array_equal(np.isfinite(actual), np.isfinite(expected))
    finite = np.isfinite(expected)
    if finite.any():
        scale = max(floor, 1e-300, np.max(np.abs(expected[finite])))
        error = np.max(np.abs(actual[finite] - expected[finite]))
        assert error <= tol * scale, f"max error {error:.3e} > {tol:.1e} * {scale:.3e}"
    assert np.array_equal(actual[~finite], expected[~finite])


def assert_rows_close(actual, expected, tol):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    bound = tol * np.maximum(1.0, np.abs(expected))
    worst = np.max(np.abs(actual - expected) - bound) if actual.size else 0.0
    assert worst <= 0.0, f"an element is {worst:.3e} beyond its bound"


@pytest.fixture
def rng():
    return np.random.default_rng(20261206)
