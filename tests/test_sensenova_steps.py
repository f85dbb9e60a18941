"""SenseNova-U1 continuous batching under vLLM-Omni's step execution (issue #41), on CPU; and the
engine's cancellation reaching a request of a request-mode batch (issue #39).

The mechanism (``turns.Ticks``) is tested alone; then the whole path on vllm-omni's real
``SenseNovaU1Pipeline`` from the tiny checkpoint (fp32), driven as vLLM-Omni's step engine drives
it: its real ``StepScheduler`` (admission and batch key) and its real ``DiffusionModelRunner``'s
stepwise path (``testing.sensenova.StepServer``). Each answer is compared with the same request
run alone in request mode (a batch of one through ``pipeline.forward``). On CPU the batched step
runs without graphs over the reference attention (``tests/test_sensenova_steps_gpu.py``: CUDA
graphs, vLLM's kernel). Nothing waits on time: members meet through the ticks themselves.
"""

from __future__ import annotations

import contextvars

import pytest

from vllm_omni_graphdecode.core import reasons, stats
from vllm_omni_graphdecode.decode.batch import turns
from vllm_omni_graphdecode.hooks import sensenova_u1 as hook
from vllm_omni_graphdecode.hooks.sensenova_u1 import batch as batch_mod, steps
from vllm_omni_graphdecode.testing import sensenova as rm

from test_sensenova_batch import _answer, _batch, _cfg, _pipeline, _request
from test_sensenova_denoise import checkpoint  # noqa: F401 - the tiny checkpoint fixture

MODEL = hook.MODEL


# ------------------------------------------------------------------ Ticks

def _group(events, launches=None, order="fcfs", beside_launch=None):
    def launch():
        events.append("launch")
        if launches is not None:
            launches[0] += 1
    return turns.Ticks(launch, order=order, beside_launch=beside_launch)


def test_a_tick_gives_each_member_one_step_and_the_decoding_members_one_launch():
    events, served = [], [0]
    group = _group(events, served)

    def denoiser(name, steps):
        def body():
            events.append(f"{name} prefill")
            for i in range(steps):
                group.end_of_step()
                events.append(f"{name} step {i}")
            return name
        return body

    def decoder(name, launches):
        def body():
            events.append(f"{name} prefill")
            for i in range(launches):
                want = served[0] + 1
                group.wait_until(lambda: served[0] >= want)
                events.append(f"{name} tokens {i}")
            return name
        return body

    a = group.add(denoiser("a", 2))
    b = group.add(decoder("b", 2))
    group.tick()
    assert events == ["a prefill", "b prefill", "launch", "b tokens 0"]
    events.clear()
    group.tick()
    assert events == ["a step 0", "launch", "b tokens 1"]
    assert b.done and b.result == "b" and not a.done
    events.clear()
    group.tick()
    assert events == ["a step 1"] and a.done and a.result == "a"


def test_a_member_added_between_ticks_starts_at_the_next_one_beside_the_others():
    events = []
    group = _group(events, order="round_robin")

    def steps(name, n):
        def body():
            for i in range(n):
                events.append(f"{name} {i}")
                group.end_of_step()
            return name
        return body

    first = group.add(steps("first", 3))
    group.tick()
    second = group.add(steps("second", 1))
    assert events == ["first 0"] and second.state == turns.NEW
    group.tick()
    assert events == ["first 0", "second 0", "first 1"]  # new members first, then the steps
    group.tick()
    assert second.done and not first.done
    group.tick()
    assert first.done and [m.result for m in (first, second)] == ["first", "second"]
    group.forget(second)
    assert group.members == [first]


def _denoisers(order, works):
    """Members that each take ``works[i]`` denoising steps, added together, ticked until all are
    done: (each member's own events, the denoising steps run when each ended, the steps each
    tick ran). A tick lasts as long as its steps: the steps run before a request ended are the
    time it waited."""
    events, ended, per_tick = [], {}, []
    group = _group(events, order=order)

    def denoiser(name, n):
        def body():
            for i in range(n):
                group.end_of_step()
                events.append((name, i))
                if i == n - 1:
                    ended[name] = len(events)
            return name
        return body

    members = {name: group.add(denoiser(name, n)) for name, n in works.items()}
    while not all(m.done for m in members.values()):
        before = len(events)
        group.tick()
        per_tick.append(len(events) - before)
    own = {name: [e for e in events if e[0] == name] for name in works}
    return own, ended, per_tick


