"""SenseNova-U1 requests decoding together (issue #22), on CPU.

The mechanism modules (``turns``, ``batch_kv``, ``batch_decode``) are tested alone, then the
whole path on vllm-omni's real ``SenseNovaU1Pipeline`` built from the tiny checkpoint
(``examples/make_tiny_checkpoints.py``, fp32): ``pipeline.forward`` is called with a real
``DiffusionRequestBatch`` of real ``OmniDiffusionRequest``s, as vLLM-Omni's runner calls it.
On CPU the batched step runs eagerly with ``batch_kv.REFERENCE`` as its attention (graphs and
vLLM's Triton kernel: ``tests/test_sensenova_batch_gpu.py``); every other part is the production
code. Nothing here waits on time: threads meet through events and the turns themselves.
"""

import threading
from multiprocessing.shared_memory import SharedMemory
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import loading, reasons, stats
from vllm_omni_graphdecode.decode import sampling
from vllm_omni_graphdecode.decode.batch import decoder as batch_decode, kv as batch_kv, turns
from vllm_omni_graphdecode.graphs.capture import CaptureFailed
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import batch as batch_mod
from vllm_omni_graphdecode.testing import sensenova as rm

from test_sensenova_denoise import checkpoint  # noqa: F401 - the tiny checkpoint fixture

MODEL = hook.MODEL


# ------------------------------------------------------------------ turns

def test_members_run_one_at_a_time_and_meet_in_the_idle_work():
    events, running, most = [], [0], [0]
    ready = [False] * 3
    lock = threading.Lock()

    def section(name):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        events.append(name)
        with lock:
            running[0] -= 1

    def idle():
        events.append("idle")
        ready[:] = [True] * 3

    group = turns.Turns(idle)

    def member(i):
        def body():
            section(f"start {i}")
            group.wait_until(lambda: ready[i])
            section(f"resume {i}")
            return i
        return body

    assert group.run([member(i) for i in range(3)]) == [0, 1, 2]
    assert events == ["start 0", "start 1", "start 2", "idle", "resume 0", "resume 1",
                      "resume 2"]
    assert most[0] == 1


def test_a_member_that_raises_ends_alone():
    group = turns.Turns(lambda: None)

    def bad():
        raise ValueError("this request only")

    results = group.run([lambda: "a", bad, lambda: "c"])
    assert results[0] == "a" and results[2] == "c"
    assert isinstance(results[1], ValueError)


def test_idle_work_that_frees_nobody_fails_the_waiters_instead_of_hanging():
    group = turns.Turns(lambda: None)
    results = group.run([lambda: group.wait_until(lambda: False), lambda: "done"])
    assert isinstance(results[0], turns.Stuck) and results[1] == "done"


def test_wait_until_outside_a_member_is_refused():
    with pytest.raises(RuntimeError, match="outside"):
        turns.Turns(lambda: None).wait_until(lambda: True)


# ------------------------------------------------------------------ batch K/V

def _kv(rows=3, blocks=8, width=4, layers=2, kv_heads=2, head_dim=8):
    return batch_kv.BatchKV(layers, kv_heads, head_dim, 4, rows=rows, dtype=torch.float32,
                            device="cpu", attention=batch_kv.REFERENCE, blocks=blocks)


def _cache(layers, kv_heads, length, head_dim, seed):
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for i in range(layers):
        cache.update(torch.randn(1, kv_heads, length, head_dim, generator=gen),
                     torch.randn(1, kv_heads, length, head_dim, generator=gen), i)
    return cache


def test_rows_keep_their_tokens_when_the_pool_grows():
    kv = _kv()
    kv.grow(kv.num_blocks, width=4)
    caches = [_cache(2, 2, n, 8, seed) for seed, n in enumerate((20, 5, 33))]
    for row, cache in enumerate(caches):
        assert kv.reserve(row, cache.layers[0].keys.shape[2])
        kv.load(row, cache)
    generation = kv.generation
    kv.grow(kv.num_blocks * 2)
    assert kv.generation == generation + 1
    for row, cache in enumerate(caches):
        out = _cache(2, 2, 1, 8, 99)
        kv.write_back(row, out)
        for a, b in zip(out.layers, cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_rows_attention_does_not_depend_on_the_other_rows():
    kv = _kv(blocks=16)
    kv.grow(kv.num_blocks, width=4)
    for row, n in enumerate((20, 5, 33)):
        kv.reserve(row, n)
        kv.load(row, _cache(2, 2, n, 8, row))
    q = torch.randn(3, 4, 8)

    def attend():
        kv.load_lengths(torch.tensor([20, 5, 33], dtype=torch.int32),
                        torch.tensor([1, 1, 1], dtype=torch.int32))
        return kv.attention(q, kv.k[0], kv.v[0], table=kv.table, seqused=kv.seqused, scale=0.3,
                            scratch=kv.scratch)

    first = attend()
    kv.k[0][kv.row_blocks[1]] = torch.randn_like(kv.k[0][kv.row_blocks[1]])
    second = attend()
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2])
    assert not torch.equal(first[1], second[1])


