"""The batched decode step's bf16 GEMMs at 1-16 rows: cuBLAS against a HAND-WRITTEN Triton
candidate with the weight's rows on the tensor-core tile's long side (issue #42).

    python benchmarks/probes/rows_gemm.py --out DIR [--rows 1,8,16] [--layers 42] [--quick]

Why: the batched step (up to 16 requests a token, padded to a fixed row count so that a row
rounds alike in any batch) reads every weight once for all its rows, so it is bound by the
weights' bytes. cuBLAS reads them short of that: the 168 GEMMs of a SenseNova-U1 step (42 layers
of qkv 6144x4096, o_proj 4096x4096, gate_up 24576x4096, down 4096x12288) took 4.62 ms at 16 rows
against a 3.79 ms copy floor on the H200 (``benchmarks/results/h200-2026-12-01f``
``fp8-probe-0.26``). The earlier Triton tile of that probe put the 16 rows on the tile's long
side and was slower still (5.10 ms, with FP8 weights). This candidate swaps the operands: each
program computes ``W[n0:n0+BLOCK_N] @ X.T`` (``BLOCK_N`` weight rows on the tile's M, the 16
padded rows on its N), streams its weight rows ``BLOCK_K`` at a time and, with ``SPLIT_K`` > 1,
writes fp32 partial sums that a second launch adds in a fixed order.

Batch invariance: the tile always holds 16 rows (absent ones read as zeros), and an output's
sum runs over the same K blocks with the same instruction and the same split reduction whatever
the other rows hold; the block sizes are fixed per shape. So row 0 of a 16-row call equals the
one-row call bit for bit (``row_invariant``, checked here on the GPU; the CPU test checks it under
Triton's interpreter, where the tiles are widened to fp32 before the product: the interpreter
multiplies bf16 tiles wrongly, Triton 3.7.1).

What it measures (JSON printed and written to DIR/rows-gemm.json):

- ``sweep``: per shape, us per layer for each block-size candidate at 16 rows (a chain of
  ``--layers`` own weights as one CUDA graph, so L2 never serves one), and cuBLAS's;
- ``chain``: the step's 168 GEMMs as one graph at each of ``--rows``: cuBLAS (``F.linear``) and
  the candidate with each shape's best configuration, ms per chain, against the copy floor
  (the weights' bytes at ``copy_tb_s``, this machine's device-to-device copy rate, measured
  first);
- ``rel_err``: the candidate against cuBLAS per shape at 16 rows (||a - b|| / ||b||);
- ``row_invariant``: per shape, the candidate's and cuBLAS's row 0 at 16 rows against 1 row.

Run once, on an H100 80GB with ``--quick`` (``benchmarks/results/h100-2026-12-06`` ``c/``): the
chain 6.04 against cuBLAS's 6.38 ms at 16 rows (1.057x), 6.01 against 6.30 at 8 (1.048x), every
shape's row 0 invariant, relative error below 5e-7 (1.5e-4 for down, four K splits). That run
took its floor from the H200's 4.28 TB/s, then a constant; the H100's is about 3.0 TB/s (5.38 ms
for the chain). Having beaten cuBLAS at 8 and 16 rows with rows invariant, the kernel moved into
the plugin (``ops/rows_gemm.py``, block sizes from ``config_for``, the rule that reproduces that
run's picks; ``plugin_rule_matches`` says whether a sweep here picks the same): the batched step
reads it under ``..._SENSENOVA_STEP=rowgemv``. The H200 has not run it.
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

# The kernel is the plugin's (``ops/rows_gemm.py``); the probe sweeps its block sizes.
from vllm_omni_graphdecode.ops.rows_gemm import (  # noqa: E402
    TILE_ROWS, Config, config_for, rows_gemm)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 4096, 32, 8, 128, 12288
SHAPES = {
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * MLP, HIDDEN),
    "down": (HIDDEN, MLP),
}
SWEEP = [Config(bn, bk, sk, w, st)
         for bn in (32, 64, 128) for bk in (64, 128, 256) for sk in (1, 2, 4)
         for (w, st) in ((4, 3), (4, 4), (8, 4))]
QUICK = [Config(64, 128, sk, 4, 4) for sk in (1, 2, 4)] + [Config(128, 128, 2, 8, 4)]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def graph_ms(fn, replays: int = 10, trials: int = 7) -> float:
    from common import capture_graph, time_ms

    graph, _ = capture_graph(fn)
    return time_ms(graph.replay, warmup=1, repeats=trials, inner=replays)


def floor_us(n: int, k: int, copy_tb_s: float) -> float:
    """A bf16 ``n`` x ``k`` weight's bytes at the machine's measured copy rate, us."""
    return round(2 * n * k / (copy_tb_s * 1e12) * 1e6, 2)


def sweep(layers: int, candidates, copy_tb_s: float) -> tuple[dict, dict]:
    best, table = {}, {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        x = torch.randn(TILE_ROWS, k, device="cuda", dtype=torch.bfloat16)
        rows = [{"config": "cublas",
                 "us": round(graph_ms(lambda: [F.linear(x, w) for w in ws]) * 1000 / layers, 2)}]
        for cfg in candidates:
            entry = {"config": dataclasses.asdict(cfg)}
            part = (torch.empty(cfg.split_k, TILE_ROWS, n, dtype=torch.float32, device="cuda")
                    if cfg.split_k > 1 else None)
            try:
                entry["us"] = round(graph_ms(
                    lambda: [rows_gemm(x, w, cfg, part) for w in ws]) * 1000 / layers, 2)
            except Exception as exc:  # noqa: BLE001 - reported
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(entry)
            log(name, entry)
        ok = [r for r in rows[1:] if "error" not in r]
        pick = min(ok, key=lambda r: r["us"])
        best[name] = Config(**pick["config"])
        table[name] = {"shape": [n, k], "cublas_us": rows[0]["us"], "best": pick,
                       "floor_us": floor_us(n, k, copy_tb_s), "all": rows}
        del ws
        torch.cuda.empty_cache()
    return best, table


def chain(layers: int, rows_list, best: dict, copy_tb_s: float) -> dict:
    ws = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                 for _ in range(layers)] for name, (n, k) in SHAPES.items()}
    parts = {name: torch.empty(best[name].split_k, TILE_ROWS, n, dtype=torch.float32,
                               device="cuda") if best[name].split_k > 1 else None
             for name, (n, k) in SHAPES.items()}
    out = {"floor_ms": round(layers * sum(floor_us(n, k, copy_tb_s)
                                          for n, k in SHAPES.values()) / 1000, 4)}
    for m in rows_list:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
              for name, (n, k) in SHAPES.items()}
        sides = {
            "cublas": lambda: [F.linear(xs[name], ws[name][i])
                               for i in range(layers) for name in SHAPES],
            "candidate": lambda: [rows_gemm(xs[name], ws[name][i], best[name], parts[name])
                                  for i in range(layers) for name in SHAPES],
        }
        times = {side: [] for side in sides}
        for _ in range(3):  # alternated
            for side, fn in sides.items():
                times[side].append(graph_ms(fn))
        out[f"m{m}"] = {side: round(sorted(t)[1], 4) for side, t in times.items()}
        out[f"m{m}"]["all_ms"] = {side: [round(v, 4) for v in t] for side, t in times.items()}
        log("chain", m, out[f"m{m}"])
    return out


def checks(best: dict) -> tuple[dict, dict]:
    rel, invariant = {}, {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(TILE_ROWS, k, device="cuda", dtype=torch.bfloat16)
        got, want = rows_gemm(x, w, best[name]).float(), F.linear(x, w).float()
        rel[name] = round(float((got - want).norm() / want.norm()), 6)
        invariant[name] = {
            "candidate": bool(torch.equal(rows_gemm(x[:1], w, best[name])[0],
                                          rows_gemm(x, w, best[name])[0])),
            "cublas": bool(torch.equal(F.linear(x[:1], w)[0], F.linear(x, w)[0]))}
    return rel, invariant


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--quick", action="store_true",
                    help=f"sweep {len(QUICK)} configurations, not {len(SWEEP)}")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "command": " ".join(sys.argv)}))
        return 0
    from common import copy_bandwidth_bytes_per_s, environment

    t0 = time.monotonic()
    torch.manual_seed(0)
    doc = {"environment": environment()}
    copy_tb_s = doc["copy_tb_s"] = round(copy_bandwidth_bytes_per_s() / 1e12, 3)
    best, doc["sweep"] = sweep(args.layers, QUICK if args.quick else SWEEP, copy_tb_s)
    doc["configs"] = {name: dataclasses.asdict(cfg) for name, cfg in best.items()}
    # Whether the plugin's shape rule (``rows_gemm.config_for``) picks what this sweep picked.
    doc["plugin_rule_matches"] = {name: config_for(*SHAPES[name]) == cfg
                                  for name, cfg in best.items()}
    doc["rel_err"], doc["row_invariant"] = checks(best)
    doc["chain"] = chain(args.layers, [int(r) for r in args.rows.split(",")], best, copy_tb_s)
    doc["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(doc, indent=1)
    with open(os.path.join(args.out, "rows-gemm.json"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
