"""One decoder layer's MLP, and its whole tail after attention, at one row as ONE persistent
launch against the GEMV launches it runs as today: can a persistent kernel beat kernel
boundaries (issue #42)?

    python benchmarks/probes/persistent_mlp.py --out DIR [--layers 42] [--programs 1x,2x,max]
        [--blocks step|rule] [--dtypes bf16,fp8] [--span mlp,tail]

Why: the one-row decode step is bound by its weights' bytes, yet on an H100 80GB each of its
layer GEMVs costs ~2.7 us beyond them: the FP8 step's 168 layer GEMVs took 3.15 ms for what
reads in 2.70 at the copy bandwidth, with dependent launches already
(docs/performance-history.md, "What would close the remaining gap"; ``h100-2026-12-07e``). A
launch boundary costs the ramp of one grid and the tail of the other; a kernel whose programs
stay resident and go on streaming weight across the boundary would not pay it.

The scheme (HAND-WRITTEN Triton, here only: nothing in the plugin calls it). P programs, all
resident at once, take static work. The MLP span (``persistent_mlp``, gate-up -> down):

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

The tail span (``persistent_tail``, o_proj -> RMSNorm -> gate-up -> down, what the step runs as
three launches after attention: ``RowLinears.add_norm`` or ``Fp8Linears.add_norm``, then
``swiglu_mlp``) puts a phase before those, and one more wait:

* o_proj first: program p computes blocks p, p + P, ... as ``fp8_gemv`` does with ``residual``
  and ``norm`` (h1 = residual + o_proj(x)), counting each block (acq_rel); the program that
  counts the last block normalises the whole row as the NORM path does (vLLM's ``rms_norm``
  roundings) and releases one "normed ready" flag;
* then gate-up as in 1., but each program asks for its first weight tile before it waits
  (acquire) for that flag, so weight streaming goes on across the norm, and reads normed
  through L2; then 2. to 4. (down adds h1, read through L2; the o_proj count and the flag go
  back to zero with the rest).

The tail kernel takes o_proj's warp count: the norm's sum spans every warp, so its order is
the warp count's (``TailLayout.num_warps``; the CPU tests compare the sums' layouts).
The phases are @triton.jit functions both kernels call (``_gate_up_phase``, ``_down_phase``,
``_wait_for``, ``_count_done``).

Waiting programs hold their SM, so every program must be resident at once or the grid deadlocks:
``resident_programs`` bounds P from the compiled kernel's registers, shared memory and warps
against the device's SMs, and the probe never launches more. A wait (the normed wait included)
gives up after ``max_spins`` reads and marks the flag buffer's last word (``stuck``), so a wrong
cap reports itself instead of hanging the GPU.

What it measures (JSON printed and written to DIR/persistent-mlp.json), bf16 weights and FP8
(e4m3, per-channel scales, ``quant.quantize_rows``) at SenseNova-U1's shapes (o_proj 4096 x
4096, gate-up 24576 x 4096, down 4096 x 12288), the blocks each step takes (``config_for`` with
``gemv_table``'s tables; ``--blocks rule``: the shape rule), per span (``--span``; the MLP under
the dtype's key, the tail under ``DTYPE_tail``): a chain of ``--layers`` spans, each its own
weights (so L2 never serves one; each layer's output is the next one's input, residual and,
for the tail, attention-output stand-in), as one CUDA graph, us per layer (the median of three
timings, the sides alternated): ``plain`` (the two or three ``gemv`` launches), ``pdl`` (the
same as dependent launches, "prefetch", where ``dependent_launches`` allows it),
``persistent_P`` at each P (``--programs``: ``Nx`` is N per SM, ``max`` the cap,
``resident_cap``; more is refused); the copy floor (the span's weights' bytes, scales and norm
weight included, at the measured device-to-device copy rate); ``same_bits``: each side's final
output equals the plain launches' bit for bit after its replays; ``flags_zero`` and ``stuck``:
per P, whether the flags came back to zero and whether a wait gave up; ``kernel``: the compiled
kernel's registers, spills and shared memory.

What it decides: if the persistent MLP beats the dependent launches by more than a few us a
layer, the launch boundary is worth spanning; if the tail beats its three dependent launches by
more than the MLP span beats its two, the norm's boundary (one program's norm that every other
waits for) is worth spanning too, toward one persistent kernel per decoder layer; if neither
wins, the launch boundary is not what is left to win.

It has NOT run on a GPU yet: no numbers here are measured. Its CPU tests
(``tests/test_persistent_mlp_probe.py``) check both kernels' bits against the launches under
Triton's interpreter at small shapes, compile them for sm_90, and check that the tail's sums
take the launches' layouts there.
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
O_PROJ, GATE_UP, DOWN = (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)
# A wait this long (an acquire read each, ~1 us under contention) means a program that never
# came: the kernel marks ``stuck`` and goes on rather than hang.
MAX_SPINS = 1 << 20
# Hopper's per-SM limits, where torch's device properties do not say (H100 and H200 alike).
HOPPER = {"regs_per_sm": 65536, "threads_per_sm": 2048, "shared_per_sm": 233472,
          "blocks_per_sm": 32}
RESERVED_SHARED = 1024  # per block, from compute capability 8.0 on


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# -- the kernels --------------------------------------------------------------------------------

def _define_phases(triton, tl):
    """The phases both kernels run, as module globals (Triton resolves a called @jit function
    through the caller's globals, compiled and interpreted, as ``ops/rows_gemm.py``'s
    ``_finish``); defined once a process."""
    global _wait_for, _gate_up_phase, _down_phase, _count_done
    if "_wait_for" in globals():
        return
    # The kernels' annotations are strings (``from __future__ import annotations``) that Triton
    # evaluates in a kernel's globals and closure: a kernel whose body names no ``tl`` finds it
    # here.
    globals()["tl"] = tl

    @triton.jit
    def wait_for(ptr, want, stuck_ptr, max_spins):
        # Reads ``ptr`` (acquire) until it reaches ``want``; after ``max_spins`` reads it gives
        # up and marks ``stuck``: a program that never came (see MAX_SPINS).
        seen = tl.atomic_add(ptr, 0, sem="acquire")
        spins = seen * 0
        while (seen < want) & (spins < max_spins):
            seen = tl.atomic_add(ptr, 0, sem="acquire")
            spins += 1
        if seen < want:
            tl.atomic_xchg(stuck_ptr, 1, sem="relaxed")

    @triton.jit
    def gate_up_phase(x_ptr, wg_ptr, sg_ptr, act_ptr, flag_ptr, ready_ptr, stuck_ptr, K1, K2,
                      stride_wg, max_spins, HAS_SCALE: tl.constexpr, BLOCK_N1: tl.constexpr,
                      BLOCK_K1: tl.constexpr, BLOCK_K2: tl.constexpr, SPAN: tl.constexpr,
                      SHARE: tl.constexpr, WAIT: tl.constexpr):
        # gate-up, as fp8_gemv with SWIGLU_OUT (EVEN_N, EVEN_K, no bias): the same bits. With
        # WAIT x is another program's output: the program's first weight tile is asked for
        # before it waits (acquire) for ``ready_ptr`` to read 1, x is read through L2 (.cg).
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        HALF: tl.constexpr = BLOCK_N1 // 2
        offs_k1 = tl.arange(0, BLOCK_K1)
        known = pid * 0  # WAIT: x seen ready, never asked about again
        for b in range(pid, 2 * K2 // BLOCK_N1, progs):
            offs_n = b * BLOCK_N1 + tl.arange(0, BLOCK_N1)
            w_ptrs = wg_ptr + offs_n[:, None] * stride_wg + offs_k1[None, :]
            x_ptrs = x_ptr + offs_k1
            acc = tl.zeros((BLOCK_N1, BLOCK_K1), dtype=tl.float32)
            for start in range(0, K1, BLOCK_K1):
                if WAIT:
                    w = tl.load(w_ptrs, eviction_policy="evict_first")
                    if known == 0:
                        _wait_for(ready_ptr, 1, stuck_ptr, max_spins)
                        known = pid * 0 + 1
                    # Through L2: another SM wrote it, and L1 is not coherent.
                    x = tl.load(x_ptrs, cache_modifier=".cg")
                else:
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

    @triton.jit
    def down_phase(act_ptr, wd_ptr, sd_ptr, res_ptr, out_ptr, flag_ptr, stuck_ptr, N2,
                   stride_wd, max_spins, HAS_SCALE: tl.constexpr, BLOCK_N2: tl.constexpr,
                   BLOCK_K2: tl.constexpr, CHUNKS: tl.constexpr, RES_CG: tl.constexpr):
        # down, as fp8_gemv with HAS_RESIDUAL: each chunk's weight tile is asked for before the
        # wait for its act slice, so the weight keeps streaming while gate-up finishes. RES_CG:
        # the residual is this launch's output too (read through L2).
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
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
                    _wait_for(flag_ptr + c, BLOCK_K2, stuck_ptr, max_spins)
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
            if RES_CG:
                res = tl.load(res_ptr + offs_n, cache_modifier=".cg")
            else:
                res = tl.load(res_ptr + offs_n)
            y = (res.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs_n, y)

    @triton.jit
    def count_done(flag_ptr, WORDS: tl.constexpr, WORDS_P2: tl.constexpr):
        # Each program counts itself done (``flag_ptr + WORDS``) after its last flag read; the
        # last one sees every other program's (acq_rel) and puts the WORDS flags before the
        # count, and the count, back to zero.
        tl.debug_barrier()
        done = tl.atomic_add(flag_ptr + WORDS, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            word = tl.arange(0, WORDS_P2)
            tl.store(flag_ptr + word, tl.zeros((WORDS_P2,), tl.int32), mask=word < WORDS)
            tl.atomic_xchg(flag_ptr + WORDS, 0, sem="relaxed")

    _wait_for, _gate_up_phase, _down_phase, _count_done = (wait_for, gate_up_phase, down_phase,
                                                           count_done)


def _define(triton, tl):
    _define_phases(triton, tl)

    @triton.jit
    def persistent_mlp(x_ptr, wg_ptr, sg_ptr, wd_ptr, sd_ptr, res_ptr, act_ptr, out_ptr,
                       flag_ptr, K1, K2, N2, stride_wg, stride_wd, max_spins,
                       HAS_SCALE: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr,
                       BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, CHUNKS: tl.constexpr,
                       CHUNKS_P2: tl.constexpr, SPAN: tl.constexpr, SHARE: tl.constexpr):
        # flag_ptr: [CHUNKS] act values counted per chunk, then ``done``, then ``stuck``.
        stuck_ptr = flag_ptr + CHUNKS + 1
        _gate_up_phase(x_ptr, wg_ptr, sg_ptr, act_ptr, flag_ptr, stuck_ptr, stuck_ptr, K1, K2,
                       stride_wg, max_spins, HAS_SCALE, BLOCK_N1, BLOCK_K1, BLOCK_K2, SPAN, SHARE,
                       False)
        _down_phase(act_ptr, wd_ptr, sd_ptr, res_ptr, out_ptr, flag_ptr, stuck_ptr, N2,
                    stride_wd, max_spins, HAS_SCALE, BLOCK_N2, BLOCK_K2, CHUNKS, False)
        _count_done(flag_ptr, CHUNKS, CHUNKS_P2)

    return persistent_mlp


def _define_tail(triton, tl):
    _define_phases(triton, tl)

    @triton.jit
    def persistent_tail(a_ptr, wo_ptr, so_ptr, res_ptr, h1_ptr, nw_ptr, normed_ptr, wg_ptr,
                        sg_ptr, wd_ptr, sd_ptr, act_ptr, out_ptr, flag_ptr, K0, N0, K2,
                        stride_wo, stride_wg, stride_wd, norm_eps, max_spins,
                        HAS_SCALE: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_K0: tl.constexpr,
                        NORM_N: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr,
                        BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, CHUNKS: tl.constexpr,
                        WORDS_P2: tl.constexpr, SPAN: tl.constexpr, SHARE: tl.constexpr):
        # flag_ptr: [CHUNKS] act values counted per chunk, o_proj blocks counted, normed ready,
        # ``done``, ``stuck``.
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        count_ptr = flag_ptr + CHUNKS
        ready_ptr = flag_ptr + CHUNKS + 1
        stuck_ptr = flag_ptr + CHUNKS + 3
        # o_proj, as fp8_gemv with HAS_RESIDUAL and NORM (EVEN_N, EVEN_K, no bias): the same
        # bits. ``N0`` is the hidden size: o_proj's outputs, gate-up's and down's K and N.
        offs_k0 = tl.arange(0, BLOCK_K0)
        for b in range(pid, N0 // BLOCK_N0, progs):
            offs_n = b * BLOCK_N0 + tl.arange(0, BLOCK_N0)
            w_ptrs = wo_ptr + offs_n[:, None] * stride_wo + offs_k0[None, :]
            x_ptrs = a_ptr + offs_k0
            acc = tl.zeros((BLOCK_N0, BLOCK_K0), dtype=tl.float32)
            for start in range(0, K0, BLOCK_K0):
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
                w_ptrs += BLOCK_K0
                x_ptrs += BLOCK_K0
            y = tl.sum(acc, axis=1)
            if HAS_SCALE:
                y = y * tl.load(so_ptr + offs_n)
            y = y.to(h1_ptr.dtype.element_ty)
            res = tl.load(res_ptr + offs_n)
            y = (res.to(tl.float32) + y.to(tl.float32)).to(h1_ptr.dtype.element_ty)
            tl.store(h1_ptr + offs_n, y)
            # As NORM: every thread's stores before the count (release); the program that
            # counts the last block sees every block (acquire) and normalises the whole row as
            # vLLM's rms_norm rounds it, then says so (release) to the programs waiting in
            # gate-up. Its sum spans the program: one warp count for both (``TailLayout``).
            tl.debug_barrier()
            counted = tl.atomic_add(count_ptr, 1, sem="acq_rel")
            if counted == N0 // BLOCK_N0 - 1:
                cols = tl.arange(0, NORM_N)
                c_mask = cols < N0
                h = tl.load(h1_ptr + cols, mask=c_mask, other=0.0,
                            cache_modifier=".cg").to(tl.float32)
                rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N0 + norm_eps)
                hn = (h * rstd).to(h1_ptr.dtype.element_ty).to(tl.float32)
                gain = tl.load(nw_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
                tl.store(normed_ptr + cols, (hn * gain).to(h1_ptr.dtype.element_ty),
                         mask=c_mask)
                tl.debug_barrier()
                tl.atomic_xchg(ready_ptr, 1, sem="release")
        _gate_up_phase(normed_ptr, wg_ptr, sg_ptr, act_ptr, flag_ptr, ready_ptr, stuck_ptr, N0,
                       K2, stride_wg, max_spins, HAS_SCALE, BLOCK_N1, BLOCK_K1, BLOCK_K2, SPAN,
                       SHARE, True)
        _down_phase(act_ptr, wd_ptr, sd_ptr, h1_ptr, out_ptr, flag_ptr, stuck_ptr, N0,
                    stride_wd, max_spins, HAS_SCALE, BLOCK_N2, BLOCK_K2, CHUNKS, True)
        # The count of o_proj blocks and the ready flag go back to zero with the chunks'.
        _count_done(flag_ptr, CHUNKS + 2, WORDS_P2)

    return persistent_tail


_kernel = triton_kernel(_define)
_tail_kernel = triton_kernel(_define_tail)


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


def _mlp_blocks(n1: int, k1: int, n2: int, k2: int, gu: KernelConfig, dn: KernelConfig) -> dict:
    """The gate-up and down phases' constexprs, once their blocks are checked to fit."""
    half = gu.block_n // 2
    if (2 * k2 != n1 or n1 % gu.block_n or gu.block_n % 2 or k1 % gu.block_k
            or n2 % dn.block_n or k2 % dn.block_k or (half % dn.block_k and dn.block_k % half)):
        raise ValueError(f"gate-up {n1}x{k1} in {gu}, down {n2}x{k2} in {dn}: want blocks "
                         "dividing both, even gate-up blocks and act chunks that nest")
    return dict(BLOCK_N1=gu.block_n, BLOCK_K1=gu.block_k, BLOCK_N2=dn.block_n,
                BLOCK_K2=dn.block_k, CHUNKS=k2 // dn.block_k, SPAN=max(1, half // dn.block_k),
                SHARE=min(half, dn.block_k))