# ------------------------------------------------------------------ the batch decoder's rows

class _PositionModel:
    """A ``BatchStepModel`` whose next token is a function of the fed token and its position
    (it reads no K/V): a token decoded for another position shows in the answer."""

    VOCAB = 97

    def __init__(self, rows):
        self.rows = rows
        self.tokens = torch.zeros(rows, dtype=torch.long)
        self.positions = torch.zeros(rows, dtype=torch.long)

    @staticmethod
    def follows(token, position):
        return (7 * token + 3 * position + 1) % _PositionModel.VOCAB

    def load_inputs(self, tokens, positions):
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)

    def advance(self, tokens, active):
        self.tokens.copy_(tokens)
        self.positions.add_(active)

    def forward(self, cache):
        return torch.nn.functional.one_hot(self.follows(self.tokens, self.positions),
                                           self.VOCAB).float()


@pytest.mark.parametrize("jump", [3, -1])
def test_a_row_fed_the_devices_token_at_another_position_gets_that_positions_token(jump):
    """A row is served from the last launch only when its loop feeds the token the device fed
    at the position the device fed it; the same token at another position launches again."""
    follows = _PositionModel.follows
    decoder = batch_decode.BatchDecoder(_PositionModel(2), _kv(rows=2, blocks=16), name="rows",
                                        k=4, graphs=False)
    row = decoder.join(_cache(2, 2, 5, 8, seed=0))
    first = row.next(11, 5)
    second = row.next(first, 6)
    assert (first, second) == (follows(11, 5), follows(first, 6))
    assert stats.get("rows", "batch_launch") == 1  # the second was served from the launch
    assert row.next(second, 7 + jump) == follows(second, 7 + jump)
    assert stats.get("rows", "batch_launch") == 2


# ------------------------------------------------------------------ the device's draws

def test_draws_follow_softmax_at_the_temperature_and_not_at_twice_it():
    scipy_stats = pytest.importorskip("scipy.stats")
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 4000
    temperature = 0.7
    seeds = torch.arange(n, dtype=torch.long)
    tokens = [int(sampling.choose(logits, torch.tensor([temperature]), seeds[i:i + 1],
                                  torch.tensor([7]), True)[0]) for i in range(n)]
    counts = np.bincount(tokens, minlength=5)

    def p_value(t):
        p = torch.softmax(logits[0].double() / t, -1).numpy()
        return scipy_stats.chisquare(counts, p / p.sum() * n).pvalue

    assert p_value(temperature) > 1e-6
    assert p_value(2 * temperature) < 1e-6


def test_a_rows_draw_depends_on_its_seed_and_position_only():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    temps = torch.tensor([0.8, 0.0, 1.2, 0.8])
    seeds = torch.tensor([3, 4, 5, 6])
    positions = torch.tensor([10, 11, 12, 13])
    out = sampling.choose(logits, temps, seeds, positions, True)
    # Row 0 alone, its neighbours gone: the same token.
    alone = sampling.choose(logits[:1], temps[:1], seeds[:1], positions[:1], True)
    assert int(alone[0]) == int(out[0])
    assert int(out[1]) == int(logits[1].argmax())  # temperature 0: the loop's argmax
    u = sampling.uniform(torch.tensor([3, 3, 4]), torch.tensor([10, 11, 10]), 1000)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert float(u.min()) > 0 and float(u.max()) < 1


