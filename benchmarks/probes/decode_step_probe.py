"""Candidate changes to SenseNova-U1's fused decode step, timed against the step as it is, in one
process at the real shape. Prints JSON; writes ``decode-step-probe.json`` to --out.

    python benchmarks/probes/decode_step_probe.py --out DIR [--contexts 512,2048,8192] \
        [--profile 2048]

Variants (``--variants``, comma list):
  base          the fused step without the MLP-tail kernel (SiLU * up, the down GEMV and the
                residual add as three kernels: the step before ``gemv.Gemv.mlp_tail``)
  mlp_tail      the fused step as shipped: those three as one Inductor kernel
  mlp_tail_sN   the same with FA3's split of the keys fixed at N (scheduler and kernel alike)
                instead of its heuristic
  deterministic mlp_tail in Inductor's deterministic mode (no block sizes tuned by timing)
  cublas        the fused norms and rope with the linear layers' own cuBLAS GEMMs (no Inductor):
                the default step since issue #22 (base and mlp_tail are SENSENOVA_STEP=tuned)

Each variant is its own ``paged_decoder`` over the same model (FA3, 8 tokens a launch, the greedy
token loop driven as the pipeline's loop drives it). After a warm-up that captures, the variants
take turns, ``--tokens`` tokens each per round, for ``--rounds`` rounds (the order rotates each
round, so a drift of the GPU's clocks spreads over all of them); a variant's figure is the median
of its rounds. All start from the same prefix and token; ``tokens_agree_with_base`` counts the
leading tokens a variant shares with ``base`` (a variant that rounds differently parts from it at
the first near tie). ``--profile CTX`` profiles ``base`` and the fastest variant at CTX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

# The repository root (the plugin) and benchmarks/ (common, profile_step, bench) on the path:
# this file lives in benchmarks/probes/ and runs as `python3 benchmarks/probes/NAME.py`.
_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))
sys.path.insert(0, _BENCHMARKS)

import common  # noqa: E402
import profile_step  # noqa: E402
from bench import SENSENOVA_SHAPE, sensenova_read_bytes  # noqa: E402
from vllm_omni_graphdecode import config, gemv, kernels  # noqa: E402
from vllm_omni_graphdecode.hooks import sensenova_u1  # noqa: E402
from vllm_omni_graphdecode.hooks.sensenova_u1 import fused_step, layouts  # noqa: E402
from vllm_omni_graphdecode.testing import random_models as rm  # noqa: E402

def log(msg):
    print(f"[step probe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def split_kernel(kernel, n: int):
    """FA3 with its split of the keys fixed at ``n``, in the per-step plan and the call."""

    def schedule(q, k_cache, *, cu_seqlens_q, seqused_k, max_seqlen_k):
        from vllm.vllm_flash_attn.flash_attn_interface import get_scheduler_metadata

        return get_scheduler_metadata(
            batch_size=1, max_seqlen_q=1, max_seqlen_k=max_seqlen_k, num_heads_q=q.shape[1],
            num_heads_kv=k_cache.shape[2], headdim=q.shape[2], cache_seqlens=seqused_k,
            qkv_dtype=q.dtype, cu_seqlens_q=cu_seqlens_q, page_size=k_cache.shape[1],
            causal=False, num_splits=n)

    return dataclasses.replace(kernel, name=f"{kernel.name}, {n} splits",
                               extra=kernel.extra + (("num_splits", n),), schedule=schedule)


def variant_parts(name, lm, kernel):
    """(kernel, fusion) of a variant."""
    layout = layouts.detect_layout(lm)
    param = next(lm.parameters())
    fusion = fused_step.Fusion.select(lm, layout, param.device, param.dtype, tuned_gemv=True)
    if fusion.gemv is None:
        raise RuntimeError(f"no Inductor GEMV here: {fusion.reasons}")
    fusion.gemv.fuse_mlp_tail = name != "base"
    if name == "deterministic":
        fusion.gemv = gemv.Gemv(deterministic=True)
    elif name == "cublas":
        fusion.gemv = None
    if name.startswith("mlp_tail_s"):
        kernel = split_kernel(kernel, int(name[len("mlp_tail_s"):]))
    return kernel, fusion


class Driven:
    """One variant's decoder, driven as the pipeline's greedy loop drives it."""

    def __init__(self, lm, kernel, fusion, buckets, prefix_logits, cache, ctx):
        self.dec = sensenova_u1.paged_decoder(lm, kernel=kernel, buckets=buckets, fusion=fusion,
                                              tokens_per_launch=8)
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


def _agree(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--variants", default="base,mlp_tail,mlp_tail_s4,mlp_tail_s8,mlp_tail_s16")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="context to profile at (0: none)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in ("base", "mlp_tail", "deterministic", "cublas")
           and not (v.startswith("mlp_tail_s") and v[len("mlp_tail_s"):].isdigit())]
    if bad:
        ap.error(f"unknown variant(s) {bad}; known: base, mlp_tail, mlp_tail_sN, deterministic, cublas")
    env = common.environment()
    bw = common.copy_bandwidth_bytes_per_s()
    env["copy_bandwidth_tb_s"] = round(bw / 1e12, 3)
    lm = rm.build_lm(rm.llm_config(**SENSENOVA_SHAPE), device="cuda", dtype=torch.bfloat16,
                     seed=0, on_device_init=True)
    device = next(lm.parameters()).device
    kernel = kernels.select_kernel(device, lm.config.head_dim, "3")
    buckets = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1"}).buckets
    result = {"environment": env, "kernel": str(getattr(kernel, "name", kernel)),
              "tokens_per_round": args.tokens, "rounds": args.rounds, "contexts": {}}
    path = os.path.join(args.out, "decode-step-probe.json")
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        prefix_logits, make_cache = rm.random_prefix(lm, ctx, seed=ctx)
        floor = sensenova_read_bytes(lm, ctx + args.tokens * args.rounds // 2) / bw * 1e3
        driven, rows = {}, {}
        for name in names:
            try:
                k, fusion = variant_parts(name, lm, kernel)
                d = Driven(lm, k, fusion, buckets, prefix_logits, make_cache(), ctx)
                d.run(24)  # capture + warm-up
                driven[name] = d
            except Exception as exc:  # a variant that fails to build or capture is reported
                rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                log(f"ctx {ctx} {name}: {rows[name]['error']}")
        order = list(driven)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                driven[name].rounds.append(driven[name].run(args.tokens))
        base = driven.get("base")
        for name, d in driven.items():
            ms = statistics.median(d.rounds)
            rows[name] = {"ms_per_token": round(ms, 4),
                          "rounds_ms": [round(x, 4) for x in d.rounds],
                          "of_floor": round(ms / floor, 3),
                          "tokens_agree_with_base": (None if base is None
                                                     else _agree(d.tokens, base.tokens)),
                          "tokens": len(d.tokens)}
            if base is not None and name != "base":
                rows[name]["speedup_vs_base"] = round(statistics.median(base.rounds) / ms, 4)
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
        timed = {n: r["ms_per_token"] for n, r in rows.items()
                 if "ms_per_token" in r and n != "base"}
        best = min(timed, key=timed.get) if timed else None
        prefix_logits, make_cache = rm.random_prefix(lm, ctx, seed=ctx)
        result["profiles"] = {}
        for name in ["base"] + ([best] if best else []):
            k, fusion = variant_parts(name, lm, kernel)
            result["profiles"][name] = profile_step.profile_sensenova_graph(
                lm, k, prefix_logits, make_cache, ctx, steps=32, buckets=buckets,
                copy_bytes_per_s=bw, tokens_per_launch=8, fusion=fusion)
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
    print(json.dumps(result["contexts"], indent=1))


if __name__ == "__main__":
    main()
