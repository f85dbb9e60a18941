"""Structure changes a captured graph cannot see (issue #39, item 4), on CPU, for each path that
replays: Qwen-Image-2.1's cached steps, SenseNova-U1's decode (one request, and batched) and its
denoising branches. Each hook checks one ``eligibility.Watch`` in constant time where its graphs
replay; these tests make each change the way a user or library makes it and check what the next
step does: weights moved by a ``.to()`` round trip (the graphs that read the old addresses are
dropped, ``WEIGHTS_MOVED`` counted, the next step binds anew), an accelerate or diffusers hook
on one inner projection (the step runs eagerly with the hook, ``HOOKS`` counted), and an attribute
a module writes for itself during its forward (nothing happens).

There are no graphs on CPU: the static-buffer step (``capture=False``) stands for the replay,
so a stale graph cannot show here as a wrong result. What is checked is the mechanism and its
decisions: which entries, decoders or launches are dropped and rebuilt, which reason is
counted, and that results equal the model's own. The GPU file
(``tests/test_structure_changes_gpu.py``) checks what the replays compute.

A ``.to()`` round trip here is float32 -> float64 -> float32 (every weight on new storage, every
value kept; the models are float32 throughout); on a GPU it is ``.to("cpu"); .to("cuda")``.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qwen_tiny import at_step, cached_call, cached_reference, extract, request, tiny_transformer
from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import eligibility, reasons, stats
from vllm_omni_graphdecode.decode.batch import kv as batch_kv
from vllm_omni_graphdecode.hooks import qwen_image_21 as qwen
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import denoise, wiring
from vllm_omni_graphdecode.ops import attention as kernels
from vllm_omni_graphdecode.testing import sensenova as rm

from test_sensenova_denoise import checkpoint  # noqa: F401 - the tiny checkpoint fixture

QWEN = qwen.MODEL
DECODE = hook.MODEL
IMAGE = denoise.MODEL


def moves(model: str) -> int:
    """How often ``model``'s graphs were dropped for weights that moved (``WEIGHTS_MOVED``)."""
    return stats.degraded_paths(model).get(f"{model}: {reasons.WEIGHTS_MOVED.key}", 0)


def round_trip(module) -> None:
    """Every floating weight to new storage and back, values kept (module docstring)."""
    module.to(torch.float64)
    module.to(torch.float32)


