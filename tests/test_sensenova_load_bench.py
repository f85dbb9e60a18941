"""CPU checks of the Poisson load benchmark (``benchmarks/sensenova_load.py``) and its driver
scenario (``tests/e2e_serve.py --scenario sensenova_trace``); the servers run on the GPU host only.

* the trace (``poisson_trace``) is a pure function: one seed, one list; another seed, another
  order and other arrival times; half text answers and a quarter each image kind (exact for n
  divisible by 4; otherwise each kind within one request of its share, the left-over requests
  to the largest remainders); offsets from 0, increasing, their mean gap about 1/rate; one seed
  at two rates: the same requests, the offsets scaled;
* the sending: a thread a request (one in flight never holds back a later one), send times in
  trace order and never before their offsets; against a stub server on loopback that echoes,
  the scenario records every request of the trace with its kind, latency and answer, warms up
  each kind first and sends the alone requests after, each body as vLLM-Omni's chat handler
  reads it (the plain image's think flag off);
* the figures from hand-written driver results: throughput, p50/p90/p99, errors, the alone and
  release comparisons, the rows; the main loop with a stand-in driver: each side's server
  arguments and environment, one file for every side and rate, a failed side's exit code, a
  second call adding to the file and one with another trace refused; ``--help`` of both scripts.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "e2e_serve.py")
BENCH = os.path.join(ROOT, "benchmarks", "sensenova_load.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import e2e_serve
import plot_load
import sensenova_load as load
import test_e2e_serve_cpu as serve_cpu  # its echo stub and vLLM-Omni's reading of a chat body


# ---------------------------------------------------------------------------------------------
# The trace
# ---------------------------------------------------------------------------------------------

def test_trace_is_the_same_for_one_seed_and_another_for_another_seed():
    a = e2e_serve.poisson_trace(0.2, 40, 0, prompt_chars=500)
    assert a == e2e_serve.poisson_trace(0.2, 40, 0, prompt_chars=500)
    b = e2e_serve.poisson_trace(0.2, 40, 1, prompt_chars=500)
    assert [r["kind"] for r in a] != [r["kind"] for r in b]
    assert [r["offset_s"] for r in a] != [r["offset_s"] for r in b]
    # the requests themselves (prompt and seed of request i) do not depend on the seed
    assert all(x["i"] == y["i"] and (x["kind"] != y["kind"] or x["prompt"] == y["prompt"])
               for x, y in zip(a, b))


@pytest.mark.parametrize("n", [4, 8, 40, 100])
def test_trace_is_half_text_a_quarter_think_images_a_quarter_plain_images_when_n_divides_by_4(n):
    kinds = [r["kind"] for r in e2e_serve.poisson_trace(1.0, n, 7)]
    assert (kinds.count("text"), kinds.count("think_image"), kinds.count("image")) == (
        n // 2, n // 4, n // 4)


def test_trace_mix_of_other_n_rounds_down_and_gives_the_rest_to_the_largest_remainders():
    """n times each share rounded down, then one each to the largest remainders, ties in the
    mix's order (text, think_image, image): every kind within one request of its share."""
    expected = {1: (1, 0, 0), 2: (1, 1, 0), 3: (1, 1, 1), 5: (3, 1, 1), 6: (3, 2, 1),
                7: (3, 2, 2), 41: (21, 10, 10), 42: (21, 11, 10)}
    for n, counts in expected.items():
        got = e2e_serve.mix_counts(n)
        assert (got["text"], got["think_image"], got["image"]) == counts, n
        kinds = [r["kind"] for r in e2e_serve.poisson_trace(1.0, n, 0)]
        assert tuple(kinds.count(k) for k in load.KINDS) == counts
    for n in range(1, 60):
        got = e2e_serve.mix_counts(n)
        assert sum(got.values()) == n
        assert abs(got["text"] - n / 2) < 1 and abs(got["image"] - n / 4) < 1
        assert abs(got["think_image"] - n / 4) < 1


