"""Qwen-Image-2.1 hook on CPU: the static-buffer cached step (run eagerly, no graph) against
diffusers' own forward, the real pipeline's loop, request safety, and every eligibility rule.

All comparisons are exact (``torch.equal``): the static step runs the very modules and ops of
diffusers' cached path on the same values.
"""

from __future__ import annotations

import gc

import logging

import pytest
import torch

from qwen_tiny import (
    at_step,
    cached_call,
    cached_reference,
    diffusers_forward,
    extract,
    fallback_reasons,
    new_cache,
    request,
    tiny_pipeline,
    tiny_transformer,
)
from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.core.patching import HookRefused
from vllm_omni_graphdecode.core.reasons import Reason
from vllm_omni_graphdecode.graphs import prefix as prefix_graph
from vllm_omni_graphdecode.hooks import qwen_image_21 as qwen
from vllm_omni_graphdecode.testing.qwen import synthetic_inputs

MODEL = qwen.MODEL


@pytest.fixture(autouse=True)
def exact_mode_unless_asked():
    """These tests prove the exact mode (diffusers' own block code, bit for bit) and the wiring
    around both modes; the fast mode's own tests ask for it by name."""
    config.reset_for_tests(config.parse({"VLLM_OMNI_GRAPHDECODE_QWEN_MODE": "exact"}))


@pytest.fixture
def model():
    return tiny_transformer()


# -- the static-buffer step equals diffusers' cached forward ----------------------------------

@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("text_tokens,reference_shapes", [
    (3, ()), (8, ()), (13, ()),  # text-to-image, three prefix lengths
    (6, ((2, 4),)), (5, ((4, 4), (2, 2))),  # edits: condition-image tokens inside the prefix
])
def test_static_step_equals_diffusers_cached_forward(model, batch, text_tokens, reference_shapes):
    kwargs = request(model, batch=batch, text_tokens=text_tokens, reference_shapes=reference_shapes)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False)
    for step in (1, 2, 3):
        step_kwargs = at_step(kwargs, step)
        expected = cached_reference(model, step_kwargs, cache)
        got = cached_call(model, step_kwargs, cache)
        assert torch.equal(got, expected), f"step {step}: max diff {(got - expected).abs().max()}"
    assert stats.get(MODEL, "static_step") == 3
    assert stats.fallbacks(MODEL) == {}
    assert wiring.graphs.info()["entries"] == 1


def test_cond_and_uncond_each_keep_their_own_prefix(model):
    cond = request(model, text_tokens=9, seed=1)
    uncond = request(model, text_tokens=4, seed=2)  # the negative prompt: other text, other length
    cond_cache, uncond_cache = extract(model, cond), extract(model, uncond)
    uncond["hidden_states"] = cond["hidden_states"]  # true CFG feeds both the same latents
    wiring = qwen.enable(model, capture=False)
    for step in (1, 2):
        for kwargs, cache in ((at_step(cond, step), cond_cache), (at_step(uncond, step), uncond_cache)):
            assert torch.equal(cached_call(model, kwargs, cache), cached_reference(model, kwargs, cache))
    assert wiring.graphs.lookup(cond_cache) is not wiring.graphs.lookup(uncond_cache)
    assert stats.get(MODEL, "static_step") == 4


def test_bind_repoints_the_request_cache_at_its_own_buffers(model):
    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False)
    cached_call(model, at_step(kwargs, 1), cache)
    entry = wiring.graphs.lookup(cache)
    for i, (k, v) in enumerate(entry.buffers.prefix):
        assert cache.get_layer(i).k is k and cache.get_layer(i).v is v


# -- the real pipeline's loop ------------------------------------------------------------------

