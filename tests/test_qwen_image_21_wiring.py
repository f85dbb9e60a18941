"""How the Qwen-Image-2.1 hook is wired, on CPU with the real transformer (tiny, random weights):
a cached step is a lookup, copies and a replay (no walk of the module tree); a structure change
between binds is still seen at the next step; a call with a keyword this hook does not know runs
the original forward; ``unwire`` puts back every attribute; sleep's release is checked at every
bind; a release racing a step makes that step eager instead of raising.

The static-buffer step (``capture=False``) stands for the replay, as in test_qwen_image_21.py.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from qwen_tiny import (
    at_step,
    cached_call,
    cached_reference,
    diffusers_forward,
    extract,
    fallback_reasons,
    request,
    tiny_pipeline,
    tiny_transformer,
)
from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import patching, reasons, stats
from vllm_omni_graphdecode.hooks import qwen_image_21 as qwen

MODEL = qwen.MODEL


@pytest.fixture(autouse=True)
def exact_mode():
    config.reset_for_tests(config.parse({"VLLM_OMNI_GRAPHDECODE_QWEN_MODE": "exact"}))


@pytest.fixture
def model():
    return tiny_transformer()


def _wire_on_cpu(model, runner):
    """``wire`` as the loader calls it, then the static-buffer step (no CUDA here)."""
    qwen.wire(model, config.get(), runner)
    wiring = model._graphdecode_qwen
    wiring.graphs.capture = False
    wiring.require_cuda = False
    return wiring


# -- per step: no walk of the module tree; structure changes still seen -------------------------

def _walks_over_cached_steps(monkeypatch, steps: int) -> int:
    """Walks of the transformer's module tree (``named_modules`` from its root: ``modules()``,
    ``named_parameters()`` and the eligibility scan all go through it) during ``steps`` cached
    steps of one request."""
    model = tiny_transformer()
    kwargs = request(model)
    cache = extract(model, kwargs)
    qwen.enable(model, capture=False)
    walks, walk = [], torch.nn.Module.named_modules

    def counted(self, *args, **kw):
        if self is model:
            walks.append(1)
        return walk(self, *args, **kw)

    with monkeypatch.context() as patched:
        patched.setattr(torch.nn.Module, "named_modules", counted)
        for s in range(1, steps + 1):
            cached_call(model, at_step(kwargs, s), cache)
    assert stats.get(MODEL, "static_step") == steps and stats.fallbacks(MODEL) == {}
    stats.reset()
    return len(walks)


def test_cached_steps_walk_the_module_tree_only_when_they_bind(monkeypatch):
    two, eight = _walks_over_cached_steps(monkeypatch, 2), _walks_over_cached_steps(monkeypatch, 8)
    assert two == eight, f"{two} walks for 2 steps, {eight} for 8: a step walks the tree"
    assert eight <= 4  # the bind: eligibility scan, parameter residency, arming the watch


def test_a_forward_hook_added_to_a_block_after_binding_is_seen_at_the_next_step(model):
    kwargs = request(model)
    cache = extract(model, kwargs)
    qwen.enable(model, capture=False)
    cached_call(model, at_step(kwargs, 1), cache)  # binds: on a GPU, captured
    seen = []
    model.transformer_blocks[1].register_forward_hook(lambda m, a, out: seen.append(1))
    step = at_step(kwargs, 2)
    got = cached_call(model, step, cache)
    assert seen == [1]  # diffusers' forward ran, hook and all, not the step bound without it
    assert torch.equal(got, cached_reference(model, step, cache))
    assert stats.get(MODEL, "structure_changed") == 1 and stats.get(MODEL, "static_step") == 1
    assert reasons.HOOKS.key in fallback_reasons()


def test_a_lora_wrapper_put_in_place_after_binding_is_seen_at_the_next_step(model):
    layers = pytest.importorskip("vllm.lora.layers")

    class LoRALinear(layers.BaseLayerWithLoRA):  # vLLM's kind of wrapper around a Linear
        def __init__(self, base):
            torch.nn.Module.__init__(self)
            self.base_layer = base
            self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, base.in_features))

        def forward(self, x):
            return self.base_layer(x) + 0.1 * torch.nn.functional.linear(x, self.lora_b)

    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False)
    cached_call(model, at_step(kwargs, 1), cache)
    attn = model.transformer_blocks[0].attn
    attn.to_k = LoRALinear(attn.to_k)
    for s in (2, 3):
        step = at_step(kwargs, s)
        assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert stats.get(MODEL, "structure_changed") == 1 and stats.get(MODEL, "static_step") == 1
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {reasons.LORA.key}": 2}
    assert wiring.graphs.info()["entries"] == 0  # what was bound without the wrapper is gone


def test_what_wiring_built_before_the_first_step_survives_it(model):
    """The fast parts built at load (wire's pre-compile) are not a structure change: the first
    step keeps them."""
    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False, mode="fast", compile=False)
    fast = wiring._fast_for(torch.device("cpu"), torch.ones(1, dtype=torch.bool))
    for s in (1, 2):
        step = at_step(kwargs, s)
        assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert wiring._fast is fast and stats.get(MODEL, "structure_changed") == 0
    assert stats.get(MODEL, "static_step") == 2


def test_sleeps_release_builds_a_fast_body_that_failed_again_at_the_next_bind(model):
    """``FAST_NOT_HERE``'s hint: a fast body that failed to build or compile runs the exact step
    until sleep level 2 (``release_graphs``) or a structure change; then the next bind builds it
    again."""
    from vllm_omni_graphdecode.hooks.qwen_image_21 import fast_step

    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False, mode="fast", compile=False)
    failed = fast_step.COMPILE_FAILED.because("injected")
    wiring._fast = failed
    step = at_step(kwargs, 1)
    assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert wiring._fast is failed  # the exact step ran (diffusers' bits)
    wiring.release_graphs()
    cached_call(model, at_step(kwargs, 2), cache)
    assert not isinstance(wiring._fast, reasons.Reason)
    assert wiring.graphs.lookup(cache).key.backend.startswith("fast:")


def test_fp8_wires_the_fast_step_with_its_copies_and_is_counted_in_exact_mode(model):
    """``VLLM_OMNI_GRAPHDECODE_FP8`` naming qwen_image_21: the fast step's name says FP8 and its
    output moves from diffusers' (W8A8 rounding); with the exact mode it is counted as not run."""
    config.reset_for_tests(config.parse({"VLLM_OMNI_GRAPHDECODE_QWEN_MODE": "fast",
                                         "VLLM_OMNI_GRAPHDECODE_FP8": "qwen_image_21"}))
    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False, compile=False)
    fast = wiring._fast_for(torch.device("cpu"), torch.ones(1, dtype=torch.bool))
    assert fast.name.endswith(":fp8") and fast.blocks.fp8
    step = at_step(kwargs, 1)
    got, want = cached_call(model, step, cache), cached_reference(model, step, cache)
    assert not torch.equal(got, want)
    assert stats.get(MODEL, "static_step") == 1 and fallback_reasons() == set()
    wiring.unwire()
    stats.reset()
    config.reset_for_tests(config.parse({"VLLM_OMNI_GRAPHDECODE_QWEN_MODE": "exact",
                                         "VLLM_OMNI_GRAPHDECODE_FP8": "on"}))
    qwen.enable(model, capture=False)
    assert stats.degraded_paths(MODEL) == {
        f"{MODEL}: FP8 weights need the fast cached step": 1}


