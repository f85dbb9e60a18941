"""FP8 fast accumulation at a denoising step's GEMM shapes, on one GPU.

    python3 benchmarks/probes/fp8_accum.py --out DIR [--model qwen_image_21|sensenova_u1]
                                                                    (H200: ~1 minute)

``qwen_image_21`` (the default): the seven linear layers of a Qwen-Image-2.1 block (q, k, v, out:
4,096 x 4,096; gate, up: 12,288 x 4,096; down: 4,096 x 12,288) at 4,096 rows (a 1024x1024
target), 32 blocks. ``sensenova_u1``: the four of a SenseNova-U1 generation layer (qkv 6,144 x
4,096, o 4,096 x 4,096, gate-up 24,576 x 4,096, down 4,096 x 12,288) at 1,024 rows (a 1024x1024
image's tokens), 42 layers. ``--blocks`` blocks' worth as one CUDA graph (``--distinct`` blocks
of random N(0, 0.02) weights, cycled), timed four ways:

- ``bf16``: ``F.linear`` (cuBLAS), the bf16 fast step's GEMMs;
- ``scaled_mm``: ``torch._scaled_mm`` with row-wise scales, e4m3 inputs quantised beforehand
  (the W8A8 step quantises inside its compiled regions), fp32 promotion (``use_fast_accum=False``);
- ``scaled_mm_fast_accum``: the same with ``use_fast_accum=True``;
- ``cutlass``: vLLM's ``cutlass_scaled_mm`` on the same e4m3 inputs, where vLLM is importable.

Per variant: ms per graph replay (median), and per shape the largest error against fp32 on the
same e4m3 values, relative to the largest output (``rel_err``). Writes DIR/fp8-accum.json
(``fp8-accum-sensenova_u1.json`` for that model) and
prints it. Needs CUDA (FP8 tensor cores: compute capability 8.9 or newer); without, it prints a
``skipped`` line and exits 0, having measured nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import capture_graph, environment, time_ms  # noqa: E402

from vllm_omni_graphdecode.ops.fp8 import quant, w8a8  # noqa: E402

HIDDEN, MLP = 4096, 12288
# model -> (rows, blocks, (name, N, K) per linear layer of a block)
MODELS = {
    "qwen_image_21": (4096, 32, (("q", HIDDEN, HIDDEN), ("k", HIDDEN, HIDDEN),
                                 ("v", HIDDEN, HIDDEN), ("out", HIDDEN, HIDDEN),
                                 ("gate", MLP, HIDDEN), ("up", MLP, HIDDEN),
                                 ("down", HIDDEN, MLP))),
    "sensenova_u1": (1024, 42, (("qkv", 6144, HIDDEN), ("o", HIDDEN, HIDDEN),
                                ("gate_up", 2 * MLP, HIDDEN), ("down", HIDDEN, MLP))),
}


def _quantize_rows(x):
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    sx = torch.where(amax > 0, amax / quant.FP8_MAX, torch.ones_like(amax))
    return (x.float() / sx).clamp(-quant.FP8_MAX, quant.FP8_MAX).to(quant.FP8_DTYPE), sx


def _variants():
    out = {
        "bf16": lambda x, w, x8, sx, w8, sw: F.linear(x, w),
        "scaled_mm": lambda x, w, x8, sx, w8, sw: torch._scaled_mm(
            x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16),
        "scaled_mm_fast_accum": lambda x, w, x8, sx, w8, sw: torch._scaled_mm(
            x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True),
    }
    try:
        from vllm import _custom_ops as ops

        out["cutlass"] = lambda x, w, x8, sx, w8, sw: ops.cutlass_scaled_mm(
            x8, w8.t(), scale_a=sx, scale_b=sw.view(-1, 1), out_dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - reported
        out["cutlass_error"] = f"{type(exc).__name__}: {exc}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen_image_21", choices=sorted(MODELS))
    ap.add_argument("--blocks", type=int, default=None, help="default: the model's layers")
    ap.add_argument("--distinct", type=int, default=4)
    args = ap.parse_args(argv)
    rows, blocks, shapes = MODELS[args.model]
    blocks = args.blocks or blocks
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "command": " ".join(sys.argv)}))
        return 0
    why = w8a8.w8a8_available("cuda")
    if why is not None:
        print(json.dumps({"skipped": why.describe(), "command": " ".join(sys.argv)}))
        return 0
    torch.manual_seed(0)
    dev = "cuda"
    layers = []
    for _ in range(args.distinct):
        for name, n, k in shapes:
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            w8, sw = w8a8.w8a8_weight(w)
            layers.append((name, w, w8, sw))
    inputs = {}
    for k in sorted({k for _, _, k in shapes}):
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        inputs[k] = (x, *_quantize_rows(x))
    variants = _variants()
    doc = {"environment": environment(), "command": "python3 " + " ".join(sys.argv),
           "model": args.model, "rows": rows, "blocks": blocks,
           "distinct_blocks": args.distinct, "variants": {}}
    chain = [layers[(i * len(shapes) + j) % len(layers)]
             for i in range(blocks) for j in range(len(shapes))]
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for _, w, _, _ in chain)
    for vname, fn in variants.items():
        if not callable(fn):
            doc["variants"][vname] = fn
            continue
        entry = {}
        try:
            def run(fn=fn):
                for _, w, w8, sw in chain:
                    x, x8, sx = inputs[w.shape[1]]
                    fn(x, w, x8, sx, w8, sw)
            graph, _ = capture_graph(run)
            ms = time_ms(graph.replay, warmup=2, repeats=7, inner=3)
            entry["ms"] = round(ms, 3)
            entry["tflops"] = round(flops / ms / 1e9, 1)
            errs = {}
            for name, w, w8, sw in layers[:len(shapes)]:
                x, x8, sx = inputs[w.shape[1]]
                got = fn(x, w, x8, sx, w8, sw).float()
                if vname == "bf16":
                    want = x.float() @ w.float().T
                else:
                    want = (x8.float() * sx) @ (w8.float() * sw.view(-1, 1)).T
                errs[name] = float((got - want).abs().max() / want.abs().max())
            entry["rel_err"] = {k: float(f"{v:.3g}") for k, v in errs.items()}
        except Exception as exc:  # noqa: BLE001 - reported
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        doc["variants"][vname] = entry
        print(f"[fp8-accum] {vname}: {entry}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    name = "fp8-accum.json" if args.model == "qwen_image_21" else f"fp8-accum-{args.model}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