@pytest.mark.parametrize("images_per_prompt", [1, 2])
def test_pipeline_loop_with_plugin_equals_loop_without(model, images_per_prompt):
    pipe = tiny_pipeline(model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, 7, model.config.context_in_dim, generator=gen)
    negative = torch.randn(1, 4, model.config.context_in_dim, generator=gen)

    def run():
        return pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, true_cfg_scale=4.0,
                    height=64, width=64, num_inference_steps=5, output_type="latent",
                    num_images_per_prompt=images_per_prompt,
                    generator=torch.Generator().manual_seed(3)).images

    expected = run()
    wiring = qwen.enable(pipe, capture=False)
    got = run()
    assert torch.equal(got, expected)
    assert stats.get(MODEL, "static_step") == 4 * 2  # steps 1..4, cond and uncond
    assert stats.fallbacks(MODEL) == {}
    gc.collect()
    assert wiring.graphs.info()["live"] == 0  # the pipeline's caches are gone: entries are free

    pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, true_cfg_scale=4.0, height=64,
         width=64, num_inference_steps=3, output_type="latent", num_images_per_prompt=images_per_prompt)
    assert wiring.graphs.info()["entries"] == 2  # the next request reused both


# -- request safety ----------------------------------------------------------------------------

def test_two_interleaved_requests_with_the_same_key_keep_their_own_prefixes(model):
    a = request(model, text_tokens=8, seed=11)
    b = request(model, text_tokens=8, seed=12)  # same shapes, other prompt: the same key
    cache_a, cache_b = extract(model, a), extract(model, b)
    wiring = qwen.enable(model, capture=False)
    for step in (1, 2, 3):
        for kwargs, cache in ((at_step(a, step), cache_a), (at_step(b, step), cache_b)):
            assert torch.equal(cached_call(model, kwargs, cache), cached_reference(model, kwargs, cache))
    entry_a, entry_b = wiring.graphs.lookup(cache_a), wiring.graphs.lookup(cache_b)
    assert entry_a.key == entry_b.key and entry_a is not entry_b
    assert entry_a.buffers.prefix[0][0].data_ptr() != entry_b.buffers.prefix[0][0].data_ptr()

    # A finishes: a third request with the same key takes A's entry, and B's prefix is untouched.
    del cache_a
    gc.collect()
    c = request(model, text_tokens=8, seed=13)
    cache_c = extract(model, c)
    for kwargs, cache in ((at_step(c, 1), cache_c), (at_step(b, 4), cache_b)):
        assert torch.equal(cached_call(model, kwargs, cache), cached_reference(model, kwargs, cache))
    assert wiring.graphs.lookup(cache_c) is entry_a
    assert wiring.graphs.info()["entries"] == 2


def test_a_new_extract_into_the_same_cache_is_copied_again(model):
    first, second = request(model, seed=21), request(model, seed=22)
    cache = extract(model, first)
    qwen.enable(model, capture=False)
    cached_call(model, at_step(first, 1), cache)
    extract(model, second, cache)  # the caller reuses its cache object for a new prompt
    kwargs = at_step(second, 1)
    assert torch.equal(cached_call(model, kwargs, cache), cached_reference(model, kwargs, cache))


def test_explicit_release_returns_the_entry_to_the_pool(model):
    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False)
    cached_call(model, at_step(kwargs, 1), cache)
    wiring.graphs.release(cache)
    assert wiring.graphs.lookup(cache) is None
    assert wiring.graphs.info() == {"entries": 1, "live": 0, "captured": 0, "eager_keys": 0}


# -- eligibility: each rule, its reason, and the eager result ---------------------------------

def _eager_result_with_reason(model, reason, kwargs=None, cache=None):
    """One cached step that must run diffusers' forward because of ``reason``."""
    kwargs = kwargs or request(model)
    cache = cache or extract(model, kwargs)
    step = at_step(kwargs, 1)
    expected = cached_reference(model, step, cache)
    eager, static = stats.get(MODEL, "eager_step"), stats.get(MODEL, "static_step")
    got = cached_call(model, step, cache)
    assert torch.equal(got, expected)
    assert reason.key in fallback_reasons(), stats.fallbacks(MODEL)
    assert stats.get(MODEL, "eager_step") == eager + 1
    assert stats.get(MODEL, "static_step") == static
    return got


def test_not_cuda_runs_eagerly(model):
    qwen.enable(model)  # capture on, on a CPU tensor
    _eager_result_with_reason(model, qwen.NOT_CUDA)


