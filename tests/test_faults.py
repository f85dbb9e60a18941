"""Faults lose nothing (issue #39), on CPU: vllm-omni's real SenseNova-U1 pipeline from the tiny
checkpoint, fp32, the batched decode with the reference attention and the one-request decode with
the reference kernel.

Each test forces one fault in the middle of real requests and compares every answer with the same
request run without it:

* batched rows without room (at join, or to grow) wait or are swapped out to host memory, and
  answer exactly as with room; a row that cannot have room even alone is handed back and
  finishes on the pipeline's eager path, a sampled one still drawing from its own stream;
* a refused batch still draws a sampled answer from the request's own stream;
* a release (sleep level 2) or a failed capture in the middle of a batch or of a one-request
  decode: the rows go on with the same step without graphs and answer exactly as without it.

The GPU file (tests/test_faults_gpu.py) forces the same faults in bf16 with CUDA graphs, where a
device mix-up can show. docs/faults.md lists what each fault injects and what the request gets.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import reasons, stats
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import batch as batch_mod
from vllm_omni_graphdecode.hooks.sensenova_u1 import rules as hook_rules
from vllm_omni_graphdecode.ops import attention as kernels
from vllm_omni_graphdecode.testing import sensenova as rm

from test_sensenova_batch import _answer, _batch, _pipeline, _request  # noqa: F401
from test_sensenova_denoise import checkpoint  # noqa: F401 - the tiny checkpoint fixture

MODEL = hook.MODEL


def _texts(offset=0, sampled=False):
    texts = [("a red cube on a table", 24), ("two cats and a dog in the rain", 37),
             ("x", 17), ("a boat on a lake at night", 30)]
    out = [_request(offset + i, p, text=n) for i, (p, n) in enumerate(texts)]
    if sampled:
        out.append(_request(offset + 9, "tell me a story", text=28, do_sample=True,
                            temperature=0.9))
    return out


def _alone(pipe, requests):
    return [_answer(pipe.forward(_batch([r]))) for r in requests]


def _no_room(monkeypatch, decoder, free_blocks):
    """The pool cannot grow (out of memory) and holds only ``free_blocks`` free blocks."""
    def grow(blocks, width=None):
        raise torch.OutOfMemoryError("CUDA out of memory: no room for the batch (test)")

    monkeypatch.setattr(decoder.cache, "grow", grow)
    monkeypatch.setattr(decoder.cache, "free", decoder.cache.free[:free_blocks])


def _decoder(pipe):
    return getattr(pipe, hook.STATE_ATTR).batch._decoder()


# ------------------------------------------------------------------ no room in the batch's pool


def test_rows_without_room_to_grow_wait_or_are_swapped_and_answer_as_with_room(checkpoint,
                                                                                monkeypatch):
    """Nine free blocks for four rows that end needing 3-5 each: rows wait for room and, when
    none of them has it, the youngest are swapped out to host memory and back. Every answer is
    its answer with room; no row decodes on the eager path."""
    pipe = _pipeline(checkpoint)
    requests = _texts()
    want = _alone(pipe, requests)
    _no_room(monkeypatch, _decoder(pipe), 9)
    got = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert got == want
    assert stats.get(MODEL, "batch_row_swapped") >= 1
    assert stats.get(MODEL, "batch_row_waited") >= 1
    assert stats.get(MODEL, "eager_step") == 0
    assert f"{MODEL}: {reasons.OOM}" not in stats.fallbacks(MODEL)
    assert stats.degraded_paths(MODEL).get(f"{MODEL}: {reasons.OOM}", 0) >= 1
    decoder = _decoder(pipe)
    assert all(r is None for r in decoder.rows)
    assert sorted(decoder.cache.free) == sorted(set(decoder.cache.free)), "a block freed twice"


def test_a_row_joining_without_room_waits_for_another_to_leave(checkpoint, monkeypatch):
    """Six free blocks: room for the longer request alone (prompt 49 + 37 tokens + a launch),
    not for both at their first launch: the second waits at join until the first leaves, then
    decodes with the same tokens."""
    pipe = _pipeline(checkpoint)
    requests = _texts()[:2]
    want = _alone(pipe, requests)
    _no_room(monkeypatch, _decoder(pipe), 6)
    got = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert got == want
    assert stats.get(MODEL, "batch_row_waited") >= 1
    assert stats.get(MODEL, "eager_step") == 0


def test_a_row_without_room_even_alone_is_handed_back_and_draws_from_its_own_stream(
        checkpoint, monkeypatch):
    """Two free blocks: no row can grow past 32 tokens, even alone. Each is handed back (counted)
    and finishes on the pipeline's eager path from the tokens it has: the greedy ones as the
    release answers (fp32: the eager step rounds as the batch's), the sampled one from its own
    seeded stream, whatever the process's generator holds."""
    pipe = _pipeline(checkpoint)
    requests = _texts(sampled=True)
    want = _alone(pipe, requests)
    _no_room(monkeypatch, _decoder(pipe), 2)
    torch.manual_seed(1234)
    got = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert got == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.OOM}", 0) == len(requests)
    assert stats.get(MODEL, "eager_step") > 0


