"""Where a decode step's time goes: kernels per step, GPU busy against wall time, time by kernel
category, the top kernels, and what each weight GEMM achieves against the copy bandwidth.

    python benchmarks/bench.py --out DIR --cases profile      -> DIR/profile-<tag>.json + a table

Cases (keys of the JSON's "profiles"):
  sensenova_graph_ctxN: the plugin's ``PagedDecoder`` with graphs, captured before profiling, one
      step as the pipeline's loop runs it (step, argmax, ``.item()``). If the profiler sees a graph
      replay as one opaque launch (no kernels inside), the same steps are profiled again with
      ``graphs=False`` and ``kernels_from`` says so.
  sensenova_eager_ctxN: the pipeline's own text loop (``_generate_text``, no plugin): same kernels
      and more, issued one by one; wall minus GPU busy is what the launches cost.
  qwen_image_21_graph_t2i_1024 / qwen_image_21_eager_t2i_1024: one cached step, the plugin's graph
      replay and diffusers' own forward, with the attention backend named.

How: torch.profiler (CPU + CUDA activities) around the steps, exported as a Chrome trace and read
back; every device event ("kernel", "gpu_memcpy", "gpu_memset") is counted. Per-step figures are
totals over the profiled steps divided by their number, so no event needs to be assigned to a step.
``wall_ms_per_step`` is timed outside the profiler (it slows the host side of eager steps).
The weight GEMMs of a SenseNova step come in a fixed order (per layer qkv, o, gate_up, down; then
lm_head), so each launch is named by its position once that run is found in the step (each
per-layer position launching one kernel in every layer, lm_head the longest launch after it; other
GEMMs before or after count as ``other_gemm``); a split-K reduction joins the launch before it.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time
from collections import defaultdict

import torch

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CATEGORIES = ("gemm", "attention", "norm", "rope", "elementwise", "copy", "other")
SENSENOVA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# Ordered: the first rule that matches names the category. Attention and norm/rope come before
# GEMM because FA3's and FlashInfer's kernels live in cutlass/flashinfer namespaces, and a fused
# qk-norm+rope kernel names both (it is counted as rope).
_RULES = (
    ("rope", ("rotary", "rope", "pos_encoding")),
    ("norm", ("rmsnorm", "rms_norm", "layernorm", "layer_norm", "groupnorm", "group_norm",
              "norm_kernel", "normkernel", "fused_add_rms")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "softmax", "batchdecode",
                   "batch_decode", "pagedattention", "paged_attention", "mha_", "flashinfer",
                   # vLLM's Triton decode attention (the batched step's): its two stages
                   "_fwd_grouped_kernel_stage", "_fwd_kernel_stage")),
    ("gemm", ("gemm", "gemv", "nvjet", "xmma", "cublas", "cutlass", "matmul", "splitk",
              "dot_kernel", "s16816", "tensorop", "wgmma", "_mm_", "bmm", "marlin")),
    ("copy", ("memcpy", "memset", "copy", "index", "scatter", "gather", "catarray", "concat",
              "_cat_", "fill", "transpose", "embedding", "clone", "arange")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "gelu", "act_and_mul",
                     "swiglu", "mul_", "add_", "reduce", "argmax", "max_", "sum_", "mean",
                     "exp", "sigmoid", "tanh", "triton_poi", "triton_red", "where", "clamp",
                     "pow", "sqrt", "div", "neg", "cast", "convert")),
)


def classify(name: str, cat: str = "kernel") -> str:
    """The category of one device event from its name (and trace category)."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    low = name.lower()
    for category, needles in _RULES:
        if any(n in low for n in needles):
            return category
    return "other"


def is_split_k_reduce(name: str) -> bool:
    low = name.lower()
    return "splitk" in low and "reduce" in low


def short(name: str, width: int = 140) -> str:
    """A kernel name without template arguments past ``width`` characters."""
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


# ------------------------------------------------------------------ trace handling