def _p2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


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
    blocks = _mlp_blocks(n1, k1, n2, k2, layout.gate_up, layout.down)
    chunks = blocks["CHUNKS"]
    if flags.numel() < chunks + 2 or flags.dtype != torch.int32:
        raise ValueError(f"flags: want {chunks + 2} int32 words")
    return _kernel()[(programs,)](
        x, gate_up, out if gate_up_scale is None else gate_up_scale, down,
        out if down_scale is None else down_scale, residual, act, out, flags,
        k1, k2, n2, gate_up.stride(0), down.stride(0), max_spins,
        HAS_SCALE=gate_up_scale is not None, CHUNKS_P2=_p2(chunks), **blocks,
        num_warps=layout.num_warps, num_stages=1)


def two_launches(x, gate_up, gate_up_scale, down, down_scale, residual, layout: Layout,
                 pdl: str | None = None):
    """What the step runs: gate-up's launch with its SwiGLU output, then down's with the
    residual (``ops/fp8/gemv.py``)."""
    act = gemv.gemv(x, gate_up, gate_up_scale, None, layout.gate_up, swiglu_out=True, pdl=pdl)
    return gemv.gemv(act, down, down_scale, None, layout.down, residual=residual, pdl=pdl)


@dataclasses.dataclass(frozen=True)
class TailLayout:
    """The persistent tail's blocks: o_proj's, gate-up's and down's as their launches take
    them."""

    o_proj: KernelConfig
    gate_up: KernelConfig
    down: KernelConfig

    @property
    def mlp(self) -> Layout:
        return Layout(self.gate_up, self.down)

    @property
    def num_warps(self) -> int:
        # o_proj's: the norm's sum runs over the whole row across every warp of the program,
        # so its order is the warp count's; the GEMV blocks' sums run along K within the warps
        # a row spans, the same at 4 and 8 warps for these blocks (see ``Layout.num_warps``;
        # FP8 gate-up's 32 x 512 block: one warp a row at both). ``same_bits`` checks it.
        return self.o_proj.num_warps


