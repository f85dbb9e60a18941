"""SenseNova-U1 continuous batching under step execution (issue #41), on the GPU host: vllm-omni's
real pipeline from the tiny checkpoint, bf16 on CUDA, the batched step captured as CUDA graphs
with vLLM's Triton decode attention and the denoising branches replayed as graphs, driven by
vLLM-Omni's own ``StepScheduler`` and its runner's stepwise path (``testing.sensenova.StepServer``).

The claims, each a test below:

* requests that join while others decode and while others denoise answer bit for bit as each
  alone (request mode, a batch of one), and as the same requests sent together in request mode;
* sleep level 2 while requests are in flight changes no answer, and the next requests capture
  again;
* an aborted request leaves its row at the next step, the others unchanged;
* a request for two images joins a running batch and gets both, from one prefill;
* no room for a row's K/V: rows wait (or are handed back, finishing on the eager step on the
  device), the answers are the ones with room;
* device memory is flat over 200 requests served step by step.
"""

import gc

import pytest
import torch

from vllm_omni_graphdecode.core import reasons, stats
from vllm_omni_graphdecode.decode.batch import decoder as batch_decode
from vllm_omni_graphdecode.decode.batch import turns
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import steps
from vllm_omni_graphdecode.testing import sensenova as rm

from test_sensenova_batch import _answer, _batch, _request
from test_sensenova_batch_gpu import _cfg, _pipeline
from test_sensenova_denoise import checkpoint  # noqa: F401 - the tiny checkpoint fixture
from test_sensenova_steps import _members, _tick_until, widened  # noqa: F401 - fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not steps.has_step_execution(),
    reason="this vllm-omni has no step execution (0.28 and 0.30 have it; run with STACK=0.30)")]

MODEL = hook.MODEL


@pytest.fixture
def server(checkpoint, widened):  # noqa: F811
    def make(rows=8, max_num_seqs=16, **install):
        hook.declare_batching(rm.pipeline_module(), _cfg())  # at import, before the load
        pipe = _pipeline(checkpoint, rows=rows, **install)
        return rm.StepServer(pipe, max_num_seqs=max_num_seqs, device="cuda")
    return make


def _answers(outputs):
    return {rid: _answer(out) for rid, out in outputs.items()}


def _alone(srv, requests):
    """Each request alone on the same pipeline, request mode (a batch of one)."""
    return {r.request_id: _answer(srv.pipe.forward(_batch([r]))) for r in requests}


def test_gpu_requests_joining_mid_decode_and_mid_denoise_answer_as_each_alone(server):
    srv = server()
    wiring = getattr(srv.pipe, hook.STATE_ATTR)
    assert wiring.batch.graphs
    think = _request(0, "a think image of a boat", think=True)
    first = _request(1, "a text answer", text=120)
    joins_decode = _request(2, "joins while the think request decodes", text=200,
                            do_sample=True, temperature=0.8)
    joins_denoise = _request(3, "a plain image that joins later")
    srv.add(think)
    srv.add(first)
    for _ in range(3):
        srv.tick()
    srv.add(joins_decode)
    _tick_until(srv, lambda: _members(srv)[think.request_id].state == turns.AT_STEP)
    srv.add(joins_denoise)
    together = _answers(srv.run())
    assert stats.get(MODEL, "batch_capture") >= 1
    assert stats.get(MODEL, "batch_rows") > stats.get(MODEL, "batch_launch")
    assert stats.fallbacks(MODEL) == {}
    requests = [think, first, joins_decode, joins_denoise]
    assert together == _alone(srv, requests)
    request_mode = [_answer(o) for o in srv.pipe.forward(_batch(requests))]
    assert [together[r.request_id] for r in requests] == request_mode


def test_gpu_sleep_while_requests_are_in_flight_changes_no_answer(server):
    srv = server()
    requests = [_request(10, "before the sleep", text=150), _request(11, "an image"),
                _request(12, "a think image", think=True)]
    for r in requests:
        srv.add(r)
    for _ in range(4):
        srv.tick()
    srv.pipe.release_captured_graphs()  # sleep level 2, between two steps
    together = _answers(srv.run())
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.RELEASED}", 0) >= 1
    captures = stats.get(MODEL, "batch_capture")
    assert together == _alone(srv, requests)  # the next requests batch and capture again
    assert stats.get(MODEL, "batch_capture") > captures


