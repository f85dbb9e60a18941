"""Batch-1 GEMVs of SenseNova-U1's decode step, library against library, inside a CUDA graph.

    python benchmarks/probes/gemv.py [--out PATH] [--quick] [--shapes o_proj,qkv] [--candidates ...]

Why (issue #12, "GEMVs at copy bandwidth"): a decode step at batch 1 is y = x @ W^T with x (1, K)
bf16 for every linear layer, so each one should stream its weight at memory bandwidth. Measured
inside the plugin's graphed step with cuBLAS, gate_up and lm_head reach copy bandwidth while qkv
(71%), o_proj (61%) and down (80%) do not. This script decides what to use instead, by measurement
at the real shapes, preferring well-kept libraries; the hand-written Triton kernel runs last and
only shows whether the libraries fall short.

How: per shape, a ring of distinct weight copies (42, one per layer; lm_head 3) so that L2 (50 MB
on H200) never serves a weight; one CUDA graph runs the candidate over every copy in order and is
replayed; CUDA events, median over trials. ``us`` is per call, ``gb_s`` the weight bytes over that
time, ``eff_read`` / ``eff_copy`` against a graph of ``torch.sum`` over 2 GiB (read bandwidth) and
a 2 GiB device copy counted read + write (the issue's reference) measured in the same run.
``max_abs_diff`` is against an fp32 reference (copy 0 and the last copy); ``bit_identical`` is
copy 0 against eager ``F.linear`` (cuBLAS default).

Candidates (each guarded: one that fails reports its error string):
  cublas                       F.linear, torch's default BLAS (vllm's UnquantizedLinearMethod)
  cublas_mv                    torch.mv(W, x): the same library asked for a matrix-vector product
  cublas_no_splitk             F.linear with allow_bf16_reduced_precision_reduction = (False, False)
  cublaslt                     F.linear with preferred_blas_library("cublaslt") while capturing
  cublaslt_no_splitk           both (cuBLASLt without split-K)
  inductor_default             torch.compile, default mode: Inductor keeps the mm as an ATen call
  inductor_max_autotune        mode "max-autotune-no-cudagraphs"; that mode also turns on
                               coordinate_descent_tuning, under which Inductor decomposes an M=1 mm
                               into multiply + sum (a tuned reduction), so no mm template runs
  inductor_triton_templates    max_autotune with coordinate descent off and gemm backends "TRITON":
                               Inductor's Triton mm templates themselves
  inductor_autotune_aten_triton  the same with gemm backends "ATEN,TRITON": what the autotuner
                               picks between cuBLAS and the templates (its choice is in
                               ``generated``)
  inductor_coordinate_descent  default mode + coordinate_descent_tuning (gpt-fast's setting)
  vllm_linear                  what vllm's dispatch_unquantized_gemm() returns on this platform
                               (read in 0.30: F.linear on CUDA, FlashInfer's CuTe-DSL bf16 GEMM
                               only for --linear-backend flashinfer_cutedsl on SM100; its skinny
                               GEMMs LLMM1/wvSplitK live in _rocm_C, ROCm only; ``vllm`` in the
                               document lists the GEMM ops registered here)
  vllm_batch_invariant         vllm's Triton matmul_persistent (its batch-invariant mode)
  handwritten_triton_gemv      HAND-WRITTEN: one program per BLOCK_N output rows, fp32 accumulation,
                               no split-K; BLOCK_N/BLOCK_K/num_warps tuned over a small grid

Inductor candidates report compile seconds and what Inductor generated (kernel names, ATen calls,
block sizes). Compilation stops being attempted once ``--compile-budget-s`` is spent (the shapes
run worst-first, so what is cut is what already runs at bandwidth). Without a CUDA device the
script prints ``{"skipped": "no CUDA device", ...}`` and exits 0. vllm is optional. Expected
runtime on one H200 (estimated, not yet measured): ~3 min at the defaults, most of it compiling;
--quick ~1.5 min. stdout carries only the JSON document (logs go to stderr); --out is rewritten
after each shape.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N out, K in, copies); worst efficiency first (issue #12's measurement)
    "o_proj": (4096, 4096, 42),
    "qkv": (6144, 4096, 42),
    "down": (4096, 12288, 42),
    "gate_up": (24576, 4096, 42),
    "lm_head": (151936, 4096, 3),
}
LIBRARY_CANDIDATES = (
    "cublas", "cublas_mv", "cublas_no_splitk", "cublaslt", "cublaslt_no_splitk",
    "inductor_default", "inductor_max_autotune", "inductor_triton_templates",
    "inductor_autotune_aten_triton", "inductor_coordinate_descent", "vllm_linear",
    "vllm_batch_invariant",
)
HANDWRITTEN = "handwritten_triton_gemv"
CANDIDATES = LIBRARY_CANDIDATES + (HANDWRITTEN,)
BLAS_SETTINGS = {  # candidate: (preferred BLAS library or None, disallow split-K)
    "cublas": (None, False), "cublas_mv": (None, False), "cublas_no_splitk": (None, True),
    "cublaslt": ("cublaslt", False), "cublaslt_no_splitk": ("cublaslt", True),
}
COMPILE_OPTIONS = {  # candidate: torch.compile keyword arguments
    "inductor_default": {},
    "inductor_max_autotune": {"mode": "max-autotune-no-cudagraphs"},
    "inductor_triton_templates": {"options": {"max_autotune": True,
                                              "coordinate_descent_tuning": False,
                                              "max_autotune_gemm_backends": "TRITON"}},
    "inductor_autotune_aten_triton": {"options": {"max_autotune": True,
                                                  "coordinate_descent_tuning": False,
                                                  "max_autotune_gemm_backends": "ATEN,TRITON"}},
    "inductor_coordinate_descent": {"options": {"coordinate_descent_tuning": True}},
}
# (BLOCK_N, BLOCK_K, num_warps): tiles of 2-8 K elements (8-64 per thread); N and K here all
# divide, other shapes are masked. Ten configs: their first compile is ~1-2 s each.
TRITON_GRID = ((4, 512, 4), (4, 1024, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 4), (8, 512, 8),
               (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8))
TRITON_GRID_QUICK = ((8, 512, 4), (16, 512, 8), (4, 1024, 4))
TARGET_TRIAL_MS = 5.0


def log(msg):
    print(f"[gemv {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _err(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _csv(choices):
    def parse(text):
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {bad or 'empty list'}; choose from {','.join(choices)}")
        return names
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the JSON document to this path")
    p.add_argument("--quick", action="store_true",
                   help="fewer copies, trials and Triton configs; compile budget 40 s")
    p.add_argument("--shapes", type=_csv(tuple(SHAPES)), default=list(SHAPES))
    p.add_argument("--candidates", type=_csv(CANDIDATES), default=list(CANDIDATES))
    p.add_argument("--copies", type=int, default=None,
                   help="ring size per layer shape (42; quick 16)")
    p.add_argument("--lm-head-copies", type=int, default=None,
                   help="lm_head ring size (3; quick 2)")
    p.add_argument("--trials", type=int, default=None,
                   help="timed trials per candidate (7; quick 3)")
    p.add_argument("--compile-budget-s", type=float, default=None,
                   help="start no torch.compile candidate after this many compile seconds "
                        "(90; quick 40)")
    args = p.parse_args(argv)
    defaults = {"copies": (42, 16), "lm_head_copies": (3, 2), "trials": (7, 3),
                "compile_budget_s": (90.0, 40.0)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if min(args.copies, args.lm_head_copies, args.trials) < 1:
        p.error("--copies, --lm-head-copies and --trials must be >= 1")
    return args


# ---------------------------------------------------------------- timing


_STATE: dict = {}


def _side_stream():
    if "stream" not in _STATE:
        _STATE["stream"] = torch.cuda.Stream()
    return _STATE["stream"]


def capture(body, settings=contextlib.nullcontext):
    """(graph, body's result): warm-up on the side stream, then capture there, under ``settings``
    (a BLAS choice is read at launch, so it must hold while capturing)."""
    stream = _side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with settings():
        with torch.cuda.stream(stream):
            body()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            result = body()
    torch.cuda.synchronize()
    return graph, result


def time_graph(graph, trials: int) -> float:
    """Median ms per replay; each trial replays enough times to last ~TARGET_TRIAL_MS."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(2, math.ceil(TARGET_TRIAL_MS / max(start.elapsed_time(end), 1e-3)))
    samples = []
    for _ in range(trials):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    return statistics.median(samples)


def graph_ms(body, trials: int) -> float:
    graph, _ = capture(body)
    return time_graph(graph, trials)


def bandwidth(trials: int, size_bytes: int = 2 << 30) -> dict:
    """Read bandwidth (graph of an fp32-accumulated torch.sum) and copy bandwidth (read + write),
    both over buffers far larger than L2."""
    src = torch.randn(size_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    read_ms = graph_ms(lambda: torch.sum(src, dtype=torch.float32), trials)
    copy_ms = graph_ms(lambda: dst.copy_(src), trials)
    return {"buffer_gib": size_bytes / 2**30,
            "read_sum_gb_s": round(size_bytes / read_ms / 1e6, 1),
            "copy_read_write_gb_s": round(2 * size_bytes / copy_ms / 1e6, 1)}


# ---------------------------------------------------------------- cuBLAS settings


@contextlib.contextmanager
def blas_settings(library: str | None, no_splitk: bool):
    """Preferred BLAS library and split-K permission for bf16, restored on exit."""
    matmul = torch.backends.cuda.matmul
    saved_lib = torch.backends.cuda.preferred_blas_library()
    saved_red = (matmul.allow_bf16_reduced_precision_reduction,
                 matmul.allow_bf16_reduced_precision_reduction_split_k if no_splitk else None)
    try:
        if library:
            torch.backends.cuda.preferred_blas_library(library)
        if no_splitk:
            # (allow reduced-precision reduction, allow split-K); torch refuses split-K off alone.
            matmul.allow_bf16_reduced_precision_reduction = (False, False)
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved_lib)
        if no_splitk:
            matmul.allow_bf16_reduced_precision_reduction = saved_red


def kernel_names(fn, x, w, settings) -> list[str]:
    """CUDA kernels one eager call launches (cuBLAS's choice is the same eagerly and captured)."""
    from torch.profiler import ProfilerActivity, profile

    with settings(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x, w)
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sorted({e.name[:160] for e in prof.events() if e.device_type == cuda})


# ---------------------------------------------------------------- candidates


def linear(x, w):
    return F.linear(x, w)


def mv(x, w):
    return torch.mv(w, x.view(-1)).view(1, -1)


def summarize_code(codes: list[str]) -> dict:
    """What Inductor generated: Triton kernels by name, ATen calls, block sizes; and its kind."""
    text = "\n".join(codes)
    kernels = sorted(set(re.findall(r"def (triton_\w+)\(", text)))
    extern = sorted(set(re.findall(r"extern_kernels\.(\w+)", text)))
    blocks = sorted(set(re.findall(
        r"\b(BLOCK_[MNK]|EVEN_K|GROUP_M|num_stages|num_warps)\s*:\s*tl\.constexpr\s*=\s*(\w+)",
        text)))
    if any(k.startswith("triton_tem") for k in kernels):
        kind = "triton mm template"
    elif any(k.startswith(("triton_red", "triton_per")) for k in kernels):
        kind = "mm decomposed into multiply + sum reduction"
    elif any(e in ("mm", "addmm", "bmm") for e in extern):
        kind = "ATen mm (cuBLAS)"
    else:
        kind = "unknown" if codes else "no code captured (cache hit?)"
    return {"kind": kind, "triton_kernels": kernels, "aten_calls": extern,
            "constexprs": [f"{k}={v}" for k, v in blocks][:16], "code_chars": len(text)}


def compiled_candidate(name, x, w):
    """(fn, info): torch.compile of F.linear at this fixed shape, compiled and warmed now."""
    fn = torch.compile(linear, dynamic=False, fullgraph=True, **COMPILE_OPTIONS[name])
    start = time.perf_counter()
    try:
        from torch._inductor.utils import run_and_get_code

        _, codes = run_and_get_code(fn, x, w)  # resets dynamo first: each shape compiles afresh
        generated = summarize_code(codes)
    except ImportError as exc:
        torch._dynamo.reset()
        fn(x, w)
        generated = {"error": _err(exc)}
    torch.cuda.synchronize()
    return fn, {"compile_s": round(time.perf_counter() - start, 2), "generated": generated}


def _import_first(paths, attr):
    errors = []
    for path in paths:
        try:
            module = __import__(path, fromlist=[attr])
            return getattr(module, attr)
        except Exception as exc:  # noqa: BLE001 - any import failure is a reason to report
            errors.append(f"{path}: {_err(exc)}")
    raise ImportError("; ".join(errors))


def vllm_candidate(name):
    """(fn, info) for a vllm op; ImportError when vllm (or the op) is not importable here."""
    if name == "vllm_linear":
        dispatch = _import_first(["vllm.model_executor.layers.utils"], "dispatch_unquantized_gemm")
        gemm = dispatch()
        return (lambda x, w: gemm(None, x, w)), {"vllm_function": getattr(gemm, "__name__",
                                                                          repr(gemm))}
    persistent = _import_first(["vllm.model_executor.determinism.batch_invariant",
                                "vllm.model_executor.layers.batch_invariant"], "matmul_persistent")
    return (lambda x, w: persistent(x, w.t())), {"vllm_function": "matmul_persistent"}


def vllm_report() -> dict:
    """Which vllm ops for bf16 small-M GEMM exist on this platform (registered op names)."""
    out: dict = {}
    try:
        import vllm

        out["version"] = getattr(vllm, "__version__", None)
        from vllm import _custom_ops  # noqa: F401 - loads vllm._C and registers its ops
    except Exception as exc:  # noqa: BLE001
        out["error"] = _err(exc)
        return out
    ops = torch._C._dispatch_get_all_op_names()
    out["rocm_skinny_gemm_ops"] = sorted(o for o in ops if o.startswith("_rocm_C::")
                                         and re.search(r"LLMM|wvSplitK", o)) or \
        "none registered (LLMM1/wvSplitK are ROCm-only, in _rocm_C)"
    out["cuda_gemm_ops"] = sorted(o for o in ops if o.startswith(("_C::", "vllm::"))
                                  and re.search(r"gemm|gemv|_mm\b|_mm_|skinny", o))
    return out


# ---------------------------------------------------------------- hand-written Triton GEMV

_KERNEL: dict = {}


def _gemv_kernel():
    """The Triton kernel, defined on first use so importing this file needs no Triton (and the
    Triton CPU interpreter, TRITON_INTERPRET=1, can run it in tests)."""
    if "k" in _KERNEL:
        return _KERNEL["k"]
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_rows(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_N and EVEN_K:
                xv = tl.load(x_ptr + k0 + cols)
                wv = tl.load(w_ptrs + k0)
            else:
                kmask = k0 + cols < K
                xv = tl.load(x_ptr + k0 + cols, mask=kmask, other=0.0)
                wv = tl.load(w_ptrs + k0, mask=(rows[:, None] < N) & kmask[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty)
        if EVEN_N:
            tl.store(y_ptr + rows, y)
        else:
            tl.store(y_ptr + rows, y, mask=rows < N)

    _KERNEL["k"] = (triton, gemv_rows)
    return _KERNEL["k"]


def gemv_triton(x, w, block_n=8, block_k=512, num_warps=4):
    """y (1, N) = x (1, K) @ w (N, K)^T, both contiguous, any float dtype; fp32 accumulation."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous(), x.shape
    assert w.dim() == 2 and w.stride(1) == 1 and w.shape[1] == x.shape[1], (w.shape, w.stride())
    triton, kernel = _gemv_kernel()
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(n, block_n),)](x, w, y, n, k, w.stride(0), BLOCK_N=block_n,
                                       BLOCK_K=block_k, EVEN_N=n % block_n == 0,
                                       EVEN_K=k % block_k == 0, num_warps=num_warps)
    return y


# ---------------------------------------------------------------- one shape


def make_ring(n, k, copies):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((1, k), dtype=torch.bfloat16, device="cuda", generator=g)
    ring = [torch.randn((n, k), dtype=torch.bfloat16, device="cuda", generator=g).mul_(0.02)
            for _ in range(copies)]
    return x, ring


def measure(fn, x, ring, refs, trials, settings=contextlib.nullcontext) -> dict:
    """Time ``fn`` over the ring in one graph; check copy 0 and the last copy's outputs."""
    graph, outs = capture(lambda: [fn(x, w) for w in ring], settings)
    ms = time_graph(graph, trials)
    us = ms * 1e3 / len(ring)
    diff = max((outs[i].float() - refs["fp32"][j]).abs().max().item()
               for j, i in enumerate((0, len(ring) - 1)))
    row = {"us": round(us, 2), "gb_s": round(ring[0].numel() * 2 / us / 1e3, 1),
           "max_abs_diff": diff, "bit_identical": bool(torch.equal(outs[0], refs["cublas_eager"]))}
    del graph, outs
    return row


def tune_handwritten(x, ring, refs, args) -> dict:
    grid = TRITON_GRID_QUICK if args.quick else TRITON_GRID
    results = {}
    for bn, bk, nw in grid:
        key = f"bn{bn}_bk{bk}_w{nw}"
        try:
            fn = (lambda x_, w_, bn=bn, bk=bk, nw=nw: gemv_triton(x_, w_, bn, bk, nw))
            results[key] = measure(fn, x, ring, refs, max(2, args.trials // 2))["us"]
        except Exception as exc:  # noqa: BLE001 - one config failing must not end the grid
            results[key] = _err(exc)
    timed = {k: v for k, v in results.items() if isinstance(v, float)}
    if not timed:
        raise RuntimeError(f"every Triton config failed: {results}")
    best = min(timed, key=timed.get)
    bn, bk, nw = (int(s) for s in re.findall(r"\d+", best))
    row = measure(lambda x_, w_: gemv_triton(x_, w_, bn, bk, nw), x, ring, refs, args.trials)
    return {**row, "handwritten": True, "config": best, "grid_us": results}


def run_candidate(name, x, ring, refs, args, budget) -> dict:
    if name in BLAS_SETTINGS:
        settings = functools.partial(blas_settings, *BLAS_SETTINGS[name])
        fn = mv if name == "cublas_mv" else linear
        row = measure(fn, x, ring, refs, args.trials, settings)
        try:
            row["kernels"] = kernel_names(fn, x, ring[0], settings)
        except Exception as exc:  # noqa: BLE001 - the names are a detail; the timing stands
            row["kernels"] = _err(exc)
        return row
    if name in COMPILE_OPTIONS:
        if budget["spent_s"] >= args.compile_budget_s:
            return {"skipped": f"compile budget {args.compile_budget_s:.0f} s spent; "
                               f"raise --compile-budget-s"}
        start = time.perf_counter()
        try:
            fn, info = compiled_candidate(name, x, ring[0])
        finally:
            budget["spent_s"] += time.perf_counter() - start
        return {**measure(fn, x, ring, refs, args.trials), **info}
    if name == HANDWRITTEN:
        return tune_handwritten(x, ring, refs, args)
    fn, info = vllm_candidate(name)
    return {**measure(fn, x, ring, refs, args.trials), **info}


def run_shape(shape, args, bw, budget) -> dict:
    n, k, copies = SHAPES[shape]
    copies = args.lm_head_copies if shape == "lm_head" else min(copies, args.copies)
    x, ring = make_ring(n, k, copies)
    refs = {"fp32": [(x.float() @ ring[i].float().t()) for i in (0, copies - 1)],
            "cublas_eager": F.linear(x, ring[0])}
    out = {"n": n, "k": k, "copies": copies, "weight_mb": round(n * k * 2 / 1e6, 2),
           "ring_gb": round(n * k * 2 * copies / 1e9, 2), "candidates": {}}
    for name in args.candidates:
        start = time.perf_counter()
        try:
            row = run_candidate(name, x, ring, refs, args, budget)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next candidate
            row = {"error": _err(exc)}
        if "gb_s" in row:
            row["eff_read"] = round(row["gb_s"] / bw["read_sum_gb_s"], 3)
            row["eff_copy"] = round(row["gb_s"] / bw["copy_read_write_gb_s"], 3)
        row["wall_s"] = round(time.perf_counter() - start, 2)
        out["candidates"][name] = row
        log(f"{shape} {name}: {row.get('us', row.get('error', row.get('skipped')))}")
    del x, ring, refs
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- document


def best_of(cands: dict, names) -> str | None:
    timed = {n: cands[n]["us"] for n in names if n in cands and "us" in cands[n]}
    return min(timed, key=timed.get) if timed else None


def summarize(shapes: dict) -> dict:
    """Per shape: cuBLAS default, the best library candidate, the hand-written kernel, and
    whether the best library candidate reaches issue #12's target (gate_up's cuBLAS efficiency)."""
    out = {}
    for shape, res in shapes.items():
        cands = res["candidates"]
        lib = best_of(cands, LIBRARY_CANDIDATES)
        row = {"best_library": lib}
        for label, name in (("cublas", "cublas"), ("best_library", lib),
                            ("handwritten", HANDWRITTEN)):
            if name and "us" in cands.get(name, {}):
                row[f"{label}_us"] = cands[name]["us"]
                row[f"{label}_eff_copy"] = cands[name]["eff_copy"]
                row[f"{label}_eff_read"] = cands[name]["eff_read"]
        out[shape] = row
    target = out.get("gate_up", {}).get("cublas_eff_copy")
    for row in out.values():
        if target is not None and "best_library_eff_copy" in row:
            row["best_library_reaches_gate_up_cublas"] = row["best_library_eff_copy"] >= target
    return out


def skipped_document(args, reason) -> dict:
    return {"skipped": reason, "shapes": args.shapes, "candidates": args.candidates,
            "quick": args.quick}


def run(args, doc: dict) -> None:
    """Fill ``doc`` shape by shape, rewriting --out after each, so a crash keeps what was done."""
    import common  # benchmarks/common.py (main() puts benchmarks/ on the path): versions, GPU

    start = time.perf_counter()
    doc.update(environment=common.environment(), args=vars(args),
               default_blas=str(torch.backends.cuda.preferred_blas_library()))
    doc["bandwidth"] = bw = bandwidth(args.trials)
    torch.cuda.empty_cache()
    log(f"bandwidth {bw}")
    if any(c.startswith("vllm_") for c in args.candidates):
        doc["vllm"] = vllm_report()
    budget = {"spent_s": 0.0}
    doc["shapes"] = {}
    for shape in args.shapes:
        doc["shapes"][shape] = run_shape(shape, args, bw, budget)
        doc["compile_s_total"] = round(budget["spent_s"], 1)
        doc["elapsed_s"] = round(time.perf_counter() - start, 1)
        emit(doc, args.out, None, to_stdout=False)
    doc["summary"] = summarize(doc["shapes"])


def emit(doc: dict, out_path: str | None, stdout_fd: int | None = None,
         to_stdout: bool = True) -> None:
    text = json.dumps(doc, indent=1, default=str)
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            f.write(text + "\n")
    if not to_stdout:
        return
    if stdout_fd is None:
        print(text, flush=True)
    else:
        with os.fdopen(stdout_fd, "w") as f:
            f.write(text + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        emit(skipped_document(args, "no CUDA device"), args.out)
        return 0
    # vllm's logger, Inductor and Triton print to stdout (Python and C level): send fd 1 to
    # stderr while measuring so stdout carries only the JSON document.
    sys.stdout.flush()
    stdout_fd = os.dup(1)
    os.dup2(2, 1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # common
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    doc: dict = {}
    rc = 0
    try:
        run(args, doc)
    except Exception as exc:  # noqa: BLE001 - keep the shapes measured so far, say what broke
        doc["error"] = _err(exc)
        rc = 1
    sys.stdout.flush()
    emit(doc, args.out, stdout_fd)
    return rc


if __name__ == "__main__":
    sys.exit(main())