def test_fcfs_gives_the_ticks_steps_to_the_oldest_request_first_and_none_ends_later():
    works = {"a": 6, "b": 6, "c": 6}
    own, ended, per_tick = _denoisers("fcfs", works)
    rr_own, rr_ended, rr_per_tick = _denoisers("round_robin", works)
    assert own == rr_own  # every request runs its own steps, in its own order
    # A tick runs one step per request denoising when it began, in both orders.
    assert per_tick[:4] == [0, 3, 3, 2] and rr_per_tick[:3] == [0, 3, 3]
    assert sum(per_tick) == sum(rr_per_tick) == 18
    # Round robin: all end in the last tick; first come, first served: the oldest first, each
    # after no more work than round robin's.
    assert ended == {"a": 6, "b": 12, "c": 18} and rr_ended == {"a": 16, "b": 17, "c": 18}


def test_fcfs_hands_the_steps_a_finished_request_leaves_to_the_next_one():
    own, ended, per_tick = _denoisers("fcfs", {"a": 1, "b": 4})
    # Tick 2 has two steps to give: a's last, then b's first; b then runs alone, one a tick.
    assert per_tick == [0, 2, 1, 1, 1]
    assert ended == {"a": 1, "b": 5} and own["b"] == [("b", i) for i in range(4)]


@pytest.mark.parametrize("order,expected", [
    ("fcfs", ["a 0", "launch", "a 1", "launch", "a 2", "b 0", "b 1"]),
    ("round_robin", ["a 0", "launch", "b 0", "launch", "c 0", "a 1", "b 1"]),
])
def test_while_a_member_decodes_a_tick_runs_at_most_beside_launch_steps(order, expected):
    """A text answer waits for one denoising step between its launches, not for every
    image's; once it is done, the tick runs one step per denoising request again."""
    events, served = [], [0]
    group = _group(events, served, order=order, beside_launch=1)

    def denoiser(name, n):
        def body():
            for i in range(n):
                group.end_of_step()
                events.append(f"{name} {i}")
        return body

    def decoder():
        for _ in range(3):
            want = served[0] + 1
            group.wait_until(lambda: served[0] >= want)

    images = [group.add(denoiser(name, 3)) for name in "abc"]
    text = group.add(decoder)
    group.tick()  # every member runs up to its first park: no step, the first launch
    assert events == ["launch"]
    events.clear()
    for _ in range(3):
        group.tick()
    assert text.done and events == expected
    assert group.held == 4  # two ticks beside a launch, each putting off two of three steps
    while not all(m.done for m in images):  # no member left parked on a worker thread
        group.tick()
    assert group.held == 4


def test_an_unknown_order_or_limit_is_refused_by_name():
    with pytest.raises(ValueError, match="beside_launch 0: accepted: None"):
        turns.Ticks(lambda: None, beside_launch=0)


def test_an_unknown_order_is_refused_by_name():
    with pytest.raises(ValueError, match="order 'lifo': accepted: fcfs, round_robin"):
        turns.Ticks(lambda: None, order="lifo")


def test_stopping_a_parked_member_unwinds_it_at_the_next_tick_and_leaves_the_others():
    events = []
    group = _group(events)

    def body():
        try:
            while True:
                group.end_of_step()
                events.append("stepped")
        finally:
            events.append("cleaned up")

    victim = group.add(body)
    other = group.add(lambda: "other")
    group.tick()
    group.stop(victim, RuntimeError("aborted"))
    assert not victim.done  # parked until the next tick
    group.tick()
    assert victim.done and str(victim.error) == "aborted"
    assert events == ["cleaned up"] and other.result == "other"


