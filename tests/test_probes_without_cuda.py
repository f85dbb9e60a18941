"""The GPU probes (benchmarks/probes/) on CPU: without CUDA each says so in one JSON line and exits
0, having measured nothing. What they record needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("probe", ["capture_failure.py", "fp8_attention.py", "fp8_gemv.py",
                                   "fp8_accum.py"])
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


def test_compiled_repro_probe_on_cpu_hashes_both_modes_alike_in_two_processes(tmp_path):
    """``compiled_repro.py`` on CPU (Inductor's C++ backend, which tunes nothing by timing): the
    two modes compile the fast denoising layer's regions with and without Inductor's
    deterministic mode, and two processes' hashes of each mode agree; no timing without CUDA."""
    script = os.path.join(ROOT, "benchmarks", "probes", "compiled_repro.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    docs = []
    for tag in ("A", "B"):
        proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--tag", tag,
                               "--tokens", "16"], capture_output=True, text=True, timeout=600,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        docs.append(json.loads((tmp_path / f"compiled-repro-{tag}.json").read_text()))
    a, b = ([(m["mode"], m["options"]["deterministic"], m["pre_sha256"], m["post_sha256"])
             for m in doc["modes"]] for doc in docs)
    assert [(m[0], m[1]) for m in a] == [("tuned", False), ("deterministic", True)]
    assert a == b
    assert a[0][2] != a[0][3]  # the two regions' outputs hash apart (no constant digest)
    assert docs[0]["environment"]["pid"] != docs[1]["environment"]["pid"]
    assert not any(k.endswith("_us") for m in docs[0]["modes"] for k in m)