@pytest.mark.parametrize("params,think,want", [
    ({"t_idx": 3, "max_think_tokens": 64}, True, sampling.RowSampling()),  # think: argmax
    ({"do_sample": False, "temperature": 0.7}, False, sampling.RowSampling()),
    ({"do_sample": True, "temperature": 0.0}, False, sampling.RowSampling()),
    ({"do_sample": True, "temperature": 0.7}, False, sampling.RowSampling(0.7, 0)),
    ({"do_sample": True, "temperature": torch.tensor(0.7)}, False, reasons.ARGUMENTS),
    ({"do_sample": True, "temperature": True}, False, reasons.ARGUMENTS),
    (None, False, reasons.ARGUMENTS),  # the text loop's arguments could not be bound
    (None, True, sampling.RowSampling()),
    # a parameter the device-side choice does not implement: the loop's own picks
    ({"do_sample": True, "temperature": 0.7, "top_k": 5}, False, batch_mod.UNKNOWN_LOOP_PARAMS),
    ({"do_sample": False, "temperature": 0.7, "top_p": 0.9}, False,
     batch_mod.UNKNOWN_LOOP_PARAMS),
    ({"max_think_tokens": 64, "repetition_penalty": 1.1}, True, batch_mod.UNKNOWN_LOOP_PARAMS),
])
def test_a_text_loop_whose_sampling_cannot_be_read_is_not_served_argmax_tokens(params, think,
                                                                               want):
    """The batch serves a row its argmax or its own seeded draw; a loop whose sampling it cannot
    read runs eagerly (its own draws) under ARGUMENTS, and one with a parameter the choice does
    not implement under UNKNOWN_LOOP_PARAMS, instead of being served tokens it might not pick."""
    got = batch_mod.sampling_for(params, think)
    if isinstance(want, reasons.Reason):
        assert isinstance(got, reasons.Reason) and want.same(got), got
    else:
        assert got == want


# ------------------------------------------------------------------ the pipeline's forward

def _cfg(**env):
    values = {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
              "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "off",
              "VLLM_OMNI_GRAPHDECODE_BUCKETS": "64,128",
              "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "64",
              "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": "4"}
    values.update(env)
    return config.parse(values)


def _pipeline(checkpoint, cfg=None, rows=4, **install):
    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=torch.float32)
    if cfg is not False:
        install.setdefault("batch_attention", batch_kv.REFERENCE)
        install.setdefault("graphs", False)
        install.setdefault("image_graphs", False)
        hook.install(pipe, cfg or _cfg(), None, rows=rows, **install)
    return pipe


def _request(i, prompt, *, text=None, think=False, **extra):
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    if text is not None:
        params = OmniDiffusionSamplingParams(seed=i, extra_args={"max_tokens": text, **extra})
        prompt = {"prompt": prompt, "modalities": ["text"]}
    else:
        params = OmniDiffusionSamplingParams(seed=i, height=64, width=64, num_inference_steps=2,
                                             extra_args={"think": think, **extra})
        prompt = {"prompt": prompt}
    return OmniDiffusionRequest(prompt=prompt, sampling_params=params, request_id=f"req-{i}")


def _batch(requests):
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    return DiffusionRequestBatch(list(requests))


def _answer(out):
    """A request's answer: its text, or its image (and think text)."""
    assert out.error is None and not out.aborted, (out.error, out.abort_message)
    payload = out.output["payload"]
    if "text" in payload:
        return payload["text"]
    think = (out.output.get("metadata") or {}).get("text", {}).get("think_text", "")
    return (np.asarray(payload["image"]).tobytes(), think)


TEXTS = [("a red cube on a table", 24), ("two cats and a dog in the rain", 37),
         ("x", 17)]


def _text_requests(offset=0):
    return [_request(offset + i, p, text=n) for i, (p, n) in enumerate(TEXTS)]


