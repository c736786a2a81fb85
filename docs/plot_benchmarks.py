#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Draws the attention-variant trade-off from apex_bench's JSON output.

    ./build/bench/benchmarks/apex_bench --benchmark_filter='BM_Variant_' \
        --benchmark_out=variants.json --benchmark_out_format=json
    python3 docs/plot_benchmarks.py variants.json docs/attention_variants.png

Left: time of one layer forward against the sequence length S. Right: the KV cache a decoder
keeps for that layer at S tokens (bytes per token times S; a sliding-window layer keeps at most
W tokens). Needs matplotlib (Debian: python3-matplotlib); a tool for the docs, not a dependency
of the library.
"""
import json
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "Mha": "MHA",
    "Gqa4": "GQA (H_kv = H_q/4)",
    "Gqa16": "GQA (H_kv = H_q/16)",
    "Mla": "MLA",
    "SlidingWindow": "GQA/4 + window S/8",
}


def load(path):
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    series = defaultdict(list)
    for run in runs:
        if run.get("run_type") == "aggregate":
            continue
        m = re.match(r"BM_Variant_(\w+?)/S:(\d+)", run["name"])
        if not m:
            continue
        variant, seq = m.group(1), int(m.group(2))
        ms = run["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[run["time_unit"]]
        cached_tokens = seq if variant != "SlidingWindow" else seq // 8
        cache = run["kv_cache_bytes_per_token"] * cached_tokens
        series[variant].append((seq, ms, cache))
    return {k: sorted(v) for k, v in series.items()}


def main(source, target):
    series = load(source)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in LABELS:
        if variant not in series:
            continue
        seq, ms, cache = zip(*series[variant])
        left.plot(seq, ms, marker="o", label=LABELS[variant])
        right.plot(seq, [c / 2**20 for c in cache], marker="o", label=LABELS[variant])
    for axis, title, unit in ((left, "Layer forward time", "ms"),
                              (right, "KV cache of the layer at S tokens", "MiB")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length S")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("apex attention variants, d = 1024, H_q = 16, d_h = 64, float")
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
