#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What a call through Python costs beside apex's own time: apex.sdpa timed from Python against
the same apex::sdpa call timed from C++ inside the module (apex._core._sdpa_cpp_seconds), in one run,
on the same arrays.

    PYTHONPATH=build/release/python /usr/bin/python3 python/examples/overhead.py

Prints, for a 1 x 1 x 1 x 64 problem and for causal prefill at S = 4096 (H_q = 32, H_kv = 8,
d_h = 128, float32), the C++ time, the Python time and their difference and ratio.
"""
import argparse
import time

import numpy as np

import apex


def python_seconds(q, k, v, causal, repeats):
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            apex.sdpa(q, k, v, causal=causal)
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
    print(f"{'problem':<36} {'C++':>12} {'Python':>12} {'difference':>12} {'ratio':>7}")
    for name, q_shape, kv_shape, causal, repeats in rows:
        q = rng.standard_normal(q_shape, dtype=np.float32)
        k = rng.standard_normal(kv_shape, dtype=np.float32)
        v = rng.standard_normal(kv_shape, dtype=np.float32)
        python_seconds(q, k, v, causal, 1)  # warm up: scratch, threads
        cpp, py = [], []
        for _ in range(3):  # interleaved, so that both see the same machine
            cpp.append(apex._core._sdpa_cpp_seconds(q, k, v, causal=causal, repeats=repeats))
            py.append(python_seconds(q, k, v, causal, repeats))
        c, p = min(cpp), min(py)
        print(f"{name:<36} {c * 1e6:10.2f}us {p * 1e6:10.2f}us {(p - c) * 1e6:10.2f}us {p / c:7.3f}")


if __name__ == "__main__":
    main()