def test_trace_offsets_start_at_zero_increase_and_their_mean_gap_is_about_one_over_rate():
    """400 requests at 2 a second: a fixed seed makes the mean gap one number (0.4856 s for
    seed 0, 0.4978 for seed 1); the bound, 1/rate within 20%, is ~4 standard deviations of a
    399-gap mean wide, and only guards against a wrong scale (1/rate squared, rate itself)."""
    for seed in (0, 1):
        offsets = [r["offset_s"] for r in e2e_serve.poisson_trace(2.0, 400, seed)]
        assert offsets[0] == 0.0
        assert all(b > a for a, b in zip(offsets, offsets[1:]))
        mean_gap = offsets[-1] / 399
        assert 0.4 <= mean_gap <= 0.6, mean_gap
    assert e2e_serve.poisson_trace(2.0, 400, 0)[-1]["offset_s"] / 399 == pytest.approx(0.4856,
                                                                                       abs=1e-4)


def test_one_seed_at_another_rate_is_the_same_requests_with_offsets_scaled():
    slow, fast = e2e_serve.poisson_trace(0.05, 40, 0), e2e_serve.poisson_trace(0.2, 40, 0)
    strip = [{k: v for k, v in r.items() if k != "offset_s"} for r in slow]
    assert strip == [{k: v for k, v in r.items() if k != "offset_s"} for r in fast]
    for s, f in zip(slow, fast):
        assert s["offset_s"] == pytest.approx(4 * f["offset_s"], rel=1e-12)


def test_trace_requests_have_distinct_prompts_and_image_seeds_of_the_asked_length():
    trace = e2e_serve.poisson_trace(1.0, 40, 0, prompt_chars=500)
    texts = [r for r in trace if r["kind"] == "text"]
    images = [r for r in trace if r["kind"] != "text"]
    assert all(len(r["prompt"].encode()) == 500 for r in texts)
    assert len({r["prompt"] for r in texts}) == len(texts)
    assert len({(r["prompt"], r["seed"]) for r in images}) == len(images)
    assert [r["i"] for r in trace] == list(range(40))


# ---------------------------------------------------------------------------------------------
# The sending
# ---------------------------------------------------------------------------------------------

def test_a_request_in_flight_never_holds_back_a_later_ones_sending():
    """Every request but the last waits for the last to have been sent: with fewer threads than
    requests the last would never go out (each wait gives up after 60 s and errors)."""
    trace = e2e_serve.poisson_trace(1e6, 6, 0)
    last_sent = threading.Event()

    def send(spec):
        if spec["i"] == len(trace) - 1:
            last_sent.set()
        elif not last_sent.wait(timeout=60):
            raise TimeoutError("the last request was never sent")
        return {"text": f"answer {spec['i']}", "s": 0.5}

    entry = e2e_serve.send_trace(trace, send)
    assert entry["errors"] == 0 and "error" not in entry, entry
    assert [r["i"] for r in entry["requests"]] == list(range(6))
    assert all(r["latency_s"] == 0.5 and r["text"] == f"answer {r['i']}"
               for r in entry["requests"])


def test_a_failed_request_is_recorded_and_the_others_still_answered():
    trace = e2e_serve.poisson_trace(1e6, 4, 0)

    def send(spec):
        if spec["i"] == 2:
            raise ConnectionError("refused")
        return {"text": "ok", "s": 0.1}

    entry = e2e_serve.send_trace(trace, send)
    assert entry["errors"] == 1
    assert entry["error"] == "1 of 4 requests failed; request 2: ConnectionError: refused"
    assert [("error" in r) for r in entry["requests"]] == [False, False, True, False]


class _TraceStub(serve_cpu._EchoStub):
    """The echo stub (text "echo: PROMPT", image every value its seed, think text "think:
    PROMPT"), keeping each body in arrival order (a list of its own)."""

    bodies: ClassVar[list] = []
    lock = threading.Lock()

    def do_POST(self):
        import io

        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            self.bodies.append(json.loads(body))
        self.rfile = io.BytesIO(body)
        super().do_POST()


TRACE_ARGV = ["--trace-rate", "1000,2000", "--trace-n", "8", "--trace-seed", "3",
              "--trace-alone", "1",
              "--image-size", "1024", "--sensenova-steps", "50", "--text-tokens", "256",
              "--text-prompt-chars", "500"]


