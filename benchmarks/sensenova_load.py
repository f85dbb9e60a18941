"""SenseNova-U1 under a Poisson request load over HTTP, as vLLM's ``benchmark_serving.py`` loads a
server: latency and throughput against request rate for the release, the plugin's request
batching and its continuous batching (``--step-execution``), the same seeded trace for each.

    python3 benchmarks/sensenova_load.py --out benchmarks/results/<folder> --rates 0.1,0.4 --n 40
                                         [--sides release,request,step] [--seed 0] [--alone 2]
                                         [--checkpoint DIR] [--tiny]

One server per side, one after the other on the same GPU, each ``vllm serve MODEL --omni
--model-class-name SenseNovaU1Pipeline`` as users start it (through ``tests/e2e_serve.py
--scenario sensenova_trace``, the ``openai`` client), meeting the trace at each rate of
``--rates`` in turn, as ``benchmark_serving.py`` is run at one rate after another against one
server (a rate's trace starts once every request of the one before is answered):

- ``release``: ``VLLM_OMNI_GRAPHDECODE=0``, ``--max-num-seqs 1`` (vllm-omni 0.30 as released:
  its in-tree paged decode, one request at a time).
- ``request``: ``VLLM_OMNI_GRAPHDECODE=1``, ``--max-num-seqs 8 --request-batch-max-wait-ms 100``:
  the plugin's request batching (the requests the engine hands one ``forward`` decode as rows of
  one batched step; a forward's batch is fixed once it starts).
- ``step``: ``VLLM_OMNI_GRAPHDECODE=1``, ``--step-execution --max-num-seqs 16``: the plugin's
  continuous batching (requests join and leave the running batch at every step).
- ``step_rr`` (only when named): ``step`` with every denoising request's step in every server
  step, one each (``..._SENSENOVA_DENOISE_ORDER=round_robin``,
  ``..._SENSENOVA_DENOISE_BESIDE_DECODE=all``): what the order and the limit change.

The trace (``e2e_serve.poisson_trace``, the same list for every side: a pure function of
``--n``, ``--seed``, the rate and the prompt length): ``--n`` requests, the first sent at 0 and
each next after an exponential gap of mean 1/rate; half text answers (``--text-prompt-chars``
bytes of prompt, ``--text-tokens`` greedy tokens), a quarter think text-to-image requests and a
quarter plain ones (think off), ``--size`` square, ``--steps`` steps, the pipeline's CFG 4, the
think requests 1,024 think tokens (the checkpoint's end tokens are silenced), in an order drawn
from the seed. One seed at two rates gives the same requests, the offsets scaled. Each server
first answers one request of each kind, untimed (first-call compiles and captures); then, at
each rate, every request is sent at its offset from a thread of its own, whether or not earlier
ones have been answered; then the first ``--alone`` requests of each kind are sent again, one at
a time.

What is measured, per side, rate and kind (``text``, ``think_image``, ``image``, and ``all``):

- ``throughput_rps``: requests of that kind answered without error, divided by the trace's wall
  time (first send to last answer, every kind together: the kinds' figures add up to ``all``'s);
- ``p50_ms``, ``p90_ms``, ``p99_ms``: end-to-end latency as the client saw it (the HTTP round
  trip, send to the whole answer), over the requests answered; ranks as ``common.percentiles``
  takes them (the element at ``round(q * (count - 1))`` of the sorted values, p50 the upper
  middle);
- ``completed``, ``errors``; ``send_late_ms_max``: how far the client sent a request after its
  offset (a few ms; more means the figures are not at the asked rate);
- ``alone``: each of those first ``--alone`` per kind against its own answer in the trace, on the
  same server, at each rate (``equal`` of ``compared``; ``differ`` names the request and the
  parts that differ). The release serves one request at a time whatever arrives, so its count
  checks that the server is deterministic; the plugin sides' counts check that batching, and
  requests joining and leaving a running batch, leave every answer as the request alone gets
  it. Text answers are compared whole (sha256 of the text), images by the sha256 of their uint8
  array, a think image's think text as well;
- ``same_as_release`` (the plugin sides): each request's answer against the release's answer to
  the same request at the same rate, where both are in the file: reported, not required (the
  plugin's decode is not the release's kernels).

Written to ``OUT/sensenova-load.json`` after every server: ``environment`` (versions, the GPU,
every command, the checkpoint), ``trace`` (its parameters; a later call into the same ``--out``
must use the same ones), ``runs[side][rate]`` (the server's ``serve_args`` and plugin
``env``, ``machine``: the GPU and versions it ran on, since the sides of one file may run in
separate calls; the driver's exit code and seconds, ``summary`` as above, ``requests``: each
trace request's kind, ``offset_s``, ``sent_s``, ``done_s``, ``latency_s``, answer or
``error``, its prompt left out (``poisson_trace`` rebuilds it), ``alone`` likewise, the plugin's ``counters`` and
``fallbacks`` summed over the server's processes and its whole run, every rate's), and
``summary`` (one row per side, rate and kind, the equality counts, and ``targets``: issue #41's
ratios at each rate the step side ran, ``targets()``), which is also printed.
Each server's own folder (``OUT/<side>-rate<rates>/``, e.g. ``step-rate0.1+0.4``) keeps the
driver's ``result.json``, ``server.log`` and ``driver.log``; ``seconds`` is that server's whole
run.
Then ``OUT/latency-vs-rate.png`` (``plot_load.py``: p50 and p99 against rate, a panel per kind).
Exits 1 when a server's driver did (a request failed, or the server did not start).

Sides and rates may run in separate calls into one ``--out`` (``--sides step --rates 0.4``),
each adding its runs to the file (each run records its GPU and versions): a device call's time
limit fits one server at a time. Each server takes its start (about 1.5 minutes at the released
shape on a warm host; FA2's JIT adds 2-2.6 minutes once on a cold one) and its warm-ups once,
then per rate the arrivals (n / rate: 400 s at 0.1 and 40 requests, 100 s at 0.4) and the
backlog left at the last arrival, then the alone requests (on an H100, with 40 requests, a
plugin server's whole run took 242-250 s at 0.4 and 401 s at 0.15; the checkpoint, written once
a machine, 34 s more). The release's capacity
for this mix is about 0.2 requests a second on one H200 (from the committed single-request
figures: a think request 11.3 s, a plain one 4.3 s, a 256-token text answer about 1.8 s; mean
4.8 s): the default rates, 0.1 and 0.4, are one below it and one above.

The checkpoint (``--checkpoint``, written there unless complete; ``sensenova_serve.py``'s): the
released shape with random bf16 weights drawn on the GPU, the byte-level tokenizer, end tokens
silenced so that every think runs 1,024 tokens and every text answer to its limit. ``--tiny``:
the tiny checkpoint's shape, for a quick run of the whole path (``--size`` a multiple of 16, e.g.
``--tiny --size 32 --steps 2 --text-tokens 16 --rates 2,8 --n 8``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import plot_load  # noqa: E402 - the picture
import sensenova_serve as serve  # noqa: E402 - the checkpoint, the driver, the counters

FILE = "sensenova-load.json"
KINDS = ("text", "think_image", "image")
ANSWER_PARTS = ("text_sha256", "think_sha256", "image_sha256")  # what "the same answer" compares


@dataclasses.dataclass(frozen=True)
class Side:
    plugin: bool  # VLLM_OMNI_GRAPHDECODE=1
    serve_args: tuple[str, ...]  # after serve.MODEL_ARGS
    env: tuple[tuple[str, str], ...] = ()  # more of the plugin's variables


STEP_ARGS = serve.STEP_ARGS
SIDES = {
    "release": Side(False, ("--max-num-seqs", "1")),
    "request": Side(True, ("--max-num-seqs", "8", "--request-batch-max-wait-ms", "100")),
    "step": Side(True, STEP_ARGS),
    # Step mode as it ticked before the denoising order and limit: every denoising request's
    # step in every server step, one each (named only: not among the default sides).
    "step_rr": Side(True, STEP_ARGS, (("VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_ORDER",
                                       "round_robin"),
                                      ("VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_BESIDE_DECODE",
                                       "all"))),
}
DEFAULT_SIDES = ("release", "request", "step")


def log(msg):
    print(f"[sensenova-load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rate_key(rate: float) -> str:
    """A rate as the file's keys and folders spell it: 0.05 -> "0.05", 2.0 -> "2"."""
    return f"{rate:g}"