# -- arguments this hook does not know ----------------------------------------------------------

def test_a_keyword_a_newer_diffusers_adds_runs_the_original_forward_with_its_reason(model):
    """diffusers adds a trailing parameter to the forward: the hook still wires (the leading ones
    did not move), and a call passing it gets the original's result, not a TypeError."""
    base = type(model)

    class Newer(base):
        def forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
                    encoder_hidden_states_mask=None, attention_kwargs=None, kv_cache=None,
                    kv_cache_mode=None, return_dict=True, future_option=None):
            out = base.forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes,
                               img_mask, encoder_hidden_states_mask, attention_kwargs, kv_cache,
                               kv_cache_mode, return_dict)
            if future_option == "double":
                return (out[0] * 2,)
            return out

    model.__class__ = Newer
    kwargs = request(model)
    cache = extract(model, kwargs)
    qwen.enable(model, capture=False)
    step = at_step(kwargs, 1)
    with torch.no_grad():
        got = model(**step, kv_cache=cache, kv_cache_mode="cached", return_dict=False,
                    future_option="double")[0]
        want = Newer.forward(model, **step, kv_cache=cache, kv_cache_mode="cached",
                             return_dict=False, future_option="double")[0]
    assert torch.equal(got, want)
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {reasons.ARGUMENTS.key}": 1}
    assert stats.get(MODEL, "eager_step") == 1 and stats.get(MODEL, "static_step") == 0
    step = at_step(kwargs, 2)  # the next call without it takes the graph path
    assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert stats.get(MODEL, "static_step") == 1


