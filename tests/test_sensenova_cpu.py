"""The SenseNova-U1 hook on the installed vllm-omni's real code, on CPU.

The model, the pipeline's think/text loops and the tokenizer handling are vllm-omni's own
(``vllm_omni_graphdecode/testing/sensenova.py`` builds a 2-layer model and a local tokenizer; the
pipeline object is made with ``object.__new__`` because its ``__init__`` loads a checkpoint). The
paged path runs with ``kernels.REFERENCE`` as its kernel and without graphs (there is no GPU);
everything else (patches, sessions, write-back, eligibility, fallbacks) is the production code.

Buckets are 32,64 (tail step 32) so a 20-token prompt decoding 70 tokens crosses a bucket
boundary (32 -> 64) and grows past the last bucket (-> 96).
"""

import threading
from types import SimpleNamespace

import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import loading, stats
from vllm_omni_graphdecode.core.patching import HookRefused
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.ops import attention as kernels
from vllm_omni_graphdecode.testing import sensenova as st, common

MODEL = hook.MODEL
PROMPT = 20
STEPS = 70  # 20 + 70 tokens: buckets 32 -> 64 -> tail 96
SHORT = 40  # enough to leave the first bucket


def _cfg(**env):
    values = {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
              "VLLM_OMNI_GRAPHDECODE_BUCKETS": "32,64",
              "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "32",
              "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
              # These tests compare every step's logits: one launch per token returns them.
              # Multi-token launches: tests/test_token_loop.py.
              "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": "1"}
    values.update(env)
    return config.parse(values)


@pytest.fixture(scope="module")
def tiny():
    tok = st.build_tokenizer()
    lm = st.build_lm(banned_ids=st.stop_ids(tok))
    return SimpleNamespace(tok=tok, lm=lm, ids=st.prompt_ids(tok, PROMPT))


@pytest.fixture(scope="module")
def eager_think(tiny):
    """The unpatched pipeline's think result and per-step logits, per step limit."""
    results = {}

    def get(steps, ids=None):
        key = (steps, None if ids is None else tuple(ids.flatten().tolist()))
        if key not in results:
            pipe = st.build_pipeline(tiny.lm, tiny.tok)
            logits = st.record_ar_steps(pipe)
            results[key] = (*st.run_think(pipe, tiny.ids if ids is None else ids, steps), logits)
        return results[key]

    return get


def _paged_pipeline(tiny, lm=None, cfg=None, **install):
    pipe = st.build_pipeline(lm or tiny.lm, tiny.tok, od_config=install.pop("od_config", None))
    install.setdefault("kernel", kernels.REFERENCE)
    install.setdefault("graphs", False)
    summary = hook.install(pipe, cfg or _cfg(), install.pop("runner", None), **install)
    return pipe, summary


def _assert_same_cache(a, b, atol=1e-5):
    assert a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=atol, rtol=1e-4)
        torch.testing.assert_close(la.values, lb.values, atol=atol, rtol=1e-4)


def _assert_same_think(got, want):
    cache, t_idx, text = got
    w_cache, w_t_idx, w_text = want[:3]
    assert text == w_text and t_idx == w_t_idx
    _assert_same_cache(cache, w_cache)


def _state(pipe):
    """The wiring install() attached: ``.sessions`` (gate, lock, live session), ``.decoder``."""
    return getattr(pipe, hook.STATE_ATTR)


# ------------------------------------------------------------------ paged path == eager path