# ------------------------------------------------------------------ a refused batch


def test_a_refused_batch_draws_a_sampled_answer_from_its_own_stream(checkpoint):
    """A forward hook on the language model refuses the batch (HOOKS): every loop decodes on
    the pipeline's eager path, and the sampled one draws as it would in the batch, from its own
    stream: the same answer whatever the process's generator holds."""
    pipe = _pipeline(checkpoint)
    requests = _texts(sampled=True)
    want = _alone(pipe, requests)
    handle = pipe.language_model.register_forward_hook(lambda module, args, out: None)
    try:
        answers = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            answers.append([_answer(o) for o in pipe.forward(_batch(requests))])
    finally:
        handle.remove()
    assert answers[0] == answers[1] == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {hook_rules.HOOKED}", 0) == 2
    assert stats.get(MODEL, "eager_step") > 0


def test_a_loop_with_a_sampling_parameter_the_plugin_does_not_know_runs_its_own_code(
        checkpoint, monkeypatch):
    """The text loop gains ``top_k`` (applied to its logits before drawing). The device-side
    choice does not implement it: the loop runs its own code over the model's logits, the
    release's draws from the same generator state, with the reason counted, in the batch and on
    the one-request path."""
    from vllm_omni.diffusion.models.sensenova_u1 import pipeline_sensenova_u1 as module

    cls = module.SenseNovaU1Pipeline
    real = cls._generate_text

    def generate_text(self, prefix_logits, past_key_values, t_idx, max_tokens=512,
                      do_sample=False, temperature=0.7, top_k=3):
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = []
        logits = prefix_logits[:, -1, :]
        for _ in range(max_tokens):
            top = torch.topk(logits, top_k, dim=-1)
            probs = torch.softmax(top.values / temperature, dim=-1)
            token = top.indices.gather(-1, torch.multinomial(probs, 1)).squeeze(-1)
            if token.item() == eos:
                break
            ids.append(token.item())
            logits = self._ar_step(token, t_idx, past_key_values).logits[:, -1, :]
            t_idx += 1
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    monkeypatch.setattr(cls, "_generate_text", generate_text)
    request = _request(5, "tell me a story", text=30, do_sample=True, temperature=0.9)
    release = _pipeline(checkpoint, cfg=False)
    torch.manual_seed(7)
    want = _answer(release.forward(_batch([request])))
    batched = _pipeline(checkpoint)
    torch.manual_seed(7)
    assert _answer(batched.forward(_batch([request]))) == want
    key = f"{MODEL}: {batch_mod.UNKNOWN_LOOP_PARAMS}"
    assert stats.fallbacks(MODEL).get(key) == 1
    assert stats.get(MODEL, "batch_launch") == 0
    one = _one_request_pipeline(checkpoint)
    torch.manual_seed(7)
    assert _answer(one.forward(_batch([request]))) == want
    assert stats.degraded_paths(MODEL).get(key) == 1
    assert stats.get(MODEL, "token_launch") == 0
    monkeypatch.setattr(cls, "_generate_text", real)


# ------------------------------------------------------------------ release and failed capture


def _release_at(monkeypatch, pipe, call):
    """Sleep level 2 from inside the worker at the ``call``-th token a row is served."""
    real = batch_mod.RowSession.decode
    calls = {"n": 0}

    def decode(self, token, position):
        calls["n"] += 1
        if calls["n"] == call:
            pipe.release_captured_graphs()
        return real(self, token, position)

    monkeypatch.setattr(batch_mod.RowSession, "decode", decode)
    return calls


def test_a_release_mid_batch_lets_greedy_sampled_and_think_rows_go_on_unchanged(checkpoint,
                                                                                 monkeypatch):
    """``release_captured_graphs`` (sleep level 2) after a dozen tokens: every row goes on with
    the same step without graphs (the same kernels), so every answer, the think request's image
    included, is its answer without the release; the buffers go when the last row leaves."""
    pipe = _pipeline(checkpoint, rows=8)
    requests = _texts(sampled=True) + [_request(8, "a think image of a boat", think=True)]
    want = _alone(pipe, requests)
    _release_at(monkeypatch, pipe, 12)
    got = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert got == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.RELEASED}", 0) >= 2
    assert stats.get(MODEL, "eager_step") == 0
    decoder = getattr(pipe, hook.STATE_ATTR).batch.decoder
    assert decoder.cache.num_blocks == 0  # dropped once the last row left


