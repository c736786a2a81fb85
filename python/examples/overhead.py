#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What a call through Python costs beside apex's own time: apex.sdpa timed from Python against
the same apex::sdpa call timed from C++ inside the module (apex._core._sdpa_cpp_seconds), in one run,
on the same arrays.

    PYTHONPATH=build/release/python /usr/bin/python3 python/examples/overhead.py

Prints, for a 1 x 1 x 1 x 64 problem and for causal prefill at S = 4096 (H_q = 32, H_kv = 8,
d_h = 128, float32), the C++ time, the Python time and their difference and ratio: once as a
call that returns a new array, once writing into an array given as out= (as the C++ call,
timed with one output buffer, does).
"""
import argparse
import time

import numpy as np

import apex


def python_seconds(q, k, v, causal, repeats, out=None):
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            apex.sdpa(q, k, v, causal=causal, out=out)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096, help="S of the prefill row")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = [("1 x 1 x 1 x 64", (1, 1, 1, 64), (1, 1, 1, 64), False, 20000),
            (f"causal S = {args.seq}, 32/8 heads, d 128", (1, 32, args.seq, 128),
             (1, 8, args.seq, 128), True, 2)]
    print(f"{'problem':<36} {'C++':>12} {'Python':>12} {'difference':>12} {'ratio':>7}"
          f" {'Python, out=':>13} {'ratio':>7}")
    for name, q_shape, kv_shape, causal, repeats in rows:
        q = rng.standard_normal(q_shape, dtype=np.float32)
        k = rng.standard_normal(kv_shape, dtype=np.float32)
        v = rng.standard_normal(kv_shape, dtype=np.float32)
        python_seconds(q, k, v, causal, 1)  # warm up: scratch, threads
        out = np.empty(q_shape, dtype=np.float32)
        cpp, py, into = [], [], []
        for _ in range(3):  # interleaved, so that all three see the same machine
            cpp.append(apex._core._sdpa_cpp_seconds(q, k, v, causal=causal, repeats=repeats))
            py.append(python_seconds(q, k, v, causal, repeats))
            into.append(python_seconds(q, k, v, causal, repeats, out))
        c, p, o = min(cpp), min(py), min(into)
        print(f"{name:<36} {c * 1e6:10.2f}us {p * 1e6:10.2f}us {(p - c) * 1e6:10.2f}us {p / c:7.3f}"
              f" {o * 1e6:11.2f}us {o / c:7.3f}")


if __name__ == "__main__":
    main()
