"""The GPU probes (benchmarks/probes/) on CPU: without CUDA each says so in one JSON line and exits
0, having measured nothing. What they record needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("probe", ["capture_failure.py", "fp8_attention.py", "fp8_gemv.py"])
def test_without_cuda_the_probe_exits_0_with_a_skipped_document(probe, tmp_path):
    script = os.path.join(ROOT, "benchmarks", "probes", probe)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] == "no CUDA device"
    assert not os.listdir(tmp_path)  # nothing measured, nothing written


def test_batched_attention_probe_on_cpu_checks_the_reference_and_names_bad_arguments(tmp_path):
    """Without CUDA ``batched_attention.py`` runs the fp32 reference alone at small sizes: no
    timing, its error 0, row 0 the same whatever its neighbours' lengths (the same shapes); bad
    arguments are refused naming the value and what is accepted."""
    script = os.path.join(ROOT, "benchmarks", "probes", "batched_attention.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--rows", "1,4",
                           "--contexts", "40", "--heads", "4,2,16"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "batched-attention.json").read_text())
    assert doc["environment"]["candidates"] == ["reference"]
    rows = doc["results"]
    assert [(r["kernel"], r["rows"], r["context"]) for r in rows] == [
        ("reference", 1, 40), ("reference", 4, 40)]
    for r in rows:
        assert r["max_abs_err"] == 0.0 and "us_per_call" not in r, r
        assert r["same_with_other_neighbours"] is True
        assert r["kv_bytes"] == r["rows"] * 40 * 2 * 16 * 2 * 4  # fp32 K and V on the CPU
    for bad, message in ((["--rows", "0,8"], "'0,8': accepted: positive integers"),
                         (["--heads", "4,3,16"], "--heads 4,3,16: accepted: Q,KV,D")):
        proc = subprocess.run([sys.executable, script, "--out", str(tmp_path)] + bad,
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-1000:]