@pytest.fixture(scope="module")
def trace_run(tmp_path_factory):
    """The ``sensenova_trace`` scenario against the echo stub: 8 requests at 1,000 a second (all
    offsets within milliseconds), the same 8 at 2,000 a second, then the first of each kind
    alone."""
    out = tmp_path_factory.mktemp("trace")
    _TraceStub.bodies.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TraceStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        args = e2e_serve.parse_args(["--scenario", "sensenova_trace", "--model", "tiny",
                                     "--out", str(out)] + TRACE_ARGV)
        rec = e2e_serve.Recorder(str(out), {"scenario": args.scenario})
        e2e_serve.run_sensenova_trace(rec, e2e_serve.make_client(url, 30), url, "tiny", args)
    finally:
        server.shutdown()
    result = json.loads((out / "result.json").read_text())
    trace = e2e_serve.poisson_trace(1000, 8, 3, prompt_chars=500)
    return result, list(_TraceStub.bodies), trace


RATES = (1000.0, 2000.0)


def _prompt(body: dict) -> str:
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else content[0]["text"]


def _echoed_image_sha256(seed: int) -> str:
    return hashlib.sha256(np.full((32, 32, 3), seed % 256, dtype=np.uint8).tobytes()).hexdigest()


def test_trace_scenario_records_every_request_with_its_kind_latency_and_answer(trace_run):
    result, _, trace = trace_run
    assert list(result["requests"]) == ["sensenova_trace_warmup", "sensenova_trace_rate1000",
                                        "sensenova_trace_rate2000", "sensenova_trace_alone"]
    for rate in RATES:
        entry = result["requests"][e2e_serve.trace_step(rate)]
        assert entry["errors"] == 0 and "error" not in entry
        assert (entry["rate"], entry["n"], entry["seed"]) == (rate, 8, 3)
        assert entry["counts"] == {"text": 4, "think_image": 2, "image": 2}
        assert isinstance(entry["wall_s"], float) and isinstance(entry["late_s_max"], float)
        # one seed at another rate: the same requests, the offsets scaled
        want = e2e_serve.poisson_trace(rate, 8, 3, prompt_chars=500)
        assert [{k: got[k] for k in spec} for spec, got in zip(want, entry["requests"])] == want
    entry = result["requests"]["sensenova_trace_rate1000"]
    assert len(entry["requests"]) == 8
    for spec, got in zip(trace, entry["requests"]):
        assert {k: got[k] for k in spec} == spec
        assert isinstance(got["latency_s"], float) and got["latency_s"] >= 0  # recorded
        assert got["done_s"] >= got["sent_s"]
        if spec["kind"] == "text":
            full = f"echo: {spec['prompt']}"
            assert got["text"] == full[:200] and got["text_chars"] == len(full)
            assert got["text_sha256"] == hashlib.sha256(full.encode()).hexdigest()
        else:
            assert got["image_sha256"] == _echoed_image_sha256(spec["seed"])
            assert got["image_shape"] == [32, 32, 3] and "image" not in got
            assert got["think_chars"] == len(f"think: {spec['prompt']}")


def test_trace_scenario_sends_in_trace_order_none_before_its_offset(trace_run):
    """The send times the client took: in trace order (each request dispatched only once the one
    before has taken its time) and never before the request's offset."""
    result, _, _ = trace_run
    for rate in RATES:
        records = result["requests"][e2e_serve.trace_step(rate)]["requests"]
        sent = [r["sent_s"] for r in records]
        assert sent == sorted(sent)
        assert all(r["sent_s"] >= round(r["offset_s"], 3) - 0.001 for r in records)


def test_trace_scenario_warms_up_each_kind_then_each_rates_trace_then_the_first_of_each_kind_alone(
        trace_run):
    """One warm-up per server, the trace at each rate in turn (the second starts once the first
    is answered: its bodies all come after the first's), then the alone requests."""
    result, bodies, trace = trace_run
    assert len(bodies) == 3 + 8 + 8 + 3
    warmups, traced, again, alone = bodies[:3], bodies[3:11], bodies[11:19], bodies[19:]
    assert sorted((_prompt(b), b["seed"]) for b in again) == sorted(
        (_prompt(b), b["seed"]) for b in traced)
    first = {}
    for spec in trace:
        first.setdefault(spec["kind"], spec)
    alone_specs = sorted(first.values(), key=lambda s: s["i"])
    # warm-ups and alone requests go one at a time: their order on the wire is known
    assert [b["modalities"] for b in warmups] == [["text"], ["image"], ["image"]]
    assert [b.get("think") for b in warmups] == [None, True, False]
    assert [_prompt(b) for b in alone] == [s["prompt"] for s in alone_specs]
    assert sorted((_prompt(b), b["seed"]) for b in traced) == sorted(
        (s["prompt"], s["seed"]) for s in trace)
    assert not {_prompt(b) for b in warmups} & {s["prompt"] for s in trace}
    recorded = result["requests"]["sensenova_trace_alone"]
    assert recorded["k"] == 1 and recorded["errors"] == 0
    assert [r["i"] for r in recorded["requests"]] == [s["i"] for s in alone_specs]