def trace_of(prof) -> dict:
    """The profiler's Chrome trace as a dict (written to a temporary file and read back)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.remove(path)


def device_events(trace: dict) -> list[dict]:
    """Every device event (kernels, copies, sets), sorted by start: name, cat, ts, dur (us)."""
    out = []
    for e in trace.get("traceEvents", []):
        cat = str(e.get("cat", "")).lower()
        if cat in DEVICE_CATS and e.get("ph") == "X":
            out.append({"name": str(e.get("name", "")), "cat": cat, "ts": float(e["ts"]),
                        "dur": float(e.get("dur", 0.0))})
    out.sort(key=lambda e: e["ts"])
    return out


def graph_launches(trace: dict) -> int:
    return sum(1 for e in trace.get("traceEvents", [])
               if "graphlaunch" in str(e.get("name", "")).lower().replace("_", ""))


def busy_us(events: list[dict]) -> float:
    """Time at least one device event runs (union of intervals)."""
    total, end = 0.0, float("-inf")
    for e in events:  # sorted by start
        s, t = e["ts"], e["ts"] + e["dur"]
        if s >= end:
            total += e["dur"]
            end = t
        elif t > end:
            total += t - end
            end = t
    return total


# ------------------------------------------------------------------ summaries

def summarize(events: list[dict], steps: int, *, top: int = 15) -> dict:
    """Per-step kernel count and time, time by category, top kernels, unknown names."""
    steps = max(steps, 1)
    by_cat = {c: {"ms_per_step": 0.0, "kernels_per_step": 0.0} for c in CATEGORIES}
    by_name: dict[str, dict] = {}
    other: dict[str, int] = defaultdict(int)
    kernel_us = 0.0
    for e in events:
        c = classify(e["name"], e["cat"])
        by_cat[c]["ms_per_step"] += e["dur"] / 1e3 / steps
        by_cat[c]["kernels_per_step"] += 1 / steps
        kernel_us += e["dur"]
        entry = by_name.setdefault(e["name"], {"category": c, "count": 0, "total_us": 0.0})
        entry["count"] += 1
        entry["total_us"] += e["dur"]
        if c == "other":
            other[short(e["name"])] += 1
    kernel_ms = kernel_us / 1e3 / steps
    for c in by_cat.values():
        c["share"] = round(c["ms_per_step"] / kernel_ms, 4) if kernel_ms else 0.0
        c["ms_per_step"] = round(c["ms_per_step"], 4)
        c["kernels_per_step"] = round(c["kernels_per_step"], 2)
    ranked_all = sorted(by_name.items(), key=lambda kv: -kv[1]["total_us"])
    ranked = ranked_all[:top]
    for c, entry in by_cat.items():  # which kernels a category is (e.g. which attention backend)
        entry["top_names"] = [short(n, 100) for n, v in ranked_all if v["category"] == c][:3]
    return {
        "steps": steps,
        "kernels_per_step": round(len(events) / steps, 2),
        "gpu_kernel_ms_per_step": round(kernel_ms, 4),
        "gpu_busy_ms_per_step": round(busy_us(events) / 1e3 / steps, 4),
        "by_category": by_cat,
        "top_kernels": [{"name": short(n), "category": v["category"], "count": v["count"],
                         "count_per_step": round(v["count"] / steps, 2),
                         "ms_per_step": round(v["total_us"] / 1e3 / steps, 4),
                         "mean_us": round(v["total_us"] / v["count"], 2)} for n, v in ranked],
        "other_kernel_names": dict(sorted(other.items(), key=lambda kv: -kv[1])[:40]),
    }


def gemm_launches(events: list[dict]) -> list[dict]:
    """GEMM launches in order; a split-K reduction joins the launch before it."""
    out: list[dict] = []
    for e in events:
        if classify(e["name"], e["cat"]) != "gemm":
            continue
        if is_split_k_reduce(e["name"]) and out:
            out[-1]["dur"] += e["dur"]
            out[-1]["kernels"] += 1
            continue
        out.append({"name": e["name"], "dur": e["dur"], "kernels": 1})
    return out


def gemm_by_slot(events: list[dict], steps: int, per_layer: tuple[str, ...], layers: int,
                 tail: str, weight_bytes: dict[str, int],
                 copy_bytes_per_s: float | None) -> dict:
    """Time and achieved weight bandwidth per named GEMM.

    A step's GEMM launches are ``per_layer`` for each of ``layers`` layers, then ``tail``, possibly
    with a few other GEMMs before or after (counted as ``other_gemm``). The layer block is found
    as the offset where each per-layer position launches the same kernel in every layer (of those,
    the one followed by the longest launch: ``tail`` reads the most); every step must launch the
    same number of GEMMs.
    """
    launches = gemm_launches(events)
    period, block = len(per_layer), len(per_layer) * layers
    if not launches or len(launches) % max(steps, 1):
        return {"attributed": False, "gemm_launches": len(launches),
                "why": f"{len(launches)} GEMM launches over {steps} steps is not the same number "
                       f"per step; see top_kernels for GEMMs by name"}
    per_step = len(launches) // steps
    names = [launch["name"] for launch in launches[:per_step]]
    fits = [o for o in range(per_step - block)
            if all(len({names[o + period * i + j] for i in range(layers)}) == 1
                   for j in range(period))]
    # Several offsets fit when another GEMM launches a per-layer kernel next to the run; the
    # tail (lm_head, the largest weight by far) is then the longest launch right after it.
    offset = max(fits, key=lambda o: launches[o + block]["dur"]) if fits else None
    if offset is None:
        return {"attributed": False, "gemm_launches_per_step": per_step,
                "why": f"no run of {layers} layers x {period} GEMMs with one kernel per position "
                       f"among the {per_step} GEMM launches of a step; see top_kernels"}
    slots = (["other_gemm"] * offset + list(per_layer) * layers + [tail]
             + ["other_gemm"] * (per_step - offset - block - 1))
    acc: dict[str, dict] = {}
    for i, launch in enumerate(launches):
        a = acc.setdefault(slots[i % per_step], {"calls": 0, "us": 0.0, "kernels": set()})
        a["calls"] += 1
        a["us"] += launch["dur"]
        a["kernels"].add(short(launch["name"], 100))
    out = {}
    for name, a in acc.items():
        mean_us = a["us"] / a["calls"]
        row = {"calls_per_step": a["calls"] // steps,
               "ms_per_step": round(a["us"] / 1e3 / steps, 4),
               "mean_us": round(mean_us, 2), "kernels": sorted(a["kernels"])}
        wb = weight_bytes.get(name)
        if wb:
            gbps = wb / (mean_us * 1e-6)
            row["weight_bytes"] = wb
            row["achieved_gb_s"] = round(gbps / 1e9, 1)
            if copy_bytes_per_s:
                # The copy rate counts read + write; a GEMV mostly reads, so this can pass 1.
                row["of_copy_bandwidth"] = round(gbps / copy_bytes_per_s, 3)
        out[name] = row
    result = {"attributed": True, "gemm_launches_per_step": per_step, "by_projection": out}
    named = [n for n in out if weight_bytes.get(n)]
    if named:
        nbytes = sum(out[n]["calls_per_step"] * weight_bytes[n] for n in named)
        ms = sum(acc[n]["us"] for n in named) / 1e3 / steps
        result["weights"] = {"bytes_per_step": nbytes, "ms_per_step": round(ms, 4),
                             "achieved_gb_s": round(nbytes / (ms * 1e-3) / 1e9, 1)}
        if copy_bytes_per_s:
            result["weights"]["of_copy_bandwidth"] = round(
                nbytes / (ms * 1e-3) / copy_bytes_per_s, 3)
    return result


# ------------------------------------------------------------------ running a profile

def profile(fn, steps: int, *, device_type: str = "cuda") -> dict:
    """Run ``fn()`` ``steps`` times under torch.profiler; returns the trace dict."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with tprofile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
    return trace_of(prof)


