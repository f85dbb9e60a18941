"""FP8 weights for SenseNova-U1's decode GEMVs: libraries against the plugin's Triton kernel.

    python benchmarks/probes/fp8_gemv.py --out DIR [--rows 1,8,16] [--sweep] [--layers 42]

Why (issue #23): a decode step at 1-16 rows is bound by the bytes of its weights. This measures,
at SenseNova-U1's shapes (qkv 6144x4096, o_proj 4096x4096, gate_up 24576x4096, down 4096x12288;
lm_head 151936x4096 apart), the whole 42-layer chain of a step's linear layers as one CUDA graph
per candidate and row count, each layer its own weight (so L2 never serves one):

  cublas_bf16     F.linear on the bf16 weights (what the step runs today)
  triton_w8a16    HAND-WRITTEN here: e4m3 weights, per-row scales, bf16 activations widened in
                  registers, one tensor-core tile of 16 rows; fixed block sizes (``config_for``,
                  or --sweep's best)
  marlin_w8a16    vLLM's Marlin FP8 weight-only GEMM (``apply_fp8_marlin_linear``) through the
                  plugin's ``marlin.Fp8Weight``: what the plugin's batched step runs
  plugin_gemv     the plugin's one-row GEMV (``vllm_omni_graphdecode.ops.fp8.gemv``, hand-written,
                  block sizes from the shape alone): what its one-request step runs; at 8 and
                  16 rows it reads the weights once per row (shown, not used there)
  cutlass_w8a8    vLLM's ``scaled_fp8_quant`` (dynamic per-token activation scale) +
                  ``cutlass_scaled_mm`` (what ``--quantization fp8`` runs)
  scaled_mm_w8a8  the same activation quantisation + ``torch._scaled_mm`` (row-wise scales)

``ms`` is one replay of the 168-call chain (median of 7 timings of 10 replays); ``rel_err``: one
layer of each shape against the bf16 F.linear output, ||y - y_bf16|| / ||y_bf16||, random
weights (std 0.02) and inputs (std 1); ``kernel_vs_reference``: the Triton kernel against its
fp32 restatement (``fp8.reference``); ``row_invariant``: row 0 of a 16-row call equals the
1-row call bit for bit. --sweep times every block-size candidate per shape at 1 and 16 rows
before the chain and uses the best (lowest sum of the two). --gemv-sweep times the plugin GEMV's
block sizes per shape at one row, lm_head's too (``gemv_sweep``; the chain keeps
``config_for``'s), then the step's GEMVs as one chain with today's configs against the sweep's
picks (``gemv_chain``; ``--gemv-only`` stops there; ``scripts/gpu/gemv_table.py`` writes the picks
into ``gemv_table.MEASURED``). --bf16-gemv: only the plugin's GEMV kernel on the bf16 weights
themselves against cuBLAS (``bf16_gemv``, issue #42). Prints the JSON document and writes it to
DIR/fp8-gemv.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import capture_graph, environment, time_ms  # noqa: E402

from vllm_omni_graphdecode.graphs.compiling import triton_kernel  # noqa: E402
from vllm_omni_graphdecode.hooks.sensenova_u1.gemv_table import MEASURED  # noqa: E402
from vllm_omni_graphdecode.ops.fp8 import gemv, marlin as fp8_marlin, quant  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 4096, 32, 8, 128, 12288, 151936
SHAPES = {
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * MLP, HIDDEN),
    "down": (HIDDEN, MLP),
}
ROWS = 16  # rows of the hand-written kernel's tile (1-16 rows padded to 16)


# -- the hand-written candidate (HAND-WRITTEN; measured slower than cuBLAS bf16, not used) ----

@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (N, K) -> block sizes; --sweep fills it with the fastest found (the sum of 1 and 16 rows).
CONFIGS: dict[tuple[int, int], KernelConfig] = {}
DEFAULT_CONFIG = KernelConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)


def config_for(n: int, k: int) -> KernelConfig | None:
    """The fixed block sizes for an [n, k] weight, or None when no block size divides it."""
    found = CONFIGS.get((n, k))
    if found is not None:
        return found
    for block_n in (DEFAULT_CONFIG.block_n, 16):
        for block_k in (DEFAULT_CONFIG.block_k, 128, 64):
            if n % block_n == 0 and k % block_k == 0:
                return dataclasses.replace(DEFAULT_CONFIG, block_n=block_n, block_k=block_k)
    return None


@dataclasses.dataclass
class TritonWeight:
    """One linear layer's e4m3 copy. ``source``: the bf16 weight it was made from, checked by
    ``stale`` (same storage, same version counter)."""

    w8: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32
    bias: torch.Tensor | None  # [N], the layer's own
    config: KernelConfig
    source_ptr: int
    source_version: int

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None):
        n, k = weight.shape
        config = config_for(n, k)
        if config is None:
            raise ValueError(f"no FP8 GEMV block size divides a [{n}, {k}] weight")
        w8, scale = quant.quantize_rows(weight.detach())
        return cls(w8, scale, bias, config, weight.data_ptr(), weight._version)

    def stale(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() != self.source_ptr or weight._version != self.source_version

    @property
    def nbytes(self) -> int:
        return self.w8.numel() + self.scale.numel() * 4


def triton_linear(x: torch.Tensor, weight: TritonWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (w8 * scale).T + bias`` for ``x`` [..., K] bf16 with at most ``ROWS`` rows, as one
    kernel launch; the result has ``x``'s dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > ROWS:  # noqa: SIM102
        raise ValueError(f"the FP8 GEMV takes at most {ROWS} rows, got {m}")
    n = weight.w8.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = weight.config
    bias = weight.bias
    _kernel()[(n // cfg.block_n,)](
        x2, weight.w8, weight.scale, bias if bias is not None else weight.scale, out,
        m, k, x2.stride(0), weight.w8.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ROWS=ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.reshape(*x.shape[:-1], n)


def _define(triton, tl):
    """The Triton kernel (``compiling.triton_kernel`` defines it at first use)."""
    @triton.jit
    def w8a16_gemv(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, K, stride_xm, stride_wn,
                   stride_om, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]). The weight tile is the
        # dot's left operand ([BLOCK_N, BLOCK_K], widened to bf16 in registers), the rows' tile
        # its right ([BLOCK_K, ROWS]): rows past M load zeros and are not stored. K is a
        # multiple of BLOCK_K and N of BLOCK_N (config_for), so only the rows are masked.
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs).to(tl.bfloat16)
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = acc * tl.load(scale_ptr + offs_n)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :])

    return w8a16_gemv


_kernel = triton_kernel(_define)



SWEEP = [KernelConfig(bn, bk, w, s)
         for bn in (16, 32, 64) for bk in (128, 256, 512)
         for (w, s) in ((4, 3), (4, 5), (8, 4))]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def graph_ms(fn, replays: int = 10, trials: int = 7) -> float:
    """ms per replay of ``fn`` captured as one graph (median of ``trials`` timings of
    ``replays`` replays)."""
    graph, _ = capture_graph(fn)
    return time_ms(graph.replay, warmup=1, repeats=trials, inner=replays)


def triton_reference(x, weight):
    """What ``triton_linear`` computes, in fp32 (the sum order differs)."""
    out = x.float() @ quant.dequantize(weight.w8, weight.scale).T
    return (out if weight.bias is None else out + weight.bias.float()).to(x.dtype)


def w8a8_factories():
    out = {}
    try:
        from vllm import _custom_ops as ops

        def cutlass(x, w8, scale):
            x8, sx = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
            return ops.cutlass_scaled_mm(x8, w8.t(), scale_a=sx, scale_b=scale.view(-1, 1),
                                         out_dtype=torch.bfloat16)
        out["cutlass_w8a8"] = cutlass

        def scaled_mm(x, w8, scale):
            x8, sx = ops.scaled_fp8_quant(x, None, use_per_token_if_dynamic=True)
            return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=scale.view(1, -1),
                                    out_dtype=torch.bfloat16)
        out["scaled_mm_w8a8"] = scaled_mm
    except Exception as exc:  # noqa: BLE001 - reported
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def sweep(layers: int, rows_list) -> dict:
    best, table = {}, {}
    for name, (n, k) in SHAPES.items():
        weights = [TritonWeight.from_weight(torch.randn(n, k, device="cuda",
                                                         dtype=torch.bfloat16) * 0.02)
                   for _ in range(layers)]
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in rows_list}
        rows = []
        for cfg in SWEEP:
            if n % cfg.block_n or k % cfg.block_k:
                continue
            ws = [dataclasses.replace(w, config=cfg) for w in weights]
            entry = {"config": dataclasses.asdict(cfg)}
            try:
                for m, x in xs.items():
                    entry[f"us_m{m}"] = round(graph_ms(
                        lambda: [triton_linear(x, w) for w in ws]) * 1000 / layers, 2)
            except Exception as exc:  # noqa: BLE001 - reported
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(entry)
            log(name, entry)
        ok = [r for r in rows if "error" not in r]
        pick = min(ok, key=lambda r: sum(r[f"us_m{m}"] for m in xs))
        best[name] = KernelConfig(**pick["config"])
        table[name] = {"best": pick, "all": rows,
                       "floor_us": round(n * k / 4.28e12 * 1e6 * 1.0, 2)}
        del weights
        torch.cuda.empty_cache()
    return best, table


GEMV_SWEEP = [gemv.KernelConfig(bn, bk, w, st)
              for bn in (4, 8, 16, 32) for bk in (256, 512, 1024, 2048)
              for (w, st) in ((4, 1), (8, 1))]
# A config whose block sizes differ from today's rounds differently: it replaces today's only
# when it is faster by more than this share.
NEW_BLOCKS_MARGIN = 0.02
HEAD_COPIES = 3  # lm_head copies in a chain (26 GB for 42 would be a waste; 3 defeat L2)


def gemv_sweep(layers: int) -> dict:
    """The plugin GEMV's configs at one row, per shape (the four decoder-layer shapes and
    lm_head): us per layer (a chain of ``layers`` copies of the shape as one graph, ``HEAD_COPIES``
    for lm_head) against ``config_for``'s pick (today's) and the byte floor. ``pick``: the config
    ``scripts/gpu/gemv_table.py`` writes into ``gemv_table.MEASURED`` (today's, unless other
    block sizes beat it by ``NEW_BLOCKS_MARGIN``: they round differently)."""
    table = {}
    for name, (n, k) in {**SHAPES, "lm_head": (VOCAB, HIDDEN)}.items():
        copies = HEAD_COPIES if name == "lm_head" else layers
        ws = [quant.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        today = gemv.config_for(n, k, MEASURED)
        rows = []
        for cfg in GEMV_SWEEP + [today]:
            if n % cfg.block_n or k % cfg.block_k or any(r["config"] == dataclasses.asdict(cfg)
                                                         for r in rows):
                continue
            entry = {"config": dataclasses.asdict(cfg)}
            try:
                entry["us"] = round(graph_ms(
                    lambda: [gemv.gemv(x, w8, s, None, cfg) for w8, s in ws]) * 1000 / copies, 2)
            except Exception as exc:  # noqa: BLE001 - reported
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(entry)
        ok = [r for r in rows if "error" not in r]
        now = next(r for r in rows if r["config"] == dataclasses.asdict(today))
        best = min(ok, key=lambda r: r["us"])
        pick = best if best["us"] < now["us"] * (1 - NEW_BLOCKS_MARGIN) else now
        table[name] = {"shape": [n, k], "best": best, "config_for": now, "pick": pick,
                       "floor_us": round(n * k / 4.28e12 * 1e6, 2), "all": rows}
        log(name, "best", best, "today", now, "pick", pick)
        del ws
        torch.cuda.empty_cache()
    return table


def gemv_chain(layers: int, picks: dict) -> dict:
    """The one-request step's GEMVs alone, as one graph at one row: every layer's qkv, o,
    gate-up and down projections (``layers`` of each, own weights), then lm_head, with today's
    configs (``config_for``) and with ``picks`` ({name: KernelConfig}) in the same process,
    alternated three times; ms per chain (median of each side's three) and whether the picks'
    output has today's bits (``same_bits``: wherever a pick kept today's config)."""
    shapes = {**SHAPES, "lm_head": (VOCAB, HIDDEN)}
    ws = {name: [quant.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
                 for _ in range(1 if name == "lm_head" else layers)]
          for name, (n, k) in shapes.items()}
    xs = {name: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
          for name, (n, k) in shapes.items()}
    sides = {"today": {name: gemv.config_for(*shape, MEASURED) for name, shape in shapes.items()},
             "picked": {name: picks.get(name) or gemv.config_for(*shape, MEASURED)
                        for name, shape in shapes.items()}}

    def chain(cfgs):
        def run():
            for i in range(layers):
                for name in SHAPES:
                    gemv.gemv(xs[name], *ws[name][i], None, cfgs[name])
            gemv.gemv(xs["lm_head"], *ws["lm_head"][0], None, cfgs["lm_head"])
        return run

    times = {side: [] for side in sides}
    for _ in range(3):
        for side, cfgs in sides.items():
            times[side].append(graph_ms(chain(cfgs)))
    out = {side: round(sorted(t)[1], 4) for side, t in times.items()}
    out["all_ms"] = {side: [round(v, 4) for v in t] for side, t in times.items()}
    out["floor_ms"] = round((layers * sum(n * k for n, k in SHAPES.values()) + VOCAB * HIDDEN)
                            / 4.28e12 * 1e3, 4)
    out["same_bits"] = {
        name: bool(torch.equal(gemv.gemv(xs[name], *ws[name][0], None, sides["today"][name]),
                               gemv.gemv(xs[name], *ws[name][0], None, sides["picked"][name])))
        for name in shapes}
    log("chain", out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--gemv-sweep", action="store_true",
                    help="time the plugin GEMV's block sizes per shape at one row first")
    ap.add_argument("--gemv-only", action="store_true",
                    help="with --gemv-sweep: stop after the sweep and its chain (today's "
                         "configs against the picks)")
    ap.add_argument("--lm-head-only", action="store_true",
                    help="only lm_head, both ways (bf16, the Triton kernel, Marlin)")
    ap.add_argument("--bf16-gemv", action="store_true",
                    help="only the plugin's one-row GEMV on the bf16 weights against cuBLAS "
                         "(issue #42; bf16_gemv)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "command": " ".join(sys.argv)}))
        return 0
    doc = {"environment": environment(), "command": " ".join(sys.argv)}
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    t0 = time.monotonic()
    if args.lm_head_only:
        doc["lm_head"] = lm_head(rows_list)
        return _write(doc, args.out, t0)
    if args.bf16_gemv:
        doc["bf16_gemv"] = bf16_gemv(args.layers)
        return _write(doc, args.out, t0)
    if args.sweep:
        best, doc["sweep"] = sweep(args.layers, (1, 16))
        for name, cfg in best.items():
            CONFIGS[SHAPES[name]] = cfg
        doc["sweep_s"] = round(time.monotonic() - t0, 1)
    if args.gemv_sweep:
        t1 = time.monotonic()
        doc["gemv_sweep"] = gemv_sweep(args.layers)
        doc["gemv_sweep_s"] = round(time.monotonic() - t1, 1)
        picks = {name: gemv.KernelConfig(**row["pick"]["config"])
                 for name, row in doc["gemv_sweep"].items()}
        doc["gemv_chain"] = gemv_chain(args.layers, picks)
        if args.gemv_only:
            return _write(doc, args.out, t0)
    doc["configs"] = {name: dataclasses.asdict(config_for(n, k))
                      for name, (n, k) in SHAPES.items()}

    # The chain: every layer's four weights in bf16 and e4m3.
    bf16 = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(args.layers)] for name, (n, k) in SHAPES.items()}
    q = {name: [TritonWeight.from_weight(w) for w in ws] for name, ws in bf16.items()}
    gv = {name: [gemv.Fp8GemvWeight(w, table=MEASURED) for w in ws] for name, ws in bf16.items()}
    marlin, mar = fp8_marlin.available("cuda"), None
    if marlin is None:
        try:  # the plugin's own copies (fp8.Fp8Weight), from the same bf16 weights
            mar = {name: [fp8_marlin.Fp8Weight(w) for w in ws] for name, ws in bf16.items()}
        except Exception as exc:  # noqa: BLE001 - reported
            marlin = f"{type(exc).__name__}: {str(exc)[:300]}"
    else:
        marlin = marlin.describe()
    w8a8 = w8a8_factories()
    doc["marlin_error"] = marlin if isinstance(marlin, str) else None
    doc["w8a8_error"] = w8a8.pop("error", None)

    candidates = {
        "cublas_bf16": lambda x, name, i: F.linear(x, bf16[name][i]),
        "triton_w8a16": lambda x, name, i: triton_linear(x, q[name][i]),
        "plugin_gemv": lambda x, name, i: gv[name][i](x),
    }
    if mar is not None:
        candidates["marlin_w8a16"] = lambda x, name, i: mar[name][i](x)
    for key, fn in w8a8.items():
        candidates[key] = (lambda f: lambda x, name, i: f(x, q[name][i].w8, q[name][i].scale))(fn)

    chain, accuracy = {}, {}
    for m in rows_list:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
              for name, (n, k) in SHAPES.items()}
        for cand, fn in candidates.items():
            def step():
                for i in range(args.layers):
                    for name in SHAPES:
                        fn(xs[name], name, i)
            try:
                chain.setdefault(cand, {})[f"ms_m{m}"] = round(graph_ms(step), 4)
            except Exception as exc:  # noqa: BLE001 - reported
                chain.setdefault(cand, {})[f"error_m{m}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(m, cand, chain[cand])
        if m == max(rows_list):
            for name in SHAPES:
                ref = F.linear(xs[name], bf16[name][0]).float()
                for cand, fn in candidates.items():
                    try:
                        y = fn(xs[name], name, 0).float()
                        accuracy.setdefault(cand, {})[name] = round(
                            float((y - ref).norm() / ref.norm()), 5)
                    except Exception as exc:  # noqa: BLE001 - reported
                        accuracy.setdefault(cand, {})[name] = f"{type(exc).__name__}"
                y = triton_linear(xs[name], q[name][0]).float()
                r = triton_reference(xs[name], q[name][0]).float()
                accuracy.setdefault("kernel_vs_reference", {})[name] = round(
                    float((y - r).norm() / r.norm()), 6)
                one = triton_linear(xs[name][:1], q[name][0])
                many = triton_linear(xs[name], q[name][0])
                accuracy.setdefault("row_invariant", {})[name] = bool(torch.equal(one[0], many[0]))
                g = gv[name][0]
                y = g(xs[name]).float()
                r = gemv.reference(xs[name], g.w8, g.scale, g.bias).float()
                accuracy.setdefault("plugin_gemv_vs_reference", {})[name] = round(
                    float((y - r).norm() / r.norm()), 6)
                accuracy.setdefault("plugin_gemv_row_invariant", {})[name] = bool(
                    torch.equal(g(xs[name][:1])[0], g(xs[name])[0]))
    floor_bytes = sum(n * k for n, k in SHAPES.values()) * args.layers
    doc["chain"] = chain
    doc["rel_err"] = accuracy
    doc["floor_ms"] = {"bf16": round(floor_bytes * 2 / 4.28e12 * 1e3, 3),
                       "fp8": round(floor_bytes / 4.28e12 * 1e3, 3),
                       "note": "weight bytes over 4.28 TB/s (FACTS: the H200's copy bandwidth)"}
    bf16 = q = mar = gv = None  # the chain's weights, freed before lm_head's
    torch.cuda.empty_cache()
    doc["lm_head"] = lm_head(rows_list)
    return _write(doc, args.out, t0)


BF16_SWEEP = [gemv.KernelConfig(bn, bk, w, st)
              for bn in (4, 8, 16) for bk in (128, 256, 512, 1024)
              for (w, st) in ((4, 1), (8, 1))]


def bf16_gemv(layers: int) -> dict:
    """Issue #42: the plugin's one-row GEMV kernel (``ops/fp8/gemv.py``, block sizes fixed per
    shape: every process rounds alike) reading the bf16 weights themselves, unit scales, against
    cuBLAS (``F.linear``, what the bf16 fused step runs), at one row. Per shape (the four
    decoder-layer shapes and lm_head): us per call of each config (a chain of ``layers`` copies,
    ``HEAD_COPIES`` for lm_head) and cuBLAS's, the best config; then the step's GEMVs as one
    graph, cuBLAS against the best configs, three times each, alternated; the kernel's output
    against its fp32 restatement and cuBLAS's, and row 0 of a 16-row call against the one-row
    call. Said whether a bf16 row GEMV was worth wiring into the bf16 step: it is
    (``..._SENSENOVA_STEP=rowgemv``, ``ops/row_linears.py``; benchmarks/results/h100-2026-12-05d)."""
    shapes = {**SHAPES, "lm_head": (VOCAB, HIDDEN)}
    out = {"shapes": {}}
    picks = {}
    for name, (n, k) in shapes.items():
        copies = HEAD_COPIES if name == "lm_head" else layers
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        ones = torch.ones(n, device="cuda", dtype=torch.float32)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        rows = [{"config": "cublas",
                 "us": round(graph_ms(lambda: [F.linear(x, w) for w in ws]) * 1000 / copies, 2)}]
        for cfg in BF16_SWEEP:
            if n % cfg.block_n or k % cfg.block_k:
                continue
            entry = {"config": dataclasses.asdict(cfg)}
            try:
                entry["us"] = round(graph_ms(
                    lambda: [gemv.gemv(x, w, ones, None, cfg) for w in ws]) * 1000 / copies, 2)
            except Exception as exc:  # noqa: BLE001 - reported
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(entry)
        ok = [r for r in rows[1:] if "error" not in r]
        best = min(ok, key=lambda r: r["us"])
        picks[name] = gemv.KernelConfig(**best["config"])
        w0 = ws[0]
        x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        y = gemv.gemv(x16, w0, ones, None, picks[name]).float()
        exact = x16.float() @ w0.float().T
        blas = F.linear(x16, w0).float()
        out["shapes"][name] = {
            "shape": [n, k], "cublas_us": rows[0]["us"], "best": best,
            "floor_us": round(n * k * 2 / 4.28e12 * 1e6, 2),
            "rel_err_vs_fp32": round(float((y - exact).norm() / exact.norm()), 6),
            "cublas_rel_err_vs_fp32": round(float((blas - exact).norm() / exact.norm()), 6),
            "row_invariant": bool(torch.equal(
                gemv.gemv(x16[:1], w0, ones, None, picks[name])[0],
                gemv.gemv(x16, w0, ones, None, picks[name])[0])),
            "all": rows}
        log("bf16", name, "cublas", rows[0]["us"], "best", best)
        del ws
        torch.cuda.empty_cache()
    ws = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                 for _ in range(1 if name == "lm_head" else layers)]
          for name, (n, k) in shapes.items()}
    ones = {name: torch.ones(n, device="cuda", dtype=torch.float32)
            for name, (n, k) in shapes.items()}
    xs = {name: torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
          for name, (n, k) in shapes.items()}

    def chain(kind):
        def linear(name, i):
            if kind == "cublas":
                return F.linear(xs[name], ws[name][i])
            return gemv.gemv(xs[name], ws[name][i], ones[name], None, picks[name])

        def run():
            for i in range(layers):
                for name in SHAPES:
                    linear(name, i)
            linear("lm_head", 0)
        return run

    times = {"cublas": [], "row_gemv": []}
    for _ in range(3):
        for kind in times:
            times[kind].append(graph_ms(chain(kind)))
    out["chain_ms"] = {kind: round(sorted(t)[1], 4) for kind, t in times.items()}
    out["chain_all_ms"] = {kind: [round(v, 4) for v in t] for kind, t in times.items()}
    out["chain_floor_ms"] = round((layers * sum(n * k for n, k in SHAPES.values())
                                   + VOCAB * HIDDEN) * 2 / 4.28e12 * 1e3, 4)
    out["picks"] = {name: dataclasses.asdict(cfg) for name, cfg in picks.items()}
    log("bf16 chain", out["chain_ms"], "floor", out["chain_floor_ms"])
    return out


def lm_head(rows_list) -> dict:
    """lm_head (151,936 x 4,096), both ways: bf16 ``F.linear``, the hand-written Triton kernel
    (``fp8_ms``), the plugin's one-row GEMV (``plugin_gemv_ms``) and Marlin (``marlin_ms``, what the plugin would run), 3 copies so L2 does not
    serve one; argmax agreement with bf16 over the rows (random weights)."""
    heads = [torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
             for _ in range(3)]
    qh = [TritonWeight.from_weight(w) for w in heads]
    mh = [fp8_marlin.Fp8Weight(w) for w in heads] if fp8_marlin.available("cuda") is None else None
    gh = [gemv.Fp8GemvWeight(w, table=MEASURED) for w in heads]
    lm = {}
    for m in rows_list:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        lm[f"bf16_ms_m{m}"] = round(graph_ms(lambda: [F.linear(x, w) for w in heads]) / 3, 4)
        lm[f"fp8_ms_m{m}"] = round(graph_ms(lambda: [triton_linear(x, w) for w in qh]) / 3, 4)
        ref = F.linear(x, heads[0]).float()
        y = triton_linear(x, qh[0]).float()
        lm[f"argmax_agree_m{m}"] = float((y.argmax(-1) == ref.argmax(-1)).float().mean())
        lm[f"plugin_gemv_ms_m{m}"] = round(graph_ms(lambda: [w(x) for w in gh]) / 3, 4)
        if mh is not None:
            lm[f"marlin_ms_m{m}"] = round(graph_ms(lambda: [w(x) for w in mh]) / 3, 4)
            y = mh[0](x).float()
            lm[f"marlin_argmax_agree_m{m}"] = float((y.argmax(-1) == ref.argmax(-1)).float().mean())
            lm[f"marlin_rel_err_m{m}"] = round(float((y - ref).norm() / ref.norm()), 5)
    return lm


def _write(doc: dict, out: str, t0: float) -> int:
    doc["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(doc, indent=1)
    with open(os.path.join(out, "fp8-gemv.json"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
