"""SenseNova-U1's fast denoising body (``hooks/sensenova_u1/fast_denoise.py``) on the tiny
checkpoint, on CPU: Inductor's C++ backend with ``emulate_precision_casts`` and SDPA, through the
real pipeline's ``forward``. There the restated, compiled step computes the pipeline's own bits
(the GPU's Triton kernels and FlashAttention will round differently: its GPU test states that
bound). Fallbacks: a layer the body does not restate, a compile that fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import denoise, fast_denoise, wiring
from vllm_omni_graphdecode.testing import sensenova as rm

from test_sensenova_denoise import DTYPE, checkpoint  # noqa: F401 - the tiny checkpoint fixture

MODEL = denoise.MODEL
CASES = {
    "t2i_cfg4": (rm.image_request(num_steps=2), 0),
    "edit_two_refs_three_branches": (rm.image_request(img_cfg_scale=2.0, num_steps=2), 2),
}


def _cfg():
    return config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                         "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "fast"})


def _pipeline(checkpoint, wire=True, change=None):  # noqa: F811
    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=DTYPE)
    if change is not None:
        change(pipe)
    summary = hook.install(pipe, _cfg(), None, image_graphs=False) if wire else None
    return pipe, summary


@pytest.fixture(scope="module")
def eager(checkpoint):  # noqa: F811
    pipe, _ = _pipeline(checkpoint, wire=False)
    return {name: rm.generate_image(pipe, request, refs)[:2]
            for name, (request, refs) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_fast_steps_equal_the_pipelines_own_on_cpu(checkpoint, eager, case):  # noqa: F811
    request, refs = CASES[case]
    pipe, summary = _pipeline(checkpoint)
    # the load's summary names the attention the body runs (SDPA on a CPU)
    assert "fast mode: restated layers, Inductor-fused, SDPA" in summary
    image, steps = rm.generate_image(pipe, request, refs)[:2]
    want_image, want_steps = eager[case]
    state = getattr(pipe, wiring.IMAGE_ATTR)
    assert isinstance(state.fast, fast_denoise.FastGen) and state.fast.compile
    assert fast_denoise.compiled_graphs() > 0
    assert len(steps) == len(want_steps)
    for i, (got, want) in enumerate(zip(steps, want_steps)):
        assert torch.equal(got, want), f"branch step {i}: max diff {(got - want).abs().max()}"
    assert np.array_equal(image, want_image)
    assert stats.get(MODEL, "static_step") == len(steps) and stats.degraded_paths(MODEL) == {}


def test_the_restated_layers_equal_the_modules_without_compile(checkpoint, eager):  # noqa: F811
    """``compile=False``: the plain restated math (what the compiled regions are traced from)."""
    pipe, _ = _pipeline(checkpoint)
    state = getattr(pipe, wiring.IMAGE_ATTR)
    state.fast = state._build_fast(DTYPE)
    state.fast.compile, state.fast._pre, state.fast._post = (
        False, fast_denoise.pre_attention, fast_denoise.post_attention)
    request, refs = CASES["t2i_cfg4"]
    steps = rm.generate_image(pipe, request, refs)[1]
    assert all(torch.equal(a, b) for a, b in zip(steps, eager["t2i_cfg4"][1]))


def test_a_layer_the_body_does_not_restate_runs_the_exact_step_with_the_reason(checkpoint):  # noqa: F811
    def gelu(pipe):
        pipe.language_model.model.layers[1].mlp_mot_gen.act_fn = torch.nn.GELU()

    want = rm.generate_image(_pipeline(checkpoint, wire=False, change=gelu)[0],
                             CASES["t2i_cfg4"][0])[1]
    pipe, summary = _pipeline(checkpoint, change=gelu)
    assert "the pipeline's own code; fast mode not applicable: " in summary
    steps = rm.generate_image(pipe, CASES["t2i_cfg4"][0])[1]
    assert all(torch.equal(a, b) for a, b in zip(steps, want))
    state = getattr(pipe, wiring.IMAGE_ATTR)
    assert fast_denoise.STRUCTURE.same(state.fast)
    assert "layer 1: MLP activation GELU" in state.fast.describe()
    degraded = stats.degraded_paths(MODEL)
    assert list(degraded) == [f"{MODEL}: {denoise.FAST_NOT_HERE.key}"]
    assert stats.get(MODEL, "static_step") == len(steps)


def test_a_compile_that_fails_runs_the_exact_step_from_then_on(checkpoint, eager, monkeypatch):  # noqa: F811
    pipe, _ = _pipeline(checkpoint)
    state = getattr(pipe, wiring.IMAGE_ATTR)
    calls = []

    def failing(*args):
        calls.append(1)
        raise fast_denoise.CompileFailed(fast_denoise.COMPILE_FAILED.because("injected"))

    state.fast = state._build_fast(DTYPE)
    state.fast._pre = failing  # the compiled region, as Regions.select hands it out
    request, refs = CASES["t2i_cfg4"]
    image, steps = rm.generate_image(pipe, request, refs)[:2]
    assert calls == [1]  # once: the exact step from then on
    assert np.array_equal(image, eager["t2i_cfg4"][0])
    assert all(torch.equal(a, b) for a, b in zip(steps, eager["t2i_cfg4"][1]))
    assert fast_denoise.COMPILE_FAILED.same(state.fast)
    # counted at the failed warm-up (cond) and again when the uncond branch bound
    assert stats.degraded_paths(MODEL) == {f"{MODEL}: {denoise.FAST_NOT_HERE.key}": 2}


def test_the_norm_kind_is_read_from_the_release(checkpoint):  # noqa: F811
    pipe, _ = _pipeline(checkpoint, wire=False)
    norm = pipe.language_model.model.norm_mot_gen
    assert fast_denoise.cast_chain_norm(norm) is False  # vllm-omni 0.30: F.rms_norm

    class CastChain(torch.nn.Module):  # vllm-omni 0.24-0.28's Qwen3RMSNorm.forward
        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    assert fast_denoise.cast_chain_norm(CastChain()) is True
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    module = CastChain()
    module.weight, module.variance_epsilon = norm.weight.detach()[:64].clone(), 1e-6
    assert torch.equal(fast_denoise.rms_norm(x, module.weight, 1e-6, True), module(x))
    h = torch.randn(3, norm.weight.shape[0], dtype=torch.bfloat16)
    assert torch.equal(fast_denoise.rms_norm(h, norm.weight, norm.variance_epsilon, False), norm(h))


def _fp8_pipeline(checkpoint, mode="fast"):  # noqa: F811
    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=DTYPE)
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": mode,
                        "VLLM_OMNI_GRAPHDECODE_FP8": "sensenova_denoise"})
    return pipe, hook.install(pipe, cfg, None, image_graphs=False)


def _relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_fp8_fast_steps_stay_near_the_pipelines_own_within_their_bound(checkpoint, eager):  # noqa: F811
    """``VLLM_OMNI_GRAPHDECODE_FP8=sensenova_denoise``: the fast body's four linear layers a layer
    run W8A8 from e4m3 copies (torch's CPU ``_scaled_mm`` here, compiled regions). Measured on
    this CPU (tiny checkpoint, 2 layers, bf16): 3.1% and 3.6% relative RMS for the first step's
    two branches from the pipeline's own bits, 7.3% and 6.6% for the second's (its latents have
    moved with the first step's rounding); the bf16 fast body equals them exactly (above).
    Bound 12%."""
    pipe, summary = _fp8_pipeline(checkpoint)
    state = getattr(pipe, wiring.IMAGE_ATTR)
    layers = len(pipe.language_model.model.layers)
    assert isinstance(state.fast, fast_denoise.FastGen) and len(state.fast.fp8) == 4 * layers
    assert "FP8 (W8A8) GEMMs from e4m3 copies of" in summary
    steps = rm.generate_image(pipe, *CASES["t2i_cfg4"])[1]
    want = eager["t2i_cfg4"][1]
    assert len(steps) == len(want)
    errors = [_relative(a, b) for a, b in zip(steps, want)]
    print("FP8 fast steps, relative RMS from the pipeline's:", [f"{e:.4f}" for e in errors])
    assert all(0 < e <= 0.12 for e in errors), errors  # 0: the copies were not read
    assert stats.degraded_paths(MODEL) == {}


def test_fp8_copies_are_dropped_at_release_and_made_again_from_the_weights_then(checkpoint):  # noqa: F811
    pipe, _ = _fp8_pipeline(checkpoint)
    state = getattr(pipe, wiring.IMAGE_ATTR)
    request, refs = CASES["t2i_cfg4"]
    first = rm.generate_image(pipe, request, refs)[1]
    pipe.release_captured_graphs()  # what sleep level 2 calls
    assert len(state.fast.fp8) == 0
    again = rm.generate_image(pipe, request, refs)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len(state.fast.fp8) == 4 * len(pipe.language_model.model.layers)
    # Weights written as vLLM's loaders write them (through .data, no trace on the parameter),
    # then sleep: the next request reads copies of the new weights.
    pipe.release_captured_graphs()
    for layer in pipe.language_model.model.layers:
        layer.mlp_mot_gen.down_proj.weight.data.mul_(2)
    changed = rm.generate_image(pipe, request, refs)[1]
    assert not torch.equal(changed[0], first[0])


def test_fp8_outside_the_fast_mode_runs_the_pipelines_bits_with_the_reason(checkpoint, eager):  # noqa: F811
    pipe, summary = _fp8_pipeline(checkpoint, mode="graph")
    assert "FP8" not in summary
    steps = rm.generate_image(pipe, *CASES["t2i_cfg4"])[1]
    assert all(torch.equal(a, b) for a, b in zip(steps, eager["t2i_cfg4"][1]))
    assert stats.degraded_paths(MODEL) == {f"{MODEL}: {denoise.FP8_NEEDS_FAST.key}": 1}


def test_the_compiled_body_fixes_its_reductions_by_heuristics_not_by_timing(checkpoint):  # noqa: F811
    """Inductor's deterministic mode: a reduction's sum order never picked by timing at first
    use, so every process rounds a request alike (``compiling.FAST_BODY_OPTIONS``)."""
    pipe, _ = _pipeline(checkpoint)
    fast = getattr(pipe, wiring.IMAGE_ATTR)._build_fast(DTYPE)
    assert fast.options == {"emulate_precision_casts": True, "deterministic": True}
    assert fast.compile and fast._pre.args[0] is fast_denoise.REGIONS.select(
        "cpu", compile=True, **fast.options)[0].args[0]


def test_after_a_compile_failure_sleeps_release_builds_the_fast_body_again(checkpoint, eager,
                                                                            monkeypatch):  # noqa: F811
    """``FAST_NOT_HERE``'s hint: a fast body that failed to compile is tried again after sleep
    level 2 (``release_captured_graphs``)."""
    pipe, _ = _pipeline(checkpoint)
    state = getattr(pipe, wiring.IMAGE_ATTR)

    def failing(*args):
        raise fast_denoise.CompileFailed(fast_denoise.COMPILE_FAILED.because("injected"))

    state.fast._pre = failing
    request, refs = CASES["t2i_cfg4"]
    rm.generate_image(pipe, request, refs)
    assert fast_denoise.COMPILE_FAILED.same(state.fast)
    rm.generate_image(pipe, request, refs)
    assert fast_denoise.COMPILE_FAILED.same(state.fast)  # until a release
    pipe.release_captured_graphs()
    image, steps = rm.generate_image(pipe, request, refs)[:2]
    assert isinstance(state.fast, fast_denoise.FastGen) and state.fast._pre is not failing
    assert np.array_equal(image, eager["t2i_cfg4"][0])
    assert all(torch.equal(a, b) for a, b in zip(steps, eager["t2i_cfg4"][1]))
