"""Faults lose nothing (issue #39), on the GPU host: vllm-omni's real SenseNova-U1 pipeline from
the tiny checkpoint, bf16 on CUDA, the batched step and the one-request step captured as CUDA
graphs. Each test forces one fault in the middle of real requests (greedy, sampled and think
rows together) and compares every answer with the same requests run without it.

* Batched rows without room wait or are swapped to host memory: every answer bit for bit.
* A batched row without room even alone is handed back and finishes on CUDA (the fault the
  issue saw: the eager step was fed a host tensor and failed every such request).
* A release (sleep level 2) or a failed capture in the middle of a batch or of a one-request
  decode: the same step goes on without graphs, every answer bit for bit; capture works again
  after a release.
* A refused batch draws a sampled answer from the request's own stream, whatever the process's
  generator holds.
* A one-request decode that cannot grow its buffers is handed back and finishes on CUDA.

The CPU file (tests/test_faults.py) checks the same decisions in fp32.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import reasons, stats
from vllm_omni_graphdecode.decode import paged as paged_decode
from vllm_omni_graphdecode.decode.batch import decoder as batch_decode
from vllm_omni_graphdecode.decode import session as ar_session
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import batch as batch_mod
from vllm_omni_graphdecode.hooks.sensenova_u1 import rules as hook_rules
from vllm_omni_graphdecode.hooks.sensenova_u1 import step as step_mod
from vllm_omni_graphdecode.testing import sensenova as rm, common

from test_sensenova_batch import _answer, _batch, _request  # noqa: F401 (request builders)
from test_sensenova_denoise import checkpoint  # noqa: F401 - the tiny checkpoint fixture

pytestmark = pytest.mark.gpu

MODEL = hook.MODEL
OOM_KEY = f"{MODEL}: {reasons.OOM}"


def _cfg(**env):
    return config.parse(common.with_suite_overrides({
        "VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
        "VLLM_OMNI_GRAPHDECODE_BUCKETS": "256,512,1024,2048",
        "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS": "256", **env}))


def _pipeline(checkpoint, rows=8, **env):  # noqa: F811
    pipe = rm.load_sensenova_pipeline(checkpoint, device="cuda", dtype=torch.bfloat16)
    hook.install(pipe, _cfg(**env), None, rows=rows)
    return pipe


def _requests():
    return [_request(0, "a red cube on a table", text=60),
            _request(1, "two cats and a dog in the rain", text=150),
            _request(2, "x", text=33),
            _request(3, "a sampled answer", text=90, do_sample=True, temperature=0.8),
            _request(4, "a think image of a boat", think=True)]


def _together(pipe, requests):
    outs = pipe.forward(_batch(requests))
    return [_answer(o) for o in (outs if isinstance(outs, list) else [outs])]


def _decoder(pipe):
    return getattr(pipe, hook.STATE_ATTR).batch._decoder()


def _no_room(monkeypatch, decoder, free_blocks):
    def grow(blocks, width=None):
        raise torch.OutOfMemoryError("CUDA out of memory: no room for the batch (test)")

    monkeypatch.setattr(decoder.cache, "grow", grow)
    monkeypatch.setattr(decoder.cache, "free", decoder.cache.free[:free_blocks])


def _vllm_pool_takes_a_capture():
    """vLLM's global graph pool still takes a capture: vLLM's runners and vllm-omni 0.30's own
    SenseNova-U1 decode capture there, in the same process as the plugin. On the H200 (0.30,
    torch 2.11), while the plugin's graphs lived in that pool, the batched decode's failed
    capture left it refusing captures ("already recording to mempool_id", h200-2026-12-05b);
    the plugin's graphs now have a pool of their own. Each fault below ends by checking it."""
    from vllm.platforms import current_platform

    graph, x = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    side, pool = torch.cuda.Stream(), current_platform.get_global_graph_pool()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, pool=pool):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    assert torch.equal(x.cpu(), torch.ones(4))


# ------------------------------------------------------------------ the batched decode


def _longest_row(monkeypatch, decoder):
    """Record the most tokens any row of ``decoder`` reserves (its last launch's need)."""
    seen = [0]
    real = decoder._reserve

    def reserve(index, tokens):
        seen[0] = max(seen[0], tokens)
        return real(index, tokens)

    monkeypatch.setattr(decoder, "_reserve", reserve)
    return seen


