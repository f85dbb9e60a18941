"""SenseNova-U1 under load: N requests through one ``forward`` (the plugin's batched decode)
against the release serving the same requests one at a time (issue #22).

    python3 benchmarks/sensenova_batch.py --out DIR [--cases step,text,think,overlap,wave,memory] [--n 8]
                                          [--think-ns 1,2,4,16] [--tiny]

Everything goes through ``SenseNovaU1Pipeline.forward`` with a real ``DiffusionRequestBatch``, as
vLLM-Omni's runner calls it, at the released shape with random weights
(``sensenova_request.build_real_pipeline``; ``--tiny``: the tiny checkpoint, any device). One
process, one pipeline object: the release's side first (vllm-omni 0.30: its in-tree paged decode,
on by default; earlier releases: the eager loop), one request after another as its engine runs
them (``--max-num-seqs`` above 1 is refused for this pipeline), then the plugin wired on the same
object for a server started with ``--max-num-seqs ROWS`` (``ROWS`` = the largest N asked for),
every request of a case in one ``forward``.

Cases (rows of ``sensenova-batch.json``):

- ``sensenova_batch_decode_step_b8`` (``step``): one decode step at context ``--context``:
  ``eager_ms`` the plugin's batch-1 path (FA3, fused step, 8 tokens a launch; ms per token),
  ``ours_ms`` the batched path with 8 rows decoding (ms per step of all 8); also ``_b1`` and
  ``_b16`` (the batched path with 1 and 16 rows). ``--profile-rows 8,16``: those row counts'
  steps also run once under torch.profiler (``sensenova_batch_step_profile_b{N}`` rows; the
  whole report, kernels by category and the linear layers by position, in
  ``profile-batch-b{N}.json``). ``--step-mode rowgemv``: the batched step's linear layers
  through the plugin's 16-row GEMM (``ops/rows_gemm.py``), names ending in ``_rowgemv``; the
  batch-1 side stays the cuBLAS fused step, so a run with it and one without, on one machine,
  compare through ``ours_ms``. ``--row-launches plain|dependent`` with it: that GEMM's launches
  plain or programmatic dependent ones (names ending in ``_plain`` / ``_dependent``), the A/B
  of ``rows_gemm``'s ``pdl``.
- ``sensenova_batch_text_n{N}`` (``text``): N text answers, ``--text-prompt``-token prompts,
  ``--text-tokens`` tokens each (end tokens can never win: their lm_head rows are zero).
- ``sensenova_batch_think_t2i_{size}_n{N}`` (``think``): N think text-to-image requests (1,024 think
  tokens, ``--steps`` steps, CFG ``--cfg``). ``eager_ms`` is the release's total time for the N
  requests in turn (for N other than ``--n``: N times the median of the ``--n`` run's requests,
  marked ``eager_from``), ``ours_ms`` the batch's wall time, ``speedup`` their ratio (throughput),
  with p50/p99 request latencies on both sides (a request's latency: from the batch's start to
  its own output, as a client sees it when all N arrive together). The plugin side denoises
  with the exact branch-step graphs unless ``--denoise fast`` (rows end in ``_fast``) or an FP8
  option that covers the denoising (rows end in ``_fp8``) selects the fast body.

- ``sensenova_batch_memory_n{N}`` (``memory``): device memory over ``--memory-batches`` batches
  of N text answers (``--memory-mix mixed``: half of them think images,
  ``sensenova_batch_memory_mixed_n{N}``), on the pooled worker threads and with a thread per
  member (``bench_memory``).
- ``sensenova_tick_overlap_b{N}`` (``overlap``) and ``sensenova_tick_wave_k{k}`` (``wave``): what
  a step-execution tick would gain from running its decode launch and its denoising on two CUDA
  streams at once, and from one GEMM over several requests' denoising instead of one request
  after another (``overlap.py``; ``bench_tick_modes``).

Each row also says whether every request's answer in the batch equals the same request's answer
alone through the plugin (``request0_same_in_every_batch``: request 0 of every N), and how far
each answer agrees with the release's (greedy answers part where the two paths round a near tie
differently; with random weights that comes early).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402
import sensenova_request as sr  # noqa: E402


def log(msg):
    print(f"[sensenova-batch {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- requests -------------------------------------------------------------------------------------

def _batch(requests):
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    return DiffusionRequestBatch(list(requests))


def think_requests(n: int, args, start: int = 0):
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    out = []
    for i in range(start, start + n):
        params = OmniDiffusionSamplingParams(
            seed=i, height=args.size, width=args.size, num_inference_steps=args.steps,
            extra_args={"cfg_scale": float(args.cfg), "think": True})
        # One filler word apart: the same length, another think text.
        out.append(OmniDiffusionRequest(prompt={"prompt": f"{sr.PROMPT} w{i}"},
                                        sampling_params=params, request_id=f"think-{i}"))
    return out


def text_requests(n: int, args, start: int = 0):
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    out = []
    words = max(1, args.text_prompt - 12)  # the chat template adds ~12 tokens
    for i in range(start, start + n):
        prompt = " ".join(f"w{(i * 7919 + j * 104729) % 150000}" for j in range(words))
        params = OmniDiffusionSamplingParams(
            seed=i, extra_args={"max_tokens": args.text_tokens, "do_sample": False})
        out.append(OmniDiffusionRequest(prompt={"prompt": prompt, "modalities": ["text"]},
                                        sampling_params=params, request_id=f"text-{i}"))
    return out


def answer(out) -> dict:
    if out.error or out.aborted or out.output is None:
        return {"error": out.error or out.abort_message or "no output"}
    payload = out.output["payload"]
    if "text" in payload:
        return {"text": payload["text"]}
    import numpy as np

    image = np.asarray(payload["image"])
    think = (out.output.get("metadata") or {}).get("text", {}).get("think_text", "")
    return {"image_sha256": hashlib.sha256(image.tobytes()).hexdigest(), "think_text": think,
            "_image": image}


def _public(a: dict) -> dict:
    return {k: v for k, v in a.items() if not k.startswith("_")}


def agreement(ours: dict, release: dict) -> dict:
    """How far an answer agrees with the release's: characters of text (or think text) in
    common before they part, and the image's PSNR."""
    key = "text" if "text" in ours else "think_text"
    a, b = ours.get(key) or "", release.get(key) or ""
    common_prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    out = {"field": key, "equal": a == b, "chars_equal_before_parting": common_prefix,
           "chars": len(b)}
    if "_image" in ours and "_image" in release:
        out["image_psnr_db"] = sr.psnr_db(ours["_image"], release["_image"])
    return out