def tail_flag_words(k2: int, layout: TailLayout) -> int:
    """int32 words the tail's flag buffer needs: a count per act chunk, the o_proj blocks'
    count, normed ready, ``done``, ``stuck``."""
    return k2 // layout.down.block_k + 4


def launch_tail(x, o_proj, o_scale, residual, h1, norm_weight, eps: float, normed, gate_up,
                gate_up_scale, down, down_scale, act, out, flags, programs: int,
                layout: TailLayout, max_spins: int = MAX_SPINS):
    """A layer's tail after attention for one row as one launch of ``programs`` programs:
    ``h1 = residual + o_proj(x)``, ``normed = rms_norm(h1) * norm_weight``, ``out = h1 +
    down(silu(gate) * up)`` of ``normed``; returns Triton's compiled-kernel handle.

    x: [K0] bf16 (attention's output); o_proj: [H, K0] bf16 or e4m3; o_scale: [H] fp32 or None
    (bf16); residual: [H] bf16 (may be ``x``); h1, normed, out: [H] bf16, written (distinct
    from each other and from x and residual); norm_weight: [H] bf16; gate_up, its scale, down,
    its scale and act as ``launch`` takes them (gate-up [N1, H], down [H, N1 / 2]); flags:
    int32 zeros, ``tail_flag_words`` of them, left at zero (``stuck`` apart). Every program must
    be resident at once (``resident_programs``)."""
    hidden, k0 = o_proj.shape
    n1, k1 = gate_up.shape
    n2, k2 = down.shape
    op = layout.o_proj
    if hidden % op.block_n or k0 % op.block_k or k1 != hidden or n2 != hidden:
        raise ValueError(f"o_proj {hidden}x{k0} in {op}, gate-up K {k1}, down N {n2}: want "
                         "blocks dividing o_proj and the hidden size as gate-up's K and down's N")
    blocks = _mlp_blocks(n1, k1, n2, k2, layout.gate_up, layout.down)
    words = blocks["CHUNKS"] + 4
    if flags.numel() < words or flags.dtype != torch.int32:
        raise ValueError(f"flags: want {words} int32 words")
    return _tail_kernel()[(programs,)](
        x, o_proj, out if o_scale is None else o_scale, residual, h1, norm_weight, normed,
        gate_up, out if gate_up_scale is None else gate_up_scale, down,
        out if down_scale is None else down_scale, act, out, flags, k0, hidden, k2,
        o_proj.stride(0), gate_up.stride(0), down.stride(0), float(eps), max_spins,
        HAS_SCALE=o_scale is not None, BLOCK_N0=op.block_n, BLOCK_K0=op.block_k,
        NORM_N=gemv._next_pow2(hidden), WORDS_P2=_p2(words - 2), **blocks,
        num_warps=layout.num_warps, num_stages=1)