def test_stopping_a_member_that_never_ran_ends_it_without_running_it():
    ran = []
    group = _group([])
    member = group.add(lambda: ran.append("ran"))
    group.stop(member, RuntimeError("aborted"))
    assert member.done and str(member.error) == "aborted" and ran == []
    group.tick()
    assert ran == []


def test_a_launch_that_raises_fails_the_members_that_waited_for_it_only():
    def launch():
        raise ValueError("launch broke")

    group = turns.Ticks(launch)
    waiter = group.add(lambda: group.wait_until(lambda: False))
    stepper = group.add(lambda: group.end_of_step() or "stepped")
    group.tick()
    assert waiter.done and isinstance(waiter.error, ValueError)
    group.tick()
    assert stepper.result == "stepped"


def test_a_member_calling_the_group_from_outside_is_refused():
    with pytest.raises(RuntimeError, match="outside"):
        _group([]).end_of_step()


REQUEST_ID = contextvars.ContextVar("request_id", default=None)


def test_members_see_the_context_variables_of_the_thread_that_started_them():
    """vllm-omni 0.30 keeps a request's cancellation signals in a context variable: a member's
    code (in a thread of its own) must see the caller's, in ``Turns`` and in ``Ticks``."""
    token = REQUEST_ID.set("caller's")
    try:
        group = turns.Turns(lambda: None)
        assert group.run([REQUEST_ID.get, REQUEST_ID.get]) == ["caller's", "caller's"]
        ticks = _group([])
        member = ticks.add(REQUEST_ID.get)
        ticks.tick()
        assert member.result == "caller's"
    finally:
        REQUEST_ID.reset(token)


# ------------------------------------------------------------------ the engine's admission

@pytest.fixture
def widened():
    from vllm_omni.diffusion.sched import step_scheduler

    steps.undo_step_admission()  # another test's register() may have widened it already
    line = steps.widen_step_admission(step_scheduler, _cfg())
    yield line
    steps.undo_step_admission()


def _od_config(model_class_name="SenseNovaU1Pipeline", max_num_seqs=8):
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    od = OmniDiffusionConfig(model="x", max_num_seqs=max_num_seqs, step_execution=True)
    od.model_class_name = model_class_name
    return od


def _scheduler(model_class_name="SenseNovaU1Pipeline", max_num_seqs=8):
    from vllm_omni.diffusion.sched.step_scheduler import StepScheduler

    scheduler = StepScheduler()
    scheduler.initialize(_od_config(model_class_name, max_num_seqs))
    return scheduler


def _kinds():
    """A text answer, a think image, a smaller plain image with other steps, a sampled answer."""
    plain = _request(2, "a plain image")
    plain.sampling_params.height = plain.sampling_params.width = 32
    plain.sampling_params.num_inference_steps = 5
    return [_request(0, "a text answer", text=12), _request(1, "a think image", think=True),
            plain, _request(3, "a sampled answer", text=8, do_sample=True, temperature=0.7)]


def test_the_step_scheduler_runs_sensenova_requests_of_every_kind_and_size_together(widened):
    assert "admits" in widened
    scheduler = _scheduler()
    requests = _kinds()
    for r in requests:
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert sorted(out.scheduled_request_ids) == sorted(r.request_id for r in requests)
    assert stats.get(MODEL, "step_admission_widened") == len(requests)


def test_the_release_admission_keeps_them_apart_and_another_model_is_untouched(widened):
    scheduler = _scheduler(model_class_name="QwenImagePipeline")
    requests = _kinds()[1:3]
    for r in requests:
        scheduler.add_request(r)
    assert scheduler.schedule().scheduled_request_ids == [requests[0].request_id]
    steps.undo_step_admission()
    scheduler = _scheduler()
    for r in _kinds()[1:3]:
        scheduler.add_request(r)
    assert len(scheduler.schedule().scheduled_request_ids) == 1  # the release: one kind waits