def test_the_patched_forward_keeps_the_originals_signature(model):
    import inspect

    qwen.enable(model, capture=False)
    assert inspect.signature(model.forward) == inspect.signature(diffusers_forward.__get__(model))


# -- unwire -------------------------------------------------------------------------------------

def _runner(kind: str, model):
    if kind == "0.30":
        from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

        if not callable(getattr(DiffusionModelRunner, "release_captured_graphs", None)):
            pytest.skip("this vllm-omni's runner has no release_captured_graphs")
        runner = object.__new__(DiffusionModelRunner)
        runner.pipeline = tiny_pipeline(model)
        return runner
    return SimpleNamespace(pipeline=tiny_pipeline(model))  # 0.24-0.28: no method, no dict


def _own_attributes(model, runner) -> list[tuple[str, dict]]:
    return ([(name, dict(vars(m))) for name, m in model.named_modules()]
            + [("runner", dict(vars(runner)))])


@pytest.mark.parametrize("kind", ["0.24-0.28", "0.30"])
def test_unwire_puts_back_every_attribute_and_the_models_own_outputs(model, kind):
    runner = _runner(kind, model)
    kwargs = request(model)
    cache = extract(model, kwargs)
    before_outputs = [cached_call(model, at_step(kwargs, s), cache) for s in (1, 2)]
    before = _own_attributes(model, runner)
    # What the model's own forward reassigns at every call (its rotary module's ``freqs`` list)
    # is not the wiring's: found by one more call, then left out.
    cached_call(model, at_step(kwargs, 1), cache)
    churn = {(name, k) for (name, was), (_, now) in zip(before, _own_attributes(model, runner))
             for k in was if now.get(k) is not was[k]}
    wiring = _wire_on_cpu(model, runner)
    model.transformer_blocks[0].register_forward_hook(lambda *a: None).remove()
    cached_call(model, at_step(kwargs, 3), extract(model, kwargs))  # binds, arms the watch
    assert stats.get(MODEL, "static_step") == 1
    assert qwen.unwire(model) is True and qwen.unwire(model) is False
    after = _own_attributes(model, runner)
    assert [name for name, _ in after] == [name for name, _ in before]
    for (name, was), (_, now) in zip(before, after):
        assert now.keys() == was.keys(), name
        changed = [k for k in was if now[k] is not was[k] and (name, k) not in churn]
        assert changed == [], f"{name}: {changed} are not the objects they were"
        for k, table in was.items():  # the module tables hold what they held
            if isinstance(table, dict):
                assert now[k] == table, f"{name}.{k}"
    assert type(model).forward is diffusers_forward
    after_outputs = [cached_call(model, at_step(kwargs, s), cache) for s in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(after_outputs, before_outputs))
    assert wiring.graphs.info()["entries"] == 0 and stats.get(MODEL, "static_step") == 1