def test_requests_of_one_batch_answer_as_each_alone_and_as_the_release(checkpoint):
    """Greedy text answers, a sampled one, a think image and a plain image in one forward: each
    equals the same request alone (a batch of one, the same path) exactly; the greedy text
    answers, the think text and the plain image equal the pipeline's own (fp32, the reference
    attention against its SDPA), and the think image is close to its own (bound below)."""
    requests = _text_requests() + [
        _request(3, "a sampled answer", text=20, do_sample=True, temperature=0.8),
        _request(4, "a think image of a boat", think=True),
        _request(5, "a plain image of a tree")]
    release = _pipeline(checkpoint, cfg=False)
    want = [_answer(release.forward(_batch([r]))) for r in requests]
    pipe = _pipeline(checkpoint, rows=8)
    together = [_answer(o) for o in pipe.forward(_batch(requests))]
    rows, launches = stats.get(MODEL, "batch_rows"), stats.get(MODEL, "batch_launch")
    alone = [_answer(pipe.forward(_batch([r]))) for r in requests]
    assert together == alone
    for i in (0, 1, 2, 5):  # greedy: the release's answer
        assert together[i] == want[i], f"request {i}"
    (image, think), (want_image, want_think) = together[4], want[4]
    assert think and think == want_think
    # The batched 16-row step rounds the think tokens' K/V unlike the release's one-row step,
    # and the image is denoised over them. Measured on CPU over seeds 0-23: at most 1 level in
    # at most 3 of the 12,288 values. The bound leaves room for another CPU; a wrong image (the
    # plain one against it) differs by up to 255 levels, 50-61 on average.
    diff = np.abs(np.frombuffer(image, np.uint8).astype(int)
                  - np.frombuffer(want_image, np.uint8).astype(int))
    assert diff.size == 64 * 64 * 3
    assert diff.max() <= 2 and np.count_nonzero(diff) <= diff.size // 100, (
        diff.max(), np.count_nonzero(diff))
    assert rows > launches, "the loops never decoded in one launch"
    assert stats.fallbacks(MODEL) == {}
    assert stats.get(MODEL, "batch_requests") == 2 * len(requests)


def test_a_sampled_answer_depends_on_its_seed_not_on_its_batch(checkpoint):
    pipe = _pipeline(checkpoint)
    sampled = _request(7, "tell me a story", text=25, do_sample=True, temperature=0.9)
    other_seed = _request(8, "tell me a story", text=25, do_sample=True, temperature=0.9)
    alone = _answer(pipe.forward(_batch([sampled])))
    torch.manual_seed(123)  # the process's generator plays no part
    together = [_answer(o) for o in pipe.forward(_batch(_text_requests() + [sampled]))]
    assert together[-1] == alone
    assert _answer(pipe.forward(_batch([other_seed]))) != alone


def test_a_text_loop_with_a_tensor_temperature_decodes_eagerly_as_the_release(checkpoint,
                                                                            monkeypatch):
    """A caller handing the text loop a temperature that is not a number: the batch does not
    serve it (it could not draw as the loop does); the loop runs its own code, the same draws as
    the release from the same generator state, and ARGUMENTS is counted."""
    def tensor_temperature(pipe):
        loop = pipe._generate_text

        def generate(*args, **kwargs):
            kwargs["temperature"] = torch.tensor(kwargs["temperature"])
            return loop(*args, **kwargs)
        monkeypatch.setattr(pipe, "_generate_text", generate)
        return pipe

    request = _request(9, "tell me a story", text=20, do_sample=True, temperature=0.9)
    release = tensor_temperature(_pipeline(checkpoint, cfg=False))
    torch.manual_seed(5)
    want = _answer(release.forward(_batch([request])))
    pipe = tensor_temperature(_pipeline(checkpoint))
    torch.manual_seed(5)
    got = _answer(pipe.forward(_batch([request])))
    assert got == want
    assert reasons.ARGUMENTS.key in {k.split(": ", 1)[1] for k in stats.fallbacks(MODEL)}
    assert stats.get(MODEL, "batch_launch") == 0


def test_more_requests_than_rows_run_in_turns_of_rows(checkpoint):
    pipe = _pipeline(checkpoint, rows=2)
    requests = _text_requests()
    together = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert together == [_answer(pipe.forward(_batch([r]))) for r in requests]


def test_a_failing_request_returns_its_error_and_the_others_go_on(checkpoint, monkeypatch):
    pipe = _pipeline(checkpoint)
    requests = _text_requests()
    want = [_answer(pipe.forward(_batch([r]))) for r in requests]
    real = pipe._forward_text

    def forward_text(p, images):
        if p.prompt == TEXTS[1][0]:
            raise RuntimeError("this request's own failure")
        return real(p, images)

    monkeypatch.setattr(pipe, "_forward_text", forward_text)
    outs = pipe.forward(_batch(requests))
    assert "this request's own failure" in outs[1].error
    assert [_answer(outs[0]), _answer(outs[2])] == [want[0], want[2]]


