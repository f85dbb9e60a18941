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


def _counted_units(meet: threading.Barrier):
    """Two units that record how many units run at once in each phase; in the together phase
    each first waits for the other at ``meet`` (serial together-threads would break it)."""
    lock = threading.Lock()
    state = {"running": 0, "most": {"alone": 0, "together": 0}, "met": set()}

    def unit(name):
        def run():
            phase = ("together" if threading.current_thread().name.endswith("together")
                     else "alone")
            if phase == "together" and name not in state["met"]:
                meet.wait(timeout=30)
                state["met"].add(name)
            with lock:
                state["running"] += 1
                state["most"][phase] = max(state["most"][phase], state["running"])
            time.sleep(0.002)
            with lock:
                state["running"] -= 1
        return run

    return {"a": unit("a"), "b": unit("b")}, state


def test_each_kind_runs_alone_then_both_at_once_on_threads_of_their_own():
    units, state = _counted_units(threading.Barrier(2))
    result = overlap.together(units, device=CPU, seconds=0.05)
    # Alone: one unit at a time. Together: both met inside their units, so both ran at once.
    assert state["most"]["alone"] == 1
    assert state["met"] == {"a", "b"}
    assert set(result["alone"]) == set(result["together"]) == {"a", "b"}
    assert result["streams"].startswith("no CUDA")


def test_the_gain_and_slowdowns_are_the_rates_the_result_reports():
    units, _ = _counted_units(threading.Barrier(2))
    result = overlap.together(units, device=CPU, seconds=0.05, min_units=3)
    alone, both = result["alone"], result["together"]
    for name in units:
        for r in (alone[name], both[name]):
            assert r["units"] >= 3
            assert r["per_s"] == pytest.approx(r["units"] / r["seconds"], rel=3e-3)  # 4-digit s
            assert r["ms_per_unit"] == pytest.approx(1e3 / r["per_s"], rel=1e-3)
        assert result["slowdown"][name] == pytest.approx(alone[name]["per_s"] / both[name]["per_s"])
    assert result["throughput_gain"] == pytest.approx(
        sum(both[n]["per_s"] / alone[n]["per_s"] for n in units))
    assert result["unshared_tail_s"] == pytest.approx(
        abs(both["a"]["seconds"] - both["b"]["seconds"]), abs=1e-4)


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