def test_gpu_an_aborted_request_leaves_its_row_and_the_others_are_untouched(server):
    srv = server()
    requests = [_request(20, "a long answer", text=300), _request(21, "aborted", text=300),
                _request(22, "a think image", think=True)]
    for r in requests:
        srv.add(r)
    for _ in range(5):
        srv.tick()
    decoder = getattr(srv.pipe, hook.STATE_ATTR).batch.decoder
    live = len(decoder.live_rows)
    srv.abort(requests[1].request_id)
    srv.tick()
    assert len(decoder.live_rows) == live - 1
    outputs = srv.run()
    assert requests[1].request_id not in outputs
    kept = [requests[0], requests[2]]
    assert {r.request_id: _answer(outputs[r.request_id]) for r in kept} == _alone(srv, kept)


def test_gpu_a_request_for_two_images_joins_and_gets_both_from_one_prefill(server):
    """``num_outputs_per_prompt`` 2 (OpenAI ``n``), joining while a think request and a text
    answer decode: two different images from one prefill (counted), and every answer as alone."""
    import numpy as np

    srv = server()
    think = _request(20, "a think image of a lighthouse", think=True)
    text = _request(21, "a text answer beside them", text=90)
    two = _request(22, "two images of a tree")
    two.sampling_params.num_outputs_per_prompt = 2
    srv.add(think)
    srv.add(text)
    for _ in range(2):
        srv.tick()
    stats.reset()
    srv.add(two)
    outputs = srv.run()
    assert stats.get(MODEL, "n_images_request") == 1 and stats.get(MODEL, "n_images") == 2
    images = outputs[two.request_id].output["payload"]["image"]
    assert isinstance(images, list) and len(images) == 2
    assert not np.array_equal(np.asarray(images[0]), np.asarray(images[1]))
    assert stats.fallbacks(MODEL) == {}
    assert _answers(outputs) == _alone(srv, [think, text, two])


@pytest.mark.parametrize("room", ["rows-wait", "handed-back"])
def test_gpu_no_room_for_a_rows_kv_keeps_every_answer(server, monkeypatch, room):
    """The pool cannot grow (out of memory). ``rows-wait``: room for the longest row alone and
    a few blocks more (measured on the requests alone, not guessed), so the two think rows
    cannot both grow: rows take turns (waits, swaps) and every answer is the one with room.
    ``handed-back``: no free block; every row is handed back and finishes on the pipeline's
    eager step on the device (issue #39: that hand-back failed on CUDA)."""
    from test_faults_gpu import _longest_row

    requests = [_request(30, "first", text=100), _request(31, "second", text=140),
                _request(32, "a think image", think=True),
                _request(33, "a think image of a harbour at dusk", think=True)]
    srv = server()
    srv.tick()  # nothing scheduled yet: builds nothing
    decoder = getattr(srv.pipe, hook.STATE_ATTR).batch._decoder()
    longest = _longest_row(monkeypatch, decoder)
    want = _alone(srv, requests)
    stats.reset()

    def grow(blocks, width=None):
        raise torch.OutOfMemoryError("no room for the batch (test)")

    free_blocks = batch_decode.blocks_for(longest[0]) + 4 if room == "rows-wait" else 0
    monkeypatch.setattr(decoder.cache, "grow", grow)
    monkeypatch.setattr(decoder.cache, "free", decoder.cache.free[:free_blocks])
    for r in requests:
        srv.add(r)
    outputs = srv.run()
    if free_blocks:
        assert _answers(outputs) == want
        assert stats.get(MODEL, "batch_row_swapped") + stats.get(MODEL, "batch_row_waited") >= 1
        assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.OOM}", 0) == 0
    else:
        # Eager after a hand-back: the model's own step, whose rounding is not the batched
        # step's; the request still ends with an answer, on the device.
        assert all(out.error is None for out in outputs.values()), outputs
        assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.OOM}", 0) >= 1


def test_gpu_device_memory_is_flat_over_200_requests(server):
    srv = server(rows=8)
    free = {}
    for n in range(200):
        srv.add(_request(1000 + n, f"request number {n}", text=20 + n % 40))
        if n % 3 == 0:
            srv.tick()
        if n in (40, 199):
            srv.run()
            gc.collect()
            torch.cuda.synchronize()
            free[n] = torch.cuda.mem_get_info()[0]
    assert len(srv.outputs) == 200
    assert all(out.error is None for out in srv.outputs.values())
    assert abs(free[40] - free[199]) <= 2 * 2**20, free
    assert _members(srv) == {}
