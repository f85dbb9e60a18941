"""`python -m vllm_omni_graphdecode doctor` runs on a CPU machine and says why no GPU path runs."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _doctor(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "vllm_omni_graphdecode", "doctor", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def report():
    proc = _doctor("--json", env_extra={"VLLM_OMNI_GRAPHDECODE": "all"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_doctor_reports_versions_of_the_stack(report):
    for dist in ("vllm", "vllm-omni", "torch", "diffusers"):
        assert report["versions"][dist] != "not installed", dist


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only report")
def test_doctor_on_cpu_says_why_no_gpu_path(report):
    assert report["gpu"] is None and "CUDA" in report["why"]
    assert "not CUDA" in report["paged_attention_kernel"] or "no CUDA" in report[
        "paged_attention_kernel"]
    no = "unavailable: FP8 weights unavailable (device is cpu)"
    assert report["fp8_weights"] == f"decode steps: {no}; denoising steps: {no}"
    assert report["decode_step_ops"] == ("fused decode-step ops on cpu: not available: not CUDA "
                                         "(device is cpu)")
    assert report["sensenova_decode_step"] == "auto: fused (no CUDA device)"


def test_doctor_decode_step_line_says_what_auto_runs_on_each_gpu(monkeypatch):
    import torch
    from vllm_omni_graphdecode import cli

    major = {"value": 9}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (major["value"], 0))
    assert cli.decode_step_report("auto", "cuda:0") == "auto: rowgemv (a Hopper GPU)"
    major["value"] = 8
    assert cli.decode_step_report("auto", "cuda:0") == "auto: fused (not a Hopper GPU)"
    assert cli.decode_step_report("exact", "cuda:0") == "exact"


def test_doctor_prints_parsed_config_and_hook_matrix(report):
    assert report["config"]["VLLM_OMNI_GRAPHDECODE"] == "qwen_image_21,sensenova_u1"
    assert set(report["hooks"]) == {"sensenova_u1", "qwen_image_21"}
    assert "0.30" in " ".join(report["hooks"]["sensenova_u1"])
    assert set(report["this_install"]) == {"sensenova_u1", "qwen_image_21"}


def test_doctor_text_names_the_decode_step_auto_runs():
    proc = _doctor(env_extra={"VLLM_OMNI_GRAPHDECODE": "sensenova_u1"})
    assert proc.returncode == 0, proc.stderr
    gpu = __import__("torch").cuda.is_available()
    assert ("SenseNova-U1 decode step (VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP): auto: "
            + ("" if gpu else "fused (no CUDA device)")) in proc.stdout


def test_doctor_flags_invalid_config_with_exit_2():
    proc = _doctor(env_extra={"VLLM_OMNI_GRAPHDECODE_FA_VERSION": "9"})
    assert proc.returncode == 2
    assert "VLLM_OMNI_GRAPHDECODE_FA_VERSION='9'" in proc.stdout


def test_doctor_fp8_line_names_the_kernels_where_fp8_runs(monkeypatch):
    """The branches a GPU takes, on CPU: the line names the one-row GEMV, or Marlin with the
    GEMV's reason (an H200 printed ``unknown: AttributeError`` here before this was tested)."""
    from vllm_omni_graphdecode import cli
    from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv, marlin, w8a8

    monkeypatch.setattr(marlin, "available", lambda device: None)
    monkeypatch.setattr(w8a8, "w8a8_available", lambda device: None)
    monkeypatch.setattr(fp8_gemv, "available", lambda device: None)
    line = cli.fp8_report("cuda:0")
    assert line.startswith("decode steps: e4m3 weights, bf16 activations: one request through "
                           "the plugin's one-row FP8 GEMV (its lm_head too where named: "
                           "sensenova_lm_head), batched steps through vLLM Marlin")
    assert line.endswith("denoising steps: W8A8 (torch._scaled_mm, e4m3 weights and per-row "
                         "activation scales)")
    monkeypatch.setattr(fp8_gemv, "available",
                        lambda device: fp8_gemv.NO_GEMV.because("compute capability 8.0"))
    line = cli.fp8_report("cuda:0")
    assert "through vLLM Marlin W8A16 (one request too: one-row FP8 GEMV unavailable" in line
    assert "compute capability 8.0" in line