def trace_params(args) -> dict:
    """What makes two runs meet the same trace and the same requests (rates aside)."""
    return {"n": args.n, "seed": args.seed, "size": args.size, "steps": args.steps,
            "text_tokens": args.text_tokens, "text_prompt_chars": args.text_prompt_chars,
            "alone": args.alone, "tiny": args.tiny}


# -- one server ------------------------------------------------------------------------------

def trace_step(rate: float) -> str:
    """The driver's step of the trace at ``rate`` (``tests/e2e_serve.py``'s ``trace_step``)."""
    return f"sensenova_trace_rate{rate_key(rate)}"


def run_server(side: str, rates: list[float], args, checkpoint: str) -> dict:
    """One server for ``side``, the trace at each of ``rates`` in turn against it; the driver's
    ``result.json`` (under ``result``, for ``record_run``), its exit code and time."""
    keys = [rate_key(r) for r in rates]
    out = os.path.join(args.out, f"{side}-rate{'+'.join(keys)}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_OMNI_GRAPHDECODE") and k != "VLLM_PLUGINS"}
    env["PYTHONUNBUFFERED"] = "1"
    env["VLLM_OMNI_GRAPHDECODE"] = "1" if SIDES[side].plugin else "0"
    if SIDES[side].plugin:
        env["VLLM_OMNI_GRAPHDECODE_STATS_FILE"] = os.path.join(out, "stats-{pid}.json")
        env.update(SIDES[side].env)
    serve_args = list(serve.MODEL_ARGS) + list(SIDES[side].serve_args)
    cmd = [sys.executable, serve.DRIVER, "--scenario", "sensenova_trace", "--model", checkpoint,
           "--out", out, "--trace-rate", ",".join(keys), "--trace-n", str(args.n),
           "--trace-seed", str(args.seed), "--trace-alone", str(args.alone),
           "--image-size", str(args.size), "--sensenova-steps", str(args.steps),
           "--text-tokens", str(args.text_tokens),
           "--text-prompt-chars", str(args.text_prompt_chars),
           "--init-timeout", str(args.init_timeout),
           "--request-timeout", str(args.request_timeout)] + [f"--serve-arg={a}"
                                                               for a in serve_args]
    rc, took, result = serve.run_driver(cmd, env, out, f"{side} at {', '.join(keys)}/s")
    return {"rc": rc, "seconds": took, "dir": os.path.basename(out), "serve_args": serve_args,
            "env": {k: v for k, v in env.items() if k.startswith("VLLM_OMNI_GRAPHDECODE")},
            "result": result}