def test_autograd_runs_eagerly(model):
    kwargs = request(model)
    cache = extract(model, kwargs)
    qwen.enable(model, capture=False)
    step = at_step(kwargs, 1)
    with torch.enable_grad():
        got = model(**step, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]
    assert got.requires_grad
    assert torch.equal(got.detach(), cached_reference(model, step, cache))
    assert qwen.AUTOGRAD.key in fallback_reasons()


def test_padded_text_mask_runs_eagerly(model):
    kwargs = request(model, batch=2, text_tokens=8)
    mask = torch.ones(2, kwargs["encoder_hidden_states"].shape[1], dtype=torch.bool)
    mask[1, -3:] = False  # the second prompt is shorter
    kwargs["encoder_hidden_states_mask"] = mask
    qwen.enable(model, capture=False)
    _eager_result_with_reason(model, qwen.PADDED, kwargs)


def test_compiled_blocks_run_eagerly(model):
    qwen.enable(model, capture=False)
    model.transformer_blocks[0].compile(backend="eager")
    _eager_result_with_reason(model, qwen.COMPILED)


def test_accelerate_hook_runs_eagerly(model):
    from accelerate.hooks import ModelHook, add_hook_to_module

    qwen.enable(model, capture=False)
    add_hook_to_module(model.transformer_blocks[1], ModelHook())
    _eager_result_with_reason(model, qwen.HOOKS)


def test_accelerate_sequential_offload_hook_is_reported_as_offload(model):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    qwen.enable(model, capture=False)
    add_hook_to_module(model.transformer_blocks[1], AlignDevicesHook(execution_device="cpu",
                                                                     offload=True))
    _eager_result_with_reason(model, qwen.OFFLOAD)


def test_an_adapter_added_mid_request_is_seen_at_the_next_step(model):
    """The request binds at step 1; a LoRA adapter appears before step 2. Step 2 must not run the
    entry bound (and, on a GPU, captured) without it: the structure change drops every entry and
    the step runs diffusers' forward, with the adapter, for its reason."""
    from peft import LoraConfig

    kwargs = request(model)
    cache = extract(model, kwargs)
    qwen.enable(model, capture=False)
    cached_call(model, at_step(kwargs, 1), cache)
    assert stats.get(MODEL, "static_step") == 1
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    step = at_step(kwargs, 2)
    expected = cached_reference(model, step, cache)
    got = cached_call(model, step, cache)
    assert torch.equal(got, expected)
    assert stats.get(MODEL, "structure_changed") == 1 and stats.get(MODEL, "static_step") == 1
    assert qwen.LORA.key in fallback_reasons()


def test_diffusers_block_hook_runs_eagerly(model):
    from diffusers.hooks import HookRegistry, ModelHook

    qwen.enable(model, capture=False)
    HookRegistry.check_if_exists_or_initialize(model.transformer_blocks[0]).register_hook(
        ModelHook(), "test_hook")
    _eager_result_with_reason(model, qwen.HOOKS)


def test_peft_lora_runs_eagerly(model):
    from peft import LoraConfig

    qwen.enable(model, capture=False)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]))
    _eager_result_with_reason(model, qwen.LORA)


def test_vllm_lora_layer_runs_eagerly(model):
    layers = pytest.importorskip("vllm.lora.layers")

    class LoRALinear(layers.BaseLayerWithLoRA):  # a vLLM LoRA layer around the block's Linear
        def __init__(self, base):
            torch.nn.Module.__init__(self)
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    qwen.enable(model, capture=False)
    attn = model.transformer_blocks[0].attn
    attn.to_k = LoRALinear(attn.to_k)
    _eager_result_with_reason(model, qwen.LORA)


def test_unknown_attention_processor_runs_eagerly(model):
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

    class Custom(QwenImage21AttnProcessor):
        pass

    qwen.enable(model, capture=False)
    model.transformer_blocks[1].attn.set_processor(Custom())
    _eager_result_with_reason(model, qwen.PROCESSOR)


