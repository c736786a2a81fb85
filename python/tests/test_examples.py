# SPDX-License-Identifier: MIT
"""The scripts of python/examples run (at small sizes) and write what they promise."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run(script, *args):
    env = dict(os.environ, MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env, check=True,
                          capture_output=True, text=True, timeout=300)
    return done.stdout


def test_overhead_prints_both_times():
    out = run("overhead.py", "--seq", "64")
    assert "1 x 1 x 1 x 64" in out and "causal S = 64" in out


def test_compare_torch_prints_and_draws(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    png = tmp_path / "compare.png"
    out = run("compare_torch.py", "--seq", "64", "128", "--plot", str(png))
    lines = [line.split() for line in out.splitlines() if line.split()[:1] in (["64"], ["128"])]
    assert len(lines) == 2 and all(float(line[-1]) < 1e-4 for line in lines)  # the results agree
    assert png.stat().st_size > 1000


def test_variants_draws_the_three_panels(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "variants.png"
    out = run("variants.py", "--seq", "64", "128", "--decode-seq", "128", "256", "--output", str(png))
    for name in ("MHA (H_kv 16)", "MLA (d_kv 256, d_r 64)", "GQA + window S/8", "q4_0", "fp8_e4m3"):
        assert name in out
    assert png.stat().st_size > 1000


def test_the_readmes_python_command_runs():
    import apex
    readme = (EXAMPLES.parent.parent / "README.md").read_text()
    start = readme.index("PYTHONPATH=build/release/python /usr/bin/python3 -c")
    command = readme[start:readme.index("\n```", start)]
    package_dir = pathlib.Path(apex.__file__).resolve().parent.parent
    command = command.replace("PYTHONPATH=build/release/python", f"PYTHONPATH={package_dir}")
    command = command.replace("/usr/bin/python3", sys.executable)
    done = subprocess.run(["bash", "-c", command], check=True, capture_output=True, text=True)
    assert done.stdout.strip() == "(1, 8, 128, 64)"
