"""The batched step's GEMM candidate (``benchmarks/probes/rows_gemm.py``, issue #42) on CPU: its
arithmetic under Triton's interpreter (block and split edges, each row as if alone) and the
probe on a machine without a GPU. Its speed against cuBLAS is what the probe measures on a GPU."""

import json
import os
import subprocess
import sys

from test_fp8 import _run_interpreted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "benchmarks", "probes", "rows_gemm.py")

INTERPRETED = """
import sys, torch
sys.path.insert(0, "benchmarks/probes")
import rows_gemm as rg

g = torch.Generator().manual_seed(3)
# N and K off the block sizes, K split unevenly, and one split with no K left.
for n, k, cfg in [(96, 80, rg.Config(32, 32, 1)), (70, 100, rg.Config(32, 32, 2)),
                  (64, 256, rg.Config(64, 64, 4)), (40, 48, rg.Config(32, 32, 4))]:
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(16, k, generator=g).bfloat16()
    got = rg.rows_gemm(x, w, cfg)
    assert got.shape == (16, n) and got.dtype == torch.bfloat16
    want = x.float() @ w.float().T
    err = (got.float() - want).abs().max().item()
    # fp32 sums in another order, one bf16 rounding
    assert err <= 2 * 2.0 ** -7 * want.abs().max().item() + 1e-3, (n, k, cfg, err)
    for m in (1, 5, 15):  # each row as if alone: the first m rows of the 16-row call
        assert torch.equal(rg.rows_gemm(x[:m], w, cfg), got[:m]), (n, k, cfg, m)
try:
    rg.rows_gemm(torch.zeros(17, 32).bfloat16(), torch.zeros(32, 32).bfloat16(),
                 rg.Config(32, 32, 1))
except ValueError as exc:
    assert "17 rows" in str(exc)
else:
    raise AssertionError("17 rows were accepted")
print("ok")
"""


def test_candidate_gemm_under_the_interpreter_rounds_once_and_keeps_rows_apart():
    _run_interpreted(INTERPRETED)


def test_probe_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, PROBE, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] == "no CUDA device"
    assert os.listdir(tmp_path) == []
