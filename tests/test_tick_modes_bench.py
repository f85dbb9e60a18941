"""``benchmarks/overlap.py`` and the ``overlap``/``wave`` cases of ``benchmarks/sensenova_batch.py``
(issue #41: whether a step-execution tick gains from two CUDA streams, or from one GEMM over
several requests' denoising). On CPU: the measurement's arithmetic and threads, and the cases'
rows from the tiny checkpoint; the figures that decide come from the H200."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import overlap  # noqa: E402

CPU = torch.device("cpu")


def test_two_kinds_that_wait_apart_run_together_at_full_rate():
    # A unit that sleeps holds no lock: run together, each keeps its rate (gain ~2). Taken in
    # turns (the measurement's failure mode) the gain would be ~1.
    units = {"a": lambda: time.sleep(0.01), "b": lambda: time.sleep(0.015)}
    result = overlap.together(units, device=CPU, seconds=0.3)
    assert set(result["alone"]) == set(result["together"]) == {"a", "b"}
    for name in units:
        alone, both = result["alone"][name], result["together"][name]
        assert alone["units"] >= 2 and both["units"] >= 2
        assert alone["per_s"] == pytest.approx(alone["units"] / alone["seconds"], rel=1e-2)
    assert result["throughput_gain"] > 1.7
    assert all(s < 1.2 for s in result["slowdown"].values())


def test_two_kinds_that_share_one_lock_gain_nothing():
    lock = threading.Lock()

    def busy():
        with lock:
            time.sleep(0.01)

    result = overlap.together({"a": busy, "b": busy}, device=CPU, seconds=0.3)
    assert result["throughput_gain"] < 1.25
    assert result["streams"].startswith("no CUDA")


def test_a_failing_unit_fails_the_measurement_without_hanging():
    def bad():
        if threading.current_thread().name.endswith("together"):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        overlap.together({"a": lambda: time.sleep(0.005), "b": bad}, device=CPU, seconds=0.05)
    with pytest.raises(ValueError, match="two kinds"):
        overlap.together({"a": bad}, device=CPU)


def test_gemm_wave_compares_k_requests_one_after_another_with_one_gemm():
    weights = [torch.randn(64, 32), torch.randn(32, 64), torch.randn(48, 32)]
    rows = overlap.gemm_wave(weights, 16, ks=(1, 3), repeats=3)
    assert [r["k"] for r in rows] == [1, 3]
    one = rows[0]["one_after_another_ms"]
    assert rows[0]["wave_ms"] == one and rows[0]["wave_gain"] == 1.0
    assert rows[1]["one_after_another_ms"] == pytest.approx(3 * one)
    assert rows[1]["wave_gain"] == pytest.approx(3 * one / rows[1]["wave_ms"])
    flops = 2 * sum(w.numel() for w in weights)
    assert rows[1]["tflops_wave"] == pytest.approx(flops * 48 / rows[1]["wave_ms"] / 1e9)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("tick_modes")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "sensenova_batch.py"), "--out",
           str(out), "--tiny", "--device", "cpu", "--cases", "wave,overlap", "--n", "2",
           "--size", "64", "--wave-ks", "1,2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, "sensenova-batch.json")) as f:
        return json.load(f)


def test_the_cases_measure_inside_a_real_denoising_step(result):
    rows = {r["case"]: r for r in result["cases"]}
    assert set(rows) == {"sensenova_tick_wave_k1", "sensenova_tick_wave_k2",
                         "sensenova_tick_overlap_b2"}
    k1, k2 = rows["sensenova_tick_wave_k1"], rows["sensenova_tick_wave_k2"]
    # the tiny checkpoint's 64x64 image: its image tokens, as the branch saw them
    assert k1["tokens"] == k2["tokens"] > 0
    assert k2["eager_ms"] == pytest.approx(2 * k1["eager_ms"], rel=1e-4)
    assert k2["speedup"] == pytest.approx(k2["eager_ms"] / k2["ours_ms"], rel=1e-4)
    assert "CUDA" in rows["sensenova_tick_overlap_b2"]["skipped"]


def test_an_unknown_case_is_refused_by_name():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sensenova_batch.py"),
                           "--out", "/tmp/unused", "--cases", "wave,waves"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2
    assert "waves not accepted; accepted: step, text, think, overlap, wave" in proc.stderr
