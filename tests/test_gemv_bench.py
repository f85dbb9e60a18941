"""The GEMV benchmark (benchmarks/probes/gemv.py, issue #12) on CPU: its command line, its skip
document without CUDA, how it reads Inductor's generated code and summarizes a run, that its cuBLAS
settings are restored, and the hand-written Triton GEMV's arithmetic under Triton's CPU interpreter.
The timings themselves need the GPU (last test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "probes", "gemv.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))

import gemv  # noqa: E402


def _run(args, env_extra=None, timeout=120):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env_extra or {})}
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def test_without_cuda_the_script_exits_0_with_a_skipped_document_on_stdout_and_in_out(tmp_path):
    out = tmp_path / "sub" / "gemv.json"
    proc = _run([SCRIPT, "--quick", "--shapes", "o_proj,qkv", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc == json.loads(out.read_text())
    assert doc["skipped"] == "no CUDA device"
    assert doc["shapes"] == ["o_proj", "qkv"] and doc["quick"] is True
    assert doc["candidates"] == list(gemv.CANDIDATES)


@pytest.mark.parametrize("argv, needle", [
    (["--shapes", "o_proj,bogus"], "bogus"),
    (["--candidates", "cublas,nope"], "nope"),
    (["--shapes", ","], "empty list"),
    (["--trials", "0"], ">= 1"),
])
def test_unknown_names_and_empty_counts_are_refused_naming_the_choices(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        gemv.parse_args(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_quick_shrinks_rings_trials_grid_and_compile_budget_and_explicit_values_win():
    full, quick = gemv.parse_args([]), gemv.parse_args(["--quick"])
    assert (full.copies, full.lm_head_copies, full.trials) == (42, 3, 7)
    assert (quick.copies, quick.lm_head_copies, quick.trials) == (16, 2, 3)
    assert quick.compile_budget_s < full.compile_budget_s
    assert gemv.parse_args(["--quick", "--copies", "5"]).copies == 5
    assert full.shapes == list(gemv.SHAPES) and gemv.HANDWRITTEN == full.candidates[-1]
    assert len(gemv.TRITON_GRID_QUICK) < len(gemv.TRITON_GRID)


def test_shapes_are_sensenova_decode_linears_and_rings_exceed_l2():
    assert gemv.SHAPES["qkv"][:2] == (6144, 4096) and gemv.SHAPES["down"][:2] == (4096, 12288)
    for n, k, copies in gemv.SHAPES.values():
        assert n * k * 2 * copies > 4 * 50e6  # H200's L2 is 50 MB


def test_generated_code_is_classified_as_template_reduction_or_aten_mm():
    template = "def triton_tem_fused_mm_0(arg_A, arg_B, out_ptr0):\n    BLOCK_M : tl.constexpr = 16"
    reduction = "def triton_red_fused_mul_sum_0(in_ptr0, in_ptr1, out_ptr0, xnumel, r0_numel):"
    aten = "buf0 = empty_strided_cuda((1, 64), (64, 1))\nextern_kernels.mm(arg0_1, arg1_1, out=buf0)"
    assert gemv.summarize_code([template])["kind"] == "triton mm template"
    assert gemv.summarize_code([template])["constexprs"] == ["BLOCK_M=16"]
    assert gemv.summarize_code([reduction])["kind"].startswith("mm decomposed")
    assert gemv.summarize_code([aten])["kind"].startswith("ATen mm")
    assert gemv.summarize_code([])["kind"].startswith("no code captured")


def test_summary_picks_the_fastest_library_candidate_and_compares_with_gate_up_cublas():
    def row(us, eff):
        return {"us": us, "eff_copy": eff, "eff_read": eff * 0.9}

    shapes = {
        "gate_up": {"candidates": {"cublas": row(50.0, 0.98)}},
        "o_proj": {"candidates": {"cublas": row(12.0, 0.61), "cublaslt": row(9.0, 0.8),
                                  "inductor_max_autotune": {"error": "X"},
                                  gemv.HANDWRITTEN: row(7.5, 0.97)}},
    }
    summary = gemv.summarize(shapes)
    assert summary["o_proj"]["best_library"] == "cublaslt"
    assert summary["o_proj"]["handwritten_us"] == 7.5
    assert summary["o_proj"]["best_library_reaches_gate_up_cublas"] is False
    assert summary["gate_up"]["best_library_reaches_gate_up_cublas"] is True


def test_blas_settings_are_restored_even_when_the_body_raises():
    matmul = torch.backends.cuda.matmul
    before = (torch.backends.cuda.preferred_blas_library(),
              matmul.allow_bf16_reduced_precision_reduction,
              matmul.allow_bf16_reduced_precision_reduction_split_k)
    with pytest.raises(RuntimeError), gemv.blas_settings("cublaslt", True):
        assert matmul.allow_bf16_reduced_precision_reduction_split_k is False
        raise RuntimeError("capture failed")
    assert (torch.backends.cuda.preferred_blas_library(),
            matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction_split_k) == before


INTERPRETED = """
import torch, gemv
for n, k, bn, bk in [(48, 384, 32, 256), (64, 512, 8, 256), (40, 1024, 16, 512)]:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    y = gemv.gemv_triton(x, w, bn, bk, 4)
    ref = x.float() @ w.float().t()
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    # bf16 products are exact in fp32, so the only error is the output's rounding to bf16: within
    # one bf16 ulp, since the interpreter truncates fp32 -> bf16 (measured: every output equals
    # the truncated reference) where the GPU rounds to nearest.
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3)
print("ok")
"""


def test_handwritten_gemv_equals_fp32_reference_rounded_to_bf16_under_triton_interpreter():
    pytest.importorskip("triton")
    proc = _run(["-c", INTERPRETED], {"TRITON_INTERPRET": "1",
                                       "PYTHONPATH": os.path.join(ROOT, "benchmarks", "probes")})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_quick_run_times_cublas_and_the_handwritten_kernel(tmp_path):
    out = tmp_path / "gemv.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    argv = [SCRIPT, "--quick", "--shapes", "o_proj", "--candidates", f"cublas,{gemv.HANDWRITTEN}",
            "--out", str(out)]
    proc = subprocess.run([sys.executable, *argv], check=False, capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    cands = doc["shapes"]["o_proj"]["candidates"]
    assert cands["cublas"]["bit_identical"] is True and cands["cublas"]["us"] > 0
    assert cands[gemv.HANDWRITTEN]["max_abs_diff"] < 0.05, cands[gemv.HANDWRITTEN]