def three_launches(x, o_proj, o_scale, residual, norm_weight, eps: float, gate_up, gate_up_scale,
                   down, down_scale, counts, layout: TailLayout, pdl: str | None = None):
    """What the step runs (``RowLinears.add_norm`` or ``Fp8Linears.add_norm``, then
    ``swiglu_mlp``): o_proj's launch with the residual and the norm folded in, gate-up's with
    its SwiGLU output, down's with the residual. Returns (out, h1, normed); counts: int32
    zeros, left at zero."""
    h1, normed = gemv.gemv(x, o_proj, o_scale, None, layout.o_proj, residual=residual,
                           norm=(norm_weight, eps), counts=counts, pdl=pdl)
    return two_launches(normed, gate_up, gate_up_scale, down, down_scale, h1, layout.mlp,
                        pdl), h1, normed


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

def _tables(blocks: str) -> dict:
    return ({"bf16": gemv_table.ROW_BF16, "fp8": gemv_table.MEASURED} if blocks == "step"
            else {"bf16": None, "fp8": None})


def layouts(blocks: str) -> dict[str, Layout]:
    """Per weight dtype, the blocks its step's launches take (``step``) or the shape rule's."""
    return {name: Layout(gemv.config_for(*GATE_UP, table), gemv.config_for(*DOWN, table))
            for name, table in _tables(blocks).items()}


