"""The FA3 FP8 attention probe (benchmarks/probes/fp8_attention.py, issue #23) on CPU: its
per-head quantisation and its document without CUDA. The timings need the H200."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "probes", "fp8_attention.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))

import fp8_attention  # noqa: E402


def test_per_head_quantisation_keeps_each_head_within_e4m3_rounding_of_its_scale():
    torch.manual_seed(0)
    x = torch.randn(50, 4, 16, dtype=torch.bfloat16) * torch.tensor([0.01, 1.0, 30.0, 0.0])[
        None, :, None].to(torch.bfloat16)
    x8, descale = fp8_attention.quantise_per_head(x)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (1, 4)
    assert descale[0, 3] == 1 and not x8[:, 3].float().any()  # a head of zeros: scale 1
    back = x8.float() * descale[0][None, :, None]
    bound = torch.maximum(x.float().abs() * 2.0 ** -4, descale[0][None, :, None] * 2.0 ** -10)
    assert torch.all((back - x.float()).abs() <= bound * 1.0001)
    top = x8.float().abs().amax(dim=(0, 2))
    assert torch.all(top[:3] == fp8_attention.FP8_MAX)  # each head uses e4m3's range


def test_without_cuda_the_probe_exits_0_with_a_skipped_document(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] == "no CUDA device"
