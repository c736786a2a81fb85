# SPDX-License-Identifier: MIT
"""What the module promises beyond the formulas: arrays read in place where their layout allows,
apex's errors as ValueError with nothing written, results bit-identical for any number of
threads, and the GIL released while apex computes."""
import os
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import apex


def peak_bytes(call):
    """The most memory numpy and Python held at once during call() beyond what they held before
    (numpy reports its array buffers to tracemalloc)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    call()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak - before


def test_strided_views_are_read_in_place_and_give_the_contiguous_result(rng):
    big = rng.standard_normal((2, 8, 512, 128)).astype(np.float32)
    q = big[:, ::2, :, :64]           # every other head, half of each row: strided, not contiguous
    k = big[:, 1::4, ::2, 64:]        # rows two apart
    v = big[:, 3::4, 1::2, 32:96]
    assert not any(a.flags.c_contiguous for a in (q, k, v))
    expected = apex.sdpa(*(np.ascontiguousarray(a) for a in (q, k, v)), causal=True)
    np.testing.assert_array_equal(apex.sdpa(q, k, v, causal=True), expected)
    input_bytes = q.nbytes + k.nbytes + v.nbytes
    out_bytes = expected.nbytes
    # In place: only the output is allocated. A view whose last axis is strided is copied once.
    assert peak_bytes(lambda: apex.sdpa(q, k, v, causal=True)) < out_bytes + input_bytes // 8
    copied = big[:, ::2, :, ::2]
    assert peak_bytes(lambda: apex.sdpa(copied, copied, copied)) >= out_bytes + copied.nbytes


def test_rope_writes_through_a_strided_view(rng):
    base = rng.standard_normal((6, 32)).astype(np.float32)
    before = base.copy()
    view = base[::2, 8:24]            # rows 0, 2, 4; features 8..23: two heads of 8
    table = apex.RopeTable(16, 8)
    apex.apply_rope(table, view, offset=1)
    expected = before[::2, 8:24].copy()
    apex.apply_rope(table, expected, offset=1)
    np.testing.assert_array_equal(base[::2, 8:24], expected)
    np.testing.assert_array_equal(base[1::2], before[1::2])
    np.testing.assert_array_equal(base[:, :8], before[:, :8])


def test_table_cos_is_a_view_of_the_table():
    table = apex.RopeTable(32, 8)
    assert np.shares_memory(table.cos, table.cos)
    cos = table.cos
    del table
    assert cos.shape == (32, 8) and cos[0, 0] == 1.0  # the view keeps the table alive


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q: apex.sdpa(q, q[..., :4], q), r"\[sdpa\] key width d_qk \(4\) must equal the query width 8"),
        (lambda q: apex.sdpa(q, q, q, window=2), r"\[sdpa\].*window"),
        (lambda q: apex.sdpa(q, q, q, softcap=-1.0), r"\[sdpa\] softcap \(-1\) must be >= 0"),
        (lambda q: apex.sdpa(q, q, q, sinks=[1.0]), r"\[sdpa\] sinks length \(1\) must be the number of query heads 3"),
        (lambda q: apex.sdpa(q, q.astype(np.float64), q), r"\[sdpa\] k dtype \(float64\) must be float32"),
        (lambda q: apex.sdpa(q, q, q, mask=np.ones((5, 4), bool)), r"\[sdpa\] allowed mask shape \[5, 4\] must be \[S_q, S_k\] = \[5, 5\]"),
        (lambda q: apex.sdpa(q.astype(np.int32), q, q), r"\[sdpa\] q dtype \(int32\) must be float32, float64, float16"),
        (lambda q: apex.sdpa(q, q, q, dtype="bfloat16"), r"\[sdpa\] q dtype \(float32\) must be uint16"),
        (lambda q: apex.sdpa(q[0, 0, 0], q, q), r"\[sdpa\] q rank \(1\) must be 2"),
        (lambda q: apex.sdpa_varlen(q[0], q[0], q[0], [0, 2], [0, 2]), r"\[sdpa_varlen\]"),
        (lambda q: apex.rms_norm(q, np.ones(3)), r"\[rms_norm\] gamma"),
        (lambda q: apex.rms_norm(q, np.ones(8), eps=0.0), r"\[rms_norm\] eps"),
        (lambda q: apex.embed(q[0, 0], [[5]]), r"\[embed\]"),
        (lambda q: apex.RopeTable(8, 7), r"\[rope\]"),
        (lambda q: apex.RopeTable(8, 8, pairing="sideways"), r"\[rope\] pairing \('sideways'\)"),
    ],
)
def test_bad_input_raises_value_error_with_apexs_message(rng, call, message):
    q = rng.standard_normal((1, 3, 5, 8)).astype(np.float32)
    before = q.copy()
    with pytest.raises(ValueError, match=message):
        call(q)
    np.testing.assert_array_equal(q, before)


def test_a_rejected_rope_leaves_x_unchanged(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    before = x.copy()
    table = apex.RopeTable(8, 8)
    with pytest.raises(ValueError, match=r"\[rope\]"):
        apex.apply_rope(table, x, offset=5)  # positions 5..8, the table ends at 7
    with pytest.raises(ValueError, match=r"\[rope\]"):
        apex.apply_rope(table, x, positions=np.array([0, 1, 2, 8]))
    np.testing.assert_array_equal(x, before)
    with pytest.raises(ValueError, match="writeable"):
        x.flags.writeable = False
        apex.apply_rope(table, x)


THREADS_SCRIPT = """
import hashlib, numpy as np, apex
rng = np.random.default_rng(7)
q = rng.standard_normal((2, 8, 300, 64)).astype(np.float32)
k = rng.standard_normal((2, 2, 700, 64)).astype(np.float32)
v = rng.standard_normal((2, 2, 700, 64)).astype(np.float32)
parts = [apex.sdpa(q, k, v, causal=True, return_lse=True)[i] for i in range(2)]
parts.append(apex.sdpa(q[:, :, :1], k, v))  # one query: split-key decoding
parts.append(apex.rms_norm(q, np.ones(64)))
print(hashlib.sha256(b"".join(p.tobytes() for p in parts)).hexdigest())
"""


def test_results_are_bit_identical_for_one_and_two_threads():
    digests = []
    for threads in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=threads)
        run = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], env=env, check=True,
                             capture_output=True, text=True)
        digests.append(run.stdout.strip())
    assert len(digests[0]) == 64 and digests[0] == digests[1]


def test_the_gil_is_released_while_apex_computes(rng):
    q = rng.standard_normal((1, 8, 2048, 64)).astype(np.float32)
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1

    worker = threading.Thread(target=count)
    worker.start()
    try:
        time.sleep(0.05)
        counts = []
        for _ in range(3):
            before = counter[0]
            started = time.perf_counter()
            apex.sdpa(q, q, q)
            elapsed = time.perf_counter() - started
            counts.append((counter[0] - before, elapsed))
    finally:
        stop.set()
        worker.join()
    # With the GIL held for the whole call the counter could only move in the few microseconds
    # around it; released, it counts through the call (millions of increments a second).
    assert all(elapsed > 0.01 for _, elapsed in counts)
    assert max(n for n, _ in counts) > 10000


def test_the_type_stubs_name_every_public_name_of_the_module():
    import ast
    import pathlib
    stub = pathlib.Path(apex.__file__).with_name("__init__.pyi")
    tree = ast.parse(stub.read_text())
    stubbed = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    public = {name for name in dir(apex._core) if not name.startswith("_")}
    assert public == stubbed


def test_sdpa_writes_into_out_in_place(rng):
    q = rng.standard_normal((2, 4, 6, 8)).astype(np.float32)
    expected = apex.sdpa(q, q, q, causal=True)
    wide = np.full((2, 4, 6, 12), 7.0, dtype=np.float32)
    out = wide[..., 2:10]                       # a strided view: rows 12 apart
    assert apex.sdpa(q, q, q, causal=True, out=out) is out
    np.testing.assert_array_equal(wide[..., 2:10], expected)
    assert np.all(wide[..., :2] == 7.0) and np.all(wide[..., 10:] == 7.0)
    same = np.empty_like(expected)
    result, lse = apex.sdpa(q, q, q, causal=True, out=same, return_lse=True)
    assert result is same and lse.shape == (2, 4, 6)
    for bad, message in [(np.empty((2, 4, 6, 7), np.float32), "out must have q's shape"),
                         (np.empty((2, 4, 6, 8), np.float64), r"out dtype \(float64\) must be float32"),
                         (np.empty((2, 4, 6, 16), np.float32)[..., ::2], "contiguous last axis")]:
        before = bad.copy()
        with pytest.raises(ValueError, match=message):
            apex.sdpa(q, q, q, out=bad)
        np.testing.assert_array_equal(bad, before)