def tail_layouts(blocks: str) -> dict[str, TailLayout]:
    """``layouts`` with o_proj's blocks."""
    return {name: TailLayout(gemv.config_for(*O_PROJ, table), gemv.config_for(*GATE_UP, table),
                             gemv.config_for(*DOWN, table))
            for name, table in _tables(blocks).items()}


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


def make_tail_layers(layers: int, fp8: bool) -> list[tuple]:
    """Per layer (o_proj, its scale, norm weight, gate_up, its scale, down, its scale): the
    MLP's weights (``make_layers``), an o_proj whose share is ~0.1 of its input and a norm
    weight near 1, so the chain (each layer's output its next one's attention output and
    residual) stays finite over 42 layers."""
    out = []
    for mlp in make_layers(layers, fp8):
        wo = (torch.randn(*O_PROJ, device="cuda") * 0.1 * O_PROJ[1] ** -0.5).bfloat16()
        nw = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).bfloat16()
        out.append((*(quant.quantize_rows(wo) if fp8 else (wo, None)), nw, *mlp))
        del wo
    return out


def replay_us(graph, layers: int) -> float:
    """One replay of a ``layers``-long chain's graph, us per layer (median of 7 timings of 10)."""
    from common import time_ms

    return time_ms(graph.replay, warmup=2, repeats=7, inner=10) * 1000 / layers