def test_a_lora_adapter_still_keeps_requests_apart(widened):
    from types import SimpleNamespace

    scheduler = _scheduler()
    requests = _kinds()[:2]
    requests[1].sampling_params.lora_request = SimpleNamespace(lora_int_id=7)
    for r in requests:
        scheduler.add_request(r)
    assert scheduler.schedule().scheduled_request_ids == [requests[0].request_id]


def test_a_text_request_that_names_no_steps_is_admitted_as_one_step(widened):
    scheduler = _scheduler()
    request = _kinds()[0]
    request.sampling_params.num_inference_steps = None
    scheduler.add_request(request)
    assert scheduler.schedule().scheduled_request_ids == [request.request_id]
    steps.undo_step_admission()
    again = _kinds()[0]
    again.sampling_params.num_inference_steps = None
    with pytest.raises(AssertionError):  # the release's scheduler refuses it
        _scheduler().add_request(again)


# ------------------------------------------------------------------ the pipeline, step by step

@pytest.fixture
def server(checkpoint, widened):  # noqa: F811
    def make(rows=4, max_num_seqs=8, **install):
        # As in a server: the class is declared at import, before the pipeline is loaded.
        hook.declare_batching(rm.pipeline_module(), _cfg())
        pipe = _pipeline(checkpoint, rows=rows, **install)
        return rm.StepServer(pipe, max_num_seqs=max_num_seqs)
    return make


def _alone(checkpoint, requests):  # noqa: F811
    hook.declare_batching(rm.pipeline_module(), _cfg())  # as a server declares it
    pipe = _pipeline(checkpoint)
    return {r.request_id: _answer(pipe.forward(_batch([r]))) for r in requests}


def _members(server):
    return steps.requests_of(server.pipe).members


def _tick_until(server, done, limit=3000):
    for _ in range(limit):
        if done():
            return
        server.tick()
    raise AssertionError("the condition never held")


def test_images_sent_together_leave_one_after_another_in_fcfs_and_answer_the_same(server):
    """VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_ORDER: with ``fcfs`` (the default) the oldest
    denoising request takes the step's denoising steps, so images sent together leave at
    different steps, the first as early as the same work allows; ``round_robin`` finishes them
    together. The same answers either way."""
    def images():
        requests = [_request(i, f"an image number {i}") for i in range(3)]
        for r in requests:
            r.sampling_params.num_inference_steps = 4
        return requests

    runs = {}
    for order in ("fcfs", "round_robin"):
        srv = server(cfg=_cfg(VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_ORDER=order))
        ticks = steps.requests_of(srv.pipe).ticks
        assert ticks.order == order and ticks.beside_launch == 1  # the defaults
        stats.reset()
        for r in images():
            srv.add(r)
        outputs = srv.run()
        assert stats.get(MODEL, "step_denoise_held") == 0  # nothing decoded beside them
        runs[order] = ({rid: _answer(o) for rid, o in outputs.items()}, srv.finished_at)
    (fcfs, fcfs_at), (rr, rr_at) = runs["fcfs"], runs["round_robin"]
    assert fcfs == rr and all(isinstance(a, tuple) and a[0] for a in fcfs.values())
    assert fcfs_at["req-0"] < fcfs_at["req-1"] < fcfs_at["req-2"]
    assert len(set(rr_at.values())) == 1
    assert fcfs_at["req-2"] > rr_at["req-2"]  # shorter steps, more of them: the same work


def test_a_text_answer_beside_denoising_images_holds_their_steps_back_and_answers_the_same(
        server, checkpoint):  # noqa: F811
    """Two images denoise while a text answer joins: each step beside its launches runs one
    denoising step (the default limit), the others put off (counted), and every answer is the
    request's answer alone."""
    images = [_request(30 + i, f"an image number {i}") for i in range(2)]
    for r in images:
        r.sampling_params.num_inference_steps = 6
    text = _request(32, "a text answer beside the images", text=40)
    want = _alone(checkpoint, [*images, text])
    stats.reset()

    srv = server()
    for r in images:
        srv.add(r)
    _tick_until(srv, lambda: all(m.state == turns.AT_STEP for m in _members(srv).values()))
    srv.add(text)
    outputs = srv.run()
    assert {rid: _answer(out) for rid, out in outputs.items()} == want
    assert stats.get(MODEL, "step_denoise_held") > 0
    assert stats.fallbacks(MODEL) == {}


