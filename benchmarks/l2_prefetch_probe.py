"""Which L2 prefetch of o_proj's weight (``l2_prefetch.py``) makes SenseNova-U1's decode step
faster, if any: the plugin's graphed decode at the real shape, each prefetch variant against none
in one process, at several contexts. Prints JSON; writes it to --out.

    python benchmarks/l2_prefetch_probe.py --out DIR [--contexts 512,2048,8192] [--profile 2048]

Each variant is its own ``paged_decoder`` over the same model (fused step, FA3, 8 tokens a launch,
the greedy token loop driven as the pipeline's loop drives it). After a warm-up that captures,
the variants take turns, ``--tokens`` tokens each per round, for ``--rounds`` rounds (the order
rotates each round, so a drift of the GPU's clocks spreads over all of them); a variant's figure
is the median of its rounds. Every variant starts from the same prefix and token, so with a
prefetch that changes nothing the tokens must equal those of ``off`` (``tokens_equal_off``).
``--profile CTX`` also profiles ``off`` and the fastest variant at CTX (time per GEMM slot:
``gemm.o_proj`` is the one a prefetch targets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import profile_step  # noqa: E402
from vllm_omni_graphdecode import config, kernels, l2_prefetch  # noqa: E402
from vllm_omni_graphdecode.hooks import sensenova_u1  # noqa: E402
from vllm_omni_graphdecode.testing import random_models as rm  # noqa: E402

SHAPE = dict(num_layers=42, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
             vocab=151936)
# name -> (mode, programs); None: no prefetch
VARIANTS = {
    "off": None,
    "lines_16": ("lines", 16),
    "lines_32": ("lines", 32),
    "lines_66": ("lines", 66),
    "evict_last_16": ("evict_last", 16),
    "bulk_8": ("bulk", 8),
    "bulk_16": ("bulk", 16),
    "sum": ("sum", 1),
}


def log(msg):
    print(f"[l2 probe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_bytes(lm, ctx: int) -> int:
    """Bytes one decode step must read (as bench.py's floor counts them)."""
    total = 0
    for name, p in lm.named_parameters():
        if "_mot_gen" in name:
            continue
        total += (p.shape[-1] if "embed_tokens" in name else p.numel()) * p.element_size()
    cfg = lm.config
    return total + 2 * cfg.num_hidden_layers * ctx * cfg.num_key_value_heads * cfg.head_dim * 2


def make_prefetch(variant, device):
    if variant is None:
        return None
    mode, programs = variant
    found = l2_prefetch.select_prefetch(device, mode, programs)
    return found if isinstance(found, l2_prefetch.L2Prefetch) else found.describe()


class Driven:
    """One variant's decoder, driven as the pipeline's greedy loop drives it."""

    def __init__(self, lm, kernel, buckets, prefix_logits, cache, ctx, prefetch):
        self.dec = sensenova_u1.paged_decoder(lm, kernel=kernel, buckets=buckets,
                                              tokens_per_launch=8, prefetch=prefetch)
        self.dec.begin(cache)
        self.ahead = self.dec.lookahead()
        self.token = int(prefix_logits[:, -1].argmax(-1))
        self.t = ctx
        self.tokens: list[int] = []
        self.rounds: list[float] = []

    def run(self, n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(n):
                self.token = self.ahead.next(self.token, self.t)
                self.tokens.append(self.token)
                self.t += 1
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", type=int, default=64, help="tokens per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="context to profile at (0: none)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    env = common.environment()
    bw = common.copy_bandwidth_bytes_per_s()
    env["copy_bandwidth_tb_s"] = round(bw / 1e12, 3)
    lm = rm.build_lm(rm.llm_config(**SHAPE), device="cuda", dtype=torch.bfloat16, seed=0,
                     on_device_init=True)
    device = next(lm.parameters()).device
    kernel = kernels.select_kernel(device, lm.config.head_dim, "3")
    buckets = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1"}).buckets
    result = {"environment": env, "kernel": str(getattr(kernel, "name", kernel)),
              "tokens_per_round": args.tokens, "rounds": args.rounds, "contexts": {}}
    path = os.path.join(args.out, "l2-prefetch-probe.json")
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        prefix_logits, make_cache = rm.random_prefix(lm, ctx, seed=ctx)
        floor = read_bytes(lm, ctx + args.tokens * args.rounds // 2) / bw * 1e3
        driven, rows = {}, {}
        for name in names:
            pf = make_prefetch(VARIANTS[name], device)
            if isinstance(pf, str):
                rows[name] = {"error": pf}
                continue
            try:
                d = Driven(lm, kernel, buckets, prefix_logits, make_cache(), ctx, pf)
                d.run(24)  # capture + warm-up
                driven[name] = d
            except Exception as exc:  # a variant that fails to build or capture is reported
                rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                log(f"ctx {ctx} {name}: {rows[name]['error']}")
        order = list(driven)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                driven[name].rounds.append(driven[name].run(args.tokens))
        base = driven.get("off")
        for name, d in driven.items():
            ms = statistics.median(d.rounds)
            rows[name] = {"ms_per_token": round(ms, 4),
                          "rounds_ms": [round(x, 4) for x in d.rounds],
                          "of_floor": round(ms / floor, 3),
                          "tokens_equal_off": None if base is None else d.tokens == base.tokens}
            if base is not None and name != "off":
                rows[name]["speedup_vs_off"] = round(statistics.median(base.rounds) / ms, 4)
            log(f"ctx {ctx} {name}: {rows[name]}")
        for d in driven.values():
            d.dec.release()
        del driven
        torch.cuda.empty_cache()
        result["contexts"][str(ctx)] = {"floor_ms_per_token": round(floor, 4), "variants": rows}
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    if args.profile:
        ctx = args.profile
        rows = result["contexts"].get(str(ctx), {}).get("variants", {})
        timed = {n: r["ms_per_token"] for n, r in rows.items() if "ms_per_token" in r and n != "off"}
        best = min(timed, key=timed.get) if timed else None
        prefix_logits, make_cache = rm.random_prefix(lm, ctx, seed=ctx)
        result["profiles"] = {}
        for name in ["off"] + ([best] if best else []):
            pf = make_prefetch(VARIANTS[name], device)
            result["profiles"][name] = profile_step.profile_sensenova_graph(
                lm, kernel, prefix_logits, make_cache, ctx, steps=32, buckets=buckets,
                copy_bytes_per_s=bw, tokens_per_launch=8, prefetch=pf)
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
    print(json.dumps(result["contexts"], indent=1))


if __name__ == "__main__":
    main()