def test_trace_scenario_bodies_read_by_vllm_omni_as_asked_the_plain_image_with_think_off(
        trace_run):
    _, bodies, _ = trace_run
    kinds = {"text": 0, "think_image": 0, "image": 0}
    for body in bodies:
        request, extras, args = serve_cpu._diffusion_args(body, "SenseNovaU1Pipeline")
        if body["modalities"] == ["text"]:
            kinds["text"] += 1
            assert extras["max_tokens"] == 256 and "think" not in extras
            assert len(_prompt(body)) == 500
            continue
        kinds["think_image" if extras["think"] else "image"] += 1
        assert extras["think"] is body["think"]
        assert (args["height"], args["width"], args["num_inference_steps"]) == (1024, 1024, 50)
    assert kinds == {"text": 1 + 2 * 4 + 1, "think_image": 1 + 2 * 2 + 1,
                     "image": 1 + 2 * 2 + 1}


def test_trace_scenario_alone_answers_equal_the_traced_ones_on_an_echo_server(trace_run):
    result, _, _ = trace_run
    for rate in RATES:
        summary = load.summarize(result, rate)
        assert summary["alone"] == {"compared": 3, "equal": 3, "differ": [], "not_compared": [],
                                    "blank": []}
        assert summary["kinds"]["all"]["completed"] == 8
        assert summary["kinds"]["text"]["requests"] == 4


@pytest.mark.parametrize("value", ["0.1,x", "0", "0.2,-1", ""])
def test_driver_refuses_a_rate_that_is_not_above_zero_naming_it(value, capsys):
    with pytest.raises(SystemExit):
        e2e_serve.parse_args(["--scenario", "sensenova_trace", "--model", "tiny", "--out", "o",
                              "--trace-rate", value])
    assert f"--trace-rate {value}, " in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The figures
# ---------------------------------------------------------------------------------------------

def _rec(i, kind, latency=None, error=None, **answer):
    record = {"i": i, "kind": kind, "offset_s": float(i), "sent_s": float(i), "seed": 0,
              "prompt": "p"}
    if error:
        record["error"] = error
    else:
        record.update(latency_s=latency, done_s=i + latency, **answer)
    return record


TRACE = [_rec(0, "text", 1.0, text_sha256="t0"),
         _rec(1, "text", 3.0, text_sha256="t1"),
         _rec(2, "text", error="APITimeoutError: Request timed out."),
         _rec(3, "think_image", 8.0, think_sha256="k3", image_sha256="i3"),
         _rec(4, "image", 2.0, image_sha256="i4"),
         _rec(5, "think_image", 12.0, think_sha256="k5", image_sha256="i5")]
ALONE = [_rec(0, "text", 1.0, text_sha256="t0"),
         _rec(2, "text", 1.0, text_sha256="t2"),
         _rec(3, "think_image", 8.0, think_sha256="k3", image_sha256="other"),
         _rec(4, "image", 2.0, image_sha256="i4")]


def _result(trace=TRACE, alone=ALONE, wall=10.0, rates=(0.2,)):
    requests = {"sensenova_trace_warmup": {"requests": [], "errors": 0}}
    for rate in rates:
        requests[e2e_serve.trace_step(rate)] = {"wall_s": wall, "late_s_max": 0.0021,
                                                "requests": trace}
    if alone is not None:
        requests["sensenova_trace_alone"] = {"k": 2, "requests": alone}
    return {"start": "ready", "requests": requests,
            "final_stats": [{"counters": {"sensenova_u1.batch_forward": 3}, "fallbacks": {}}]}


