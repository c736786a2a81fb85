#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The attention variants of §7 - §10 side by side at equal width, drawn: the README's comparison
(benchmarks/bench_variants.cpp, docs/performance.md) made from Python.

    OMP_NUM_THREADS=2 PYTHONPATH=build/release/python /usr/bin/python3 \\
        python/examples/variants.py [--seq 512 1024 2048 4096] [--output variants.png]

Every layer has d = 1024, H_q = 16, d_h = 64, random weights (seed 0), float32:
  MHA               H_kv = 16                                    (§7)
  GQA               H_kv = 4                                     (§8)
  MQA               H_kv = 1                                     (§8)
  MLA               d_kv = 256, d_q = 384, d_r = 64, one K_rope head, decoding absorbed (§9)
  GQA + window      the GQA layer with a window W = S/8          (§10)
Three panels against the context S:
  1. one causal layer forward over S tokens (projections, RoPE, attention, W_O), best of 3;
  2. the KV cache of one layer holding S tokens, in bytes (a window layer holds W tokens);
  3. one decoding step of a GQA layer (H_q = 8, H_kv = 2, d_h = 128: whole blocks of every
     format) after S cached tokens, in each storage format of the cache (float32, float16,
     bfloat16, q8_0, q4_0, fp8 e4m3), with its bytes per token in the legend.
Prints the figures as a table too.
"""
import argparse
import time

import numpy as np

import apex

D_MODEL, H_Q, D_H = 1024, 16, 64
FORMATS = ["float32", "float16", "bfloat16", "q8_0", "q4_0", "fp8_e4m3"]


def best_seconds(call, repeats=3):
    call()  # warm up: scratch, threads
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def variants(max_positions):
    gqa = lambda kv: apex.GroupedQueryAttention.random(  # noqa: E731
        D_MODEL, H_Q, kv, D_H, seed=0, max_positions=max_positions)
    mla = apex.MultiHeadLatentAttention.random(
        D_MODEL, 384, 256, H_Q, H_Q, D_H, 64, num_rope_key_heads=1, seed=0,
        max_positions=max_positions)
    return {"MHA (H_kv 16)": (gqa(16), False), "GQA (H_kv 4)": (gqa(4), False),
            "MQA (H_kv 1)": (gqa(1), False), "MLA (d_kv 256, d_r 64)": (mla, False),
            "GQA + window S/8": (gqa(4), True)}


def forward_and_cache(layers, seqs, rng):
    """Panel 1 and 2: forward seconds and cache bytes per variant and S."""
    seconds = {name: [] for name in layers}
    cache_bytes = {name: [] for name in layers}
    for s in seqs:
        x = rng.standard_normal((s, D_MODEL), dtype=np.float32)
        for name, (layer, windowed) in layers.items():
            window = max(1, s // 8) if windowed else None
            seconds[name].append(best_seconds(lambda: layer.forward(x, causal=True, window=window)))
            cache_bytes[name].append(layer.make_cache(1, window or s).bytes)
    return seconds, cache_bytes


def cache_heads(layer):
    return layer.config["num_kv_heads"]


def cache_dim(layer):
    return layer.config["head_dim"]


def decoding_by_format(layer, seqs, rng):
    """Panel 3: one decoding step after S cached tokens, per storage format."""
    seconds = {f: [] for f in FORMATS}
    cache_bytes = {f: [] for f in FORMATS}
    for s in seqs:
        # The step's cost does not depend on what the cache holds: fill it with random K and V
        # rather than run the prompt through the layer.
        shape = (1, cache_heads(layer), s, cache_dim(layer))
        k = rng.standard_normal(shape, dtype=np.float32)
        v = rng.standard_normal(shape, dtype=np.float32)
        token = rng.standard_normal((1, D_MODEL), dtype=np.float32)
        for f in FORMATS:
            cache = layer.make_cache(1, s + 1, format=f)
            cache.append(k, v)

            def step():
                layer.forward_cached(token, cache, causal=True)
                cache.truncate(s)  # the same step again

            seconds[f].append(best_seconds(step))
            cache_bytes[f].append(cache.bytes)
    return seconds, cache_bytes


def print_table(title, seqs, seconds, cache_bytes, unit="ms"):
    print(f"\n{title}")
    print(f"{'':28}" + "".join(f"{'S = ' + str(s):>22}" for s in seqs))
    for name in seconds:
        cells = "".join(f"{t * 1e3:10.2f} {unit} {b / 2**20:7.2f} MiB"
                        for t, b in zip(seconds[name], cache_bytes[name]))
        print(f"{name:28}{cells}")


def draw(path, contexts, forward, cache, decode, decode_bytes):
    seqs, decode_seqs = contexts
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for name in forward:
        axes[0].loglog(seqs, [t * 1e3 for t in forward[name]], "o-", label=name)
        axes[1].loglog(seqs, [b / 2**20 for b in cache[name]], "o-", label=name)
    for f in decode:
        per_token = decode_bytes[f][-1] / (decode_seqs[-1] + 1)
        axes[2].loglog(decode_seqs, [t * 1e3 for t in decode[f]], "o-",
                       label=f"{f} ({per_token:.0f} B/token)")
    titles = ["one causal layer forward", "KV cache of one layer", "GQA decoding step by cache format"]
    labels = ["ms", "MiB", "ms"]
    for ax, title, label in zip(axes, titles, labels):
        ax.set_title(title)
        ax.set_xlabel("S (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"apex {apex.__version__}: d = {D_MODEL}, H_q = {H_Q}, d_h = {D_H}, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--decode-seq", type=int, nargs="+", default=[1024, 4096, 16384, 65536],
                        help="the contexts of panel 3")
    parser.add_argument("--output", default="variants.png", help="the PNG to write")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    layers = variants(max(args.seq) + 1)
    forward, cache = forward_and_cache(layers, args.seq, rng)
    print_table("one causal layer forward, and its KV cache", args.seq, forward, cache)
    wide = apex.GroupedQueryAttention.random(D_MODEL, 8, 2, 128, seed=0,
                                             max_positions=max(args.decode_seq) + 1)
    decode, decode_bytes = decoding_by_format(wide, args.decode_seq, rng)
    print_table("GQA decoding step by cache format, and the cache", args.decode_seq, decode,
                decode_bytes)
    draw(args.output, (args.seq, args.decode_seq), forward, cache, decode, decode_bytes)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