def test_gpu_batch_rows_without_room_wait_or_swap_and_answer_bit_for_bit(checkpoint, monkeypatch):  # noqa: F811
    """Room for the longest row alone and a few blocks more: two think rows (a ~570-token prompt
    and 1,024 think tokens each, ~101 blocks at their last launch; seen on the H200: with 100
    blocks the think row did not fit even alone) cannot both grow. Rows wait and are swapped to
    host memory and back; every answer, the think images and the sampled text included, is bit
    for bit the answer with room. The pool's size comes from the run with room, not a guess."""
    pipe = _pipeline(checkpoint)
    requests = _requests() + [_request(5, "a think image of a harbour at dusk", think=True)]
    decoder = _decoder(pipe)
    longest = _longest_row(monkeypatch, decoder)
    want = _together(pipe, requests)
    stats.reset()
    _no_room(monkeypatch, decoder, batch_decode.blocks_for(longest[0]) + 4)
    assert _together(pipe, requests) == want
    assert stats.get(MODEL, "batch_row_swapped") + stats.get(MODEL, "batch_row_waited") >= 1
    assert stats.get(MODEL, "eager_step") == 0
    assert OOM_KEY not in stats.fallbacks(MODEL)


def test_gpu_batch_row_without_room_even_alone_finishes_on_cuda(checkpoint, monkeypatch):  # noqa: F811
    """Six free blocks: no row can grow past 96 tokens, even alone. The rows that need more
    (greedy, sampled and the think row) are handed back after tokens were served and finish on
    the pipeline's eager path on CUDA (before the fix each failed with "index is on cpu": the
    eager step was fed the token the loop had picked from host logits); the short one finishes
    in the batch."""
    pipe = _pipeline(checkpoint)
    requests = _requests()
    want = _together(pipe, requests)
    stats.reset()
    _no_room(monkeypatch, _decoder(pipe), 6)
    got = _together(pipe, requests)  # _answer asserts no request failed
    assert stats.fallbacks(MODEL).get(OOM_KEY, 0) >= 3
    assert stats.get(MODEL, "eager_step") > 0
    assert got[2] == want[2]  # 33 tokens from a short prompt: room enough
    assert got[4][0] and got[4][1]  # the think image and its text


def _release_at(monkeypatch, pipe, call):
    real = batch_mod.RowSession.decode
    calls = {"n": 0}

    def decode(self, token, position):
        calls["n"] += 1
        if calls["n"] == call:
            pipe.release_captured_graphs()
        return real(self, token, position)

    monkeypatch.setattr(batch_mod.RowSession, "decode", decode)
    return real


def test_gpu_batch_release_mid_batch_changes_no_answer_and_the_next_forward_captures(
        checkpoint, monkeypatch):  # noqa: F811
    pipe = _pipeline(checkpoint)
    requests = _requests()
    want = _together(pipe, requests)
    stats.reset()
    real = _release_at(monkeypatch, pipe, 40)
    assert _together(pipe, requests) == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.RELEASED}", 0) >= 1
    assert stats.get(MODEL, "eager_step") == 0
    assert getattr(pipe, hook.STATE_ATTR).batch.decoder.cache.num_blocks == 0
    monkeypatch.setattr(batch_mod.RowSession, "decode", real)
    captures = stats.get(MODEL, "batch_capture")
    assert _together(pipe, requests) == want
    assert stats.get(MODEL, "batch_capture") > captures
    _vllm_pool_takes_a_capture()


def _sync_while_capturing(monkeypatch, cls, name="forward"):
    """``cls.name`` reads a value back to the host when it runs inside a capture: illegal
    there, so every capture of it fails for real (and is repaired); eagerly it is harmless."""
    real = getattr(cls, name)

    def forward(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if torch.cuda.is_current_stream_capturing():
            out.sum().item()
        return out

    monkeypatch.setattr(cls, name, forward)
    return real


def test_gpu_batch_failed_capture_changes_no_answer_until_a_release_captures_again(
        checkpoint, monkeypatch):  # noqa: F811
    pipe = _pipeline(checkpoint)
    requests = _requests()
    want = _together(pipe, requests)
    decoder = _decoder(pipe)
    decoder.drop_graphs()
    stats.reset()
    real = _sync_while_capturing(monkeypatch, batch_decode.BatchProgram)
    assert _together(pipe, requests) == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.CAPTURE_FAILED}") == len(requests)
    assert stats.get(MODEL, "eager_step") == 0 and decoder.capture_failed is not None
    monkeypatch.setattr(batch_decode.BatchProgram, "forward", real)
    pipe.release_captured_graphs()
    captures = stats.get(MODEL, "batch_capture")
    assert _together(pipe, requests) == want
    assert stats.get(MODEL, "batch_capture") > captures and decoder.capture_failed is None
    _vllm_pool_takes_a_capture()


