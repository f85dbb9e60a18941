"""The batched decode step's linear layers through the plugin's bf16 GEMM for up to 16 rows
(issue #42): ``RowsLinears``, what a hook's batched step calls in place of the modules' cuBLAS
GEMMs (``gemv.Gemv``'s interface, as ``row_linears.RowLinears`` for one row).

Why a kernel of our own (HAND-WRITTEN, Triton): the batched step (up to 16 requests a token,
always padded to 16 rows so that a row rounds alike in any batch) reads every weight once for all
its rows, so it is bound by the weights' bytes, and cuBLAS reads them short of that. Measured on
an H100 80GB (``benchmarks/probes/rows_gemm.py --quick``, ``benchmarks/results/h100-2026-12-06``
``c/``): the step's 168 GEMMs as one graph took 6.38 ms through cuBLAS at 16 rows and 6.04 ms
through this kernel (1.057x; 1.048x at 8 rows), against a 5.38 ms copy floor; per layer qkv
21.2 -> 20.1 us, o_proj 16.7 -> 15.3, gate_up 73.0 -> 69.9, down 40.1 -> 38.4; the whole batched
step 2-4% faster at 1-16 rows (9.35 against 9.56 ms at 8, ``benchmarks/results/h100-2026-12-06b``).
The H200 has not run it.

The kernel swaps the GEMM's operands: each program computes ``W[n0:n0+64] @ X.T``, the weight's
rows on the tensor-core tile's long side and the 16 padded rows on its short one, streaming its
weight rows 128 of K at a time; with ``split_k`` above 1 the programs of one weight block write
fp32 partial sums that are added in split order. Block sizes come from the weight's shape
(``config_for``), none picked by timing, so every process rounds alike.

The MLP ran in four launches at the released shape, where it had run five
(``RowsLinears.swiglu_mlp``): the gate-up GEMM writes its fp32 sums to the workspace and the
adding launch ends in silu(gate) * up (in place of vLLM's ``silu_and_mul`` launch, 3.7 us a layer
at 8 rows in the H100 profile of ``benchmarks/results/h100-2026-12-06b`` ``f/``), and the down
GEMM's adding launch adds the residual too (in place of the model's ``+``). That took the
batched step from 9.24 to 9.05 ms at 8 rows (42 launches fewer; H100 80GB, vllm-omni 0.30,
``benchmarks/results/h100-2026-12-06c``), with the batched step's GPU tests passing on both
stacks; its CPU tests run under the interpreter.

The parts are added by the program that writes a block's last one (an atomic count per block,
per gate block and its up block for the SwiGLU; ``RowsLinears`` keeps the zeroed counts), not by
a launch of their own: the same additions in the same order, so the same bits (checked on the
H100 at every released shape), and 126 launches fewer a step (o_proj, gate-up and down: the
MLP in two launches). Measured on an H100 80GB, vllm-omni 0.26, both trees alternated in one
session (``benchmarks/results/h100-2026-12-06f``): 7.89-7.91 against 7.95-7.99 ms a step at 1
row (~0.9%), 8.99-9.05 against 9.06-9.10 at 8 (~0.6%), 10.46-10.57 against 10.44-10.60 at 16
(no change): the adding moved to the tail of the GEMM, which costs most of what the launch did.

Each launch can be a programmatic dependent launch on Hopper (``rows_gemm``'s ``pdl``,
``RowsLinears(pdl=...)``), as the one-row GEMV's are (they took the graphed bf16 one-row step
from 6.88 to 6.80 ms on an H100, ``fp8/gemv.dependent_launches``): the same sums in the same
order, so the same bits. Not yet run on a GPU, so a hook's batched step keeps plain launches
until its GPU tests and an A/B of the two (docs/performance-history.md, "What would close the
remaining gap") say whether to take them.

Rounding: one fp32 sum per output in a fixed order (per split, then the splits in order), the
bias added in fp32, one bf16 rounding. A row's sum never reads another row, so each row of a
16-row call equals the same row computed alone (checked on the H100 for every shape, and under
Triton's interpreter on CPU). It differs from cuBLAS in the sum order only.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..core import stats
from ..core.reasons import Reason
from ..graphs.compiling import triton_kernel
from . import gemv
from .counts import CountBuffers
from .fp8 import gemv as row_gemv
from .row_linears import ROW_LAYER_KEPT, available as _one_row_available

TILE_ROWS = 16  # rows of the tile: 1-16 rows, absent ones read as zeros
COUNT_BLOCKS = 4096  # weight-row blocks a count buffer serves (262,144 rows at 64 a block)

NO_ROWS_GEMM = Reason("bf16 row GEMM unavailable",
                      "a CUDA GPU with Triton; meanwhile the batched step's linear layers run "
                      "the modules' cuBLAS GEMMs")


@dataclasses.dataclass(frozen=True)
class Config:
    block_n: int  # weight rows a program owns (the tile's M)
    block_k: int  # K a loop step reads
    split_k: int  # programs sharing one weight row's K (fp32 partials, added in order)
    num_warps: int = 4
    num_stages: int = 4


def config_for(n: int, k: int) -> Config:
    """The block sizes of an ``n`` x ``k`` weight, from its shape alone. The rule reproduces the
    H100 sweep's picks at the released shape (``benchmarks/results/h100-2026-12-06`` ``c/``):
    no split where the weight gives 96 or more 64-row blocks (qkv 6,144 rows, gate_up 24,576),
    else two K splits, four where K is 8,192 or more (o_proj 2, down 4)."""
    if -(-n // 64) >= 96:
        return Config(64, 128, 1)
    return Config(64, 128, 4 if k >= 8192 else 2)


def available(device) -> Reason | None:
    """Why the row GEMM cannot run on ``device`` (what the one-row GEMV needs too: CUDA and
    Triton), or None."""
    why = _one_row_available(device)
    return None if why is None else NO_ROWS_GEMM.because(why.detail)


def prefetchable(weight: torch.Tensor) -> bool:
    """Whether a dependent launch can ask for ``weight``'s first blocks in L2 (``pdl``
    "prefetch"): the bulk prefetch reads whole 16-byte units, so the weight's address, its row
    stride and its row length in bytes must be multiples of 16 (every weight of the released
    model is); else the launch only waits ("wait")."""
    elt = weight.element_size()
    return (weight.data_ptr() % 16 == 0 and weight.stride(0) * elt % 16 == 0
            and weight.shape[1] * elt % 16 == 0)


def _define(triton, tl):
    global _gdc_wait, _gdc_launch_dependents, _prefetch_l2
    _gdc_wait, _gdc_launch_dependents, _prefetch_l2 = row_gemv.dependent_launch_functions(
        triton, tl)

    @triton.jit
    def finish(part_ptr, b_ptr, res_ptr, out_ptr, m, offs, mask, N, stride_rm, stride_om,
               ROWS: tl.constexpr, SPLIT_K: tl.constexpr, BIAS: tl.constexpr,
               SWIGLU: tl.constexpr, RES: tl.constexpr):
        # out[m, n] = bf16(part[0, m, n] + part[1, m, n] + ... + bias[n]), in that order; then
        # with RES bf16(res[m, n] + out[m, n]). With SWIGLU the parts are a [gate; up] weight's
        # (2N wide): gate and up are summed and rounded so, and out[m, n] is
        # silu(gate) * up rounded where vLLM's silu_and_mul rounds (the SiLU, then the product).
        # ``m`` and ``offs`` broadcast to one shape: one row's columns (the adding launch) or a
        # block of rows and columns (the last program of a block, ``rows_gemm``'s FIXUP). The
        # parts are read through L2 (.cg): in FIXUP other programs wrote them.
        if SWIGLU:
            width = 2 * N
        else:
            width = N
        total = tl.load(part_ptr + m * width + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLIT_K):
            total += tl.load(part_ptr + s * ROWS * width + m * width + offs, mask=mask,
                             other=0.0, cache_modifier=".cg")
        if BIAS:
            total += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        val = total.to(out_ptr.dtype.element_ty)
        if SWIGLU:
            up = tl.load(part_ptr + m * width + N + offs, mask=mask, other=0.0,
                         cache_modifier=".cg")
            for s in range(1, SPLIT_K):
                up += tl.load(part_ptr + s * ROWS * width + m * width + N + offs, mask=mask,
                              other=0.0, cache_modifier=".cg")
            if BIAS:
                up += tl.load(b_ptr + N + offs, mask=mask, other=0.0).to(tl.float32)
            gate = val.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
            up = up.to(out_ptr.dtype.element_ty)
            val = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
        if RES:
            res = tl.load(res_ptr + m * stride_rm + offs, mask=mask, other=0.0)
            val = (res.to(tl.float32) + val.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m * stride_om + offs, val, mask=mask)

    # The kernels call it by its global name (Triton resolves a called @jit function through the
    # caller's globals, compiled and interpreted).
    global _finish
    _finish = finish

    @triton.jit
    def rows_gemm(x_ptr, w_ptr, b_ptr, res_ptr, part_ptr, out_ptr, count_ptr, M, N, K,
                  stride_xm, stride_wn, stride_rm, stride_om, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
                  BIAS: tl.constexpr, WIDEN: tl.constexpr, PARTIAL: tl.constexpr,
                  RES: tl.constexpr, FIXUP: tl.constexpr = False, SWIGLU: tl.constexpr = False,
                  w_addr=0, PDL: tl.constexpr = False, PDL_PREFETCH: tl.constexpr = False,
                  LANES: tl.constexpr = 128):
        # part[split, m, n] = sum over this split's K of w[n, k] * x[m, k]: program
        # (pid_n, split); the tile is [BLOCK_N weight rows, ROWS rows], fp32. Without PARTIAL
        # (one split) it adds the bias in fp32 and writes out[m, n] in x's dtype itself (no
        # second launch), then with RES res[m, n] + out[m, n] as two tensors of x's dtype add.
        # With PARTIAL and FIXUP the program that writes a block's last part (an atomic count
        # per block, or per gate block and its up block with SWIGLU) adds the block's parts as
        # the adding launch would (``finish``) and puts the count back to zero. With PDL (a
        # dependent launch) it waits for the kernel before it before reading anything but the
        # weight, and lets the next one start once its weight loop is done.
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k0 = split * per_split
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        if PDL:
            if PDL_PREFETCH:
                # The weight only (no kernel's output): each of the block's rows asks for its
                # first BLOCK_K weights of this split in L2 (``w_addr``: the weight's address).
                # LANES covers every thread once, so no prefetch is asked for twice.
                lane = tl.arange(0, LANES)
                w_row = pid_n * BLOCK_N + lane
                elt: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
                size = tl.where((lane < BLOCK_N) & (w_row < N) & (k0 < K),
                                tl.minimum(K - k0, BLOCK_K) * elt, 0)
                _prefetch_l2(w_addr + (w_row.to(tl.int64) * stride_wn + k0) * elt, size)
            _gdc_wait()
        for start in range(0, per_split, BLOCK_K):
            k = k0 + start + offs_k
            k_mask = k < K
            w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=(offs_m[None, :] < M) & k_mask[:, None], other=0.0)
            if WIDEN:  # Triton's interpreter multiplies bf16 tiles wrongly (3.7.1)
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
            else:
                acc += tl.dot(w, xt)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if PDL:  # the weight is read: the next launch may start
            _gdc_launch_dependents()
        if PARTIAL:
            out = part_ptr + split * ROWS * N + offs_m[None, :] * N + offs_n[:, None]
            tl.store(out, acc, mask=offs_n[:, None] < N)
            if FIXUP:
                if SWIGLU:  # gate block j pairs with up block j + half
                    group = pid_n % (tl.num_programs(0) // 2)
                    arrivals = 2 * SPLIT_K
                    n_out = N // 2
                else:
                    group = pid_n
                    arrivals = SPLIT_K
                    n_out = N
                # Every thread's stores before the count (release); the program that counts
                # last sees every part (acquire).
                tl.debug_barrier()
                done = tl.atomic_add(count_ptr + group, 1, sem="acq_rel")
                if done == arrivals - 1:
                    cols = group * BLOCK_N + tl.arange(0, BLOCK_N)
                    mask = (offs_m[:, None] < M) & (cols[None, :] < n_out)
                    _finish(part_ptr, b_ptr, res_ptr, out_ptr, offs_m[:, None], cols[None, :],
                            mask, n_out, stride_rm, stride_om, ROWS, SPLIT_K, BIAS, SWIGLU,
                            RES)
                    tl.atomic_xchg(count_ptr + group, 0, sem="relaxed")
        else:
            if BIAS:
                acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
            val = acc.to(out_ptr.dtype.element_ty)
            mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
            if RES:
                res = tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask,
                              other=0.0)
                val = (res.to(tl.float32) + val.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], val, mask=mask)

    @triton.jit
    def add_splits(part_ptr, b_ptr, res_ptr, out_ptr, M, N, stride_rm, stride_om,
                   ROWS: tl.constexpr, SPLIT_K: tl.constexpr, BIAS: tl.constexpr,
                   BLOCK: tl.constexpr, SWIGLU: tl.constexpr, RES: tl.constexpr):
        # ``finish`` for one row's BLOCK columns: program (column block, row).
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        _finish(part_ptr, b_ptr, res_ptr, out_ptr, tl.program_id(1), offs, offs < N, N,
                stride_rm, stride_om, ROWS, SPLIT_K, BIAS, SWIGLU, RES)

    return rows_gemm, add_splits


_kernels = triton_kernel(_define)


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, cfg: Config,
              part: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
              swiglu: bool = False, residual: torch.Tensor | None = None,
              counts: torch.Tensor | None = None, pdl: str | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` [M, K] bf16 (M <= 16) and ``weight`` [N, K]: [M, N]
    in x's dtype, each row as if alone; ``bias`` [N] added to the fp32 sum before the one
    rounding. ``part``: a [split_k, 16, N] fp32 workspace to reuse.

    ``residual`` [M, N]: ``residual + that``, the two rounded tensors added as the model's ``+``
    adds them, in the same launches. ``swiglu``: ``weight`` is a [gate; up] projection (N even)
    and the result [M, N / 2] is ``silu(gate) * up`` as vLLM's ``silu_and_mul`` computes it
    from the rounded projection: the sums go through the fp32 workspace (one split or more) and
    the adding launch ends in the activation, in place of a launch of its own.

    ``counts``: an int32 buffer of zeros (``RowsLinears`` keeps one per device), one entry per
    block of ``cfg.block_n`` weight rows: where given, the program that writes a block's last
    fp32 part adds the parts itself, in the same order and with the same roundings as the adding
    launch, which then does not run (one launch where there were two; the buffer is left at
    zero). Calls that share a buffer must not run at the same time (one stream).

    ``pdl`` (``fp8.gemv.PDL_MODES``; None: a plain launch): the GEMM as a programmatic
    dependent launch, as the one-row GEMV's (``fp8.gemv.gemv``): it may start while the kernel
    before it finishes, waits for it before reading anything but the weight, and lets the next
    launch start after its weight loop; "prefetch" first asks for each weight row's first block
    in L2 ("wait" where the weight is not ``prefetchable``). The same products and sums in the
    same order; the adding launch, where one runs, stays plain."""
    row_gemv.check_pdl(pdl, x.device)
    m, k = x.shape
    n = weight.shape[0]
    if m > TILE_ROWS:
        raise ValueError(f"{m} rows: the tile holds {TILE_ROWS}")
    if swiglu and (n % 2 or residual is not None):
        raise ValueError(f"swiglu needs an even number of weight rows ({n}) and no residual")
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_out = n // 2 if swiglu else n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if residual is not None:
        if residual.shape != out.shape:
            raise ValueError(f"residual {tuple(residual.shape)}: the output is {tuple(out.shape)}")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    partial = cfg.split_k > 1 or swiglu
    if part is None and partial:
        part = torch.empty(cfg.split_k, TILE_ROWS, n, dtype=torch.float32, device=x.device)
    gemm, add = _kernels()
    b = out if bias is None else bias  # never read without BIAS
    res = out if residual is None else residual  # never read without RES
    blocks = -(-n // cfg.block_n)
    # The last program adds where the buffer has an entry per block and, with SwiGLU, each gate
    # block has its up block half the blocks on.
    fixup = (partial and counts is not None and blocks <= counts.numel()
             and (not swiglu or n % (2 * cfg.block_n) == 0))
    if pdl == "prefetch" and not prefetchable(weight):
        pdl = "wait"
    gemm[(blocks, cfg.split_k)](
        x, weight, b, res, out if part is None else part, out, counts if fixup else out, m, n,
        k, x.stride(0), weight.stride(0), res.stride(0), out.stride(0), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, ROWS=TILE_ROWS, SPLIT_K=cfg.split_k, BIAS=bias is not None,
        WIDEN=os.environ.get("TRITON_INTERPRET") == "1", PARTIAL=partial,
        RES=residual is not None, FIXUP=fixup, SWIGLU=swiglu,
        w_addr=0 if pdl is None else weight.data_ptr(), PDL=pdl is not None,
        PDL_PREFETCH=pdl == "prefetch", LANES=max(32 * cfg.num_warps, cfg.block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if pdl is None else {"launch_pdl": True}))
    if not partial or fixup:
        return out
    block = 1024
    add[(-(-n_out // block), m)](part, b, res, out, m, n_out, res.stride(0), out.stride(0),
                                 ROWS=TILE_ROWS, SPLIT_K=cfg.split_k, BIAS=bias is not None,
                                 BLOCK=block, SWIGLU=swiglu, RES=residual is not None)
    return out


class RowsLinears:
    """``linears(module, x)``: ``module``'s output for ``x`` (up to 16 rows) through the row GEMM
    on the module's own bf16 weight (and bias), or through the module where it is not a plain
    vllm linear layer or ``x`` has more rows (counted under ``row_linears.ROW_LAYER_KEPT``;
    inside a graph decided once, at capture). The MLP fused as ``swiglu_mlp`` says, the
    logits through the model's own head. ``model``: the stats key."""

    has_head = False
    nbytes = 0

    def __init__(self, model: str, fixup: bool = True, pdl: str | None = None):
        self.model = model
        # ``pdl``: every GEMM launch's ``rows_gemm`` ``pdl`` mode (None: plain launches). Read
        # at each call, so inside a graph at capture: set it before the first capture.
        self.pdl = pdl
        # ``fixup``: split GEMMs add their parts in their own last program (``rows_gemm``'s
        # ``counts``), the same bits in one launch instead of two.
        self.fixup = fixup
        self._counts = CountBuffers(COUNT_BLOCKS)

    def _counts_on(self, device: torch.device) -> torch.Tensor | None:
        """The zeroed count buffer of ``device`` (``counts.CountBuffers``: the batched step's
        launches run on one stream at a time); None without ``fixup`` (the adding launch
        runs)."""
        return self._counts.on(device) if self.fixup else None

    @staticmethod
    def _readable(module, rows: int):
        """``module``'s layer the GEMM reads for ``rows`` rows (its base where a LoRA wrapper is
        inactive), or None."""
        base = gemv.base_of_inactive_lora(module)
        if (gemv.Gemv.plain(base) and rows <= TILE_ROWS
                and base.weight.dtype in (torch.bfloat16, torch.float16)):
            return base
        return None

    def _base(self, module, rows: int):
        """``_readable``, counting a layer kept on its own kernel (once per call that runs it)."""
        base = self._readable(module, rows)
        if base is not None:
            return base
        stats.degraded(self.model, ROW_LAYER_KEPT.because(
            f"{type(module).__name__} (LoRA adapter active, quantised, hooked, not bf16, or "
            f"{rows} rows)"))
        return None

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        base = self._base(module, rows)
        if base is None:
            return module(x)[0]
        weight = base.weight
        out = rows_gemm(x.reshape(rows, x.shape[-1]), weight, config_for(*weight.shape),
                        bias=base.bias, counts=self._counts_on(x.device), pdl=self.pdl)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def swiglu_mlp(self, gate_up_module, down_module, x, residual):
        """``residual + down(silu(gate) * up)`` of ``x``: the gate-up GEMM, its adding ending
        in the SiLU-and-multiply (``rows_gemm``'s ``swiglu``), and the down GEMM with
        the residual added where its parts are (two launches with ``fixup``, four without, at
        the released shape). None where either layer is not plain or the shapes do not
        pair (the caller runs the layers one by one, counting a kept layer there)."""
        rows = x.numel() // x.shape[-1]
        up = self._readable(gate_up_module, rows)
        down = self._readable(down_module, rows)
        if (up is None or down is None or up.weight.shape[0] % 2
                or down.weight.shape[1] != up.weight.shape[0] // 2
                or residual.shape[-1] != down.weight.shape[0]):
            return None
        counts = self._counts_on(x.device)
        act = rows_gemm(x.reshape(rows, x.shape[-1]), up.weight, config_for(*up.weight.shape),
                        bias=up.bias, swiglu=True, counts=counts, pdl=self.pdl)
        out = rows_gemm(act, down.weight, config_for(*down.weight.shape), bias=down.bias,
                        residual=residual.reshape(rows, residual.shape[-1]), counts=counts,
                        pdl=self.pdl)
        return out.reshape(residual.shape)

    def mlp_tail(self, module, gate_up, residual):
        """None: ``swiglu_mlp`` serves the MLP, or the caller runs its steps."""
        return None

    def release(self) -> None:
        """Nothing to drop: the GEMM reads the modules' own weights."""

    def describe(self) -> str:
        pdl = (f", programmatic dependent launches ({self.pdl})" if self.pdl is not None
               else "")
        return (f"bf16 row GEMMs ({TILE_ROWS}-row tile, block sizes from the shape; "
                f"SiLU-and-multiply and residual add in their launches{pdl})")