def _requests(result: dict | None, step: str) -> list[dict] | None:
    entry = (((result or {}).get("requests") or {}).get(step)) or {}
    return entry.get("requests")


def record_run(run: dict, rate: float) -> dict:
    """What the file keeps of ``run_server``'s answer at ``rate``: the driver's result reduced
    to the summary, each request's record without its prompt, and the plugin's counters (the
    server's, every rate's)."""
    result = run.get("result")
    kept = {k: v for k, v in run.items() if k != "result"}
    kept["summary"] = summarize(result, rate)
    for name, step in (("requests", trace_step(rate)), ("alone", "sensenova_trace_alone")):
        records = _requests(result, step)
        kept[name] = None if records is None else [
            {k: v for k, v in r.items() if k != "prompt"} for r in records]
    kept["counters"] = serve.counters(run)
    kept["fallbacks"] = serve.counters(run, "fallbacks")
    return kept


# -- the figures -----------------------------------------------------------------------------

def latency_ms(latencies_s: list[float]) -> dict:
    """p50, p90 and p99 of ``latencies_s`` in ms: ``common.percentiles``' ranks, p90 taken the
    way it takes p99; {} for none."""
    import common

    ms = sorted(1000 * s for s in latencies_s)
    if not ms:
        return {}
    out = common.percentiles(ms)
    p90 = ms[min(len(ms) - 1, int(round(0.90 * (len(ms) - 1))))]
    return {"p50_ms": round(out["p50"], 1), "p90_ms": round(p90, 1),
            "p99_ms": round(out["p99"], 1)}


def kind_summary(records: list[dict], wall_s: float) -> dict:
    """Requests, completed, errors, throughput (completed / ``wall_s``) and latency percentiles
    of ``records`` (the trace's, of one kind or all)."""
    done = [r for r in records if "error" not in r]
    out = {"requests": len(records), "completed": len(done), "errors": len(records) - len(done),
           "throughput_rps": round(len(done) / wall_s, 4) if wall_s else None}
    out.update(latency_ms([r["latency_s"] for r in done]))
    return out


def compare(records: list[dict], references: list[dict]) -> dict:
    """Each of ``records`` that ``references`` also holds (by the request's index ``i``), both
    answered, against it: ``equal`` of ``compared``; ``differ``: the request, its kind and the
    answer parts that differ; ``not_compared``: the indices where either errored; ``blank``: the
    text answers that are empty on both sides (not counted as compared: two empty strings are
    equal whatever tokens were picked, as at the released vocabulary before the checkpoint's
    tokenizer decoded every id)."""
    by_i = {r["i"]: r for r in references}
    out = {"compared": 0, "equal": 0, "differ": [], "not_compared": [], "blank": []}
    for r in records:
        ref = by_i.get(r["i"])
        if ref is None:
            continue
        if "error" in r or "error" in ref:
            out["not_compared"].append(r["i"])
            continue
        if r["kind"] == "text" and r.get("text_chars") == 0 and ref.get("text_chars") == 0:
            out["blank"].append(r["i"])
            continue
        out["compared"] += 1
        parts = [p for p in ANSWER_PARTS if r.get(p) != ref.get(p)]
        if parts:
            out["differ"].append({"i": r["i"], "kind": r["kind"], "parts": parts})
        else:
            out["equal"] += 1
    return out