def test_paged_think_matches_eager_tokens_and_logits_across_bucket_and_tail(tiny, eager_think):
    pipe, summary = _paged_pipeline(tiny)
    assert "think/text decode paged" in summary
    logits = st.record_ar_steps(pipe)
    cache, t_idx, text = st.run_think(pipe, tiny.ids, STEPS)
    w_cache, w_t_idx, w_text, w_logits = eager_think(STEPS)
    assert text == w_text and t_idx == w_t_idx
    assert len(logits) == len(w_logits) == STEPS
    for step, (a, b) in enumerate(zip(logits, w_logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    dec = _state(pipe).decoder
    assert dec.cache.capacity == 96  # 32 -> 64 -> one tail step
    # The request started in the pinned tier (the first bucket), moved to the overflow tier at 33
    # tokens, which then grew once (64 -> 96); the pinned tier was never reallocated.
    assert dec.current is dec.overflow and dec.overflow.cache.generation == 1
    assert dec.pinned.cache.capacity == 32 and dec.pinned.cache.generation == 0
    assert stats.get(MODEL, "paged_request") == 1
    assert stats.get(MODEL, "paged_eager_step") == STEPS and stats.get(MODEL, "eager_step") == 0
    assert stats.fallbacks(MODEL) == {}


def test_paged_text_matches_eager_tokens_and_logits_across_bucket_and_tail(tiny):
    eager = st.build_pipeline(tiny.lm, tiny.tok)
    w_logits = st.record_ar_steps(eager)
    want = st.run_text(eager, tiny.ids, STEPS)
    pipe, _ = _paged_pipeline(tiny)
    logits = st.record_ar_steps(pipe)
    got = st.run_text(pipe, tiny.ids, STEPS)
    assert got == want and len(logits) == len(w_logits) == STEPS
    for step, (a, b) in enumerate(zip(logits, w_logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    assert _state(pipe).decoder.cache.capacity == 96
    assert stats.get(MODEL, "paged_eager_step") == STEPS and stats.fallbacks(MODEL) == {}


def test_think_written_back_cache_equals_eager_cache(tiny, eager_think):
    """The cache the image stage reads: prefix + think tokens + the appended "\\n\\n<img>"."""
    pipe, _ = _paged_pipeline(tiny)
    got = st.run_think(pipe, tiny.ids, STEPS)
    want = eager_think(STEPS)
    appended = len(tiny.tok("\n\n<img>", add_special_tokens=False)["input_ids"])
    # the append ran on the written-back cache: prefix + think tokens + appended ones
    assert got[0].get_seq_length() == PROMPT + STEPS + appended
    _assert_same_think(got, want)


def test_second_request_reuses_buffers_and_still_matches(tiny, eager_think):
    pipe, _ = _paged_pipeline(tiny)
    first = st.run_think(pipe, tiny.ids, STEPS)
    ptrs = [k.data_ptr() for k in _state(pipe).decoder.cache.k]
    other = st.prompt_ids(tiny.tok, 12, seed=7)
    second = st.run_think(pipe, other, SHORT)
    assert [k.data_ptr() for k in _state(pipe).decoder.cache.k] == ptrs
    _assert_same_think(first, eager_think(STEPS))
    _assert_same_think(second, eager_think(SHORT, other))


def test_paged_decoder_api_for_benchmarks_matches_the_eager_step(tiny):
    """``PagedDecoder`` as ``benchmarks/`` drives it: prefill cache in, N steps, write-back."""
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    out, cache, t_idx = st.prefill(pipe, tiny.ids)
    _, ref_cache, _ = st.prefill(pipe, tiny.ids)
    dec = hook.paged_decoder(tiny.lm, kernel=kernels.REFERENCE, buckets=(32, 64), graphs=False)
    assert dec.begin(cache) == PROMPT
    token = out.logits[:, -1].argmax(-1)
    with torch.inference_mode():
        for step in range(30):
            logits = dec.step(token, t_idx + 1 + step)
            ref = pipe._ar_step(token, t_idx + step, ref_cache).logits
            torch.testing.assert_close(logits.float(), ref.float(), atol=1e-4, rtol=1e-4)
            token = logits[:, -1].argmax(-1)
    dec.write_back(cache)
    _assert_same_cache(cache, ref_cache)
    dec.release()
    assert dec.nbytes == 0 and dec.num_graphs == 0


# ------------------------------------------------------------------ eligibility and fallbacks

def _kernel_reason(reason, detail="x"):
    return {"kernel": reason.because(detail)}


RULE_CASES = {
    # kernel selection (each reason from kernels.select_kernel, handed in as it would be found)
    kernels.BAD_HEAD_DIM: lambda t: _kernel_reason(kernels.BAD_HEAD_DIM, "head_dim=264"),
    kernels.IMPORT_FAILED: lambda t: _kernel_reason(kernels.IMPORT_FAILED),
    kernels.NO_PAGED_KWARGS: lambda t: _kernel_reason(kernels.NO_PAGED_KWARGS),
    kernels.FA_VERSION_UNSUPPORTED: lambda t: _kernel_reason(kernels.FA_VERSION_UNSUPPORTED),
    # pipeline and model state
    hook.TP: lambda t: {"od_config": st.default_od_config(
        parallel_config=SimpleNamespace(tensor_parallel_size=2))},
    hook.OFFLOAD: lambda t: {"od_config": st.default_od_config(enable_layerwise_offload=True)},
    hook.KV_QUANT: lambda t: {"od_config": st.default_od_config(diffusion_kv_cache_dtype="fp8")},
}


@pytest.mark.parametrize("reason", list(RULE_CASES))
def test_each_rule_gives_its_reason_and_the_eager_result(tiny, eager_think, reason):
    pipe, summary = _paged_pipeline(tiny, **RULE_CASES[reason](tiny))
    assert reason.key in summary
    got = st.run_think(pipe, tiny.ids, SHORT)
    _assert_same_think(got, eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {reason}": 1}
    assert stats.get(MODEL, "paged_request") == 0 and stats.get(MODEL, "eager_step") == SHORT


def test_not_cuda_is_the_reason_when_the_kernel_is_selected_here(tiny, eager_think):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    summary = hook.install(pipe, _cfg(), None)  # production selection: no override
    assert "not CUDA" in summary and "pre-capture skipped: not CUDA" in summary
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {kernels.NOT_CUDA}": 1}


def test_forward_hook_on_the_language_model_gives_its_reason(tiny, eager_think):
    pipe, _ = _paged_pipeline(tiny)
    handle = tiny.lm.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: None)
    try:
        got = st.run_think(pipe, tiny.ids, SHORT)
    finally:
        handle.remove()
    _assert_same_think(got, eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.HOOKED}": 1}


def test_offload_hook_on_a_layer_gives_the_offload_reason(tiny, eager_think):
    """An offload hook registered through vllm-omni's own HookRegistry, under the layerwise
    offloader's hook name (a pass-through hook: it moves no weights here)."""
    from vllm_omni.diffusion.hooks import HookRegistry, ModelHook
    from vllm_omni.diffusion.offloader.layerwise_backend import LayerwiseOffloadHook

    lm = st.build_lm(banned_ids=st.stop_ids(tiny.tok))
    HookRegistry.get_or_create(lm.model.layers[1]).register_hook(
        LayerwiseOffloadHook._HOOK_NAME, ModelHook())
    pipe, _ = _paged_pipeline(tiny, lm=lm)
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.OFFLOAD}": 1}


def test_compiled_language_model_gives_its_reason(tiny, eager_think):
    lm = st.build_lm(banned_ids=st.stop_ids(tiny.tok))  # same seed: same weights as tiny.lm
    lm.compile(backend="eager")
    pipe, _ = _paged_pipeline(tiny, lm=lm)
    got = st.run_think(pipe, tiny.ids, SHORT)
    _assert_same_think(got, eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.COMPILED}": 1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="capture works on a GPU")
def test_capture_failure_runs_the_same_step_without_graphs_until_a_release(tiny, eager_think):
    """Graphs forced on where CUDA capture cannot work: the real capture attempt raises, is
    repaired, and the step runs without a graph, for this request and the next (counted each)."""
    pipe, _ = _paged_pipeline(tiny, graphs=True, cfg=_cfg(VLLM_OMNI_GRAPHDECODE_PRECAPTURE="0"))
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.CAPTURE_FAILED}": 2}
    assert stats.get(MODEL, "paged_request") == 2
    assert stats.get(MODEL, "eager_step") == 0
    assert stats.get(MODEL, "paged_eager_step") == 2 * SHORT
    assert not _state(pipe).sessions.lock.locked()
    pipe.release_captured_graphs()
    assert _state(pipe).sessions.capture_failed is None


def test_out_of_memory_at_request_start_falls_back(tiny, eager_think):
    # A 40-token prompt needs the 2**40-token bucket at once: the allocation really fails.
    ids = st.prompt_ids(tiny.tok, 40, seed=3)
    pipe, _ = _paged_pipeline(tiny, cfg=_cfg(VLLM_OMNI_GRAPHDECODE_BUCKETS="32,1099511627776"))
    _assert_same_think(st.run_think(pipe, ids, SHORT), eager_think(SHORT, ids))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.OOM}": 1}
    assert _state(pipe).decoder is None and not _state(pipe).sessions.lock.locked()


def test_out_of_memory_while_growing_hands_the_request_back(tiny, eager_think):
    # Starts in the 32 bucket; growing to 2**40 tokens at step 13 fails, the rest runs eagerly.
    pipe, _ = _paged_pipeline(tiny, cfg=_cfg(VLLM_OMNI_GRAPHDECODE_BUCKETS="32,1099511627776"))
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.OOM}": 1}
    assert stats.get(MODEL, "paged_eager_step") == 32 - PROMPT
    assert stats.get(MODEL, "eager_step") == SHORT - (32 - PROMPT)
    assert _state(pipe).decoder is None and not _state(pipe).sessions.lock.locked()