def test_requests_that_join_mid_decode_and_mid_denoise_answer_as_each_alone(server,
                                                                          checkpoint):  # noqa: F811
    """A think image and a text answer start together; a second text answer joins while the
    think request decodes, a plain image while it denoises. Every answer is bit for bit the
    request's answer alone; the text answers and the think decode shared launches; a text
    answer leaves at the step it ended in, long before the image."""
    think = _request(10, "a think image of a boat", think=True)
    first = _request(11, "a text answer", text=24)
    joins_decode = _request(12, "joins while the think request decodes", text=30,
                            do_sample=True, temperature=0.8)
    joins_denoise = _request(13, "a plain image that joins later")
    want = _alone(checkpoint, [think, first, joins_decode, joins_denoise])
    stats.reset()

    srv = server()
    srv.add(think)
    srv.add(first)
    srv.tick()
    srv.tick()
    srv.add(joins_decode)
    _tick_until(srv, lambda: _members(srv)[think.request_id].state == turns.AT_STEP)
    srv.add(joins_denoise)
    outputs = srv.run()

    assert {rid: _answer(out) for rid, out in outputs.items()} == want
    assert srv.finished_at[first.request_id] < srv.finished_at[think.request_id]
    assert stats.get(MODEL, "batch_rows") > stats.get(MODEL, "batch_launch")
    assert stats.get(MODEL, "step_request") == 4 and stats.get(MODEL, "step_finished") == 4
    assert stats.fallbacks(MODEL) == {}
    assert _members(srv) == {} and steps.requests_of(srv.pipe).ticks.members == []
    decoder = getattr(srv.pipe, hook.STATE_ATTR).batch.decoder
    assert not any(decoder.rows)


def test_an_aborted_request_stops_at_the_next_step_and_the_others_are_untouched(server,
                                                                              checkpoint):  # noqa: F811
    requests = [_request(20, "a long answer", text=60), _request(21, "aborted midway", text=60),
                _request(22, "a short answer", text=9)]
    want = _alone(checkpoint, [requests[0], requests[2]])
    srv = server()
    for r in requests:
        srv.add(r)
    for _ in range(4):
        srv.tick()
    decoder = getattr(srv.pipe, hook.STATE_ATTR).batch.decoder
    live = len(decoder.live_rows)
    member = _members(srv)[requests[1].request_id]
    assert member.state == turns.AT_LAUNCH
    srv.abort(requests[1].request_id)
    srv.tick()
    assert member.done and "aborted" in str(member.error)
    assert len(decoder.live_rows) == live - 1
    outputs = srv.run()
    assert requests[1].request_id not in outputs
    assert {rid: _answer(outputs[rid]) for rid in want} == want
    assert stats.get(MODEL, "step_stopped") == 1 and _members(srv) == {}


def test_a_request_that_fails_in_its_prefill_ends_alone(server, checkpoint,  # noqa: F811
                                                        monkeypatch):
    requests = [_request(30, "fine", text=10), _request(31, "this one fails", text=10),
                _request(32, "fine too", text=14)]
    want = _alone(checkpoint, [requests[0], requests[2]])
    srv = server()
    real = srv.pipe._forward_text

    def forward_text(p, images):
        if p.prompt == "this one fails":
            raise RuntimeError("its own failure")
        return real(p, images)

    monkeypatch.setattr(srv.pipe, "_forward_text", forward_text)
    for r in requests:
        srv.add(r)
    outputs = srv.run()
    assert "its own failure" in outputs[requests[1].request_id].error
    assert {rid: _answer(outputs[rid]) for rid in want} == want


