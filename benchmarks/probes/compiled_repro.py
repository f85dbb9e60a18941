"""Do the fast bodies' compiled regions round alike in every process? One layer of SenseNova-U1's
fast denoising body (``fast_denoise.pre_attention`` and ``post_attention``) at the real shape,
compiled by Inductor with its reductions tuned by timing (its default) and in its deterministic
mode (each reduction's configuration fixed by its heuristics), run on fixed random inputs.

    python3 benchmarks/probes/compiled_repro.py --out DIR [--tag A]   (H200: ~1 min)

Run it twice, in two processes: ``DIR/compiled-repro-{tag}.json`` holds, per mode, the sha256 of
the regions' outputs and their time (CUDA graph replay, median of ``--iters``). Two processes that
round alike give equal hashes; the time says what the deterministic mode costs. Inductor keeps a
tuned choice in its on-disk cache, so two processes on one machine share it: to see the tuning
pick anew, give each its own ``TORCHINDUCTOR_CACHE_DIR`` or run on two machines. Why: two machines
served the same eight think requests through the fast denoising with the same think tokens and
different image bits (``benchmarks/results/h200-2026-12-02e``). Not a benchmark of the plugin.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import common  # noqa: E402

def inputs(tokens: int, device, seed: int = 0):
    """One generation-pathway layer's weights and a branch step's activations, SenseNova-U1's
    shape (hidden 4096, 32 query and 8 K/V heads of 128, MLP 12288), drawn from ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape, scale=0.02):
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    hidden, heads, kv, d, inter = 4096, 32, 8, 128, 12288
    # cos / sin of the t rope (a head's first half) and of the h and w ropes (a quarter each)
    tables = tuple((draw(1, tokens, width, scale=1.0), draw(1, tokens, width, scale=1.0))
                   for width in (d // 2, d // 4, d // 4))
    pre = (draw(1, tokens, hidden, scale=1.0), draw((heads + 2 * kv) * d, hidden), None,
           draw(d // 2, scale=1.0), draw(d // 2, scale=1.0), draw(d // 2, scale=1.0),
           draw(d // 2, scale=1.0), tables, 1e-6, False, heads, kv, d)
    post = (draw(1, tokens, hidden, scale=1.0), draw(1, tokens, heads, d, scale=1.0),
            draw(hidden, heads * d), None, draw(hidden, scale=1.0), draw(2 * inter, hidden),
            draw(hidden, inter), draw(hidden, scale=1.0), 1e-6, 1e-6, False)
    return pre, post


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.float().cpu().numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="A")
    ap.add_argument("--tokens", type=int, default=4096, help="image tokens (1024x1024: 4096)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from vllm_omni_graphdecode.compiling import FAST_BODY_OPTIONS, Regions
    from vllm_omni_graphdecode.hooks.sensenova_u1 import fast_denoise as fd

    began = time.perf_counter()
    env = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "versions": common.versions(), "device": str(device), "tag": args.tag, "pid": os.getpid()}
    if device.type == "cuda":
        env.update(common.gpu_info())
    pre_in, post_in = inputs(args.tokens, device)
    rows = []
    # what the fast bodies compile with, and the same with the reductions tuned by timing
    modes = {"tuned": {**FAST_BODY_OPTIONS, "deterministic": False},
             "deterministic": FAST_BODY_OPTIONS}
    for mode, options in modes.items():
        pre, post = Regions(fd.pre_attention, fd.post_attention).select(device, compile=True,
                                                                        **options)
        with torch.no_grad():
            start = time.perf_counter()
            q, k, v = pre(*pre_in)
            x, normed = post(*post_in)
            compile_s = time.perf_counter() - start
            row = {"mode": mode, "options": options, "compile_s": round(compile_s, 1),
                   "pre_sha256": digest((q, k, v)), "post_sha256": digest((x, normed))}
            if device.type == "cuda":
                for name, fn, a in (("pre", pre, pre_in), ("post", post, post_in)):
                    graph, _ = common.capture_graph(lambda fn=fn, a=a: fn(*a))
                    row[f"{name}_us"] = round(1e3 * common.time_ms(graph.replay,
                                                                   repeats=args.iters), 2)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    env["seconds"] = round(time.perf_counter() - began, 1)
    os.makedirs(args.out, exist_ok=True)
    result = {"environment": env, "modes": rows}
    with open(os.path.join(args.out, f"compiled-repro-{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