def test_parallel_and_non_resident_weights_are_reasons(model):
    # Neither runs on one CPU process; the rules themselves are checked here, the eager path they
    # lead to is the same one every other rule takes.
    assert qwen.structure_reason(model, torch.device("cpu")) is None
    assert qwen.NOT_RESIDENT.same(qwen.structure_reason(model, torch.device("meta")))
    model.transformer_blocks[1].attn.processor._parallel_config = object()
    assert qwen.PARALLEL.same(qwen.structure_reason(model, torch.device("cpu")))


def test_quantized_prefix_kv_runs_eagerly(model):
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVLayerCache

    class Int8LayerCache(QwenImage21KVLayerCache):  # per-tensor int8, dequantized on read
        def store(self, k, v):
            self.scale = (k.abs().amax() / 127, v.abs().amax() / 127)
            self.k = (k / self.scale[0]).round().to(torch.int8)
            self.v = (v / self.scale[1]).round().to(torch.int8)

        def get(self):
            return self.k.to(torch.float32) * self.scale[0], self.v.to(torch.float32) * self.scale[1]

    kwargs = request(model)
    cache = new_cache(model)
    cache.layer_caches = [Int8LayerCache() for _ in cache.layer_caches]
    extract(model, kwargs, cache)
    qwen.enable(model, capture=False)
    _eager_result_with_reason(model, qwen.QUANT_KV, kwargs, cache)


def test_prefix_kv_in_another_dtype_runs_eagerly(model):
    kwargs = request(model)
    cache = extract(model, kwargs)
    for i in range(len(model.transformer_blocks)):
        layer = cache.get_layer(i)
        layer.store(layer.k.half(), layer.v.half())  # torch.cat promotes back to the model's dtype
    qwen.enable(model, capture=False)
    step = at_step(kwargs, 1)
    expected = cached_reference(model, step, cache)
    assert torch.equal(cached_call(model, step, cache), expected)
    assert qwen.QUANT_KV.key in fallback_reasons()


def test_unpopulated_cache_fails_as_diffusers_does(model):
    qwen.enable(model, capture=False)
    kwargs = request(model)
    with pytest.raises(RuntimeError, match="not been populated"):
        cached_call(model, kwargs, new_cache(model))
    assert qwen.NOT_POPULATED.key in fallback_reasons()


def test_prefix_not_matching_the_layout_runs_eagerly(model):
    # The cache holds a 6-token prompt's prefix; the step describes a 9-token prompt.
    cache = extract(model, request(model, text_tokens=6))
    qwen.enable(model, capture=False)
    _eager_result_with_reason(model, qwen.LAYOUT, request(model, text_tokens=9), cache)


def test_every_entry_held_by_a_live_request_runs_eagerly(model):
    a, b = request(model, seed=31), request(model, seed=32)
    cache_a, cache_b = extract(model, a), extract(model, b)
    qwen.enable(model, capture=False, max_entries=1)
    assert torch.equal(cached_call(model, at_step(a, 1), cache_a),
                       cached_reference(model, at_step(a, 1), cache_a))
    _eager_result_with_reason(model, prefix_graph.CAPACITY, b, cache_b)


def test_oom_while_allocating_runs_eagerly_and_marks_the_key(model, monkeypatch):
    def no_memory(t):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(prefix_graph, "_alloc_like", no_memory)
    wiring = qwen.enable(model, capture=False)
    kwargs = request(model)
    cache = extract(model, kwargs)
    _eager_result_with_reason(model, prefix_graph.OOM, kwargs, cache)
    monkeypatch.undo()
    step = at_step(kwargs, 2)  # the key stays eager for this process, memory or not
    assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert wiring.graphs.info()["eager_keys"] == 1 and wiring.graphs.info()["entries"] == 0


def test_capture_failure_runs_eagerly(model):
    wiring = qwen.enable(model, capture=False)
    wiring.graphs.capture = True  # capture on CPU: the real capture path raises (no CUDA stream)
    _eager_result_with_reason(model, prefix_graph.CAPTURE_FAILED)
    assert wiring.graphs.info()["eager_keys"] == 1


