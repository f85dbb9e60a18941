"""Where a SenseNova-U1 text request's time goes beyond its decode steps: one request of the
pipeline's own text loop (``_generate_text``) with the plugin installed, as the bench's
``sensenova_decode_ctxN_fp8_lmhead`` row times it, profiled with the host's phases named.
Prints JSON; writes ``text-request-timeline.json`` to --out.

    python benchmarks/probes/text_request_timeline.py --out DIR [--context 2048] [--steps 64] \
        [--old-eligibility FILE]

The bench row divides a whole request by its tokens; the graphed step alone, profiled inside its
replays, was 0.16-0.18 ms a token faster (h200-2026-12-03). What a request does besides its
steps (the hook's gate, loading the prefix into the paged buffers, the first launch, the serves,
the close) runs on the host while the GPU may wait. So each of those is wrapped in a
``torch.profiler.record_function`` range, one request is profiled, and every stretch of that
request in which the GPU runs nothing is charged to the innermost range the host was in when it
began ("loop" when in none of them: the pipeline's own Python between calls).

Fields: ``ms_per_token`` (requests timed as the bench times them, median), ``profiled_request_ms``,
``gpu_busy_ms``, ``gpu_idle_ms_by_phase``, ``host_ms_by_phase`` (each range's total),
``calls_by_phase``, ``first_kernel_after_ms`` and ``idle_after_last_kernel_ms``. With
``--old-eligibility`` (a copy of ``eligibility.py`` from before 6b3112a) the language model's walk
is timed both ways too (``walk_ms``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))
sys.path.insert(0, _BENCHMARKS)

import profile_step  # noqa: E402
from bench import sensenova_model  # noqa: E402
from vllm_omni_graphdecode import config
from vllm_omni_graphdecode.core import eligibility
from vllm_omni_graphdecode.decode import session, tiers, token_loop
from vllm_omni_graphdecode.hooks import sensenova_u1  # noqa: E402
from vllm_omni_graphdecode.testing import sensenova as rm  # noqa: E402

PHASES = ("gate", "open", "begin", "launch", "serve", "ar_step", "close", "detokenize")


def log(msg):
    print(f"[request timeline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _named(name, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapped


def instrument(pipe, wiring):
    """Wrap each phase in a named range; returns the function that undoes it."""
    undo = []

    def swap(owner, attr, name):
        own = vars(owner).get(attr)  # None: inherited (a class's method, seen on an instance)
        setattr(owner, attr, _named(name, getattr(owner, attr)))
        undo.append((owner, attr, own))

    swap(wiring.sessions, "gate", "gate")
    swap(session.ARSessions, "open", "open")
    swap(tiers.PagedDecoder, "begin", "begin")
    swap(token_loop.Lookahead, "_launch", "launch")
    swap(token_loop.Lookahead, "_serve", "serve")
    swap(session.Session, "close", "close")
    swap(pipe, "_ar_step", "ar_step")
    swap(pipe.tokenizer, "decode", "detokenize")

    def restore():
        for owner, attr, own in reversed(undo):
            if own is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)
    return restore


def timeline(trace: dict) -> dict:
    """GPU idle stretches of the profiled request, charged to the host phase they began in."""
    ranges = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and e.get("name") in PHASES + ("request",)
              and str(e.get("cat", "")).lower() in ("user_annotation", "cpu_op")]
    request = next(e for e in ranges if e["name"] == "request")
    start, end = float(request["ts"]), float(request["ts"]) + float(request["dur"])
    phases = [e for e in ranges if e["name"] != "request"]
    kernels = [e for e in profile_step.device_events(trace)
               if start <= e["ts"] and e["ts"] + e["dur"] <= end + 50_000]

    def phase_at(t):
        inner = None
        for e in phases:
            s = float(e["ts"])
            if s <= t < s + float(e["dur"]) and (inner is None or s >= float(inner["ts"])):
                inner = e
        return inner["name"] if inner else "loop"

    idle: dict[str, float] = {}
    cursor = start
    for k in kernels:
        if k["ts"] > cursor + 1.0:  # a stretch of at least 1 us with nothing running
            label = phase_at(cursor)
            idle[label] = idle.get(label, 0.0) + (k["ts"] - cursor)
        cursor = max(cursor, k["ts"] + k["dur"])
    host: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in phases:
        host[e["name"]] = host.get(e["name"], 0.0) + float(e["dur"])
        calls[e["name"]] = calls.get(e["name"], 0) + 1
    return {
        "profiled_request_ms": round((end - start) / 1e3, 3),
        "gpu_busy_ms": round(profile_step.busy_us(kernels) / 1e3, 3),
        "gpu_idle_ms_by_phase": {k: round(v / 1e3, 3) for k, v in sorted(idle.items())},
        "host_ms_by_phase": {k: round(v / 1e3, 3) for k, v in sorted(host.items())},
        "calls_by_phase": calls,
        "first_kernel_after_ms": round((kernels[0]["ts"] - start) / 1e3, 3) if kernels else None,
        "idle_after_last_kernel_ms": round(max(0.0, end - cursor) / 1e3, 3),
        "kernels": len(kernels),
    }


def walk_ms(old_path, lm) -> dict:
    spec = importlib.util.spec_from_file_location("eligibility_before", old_path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # its dataclasses look their module up there
    spec.loader.exec_module(old)
    out = {"modules": sum(1 for _ in lm.modules())}
    for name, scan in (("before", old.scan), ("now", eligibility.scan)):
        scan(lm, "language_model")
        times = []
        for _ in range(20):
            t = time.perf_counter()
            scan(lm, "language_model")
            times.append((time.perf_counter() - t) * 1e3)
        out[name] = round(statistics.median(times), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--old-eligibility", default=None)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    lm, tok = sensenova_model()
    if rm.has_intree_paged_decode():
        os.environ["VLLM_OMNI_SENSENOVA_PAGED_DECODE"] = "0"
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                        "VLLM_OMNI_GRAPHDECODE_FA_VERSION": "3",
                        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
                        "VLLM_OMNI_GRAPHDECODE_PRECAPTURE": "0",
                        "VLLM_OMNI_GRAPHDECODE_FP8": "sensenova_decode,sensenova_lm_head"})
    pipe = rm.build_pipeline(lm, tok, device="cuda")
    summary = sensenova_u1.install(pipe, cfg)
    wiring = getattr(pipe, sensenova_u1.STATE_ATTR)
    ctx, steps = args.context, args.steps
    prefix_logits, make_cache = rm.random_prefix(lm, ctx, seed=ctx)

    def request(cache):
        with torch.inference_mode():
            pipe._generate_text(prefix_logits, cache, ctx - 1, max_tokens=steps)

    for _ in range(2):  # capture, then one warm request
        request(make_cache())
    per_token = []
    for _ in range(args.requests):
        cache = make_cache()
        torch.cuda.synchronize()
        t = time.perf_counter()
        request(cache)
        torch.cuda.synchronize()
        per_token.append((time.perf_counter() - t) * 1e3 / steps)
    restore = instrument(pipe, wiring)
    try:
        cache = make_cache()
        torch.cuda.synchronize()

        def one():
            with torch.profiler.record_function("request"):
                request(cache)

        trace = profile_step.profile(one, 1)
    finally:
        restore()
    result = {"context": ctx, "steps": steps, "install": summary,
              "tokens_per_launch": cfg.tokens_per_launch,
              "ms_per_token": round(statistics.median(per_token), 4),
              "ms_per_token_runs": [round(x, 4) for x in per_token], **timeline(trace)}
    if args.old_eligibility:
        result["walk_ms"] = walk_ms(args.old_eligibility, lm)
    log(json.dumps(result))
    with open(os.path.join(args.out, "text-request-timeline.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