# ------------------------------------------------------------------ one sequence per pipeline

class _PausingTokenizer:
    """Delegates to the real tokenizer; the first call from ``thread`` waits for ``release``.

    ``_generate_think`` asks the tokenizer for its stop ids right after the plugin has opened
    the decode session, so the owning request is paused inside its session.
    """

    def __init__(self, inner):
        self._inner = inner
        self.thread = None
        self.inside = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        return self._inner(*args, **kwargs)

    def convert_tokens_to_ids(self, tokens):
        if threading.current_thread() is self.thread and not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(120)
        return self._inner.convert_tokens_to_ids(tokens)


def test_a_second_request_waits_for_the_decode_in_flight_then_takes_the_paged_path(
        tiny, eager_think):
    """One sequence at a time: a request from another thread waits while the first decodes
    (touching none of its buffers), then decodes on the paged path itself. Both equal eager."""
    tok = _PausingTokenizer(tiny.tok)
    pipe = st.build_pipeline(tiny.lm, tok)
    hook.install(pipe, _cfg(), None, kernel=kernels.REFERENCE, graphs=False)
    lock = _state(pipe).sessions.lock = common.ObservedLock()
    results = {}
    first = threading.Thread(target=lambda: results.update(a=st.run_think(pipe, tiny.ids, STEPS)))
    tok.thread = first
    first.start()
    other = st.prompt_ids(tiny.tok, 12, seed=7)
    second = threading.Thread(target=lambda: results.update(b=st.run_think(pipe, other, SHORT)))
    try:
        assert tok.inside.wait(120), "the first request never reached its decode loop"
        state = _state(pipe)
        before = [t.clone() for t in state.decoder.cache.k + state.decoder.cache.v]
        second.start()
        assert lock.waiting.wait(120), "the second request did not wait for the first"
        assert second.is_alive()
        after = state.decoder.cache.k + state.decoder.cache.v
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    finally:
        tok.release.set()
        first.join(120)
        second.join(120)
    _assert_same_think(results["a"], eager_think(STEPS))
    _assert_same_think(results["b"], eager_think(SHORT, other))
    assert stats.fallbacks(MODEL) == {} and stats.get(MODEL, "paged_request") == 2
    assert stats.get(MODEL, "decode_waits") == 1
    assert not _state(pipe).sessions.lock.locked()


