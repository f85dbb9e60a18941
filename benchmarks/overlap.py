"""What a step-execution tick could gain from running its work differently (issue #41): two
measurements at the real shape that decide whether a mode is worth building.

Why: under ``--step-execution`` one tick runs every denoising request's step one after another
(each through its own denoising graphs), then one batched decode launch for every row decoding,
all on one CUDA stream (``hooks/sensenova_u1/steps.py``). Two other ways are possible, and each
costs real complexity in the tick (stream events at every hand-over between a request's decode
and its denoising, frees ordered across streams; or a batched, varlen denoising forward over
requests with different prompts). Neither is built until one of these says it pays:

- ``together(units)``: each kind of work alone, then all kinds at once, each in a thread and a
  CUDA stream of its own, over the same window: ``throughput_gain`` is the sum over kinds of
  (units per second together) / (units per second alone). 1.0: running them on two streams
  gains nothing (they only take turns on the GPU); 2.0: each ran as fast as alone. The decode
  launch is bound by memory bandwidth and the denoising by matmul throughput, which is why it
  might be above 1.
- ``gemm_wave(weights, tokens, ks)``: the denoising branch's linear layers (every
  ``*_mot_gen`` projection and ``fm_head``, the real shapes) for ``k`` requests' image tokens,
  one request after another against one GEMM over all of them. The branch is matmul-bound at
  1024x1024 (4,096 image tokens a branch): a wave of several requests in one forward gains at
  most what these GEMMs gain, times their share of the step (its attention is per request
  either way).

Timed with CUDA events and stream syncs on a GPU (no device-wide sync inside a window: it would
wait for the other stream too), ``perf_counter`` on a CPU, where the streams are absent and only
the threads run together (so a CPU figure shows only that the measurement works).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

import torch


def _stream(device: torch.device):
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None


def _loop(unit: Callable[[], object], stream, seconds: float, min_units: int,
          start: threading.Barrier | None = None) -> dict:
    """Run ``unit`` on ``stream`` (this thread's current stream for the loop) until ``seconds``
    passed and at least ``min_units`` ran; each unit ends when its stream has finished it."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        torch.cuda.set_stream(stream)
    if start is not None:
        start.wait()
    began = time.perf_counter()
    units = 0
    while True:
        unit()
        if stream is not None:
            stream.synchronize()
        units += 1
        elapsed = time.perf_counter() - began
        if elapsed >= seconds and units >= min_units:
            break
    return {"units": units, "seconds": round(elapsed, 4), "per_s": units / elapsed,
            "ms_per_unit": elapsed * 1e3 / units}


def together(units: dict[str, Callable[[], object]], *, device: torch.device,
             seconds: float = 8.0, min_units: int = 2) -> dict:
    """Each of ``units`` (name -> one unit of work, its tensors ready on the caller's current
    stream) alone, then all at once (module docstring). Every unit should have run once
    before (captures, compiles, first allocations)."""
    if len(units) < 2:
        raise ValueError(f"together needs two kinds of work or more, got {sorted(units)}")
    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None
    alone = {}
    for name, unit in units.items():
        result: dict = {}
        thread = threading.Thread(target=lambda u=unit: result.update(
            _loop(u, _stream(device), seconds, min_units)), name=f"overlap-{name}")
        thread.start()
        thread.join()
        alone[name] = result
    barrier = threading.Barrier(len(units))
    results: dict[str, dict] = {name: {} for name in units}
    errors: list[BaseException] = []

    def run(name, unit, stream):
        try:
            results[name].update(_loop(unit, stream, seconds, min_units, barrier))
        except BaseException as exc:  # reported after every thread ended
            errors.append(exc)
            barrier.abort()

    # The streams are made here, so each waits for what the caller queued before the window.
    streams = {name: _stream(device) for name in units}
    for stream in streams.values():
        if stream is not None:
            stream.wait_stream(caller)
    threads = [threading.Thread(target=run, args=(name, unit, streams[name]),
                                name=f"overlap-{name}-together") for name, unit in units.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    # A kind that ran on alone after the other kinds' windows ended is counted over its own
    # window: its tail ran without company, so the gain is an upper bound by that tail.
    tail = max(r["seconds"] for r in results.values()) - min(r["seconds"] for r in results.values())
    gain = sum(results[n]["per_s"] / alone[n]["per_s"] for n in units)
    return {"alone": alone, "together": results,
            "slowdown": {n: alone[n]["per_s"] / results[n]["per_s"] for n in units},
            "throughput_gain": gain, "unshared_tail_s": round(tail, 4),
            "streams": "one CUDA stream per kind" if device.type == "cuda"
            else "no CUDA: threads only, one CPU"}


def gen_weights(pipe) -> list[torch.Tensor]:
    """The weights a denoising branch multiplies every image token by: each layer's ``*_mot_gen``
    projections and ``fm_head`` (``sensenova_request.gen_linear_params`` counts the same)."""
    weights = [p for n, p in pipe.language_model.named_parameters()
               if "_mot_gen" in n and p.dim() == 2]
    weights += [p for p in pipe.fm_modules["fm_head"].parameters() if p.dim() == 2]
    return weights


def gemm_wave(weights: list[torch.Tensor], tokens: int, ks=(1, 2, 4), *, repeats: int = 5) -> list:
    """For each ``k``: the GEMMs of ``weights`` at ``tokens`` rows, ``k`` times one after another,
    against once at ``k * tokens`` rows (one wave). Returns one dict per ``k``: both times in
    ms, their ratio and the achieved FLOP rates. Every GEMM writes into an output made
    before timing (no allocation inside; one per output width, shared)."""
    device, dtype = weights[0].device, weights[0].dtype
    g = torch.Generator(device=device).manual_seed(0)
    by_in: dict[int, torch.Tensor] = {}
    rows = []
    per_token_flops = 2 * sum(w.numel() for w in weights)

    def timed(m: int) -> float:
        for n_in in {w.shape[1] for w in weights}:
            if n_in not in by_in or by_in[n_in].shape[0] < m:
                by_in[n_in] = torch.randn(m, n_in, device=device, dtype=dtype, generator=g)
        # One scratch output per width, overwritten by every GEMM of that width: the outputs of
        # 42 layers at 4 x 4,096 rows would take ~50 GB.
        by_out = {n: torch.empty(m, n, device=device, dtype=dtype)
                  for n in {w.shape[0] for w in weights}}
        outs = [by_out[w.shape[0]] for w in weights]
        xs = [by_in[w.shape[1]][:m] for w in weights]

        def run():
            for x, w, o in zip(xs, weights, outs):
                torch.mm(x, w.t(), out=o)
        return _median_ms(run, device, repeats)

    one = timed(tokens)
    for k in ks:
        wave = one if k == 1 else timed(k * tokens)
        rows.append({"k": k, "tokens": tokens, "one_after_another_ms": k * one, "wave_ms": wave,
                     "wave_gain": k * one / wave,
                     "tflops_one": per_token_flops * tokens / one / 1e9,
                     "tflops_wave": per_token_flops * k * tokens / wave / 1e9})
    return rows


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)