def _race(name: str, doc: dict, layers: int, num_warps: int, handle, chain, persistent,
          words: int, program_spec: str) -> dict:
    """What both spans measure, into ``doc``: the compiled kernel's resources (``handle``), its
    resident cap, then ``chain(pdl)`` (the launches) and ``persistent(p, flags)`` per grid size
    (flags: ``words`` int32 zeros) as CUDA graphs, timed alternately; their bits against the
    plain launches', the flags left."""
    doc["kernel"] = kernel_resources(handle)
    limits = device_limits(torch.cuda.current_device())
    cap = resident_programs(doc["kernel"]["n_regs"], num_warps, doc["kernel"]["shared"],
                            **limits)
    doc["device_limits"], doc["resident_cap"] = limits, cap
    sides = {"plain": chain(None)}
    if gemv.dependent_launches("cuda") is not None:
        sides["pdl"] = chain(gemv.dependent_launches("cuda"))
    counts = program_counts(program_spec, limits["sms"], cap)
    doc["refused_programs"] = [p for p in counts if p > cap or p < 1]
    flags = {}  # per grid size: what each leaves (a count left over, a wait given up) is its own
    for p in counts:
        if 1 <= p <= cap:
            flags[p] = torch.zeros(words, device="cuda", dtype=torch.int32)
            sides[f"persistent_{p}"] = persistent(p, flags[p])
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
    return doc


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(name: str, layout: Layout, layers: int, program_spec: str, copy_tb_s: float) -> dict:
    """The MLP span: a chain of ``layers`` MLPs, two launches each against one persistent."""
    weights = make_layers(layers, fp8=name == "fp8")
    h0 = torch.randn(HIDDEN, device="cuda").bfloat16()
    act = torch.empty(MLP, device="cuda", dtype=torch.bfloat16)
    doc = {"blocks": {"gate_up": dataclasses.asdict(layout.gate_up),
                      "down": dataclasses.asdict(layout.down), "num_warps": layout.num_warps},
           "floor_us": round(_nbytes(weights[0]) / (copy_tb_s * 1e12) * 1e6, 2)}

    def chain(pdl):
        def run():
            h = h0
            for wg, sg, wd, sd in weights:
                h = two_launches(h, wg, sg, wd, sd, h, layout, pdl)
            return h
        return run

    def persistent(p, flags):
        def run():
            h = h0
            for wg, sg, wd, sd in weights:
                out = torch.empty_like(h0)
                launch(h, wg, sg, wd, sd, h, act, out, flags, p, layout)
                h = out
            return h
        return run

    # One program compiles the kernel (and computes the chain right, alone).
    wg, sg, wd, sd = weights[0]
    handle = launch(h0, wg, sg, wd, sd, h0, act, torch.empty_like(h0),
                    torch.zeros(flag_words(MLP, layout), device="cuda", dtype=torch.int32), 1,
                    layout)
    torch.cuda.synchronize()
    _race(name, doc, layers, layout.num_warps, handle, chain, persistent,
          flag_words(MLP, layout), program_spec)
    del weights
    torch.cuda.empty_cache()
    return doc


