"""The capture-failure probe (benchmarks/probes/capture_failure.py) on CPU: without CUDA it says
so and exits 0. What it records needs a GPU (scripts/gpu/pool_session.sh p1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "probes", "capture_failure.py")


def test_without_cuda_the_probe_exits_0_with_a_skipped_document(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] == "no CUDA device"
    assert not os.listdir(tmp_path)  # nothing measured, nothing written