def test_a_decode_loop_nested_in_the_same_thread_runs_eagerly(tiny, eager_think):
    pipe, _ = _paged_pipeline(tiny)
    inner, nested = pipe._ar_step, {}
    other = st.prompt_ids(tiny.tok, 12, seed=7)

    def _ar_step(*args, **kwargs):
        if not nested:
            nested["running"] = True
            nested["b"] = st.run_think(pipe, other, 10)  # inside the first request's loop
        return inner(*args, **kwargs)

    pipe._ar_step = _ar_step
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    _assert_same_think(nested["b"], eager_think(10, other))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.BUSY}": 1}


# ------------------------------------------------------------------ LoRA wrappers

def test_lora_wrappers_base_lora_base_each_match_eager(tiny):
    """With vllm-omni's LoRA wrappers in the tree, graphs are per request; each request of
    base -> LoRA -> base equals the eager pipeline with the same adapter state."""
    lm = st.build_lm(banned_ids=st.stop_ids(tiny.tok))
    eager = st.build_pipeline(lm, tiny.tok)
    pipe, _ = _paged_pipeline(tiny, lm=lm)
    base_before = st.run_think(pipe, tiny.ids, SHORT)
    wrappers = st.add_lora_wrappers(lm)
    results = []
    for bound in (False, True, False):
        (common.bind_adapter if bound else common.unbind_adapter)(wrappers)
        want = st.run_think(eager, tiny.ids, SHORT)
        got = st.run_think(pipe, tiny.ids, SHORT)
        _assert_same_think(got, want)
        results.append(got[2])
    assert results[0] == results[2] == base_before[2] and results[1] != results[0]
    assert stats.get(MODEL, "lora_request") == 3 and stats.fallbacks(MODEL) == {}