def test_a_cancelled_request_leaves_the_batch_and_the_others_go_on(checkpoint, monkeypatch):
    pipe = _pipeline(checkpoint)
    requests = _text_requests()
    want = [_answer(pipe.forward(_batch([r]))) for r in requests]
    signal = SharedMemory(create=True, size=1)
    try:
        signal.buf[0] = 0
        requests[1].cancellation_signal = signal.name
        served = {"n": 0}
        real = batch_mod.RowSession.decode

        def decode(self, token, position):
            if self.request is requests[1]:
                served["n"] += 1
                if served["n"] == 5:
                    signal.buf[0] = 1  # the engine aborts it mid-decode
            return real(self, token, position)

        monkeypatch.setattr(batch_mod.RowSession, "decode", decode)
        outs = pipe.forward(_batch(requests))
    finally:
        signal.close()
        signal.unlink()
    assert outs[1].aborted
    assert [_answer(outs[0]), _answer(outs[2])] == [want[0], want[2]]
    assert not any(r is not None for r in getattr(pipe, hook.STATE_ATTR).batch.decoder.rows)


def test_a_row_without_room_even_alone_is_handed_back_and_finishes_eagerly(checkpoint, monkeypatch):
    pipe = _pipeline(checkpoint)
    requests = _text_requests()
    want = [_answer(pipe.forward(_batch([r]))) for r in requests]
    decoder = getattr(pipe, hook.STATE_ATTR).batch.decoder

    def grow(blocks, width=None):
        raise torch.OutOfMemoryError("no room for the batch (test)")

    monkeypatch.setattr(decoder.cache, "grow", grow)
    monkeypatch.setattr(decoder.cache, "free", decoder.cache.free[:3])
    outs = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert outs == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.OOM}", 0) >= 1


def test_release_mid_batch_lets_the_rows_go_on_and_the_next_forward_batches_again(
        checkpoint, monkeypatch):
    pipe = _pipeline(checkpoint)
    requests = _text_requests()
    want = [_answer(pipe.forward(_batch([r]))) for r in requests]
    real = batch_mod.RowSession.decode
    calls = {"n": 0}

    def decode(self, token, position):
        calls["n"] += 1
        if calls["n"] == 12:  # sleep level 2 from inside the worker, mid-batch
            pipe.release_captured_graphs()
        return real(self, token, position)

    monkeypatch.setattr(batch_mod.RowSession, "decode", decode)
    outs = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert outs == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.RELEASED}", 0) >= 1
    decoder = getattr(pipe, hook.STATE_ATTR).batch.decoder
    assert decoder.cache.num_blocks == 0  # dropped once the last row left
    monkeypatch.setattr(batch_mod.RowSession, "decode", real)
    launches = stats.get(MODEL, "batch_launch")
    assert [_answer(o) for o in pipe.forward(_batch(requests))] == want
    assert stats.get(MODEL, "batch_launch") > launches and decoder.cache.num_blocks > 0


@pytest.mark.parametrize("failing", [1, 2])
def test_a_failed_capture_lets_the_rows_go_on_with_their_tokens(checkpoint, monkeypatch, failing):
    """The batch's ``failing``-th launch fails its capture: the first, or the second, after the
    first served tokens (each row goes on without graphs from exactly the tokens it was fed)."""
    pipe = _pipeline(checkpoint)
    requests = _text_requests()
    want = [_answer(pipe.forward(_batch([r]))) for r in requests]
    real, calls = batch_decode.BatchProgram.run, []

    def run(self, *, graphs):
        calls.append(1)
        if len(calls) == failing:
            raise CaptureFailed("RuntimeError: capture failed (test)")
        return real(self, graphs=graphs)

    monkeypatch.setattr(batch_decode.BatchProgram, "run", run)
    outs = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert outs == want
    key = f"{MODEL}: {reasons.CAPTURE_FAILED}"
    assert stats.fallbacks(MODEL).get(key, 0) == len(requests)


def test_a_refused_pipeline_answers_every_request_eagerly_with_the_reason(checkpoint):
    pipe = _pipeline(checkpoint)
    requests = _text_requests()
    release = _pipeline(checkpoint, cfg=False)
    want = [_answer(release.forward(_batch([r]))) for r in requests]
    pipe.od_config.enable_cpu_offload = True
    outs = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert outs == want
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {hook.OFFLOAD}": 1}
    assert stats.get(MODEL, "batch_launch") == 0