def test_latency_percentiles_take_the_ranks_common_percentiles_takes():
    """1..100 s: p50 the upper middle (index 50), p90 index round(0.9 * 99) = 89, p99 index
    round(0.99 * 99) = 98."""
    assert load.latency_ms([float(s) for s in range(100, 0, -1)]) == {
        "p50_ms": 51000.0, "p90_ms": 90000.0, "p99_ms": 99000.0}
    assert load.latency_ms([]) == {}


def test_summary_of_a_hand_written_result_gives_the_hand_computed_figures():
    summary = load.summarize(_result(), 0.2)
    assert summary["wall_s"] == 10.0 and summary["send_late_ms_max"] == 2.1
    kinds = summary["kinds"]
    # text: 2 of 3 answered in 10 s; latencies 1 and 3 s -> the upper middle is 3 s
    assert kinds["text"] == {"requests": 3, "completed": 2, "errors": 1, "throughput_rps": 0.2,
                             "p50_ms": 3000.0, "p90_ms": 3000.0, "p99_ms": 3000.0}
    assert kinds["think_image"] == {"requests": 2, "completed": 2, "errors": 0,
                                    "throughput_rps": 0.2, "p50_ms": 12000.0,
                                    "p90_ms": 12000.0, "p99_ms": 12000.0}
    assert kinds["image"] == {"requests": 1, "completed": 1, "errors": 0, "throughput_rps": 0.1,
                              "p50_ms": 2000.0, "p90_ms": 2000.0, "p99_ms": 2000.0}
    # all: 1, 2, 3, 8, 12 s -> p50 index 2 (3 s), p90 index round(3.6) = 4, p99 index 4
    assert kinds["all"] == {"requests": 6, "completed": 5, "errors": 1, "throughput_rps": 0.5,
                            "p50_ms": 3000.0, "p90_ms": 12000.0, "p99_ms": 12000.0}
    # alone: 0 and 4 equal, 3's image differs, 2 failed in the trace, 1 and 5 were not sent
    assert summary["alone"] == {"compared": 3, "equal": 2,
                                "differ": [{"i": 3, "kind": "think_image",
                                            "parts": ["image_sha256"]}],
                                "not_compared": [2], "blank": []}
    assert load.summarize(_result(alone=None), 0.2)["alone"] is None
    assert load.summarize(_result(), 0.4) == {"error": "server ready"}  # no trace at 0.4


def test_empty_text_answers_on_both_sides_are_blank_not_compared_equal():
    """Two empty text answers say nothing about the tokens behind them: listed as blank, not
    counted; one empty against a non-empty one differs."""
    empty = hashlib.sha256(b"").hexdigest()
    trace = [_rec(0, "text", 1.0, text_sha256=empty, text_chars=0),
             _rec(1, "text", 1.0, text_sha256=empty, text_chars=0),
             _rec(4, "image", 2.0, image_sha256="i4")]
    alone = [_rec(0, "text", 1.0, text_sha256=empty, text_chars=0),
             _rec(1, "text", 1.0, text_sha256="t1", text_chars=5),
             _rec(4, "image", 2.0, image_sha256="i4")]
    assert load.compare(trace, alone) == {
        "compared": 2, "equal": 1, "not_compared": [], "blank": [0],
        "differ": [{"i": 1, "kind": "text", "parts": ["text_sha256"]}]}


def test_summary_of_a_server_that_never_served_says_why():
    assert load.summarize({"start": "timeout", "requests": {}}, 0.2) == {
        "error": "server timeout"}
    assert load.summarize(None, 0.2) == {"error": "server not started"}
    failed = {"start": "ready", "requests": {"sensenova_trace_rate0.2": {
        "error": "RuntimeError: boom", "traceback": "..."}}}
    assert load.summarize(failed, 0.2) == {"error": "RuntimeError: boom"}


def _run(side, trace=TRACE, rc=0):
    return load.record_run({"rc": rc, "seconds": 1.0, "dir": f"{side}-rate0.2",
                            "serve_args": list(load.SIDES[side].serve_args), "env": {},
                            "result": _result(trace)}, 0.2)


