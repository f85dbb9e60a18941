"""The decode-step probe (benchmarks/probes/decode_step_probe.py, issue #12) on CPU: its variant
names are checked before anything is built, a variant needs the GPU's tuned GEMV and says so, and
the base variant is the fused step with the MLP tail left as three kernels. The timings need the
GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_omni_graphdecode import kernels
from vllm_omni_graphdecode.testing import random_models as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "probes", "decode_step_probe.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))

import decode_step_probe as probe  # noqa: E402


def test_unknown_variants_are_refused_naming_the_known_ones():
    proc = subprocess.run([sys.executable, SCRIPT, "--out", "/tmp/unused", "--variants",
                           "base,mlp_tail_sX,tail"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT)
    assert proc.returncode == 2
    assert "mlp_tail_sX" in proc.stderr and "'tail'" in proc.stderr
    assert "known: base, mlp_tail, mlp_tail_sN" in proc.stderr


def test_a_variant_without_the_gpus_tuned_gemv_says_why():
    lm = st.build_lm()
    with pytest.raises(RuntimeError, match="no Inductor GEMV here"):
        probe.variant_parts("base", lm, kernels.REFERENCE)


def test_fixed_splits_go_to_the_plan_and_the_call_alike():
    base = kernels.Kernel(name="FA3", fa_version=3, fn=lambda *a, **k: None)
    fixed = probe.split_kernel(base, 8)
    assert dict(fixed.extra)["num_splits"] == 8 and fixed.schedule is not None
    assert fixed.name == "FA3, 8 splits" and base.extra == ()