def test_each_reason_is_logged_once(model):
    qwen.enable(model)
    kwargs = request(model)
    cache = extract(model, kwargs)
    # Listen on the plugin's logger itself: whether vLLM's "vllm" logger propagates to the root
    # (where pytest's caplog listens) depends on which vLLM modules earlier tests imported.
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    stats.logger.addHandler(handler)
    try:
        for step in (1, 2, 3):
            cached_call(model, at_step(kwargs, step), cache)
    finally:
        stats.logger.removeHandler(handler)
    assert len([r for r in records if qwen.NOT_CUDA.key in r.getMessage()]) == 1
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {qwen.NOT_CUDA.key}": 3}


# -- wiring ------------------------------------------------------------------------------------

def test_find_target_in_pipeline_adapter_and_transformer(model):
    pipe = tiny_pipeline(model)

    class Adapter(torch.nn.Module):  # how vLLM-Omni's diffusers adapter holds the pipeline
        def __init__(self, inner):
            super().__init__()
            self._pipeline = inner

    for holder in (model, pipe, Adapter(pipe)):
        assert qwen.find_target(holder) is model
    assert qwen.find_target(torch.nn.Linear(2, 2)) is None


def test_enable_is_idempotent_and_disable_restores_the_forward(model):
    wiring = qwen.enable(model, capture=False)
    assert qwen.enable(model) is wiring
    assert "forward" in model.__dict__
    wiring.disable()
    assert "forward" not in model.__dict__ and not hasattr(model, "_graphdecode_qwen")


def test_wire_attaches_sleep_release_and_summarises(model):
    class Runner:
        pipeline = tiny_pipeline(model)

    runner = Runner()
    line = qwen.wire(model, config.get(), runner)
    assert "replay CUDA graphs" in line and "sleep level 2 releases them" in line
    wiring = model._graphdecode_qwen
    kwargs = request(model)
    cache = extract(model, kwargs)
    wiring.graphs.capture = False
    wiring.require_cuda = False
    cached_call(model, at_step(kwargs, 1), cache)
    assert wiring.graphs.info()["entries"] == 1
    runner.graph_runners.clear()  # what every vLLM-Omni's sleep(level=2) does
    assert wiring.graphs.info()["entries"] == 0
    assert qwen.wire(model, config.get(), runner) == "already wired"


def test_loading_offers_the_adapter_pipeline_to_the_hook(model):
    from vllm_omni_graphdecode.core import loading

    config.reset_for_tests(config.parse({"VLLM_OMNI_GRAPHDECODE": "qwen_image_21"}))

    class Adapter(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._pipeline = inner

    class Runner:
        pipeline = Adapter(tiny_pipeline(model))

    lines = loading.after_load(Runner())
    assert len(lines) == 1 and lines[0].startswith("qwen_image_21: cached steps of"), lines
    assert getattr(model, "_graphdecode_qwen", None) is not None


def test_moved_signature_is_refused(model, monkeypatch):
    from diffusers.models.transformers import transformer_qwenimage21 as module

    def forward(self, hidden_states, modulation, attention_mask=None, rotary_emb=None):
        raise AssertionError("not called")

    monkeypatch.setattr(module.QwenImage21TransformerBlock, "forward", forward)
    with pytest.raises(HookRefused, match=r"QwenImage21TransformerBlock.forward: expected"):
        qwen.enable(model)
    assert "forward" not in model.__dict__


def test_model_with_its_own_graph_is_left_alone(model):
    pipe = tiny_pipeline(model)
    pipe.release_captured_graphs = lambda: None  # an in-tree pipeline that captures its own
    with pytest.raises(HookRefused, match="standing aside"):
        qwen.enable(pipe)


def test_compiled_transformer_is_refused_at_wiring(model):
    compiled = torch.compile(model, backend="eager")
    assert qwen.find_target(compiled) is compiled
    with pytest.raises(HookRefused, match="torch.compile"):
        qwen.wire(compiled, config.get(), None)


def test_support_names_every_supported_omni_version():
    from vllm_omni_graphdecode.core.loading import SUPPORTED_OMNI

    assert set(qwen.support()) == set(SUPPORTED_OMNI)


def test_diffusers_forward_is_untouched_by_wiring(model):
    qwen.enable(model, capture=False)
    assert type(model).forward is diffusers_forward


def test_buffers_made_under_inference_mode_serve_no_grad_steps(model):
    kwargs = request(model)
    cache = extract(model, kwargs)
    qwen.enable(model, capture=False)
    with torch.inference_mode():  # how a serving runner may call the first cached step
        cached_call(model, at_step(kwargs, 1), cache)
    step = at_step(kwargs, 2)
    assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))