@pytest.mark.parametrize("failing", [1, 3])
def test_a_failed_capture_mid_batch_lets_the_rows_go_on_without_graphs_until_a_release(
        checkpoint, monkeypatch, failing):
    """Launches ask for graphs from the ``failing``-th on (the first, or one after tokens were
    served), and capture fails (no CUDA here: a real failed capture, repaired): that launch runs
    without a graph, and so does every later one, this forward's and the next's, until a release
    lets capture try again. Every answer is its answer without it."""
    from vllm_omni_graphdecode.decode.batch import decoder as batch_decode

    pipe = _pipeline(checkpoint)
    requests = _texts(sampled=True)
    want = _alone(pipe, requests)
    decoder = _decoder(pipe)
    real_run, real_launch = batch_decode.BatchProgram.run, batch_decode.BatchDecoder._run
    asked, launches = [], []

    def run(self, *, graphs):
        asked.append(graphs)
        return real_run(self, graphs=graphs)

    def launch(self, rows):
        launches.append(1)
        if len(launches) == failing:
            self.graphs = True  # as on a GPU
        return real_launch(self, rows)

    monkeypatch.setattr(batch_decode.BatchProgram, "run", run)
    monkeypatch.setattr(batch_decode.BatchDecoder, "_run", launch)
    got = [_answer(o) for o in pipe.forward(_batch(requests))]
    assert got == want
    key = f"{MODEL}: {reasons.CAPTURE_FAILED}"
    assert stats.fallbacks(MODEL).get(key) == len(requests)
    assert decoder.capture_failed is not None
    assert asked.count(True) == 1, "a launch asked for a graph after the failure"
    assert stats.get(MODEL, "eager_step") == 0
    # The next forward: still without graphs, counted again for its rows.
    assert [_answer(o) for o in pipe.forward(_batch(requests))] == want
    assert stats.fallbacks(MODEL).get(key) == 2 * len(requests)
    assert asked.count(True) == 1
    pipe.release_captured_graphs()
    assert decoder.capture_failed is None


# ------------------------------------------------------------------ the one-request path


def _one_request_pipeline(checkpoint, graphs=False, **env):
    pipe = rm.load_sensenova_pipeline(checkpoint, dtype=torch.float32)
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "off",
                        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
                        "VLLM_OMNI_GRAPHDECODE_BUCKETS": "32,64,128",
                        "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "32",
                        "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": "4", **env})
    hook.install(pipe, cfg, None, kernel=kernels.REFERENCE, graphs=graphs, image_graphs=False,
                 rows=1)
    return pipe


def _one_at_a_time(pipe, requests, seed=3, calls=None):
    out = []
    for r in requests:
        torch.manual_seed(seed)
        if calls is not None:
            calls["n"] = 0
        out.append(_answer(pipe.forward(_batch([r]))))
    return out


def test_a_release_inside_a_one_request_decode_goes_on_with_the_same_step(checkpoint,
                                                                           monkeypatch):
    """Sleep level 2 from inside the request's own thread: it goes on with the same paged step
    without graphs (its answer, the think image included, unchanged), and its buffers go when it
    ends; the next request allocates again."""
    requests = [_request(0, "a red cube on a table", text=40),
                _request(1, "tell me a story", text=30, do_sample=True, temperature=0.9),
                _request(2, "a think image of a boat", think=True)]
    pipe = _one_request_pipeline(checkpoint)
    want = _one_at_a_time(pipe, requests)
    inner, calls = pipe._ar_step, {"n": 0}

    def ar_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (7, 11):  # twice in each request: counted once
            pipe.release_captured_graphs()
        return inner(*args, **kwargs)

    monkeypatch.setattr(pipe, "_ar_step", ar_step)
    got = _one_at_a_time(pipe, requests, calls=calls)
    assert got == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.RELEASED}", 0) == len(requests)
    assert stats.get(MODEL, "eager_step") == 0
    assert getattr(pipe, hook.STATE_ATTR).decoder is None  # dropped when the request ended


def test_a_failed_capture_in_a_one_request_decode_goes_on_with_the_same_step(checkpoint):
    """Graphs asked for on a machine where capture fails (no CUDA here: a real failed capture,
    repaired): the step runs without a graph, this request and the next, the answers those of the
    same path without graphs, until a release lets capture try again."""
    requests = [_request(0, "a red cube on a table", text=40),
                _request(1, "tell me a story", text=30, do_sample=True, temperature=0.9)]
    want = _one_at_a_time(_one_request_pipeline(checkpoint), requests)
    stats.reset()
    pipe = _one_request_pipeline(checkpoint, graphs=True,
                                 VLLM_OMNI_GRAPHDECODE_PRECAPTURE="0")
    got = _one_at_a_time(pipe, requests)
    assert got == want
    wiring = getattr(pipe, hook.STATE_ATTR)
    assert wiring.sessions.capture_failed is not None
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.CAPTURE_FAILED}") == len(requests)
    assert stats.get(MODEL, "paged_request") == len(requests)
    assert stats.get(MODEL, "eager_step") == 0
    pipe.release_captured_graphs()
    assert wiring.sessions.capture_failed is None