# -- timing ---------------------------------------------------------------------------------------

class Clock:
    """Per-request end times: the pipeline's per-request entry points, timed at return."""

    METHODS = ("_forward_t2i", "_forward_text", "_forward_it2i")

    def __init__(self, pipe):
        self.ends: list[float] = []
        for name in self.METHODS:
            inner = getattr(pipe, name)

            def timed(*a, _inner=inner, **k):
                out = _inner(*a, **k)
                _sync()
                self.ends.append(time.perf_counter())
                return out

            setattr(pipe, name, timed)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def serve_one_by_one(pipe, clock: Clock, requests) -> dict:
    """The release's engine: each request its own forward, in turn."""
    answers, latencies, times = [], [], []
    _sync()
    start = time.perf_counter()
    for r in requests:
        t0 = time.perf_counter()
        answers.append(answer(pipe.forward(_batch([r]))))
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
        latencies.append((time.perf_counter() - start) * 1e3)
    return {"ms": (time.perf_counter() - start) * 1e3, "request_ms": times,
            "latency_ms": latencies, "answers": answers}


def serve_together(pipe, clock: Clock, requests) -> dict:
    clock.ends.clear()
    _sync()
    start = time.perf_counter()
    outs = pipe.forward(_batch(requests))
    _sync()
    total = (time.perf_counter() - start) * 1e3
    outs = outs if isinstance(outs, list) else [outs]
    return {"ms": total, "latency_ms": sorted((t - start) * 1e3 for t in clock.ends),
            "answers": [answer(o) for o in outs]}


# -- the decode step ------------------------------------------------------------------------------

