"""benchmarks/probes/sensenova_denoise_probe.py on the tiny checkpoint, on CPU: the restated layer
parts (q/k norm + 3-D rope; residual, norm, MLP and the next input norm) equal vllm-omni's own
modules bit for bit, so what the probe times on a GPU is the same math; and every part reports."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks", "probes"))

import sensenova_denoise_probe as probe  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert probe.main(["--tiny", "--device", "cpu", "--size", "64", "--iters", "2",
                           "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(saved)
    with open(out / "sensenova-denoise-probe.json") as f:
        return json.load(f)["layer"]


def test_the_restated_parts_equal_the_modules_bit_for_bit(result):
    assert result["qk_rope"]["own_kernel"] == "PyTorch fallback"  # what runs without a GPU
    assert result["qk_rope"]["restated_max_abs_diff"] == 0.0
    assert result["post"]["restated_max_abs_diff"] == 0.0


def test_every_part_is_timed_and_the_compiled_parts_stay_within_bf16_rounding(result):
    assert result["prefix_tokens"] > 0 and result["image_tokens"] == (64 // 16) ** 2
    for part in ("qk_rope", "attention", "post"):
        assert result[part]["own_ms"] > 0, result[part]
    for part in ("qk_rope", "post"):
        assert result[part]["compiled_ms"] > 0
        assert result[part]["compiled_max_abs_diff"] <= 0.0625, result[part]
    assert result["attention"]["fa3"] == {"skipped": "not CUDA"}
    assert isinstance(result["projected_saving_ms_per_branch_step"], float)