def test_gpu_refused_batch_draws_a_sampled_answer_from_its_own_stream(checkpoint):  # noqa: F811
    """A forward hook on the language model refuses the batch: the sampled text is the same
    whatever the process's generator holds (before, it drew from it)."""
    pipe = _pipeline(checkpoint)
    sampled = [_request(3, "a sampled answer", text=90, do_sample=True, temperature=0.8)]
    handle = pipe.language_model.register_forward_hook(lambda module, args, out: None)
    try:
        answers = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            answers.append(_together(pipe, sampled))
    finally:
        handle.remove()
    assert answers[0] == answers[1]
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {hook_rules.HOOKED}") == 2


# ------------------------------------------------------------------ the one-request decode


def _one_at_a_time(pipe, requests, calls=None):
    """Each request alone; ``calls["seen"]`` gets how many ``calls["n"]`` each one reached."""
    out = []
    for r in requests:
        torch.manual_seed(3)  # the one-request path samples from the device's generator
        if calls is not None:
            calls["n"] = 0
        out.append(_answer(pipe.forward(_batch([r]))))
        if calls is not None:
            calls.setdefault("seen", []).append(calls["n"])
    return out


def _one_request_requests():
    return [_request(0, "a red cube on a table", text=300),
            _request(3, "a sampled answer", text=300, do_sample=True, temperature=0.8),
            _request(4, "a think image of a boat", think=True)]


def test_gpu_one_request_release_inside_the_decode_changes_no_answer(checkpoint, monkeypatch):  # noqa: F811
    """Sleep's release at the 30th, 31st and 200th call a request's session runs (mid-launch:
    the launch running ahead is served; twice more: counted once a request). Counted for each
    request that reached its 30th call: a short answer ends before (seen on the H200: one or two
    of three reach it, as the answers' lengths fall); the think request always does."""
    pipe = _pipeline(checkpoint, rows=1)
    requests = _one_request_requests()
    want = _one_at_a_time(pipe, requests)
    stats.reset()
    real, calls = ar_session.Session._run, {"n": 0}

    def run(self, fn, token, position):
        calls["n"] += 1
        if calls["n"] in (30, 31, 200):
            pipe.release_captured_graphs()
        return real(self, fn, token, position)

    monkeypatch.setattr(ar_session.Session, "_run", run)
    assert _one_at_a_time(pipe, requests, calls) == want
    reached = sum(n >= 30 for n in calls["seen"])
    assert calls["seen"][2] >= 30, calls["seen"]  # the think request's 1,024 tokens
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.RELEASED}") == reached
    assert stats.get(MODEL, "eager_step") == 0


def test_gpu_one_request_failed_capture_changes_no_answer_until_a_release(checkpoint,
                                                                          monkeypatch):  # noqa: F811
    pipe = _pipeline(checkpoint, rows=1)
    requests = _one_request_requests()
    want = _one_at_a_time(pipe, requests)
    wiring = getattr(pipe, hook.STATE_ATTR)
    wiring.sessions.decoder.drop_graphs()
    stats.reset()
    real = _sync_while_capturing(monkeypatch, step_mod.Step)
    assert _one_at_a_time(pipe, requests) == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.CAPTURE_FAILED}") == len(requests)
    assert stats.get(MODEL, "eager_step") == 0 and stats.get(MODEL, "replay") == 0
    monkeypatch.setattr(step_mod.Step, "forward", real)
    pipe.release_captured_graphs()
    assert _one_at_a_time(pipe, requests[:1]) == want[:1]
    assert stats.get(MODEL, "replay") > 0
    _vllm_pool_takes_a_capture()


def _longest_request(monkeypatch):
    """The most tokens each request's paged buffers are asked to hold (one entry a request)."""
    lengths = []
    real = paged_decode.PagedKVCache.reserve

    def reserve(self, length):
        if lengths:
            lengths[-1] = max(lengths[-1], length)
        return real(self, length)

    monkeypatch.setattr(paged_decode.PagedKVCache, "reserve", reserve)
    return lengths, real