def test_sleep_while_requests_are_in_flight_changes_no_answer(server, checkpoint):  # noqa: F811
    requests = [_request(40, "before the sleep", text=40), _request(41, "an image")]
    want = _alone(checkpoint, requests)
    srv = server()
    for r in requests:
        srv.add(r)
    for _ in range(3):
        srv.tick()
    srv.pipe.release_captured_graphs()  # sleep level 2, between two steps
    outputs = srv.run()
    assert {rid: _answer(out) for rid, out in outputs.items()} == want
    assert stats.fallbacks(MODEL).get(f"{MODEL}: {reasons.RELEASED}", 0) >= 1


def test_without_the_batched_decode_requests_still_take_turns_a_step_at_a_time(
        server, checkpoint):  # noqa: F811
    requests = [_request(50, "one request at a time", text=20), _request(51, "an image")]
    want = _alone(checkpoint, requests)
    srv = server(rows=1)  # --max-num-seqs 1 at load: no request batch wired
    for r in requests:
        srv.add(r)
    outputs = srv.run()
    assert {rid: _answer(out) for rid, out in outputs.items()} == want
    assert any(steps.NO_BATCHED_DECODE.key in key for key in stats.degraded_paths(MODEL))


# ------------------------------------------------------------------ request mode: the engine's abort

def test_the_engine_gives_a_sensenova_server_cancellation_flags_once_declared(checkpoint):  # noqa: F811
    from vllm_omni.diffusion import diffusion_engine

    hook.declare_batching(rm.pipeline_module(), _cfg())
    assert diffusion_engine.supports_request_cancellation(_od_config()) is True


def test_an_abort_through_the_engines_flags_stops_its_rows_and_steps_only(checkpoint,  # noqa: F811
                                                                         monkeypatch):
    """The engine's own registry makes each request's flag and sets it on ``abort`` (what an HTTP
    client that disconnects causes); the worker's own request path (``_execute_request_list``)
    attaches them. A text answer aborted while it decodes and an image aborted while it
    denoises end as aborted; the others answer as alone."""
    from vllm_omni.diffusion.cancellation import RequestCancellationRegistry

    requests = [_request(60, "kept", text=30), _request(61, "aborted while decoding", text=60),
                _request(62, "an image aborted while denoising"), _request(63, "kept image")]
    want = _alone(checkpoint, [requests[0], requests[3]])
    srv_pipe = _pipeline(checkpoint)
    hook.declare_batching(rm.pipeline_module(), _cfg())
    registry = RequestCancellationRegistry()
    for r in requests:
        r.cancellation_signal = registry.create(r.request_id)
    real_decode, real_denoise = batch_mod.RowSession.decode, type(srv_pipe)._denoise
    seen = {"tokens": 0}

    def decode(self, token, position):
        if self.request is requests[1]:
            seen["tokens"] += 1
            if seen["tokens"] == 5:
                registry.cancel([requests[1].request_id])  # the engine's abort()
        return real_decode(self, token, position)

    def denoise(self, *args, **kwargs):
        if batch_mod.current_request() is requests[2]:
            registry.cancel([requests[2].request_id])
        return real_denoise(self, *args, **kwargs)

    monkeypatch.setattr(batch_mod.RowSession, "decode", decode)
    monkeypatch.setattr(type(srv_pipe), "_denoise", denoise)
    runner = rm.StepServer(srv_pipe, max_num_seqs=4).runner
    srv_pipe.od_config.step_execution = False
    try:
        result = runner._execute_request_list(
            requests, od_config=srv_pipe.od_config, allow_single_output=False,
            require_request_batch_support=True, record_name="test",
            record_output_peak_memory=False)
    finally:
        registry.close()
    outs = {o.request_id: o.result for o in result.runner_outputs}
    assert outs[requests[1].request_id].aborted and outs[requests[2].request_id].aborted
    assert {rid: _answer(outs[rid]) for rid in want} == want
    decoder = getattr(srv_pipe, hook.STATE_ATTR).batch.decoder
    assert not any(decoder.rows)