def bench_step(pipe, args, rows_out: list, env: dict, write=lambda: None) -> None:
    """ms per decode step at ``--context``: the batch-1 path against the batched path; then the
    ``--profile-rows`` profiles (after every timing, so that none is taken beside a profiler's
    leftovers). ``write()`` after each row: a run cut short keeps what it measured."""
    from vllm_omni_graphdecode.decode.batch import turns
    from vllm_omni_graphdecode.hooks import sensenova_u1
    from vllm_omni_graphdecode.ops import attention
    from vllm_omni_graphdecode.ops.fp8.linears import Fp8Linears
    from vllm_omni_graphdecode.testing import sensenova as rm

    lm = pipe.language_model
    ctx, tokens = args.context, args.step_tokens
    kernel = attention.select_kernel("cuda", lm.model.layers[0].self_attn.head_dim, "3")
    wiring = getattr(pipe, sensenova_u1.STATE_ATTR)
    single = sensenova_u1.paged_decoder(lm, kernel=kernel, buckets=(ctx, 2 * ctx),
                                        tokens_per_launch=8,
                                        fusion=wiring.fusion if args.fp8 != "off" else "auto")
    prefix_logits, make_cache = rm.random_prefix(lm, ctx - 1, seed=ctx)

    def one_row():
        with torch.inference_mode():
            single.begin(make_cache())
            ahead = single.lookahead()
            token = int(prefix_logits[0, -1].argmax())
            for s in range(tokens):
                token = ahead.next(token, ctx + s)
            ahead.drain()
        _sync()

    one_row()  # capture
    start = time.perf_counter()
    one_row()
    batch1 = (time.perf_counter() - start) * 1e3 / tokens
    single.release()
    log(f"step: batch-1 path {batch1:.3f} ms/token at context {ctx}")
    decoder = wiring.batch._decoder()

    def together(n):
        def member(i):
            def run():
                with torch.inference_mode():
                    row = decoder.join(make_cache())
                    token = int(prefix_logits[0, -1].argmax()) + i
                    for s in range(tokens):
                        token = row.next(token, ctx + s)
                    decoder.leave(row, write_back=False)
            return run
        _sync()
        t0 = time.perf_counter()
        errors = [e for e in turns.Turns(decoder.launch).run([member(i) for i in range(n)])
                  if isinstance(e, BaseException)]
        _sync()
        if errors:
            raise errors[0]
        return (time.perf_counter() - t0) * 1e3 / tokens

    timed = {}
    for n in (8, 1, 16):
        if n > decoder.cache.rows:
            continue
        together(n)  # first use of these blocks
        ms = timed[n] = together(n)
        log(f"step: batched path, {n} rows: {ms:.3f} ms a step ({ms / n:.3f} ms a token)")
        rows_out.append(common.case(
            f"sensenova_batch_decode_step_b{n}" + _step_suffix(args),
            batch1, ms, None,
            eager_side="the plugin's batch-1 path (FA3, fused step, 8 tokens a launch"
                       + (", FP8 weights" if args.fp8 != "off" else "") + "), ms/token",
            ours_side=f"the batched path, {n} rows decoding ({decoder.cache.rows} in the step), "
                      f"ms per step", context=ctx, rows=decoder.cache.rows,
            ours_over_eager=ms / batch1, ms_per_token=ms / n))
        write()
    for n in args.profile_rows:
        if n not in timed:
            continue
        try:
            # Weight bytes at one a weight only where the step reads FP8 copies (the 16-row
            # GEMM of ``--step-mode rowgemv`` reads the bf16 weights themselves).
            profile_batched_step(lambda n=n: together(n), n, timed[n], lm, args, rows_out,
                                 fp8=isinstance(wiring.batch.linears, Fp8Linears))
        except Exception as exc:  # the timings above stand; the next profile still runs
            import traceback

            traceback.print_exc()
            rows_out.append({"case": f"sensenova_batch_step_profile_b{n}", "error": repr(exc)})
        write()


def profile_batched_step(run, n: int, ms: float, lm, args, rows_out: list, *, fp8: bool,
                         device_type: str = "cuda") -> None:
    """Where the batched step's time goes: ``run()`` (``--step-tokens`` steps of ``n`` rows) once
    under torch.profiler, the kernels seen inside the graph replays by category, the linear
    layers by position (``profile_step.report``); the whole report in
    ``profile-batch-b{n}[-fp8][-rowgemv].json``, a summary row
    ``sensenova_batch_step_profile_b{n}`` with the step rows' suffix (``_step_suffix``).
    ``fp8``: the step's linear layers read FP8 copies (their bytes counted at one a weight).
    The profiled run includes the rows joining and leaving (their K/V copied into the pool and
    out), spread over its steps: a few copy kernels a step more than decoding alone."""
    import profile_step

    tokens = args.step_tokens
    layout, sizes = profile_step.sensenova_gemms(lm, fp8=fp8)
    trace = profile_step.profile(run, 1, device_type=device_type)
    rep = profile_step.report(trace, tokens, ms, gemm_layout=layout, weight_bytes=sizes,
                              rows=n, context=args.context)
    # Recent CUDA and torch show a replayed graph's kernels; where they do not, say so.
    if not rep["kernels_per_step"] and not rep["graph_launches_per_step"]:
        rep["kernels_from"] = "the profiler saw no device activity (no CUDA, or no CUPTI access)"
    elif profile_step.opaque(rep, 5 * len(lm.model.layers)):
        rep["kernels_from"] = "graph replay was opaque to the profiler (no kernels inside)"
    else:
        rep["kernels_from"] = "graph replay (kernels seen inside the graph)"
    suffix = _step_suffix(args).replace("_", "-")
    with open(os.path.join(args.out, f"profile-batch-b{n}{suffix}.json"), "w") as f:
        json.dump(rep, f, indent=2)
    by_cat = {c: v["ms_per_step"] for c, v in rep["by_category"].items() if v["ms_per_step"]}
    log(f"step profile, {n} rows: wall {ms:.3f} ms, kernels {rep['gpu_kernel_ms_per_step']} ms "
        f"({rep['kernels_per_step']} a step), by category {by_cat}")
    rows_out.append({"case": f"sensenova_batch_step_profile_b{n}" + _step_suffix(args),
                     "wall_ms_per_step": rep["wall_ms_per_step"],
                     "gpu_kernel_ms_per_step": rep["gpu_kernel_ms_per_step"],
                     "gpu_busy_ms_per_step": rep["gpu_busy_ms_per_step"],
                     "kernels_per_step": rep["kernels_per_step"],
                     "kernels_from": rep["kernels_from"],
                     "ms_per_step_by_category": by_cat,
                     "file": f"profile-batch-b{n}{suffix}.json"})