# ------------------------------------------------------------------ the engine's declaration

def _engine_mode(od_config):
    """What vLLM-Omni's engine decides at start-up for this config (its own code)."""
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    engine = SimpleNamespace()
    return DiffusionEngine._resolve_execution_mode(engine, od_config)


def _od_config(checkpoint, max_num_seqs):
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    return OmniDiffusionConfig(model=checkpoint, model_class_name="SenseNovaU1Pipeline",
                               max_num_seqs=max_num_seqs)


@pytest.fixture
def pipeline_class(monkeypatch):
    """The real pipeline class, restored after the test (the declaration is process-wide)."""
    cls = rm.pipeline_module().SenseNovaU1Pipeline
    forward = cls.forward
    while getattr(forward, "__graphdecode__", False):  # declared by an earlier test's register()
        forward = forward.__wrapped__
    monkeypatch.setattr(cls, "forward", forward)
    monkeypatch.setattr(cls, "supports_request_batch", False, raising=False)
    return cls


def test_the_engine_refuses_max_num_seqs_without_the_plugin_and_accepts_it_with(
        checkpoint, pipeline_class):
    od = _od_config(checkpoint, 8)
    with pytest.raises(ValueError, match="does not support request-level batching"):
        _engine_mode(od)
    # What register() does where the engine starts, less the runner patch (tests/test_plugin.py)
    loading.install_model_hooks(config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1"}))
    assert pipeline_class.supports_request_batch is True
    assert _engine_mode(od).name == "REQUEST_BATCH"
    assert stats.get(MODEL, "batch_declared") == 1


@pytest.mark.parametrize("env", [{"VLLM_OMNI_GRAPHDECODE": "qwen_image_21"},
                                 {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                                  "VLLM_OMNI_GRAPHDECODE_SENSENOVA_BATCH": "off"}],
                         ids=["not_named", "batch_off"])
def test_the_engine_still_refuses_when_the_plugin_will_not_batch_sensenova(
        checkpoint, pipeline_class, env):
    loading.install_model_hooks(config.parse(env))
    assert pipeline_class.supports_request_batch is False
    with pytest.raises(ValueError, match="does not support request-level batching"):
        _engine_mode(_od_config(checkpoint, 8))


def test_on_a_release_that_loses_batched_outputs_the_engine_still_refuses_with_the_reason(
        checkpoint, pipeline_class, monkeypatch):
    """vllm-omni 0.26's executor can lose a request batch's outputs (``batch.py``,
    ``ENGINE_LOSES_BATCHES``): there the plugin declares nothing and says why; 0.28 and 0.30 are
    safe."""
    from vllm_omni_graphdecode.core import patching

    assert batch_mod.engine_loses_batches("0.28.0") is None
    assert batch_mod.engine_loses_batches("0.30.0") is None
    monkeypatch.setattr(patching, "omni_version", lambda: "0.26.0")
    loading.install_model_hooks(config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1"}))
    assert pipeline_class.supports_request_batch is False
    with pytest.raises(ValueError, match="does not support request-level batching"):
        _engine_mode(_od_config(checkpoint, 8))
    assert stats.get(MODEL, "batch_declared") == 0
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {batch_mod.ENGINE_LOSES_BATCHES.key}": 1}


def test_a_declared_pipeline_the_plugin_did_not_wire_answers_a_batch_one_by_one(
        checkpoint, pipeline_class):
    assert "declared" in batch_mod.declare(pipeline_class)
    pipe = _pipeline(checkpoint, cfg=False)
    requests = _text_requests()
    outs = pipe.forward(_batch(requests))
    assert [_answer(o) for o in outs] == [_answer(pipe.forward(_batch([r]))) for r in requests]
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {batch_mod.NOT_WIRED}": 1}


def test_rows_follow_the_engines_max_num_seqs_capped_at_16():
    runner = SimpleNamespace(od_config=SimpleNamespace(max_num_seqs=8))
    assert batch_mod.engine_rows(runner, _cfg()) == 8
    runner.od_config.max_num_seqs = 64
    assert batch_mod.engine_rows(runner, _cfg()) == 16
    assert batch_mod.engine_rows(runner, _cfg(VLLM_OMNI_GRAPHDECODE_SENSENOVA_BATCH="off")) == 1
    assert batch_mod.engine_rows(None, _cfg()) == 1