def wall_ms(fn, steps: int, *, device_type: str = "cuda", repeats: int = 3) -> float:
    """Median over repeats of the mean wall time of ``fn`` over ``steps`` calls (ms)."""
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(samples)


def report(trace: dict, steps: int, wall: float, *, gemm_layout=None, weight_bytes=None,
           copy_bytes_per_s=None, **extra) -> dict:
    """``gemm_layout``: (per-layer GEMM names, layers, tail name) to attribute GEMMs by position."""
    events = device_events(trace)
    out = {"wall_ms_per_step": round(wall, 4), **extra}
    out.update(summarize(events, steps))
    out["graph_launches_per_step"] = round(graph_launches(trace) / max(steps, 1), 2)
    out["launch_gap_ms_per_step"] = round(wall - out["gpu_busy_ms_per_step"], 4)
    out["gpu_busy_of_wall"] = round(out["gpu_busy_ms_per_step"] / wall, 4) if wall else None
    if gemm_layout is not None:
        out["gemm"] = gemm_by_slot(events, steps, *gemm_layout, weight_bytes or {},
                                   copy_bytes_per_s)
    return out


def opaque(rep: dict, expected_min_kernels: int) -> bool:
    """A graphed profile whose replays show (almost) no kernels inside."""
    return rep["kernels_per_step"] < expected_min_kernels