# -- what a tick could gain (overlap, wave) ------------------------------------------------------

def bench_tick_modes(pipe, args, cases, rows_out: list, write=lambda: None) -> None:
    """The ``overlap`` and ``wave`` cases (``overlap.py`` says what each decides), measured inside
    one denoising step of a one-step text-to-image request at ``--size``/``--cfg``, at its first
    branch call, where the branch's buffers are live:

    - ``sensenova_tick_overlap_b{R}``: a decode unit (``R`` = ``--n`` rows join at
      ``--context``, decode ``--overlap-tokens`` tokens each through the batched step, and
      leave) against one branch step of that request, alone and together on two streams for
      ``--overlap-seconds`` each (CUDA only: the batched decode runs nowhere else);
    - ``sensenova_tick_wave_k{k}``: the branch's linear layers for ``k`` requests' image tokens,
      one after another against one GEMM over all (``overlap.gemm_wave``)."""
    import overlap

    from vllm_omni_graphdecode.decode.batch import turns
    from vllm_omni_graphdecode.hooks import sensenova_u1
    from vllm_omni_graphdecode.testing import sensenova as rm

    device = next(pipe.language_model.parameters()).device

    def measure(branch, kw):
        tokens = int(kw["input_embeds"].shape[1])
        branch()
        if "wave" in cases:
            for row in overlap.gemm_wave(overlap.gen_weights(pipe), tokens, args.wave_ks):
                log(f"wave k={row['k']}: one after another {row['one_after_another_ms']:.2f} "
                    f"ms, one GEMM {row['wave_ms']:.2f} ms ({row['wave_gain']:.3f}x)")
                rows_out.append(common.case(
                    f"sensenova_tick_wave_k{row['k']}", row["one_after_another_ms"],
                    row["wave_ms"], None,
                    eager_side=f"the branch's linear layers at {tokens} image tokens, k times",
                    ours_side=f"the same at k x {tokens} tokens in one GEMM each",
                    **{k: v for k, v in row.items() if k not in ("one_after_another_ms",
                                                                 "wave_ms")}))
            write()
        if "overlap" in cases:
            if device.type != "cuda":
                rows_out.append({"case": f"sensenova_tick_overlap_b{args.n}",
                                 "skipped": "needs CUDA: the batched decode runs on CUDA only"})
            else:
                result = overlap.together({"decode": decode_unit(), "denoise": branch},
                                          device=device, seconds=args.overlap_seconds)
                log(f"overlap: gain {result['throughput_gain']:.3f} (slowdowns "
                    f"{result['slowdown']})")
                rows_out.append({"case": f"sensenova_tick_overlap_b{args.n}",
                                 "rows": args.n, "context": args.context,
                                 "decode_unit": f"{args.n} rows join, decode "
                                                f"{args.overlap_tokens} tokens each, leave",
                                 "denoise_unit": f"one branch step, {tokens} image tokens",
                                 **result})
            write()

    def decode_unit():
        # The decode unit's graphs replay beside the branch's on another stream: a pool of their
        # own (the first H200 run shared one and met an illegal memory access; h200-2026-12-05b).
        from vllm_omni_graphdecode.graphs import capture

        capture.next_capture_in_a_new_pool(device)
        decoder = getattr(pipe, sensenova_u1.STATE_ATTR).batch._decoder()
        ctx = args.context
        prefix_logits, make_cache = rm.random_prefix(pipe.language_model, ctx - 1, seed=ctx)
        first = int(prefix_logits[0, -1].argmax())

        def unit():
            stream = torch.cuda.current_stream(device)

            def member(i):
                def run():
                    torch.cuda.set_stream(stream)  # the launch runs in whichever member
                    with torch.inference_mode():
                        row = decoder.join(make_cache())
                        token = first + i
                        for s in range(args.overlap_tokens):
                            token = row.next(token, ctx + s)
                        decoder.leave(row, write_back=False)
                return run
            errors = [e for e in turns.Turns(decoder.launch).run([member(i) for i in
                                                                   range(args.n)])
                      if isinstance(e, BaseException)]
            if errors:
                raise errors[0]
        unit()  # captures
        return unit

    sr.at_first_branch(pipe, args, measure, seed=0, prompt=sr.PROMPT, tag="tick-modes")


