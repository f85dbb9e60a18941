"""One decoder layer's MLP at one row as ONE persistent launch against the two GEMV launches it
runs as today: can a persistent kernel beat kernel boundaries (issue #42)?

    python benchmarks/probes/persistent_mlp.py --out DIR [--layers 42] [--programs 1x,2x,max]
        [--blocks step|rule] [--dtypes bf16,fp8]

Why: the one-row decode step is bound by its weights' bytes, yet on an H100 80GB each of its
layer GEMVs costs ~2.7 us beyond them: the FP8 step's 168 layer GEMVs took 3.15 ms for what
reads in 2.70 at the copy bandwidth, with dependent launches already
(docs/performance-history.md, "What would close the remaining gap"; ``h100-2026-12-07e``). A
launch boundary costs the ramp of one grid and the tail of the other; a kernel whose programs
stay resident and go on streaming weight across the boundary would not pay it.

The scheme (HAND-WRITTEN Triton, here only: nothing in the plugin calls it). P programs, all
resident at once, take static work:

1. gate-up: program p computes blocks p, p + P, ... of the (gate, up)-paired weight exactly as
   ``ops/fp8/gemv.py``'s ``fp8_gemv`` does with ``swiglu_out`` (the same blocks, K loop, fp32
   elementwise sums, one ``tl.sum``, scale, roundings and SiLU), and stores its ``BLOCK_N / 2``
   values of act = silu(gate) * up;
2. it counts them (release) on the flag of the act chunk they fall in: chunk c is the down
   launch's c-th ``BLOCK_K`` slice of act, complete at ``BLOCK_K`` values counted;
3. down: program p computes blocks p, p + P, ... as ``fp8_gemv`` does with ``residual``; for each
   chunk it loads the weight tile first, then waits (acquire) until the chunk is complete, reads
   act through L2 (``.cg``) and goes on. A chunk seen complete is not asked about again;
4. the last program to finish (a ``done`` count) puts the flags back to zero, so the next call,
   and a CUDA graph's replay, starts from zeros.

Waiting programs hold their SM, so every program must be resident at once or the grid deadlocks:
``resident_programs`` bounds P from the compiled kernel's registers, shared memory and warps
against the device's SMs, and the probe never launches more. A wait gives up after
``max_spins`` reads and marks the flag buffer's last word (``stuck``), so a wrong cap reports
itself instead of hanging the GPU.

What it measures (JSON printed and written to DIR/persistent-mlp.json), bf16 weights and FP8
(e4m3, per-channel scales, ``quant.quantize_rows``) at SenseNova-U1's shapes (gate-up 24576 x
4096, down 4096 x 12288), the blocks each step takes (``config_for`` with ``gemv_table``'s
tables; ``--blocks rule``: the shape rule): a chain of ``--layers`` MLPs, each its own weights
(so L2 never serves one; each layer's output is the next one's input and residual), as one
CUDA graph, us per layer (the median of three timings, the sides alternated): ``plain`` (two
``gemv`` launches), ``pdl`` (the same as dependent launches, "prefetch", where
``dependent_launches`` allows it), ``persistent_P`` at each P (``--programs``: ``Nx`` is N per
SM, ``max`` the cap, ``resident_cap``; more is refused); the copy floor (the weights' bytes at
the measured device-to-device copy rate); ``same_bits``: each side's output equals the plain
launches' bit for bit after its replays; ``flags_zero`` and ``stuck``: per P, whether the flags
came back to zero and whether a wait gave up; ``kernel``: the compiled kernel's registers, spills
and shared memory.

What it decides: if the persistent kernel beats the dependent launches by more than a few us a
layer, the same scheme extends to o_proj -> gate-up and toward one persistent kernel per decoder
layer; if not, the launch boundary is not what is left to win.

It has NOT run on a GPU yet: no numbers here are measured. Its CPU tests
(``tests/test_persistent_mlp_probe.py``) check its bits against the two launches under Triton's
interpreter at small shapes and compile it for sm_90.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_omni_graphdecode.graphs.compiling import triton_kernel  # noqa: E402
from vllm_omni_graphdecode.hooks.sensenova_u1 import gemv_table  # noqa: E402
from vllm_omni_graphdecode.ops.fp8 import gemv, quant  # noqa: E402
from vllm_omni_graphdecode.ops.fp8.gemv import KernelConfig  # noqa: E402

HIDDEN, MLP = 4096, 12288
GATE_UP, DOWN = (2 * MLP, HIDDEN), (HIDDEN, MLP)
# A wait this long (an acquire read each, ~1 us under contention) means a program that never
# came: the kernel marks ``stuck`` and goes on rather than hang.
MAX_SPINS = 1 << 20
# Hopper's per-SM limits, where torch's device properties do not say (H100 and H200 alike).
HOPPER = {"regs_per_sm": 65536, "threads_per_sm": 2048, "shared_per_sm": 233472,
          "blocks_per_sm": 32}
RESERVED_SHARED = 1024  # per block, from compute capability 8.0 on


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# -- the kernel ---------------------------------------------------------------------------------

def _define(triton, tl):
    @triton.jit
    def persistent_mlp(x_ptr, wg_ptr, sg_ptr, wd_ptr, sd_ptr, res_ptr, act_ptr, out_ptr,
                       flag_ptr, K1, K2, N2, stride_wg, stride_wd, max_spins,
                       HAS_SCALE: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr,
                       BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, CHUNKS: tl.constexpr,
                       CHUNKS_P2: tl.constexpr, SPAN: tl.constexpr, SHARE: tl.constexpr):
        # flag_ptr: [CHUNKS] act values counted per chunk, then ``done``, then ``stuck``.
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        HALF: tl.constexpr = BLOCK_N1 // 2
        # gate-up, as fp8_gemv with SWIGLU_OUT (EVEN_N, EVEN_K, no bias): the same bits.
        offs_k1 = tl.arange(0, BLOCK_K1)
        for b in range(pid, 2 * K2 // BLOCK_N1, progs):
            offs_n = b * BLOCK_N1 + tl.arange(0, BLOCK_N1)
            w_ptrs = wg_ptr + offs_n[:, None] * stride_wg + offs_k1[None, :]
            x_ptrs = x_ptr + offs_k1
            acc = tl.zeros((BLOCK_N1, BLOCK_K1), dtype=tl.float32)
            for start in range(0, K1, BLOCK_K1):
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
                w_ptrs += BLOCK_K1
                x_ptrs += BLOCK_K1
            y = tl.sum(acc, axis=1)
            if HAS_SCALE:
                y = y * tl.load(sg_ptr + offs_n)
            y = y.to(act_ptr.dtype.element_ty)
            gate, up = tl.split(tl.reshape(y.to(tl.float32), (HALF, 2)))
            act = (gate / (1.0 + tl.exp(-gate)) * up).to(act_ptr.dtype.element_ty)
            tl.store(act_ptr + b * HALF + tl.arange(0, HALF), act)
            # Every thread's stores before the count (the barrier), made visible by it (release).
            tl.debug_barrier()
            if SPAN == 1:
                tl.atomic_add(flag_ptr + b * HALF // BLOCK_K2, SHARE, sem="release")
            else:  # a block wider than a chunk completes SPAN of them
                tl.atomic_add(flag_ptr + b * SPAN + tl.arange(0, SPAN), SHARE, sem="release")
        # down, as fp8_gemv with HAS_RESIDUAL: each chunk's weight tile is asked for before the
        # wait for its act slice, so the weight keeps streaming while gate-up finishes.
        offs_k2 = tl.arange(0, BLOCK_K2)
        ready = pid * 0  # chunks known complete, in order: never asked about again
        for b in range(pid, N2 // BLOCK_N2, progs):
            offs_n = b * BLOCK_N2 + tl.arange(0, BLOCK_N2)
            w_ptrs = wd_ptr + offs_n[:, None] * stride_wd + offs_k2[None, :]
            a_ptrs = act_ptr + offs_k2
            acc = tl.zeros((BLOCK_N2, BLOCK_K2), dtype=tl.float32)
            for c in range(0, CHUNKS):
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                if c >= ready:
                    seen = tl.atomic_add(flag_ptr + c, 0, sem="acquire")
                    spins = pid * 0
                    while (seen < BLOCK_K2) & (spins < max_spins):
                        seen = tl.atomic_add(flag_ptr + c, 0, sem="acquire")
                        spins += 1
                    if seen < BLOCK_K2:  # gave up: a program that never came (see MAX_SPINS)
                        tl.atomic_xchg(flag_ptr + CHUNKS + 1, 1, sem="relaxed")
                    ready = c + 1
                # Through L2: another SM wrote it, and L1 is not coherent.
                a = tl.load(a_ptrs, cache_modifier=".cg")
                acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
                w_ptrs += BLOCK_K2
                a_ptrs += BLOCK_K2
            y = tl.sum(acc, axis=1)
            if HAS_SCALE:
                y = y * tl.load(sd_ptr + offs_n)
            y = y.to(out_ptr.dtype.element_ty)
            res = tl.load(res_ptr + offs_n)
            y = (res.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs_n, y)
        # Each program counts itself done after its last flag read; the last one sees every
        # other program's (acq_rel) and puts the flags and the count back to zero.
        tl.debug_barrier()
        done = tl.atomic_add(flag_ptr + CHUNKS, 1, sem="acq_rel")
        if done == progs - 1:
            chunk = tl.arange(0, CHUNKS_P2)
            tl.store(flag_ptr + chunk, tl.zeros((CHUNKS_P2,), tl.int32), mask=chunk < CHUNKS)
            tl.atomic_xchg(flag_ptr + CHUNKS, 0, sem="relaxed")

    return persistent_mlp


_kernel = triton_kernel(_define)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The persistent launch's blocks: gate-up's and down's as their own launches take them."""

    gate_up: KernelConfig
    down: KernelConfig

    @property
    def num_warps(self) -> int:
        # One kernel, one warp count. A row's sum order is its layout's along K (16 values a
        # thread, 32 lanes, then warps): compiled for sm_90, FP8 down's 8 x 1024 block spreads
        # K over 2 warps at 4 warps and at 8 (the extra warps take rows), so the bits hold;
        # ``same_bits`` checks it on the GPU.
        return max(self.gate_up.num_warps, self.down.num_warps)


