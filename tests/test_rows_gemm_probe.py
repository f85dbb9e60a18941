"""The batched step's GEMM probe (``benchmarks/probes/rows_gemm.py``, issue #42) on a machine
without a GPU. The kernel it times is the plugin's, ``tests/test_rows_gemm.py``'s; its speed
against cuBLAS is what the probe measures on a GPU."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "benchmarks", "probes", "rows_gemm.py")


def test_probe_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, PROBE, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] == "no CUDA device"
    assert os.listdir(tmp_path) == []