class Scale:
    """What the hooks below do on their projection: scale its input by 1.5 (so the result shows
    whether the hook ran) and count the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, args):
        self.calls += 1
        return tuple(a * 1.5 if torch.is_tensor(a) else a for a in args)


def accelerate_hook(module, scale: Scale):
    hooks = pytest.importorskip("accelerate.hooks")

    class Scaling(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return scale(args), kwargs

    hooks.add_hook_to_module(module, Scaling())


def diffusers_hook(module, scale: Scale):
    from diffusers.hooks import HookRegistry, ModelHook

    class Scaling(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return scale(args), kwargs

    HookRegistry.check_if_exists_or_initialize(module).register_hook(Scaling(), "scaling")


HOOKS = {"accelerate": accelerate_hook, "diffusers": diffusers_hook}


def writes_during_forward(module) -> None:
    """Make ``module`` (a layer of the model) count its calls in an attribute of its own, as a
    module caching something during its forward does. Before any wiring."""
    cls = type(module)

    def forward(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        return cls.forward(self, *args, **kwargs)

    module.__class__ = type(f"Counting{cls.__name__}", (cls,), {"forward": forward})


# -- Qwen-Image-2.1 ------------------------------------------------------------------------------

@pytest.fixture
def exact_qwen():
    config.reset_for_tests(config.parse({"VLLM_OMNI_GRAPHDECODE_QWEN_MODE": "exact"}))
    model = tiny_transformer()
    return model, qwen.enable(model, capture=False)


def test_qwen_a_to_round_trip_between_requests_drops_the_pooled_entry_and_counts_it(exact_qwen):
    model, wiring_ = exact_qwen
    kwargs = request(model)
    cache = extract(model, kwargs)
    first = [cached_call(model, at_step(kwargs, s), cache) for s in (1, 2)]
    pooled = wiring_.graphs.lookup(cache)
    del cache
    gc.collect()  # the request is over: its entry (and, on a GPU, its graph) is pooled
    round_trip(model)
    cache = extract(model, kwargs)
    got = [cached_call(model, at_step(kwargs, s), cache) for s in (1, 2)]
    entry = wiring_.graphs.lookup(cache)
    assert entry is not None and entry is not pooled  # not the graph over the old addresses
    assert all(torch.equal(a, b) for a, b in zip(got, first))
    assert all(torch.equal(g, cached_reference(model, at_step(kwargs, s), cache))
               for s, g in zip((1, 2), got))
    assert moves(QWEN) == 1
    assert stats.get(QWEN, "static_step") == 4 and stats.fallbacks(QWEN) == {}
    assert stats.get(QWEN, "structure_changed") == 0


def test_qwen_a_to_round_trip_in_the_middle_of_a_request_rebinds_the_next_step(exact_qwen):
    model, wiring_ = exact_qwen
    kwargs = request(model)
    cache = extract(model, kwargs)
    cached_call(model, at_step(kwargs, 1), cache)
    before = wiring_.graphs.lookup(cache)
    round_trip(model)
    for s in (2, 3):
        step = at_step(kwargs, s)
        assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert wiring_.graphs.lookup(cache) is not before
    assert moves(QWEN) == 1
    assert stats.get(QWEN, "static_step") == 3


@pytest.mark.parametrize("kind", list(HOOKS))
def test_qwen_a_hook_on_one_projection_after_binding_runs_the_step_eagerly_with_it(
        exact_qwen, kind):
    model, wiring_ = exact_qwen
    kwargs = request(model)
    cache = extract(model, kwargs)
    cached_call(model, at_step(kwargs, 1), cache)  # binds: on a GPU, captured
    step = at_step(kwargs, 2)
    unhooked = cached_reference(model, step, cache)
    scale = Scale()
    HOOKS[kind](model.transformer_blocks[1].attn.to_q, scale)
    got = cached_call(model, step, cache)
    assert scale.calls == 1  # the hook ran in this step
    assert torch.equal(got, cached_reference(model, step, cache))  # diffusers', hook and all
    assert not torch.equal(got, unhooked)
    assert stats.get(QWEN, "structure_changed") == 1 and stats.get(QWEN, "eager_step") == 1
    assert stats.fallbacks(QWEN) == {f"{QWEN}: {reasons.HOOKS.key}": 1}
    assert wiring_.graphs.info()["entries"] == 0  # what was bound without the hook is gone


def test_qwen_an_attribute_a_layer_writes_during_its_forward_changes_nothing():
    config.reset_for_tests(config.parse({"VLLM_OMNI_GRAPHDECODE_QWEN_MODE": "exact"}))
    model = tiny_transformer()
    proj = model.transformer_blocks[0].attn.to_q
    writes_during_forward(proj)
    wiring_ = qwen.enable(model, capture=False)
    kwargs = request(model)
    cache = extract(model, kwargs)
    calls = proj.calls
    cached_call(model, at_step(kwargs, 1), cache)
    entry = wiring_.graphs.lookup(cache)
    for s in (2, 3, 4):
        step = at_step(kwargs, s)
        assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert proj.calls > calls  # the steps ran it (and the references)
    assert wiring_.graphs.lookup(cache) is entry
    assert stats.get(QWEN, "static_step") == 4 and stats.get(QWEN, "structure_changed") == 0
    assert stats.fallbacks(QWEN) == {} and moves(QWEN) == 0


# -- SenseNova-U1 decode, one request at a time -------------------------------------------------

def _decode_cfg(**env):
    values = {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
              "VLLM_OMNI_GRAPHDECODE_BUCKETS": "32,64",
              "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "32",
              "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
              "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "off"}
    values.update(env)
    return config.parse(values)


STEPS = 40


@pytest.fixture
def tiny():
    """A model of its own per test: these tests move it and hook it."""
    tok = rm.build_tokenizer()
    return SimpleNamespace(tok=tok, lm=rm.build_lm(banned_ids=rm.stop_ids(tok)),
                           ids=rm.prompt_ids(tok, 20))


def _decode_pipe(tiny, wire=True):
    pipe = rm.build_pipeline(tiny.lm, tiny.tok)
    if wire:
        hook.install(pipe, _decode_cfg(), None, kernel=kernels.REFERENCE, graphs=False)
    return pipe


def _same(a, b):
    """Two think results: the same text and position, the same cache."""
    assert a[1:] == b[1:]
    for la, lb in zip(a[0].layers, b[0].layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_decode_a_to_round_trip_between_requests_releases_the_decoder_and_counts_it(tiny):
    pipe = _decode_pipe(tiny)
    state = getattr(pipe, hook.STATE_ATTR)
    first = rm.run_think(pipe, tiny.ids, STEPS)
    decoder = state.decoder
    round_trip(tiny.lm)
    second = rm.run_think(pipe, tiny.ids, STEPS)
    _same(second, first)
    assert state.decoder is not None and state.decoder is not decoder  # graphs captured anew
    assert moves(DECODE) == 1
    renewed = state.decoder
    _same(rm.run_think(pipe, tiny.ids, STEPS), first)
    assert state.decoder is renewed  # nothing moved since: kept
    assert stats.get(DECODE, "paged_request") == 3 and stats.fallbacks(DECODE) == {}


@pytest.mark.parametrize("kind", list(HOOKS))
def test_decode_a_hook_on_one_projection_runs_the_next_request_eagerly_with_it(tiny, kind):
    pipe = _decode_pipe(tiny)
    plain = rm.run_think(pipe, tiny.ids, STEPS)
    scale = Scale()
    HOOKS[kind](tiny.lm.model.layers[1].mlp.down_proj, scale)
    got = rm.run_think(pipe, tiny.ids, STEPS)
    assert scale.calls > 0
    twin = SimpleNamespace(tok=tiny.tok, lm=rm.build_lm(banned_ids=rm.stop_ids(tiny.tok)),
                           ids=tiny.ids)  # the same seed: the same weights
    HOOKS[kind](twin.lm.model.layers[1].mlp.down_proj, Scale())
    _same(got, rm.run_think(_decode_pipe(twin, wire=False), twin.ids, STEPS))
    assert got[2] != plain[2] or got[1] != plain[1]  # the hook changed the answer
    assert stats.fallbacks(DECODE) == {f"{DECODE}: {hook.HOOKED.key}": 1}
    assert stats.get(DECODE, "paged_request") == 1 and stats.get(DECODE, "structure_changed") == 1


def test_decode_requests_walk_the_model_once_while_a_layer_writes_its_own_attribute(
        tiny, monkeypatch):
    """The verdict's walk is kept while the watch sees no change: three requests, one walk, and
    a layer that writes an attribute at every call is no change."""
    layer = tiny.lm.model.layers[0].mlp.down_proj
    writes_during_forward(layer)
    pipe = _decode_pipe(tiny)
    walks = []
    real = eligibility.scan
    monkeypatch.setattr(eligibility, "scan", lambda *a, **k: walks.append(1) or real(*a, **k))
    calls = getattr(layer, "calls", 0)
    results = [rm.run_think(pipe, tiny.ids, STEPS) for _ in range(3)]
    assert layer.calls > calls
    assert len(walks) == 1
    _same(results[1], results[0])
    _same(results[2], results[0])
    assert stats.get(DECODE, "paged_request") == 3 and stats.get(DECODE, "structure_changed") == 0
    assert stats.fallbacks(DECODE) == {} and moves(DECODE) == 0


def _round_trip_at(step_model, lm, call: int) -> list[int]:
    """Make ``step_model``'s ``call``-th forward (a decode launch) move ``lm``'s weights first (a
    ``.to()`` round trip, outside inference mode as a user's call would be). Returns the list
    the moves are counted in."""
    done, real = [], step_model.forward

    def forward(*args, **kwargs):
        done.append(None)
        if len(done) == call:
            with torch.inference_mode(False):
                round_trip(lm)
        return real(*args, **kwargs)

    step_model.forward = forward
    return done


def test_decode_a_to_round_trip_during_a_request_hands_it_back_and_the_next_captures(tiny):
    """The check before every token: a request in flight when the weights move finishes on the
    model's own code (CHANGED, counted once) with the answer it had; the next request is checked
    again (WEIGHTS_MOVED, the decoder built anew) and decodes on the paged path."""
    pipe = _decode_pipe(tiny)
    state = getattr(pipe, hook.STATE_ATTR)
    rm.run_think(pipe, tiny.ids, STEPS)
    decoder = state.decoder
    real = decoder.model.forward
    counted = _round_trip_at(decoder.model, tiny.lm, 0)  # counts, never moves
    first = rm.run_think(pipe, tiny.ids, STEPS)
    decoder.model.forward = real
    calls = _round_trip_at(decoder.model, tiny.lm, 3)
    second = rm.run_think(pipe, tiny.ids, STEPS)
    # Only the launch the move happened in and the one already running ahead of the loop
    # (k = 4 tokens each) ran; every later token came from the model's own code.
    assert len(calls) == 8 < len(counted)
    # The same think text and position; the K/V of the tokens after the hand-back are the
    # model's own (its float32 matmuls round apart from the paged step's in the last bits).
    assert second[1:] == first[1:]
    for la, lb in zip(second[0].layers, first[0].layers):
        torch.testing.assert_close(la.keys, lb.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(la.values, lb.values, rtol=1e-5, atol=1e-5)
    assert stats.fallbacks(DECODE) == {f"{DECODE}: {reasons.CHANGED.key}": 1}
    third = rm.run_think(pipe, tiny.ids, STEPS)
    _same(third, first)
    assert state.decoder is not decoder and moves(DECODE) == 1
    assert stats.get(DECODE, "paged_request") == 4
    assert stats.fallbacks(DECODE) == {f"{DECODE}: {reasons.CHANGED.key}": 1}


def test_decode_unwire_disarms_the_watch(tiny):
    pipe = _decode_pipe(tiny)
    rm.run_think(pipe, tiny.ids, 5)
    assert any(eligibility._stamps_of(m) for m in tiny.lm.modules())
    hook.unwire(pipe)
    assert not any(eligibility._stamps_of(m) for m in tiny.lm.modules())
    assert all(type(vars(m)["_parameters"]) is dict for m in tiny.lm.modules())


# -- SenseNova-U1 decode, batched ---------------------------------------------------------------

def _batch_cfg():
    return config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                         "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "off",
                         "VLLM_OMNI_GRAPHDECODE_BUCKETS": "64,128",
                         "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "64",
                         "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": "4"})


def _batch_pipeline(checkpoint, wire=True):  # noqa: F811
    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=torch.float32)
    if wire:
        hook.install(pipe, _batch_cfg(), None, rows=4, batch_attention=batch_kv.REFERENCE,
                     graphs=False, image_graphs=False)
    return pipe


def _texts(pipe):
    from test_sensenova_batch import _answer, _batch, _text_requests

    return [_answer(o) for o in pipe.forward(_batch(_text_requests()))]


def test_batched_a_to_round_trip_between_forwards_drops_the_launches_and_counts_it(checkpoint):  # noqa: F811
    pipe = _batch_pipeline(checkpoint)
    first = _texts(pipe)
    batch = getattr(pipe, hook.STATE_ATTR).batch
    drops = []
    real = batch.decoder.drop_graphs
    batch.decoder.drop_graphs = lambda: (drops.append(1), real())[1]
    round_trip(pipe.language_model)
    assert _texts(pipe) == first
    assert drops == [1]
    assert moves(DECODE) == 1
    assert _texts(pipe) == first and drops == [1]
    assert stats.fallbacks(DECODE) == {}


def test_batched_a_hook_on_one_projection_runs_the_next_forward_eagerly_with_it(checkpoint):  # noqa: F811
    pipe = _batch_pipeline(checkpoint)
    _texts(pipe)
    scale = Scale()
    accelerate_hook(pipe.language_model.model.layers[1].mlp.down_proj, scale)
    got = _texts(pipe)
    assert scale.calls > 0
    release = _batch_pipeline(checkpoint, wire=False)
    accelerate_hook(release.language_model.model.layers[1].mlp.down_proj, Scale())
    from test_sensenova_batch import _answer, _batch, _text_requests

    assert got == [_answer(release.forward(_batch([r]))) for r in _text_requests()]
    assert stats.fallbacks(DECODE) == {f"{DECODE}: {hook.HOOKED.key}": 1}


def test_batched_a_to_round_trip_during_a_forward_hands_every_row_back(checkpoint):  # noqa: F811
    """The check before every launch: the rows in flight when the weights move finish on the
    model's own code (CHANGED, once per row, no launch after the move) with the answers they
    had; the next forward is checked again and decodes batched."""
    pipe = _batch_pipeline(checkpoint)
    first = _texts(pipe)
    batch = getattr(pipe, hook.STATE_ATTR).batch
    launches = _round_trip_at(batch.decoder.model, pipe.language_model, 2)
    second = _texts(pipe)
    assert len(launches) == 4  # the launch the move happened in (k = 4 steps), none after
    assert second == first
    changed = stats.fallbacks(DECODE)
    assert list(changed) == [f"{DECODE}: {reasons.CHANGED.key}"] and changed[
        f"{DECODE}: {reasons.CHANGED.key}"] == len(first)
    before = stats.get(DECODE, "batch_launch")
    assert _texts(pipe) == first
    assert stats.get(DECODE, "batch_launch") > before and moves(DECODE) == 1
    assert stats.fallbacks(DECODE) == changed


# -- SenseNova-U1 denoising ---------------------------------------------------------------------

def _image_pipeline(checkpoint, wire=True, change=None):  # noqa: F811
    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=torch.float32)
    if change is not None:
        change(pipe)
    if wire:
        cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                            "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "graph"})
        hook.install(pipe, cfg, None, image_graphs=False)
    return pipe


IMAGE_REQUEST = rm.image_request(num_steps=3)


def test_denoise_a_pipeline_to_round_trip_between_requests_drops_the_entries_and_counts_it(
        checkpoint):  # noqa: F811
    pipe = _image_pipeline(checkpoint)
    denoiser = getattr(pipe, wiring.IMAGE_ATTR)
    first = rm.generate_image(pipe, IMAGE_REQUEST)[0]
    # The entries themselves, not their ids: a freed entry's id can be a new entry's.
    pooled = list(denoiser.graphs._entries.values())
    round_trip(pipe)  # a bare-diffusers user's pipe.to("cpu"); pipe.to("cuda")
    image = rm.generate_image(pipe, IMAGE_REQUEST)[0]
    assert np.array_equal(image, first)
    assert not any(e is old for e in denoiser.graphs._entries.values() for old in pooled)
    assert denoiser.graphs.info()["entries"] == 2
    assert moves(IMAGE) == 1
    assert stats.get(IMAGE, "static_step") == 2 * 2 * IMAGE_REQUEST.num_steps
    assert stats.fallbacks(IMAGE) == {}


def test_denoise_a_to_round_trip_in_the_middle_of_a_request_rebinds_its_branches(checkpoint):  # noqa: F811
    want = rm.generate_image(_image_pipeline(checkpoint, wire=False), IMAGE_REQUEST)[0]
    pipe = _image_pipeline(checkpoint)
    step = pipe._t2i_predict_v
    calls = []

    def moving_after_the_first_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # step 2's first branch: both branches bound and stepped once
            round_trip(pipe.language_model)
        return step(*args, **kwargs)

    pipe._t2i_predict_v = moving_after_the_first_step
    image = rm.generate_image(pipe, IMAGE_REQUEST)[0]
    assert np.array_equal(image, want)
    assert moves(IMAGE) == 1
    assert stats.get(IMAGE, "static_step") == 2 * IMAGE_REQUEST.num_steps
    assert stats.fallbacks(IMAGE) == {}


def test_denoise_an_accelerate_hook_on_one_projection_runs_the_branches_with_it(checkpoint):  # noqa: F811
    def hooked(pipe):
        accelerate_hook(pipe.language_model.model.layers[1].self_attn.qkv_proj_mot_gen, Scale())

    want = rm.generate_image(_image_pipeline(checkpoint, wire=False, change=hooked),
                             IMAGE_REQUEST)[0]
    pipe = _image_pipeline(checkpoint)
    plain = rm.generate_image(pipe, IMAGE_REQUEST)[0]
    scale = Scale()
    accelerate_hook(pipe.language_model.model.layers[1].self_attn.qkv_proj_mot_gen, scale)
    image = rm.generate_image(pipe, IMAGE_REQUEST)[0]
    assert scale.calls > 0 and np.array_equal(image, want) and not np.array_equal(image, plain)
    assert stats.fallbacks(IMAGE) == {f"{IMAGE}: {reasons.HOOKS.key}": 2}  # once per branch
    assert stats.get(IMAGE, "static_step") == 2 * IMAGE_REQUEST.num_steps  # the first request
    assert stats.get(IMAGE, "structure_changed") == 1


def test_denoise_a_layer_writing_its_own_attribute_changes_nothing(checkpoint):  # noqa: F811
    pipe = _image_pipeline(checkpoint, change=lambda p: writes_during_forward(
        p.language_model.model.layers[0].mlp_mot_gen.down_proj))
    layer = pipe.language_model.model.layers[0].mlp_mot_gen.down_proj
    calls = getattr(layer, "calls", 0)
    for _ in range(2):
        rm.generate_image(pipe, IMAGE_REQUEST)
    assert layer.calls > calls
    assert stats.get(IMAGE, "static_step") == 2 * 2 * IMAGE_REQUEST.num_steps
    assert stats.get(IMAGE, "structure_changed") == 0 and moves(IMAGE) == 0
    assert stats.fallbacks(IMAGE) == {}