def flag_words(k2: int, layout: Layout) -> int:
    """int32 words the flag buffer needs: a count per act chunk, ``done``, ``stuck``."""
    return k2 // layout.down.block_k + 2


def launch(x, gate_up, gate_up_scale, down, down_scale, residual, act, out, flags,
           programs: int, layout: Layout, max_spins: int = MAX_SPINS):
    """``residual + down(silu(gate) * up)`` for one row as one launch of ``programs`` programs,
    into ``out``; returns Triton's compiled-kernel handle.

    x: [K1] or [1, K1] bf16; gate_up: [N1, K1] bf16 or e4m3, rows in (gate, up) pairs
    (``gemv.pair_rows``); gate_up_scale: [N1] fp32 or None (bf16); down: [N2, N1 / 2];
    down_scale: [N2] or None; residual, out: [N2] bf16 (distinct); act: [N1 / 2] bf16, written;
    flags: int32 zeros, ``flag_words`` of them, left at zero (``stuck`` apart). Every program
    must be resident at once (``resident_programs``)."""
    n1, k1 = gate_up.shape
    n2, k2 = down.shape
    gu, dn = layout.gate_up, layout.down
    half = gu.block_n // 2
    if (2 * k2 != n1 or n1 % gu.block_n or gu.block_n % 2 or k1 % gu.block_k
            or n2 % dn.block_n or k2 % dn.block_k or (half % dn.block_k and dn.block_k % half)):
        raise ValueError(f"gate-up {n1}x{k1} in {gu}, down {n2}x{k2} in {dn}: want blocks "
                         "dividing both, even gate-up blocks and act chunks that nest")
    chunks = k2 // dn.block_k
    if flags.numel() < chunks + 2 or flags.dtype != torch.int32:
        raise ValueError(f"flags: want {chunks + 2} int32 words")
    return _kernel()[(programs,)](
        x, gate_up, out if gate_up_scale is None else gate_up_scale, down,
        out if down_scale is None else down_scale, residual, act, out, flags,
        k1, k2, n2, gate_up.stride(0), down.stride(0), max_spins,
        HAS_SCALE=gate_up_scale is not None, BLOCK_N1=gu.block_n, BLOCK_K1=gu.block_k,
        BLOCK_N2=dn.block_n, BLOCK_K2=dn.block_k, CHUNKS=chunks,
        CHUNKS_P2=1 << max(chunks - 1, 0).bit_length(), SPAN=max(1, half // dn.block_k),
        SHARE=min(half, dn.block_k), num_warps=layout.num_warps, num_stages=1)


def two_launches(x, gate_up, gate_up_scale, down, down_scale, residual, layout: Layout,
                 pdl: str | None = None):
    """What the step runs: gate-up's launch with its SwiGLU output, then down's with the
    residual (``ops/fp8/gemv.py``)."""
    act = gemv.gemv(x, gate_up, gate_up_scale, None, layout.gate_up, swiglu_out=True, pdl=pdl)
    return gemv.gemv(act, down, down_scale, None, layout.down, residual=residual, pdl=pdl)


# -- how many programs fit --------------------------------------------------------------------

def resident_programs(n_regs: int, num_warps: int, shared_bytes: int, sms: int, *,
                      regs_per_sm: int = HOPPER["regs_per_sm"],
                      threads_per_sm: int = HOPPER["threads_per_sm"],
                      shared_per_sm: int = HOPPER["shared_per_sm"],
                      blocks_per_sm: int = HOPPER["blocks_per_sm"]) -> int:
    """Programs of a kernel that fit on ``sms`` SMs at once: per SM, the fewest that registers
    (allocated per warp in units of 256), threads, shared memory (plus ``RESERVED_SHARED`` a
    block) and the block limit allow."""
    warp_regs = -(-n_regs * 32 // 256) * 256
    limits = [regs_per_sm // (warp_regs * num_warps) if warp_regs else blocks_per_sm,
              threads_per_sm // (32 * num_warps),
              shared_per_sm // (shared_bytes + RESERVED_SHARED), blocks_per_sm]
    return sms * max(0, min(limits))


def device_limits(device) -> dict:
    """The limits ``resident_programs`` takes, from torch's device properties where it has them."""
    props = torch.cuda.get_device_properties(device)
    return {"sms": props.multi_processor_count,
            "regs_per_sm": getattr(props, "regs_per_multiprocessor", HOPPER["regs_per_sm"]),
            "threads_per_sm": getattr(props, "max_threads_per_multi_processor",
                                      HOPPER["threads_per_sm"]),
            "shared_per_sm": getattr(props, "shared_memory_per_multiprocessor",
                                     HOPPER["shared_per_sm"]),
            "blocks_per_sm": HOPPER["blocks_per_sm"]}


def kernel_resources(handle) -> dict:
    """Registers, spills and shared memory of a compiled launch (Triton loads them lazily)."""
    init = getattr(handle, "_init_handles", None)
    if init is not None:
        init()
    return {"n_regs": handle.n_regs, "n_spills": handle.n_spills,
            "shared": handle.metadata.shared}


def program_counts(spec: str, sms: int, cap: int) -> list[int]:
    """``--programs``: comma-separated counts, ``Nx`` (N per SM) or ``max`` (the cap)."""
    counts = []
    for token in spec.split(","):
        token = token.strip()
        if token == "max":
            counts.append(cap)
        elif token.endswith("x"):
            counts.append(int(token[:-1]) * sms)
        else:
            counts.append(int(token))
    return sorted(set(counts))


# -- the measurement --------------------------------------------------------------------------

def layouts(blocks: str) -> dict[str, Layout]:
    """Per weight dtype, the blocks its step's launches take (``step``) or the shape rule's."""
    tables = ({"bf16": gemv_table.ROW_BF16, "fp8": gemv_table.MEASURED} if blocks == "step"
              else {"bf16": None, "fp8": None})
    return {name: Layout(gemv.config_for(*GATE_UP, table), gemv.config_for(*DOWN, table))
            for name, table in tables.items()}


def make_layers(layers: int, fp8: bool) -> list[tuple]:
    """Per layer (gate_up, its scale, down, its scale): random weights whose chain of residual
    MLPs stays near unit scale over 42 layers (gate and up ~1, down's share ~0.05)."""
    out = []
    for _ in range(layers):
        wg = (torch.randn(*GATE_UP, device="cuda") * GATE_UP[1] ** -0.5).bfloat16()
        wd = (torch.randn(*DOWN, device="cuda") * 0.1 * DOWN[1] ** -0.5).bfloat16()
        if fp8:
            out.append((*quant.quantize_rows(wg), *quant.quantize_rows(wd)))
            del wg, wd
        else:
            out.append((wg, None, wd, None))
    return out


def replay_us(graph, layers: int) -> float:
    """One replay of a ``layers``-long chain's graph, us per layer (median of 7 timings of 10)."""
    from common import time_ms

    return time_ms(graph.replay, warmup=2, repeats=7, inner=10) * 1000 / layers


def measure(name: str, layout: Layout, layers: int, program_spec: str, copy_tb_s: float) -> dict:
    weights = make_layers(layers, fp8=name == "fp8")
    h0 = torch.randn(HIDDEN, device="cuda").bfloat16()
    act = torch.empty(MLP, device="cuda", dtype=torch.bfloat16)
    flags = {}  # per grid size: what each leaves (a count left over, a wait given up) is its own
    nbytes = sum(t.numel() * t.element_size() for w in weights[:1] for t in w if t is not None)
    doc = {"blocks": {"gate_up": dataclasses.asdict(layout.gate_up),
                      "down": dataclasses.asdict(layout.down), "num_warps": layout.num_warps},
           "floor_us": round(nbytes / (copy_tb_s * 1e12) * 1e6, 2)}

    def chain(pdl=None):
        def run():
            h = h0
            for wg, sg, wd, sd in weights:
                h = two_launches(h, wg, sg, wd, sd, h, layout, pdl)
            return h
        return run

    def persistent(p):
        flags[p] = torch.zeros(flag_words(MLP, layout), device="cuda", dtype=torch.int32)

        def run():
            h = h0
            for wg, sg, wd, sd in weights:
                out = torch.empty_like(h0)
                launch(h, wg, sg, wd, sd, h, act, out, flags[p], p, layout)
                h = out
            return h
        return run

    # One program compiles the kernel (and computes the chain right, alone).
    wg, sg, wd, sd = weights[0]
    handle = launch(h0, wg, sg, wd, sd, h0, act, torch.empty_like(h0),
                    torch.zeros(flag_words(MLP, layout), device="cuda", dtype=torch.int32), 1,
                    layout)
    torch.cuda.synchronize()
    doc["kernel"] = kernel_resources(handle)
    limits = device_limits(torch.cuda.current_device())
    cap = resident_programs(doc["kernel"]["n_regs"], layout.num_warps, doc["kernel"]["shared"],
                            **limits)
    doc["device_limits"], doc["resident_cap"] = limits, cap
    sides = {"plain": chain()}
    if gemv.dependent_launches("cuda") is not None:
        sides["pdl"] = chain(gemv.dependent_launches("cuda"))
    counts = program_counts(program_spec, limits["sms"], cap)
    doc["refused_programs"] = [p for p in counts if p > cap or p < 1]
    for p in counts:
        if 1 <= p <= cap:
            sides[f"persistent_{p}"] = persistent(p)
    from common import capture_graph

    graphs = {side: capture_graph(fn) for side, fn in sides.items()}  # (graph, its output)
    times = {side: [] for side in sides}
    for _ in range(3):  # alternated
        for side, (graph, _) in graphs.items():
            times[side].append(replay_us(graph, layers))
            log(name, side, round(times[side][-1], 2))
    want = graphs["plain"][1]
    doc["us_per_layer"] = {side: round(sorted(t)[len(t) // 2], 2) for side, t in times.items()}
    doc["all_us"] = {side: [round(v, 2) for v in t] for side, t in times.items()}
    doc["finite"] = bool(torch.isfinite(want.float()).all())
    doc["same_bits"] = {side: bool(torch.equal(graphs[side][1], want)) for side in sides
                        if side != "plain"}
    # After every replay: the counts and ``done`` back at zero, and no wait given up.
    doc["flags_zero"] = {f"persistent_{p}": bool((f[:-1] == 0).all()) for p, f in flags.items()}
    doc["stuck"] = {f"persistent_{p}": bool(f[-1].item()) for p, f in flags.items()}
    del graphs, weights
    torch.cuda.empty_cache()
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--programs", default="1x,2x,3x,4x,max",
                    help="persistent grid sizes: counts, Nx (N per SM) or max (the cap); "
                         "those above the cap are refused")
    ap.add_argument("--blocks", choices=("step", "rule"), default="step",
                    help="step: the blocks the steps take (gemv_table); rule: config_for's")
    ap.add_argument("--dtypes", default="bf16,fp8")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "command": " ".join(sys.argv)}))
        return 0
    from common import copy_bandwidth_bytes_per_s, environment

    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    torch.manual_seed(0)
    doc = {"environment": environment(), "layers": args.layers}
    copy_tb_s = doc["copy_tb_s"] = round(copy_bandwidth_bytes_per_s() / 1e12, 3)
    chosen = layouts(args.blocks)
    for name in args.dtypes.split(","):
        doc[name] = measure(name, chosen[name], args.layers, args.programs, copy_tb_s)
    doc["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(doc, indent=1)
    with open(os.path.join(args.out, "persistent-mlp.json"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
