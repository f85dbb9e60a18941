"""The GPU probes (benchmarks/probes/) on CPU: without CUDA each says so in one JSON line and exits
0, having measured nothing. What they record needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("probe", ["fp8_gemv.py", "fp8_accum.py", "persistent_mlp.py"])
def test_without_cuda_the_probe_exits_0_with_a_skipped_document(probe, tmp_path):
    script = os.path.join(ROOT, "benchmarks", "probes", probe)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] == "no CUDA device"
    assert not os.listdir(tmp_path)  # nothing measured, nothing written