def test_rows_and_equality_of_every_side_and_the_plugin_sides_against_the_release():
    step_trace = [dict(r) for r in TRACE]
    step_trace[1]["text_sha256"] = "t1 otherwise"
    record = {"runs": {"release": {"0.2": _run("release")},
                       "step": {"0.2": _run("step", step_trace, rc=1), "0.05": _run("step")}}}
    load.rebuild(record)
    step = record["runs"]["step"]["0.2"]
    assert "prompt" not in step["requests"][0] and step["counters"] == {
        "sensenova_u1.batch_forward": 3}
    assert step["summary"]["same_as_release"] == {
        "compared": 5, "equal": 4, "differ": [{"i": 1, "kind": "text", "parts": ["text_sha256"]}],
        "not_compared": [2], "blank": []}
    assert "same_as_release" not in record["runs"]["step"]["0.05"]["summary"]  # no release there
    assert "same_as_release" not in record["runs"]["release"]["0.2"]["summary"]
    summary = record["summary"]
    assert [(r["side"], r["rate"], r["kind"]) for r in summary["rows"]] == [
        (side, rate, kind) for side, rate in (("release", 0.2), ("step", 0.05), ("step", 0.2))
        for kind in ("text", "think_image", "image", "all")]
    assert summary["rows"][3] == {"side": "release", "rate": 0.2, "kind": "all",
                                  **load.summarize(_result(), 0.2)["kinds"]["all"],
                                  "wall_s": 10.0}
    assert summary["equality"][2] == {"side": "step", "rate": 0.2,
                                      "alone": {"equal": 2, "compared": 3, "differ": [3],
                                                "blank": []},
                                      "same_as_release": {"equal": 4, "compared": 5,
                                                          "differ": [1], "blank": []}}
    assert summary["failed"] == [{"side": "step", "rate": 0.2, "rc": 1, "error": None}]
    json.dumps(record)


def test_targets_are_the_step_sides_ratios_to_its_lone_text_answer_request_mode_and_release():
    """Step: text p99 3 s, think p99 12 s, plain p99 2 s, 0.5 requests a second; its lone text
    answers took 1 s (median of 1 and 1 s). Request mode at 0.2: every latency 4x, one request
    fewer answered (0.4 a second). Release at 0.2: the step's figures."""
    slow = [dict(r, latency_s=4 * r["latency_s"]) if "latency_s" in r else dict(r)
            for r in TRACE]
    slow[4] = dict(slow[4], error="APITimeoutError: Request timed out.")
    record = {"runs": {"release": {"0.2": _run("release")},
                       "request": {"0.2": _run("request", slow)},
                       "step": {"0.2": _run("step"), "0.05": _run("step")}}}
    load.rebuild(record)
    assert record["summary"]["targets"] == [
        {"rate": 0.05, "alone_text_ms": 1000.0, "text_p99_over_alone": 3.0},
        {"rate": 0.2, "alone_text_ms": 1000.0, "text_p99_over_alone": 3.0,
         "think_image_p99_over_request": 0.25, "image_p99_over_request": None,
         "throughput_over_request": 1.25, "throughput_over_release": 1.0}]
    assert load.targets({"request": {"0.2": _run("request")}}) == []  # no step side


def test_plot_series_are_p50_and_p99_per_side_and_kind_rates_ascending():
    record = {"runs": {"step": {"0.2": _run("step"), "0.05": _run("step")},
                       "release": {"0.2": _run("release"),
                                   "0.4": {"summary": {"error": "server timeout"}}}}}
    lines = plot_load.series(record)
    assert list(lines) == ["all", "text", "think_image", "image"]
    assert list(lines["all"]) == ["release", "step"]
    assert lines["all"]["step"] == {"rates": [0.05, 0.2], "p50_ms": [3000.0, 3000.0],
                                    "p99_ms": [12000.0, 12000.0]}
    assert lines["image"]["release"] == {"rates": [0.2], "p50_ms": [2000.0], "p99_ms": [2000.0]}
    assert plot_load.plot({"runs": {}}, "unused.png") == {
        "skipped": "no run has latencies to draw"}