# ------------------------------------------------------------------ SenseNova-U1

def sensenova_gemms(lm, fp8: bool = False, fp8_head: bool = False) -> tuple[tuple, dict[str, int]]:
    """One step's weight GEMMs (per-layer names, layers, tail) and the bytes each reads a call;
    ``fp8``: the per-layer projections read their e4m3 copies (a byte a weight); ``fp8_head``:
    ``lm_head`` reads its copy too (else bf16)."""
    layers = lm.model.layers
    layout = (SENSENOVA_PROJECTIONS, len(layers), "lm_head")
    sizes: dict[str, int] = {}
    first = layers[0]
    owners = {"qkv_proj": first.self_attn, "o_proj": first.self_attn,
              "gate_up_proj": first.mlp, "down_proj": first.mlp}
    for name, owner in owners.items():
        w = getattr(getattr(owner, name, None), "weight", None)
        if w is not None:
            sizes[name] = w.numel() * (1 if fp8 else w.element_size())
    w = lm.lm_head.weight
    sizes["lm_head"] = w.numel() * (1 if fp8_head else w.element_size())
    return layout, sizes


def profile_sensenova_graph(lm, kernel, prefix_logits, make_cache, ctx: int, *, steps: int,
                            buckets, copy_bytes_per_s=None, device_type="cuda",
                            tokens_per_launch: int = 1, fusion="auto") -> dict:
    """The plugin's decode step (graphs on), as the pipeline's loop drives it: one token per
    ``step()``, from a launch per token or served from ``tokens_per_launch``-token launches.
    ``fusion``: the step's ``fused_step.Fusion`` ("auto": what this device supports; one with
    FP8 copies makes the GEMMs' bytes a byte a weight)."""
    from vllm_omni_graphdecode.ops.fp8 import linears

    copies = getattr(fusion, "gemv", None)
    fp8 = isinstance(copies, linears.Fp8Linears)
    layout, sizes = sensenova_gemms(lm, fp8=fp8, fp8_head=fp8 and copies.has_head)

    def run(graphs: bool) -> dict:
        from vllm_omni_graphdecode.hooks import sensenova_u1

        dec = sensenova_u1.paged_decoder(lm, kernel=kernel, buckets=buckets, graphs=graphs,
                                         tokens_per_launch=tokens_per_launch, fusion=fusion)
        try:
            dec.begin(make_cache())
            ahead = dec.lookahead() if tokens_per_launch > 1 else None
            state = {"token": int(prefix_logits[:, -1].argmax(-1)), "t": ctx}

            def step():
                with torch.inference_mode():
                    if ahead is not None:
                        state["token"] = ahead.next(state["token"], state["t"])
                    else:
                        logits = dec.step(state["token"], state["t"])
                        # the loop's argmax and host sync, as _generate_text has it
                        state["token"] = int(logits[:, -1].argmax(-1))
                    state["t"] += 1

            for _ in range(3 * tokens_per_launch):  # capture (graphs) and warm-up
                step()
            wall = wall_ms(step, steps, device_type=device_type)
            trace = profile(step, steps, device_type=device_type)
            return report(trace, steps, wall, gemm_layout=layout, weight_bytes=sizes,
                          copy_bytes_per_s=copy_bytes_per_s, graphs=graphs,
                          graphs_captured=dec.num_graphs, bucket=dec.cache.bucket, context=ctx)
        finally:
            dec.release()

    if device_type != "cuda":
        rep = run(False)
        rep["kernels_from"] = "graphs=False (no CUDA device)"
        return rep
    rep = run(True)
    # A step is at least 5 kernels per layer; far fewer means the replay stayed one opaque item.
    if not opaque(rep, 5 * len(lm.model.layers)):
        rep["kernels_from"] = "graph replay (kernels seen inside the graph)"
        return rep
    return {"kernels_from": "graph replay was opaque to the profiler (no kernels inside): "
                            "'replay' has its wall time and launches, 'kernels' the same step "
                            "profiled with graphs=False",
            "replay": rep, "kernels": run(False)}