def test_after_unwire_a_wrapper_stacked_above_routes_nothing_into_the_graph(model):
    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False)
    cached_call(model, at_step(kwargs, 1), cache)
    ours = model.forward

    def stacked(*args, **kw):  # someone's wrapper, applied after the plugin's
        return ours(*args, **kw)

    model.forward = stacked
    assert wiring.unwire() == ["QwenImage21Transformer2DModel.forward"]  # theirs stays
    stats.reset()
    for s in (2, 3):
        step = at_step(kwargs, s)
        assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert stats.snapshot()["counters"] == {} and stats.fallbacks(MODEL) == {}
    assert wiring.graphs.info()["entries"] == 0


# -- sleep release ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["0.24-0.28", "0.30"])
def test_sleep_release_drops_graphs_through_what_that_version_calls(model, kind):
    runner = _runner(kind, model)
    wiring = _wire_on_cpu(model, runner)
    kwargs = request(model)
    cached_call(model, at_step(kwargs, 1), extract(model, kwargs))
    assert wiring.graphs.info()["entries"] == 1
    if kind == "0.30":
        runner.release_captured_graphs()  # DiffusionWorker.sleep(level=2) on 0.30
    else:
        runner.graph_runners.clear()  # DiffusionWorker.sleep(level=2) on 0.24-0.28
    assert wiring.graphs.info()["entries"] == 0


@pytest.mark.parametrize("kind", ["0.24-0.28", "0.30"])
def test_a_request_binding_after_the_release_was_replaced_runs_eagerly_with_its_reason(model,
                                                                                     kind):
    runner = _runner(kind, model)
    wiring = _wire_on_cpu(model, runner)
    first = request(model, seed=1)
    cached_call(model, at_step(first, 1), extract(model, first))
    if kind == "0.30":
        runner.release_captured_graphs = lambda: None  # sleep would skip the plugin now
    else:
        runner.graph_runners = {}
    second = request(model, seed=2)
    cache = extract(model, second)
    for s in (1, 2):
        step = at_step(second, s)
        assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {patching.SLEEP_UNREACHABLE.key}": 2}
    assert stats.get(MODEL, "static_step") == 1 and wiring.graphs.info()["entries"] == 0


def test_a_runner_sleep_cannot_reach_is_refused_at_wiring(model):
    runner = SimpleNamespace(pipeline=tiny_pipeline(model), graph_runners=["not a dict"])
    with pytest.raises(patching.HookRefused, match="sleep could not release"):
        qwen.wire(model, config.get(), runner)
    assert "forward" not in vars(model)


# -- a release racing a step --------------------------------------------------------------------

def test_a_release_between_the_lookup_and_the_replay_makes_that_step_eager(model):
    """Thread A's step has looked its entry up and is copying its latents in when thread B
    releases every graph (sleep). A's step must not replay (or raise): it runs diffusers' forward,
    with the reason counted. Synchronised by events on the latents' copy, not by timing."""
    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False)
    cached_call(model, at_step(kwargs, 1), cache)  # bound
    copying, released = threading.Event(), threading.Event()

    class PausesAtCopy(torch.Tensor):
        """Latents whose first copy into the static buffers waits for the release."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_ and not copying.is_set():
                copying.set()
                assert released.wait(60)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    step = at_step(kwargs, 2)
    expected = cached_reference(model, step, cache)
    paused = dict(step, hidden_states=step["hidden_states"].as_subclass(PausesAtCopy))
    result, error = [], []

    def a():
        try:
            result.append(cached_call(model, paused, cache))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            error.append(exc)

    thread = threading.Thread(target=a)
    thread.start()
    assert copying.wait(60)
    wiring.release_graphs()  # thread B: sleep level 2
    released.set()
    thread.join(60)
    assert error == [] and len(result) == 1
    assert torch.equal(result[0], expected)
    assert reasons.RELEASED.key in fallback_reasons()
    assert stats.get(MODEL, "static_step") == 1 and stats.get(MODEL, "eager_step") == 1