def test_benchmark_inputs_have_the_documented_prefix_and_run_the_static_step(model):
    kwargs = synthetic_inputs(model, batch=2, text_tokens=10, reference_shapes=((4, 4), (2, 4)),
                                   target_shape=(4, 4))
    cache = extract(model, kwargs)
    assert cache.get_layer(0).k.shape[1] == 10 + 16 + 8  # text + both references
    qwen.enable(model, capture=False)
    step = at_step(kwargs, 1)
    assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert stats.get(MODEL, "static_step") == 1


def test_a_rebind_never_pools_buffers_its_cache_still_reads(model):
    a, b = request(model, seed=41), request(model, seed=42)
    cache_a, cache_b = extract(model, a), extract(model, b)
    wiring = qwen.enable(model, capture=False)
    cached_call(model, at_step(a, 1), cache_a)
    first = wiring.graphs.lookup(cache_a)
    step = at_step(a, 2)
    step["timestep"] = step["timestep"].double()  # another step signature: request A binds anew
    assert torch.equal(cached_call(model, step, cache_a), cached_reference(model, step, cache_a))
    assert first.buffers is None  # dropped, not pooled: A's cache read it until the rebind
    # B has A's first key; it must get fresh buffers, and A's results stay A's.
    for kwargs, cache in ((at_step(b, 1), cache_b), (at_step(a, 3), cache_a)):
        assert torch.equal(cached_call(model, kwargs, cache), cached_reference(model, kwargs, cache))
    assert wiring.graphs.lookup(cache_b) is not wiring.graphs.lookup(cache_a)


# -- the fast mode's wiring (its block body: test_qwen_image_21_fast_step.py) ------------------

@pytest.mark.parametrize("batch,reference_shapes", [(1, ()), (2, ((4, 4), (2, 2)))])
def test_fast_mode_uncompiled_equals_diffusers_and_writes_its_tail_in_place(model, batch,
                                                                          reference_shapes):
    """Fast mode on CPU with SDPA and no compile: the same math as diffusers' block, over one
    prefix + target buffer per layer instead of a torch.cat, so equal bit for bit; the entry's
    buffers keep their addresses across steps and the request's cache reads their prefix part."""
    kwargs = request(model, batch=batch, text_tokens=7, reference_shapes=reference_shapes)
    cache = extract(model, kwargs)
    prefix_len = cache.get_layer(0).k.shape[1]
    wiring = qwen.enable(model, capture=False, mode="fast", compile=False)
    ptrs = None
    for s in (1, 2, 3):
        step = at_step(kwargs, s)
        expected = cached_reference(model, step, cache)  # diffusers' own, over the same prefix
        assert torch.equal(cached_call(model, step, cache), expected), s
        entry = wiring.graphs.lookup(cache)
        assert entry.buffers.kv is not None and entry.key.backend.startswith("fast:SDPA")
        k0 = entry.buffers.kv[0][0]
        assert k0.shape[1] == prefix_len + kwargs["hidden_states"].shape[1] - \
            sum(h * w for h, w in reference_shapes)
        assert cache.get_layer(0).k.data_ptr() == k0.data_ptr()  # the prefix rows, re-pointed
        now = [t.data_ptr() for pair in entry.buffers.kv for t in pair]
        assert ptrs is None or now == ptrs
        ptrs = now
    assert stats.get(MODEL, "static_step") == 3 and stats.fallbacks(MODEL) == {}
    # SDPA here, with its reason (not CUDA): counted as a degraded path, not a fallback
    assert f"{MODEL}: {qwen.cached_step.FAST_PARTIAL.key}" in stats.degraded_paths(MODEL)