def memory_case(args) -> str:
    mix = "" if args.memory_mix == "text" else f"{args.memory_mix}_"
    return f"sensenova_batch_memory_{mix}n{args.n}"


def bench_memory(pipe, args, rows_out: list, write=lambda: None) -> None:
    """The ``memory`` case, ``sensenova_batch_memory_n{N}`` (issue #39: device memory grew by 70
    MiB over eight batches of eight mixed requests in one H200 run, by 5 MiB in another):
    ``--memory-batches`` batches of ``--n`` requests, each batch one ``forward``: text answers
    (``--memory-tokens`` greedy tokens each), or with ``--memory-mix mixed`` half of them think
    text-to-image requests (``--size``, ``--memory-steps`` steps, CFG ``--cfg``); twice over:

    - ``pool``: the members on ``workers.WORKERS``'s long-lived threads, as the plugin runs them;
    - ``thread_per_member``: the pool keeps no idle worker (``idle_max`` 0), so every member
      runs on a thread of its own that exits after it: how batches ran before ``workers.py``.

    After each batch (``gc.collect``, synchronize): the device memory in use (the driver's free
    memory; every allocation, torch's and cuBLAS's own) and torch's allocated bytes. The growth
    counted is from batch 2 to the last (batch 1 captures the graphs and grows the pool). The pool
    side runs first, so that any handle the other side leaves behind cannot hide its growth.
    Every batch's answers are compared with the first's (the same requests each time)."""
    import gc

    from vllm_omni_graphdecode.decode.batch import workers

    ask = SimpleNamespace(**{**vars(args), "text_tokens": args.memory_tokens,
                             "text_prompt": args.memory_prompt, "steps": args.memory_steps})
    thinks = args.n // 2 if args.memory_mix == "mixed" else 0
    requests = (text_requests(args.n - thinks, ask, start=200)
                + think_requests(thinks, ask, start=200))
    row = {"case": memory_case(args), "batches": args.memory_batches, "rows": args.n,
           "mix": args.memory_mix, "text_answers": args.n - thinks, "think_images": thinks,
           "tokens": args.memory_tokens, "prompt_tokens": args.memory_prompt}
    if thinks:
        row.update(size=args.size, steps=args.memory_steps, cfg=args.cfg)
    if next(pipe.language_model.parameters()).device.type != "cuda":
        rows_out.append({**row, "skipped": "needs CUDA: the batched decode (and its worker "
                                           "threads) runs on CUDA only"})
        write()
        return
    idle_max = workers.WORKERS.idle_max
    try:
        for side in ("pool", "thread_per_member"):
            workers.WORKERS.idle_max = idle_max if side == "pool" else 0
            first, used, allocated, started, same = None, [], [], [], True
            for _ in range(args.memory_batches):
                outs = pipe.forward(_batch(requests))
                outs = outs if isinstance(outs, list) else [outs]
                answers = [_public(answer(o)) for o in outs]
                first = answers if first is None else first
                same = same and answers == first
                gc.collect()
                torch.cuda.synchronize()
                free, total = torch.cuda.mem_get_info()
                used.append(round((total - free) / 2**20, 1))
                allocated.append(round(torch.cuda.memory_allocated() / 2**20, 1))
                started.append(workers.WORKERS.started)
            row[side] = {
                "used_mib": used, "allocated_mib": allocated, "workers_started": started,
                "growth_used_mib": round(used[-1] - used[min(1, len(used) - 1)], 1),
                "growth_allocated_mib": round(allocated[-1] - allocated[min(1, len(used) - 1)],
                                              1),
                "answers_same_every_batch": same,
                "errors": sum(1 for a in first if "error" in a)}
            log(f"memory {side}: used {used[0]:.0f} -> {used[-1]:.0f} MiB, growth from batch 2 "
                f"{row[side]['growth_used_mib']} MiB (allocated "
                f"{row[side]['growth_allocated_mib']}), workers made {started}")
    finally:
        workers.WORKERS.idle_max = idle_max
    rows_out.append(row)
    write()


# -- the request cases ------------------------------------------------------------------------

