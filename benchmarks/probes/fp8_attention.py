"""FA3's FP8 attention at Qwen-Image-2.1's cached-step shape: is it faster than bf16, and by how
much does it move the output?

    python benchmarks/probes/fp8_attention.py --out DIR

Why (issue #23, item 3): the W8A8 cached step spends ~14 ms of its ~80 ms in 32 attention calls
(4,096 target queries over prefix + target keys, 32 heads, d 128; FA3 0.43 ms a call at 4,352
keys, FACTS section 4). Issue #23 allows FA3's FP8 attention only if it measures faster, with its
own accuracy reported; this measures both before anything is wired.

Per key length (4,352: text-to-image; 12,544: a two-reference edit), one CUDA graph per
candidate, ms per call (median of 7 timings of 10 replays):

  bf16        vllm's ``flash_attn_varlen_func(..., fa_version=3)`` on bf16 q, k, v (what runs)
  fp8         the same call on e4m3 q, k, v with per-head descales (``q_descale`` etc., shape
              (batch, kv_heads)), already quantised
  quantise    what a step would add: q and the target's k, v (4,096 rows each) quantised per
              head (amax, divide, cast) in eager torch ops; inside an Inductor region this would
              fuse into the kernel that writes them, so it is an upper bound

``rel_err``: ||out - ref|| / ||ref|| against fp32 SDPA on the same bf16 inputs, for bf16 and FP8
(random N(0, 1) inputs, so the softmax is broad: a sharper trained attention may differ).
Prints the JSON document and writes DIR/fp8-attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import capture_graph, environment, time_ms  # noqa: E402

FP8_MAX = 448.0
HEADS, HEAD_DIM, TARGET = 32, 128, 4096


def graph_ms(fn, replays: int = 10, trials: int = 7) -> float:
    graph, _ = capture_graph(fn)
    return time_ms(graph.replay, warmup=1, repeats=trials, inner=replays)


def quantise_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, H, D) -> (e4m3 x, descale (1, H) fp32): one scale per head, amax / 448."""
    amax = x.abs().amax(dim=(0, 2)).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    x8 = (x.float() / scale[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x8, scale.view(1, -1)


def one_shape(fn, keys: int) -> dict:
    dev = "cuda"
    q = torch.randn(TARGET, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(keys, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn(keys, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, TARGET], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, keys], dtype=torch.int32, device=dev)
    scale = HEAD_DIM ** -0.5

    def call(q_, k_, v_, **descale):
        return fn(q_, k_, v_, max_seqlen_q=TARGET, cu_seqlens_q=cu_q, max_seqlen_k=keys,
                  cu_seqlens_k=cu_k, softmax_scale=scale, causal=False, fa_version=3, **descale)

    row: dict = {"keys": keys, "queries": TARGET}
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        scale=scale).transpose(0, 1)
    out = call(q, k, v)
    row["bf16_ms"] = round(graph_ms(lambda: call(q, k, v)), 4)
    row["bf16_rel_err"] = round(float((out.float() - ref).norm() / ref.norm()), 6)
    (q8, sq), (k8, sk), (v8, sv) = (quantise_per_head(t) for t in (q, k, v))
    try:
        out8 = call(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv)
        row["fp8_out_dtype"] = str(out8.dtype)
        row["fp8_ms"] = round(graph_ms(
            lambda: call(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv)), 4)
        row["fp8_rel_err"] = round(float((out8.float() - ref).norm() / ref.norm()), 6)
    except Exception as exc:  # noqa: BLE001 - reported
        row["fp8_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    qt, kt, vt = q, k[-TARGET:], v[-TARGET:]
    row["quantise_ms"] = round(time_ms(lambda: [quantise_per_head(t) for t in (qt, kt, vt)],
                                       repeats=7, inner=10), 4)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--keys", default="4352,12544")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "command": " ".join(sys.argv)}))
        return 0
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    t0 = time.monotonic()
    doc = {"environment": environment(), "command": " ".join(sys.argv),
           "shapes": [one_shape(flash_attn_varlen_func, int(n)) for n in args.keys.split(",")]}
    doc["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(doc, indent=1)
    with open(os.path.join(args.out, "fp8-attention.json"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