def test_gpu_one_request_that_cannot_grow_its_buffers_finishes_on_cuda(checkpoint, monkeypatch):  # noqa: F811
    """Buffers past the 256-token bucket cannot be allocated: each request that needs more is
    handed back there (the think request, whose prompt alone is longer, at its start) and
    finishes on the pipeline's eager path on CUDA; a request that starts below 256 keeps the
    tokens it decoded with room. Both runs start from released buffers (sleep level 2): the
    buffers a longer request grew would otherwise serve the next without allocating (seen on
    the H200: no request was handed back)."""
    pipe = _pipeline(checkpoint, rows=1)
    requests = _one_request_requests()
    lengths, real_reserve = _longest_request(monkeypatch)
    want = []
    for r in requests:
        pipe.release_captured_graphs()
        lengths.append(0)
        want += _one_at_a_time(pipe, [r])
    monkeypatch.setattr(paged_decode.PagedKVCache, "reserve", real_reserve)
    longer = [n > 256 for n in lengths]
    assert longer[2], lengths  # the think request: a ~570-token prompt
    stats.reset()
    real = paged_decode._alloc

    def alloc(shape, dtype, device):
        if shape[0] * paged_decode.BLOCK_SIZE > 256:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(shape, dtype, device)

    monkeypatch.setattr(paged_decode, "_alloc", alloc)
    got = []
    for r in requests:
        pipe.release_captured_graphs()
        got += _one_at_a_time(pipe, [r])  # _answer asserts no request failed
    assert stats.fallbacks(MODEL).get(OOM_KEY) == sum(longer), lengths
    assert stats.get(MODEL, "eager_step") > 0
    for i in (0, 1):
        if longer[i]:
            assert got[i][:100] == want[i][:100]  # decoded with room before the hand-back
        else:
            assert got[i] == want[i]
    assert got[2][0] and got[2][1]  # the think image and its think text, decoded eagerly


# ------------------------------------------------------------------ the model changed mid-request

def _moves_at(pipe, owner, call):
    """At the ``call``-th check of ``owner.changed`` (before a launch or a token), move the
    language model's weights first (``.to("cpu"); .to("cuda")``, the old blocks refilled with
    random values, as ``tests/test_structure_changes_gpu.py`` does). Returns what holds them."""
    from test_structure_changes_gpu import round_trip

    real, calls, taken = owner.changed, {"n": 0}, []

    def changed():
        calls["n"] += 1
        if calls["n"] == call:
            with torch.inference_mode(False):
                taken.extend(round_trip(pipe.language_model))
        return real()

    owner.changed = changed
    return taken


def test_gpu_batch_weights_moved_mid_forward_finish_every_row_on_cuda(checkpoint):  # noqa: F811
    """The weights move before the third launch: no launch runs after it (its graphs read the
    old blocks, now random values); every row in flight finishes on the pipeline's eager path on
    CUDA from the tokens it had, counted under CHANGED; the next forward captures again and
    answers bit for bit."""
    pipe = _pipeline(checkpoint)
    requests = _requests()
    want = _together(pipe, requests)
    stats.reset()
    decoder = _decoder(pipe)
    taken = _moves_at(pipe, decoder, 3)
    got = _together(pipe, requests)  # _answer asserts no request failed
    changed = stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.CHANGED}", 0)
    assert 1 <= changed <= len(requests)
    assert stats.get(MODEL, "eager_step") > 0
    assert got[0][:8] == want[0][:8]  # the tokens of the two launches before the move
    assert got[4][0] and got[4][1]  # the think image and its text
    del taken
    stats.reset()
    assert _together(pipe, requests) == want
    assert stats.get(MODEL, "batch_capture") >= 1 and stats.fallbacks(MODEL) == {}
    _vllm_pool_takes_a_capture()


def test_gpu_one_request_weights_moved_mid_decode_finish_it_on_cuda(checkpoint):  # noqa: F811
    """The weights move before the 50th token of the first request: it finishes eagerly on
    CUDA (CHANGED), its first tokens those it had; the next requests are checked again, capture
    anew and answer bit for bit."""
    pipe = _pipeline(checkpoint, rows=1)
    requests = _one_request_requests()
    want = _one_at_a_time(pipe, requests)
    stats.reset()
    sessions = getattr(pipe, hook.STATE_ATTR).sessions
    taken = _moves_at(pipe, sessions, 50)
    got = _one_at_a_time(pipe, requests)
    assert stats.fallbacks(MODEL) == {f"{MODEL}: {reasons.CHANGED}": 1}
    assert stats.get(MODEL, "eager_step") > 0
    assert got[0][:20] == want[0][:20]
    assert got[1:] == want[1:]
    del taken
