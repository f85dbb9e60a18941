"""The FA3 FP8 attention probe (benchmarks/probes/fp8_attention.py, issue #23) on CPU: its
per-head quantisation (its exit without CUDA: test_probes_without_cuda.py). The timings need the
H200."""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