def summarize(result: dict | None, rate: float) -> dict:
    """One server's figures at ``rate`` from the driver's ``result.json`` (module docstring):
    per kind and ``all``, the wall time, how late the sends were, and the alone requests'
    comparison (None when none were sent). ``error`` instead when no trace was recorded."""
    trace = (((result or {}).get("requests") or {}).get(trace_step(rate))) or {}
    records = trace.get("requests")
    if records is None:
        return {"error": trace.get("error") or (result or {}).get("error")
                or ("server " + str((result or {}).get("start", "not started")))}
    wall = trace["wall_s"]
    kinds = {kind: kind_summary([r for r in records if r["kind"] == kind], wall)
             for kind in KINDS}
    kinds["all"] = kind_summary(records, wall)
    alone = _requests(result, "sensenova_trace_alone")
    return {"wall_s": wall, "send_late_ms_max": round(1000 * trace["late_s_max"], 1),
            "kinds": kinds, "alone": None if alone is None else compare(records, alone)}


def rebuild(record: dict) -> None:
    """Each run's ``alone`` comparison again from its records, ``same_as_release`` for every
    plugin run whose rate the release ran too, and the ``summary`` rows, from whatever runs the
    file holds (a file written by an earlier version of ``compare`` is compared as today)."""
    runs = record["runs"]
    for side, by_rate in runs.items():
        for rate, run in by_rate.items():
            if run.get("requests") is not None and run.get("alone") is not None:
                run["summary"]["alone"] = compare(run["requests"], run["alone"])
            release = runs.get("release", {}).get(rate)
            if side != "release" and run.get("requests") is not None and release \
                    and release.get("requests") is not None:
                run["summary"]["same_as_release"] = compare(run["requests"], release["requests"])
    record["summary"] = summary(record)


