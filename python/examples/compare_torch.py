#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""apex.sdpa against PyTorch's attention on the same arrays: causal prefill, H_q = 32, H_kv = 8,
d_h = 128, float32, for several S, with both libraries on the same number of threads.

    OMP_NUM_THREADS=2 PYTHONPATH=build/release/python /usr/bin/python3 \\
        python/examples/compare_torch.py [--seq 512 1024 2048] [--plot compare.png]

PyTorch runs torch.nn.functional.scaled_dot_product_attention where it has it (2.0 and later),
else the private _scaled_dot_product_attention of 1.13 (Debian 12's python3-torch), on tensors
that share the numpy arrays' memory (torch.from_numpy). PyTorch before 2.5 has no grouped-query
form, so its K and V are repeated to H_q heads beforehand, outside the timing. Prints the
median of five calls of each, their ratio, and how far the two results lie apart.
"""
import argparse
import os
import time

import numpy as np
import torch

import apex


def torch_sdpa(q, k, v):
    functional = torch.nn.functional
    if hasattr(functional, "scaled_dot_product_attention"):
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return functional._scaled_dot_product_attention(q, k, v, None, 0.0, False, True)[0]


def median_seconds(call, repeats=5):
    call()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(seq, rng):
    q = rng.standard_normal((1, 32, seq, 128), dtype=np.float32)
    k = rng.standard_normal((1, 8, seq, 128), dtype=np.float32)
    v = rng.standard_normal((1, 8, seq, 128), dtype=np.float32)
    tq = torch.from_numpy(q)
    tk = torch.from_numpy(k).repeat_interleave(4, dim=1)
    tv = torch.from_numpy(v).repeat_interleave(4, dim=1)
    ours = apex.sdpa(q, k, v, causal=True)
    with torch.no_grad():
        theirs = torch_sdpa(tq, tk, tv).numpy()
        t_torch = median_seconds(lambda: torch_sdpa(tq, tk, tv))
    t_apex = median_seconds(lambda: apex.sdpa(q, k, v, causal=True))
    return t_apex, t_torch, float(np.max(np.abs(ours - theirs)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--plot", help="also draw the times into this PNG")
    args = parser.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, apex {apex.__version__}, {threads} thread(s)")
    print(f"{'S':>6} {'apex ms':>10} {'torch ms':>10} {'torch/apex':>11} {'max |diff|':>11}")
    rng = np.random.default_rng(0)
    rows = []
    for seq in args.seq:
        t_apex, t_torch, diff = measure(seq, rng)
        rows.append((seq, t_apex, t_torch))
        print(f"{seq:>6} {t_apex * 1e3:10.2f} {t_torch * 1e3:10.2f} {t_torch / t_apex:11.2f} {diff:11.2e}")
    if args.plot:
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        seqs = [r[0] for r in rows]
        ax.loglog(seqs, [r[1] * 1e3 for r in rows], "o-", label="apex.sdpa")
        ax.loglog(seqs, [r[2] * 1e3 for r in rows], "s-", label=f"PyTorch {torch.__version__}")
        ax.set_xlabel("S (causal prefill, H_q 32, H_kv 8, d_h 128, float32)")
        ax.set_ylabel("ms per call")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
