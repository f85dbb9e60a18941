"""Decode attention for the batched SenseNova-U1 step: what each candidate kernel costs at 1 to 16
rows, how near it runs to its K/V byte floor, and whether a row's output stays the same whatever
decodes beside it (issue #22).

    python benchmarks/probes/batched_attention.py --out DIR [--rows 1,8,16] [--contexts 512,2048]
                                                  [--splits 8,16,32] [--fa3-splits 4,8,16]

Why: ``h200-2026-12-02d`` profiled the batched step at context 2048. Its GEMMs stay at 4.9 ms
whatever the rows, while attention grows 0.83 -> 1.52 -> 2.32 ms at 1 / 8 / 16 rows (~2.3x and
~1.75x its byte floor at 8 and 16). The step runs vLLM's Triton decode kernel with 16 fixed
splits per row (``batch_kv.SPLITS``), because FlashAttention 3's split heuristic plans from the
whole batch. This measures candidates before anything is wired. One layer's call (SenseNova-U1:
32 query heads, 8 K/V heads, head dim 128, bf16, 16-token blocks), every row at the context:

  triton-sN   vLLM's ``decode_attention_fwd`` with N splits of each row's own keys (N = 16 is
              what the batched step runs)
  fa3-sN      FA3 paged varlen (``vllm.vllm_flash_attn``, ``fa_version=3``) with ``num_splits=N``
  fa3-auto    the same with FA3's own heuristic (``num_splits=0``), for reference

Each candidate: us per call (CUDA graph of ``--calls`` calls, median of 7 timings), the bytes its
rows' K/V take, ``of_floor`` against the copy rate measured in the same run, the largest error
against an fp32 reference, and two invariance checks on row 0 (bit for bit): the other rows'
lengths drawn anew (``same_with_other_neighbours``), and row 0 alone in a batch of one against
the same row among ``rows`` (``same_alone_and_in_batch``). A kernel the step could take must pass
both at every row count. Prints the JSON document and writes DIR/batched-attention.json.
``--device cpu`` runs the reference alone at small sizes (the CPU tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from vllm_omni_graphdecode import batch_kv  # noqa: E402

BLOCK = batch_kv.BLOCK_SIZE


def _ints(value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: accepted: positive integers, comma-separated")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: accepted: positive integers, comma-separated")
    return out


def _reference(q, k, v, table, seqused, max_len, scale):
    """``batch_kv.REFERENCE``: the batched step's attention contract in plain torch, fp32."""
    return batch_kv.REFERENCE(q, k, v, table=table, seqused=seqused, scale=scale, scratch=None)


def candidates(device: torch.device, splits: list[int], fa3_splits: list[int]) -> dict:
    """name -> fn(q, k_cache, v_cache, table, seqused, max_len, scale) -> out, for what this
    machine has; the fp32 reference always."""
    out = {"reference": _reference}
    if device.type != "cuda":
        return out
    for name in batch_kv._KERNEL_MODULES:
        try:
            triton_fn = __import__(name, fromlist=["decode_attention_fwd"]).decode_attention_fwd
            break
        except Exception:  # noqa: BLE001 - reported as a missing candidate
            triton_fn = None
    one = torch.ones((), dtype=torch.float32, device=device)
    for n in splits if triton_fn else []:
        def triton(q, k, v, table, seqused, max_len, scale, n=n):
            rows, heads, dim = q.shape
            o = torch.empty_like(q)
            lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device)
            partial = torch.empty(rows, heads, n, dim + 1, dtype=torch.float32, device=q.device)
            triton_fn(q, k, v, o, lse, table, seqused, partial, n, scale, BLOCK,
                      k_scale=one, v_scale=one)
            return o
        out[f"triton-s{n}"] = triton
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001
        return out
    for n in [0] + fa3_splits:
        def fa3(q, k, v, table, seqused, max_len, scale, n=n):
            cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
            return flash_attn_varlen_func(
                q, k, v, max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=max_len,
                seqused_k=seqused, block_table=table, softmax_scale=scale, causal=True,
                fa_version=3, num_splits=n)
        out["fa3-auto" if n == 0 else f"fa3-s{n}"] = fa3
    return out