def test_plot_draws_a_png():
    import tempfile

    from PIL import Image

    record = {"trace": {"n": 6, "seed": 0, "size": 1024, "steps": 50},
              "runs": {"release": {"0.2": _run("release"), "0.05": _run("release")},
                       "step": {"0.2": _run("step")}}}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.png")
        assert plot_load.plot(record, path) == {"png": path}
        with Image.open(path) as image:
            assert image.format == "PNG"
            colours = {c for _, c in image.getcolors(maxcolors=1 << 16)}
        # Both sides' lines are drawn, in their colours.
        for side in ("release", "step"):
            assert tuple(int(plot_load.COLOURS[side][i:i + 2], 16) for i in (1, 3, 5)) in colours


# ---------------------------------------------------------------------------------------------
# The main loop, the command lines
# ---------------------------------------------------------------------------------------------

def test_help_lists_the_new_scenario_and_options():
    driver = subprocess.run([sys.executable, DRIVER, "--help"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert driver.returncode == 0, driver.stderr
    for word in ("sensenova_trace", "--trace-rate", "--trace-n", "--trace-seed", "--trace-alone"):
        assert word in driver.stdout
    bench = subprocess.run([sys.executable, BENCH, "--help"], capture_output=True, text=True,
                           timeout=60, check=False)
    assert bench.returncode == 0, bench.stderr
    text = " ".join(bench.stdout.split())  # argparse wraps its lines
    for word in ("--sides", "--rates", "--n", "--seed", "--alone", "--tiny", "--checkpoint",
                 "(release, request, step, step_rr)"):
        assert word in text


@pytest.mark.parametrize("argv, message", [
    (["--sides", "release,turbo"],
     "--sides release,turbo: unknown ['turbo']; accepted: release, request, step"),
    (["--rates", "0.05,x"], "--rates 0.05,x: expected a comma list of rates > 0"),
    (["--rates", "0"], "--rates 0: expected a comma list of rates > 0"),
    (["--tiny", "--size", "40"], "--size 40: the tiny model needs a multiple of 16"),
])
def test_bad_arguments_name_the_value_and_what_is_accepted(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        load.main(["--out", str(tmp_path)] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_main_runs_every_side_and_rate_through_the_driver_into_one_file(tmp_path, monkeypatch,
                                                                      capsys):
    """The driver stood in for by a function writing what it would (every request answered in
    1 s, the step side's server failed): one server per side meeting every rate in turn, its
    arguments and environment, one trace for all, one file, exit 1; a later call adds a rate;
    one with another trace is refused."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")  # complete: not written again
    calls = []

    def driver(cmd, env, stdout, stderr, cwd, check):
        assert cmd[1] == load.serve.DRIVER
        args = e2e_serve.parse_args(cmd[2:])
        calls.append((args, {k: v for k, v in env.items() if k.startswith("VLLM_OMNI")}))
        result = _result(alone=None, rates=())
        for rate in args.trace_rates:
            trace = e2e_serve.poisson_trace(rate, args.trace_n, args.trace_seed,
                                            prompt_chars=args.text_prompt_chars)
            records = [dict(s, sent_s=s["offset_s"], latency_s=rate, done_s=s["offset_s"] + 1,
                            text_sha256=str(s["i"])) for s in trace]
            result["requests"][e2e_serve.trace_step(rate)] = {
                "wall_s": records[-1]["done_s"], "late_s_max": 0.0, "requests": records}
            result["requests"]["sensenova_trace_alone"] = {"k": 2, "requests": records[:2]}
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
        failed = "--step-execution" in args.serve_arg
        return subprocess.CompletedProcess(cmd, 1 if failed else 0)

    monkeypatch.setattr(load.serve.subprocess, "run", driver)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--checkpoint", str(ckpt), "--n", "8", "--seed", "5", "--no-plot"]
    assert load.main(argv) == 1
    record = json.loads((out / load.FILE).read_text())
    assert {side: sorted(runs) for side, runs in record["runs"].items()} == {
        "release": ["0.1", "0.4"], "request": ["0.1", "0.4"], "step": ["0.1", "0.4"]}
    model_args = ["--model-class-name", "SenseNovaU1Pipeline"]
    assert [(a.serve_arg, env["VLLM_OMNI_GRAPHDECODE"], "VLLM_OMNI_GRAPHDECODE_STATS_FILE" in env)
            for a, env in calls] == [
        (model_args + ["--max-num-seqs", "1"], "0", False),
        (model_args + ["--max-num-seqs", "8", "--request-batch-max-wait-ms", "100"], "1", True),
        (model_args + ["--step-execution", "--max-num-seqs", "16"], "1", True)]
    assert [a.trace_rates for a, _ in calls] == [[0.1, 0.4]] * 3  # one server a side
    assert {(a.scenario, a.trace_n, a.trace_seed, a.trace_alone, a.image_size, a.text_tokens,
             a.sensenova_steps, a.text_prompt_chars) for a, _ in calls} == {
        ("sensenova_trace", 8, 5, 2, 1024, 256, 50, 500)}
    step = record["runs"]["step"]["0.1"]
    assert step["serve_args"] == model_args + ["--step-execution", "--max-num-seqs", "16"]
    assert step["summary"]["kinds"]["all"]["completed"] == 8
    assert step["summary"]["same_as_release"]["equal"] == 8
    assert step["summary"]["alone"]["equal"] == 2
    # each rate's figures are its own trace's (the stub's latency is the rate)
    assert {rate: run["summary"]["kinds"]["all"]["p50_ms"]
            for rate, run in record["runs"]["request"].items()} == {"0.1": 100.0, "0.4": 400.0}
    assert step["dir"] == record["runs"]["step"]["0.4"]["dir"] == "step-rate0.1+0.4"
    # each run names the machine and versions it ran on (runs of one file may come from calls
    # on other machines)
    assert step["machine"]["versions"] == record["environment"]["versions"]
    assert set(step["machine"]) == {"gpu", "memory_mib", "driver", "versions"}
    assert record["summary"]["failed"] == [{"side": "step", "rate": rate, "rc": 1, "error": None}
                                           for rate in (0.1, 0.4)]
    assert len(record["summary"]["rows"]) == 3 * 2 * 4
    assert record["trace"] == {"n": 8, "seed": 5, "size": 1024, "steps": 50, "text_tokens": 256,
                               "text_prompt_chars": 500, "alone": 2, "tiny": False}
    # a later call adds its rate to the same file
    assert load.main(argv + ["--sides", "request", "--rates", "0.2"]) == 0
    record = json.loads((out / load.FILE).read_text())
    assert sorted(record["runs"]["request"]) == ["0.1", "0.2", "0.4"]
    assert len(record["environment"]["commands"]) == 2
    with pytest.raises(SystemExit) as exc:
        load.main(argv[:-5] + ["--n", "9", "--seed", "5", "--no-plot"])
    assert exc.value.code == 2
    assert "holds runs of another trace (n 8 there, 9 here)" in capsys.readouterr().err


@pytest.mark.parametrize("side, expected", [
    ("step", {}),
    ("step_rr", {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_ORDER": "round_robin",
                 "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_BESIDE_DECODE": "all"}),
    ("release", {}),
])
def test_each_side_starts_its_server_with_its_variables_and_no_others(tmp_path, monkeypatch,
                                                                      side, expected):
    import argparse

    seen = {}

    def run_driver(cmd, env, out, what):
        seen.update(cmd=cmd, env=env)
        return 0, 1.0, {}

    monkeypatch.setattr(load.serve, "run_driver", run_driver)
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_ORDER", "fcfs")  # not passed on
    args = argparse.Namespace(out=str(tmp_path), n=4, seed=0, alone=1, size=64, steps=2,
                              text_tokens=8, text_prompt_chars=40, init_timeout=10,
                              request_timeout=10)
    run = load.run_server(side, [0.5, 2.0], args, "/checkpoint")
    plugin = {k: v for k, v in seen["env"].items() if k.startswith("VLLM_OMNI_GRAPHDECODE")}
    assert plugin.pop("VLLM_OMNI_GRAPHDECODE") == ("0" if side == "release" else "1")
    plugin.pop("VLLM_OMNI_GRAPHDECODE_STATS_FILE", None)
    assert plugin == expected and run["env"]["VLLM_OMNI_GRAPHDECODE"]
    assert ("--serve-arg=--step-execution" in seen["cmd"]) == side.startswith("step")
    assert seen["cmd"][seen["cmd"].index("--trace-rate") + 1] == "0.5,2"
