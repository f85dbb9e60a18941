"""Structure changes a captured graph cannot see (issue #39, item 4), on the GPU host, where a
stale graph would compute a wrong result: Qwen-Image-2.1's cached steps, SenseNova-U1's decode and
its denoising branches, each with real models at small sizes (random weights, bf16).

``.to("cpu"); .to("cuda")`` between two requests: torch keeps every Parameter and rewrites its
``data``, so nothing a graph keys on changes, while the weights live at new addresses. Between the
two moves the old device blocks are taken by tensors of random values (``round_trip``): a graph
still reading the old addresses would read those. The second request must capture again and
compute what the first computed, bit for bit (same kernels, same values). A hook added to one
projection after capture must run, and the step must equal the model's own forward with it.

CPU counterpart (the mechanism and its decisions): ``tests/test_structure_changes.py``.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from qwen_tiny import GPU_CONFIG, at_step, cached_call, cached_reference, extract, request
from qwen_tiny import tiny_transformer
from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import reasons, stats
from vllm_omni_graphdecode.hooks import qwen_image_21 as qwen
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import denoise
from vllm_omni_graphdecode.ops.fp8 import marlin
from vllm_omni_graphdecode.testing import sensenova as rm, common

from test_sensenova_denoise import checkpoint  # noqa: F401 - the tiny checkpoint fixture
from test_sensenova_gpu import _cfg as _decode_cfg
from test_sensenova_gpu import _pipe, _same_logits, _think, gpu  # noqa: F401 - the fixture
from test_structure_changes import HOOKS, Scale, moves

pytestmark = pytest.mark.gpu

QWEN, DECODE, IMAGE = qwen.MODEL, hook.MODEL, denoise.MODEL


def _addresses(module) -> list[int]:
    return [t.data_ptr() for t in list(module.parameters()) + list(module.buffers())]


def round_trip(module) -> list[torch.Tensor]:
    """``module.to("cpu"); module.to("cuda")``, the device blocks the weights left taken in
    between by tensors of the same sizes holding random values. Returns those tensors: keep them
    while the next request runs. Asserts that the weights did land elsewhere."""
    before = _addresses(module)
    torch.cuda.synchronize()
    module.to("cpu")
    taken = []
    for t in list(module.parameters()) + list(module.buffers()):
        filler = torch.empty(t.shape, dtype=t.dtype, device="cuda")
        if filler.is_floating_point():
            filler.normal_()
        else:
            filler.fill_(1)
        taken.append(filler)
    module.to("cuda")
    torch.cuda.synchronize()
    assert _addresses(module) != before, "the weights came back to their old blocks"
    return taken


def _exact_qwen():
    config.reset_for_tests(config.parse({"VLLM_OMNI_GRAPHDECODE_QWEN_MODE": "exact"}))
    return tiny_transformer(GPU_CONFIG, dtype=torch.bfloat16, device="cuda")


def _qwen_request(model, kwargs, steps=(1, 2, 3)):
    cache = extract(model, kwargs)
    return [cached_call(model, at_step(kwargs, s), cache) for s in steps], cache


def test_gpu_qwen_a_to_round_trip_between_requests_recaptures_and_equals_diffusers_bit_for_bit():
    model = _exact_qwen()
    qwen.enable(model)
    kwargs = request(model, text_tokens=40, target_shape=(16, 16))
    first, cache = _qwen_request(model, kwargs)
    del cache
    gc.collect()  # the request is over: its entry and graph are pooled
    assert stats.get(QWEN, "capture") == 1 and stats.get(QWEN, "replay") == 3
    taken = round_trip(model)
    second, cache = _qwen_request(model, kwargs)
    want = [cached_reference(model, at_step(kwargs, s), cache) for s in (1, 2, 3)]
    for step, (got, ref, before) in enumerate(zip(second, want, first), start=1):
        assert torch.equal(got, ref), f"step {step}: {(got.float() - ref.float()).abs().max()}"
        assert torch.equal(got, before), f"step {step}"
    assert stats.get(QWEN, "capture") == 2 and stats.get(QWEN, "replay") == 6
    assert moves(QWEN) == 1 and stats.fallbacks(QWEN) == {}
    del taken


def test_gpu_qwen_a_to_round_trip_in_the_middle_of_a_request_recaptures_the_next_step():
    model = _exact_qwen()
    qwen.enable(model)
    kwargs = request(model, text_tokens=40, target_shape=(16, 16))
    cache = extract(model, kwargs)
    cached_call(model, at_step(kwargs, 1), cache)
    taken = round_trip(model)
    for s in (2, 3):
        step = at_step(kwargs, s)
        assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert stats.get(QWEN, "capture") == 2 and stats.get(QWEN, "replay") == 3
    assert moves(QWEN) == 1
    del taken


@pytest.mark.parametrize("kind", list(HOOKS))
def test_gpu_qwen_a_hook_on_one_projection_after_capture_runs_and_equals_diffusers(kind):
    model = _exact_qwen()
    qwen.enable(model)
    kwargs = request(model, text_tokens=40, target_shape=(16, 16))
    cache = extract(model, kwargs)
    for s in (1, 2):  # captured, replayed
        cached_call(model, at_step(kwargs, s), cache)
    step = at_step(kwargs, 3)
    unhooked = cached_reference(model, step, cache)
    scale = Scale()
    HOOKS[kind](model.transformer_blocks[1].attn.to_q, scale)
    got = cached_call(model, step, cache)
    assert scale.calls == 1  # it ran in the step, not past it
    assert torch.equal(got, cached_reference(model, step, cache))
    assert not torch.equal(got, unhooked)
    assert stats.get(QWEN, "replay") == 2 and stats.get(QWEN, "eager_step") == 1
    assert stats.fallbacks(QWEN) == {f"{QWEN}: {reasons.HOOKS.key}": 1}


# -- SenseNova-U1 decode -------------------------------------------------------------------------

def _decode_pipeline(gpu, **env):  # noqa: F811
    # No pre-capture: both requests then start from a fresh decoder (the second one's, after the
    # move, is made anew), so they run the very same allocations and kernels.
    return _pipe(gpu, cfg=_decode_cfg(VLLM_OMNI_GRAPHDECODE_PRECAPTURE="0", **env))


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_gpu_decode_a_to_round_trip_between_requests_recaptures_and_decodes_bit_for_bit(
        gpu, weights):  # noqa: F811
    """With FP8 weights the step reads the plugin's e4m3 copies, which stay where they are; each
    is quantised again in place from its moved bf16 weight (same values, the same copy)."""
    env = {}
    if weights == "fp8":
        why = marlin.available("cuda")
        if why is not None:
            pytest.skip(why.describe())
        env = {"VLLM_OMNI_GRAPHDECODE_FP8": "sensenova_decode"}
    pipe = _decode_pipeline(gpu, **env)
    first = _think(pipe, gpu.ids, 100)
    captures, replays = stats.get(DECODE, "capture"), stats.get(DECODE, "replay")
    assert captures > 0 and replays > 0
    taken = round_trip(gpu.lm)
    second = _think(pipe, gpu.ids, 100)
    _same_logits(second, first)
    assert stats.get(DECODE, "capture") == 2 * captures  # every bucket captured again
    assert stats.get(DECODE, "replay") == 2 * replays
    assert moves(DECODE) == 1 and stats.fallbacks(DECODE) == {}
    del taken


def _unhook(module, kind):
    if kind == "accelerate":
        from accelerate.hooks import remove_hook_from_module

        remove_hook_from_module(module)
    else:
        from diffusers.hooks import HookRegistry

        HookRegistry.check_if_exists_or_initialize(module).remove_hook("scaling")


@pytest.mark.parametrize("kind", list(HOOKS))
def test_gpu_decode_a_hook_on_one_projection_after_capture_runs_the_request_eagerly_with_it(
        gpu, kind, monkeypatch):  # noqa: F811
    """The request runs the pipeline's own eager loop with the hook, so the reference is that
    loop: on vllm-omni 0.30 with the plugin off, ``VLLM_OMNI_SENSENOVA_PAGED_DECODE=0`` (its
    in-tree paged decode, FA2 in a CUDA graph, rounds differently: on the H200 the two parted at
    token 38 of 60; h200-2026-12-05b). A no-op on earlier releases."""
    pipe = _decode_pipeline(gpu)
    plain = _think(pipe, gpu.ids, 60)
    assert stats.get(DECODE, "replay") > 0
    scale = Scale()
    proj = gpu.lm.model.layers[1].mlp.down_proj
    HOOKS[kind](proj, scale)
    try:
        got = _think(pipe, gpu.ids, 60)
        calls = scale.calls
        monkeypatch.setenv("VLLM_OMNI_SENSENOVA_PAGED_DECODE", "0")
        want = _think(_pipe(gpu, cfg=False), gpu.ids, 60)  # the pipeline's own, same hook
        monkeypatch.delenv("VLLM_OMNI_SENSENOVA_PAGED_DECODE")
    finally:
        _unhook(proj, kind)
    assert calls > 0
    _same_logits(got, want)
    assert not torch.equal(got.logits[0], plain.logits[0])
    assert stats.fallbacks(DECODE) == {f"{DECODE}: {hook.HOOKED.key}": 1}


# -- SenseNova-U1 denoising ---------------------------------------------------------------------

def test_gpu_denoise_a_pipeline_to_round_trip_between_requests_recaptures_bit_for_bit(
        checkpoint):  # noqa: F811
    pipe = rm.load_sensenova_pipeline(checkpoint, device="cuda", dtype=torch.bfloat16)
    hook.install(pipe, config.parse(common.with_suite_overrides({
        "VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "graph"})), None)
    request = rm.image_request(num_steps=3)
    first, first_steps = rm.generate_image(pipe, request)[:2]
    assert stats.get(IMAGE, "capture") == 2
    taken = round_trip(pipe)  # a bare-diffusers user's pipe.to("cpu"); pipe.to("cuda")
    image, steps = rm.generate_image(pipe, request)[:2]
    assert np.array_equal(image, first)
    assert all(torch.equal(a, b) for a, b in zip(steps, first_steps))
    assert stats.get(IMAGE, "capture") == 4 and stats.get(IMAGE, "replay") == 2 * 2 * 3
    assert moves(IMAGE) == 1 and stats.fallbacks(IMAGE) == {}
    del taken


def test_gpu_batched_a_to_round_trip_between_forwards_recaptures_and_answers_bit_for_bit(
        checkpoint):  # noqa: F811
    """The batched decode: the launches captured before the move are dropped, the next forward
    captures them again and every answer (greedy, and sampled from its own stream) is the one
    before the move."""
    from test_sensenova_batch_gpu import _answer, _batch, _mixed
    from test_sensenova_batch_gpu import _pipeline as batch_pipeline

    pipe = batch_pipeline(checkpoint)
    requests = _mixed()[:4]  # the text answers
    first = [_answer(o) for o in pipe.forward(_batch(requests))]
    captures = stats.get(DECODE, "batch_capture")
    assert captures >= 1
    taken = round_trip(pipe.language_model)
    second = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert second == first
    assert stats.get(DECODE, "batch_capture") > captures
    assert moves(DECODE) == 1
    del taken