def make_inputs(rows: int, context: int, heads: tuple[int, int, int], device, seed: int):
    """q (rows, q_heads, d); a cache with each row's own blocks; the table; every row at
    ``context`` keys."""
    q_heads, kv_heads, dim = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    width = -(-context // BLOCK)
    blocks = 1 + rows * width  # block 0: scratch, as in batch_kv
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen, device=device).to(dtype)
    v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen, device=device).to(dtype)
    q = torch.randn(rows, q_heads, dim, generator=gen, device=device).to(dtype)
    table = (1 + torch.arange(rows * width, device=device, dtype=torch.int32)).view(rows, width)
    seqused = torch.full((rows,), context, dtype=torch.int32, device=device)
    return q, k, v, table, seqused


def measure(fn, rows, context, heads, device, calls: int, bandwidth: float | None) -> dict:
    q, k, v, table, seqused = make_inputs(rows, context, heads, device, seed=rows * 7 + context)
    scale = heads[2] ** -0.5
    max_len = table.shape[1] * BLOCK
    row = {}
    try:
        got = fn(q, k, v, table, seqused, max_len, scale)
        want = _reference(q.float(), k.float(), v.float(), table, seqused, max_len, scale)
        row["max_abs_err"] = float((got.float() - want).abs().max())
        # Row 0 with its neighbours at other lengths (the same shapes).
        gen = torch.Generator(device="cpu").manual_seed(context)
        other = seqused.clone()
        if rows > 1:
            other[1:] = torch.randint(1, context + 1, (rows - 1,), generator=gen).to(other)
        again = fn(q, k, v, table, other, max_len, scale)
        row["same_with_other_neighbours"] = bool(torch.equal(got[0], again[0]))
        alone = fn(q[:1].contiguous(), k, v, table[:1].contiguous(), seqused[:1].contiguous(),
                   max_len, scale)
        row["same_alone_and_in_batch"] = bool(torch.equal(got[0], alone[0]))
    except Exception as exc:  # noqa: BLE001 - a candidate this build refuses: recorded
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    kv_bytes = rows * context * heads[1] * heads[2] * 2 * q.element_size()
    row["kv_bytes"] = kv_bytes
    if device.type == "cuda":
        import common

        graph, _ = common.capture_graph(lambda: [fn(q, k, v, table, seqused, max_len, scale)
                                                for _ in range(calls)])
        ms = common.time_ms(graph.replay, warmup=2, repeats=7)
        row["us_per_call"] = round(1000 * ms / calls, 2)
        if bandwidth:
            floor_us = 1e6 * kv_bytes / bandwidth
            row["floor_us"] = round(floor_us, 2)
            row["of_floor"] = round(row["us_per_call"] / floor_us, 3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=_ints, default=[1, 8, 16])
    ap.add_argument("--contexts", type=_ints, default=[512, 2048])
    ap.add_argument("--splits", type=_ints, default=[8, 16, 32], help="Triton kernel's splits")
    ap.add_argument("--fa3-splits", type=_ints, default=[4, 8, 16], help="FA3's num_splits")
    ap.add_argument("--heads", type=_ints, default=[32, 8, 128],
                    help="query heads, K/V heads, head dim (SenseNova-U1's by default)")
    ap.add_argument("--calls", type=int, default=42, help="calls per timed graph (a step's layers)")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    if len(args.heads) != 3 or args.heads[0] % args.heads[1]:
        ap.error(f"--heads {','.join(map(str, args.heads))}: accepted: Q,KV,D with Q a multiple "
                 f"of KV")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    import common

    env = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "versions": common.versions(), "device": str(device), "args": vars(args)}
    bandwidth = None
    if device.type == "cuda":
        env.update(common.gpu_info())
        bandwidth = common.copy_bandwidth_bytes_per_s()
        env["copy_bytes_per_s"] = bandwidth
    found = candidates(device, args.splits, args.fa3_splits)
    env["candidates"] = list(found)
    results = []
    started = time.perf_counter()
    for context in args.contexts:
        for rows in args.rows:
            for name, fn in found.items():
                if name == "reference" and device.type == "cuda":
                    continue
                row = {"kernel": name, "rows": rows, "context": context}
                row.update(measure(fn, rows, context, tuple(args.heads), device, args.calls,
                                   bandwidth))
                results.append(row)
    env["seconds"] = round(time.perf_counter() - started, 1)
    doc = {"environment": env, "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "batched-attention.json"), "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