def summary(record: dict) -> dict:
    """``rows``: side, rate, kind and its figures; ``equality``: per side and rate, the alone
    comparison and ``same_as_release`` as counts; ``failed``: the runs whose driver failed."""
    rows, equality, failed = [], [], []
    for side in [s for s in SIDES if s in record["runs"]]:
        by_rate = record["runs"][side]
        for rate in sorted(by_rate, key=float):
            run = by_rate[rate]
            if run.get("rc") != 0:
                failed.append({"side": side, "rate": float(rate), "rc": run.get("rc"),
                               "error": run["summary"].get("error")})
            kinds = run["summary"].get("kinds") or {}
            for kind in (*KINDS, "all"):
                if kind in kinds:
                    rows.append({"side": side, "rate": float(rate), "kind": kind,
                                 **kinds[kind], "wall_s": run["summary"]["wall_s"]})
            row = {"side": side, "rate": float(rate)}
            for name in ("alone", "same_as_release"):
                got = run["summary"].get(name)
                if got is not None:
                    row[name] = {"equal": got["equal"], "compared": got["compared"],
                                 "differ": [d["i"] for d in got["differ"]],
                                 "blank": got.get("blank", [])}
            equality.append(row)
    return {"rows": rows, "equality": equality, "failed": failed,
            "targets": targets(record["runs"])}


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def targets(runs: dict) -> list[dict]:
    """Issue #41's ratios at each rate the step side ran, from the file's figures (None where a
    figure is missing): ``text_p99_over_alone``, the step server's text p99 over the median of
    its own alone text answers; where request mode ran at the rate, ``think_image_`` and
    ``image_p99_over_request`` (step p99 over request mode's) and ``throughput_over_request``
    (all kinds' requests a second); where the release ran, ``throughput_over_release``."""
    out = []
    for rate, step in sorted((runs.get("step") or {}).items(), key=lambda kv: float(kv[0])):
        kinds = step["summary"].get("kinds") or {}
        alone = sorted(r["latency_s"] for r in step.get("alone") or []
                       if r["kind"] == "text" and "error" not in r)
        alone_ms = 1000 * alone[len(alone) // 2] if alone else None
        row = {"rate": float(rate), "alone_text_ms": alone_ms,
               "text_p99_over_alone": _ratio(kinds.get("text", {}).get("p99_ms"), alone_ms)}
        for other in ("request", "release"):
            theirs = ((runs.get(other) or {}).get(rate) or {}).get("summary", {}).get("kinds")
            if not theirs:
                continue
            if other == "request":
                for kind in ("think_image", "image"):
                    row[f"{kind}_p99_over_request"] = _ratio(
                        kinds.get(kind, {}).get("p99_ms"), theirs.get(kind, {}).get("p99_ms"))
            row[f"throughput_over_{other}"] = _ratio(
                kinds.get("all", {}).get("throughput_rps"),
                theirs.get("all", {}).get("throughput_rps"))
        out.append(row)
    return out


# -- the run ---------------------------------------------------------------------------------

def _floats(ap, name: str, value: str) -> list[float]:
    try:
        rates = [float(v) for v in value.split(",") if v]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 for r in rates):
        ap.error(f"{name} {value}: expected a comma list of rates > 0 (requests a second)")
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                    help=f"which servers to run now, in order ({', '.join(SIDES)})")
    ap.add_argument("--rates", default="0.1,0.4",
                    help="request rates (requests a second, comma list), in turn on one "
                         "server per side")
    ap.add_argument("--n", type=int, default=40, help="requests in the trace")
    ap.add_argument("--seed", type=int, default=0, help="the trace's seed (arrivals and kinds)")
    ap.add_argument("--alone", type=int, default=2, metavar="K",
                    help="after the trace, the first K requests of each kind again one at a "
                         "time, their answers compared")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--text-prompt-chars", type=int, default=500,
                    help="bytes of each text prompt (one token each; the template adds ~12)")
    ap.add_argument("--text-tokens", type=int, default=256)
    ap.add_argument("--checkpoint", default=None,
                    help="the serving checkpoint's folder (written there if not complete; "
                         "default: OUT/../sensenova-u1-serve-checkpoint)")
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint's shape")
    ap.add_argument("--device", default="cuda", help="where the checkpoint's weights are drawn")
    ap.add_argument("--init-timeout", type=int, default=600)
    ap.add_argument("--request-timeout", type=int, default=1800,
                    help="one request's limit, seconds (a backlog above capacity waits long)")
    ap.add_argument("--no-plot", action="store_true", help=f"do not draw {plot_load.PNG}")
    args = ap.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        ap.error(f"--sides {args.sides}: unknown {unknown}; accepted: {', '.join(SIDES)}")
    rates = _floats(ap, "--rates", args.rates)
    if args.n < 1 or args.alone < 0:
        ap.error(f"--n {args.n}, --alone {args.alone}: expected n >= 1 and K >= 0")
    if args.tiny and args.size % 16:
        ap.error(f"--size {args.size}: the tiny model needs a multiple of 16")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, FILE)
    record = {"environment": {}, "trace": trace_params(args), "runs": {}, "summary": {}}
    if os.path.exists(path):
        with open(path) as f:
            record = json.load(f)
        changed = {k: (record["trace"].get(k), v) for k, v in trace_params(args).items()
                   if record["trace"].get(k) != v}
        if changed:
            differ = ", ".join(f"{k} {old} there, {new} here" for k, (old, new) in changed.items())
            ap.error(f"{path} holds runs of another trace ({differ}): one trace for every side; "
                     "give another --out or the same arguments")
    checkpoint = args.checkpoint or os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                                 "sensenova-u1-serve-checkpoint")
    import common

    env = record["environment"]
    env.setdefault("commands", []).append(" ".join([os.path.basename(sys.executable)] + sys.argv))
    env["versions"] = common.versions()
    env["args"] = vars(args)
    env["checkpoint"] = serve.write_checkpoint(checkpoint, tiny=args.tiny, device=args.device)
    log(f"checkpoint: {env['checkpoint']}")
    import torch

    if torch.cuda.is_available():
        env.update(common.gpu_info())

    def write():
        rebuild(record)
        with open(path, "w") as f:
            json.dump(record, f, indent=2, default=str)

    write()
    ran = []
    machine = common.machine(env)  # each run's own
    for side in sides:
        served = run_server(side, rates, args, checkpoint)
        for rate in rates:
            record["runs"].setdefault(side, {})[rate_key(rate)] = record_run(served, rate) | {
                "machine": machine}
            ran.append((side, rate_key(rate)))
        write()
    if not args.no_plot and record["runs"]:
        record["plot"] = plot_load.plot(record, os.path.join(args.out, plot_load.PNG))
        write()
    print(json.dumps(record["summary"], indent=2))
    return 0 if all(record["runs"][s][r]["rc"] == 0 for s, r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