# ------------------------------------------------------------------ versions, refusal, sleep

def _in_tree():
    return hasattr(st.pipeline_module().SenseNovaU1Pipeline, "_decode_context")


@pytest.fixture
def in_tree_spy(monkeypatch):
    """Counts calls of vllm-omni 0.30's own ``_decode_context`` (class attribute; the plugin
    never patches the class)."""
    if not _in_tree():
        pytest.skip("the installed vllm-omni has no in-tree SenseNova paged decode")
    cls = st.pipeline_module().SenseNovaU1Pipeline
    original = cls._decode_context
    calls = []

    def _decode_context(self, past_key_values):
        calls.append(1)
        return original(self, past_key_values)

    monkeypatch.setattr(cls, "_decode_context", _decode_context)
    return calls


@pytest.mark.parametrize("denoise", ["off", "graph"])
def test_defer_leaves_the_decode_alone_and_the_in_tree_decode_still_runs(
        tiny, eager_think, in_tree_spy, denoise):
    want = eager_think(SHORT)  # the unpatched pipeline's own run (it may call the in-tree path)
    in_tree_spy.clear()
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    summary = hook.install(pipe, _cfg(VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE="defer",
                                      VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE=denoise), None,
                           kernel=kernels.REFERENCE, graphs=False)
    assert "stays in charge" in summary
    decode = {"_ar_step", "_generate_think", "_generate_text", "_decode_context"}
    assert not decode & set(vars(pipe)) and getattr(pipe, hook.STATE_ATTR, None) is None
    if denoise == "off":
        assert "nothing wired" in summary and "release_captured_graphs" not in vars(pipe)
    else:  # the default: only the image denoising is wired, with its sleep release
        assert "decode not wired; image denoising: each CFG branch's step replayed" in summary
        assert {"_t2i_predict_v", "_run_denoising_loop", "release_captured_graphs"} <= set(vars(pipe))
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), want)
    assert in_tree_spy == [1] and stats.get(MODEL, "paged_request") == 0


def test_takeover_replaces_the_in_tree_decode_context(tiny, eager_think, in_tree_spy):
    want = eager_think(SHORT)  # the unpatched pipeline's own run (it may call the in-tree path)
    in_tree_spy.clear()
    pipe, summary = _paged_pipeline(tiny)
    assert "in-tree decode context taken over" in summary
    assert pipe._decode_context(None) is None
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), want)
    assert in_tree_spy == [] and stats.get(MODEL, "paged_request") == 1


def test_moved_ar_step_signature_is_refused_and_the_model_left_untouched(tiny):
    base = st.pipeline_module().SenseNovaU1Pipeline

    class MovedPipeline(base):
        def _ar_step(self, token, position, cache):
            return base._ar_step(self, token, position, cache)

    lm = st.build_lm(banned_ids=st.stop_ids(tiny.tok))
    pipe = st.build_pipeline(lm, tiny.tok, cls=MovedPipeline)
    assert hook.find_target(pipe) is pipe
    with pytest.raises(HookRefused, match=r"_ar_step: expected \(self, next_token"):
        hook.install(pipe, _cfg(), None)
    assert not {"_ar_step", "_generate_think", "release_captured_graphs"} & set(vars(pipe))
    assert all("forward_und" not in vars(layer.self_attn) for layer in lm.model.layers)
    # Through the loader the refusal is one WARNING and a counted fallback; the load goes on.
    config.reset_for_tests(_cfg())
    lines = loading.after_load(SimpleNamespace(pipeline=pipe))
    assert lines and "not wired" in lines[0] and "_ar_step" in lines[0]
    fallbacks = stats.fallbacks(MODEL)
    assert sum(fallbacks.values()) == 1 and "_ar_step" in next(iter(fallbacks)) + lines[0]


def test_unknown_attention_layout_is_refused(tiny):
    lm = st.build_lm(banned_ids=st.stop_ids(tiny.tok))
    attn_cls = type(lm.model.layers[0].self_attn)

    class MovedAttention(attn_cls):
        def _project_and_rope(self, hidden_states, rope_tables, *projections):
            raise AssertionError("never called")

    for layer in lm.model.layers:
        layer.self_attn.__class__ = MovedAttention
    pipe = st.build_pipeline(lm, tiny.tok)
    with pytest.raises(HookRefused, match="unknown SenseNova-U1 code layout"):
        hook.install(pipe, _cfg(), None)
    assert "_ar_step" not in vars(pipe)