EPS = 1e-6  # the RMSNorm's epsilon (SenseNova-U1's rms_norm_eps)


def measure_tail(name: str, layout: TailLayout, layers: int, program_spec: str,
                 copy_tb_s: float) -> dict:
    """The tail span: a chain of ``layers`` layer tails (o_proj with the residual and the norm,
    gate-up, down), three launches each against one persistent."""
    weights = make_tail_layers(layers, fp8=name == "fp8")
    h0 = torch.randn(HIDDEN, device="cuda").bfloat16()
    act = torch.empty(MLP, device="cuda", dtype=torch.bfloat16)
    h1, normed = torch.empty_like(h0), torch.empty_like(h0)
    counts = torch.zeros(1, device="cuda", dtype=torch.int32)  # the o_proj launch's norm count
    words = tail_flag_words(MLP, layout)
    doc = {"blocks": {"o_proj": dataclasses.asdict(layout.o_proj),
                      "gate_up": dataclasses.asdict(layout.gate_up),
                      "down": dataclasses.asdict(layout.down), "num_warps": layout.num_warps},
           "floor_us": round(_nbytes(weights[0]) / (copy_tb_s * 1e12) * 1e6, 2)}

    def chain(pdl):
        def run():
            h = h0
            for wo, so, nw, wg, sg, wd, sd in weights:
                h = three_launches(h, wo, so, h, nw, EPS, wg, sg, wd, sd, counts, layout,
                                   pdl)[0]
            return h
        return run

    def persistent(p, flags):
        def run():
            h = h0
            for wo, so, nw, wg, sg, wd, sd in weights:
                out = torch.empty_like(h0)
                launch_tail(h, wo, so, h, h1, nw, EPS, normed, wg, sg, wd, sd, act, out, flags,
                            p, layout)
                h = out
            return h
        return run

    wo, so, nw, wg, sg, wd, sd = weights[0]
    handle = launch_tail(h0, wo, so, h0, h1, nw, EPS, normed, wg, sg, wd, sd, act,
                         torch.empty_like(h0),
                         torch.zeros(words, device="cuda", dtype=torch.int32), 1, layout)
    torch.cuda.synchronize()
    _race(f"{name}_tail", doc, layers, layout.num_warps, handle, chain, persistent, words,
          program_spec)
    del weights
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
    ap.add_argument("--span", default="mlp,tail",
                    help="mlp: gate-up -> down (under the dtype's key); tail: o_proj -> "
                         "RMSNorm -> gate-up -> down (under DTYPE_tail); or both")
    args = ap.parse_args(argv)
    spans = args.span.split(",")
    if not spans or set(spans) - {"mlp", "tail"}:
        ap.error(f"--span {args.span}: want mlp, tail or mlp,tail")
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "command": " ".join(sys.argv)}))
        return 0
    from common import copy_bandwidth_bytes_per_s, environment

    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    torch.manual_seed(0)
    doc = {"environment": environment(), "layers": args.layers, "spans": spans}
    copy_tb_s = doc["copy_tb_s"] = round(copy_bandwidth_bytes_per_s() / 1e12, 3)
    chosen, tails = layouts(args.blocks), tail_layouts(args.blocks)
    for name in args.dtypes.split(","):
        if "mlp" in spans:
            doc[name] = measure(name, chosen[name], args.layers, args.programs, copy_tb_s)
        if "tail" in spans:
            doc[f"{name}_tail"] = measure_tail(name, tails[name], args.layers, args.programs,
                                               copy_tb_s)
    doc["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(doc, indent=1)
    with open(os.path.join(args.out, "persistent-mlp.json"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