def request_rows(kind: str, n: int, release: dict | None, ours: dict, args, *, rows: int,
                 eager_from: str | None = None, eager_ms=None) -> dict:
    name = (f"sensenova_batch_text_n{n}" if kind == "text"
            else f"sensenova_batch_think_t2i_{args.size}_n{n}") + _suffix(args)
    eager = release["ms"] if release else eager_ms
    extra = dict(requests=n, rows=rows, ours_latency_ms=common.percentiles(ours["latency_ms"]),
                 ours_answers=[_public(a) for a in ours["answers"]])
    if release:
        extra.update(eager_latency_ms=common.percentiles(release["latency_ms"]),
                     eager_request_ms=release["request_ms"],
                     agreement_with_release=[agreement(o, r) for o, r in
                                             zip(ours["answers"], release["answers"])])
    if eager_from:
        extra["eager_from"] = eager_from
    return common.case(name, eager, ours["ms"], None, **extra)


def _denoise_mode(fp8: str, asked: str | None = None) -> str:
    """The plugin side's denoising mode: ``asked`` (``--denoise``) when given, else the fast body
    when its FP8 GEMMs are asked for (they exist only there), else the exact graph mode."""
    if asked:
        return asked
    return "fast" if fp8 in ("on", "1", "all") or "sensenova_denoise" in fp8 else "graph"


def _step_suffix(args) -> str:
    """What the step case's row and profile names add: ``_fp8`` (FP8 copies), ``_rowgemv``
    (``--step-mode rowgemv``), ``_plain`` or ``_dependent`` (``--row-launches``), in that
    order."""
    launches = getattr(args, "row_launches", None)
    return (("_fp8" if args.fp8 != "off" else "")
            + ("_rowgemv" if args.step_mode == "rowgemv" else "")
            + (f"_{launches}" if launches else ""))


def _suffix(args) -> str:
    """What a request row's name adds for a plugin side other than the defaults: ``_fp8`` (FP8
    copies), ``_fast`` (bf16 with the fast denoising body, which rounds differently)."""
    if args.fp8 != "off":
        return "_fp8"
    return "_fast" if args.denoise == "fast" else ""


def _row_counts(value: str) -> list[int]:
    """``--profile-rows``: a comma-separated list of the step case's row counts (1, 8, 16)."""
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        counts = None
    if counts is None or any(c not in (1, 8, 16) for c in counts):
        raise argparse.ArgumentTypeError(
            f"--profile-rows {value!r}: accepted: row counts of the step case, 1, 8 and 16, "
            f"comma-separated (e.g. 8,16)")
    return counts


CASES = ("step", "text", "think", "overlap", "wave", "memory")