def profile_sensenova_eager(pipe, prefix_logits, make_cache, ctx: int, *, steps: int, lm,
                            copy_bytes_per_s=None, device_type="cuda") -> dict:
    """The pipeline's own text loop (no plugin), ``steps`` tokens per profiled run."""
    layout, sizes = sensenova_gemms(lm)

    def run():
        with torch.inference_mode():
            pipe._generate_text(prefix_logits, make_cache(), ctx - 1, max_tokens=steps)

    run()  # warm-up
    wall = wall_ms(run, 1, device_type=device_type, repeats=2) / steps
    trace = profile(run, 1, device_type=device_type)
    # One forward per emitted token (_generate_text stops early only at the end token, whose
    # lm_head row the benchmark zeroes).
    return report(trace, steps, wall, gemm_layout=layout, weight_bytes=sizes,
                  copy_bytes_per_s=copy_bytes_per_s, context=ctx, tokens=steps, forwards=steps)


# ------------------------------------------------------------------ Qwen-Image-2.1

def profile_qwen_step(tf, *, target_shape=(64, 64), text_tokens=256, steps=3,
                      modes=("exact", "fast")) -> dict:
    """One cached step at ``target_shape`` (t2i): diffusers' own forward and the plugin's graph
    replay (on CPU the plugin's static-buffer step, uncaptured)."""
    from vllm_omni_graphdecode.core import stats
    from vllm_omni_graphdecode.hooks import qwen_image_21 as q
    from vllm_omni_graphdecode.hooks.qwen_image_21 import names
    from vllm_omni_graphdecode.testing.qwen import synthetic_inputs

    device_type = next(tf.parameters()).device.type
    capture = device_type == "cuda"
    q._prepare(tf)
    d = names.resolve()
    kwargs = synthetic_inputs(tf, text_tokens=text_tokens, target_shape=target_shape)
    out = {"attention_backend": names.backend_name(d, tf), "target_tokens":
           target_shape[0] * target_shape[1], "text_tokens": text_tokens}
    with torch.no_grad():
        cache = d.module.QwenImage21KVCache(len(tf.transformer_blocks))
        tf(**kwargs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)
        out["prefix_len"] = int(cache.get_layer(0).k.shape[1])

    def step():
        with torch.no_grad():
            tf(**kwargs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)

    def measured(**extra):
        for _ in range(3):  # warm-up (with the plugin wired: bind and capture)
            step()
        wall = wall_ms(step, steps, device_type=device_type)
        return report(profile(step, steps, device_type=device_type), steps, wall, **extra)

    out["eager"] = measured()
    for mode in modes:  # "graph" is the exact mode's replay; "graph_fast" the fast mode's
        wiring = q.CachedStepGraphs(tf, max_entries=2, verify=False, capture=capture, mode=mode)
        try:
            rep = measured(graphs=capture)
            rep["graphs_captured"] = stats.get(q.MODEL, "capture")
            rep["fallbacks"] = stats.fallbacks(q.MODEL)
            if not capture:
                rep["kernels_from"] = "static-buffer step without graphs (no CUDA device)"
            elif opaque(rep, 5 * len(tf.transformer_blocks)):
                rep["kernels_from"] = ("graph replay was opaque to the profiler; 'eager' has the "
                                       "same step's kernels")
            else:
                rep["kernels_from"] = "graph replay (kernels seen inside the graph)"
            out["graph" if mode == "exact" else f"graph_{mode}"] = rep
        finally:
            wiring.disable()
    return out