def test_fast_mode_compiled_on_cpu_is_close_to_diffusers(model):
    kwargs = request(model, text_tokens=7)
    cache = extract(model, kwargs)
    qwen.enable(model, capture=False, mode="fast", compile=True)
    for s in (1, 2):
        step = at_step(kwargs, s)
        expected = cached_reference(model, step, cache)
        got = cached_call(model, step, cache)
        # fp32, Inductor's CPU kernels: sum order only (measured 2.5e-6 on outputs up to ~3)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert stats.get(MODEL, "static_step") == 2


def test_fast_mode_falls_back_to_the_exact_step_when_its_block_body_does_not_apply(model):
    model.transformer_blocks[1].img_mlp.activation_fn = torch.nn.GELU()  # not the SwiGLU it reads
    kwargs = request(model, text_tokens=5)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False, mode="fast", compile=False)
    step = at_step(kwargs, 1)
    assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    entry = wiring.graphs.lookup(cache)
    assert entry.buffers.kv is None and entry.key.backend.startswith("exact:")
    degraded = stats.degraded_paths(MODEL)
    assert list(degraded) == [f"{MODEL}: {qwen.cached_step.FAST_NOT_HERE.key}"]


def test_fast_mode_compile_failure_runs_the_exact_step_with_its_reason(model, monkeypatch):
    from vllm_omni_graphdecode.hooks.qwen_image_21 import fast_step

    def fails(*args, **kwargs):
        raise fast_step.CompileFailed(fast_step.COMPILE_FAILED.because("injected"))

    kwargs = request(model, text_tokens=5)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False, mode="fast", compile=True)
    step = at_step(kwargs, 1)
    expected = cached_reference(model, step, cache)
    cached_call(model, at_step(kwargs, 1), cache)  # builds the fast parts (compiled on CPU)
    monkeypatch.setattr(wiring._fast.blocks, "block", fails)
    for s in (2, 3):
        step = at_step(kwargs, s)
        assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert isinstance(wiring._fast, Reason) and fast_step.COMPILE_FAILED.same(wiring._fast)
    assert f"{MODEL}: {qwen.cached_step.FAST_NOT_HERE.key}" in stats.degraded_paths(MODEL)
    del expected


def test_regionally_compiled_blocks_are_no_obstacle_to_the_fast_mode(model):
    """vLLM-Omni's runner compiles a pipeline's transformer blocks regionally unless
    --enforce-eager (``vllm_omni.diffusion.compile.regionally_compile``). The fast body reads the
    blocks' weights only, so it still runs; the exact mode refuses, with its reason."""
    from vllm_omni.diffusion.compile import regionally_compile

    regionally_compile(model, backend="eager")
    kwargs = request(model, text_tokens=5)
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False, mode="fast", compile=False)
    step = at_step(kwargs, 1)
    assert torch.equal(cached_call(model, step, cache), cached_reference(model, step, cache))
    assert stats.get(MODEL, "static_step") == 1 and stats.fallbacks(MODEL) == {}
    wiring.disable()
    qwen.enable(model, capture=False, mode="exact")
    _eager_result_with_reason(model, qwen.COMPILED, kwargs, cache)


def test_fast_mode_precompile_leaves_nothing_to_compile_for_a_request_of_that_size(model):
    """What wire() does at load with pre-capture on (for 1024x1024 there): run the fast step on
    zeros laid out as a request's buffers. A real request of that target size then compiles
    nothing (prompt length never reaches a compiled region). CPU, Inductor's C++ backend."""
    from vllm_omni_graphdecode.hooks.qwen_image_21 import fast_step

    kwargs = request(model, text_tokens=9)  # the default 4x4 target: 16 tokens
    cache = extract(model, kwargs)
    wiring = qwen.enable(model, capture=False, mode="fast", compile=True)
    line = wiring.precompile(target_tokens=16, batch=1)
    assert line.startswith("fast step compiled for 16 target tokens x batch 1"), line
    before = fast_step.compiled_graphs()
    with torch.inference_mode():
        for s in (1, 2):
            cached_call(model, at_step(kwargs, s), cache)
    assert fast_step.compiled_graphs() == before
    assert stats.get(MODEL, "static_step") == 2