def test_a_flag_read_through_a_threads_own_request(checkpoint):  # noqa: F811
    """``batch.serving``: the flag is opened once per request and read per token or step; a
    request without one is never cancelled."""
    from multiprocessing.shared_memory import SharedMemory

    request = _request(70, "x", text=4)
    with batch_mod.serving(request):
        assert not batch_mod.cancelled()
        batch_mod.check_cancelled()
    signal = SharedMemory(create=True, size=1)
    try:
        signal.buf[0] = 0
        request.cancellation_signal = signal.name
        with batch_mod.serving(request):
            assert not batch_mod.cancelled()
            signal.buf[0] = 1
            with pytest.raises(Exception, match="cancelled"):
                batch_mod.check_cancelled()
        assert not batch_mod.cancelled()  # left: the flag is closed
    finally:
        signal.close()
        signal.unlink()


# ------------------------------------------------------------------ n images for one request

def _images(out):
    import numpy as np

    assert out.error is None, out.error
    image = out.output["payload"]["image"]
    return [np.asarray(i) for i in (image if isinstance(image, list) else [image])]


def test_a_request_for_two_images_gets_both_from_one_prefill(checkpoint):  # noqa: F811
    """``num_outputs_per_prompt`` 2: both images of the pipeline's own batch of two (its first
    image is what the release returns for ``batch_size`` 2, the second is the one it drops);
    one prefill (a single prefix forward per CFG branch)."""
    import numpy as np

    two = _request(80, "two images of a boat")
    two.sampling_params.num_outputs_per_prompt = 2
    release = _pipeline(checkpoint, cfg=False)
    hook.declare_batching(rm.pipeline_module(), _cfg())
    by_batch_size = _request(80, "two images of a boat", batch_size=2)
    want = _images(release.forward(_batch([by_batch_size])))
    assert len(want) == 1  # the release's own behaviour: the first image only

    pipe = _pipeline(checkpoint)
    prefills = []
    real = pipe._t2i_prefix_forward

    def prefix_forward(*args, **kwargs):
        prefills.append(1)
        return real(*args, **kwargs)

    pipe._t2i_prefix_forward = prefix_forward
    got = _images(pipe.forward(_batch([two])))
    assert len(got) == 2 and np.array_equal(got[0], want[0])
    assert not np.array_equal(got[0], got[1])
    assert len(prefills) == 2  # cond and uncond, once each: not once per image
    assert stats.get(MODEL, "n_images_request") == 1 and stats.get(MODEL, "n_images") == 2
    named = _request(81, "a batch named by the request", batch_size=2)
    named.sampling_params.num_outputs_per_prompt = 2
    assert len(_images(pipe.forward(_batch([named])))) == 1  # the pipeline's own behaviour


def test_a_request_for_two_images_joins_a_running_step_batch(server, checkpoint):  # noqa: F811
    two = _request(82, "two images of a tree")
    two.sampling_params.num_outputs_per_prompt = 2
    text = _request(83, "a text answer beside them", text=20)
    want = _alone(checkpoint, [two, text])
    srv = server()
    srv.add(text)
    srv.tick()
    srv.add(two)
    outputs = srv.run()
    assert {rid: _answer(out) for rid, out in outputs.items()} == want
    assert len(_images(outputs[two.request_id])) == 2


# ------------------------------------------------------------------ what register() declares

@pytest.fixture
def bare_class():
    """The real pipeline class without any declaration of this plugin, restored after the test
    (declarations are process-wide: an earlier test's may be in place)."""
    # Imported first: a patch another test's register() left pending runs now, then goes.
    from vllm_omni.diffusion.sched import step_scheduler  # noqa: F401

    steps.undo_step_admission()
    cls = rm.pipeline_module().SenseNovaU1Pipeline
    names = (*steps.PROTOCOL, "supports_step_execution", "supports_request_cancellation",
             "supports_request_batch", "forward", "_denoise")
    before = {name: cls.__dict__[name] for name in names if name in cls.__dict__}
    for name in names:
        if name in cls.__dict__:
            delattr(cls, name)
    for name in ("forward", "_denoise"):  # the pipeline's own, beneath any declaration
        fn = before[name]
        while getattr(fn, "__graphdecode__", False):
            fn = fn.__wrapped__
        setattr(cls, name, fn)
    yield cls
    steps.undo_step_admission()
    for name in names:  # exactly as before: what the test declared goes, what was there returns
        if name in cls.__dict__:
            delattr(cls, name)
    for name, value in before.items():
        setattr(cls, name, value)