def test_loader_wires_a_sensenova_pipeline(tiny):
    pipe = st.build_pipeline(tiny.lm, tiny.tok)
    config.reset_for_tests(_cfg())
    lines = loading.after_load(SimpleNamespace(pipeline=pipe))
    assert lines[0].startswith("sensenova_u1: SenseNovaU1Pipeline")
    assert getattr(pipe, hook.STATE_ATTR) is not None
    assert hook.install(pipe, _cfg(), None) == "already wired"


def test_release_captured_graphs_through_the_real_runner_drops_buffers(tiny, eager_think):
    """vllm-omni 0.30's ``DiffusionModelRunner.release_captured_graphs`` (what sleep level 2
    calls) reaches the plugin; the next request allocates anew and still matches."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    if not callable(getattr(DiffusionModelRunner, "release_captured_graphs", None)):
        pytest.skip("this vllm-omni's runner has no release_captured_graphs (0.24-0.28: the "
                    "graph_runners path is tested in test_sensenova_omni028.py)")
    runner = object.__new__(DiffusionModelRunner)
    pipe, _ = _paged_pipeline(tiny, runner=runner)
    runner.pipeline = pipe
    st.run_think(pipe, tiny.ids, SHORT)
    assert _state(pipe).decoder.nbytes > 0
    runner.release_captured_graphs()
    assert _state(pipe).decoder is None
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert _state(pipe).decoder.nbytes > 0


def test_graph_runners_shim_keeps_entries_and_releases_on_clear(tiny):
    """The only call 0.24-0.28 workers make at sleep level 2 is
    ``model_runner.graph_runners.clear()``: it must release the decode graphs and buffers."""
    runner = SimpleNamespace(graph_runners={"existing": 1})
    pipe, _ = _paged_pipeline(tiny, runner=runner)
    assert runner.graph_runners == {"existing": 1}
    st.run_think(pipe, tiny.ids, SHORT)
    assert _state(pipe).decoder.nbytes > 0
    if hasattr(runner, "graph_runners"):  # the worker's own line
        runner.graph_runners.clear()
    assert _state(pipe).decoder is None and runner.graph_runners == {}


def test_a_degraded_graph_path_is_counted_apart_and_warned_once_through_wiring(
        tiny, monkeypatch, stats_warnings):
    """install() selects the fused step's parts; one that cannot run (here: every part, on CPU)
    is a degraded path: counted apart from eager fallbacks, warned once, and the paged path runs."""
    for _ in range(2):
        pipe, summary = _paged_pipeline(tiny)
        st.run_think(pipe, tiny.ids, SHORT)
    lines = stats_warnings
    assert len(lines) == 1 and lines[0].startswith(
        "graphdecode: sensenova_u1 runs the graph path without an optimisation: decode step "
        "unfused (")
    assert "two-kernel K/V write" in lines[0] and hook.UNFUSED.hint in lines[0]
    assert stats.degraded_paths(MODEL) == {f"{MODEL}: {hook.UNFUSED}": 2}
    assert stats.fallbacks(MODEL) == {} and stats.get(MODEL, "paged_request") == 2
    assert "step the model's own" in summary


# ------------------------------------------------------------------ release during a request

def test_release_from_another_thread_waits_for_the_request_in_flight(tiny, eager_think):
    tok = _PausingTokenizer(tiny.tok)
    pipe = st.build_pipeline(tiny.lm, tok)
    hook.install(pipe, _cfg(), None, kernel=kernels.REFERENCE, graphs=False)
    lock = _state(pipe).sessions.lock = common.ObservedLock()
    results, released = {}, threading.Event()
    first = threading.Thread(target=lambda: results.update(a=st.run_think(pipe, tiny.ids, STEPS)))
    tok.thread = first
    first.start()
    assert tok.inside.wait(120), "the request never reached its decode loop"
    sleeper = threading.Thread(target=lambda: (pipe.release_captured_graphs(), released.set()))
    sleeper.start()
    try:
        assert lock.waiting.wait(120), "release did not wait for the request in flight"
        assert not released.is_set()
        assert _state(pipe).decoder is not None
    finally:
        tok.release.set()
        first.join(120)
        sleeper.join(120)
    assert released.is_set() and _state(pipe).decoder is None
    _assert_same_think(results["a"], eager_think(STEPS))
    assert stats.fallbacks(MODEL) == {} and stats.get(MODEL, "paged_eager_step") == STEPS


def test_release_from_inside_the_request_goes_on_with_the_same_step(tiny, eager_think):
    pipe, _ = _paged_pipeline(tiny)
    inner = pipe._ar_step
    calls = []

    def _ar_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:  # e.g. a sleep issued from the worker thread mid-request
            pipe.release_captured_graphs()
        return inner(*args, **kwargs)

    pipe._ar_step = _ar_step
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.RELEASED}": 1}
    assert stats.get(MODEL, "paged_eager_step") == SHORT
    assert stats.get(MODEL, "eager_step") == 0
    # Its buffers went when it ended.
    assert _state(pipe).decoder is None and not _state(pipe).sessions.lock.locked()


# ------------------------------------------------------------------ tiers and accelerate hooks

def test_a_longer_request_keeps_the_pinned_tier_and_the_next_short_one_uses_it(tiny, eager_think):
    pipe, _ = _paged_pipeline(tiny)
    short_ids = st.prompt_ids(tiny.tok, 8, seed=4)
    st.run_think(pipe, short_ids, 10)
    dec = _state(pipe).decoder
    pinned = dec.pinned
    ptrs = [k.data_ptr() for k in pinned.cache.k]
    _assert_same_think(st.run_think(pipe, tiny.ids, STEPS), eager_think(STEPS))  # to 96 tokens
    assert dec.pinned is pinned and [k.data_ptr() for k in pinned.cache.k] == ptrs
    assert pinned.cache.generation == 0 and dec.overflow.cache.capacity == 96
    _assert_same_think(st.run_think(pipe, short_ids, 10), eager_think(10, short_ids))
    assert dec.current is pinned


def test_accelerate_sequential_offload_hook_is_reported_as_offload(tiny, eager_think):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    lm = st.build_lm(banned_ids=st.stop_ids(tiny.tok))
    add_hook_to_module(lm.model.layers[1].mlp, AlignDevicesHook(execution_device="cpu",
                                                                 offload=True))
    pipe, _ = _paged_pipeline(tiny, lm=lm)
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.OFFLOAD}": 1}


def test_removing_an_accelerate_hook_brings_the_fast_path_back(tiny, eager_think):
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    lm = st.build_lm(banned_ids=st.stop_ids(tiny.tok))
    add_hook_to_module(lm.model.layers[0].mlp, ModelHook())
    pipe, _ = _paged_pipeline(tiny, lm=lm)
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.HOOKED}": 1}
    remove_hook_from_module(lm.model.layers[0].mlp)
    assert "forward" in vars(lm.model.layers[0].mlp)  # what removal leaves: the bound forward
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), eager_think(SHORT))
    assert stats.get(MODEL, "paged_request") == 1 and stats.fallbacks(MODEL) == {
        f"{MODEL}: {hook.HOOKED}": 1}


def test_fp8_on_takes_the_in_tree_decode_over_and_counts_why_it_runs_bf16_here(
        tiny, eager_think, in_tree_spy):
    """With FP8 weights asked for, 0.30's in-tree decode (which has none) stands aside under the
    default ``defer``; on a CPU the copies cannot run, so the step reads bf16, counted."""
    want = eager_think(SHORT)
    in_tree_spy.clear()
    pipe, summary = _paged_pipeline(tiny, cfg=_cfg(VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE="defer",
                                                   VLLM_OMNI_GRAPHDECODE_FP8="on"))
    assert "in-tree decode context taken over (FP8 weights run in this plugin's step only)" \
        in summary
    assert stats.degraded_paths(MODEL)[f"{MODEL}: FP8 weights unavailable"] == 1
    _assert_same_think(st.run_think(pipe, tiny.ids, SHORT), want)
    assert in_tree_spy == [] and stats.get(MODEL, "paged_request") == 1


def test_fp8_with_the_exact_step_is_counted_as_running_bf16(tiny):
    _, summary = _paged_pipeline(tiny, cfg=_cfg(VLLM_OMNI_GRAPHDECODE_FP8="sensenova_decode",
                                                VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP="exact"))
    assert "FP8" not in summary
    assert stats.degraded_paths(MODEL)[f"{MODEL}: FP8 weights need the fused step"] == 1
    assert f"{MODEL}: FP8 weights unavailable" not in stats.degraded_paths(MODEL)