# ------------------------------------------------------------------ table

def table(profiles: dict) -> str:
    """A compact text table of every profile (for the log)."""
    lines = []
    for name, rep in profiles.items():
        for sub, r in _flatten(name, rep):
            source = f"; {r['kernels_from']}" if r.get("kernels_from") else ""
            lines.append(f"== {sub}: wall {r['wall_ms_per_step']:.2f} ms/step, GPU busy "
                         f"{r['gpu_busy_ms_per_step']:.2f} (kernels "
                         f"{r['gpu_kernel_ms_per_step']:.2f}, {r['kernels_per_step']:.0f}/step), "
                         f"gap {r['launch_gap_ms_per_step']:.2f}{source}")
            cats = "  ".join(f"{c} {v['ms_per_step']:.2f} ({v['share'] * 100:.0f}%, "
                             f"{v['kernels_per_step']:.0f})"
                             for c, v in r["by_category"].items() if v["kernels_per_step"])
            lines.append(f"   by category ms/step (share, kernels): {cats}")
            g = r.get("gemm") or {}
            for proj, p in (g.get("by_projection") or {}).items():
                bw = (f", {p['achieved_gb_s']:.0f} GB/s = {p.get('of_copy_bandwidth', 0):.2f} of "
                      f"copy" if "achieved_gb_s" in p else "")
                lines.append(f"   gemm {proj:13s} {p['ms_per_step']:.3f} ms/step, "
                             f"{p['mean_us']:.1f} us/call x{p['calls_per_step']}{bw}")
            if g.get("weights"):
                w = g["weights"]
                lines.append(f"   weight GEMMs {w['ms_per_step']:.3f} ms/step for "
                             f"{w['bytes_per_step'] / 1e9:.2f} GB: {w['achieved_gb_s']:.0f} GB/s"
                             f" = {w.get('of_copy_bandwidth', 0):.2f} of copy")
            if g and not g.get("attributed"):
                lines.append(f"   gemm not attributed: {g.get('why')}")
            for k in r["top_kernels"][:15]:
                lines.append(f"   {k['ms_per_step']:8.3f} ms {k['count_per_step']:6.1f}x "
                             f"{k['category']:11s} {k['name'][:90]}")
            if r.get("other_kernel_names"):
                lines.append(f"   other: {list(r['other_kernel_names'])[:8]}")
    return "\n".join(lines)


def _flatten(name, rep):
    if "wall_ms_per_step" in rep:
        yield name, rep
        return
    for key, sub in rep.items():
        if isinstance(sub, dict):
            yield from _flatten(f"{name}/{key}", sub)