def _ks(value: str) -> tuple[int, ...]:
    """``--wave-ks``: positive request counts, comma-separated."""
    try:
        ks = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        ks = ()
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"--wave-ks {value!r}: accepted: positive request "
                                         f"counts, comma-separated (e.g. 1,2,4)")
    return ks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="step,text,think")
    ap.add_argument("--n", type=int, default=8, help="requests of the headline cases")
    ap.add_argument("--think-ns", default="1,2,4,16", help="further batch sizes (plugin side)")
    ap.add_argument("--text-prompt", type=int, default=512)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--context", type=int, default=2048, help="step case")
    ap.add_argument("--step-tokens", type=int, default=256, help="step case: tokens timed")
    ap.add_argument("--profile-rows", type=_row_counts, default=[],
                    help="step case: also profile the batched step at these row counts "
                         "(of 1, 8, 16; e.g. 8,16): kernels by category and the linear layers "
                         "by position, in profile-batch-b{N}.json")
    ap.add_argument("--fp8", nargs="?", const="sensenova_decode", default="off",
                    help="the plugin side's VLLM_OMNI_GRAPHDECODE_FP8 (alone: sensenova_decode, "
                         "the decode on FP8 weight copies; on or naming sensenova_denoise: the "
                         "fast denoising with W8A8 GEMMs too): case names end in _fp8")
    ap.add_argument("--step-mode", choices=("fused", "rowgemv"), default="fused",
                    help="the plugin side's VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP (rowgemv: the "
                         "batched step's linear layers through the plugin's 16-row GEMM): "
                         "step case names end in _rowgemv")
    ap.add_argument("--row-launches", choices=("plain", "dependent"), default=None,
                    help="with --step-mode rowgemv: the 16-row GEMMs as plain launches or as "
                         "programmatic dependent launches (Hopper; rows_gemm's pdl), set "
                         "after install with pre-capture off; step case names end in _plain "
                         "or _dependent (default: what the hook wires)")
    ap.add_argument("--denoise", choices=("graph", "fast"), default=None,
                    help="the plugin side's VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE (default: "
                         "fast when --fp8 asks for its W8A8 GEMMs, else graph, the exact "
                         "denoising); fast with --fp8 off: request rows end in _fast")
    ap.add_argument("--overlap-seconds", type=float, default=6.0,
                    help="overlap case: each side's window, alone and together")
    ap.add_argument("--overlap-tokens", type=int, default=64,
                    help="overlap case: tokens each row decodes in one decode unit")
    ap.add_argument("--wave-ks", type=_ks, default=(1, 2, 4),
                    help="wave case: request counts k, comma-separated")
    ap.add_argument("--memory-batches", type=int, default=12,
                    help="memory case: batches on each side")
    ap.add_argument("--memory-tokens", type=int, default=64,
                    help="memory case: greedy tokens each text answer decodes")
    ap.add_argument("--memory-prompt", type=int, default=128,
                    help="memory case: prompt tokens of each text answer")
    ap.add_argument("--memory-mix", choices=("text", "mixed"), default="text",
                    help="memory case: text answers only, or half think images")
    ap.add_argument("--memory-steps", type=int, default=4,
                    help="memory case, mixed: denoising steps of each think image")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--lm-only", action="store_true",
                    help="step case only: the language model at the real shape on a bare "
                         "pipeline object (no image heads: a third of the build time)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--release-from", default=None,
                    help="a sensenova-batch.json whose release think run gives the eager side "
                         "(N x its median request) instead of running the release here")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="start no further case after this many seconds (results so far kept)")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: {', '.join(unknown)} not accepted; accepted: {', '.join(CASES)}")
    if args.row_launches and args.step_mode != "rowgemv":
        ap.error(f"--row-launches {args.row_launches}: accepted with --step-mode rowgemv only "
                 f"(the launches are the 16-row GEMM's)")
    ns = [int(x) for x in args.think_ns.split(",") if x]
    rows = min(16, max([args.n] + ns))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sensenova-batch.json")
    began = time.perf_counter()
    release_single = None
    env = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "versions": common.versions(), "device": str(device), "rows": rows,
           "args": vars(args)}
    if device.type == "cuda":
        env.update(common.gpu_info())
    results: list[dict] = []

    def write():
        with open(path, "w") as f:
            json.dump(sr._json_safe({"environment": env, "cases": results}), f, indent=2)

    from vllm_omni_graphdecode import config
    from vllm_omni_graphdecode.core import stats

    per_launch = config.parse({}).tokens_per_launch
    if args.step_tokens % per_launch:
        ap.error(f"--step-tokens {args.step_tokens}: accepted: a multiple of the tokens a launch "
                 f"decodes ({per_launch}), so that no launch decodes steps the timing leaves out")

    from vllm_omni_graphdecode.hooks import sensenova_u1

    workdir = tempfile.mkdtemp(prefix="sensenova-batch-")
    dtype = torch.bfloat16
    if args.lm_only:
        if cases != ["step"]:
            ap.error("--lm-only runs the step case alone (--cases step)")
        from vllm_omni_graphdecode.testing import sensenova as rm

        rm.setup_runtime(device.type)
        shape = dict(num_layers=42, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                     intermediate=12288, vocab=151936)  # bench.SENSENOVA_SHAPE
        lm = rm.build_lm(rm.llm_config(**shape), device=device.type, dtype=dtype, seed=0,
                         on_device_init=True)
        pipe = rm.build_pipeline(lm, rm.build_tokenizer(shape["vocab"]), device=device.type)
    elif args.tiny:
        pipe = sr.build_tiny_pipeline(device, dtype, 0, workdir)
    else:
        pipe = sr.build_real_pipeline(device, dtype, 0, workdir, sr.PROMPT)
    log(f"pipeline built ({time.perf_counter() - began:.0f} s)")
    clock = None if args.lm_only else Clock(pipe)

    def over_budget(what):
        if time.perf_counter() - began > args.budget_s:
            log(f"budget: {what} not run")
            results.append({"case": what, "skipped": "time budget (--budget-s)"})
            write()
            return True
        return False

    # The release's side, every request alone (first: one untimed request per kind).
    release = {}
    if args.release_from:
        with open(args.release_from) as f:
            earlier = json.load(f)
        row = next(r for r in earlier["cases"]
                   if r.get("case", "").startswith("sensenova_batch_think_t2i")
                   and r.get("eager_request_ms"))
        env["release_from"] = {"file": args.release_from, "case": row["case"],
                               "command": earlier["environment"].get("command")}
        release_single = statistics.median(row["eager_request_ms"])
    for kind in ("text", "think"):
        if args.release_from or kind not in cases or over_budget(f"release {kind}"):
            continue
        make = text_requests if kind == "text" else think_requests
        pipe.forward(_batch(make(1, args, start=100)))  # warm-up (FA2's first call compiles)
        release[kind] = serve_one_by_one(pipe, clock, make(args.n, args))
        log(f"release {kind}: {args.n} requests in {release[kind]['ms']:.0f} ms")
    # The plugin, for a server started with --max-num-seqs ROWS.
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE":
                            "off" if args.lm_only else _denoise_mode(args.fp8, args.denoise),
                        "VLLM_OMNI_GRAPHDECODE_FP8": args.fp8,
                        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": args.step_mode,
                        # the launches are chosen after install: no graph captured before
                        **({"VLLM_OMNI_GRAPHDECODE_PRECAPTURE": "0"} if args.row_launches
                           else {})})
    stats.reset()
    summary = sensenova_u1.install(pipe, cfg, SimpleNamespace(
        od_config=SimpleNamespace(max_num_seqs=rows)))
    env["plugin_summary"] = summary
    log(summary)
    if args.row_launches:
        from vllm_omni_graphdecode.ops.fp8 import gemv as row_gemv
        from vllm_omni_graphdecode.ops.rows_gemm import RowsLinears

        linears = getattr(pipe, sensenova_u1.STATE_ATTR).batch.linears
        if not isinstance(linears, RowsLinears):
            ap.error(f"--row-launches {args.row_launches}: the batched step reads "
                     f"{type(linears).__name__}, not the 16-row GEMM ({summary})")
        linears.pdl = (None if args.row_launches == "plain"
                       else row_gemv.dependent_launches(device))
        if args.row_launches == "dependent" and linears.pdl is None:
            ap.error(f"--row-launches dependent: {device} runs no dependent launch (compute "
                     f"capability 9.0+ and a Triton with gdc_wait)")
        env["row_launches"] = linears.describe()
        log(env["row_launches"])
    if "step" in cases and device.type == "cuda" and not over_budget("step"):
        try:
            bench_step(pipe, args, results, env, write)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            results.append({"case": "sensenova_batch_decode_step_b8", "error": repr(exc)})
        write()
    if "memory" in cases and not over_budget("memory"):
        try:
            bench_memory(pipe, args, results, write)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            results.append({"case": memory_case(args), "error": repr(exc)})
        write()
    tick_cases = [c for c in ("overlap", "wave") if c in cases]
    if tick_cases and not over_budget(",".join(tick_cases)):
        try:
            bench_tick_modes(pipe, args, tick_cases, results, write)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            results.append({"case": "sensenova_tick_" + "_".join(tick_cases), "error": repr(exc)})
        write()
    request0 = {}
    for kind in ("text", "think"):
        if kind not in cases:
            continue
        make = text_requests if kind == "text" else think_requests
        pipe.forward(_batch(make(1, args, start=100)))  # warm-up: the denoising graphs' first use
        if over_budget(f"{kind} n{args.n}"):
            continue
        ours = serve_together(pipe, clock, make(args.n, args))
        log(f"plugin {kind}: {args.n} requests in one forward, {ours['ms']:.0f} ms")
        request0.setdefault(kind, {})[args.n] = _public(ours["answers"][0])
        eager_ms = (release_single * args.n if args.release_from and kind == "think" else None)
        results.append(request_rows(
            kind, args.n, release.get(kind), ours, args, rows=rows, eager_ms=eager_ms,
            eager_from=(f"{args.n} x the median request of {args.release_from}" if eager_ms
                        else None)))
        write()
        if kind != "think":
            continue
        single = (statistics.median(release["think"]["request_ms"]) if "think" in release
                  else release_single if args.release_from else None)
        where = f"the release's n{args.n} run" if "think" in release else args.release_from
        for n in ns:
            if n == args.n or n > rows or over_budget(f"think n{n}"):
                continue
            ours = serve_together(pipe, clock, make(n, args))
            log(f"plugin think: {n} requests in one forward, {ours['ms']:.0f} ms")
            request0["think"][n] = _public(ours["answers"][0])
            results.append(request_rows(
                kind, n, None, ours, args, rows=rows, eager_ms=single * n if single else None,
                eager_from=f"{n} x the median request of {where}"))
            write()
    for kind, by_n in request0.items():
        same = len({json.dumps(a, sort_keys=True) for a in by_n.values()}) == 1
        env[f"{kind}_request0_same_in_every_batch"] = {"batch_sizes": sorted(by_n), "same": same}
    env["stats"] = stats.snapshot()
    env["seconds"] = round(time.perf_counter() - began, 1)
    write()
    print(json.dumps(sr._json_safe({"environment": env, "cases": results}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