def _supports_step_mode(pipe) -> bool:
    """The runner's own check at load (``DiffusionModelRunner._supports_step_mode``)."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    return DiffusionModelRunner._supports_step_mode(type("R", (), {"pipeline": pipe})())


def test_the_release_refuses_step_execution_for_sensenova_and_register_declares_it(
        checkpoint, bare_class):  # noqa: F811
    from vllm_omni.diffusion.sched.step_scheduler import StepScheduler

    from vllm_omni_graphdecode.core import loading

    pipe = _pipeline(checkpoint, cfg=False)
    assert not _supports_step_mode(pipe)  # load_model raises "step_execution=True requires ..."
    key_method = StepScheduler._build_sampling_params_key
    # What register() does where the engine and the worker import vllm-omni's modules.
    loading.install_model_hooks(_cfg())
    assert _supports_step_mode(pipe)
    assert bare_class.supports_request_cancellation is True
    assert StepScheduler._build_sampling_params_key is not key_method
    steps.undo_step_admission()
    assert StepScheduler._build_sampling_params_key is key_method


@pytest.mark.parametrize("env", [{"VLLM_OMNI_GRAPHDECODE": "qwen_image_21"},
                                 {"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                                  "VLLM_OMNI_GRAPHDECODE_SENSENOVA_BATCH": "off"}],
                         ids=["not_named", "batch_off"])
def test_without_the_plugin_for_sensenova_nothing_is_declared_or_widened(checkpoint,  # noqa: F811
                                                                         bare_class, env):
    from vllm_omni.diffusion.sched.step_scheduler import StepScheduler

    from vllm_omni_graphdecode import config
    from vllm_omni_graphdecode.core import loading

    key_method = StepScheduler._build_sampling_params_key
    loading.install_model_hooks(config.parse(env))
    assert not _supports_step_mode(_pipeline(checkpoint, cfg=False))
    assert StepScheduler._build_sampling_params_key is key_method


def test_the_denoiser_keeps_a_live_entry_for_every_branch_of_every_running_request(
        checkpoint):  # noqa: F811
    """--max-num-seqs 16 under step execution: up to 16 requests denoise at once, an edit with
    three branches; below that cap a branch would run eagerly for want of an entry."""
    from vllm_omni_graphdecode.hooks.sensenova_u1 import denoise, wiring

    cfg = _cfg(VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE="graph")
    pipe = _pipeline(checkpoint, cfg=cfg, rows=16)
    assert getattr(pipe, wiring.IMAGE_ATTR).graphs.max_entries == denoise.BRANCHES * 16 == 48
    pipe = _pipeline(checkpoint, cfg=cfg, rows=2)
    assert getattr(pipe, wiring.IMAGE_ATTR).graphs.max_entries == cfg.max_entries


def test_many_requests_through_the_steps_leave_no_thread_row_or_member_behind(server):
    """Forty short answers joining a running batch two at a time: every one answered, and when
    the last has left, no request runs on a thread, and no batch row or step member remains
    (the CPU side of the GPU test's flat device memory over 200 requests). The threads stay as
    idle workers for the next requests (``decode/batch/workers.py``)."""
    import threading

    from vllm_omni_graphdecode.decode.batch import workers

    srv = server()
    for n in range(40):
        srv.add(_request(900 + n, f"request number {n}", text=3 + n % 7))
        if n % 2:
            srv.tick()
    outputs = srv.run()
    assert len(outputs) == 40 and all(out.error is None for out in outputs.values())
    assert _members(srv) == {} and steps.requests_of(srv.pipe).ticks.members == []
    assert not any(getattr(srv.pipe, hook.STATE_ATTR).batch.decoder.rows)
    ours = [t.name for t in threading.enumerate() if t.name.startswith("graphdecode-")]
    assert all(name.startswith("graphdecode-worker-") for name in ours), ours
    assert len(ours) == workers.WORKERS.idle()
