"""FP8 (e4m3) weight GEMV for a decode step of one row: HAND-WRITTEN Triton, because the
libraries measured short of the bytes at one row.

Why: at one token a linear layer must read its weight once, so with e4m3 weights the 168 layers of
the measured decode step (42 decoder layers, docs/performance.md) read 8.1 GB, 1.89 ms at the H200's
4.28 TB/s. The libraries at one row, the 168 layers as one graph (``benchmarks/probes/fp8_gemv.py``,
``benchmarks/results/h200-2026-12-01f/fp8-probe-0.26``): vLLM's Marlin W8A16 3.31 ms (1.75x the
floor), CUTLASS W8A8 3.09 (activations quantised too), ``torch._scaled_mm`` 5.02. Marlin and CUTLASS
are tensor-core GEMMs that pad one row to a tile; a GEMV needs no tile. This kernel is the plain
one: each program owns ``BLOCK_N`` output channels of one row, streams their e4m3 weight rows
``BLOCK_K`` bytes at a time, widens them to fp32 in registers against the bf16 activations, and
reduces once at the end; the per-channel scale and the bias are applied in fp32 before the one bf16
rounding. The 168 layers as one graph: 2.44 ms against Marlin's 3.31 in the same run
(``benchmarks/results/h200-2026-12-01h/fp8-probe-0.26``).

A gate-up copy made with ``swiglu`` keeps each gate row beside its up row, so its own launch ends
in silu(gate) * up (``Fp8GemvWeight.swiglu``, the kernel's SWIGLU_OUT) and the down launch reads
that row plainly (``add_to``): the same roundings, each SiLU computed once (the down launch 15.0
us a call against 16.9 when each of its programs recomputed the SiLU of the whole row,
``benchmarks/results/h200-2026-12-03c``). ``Fp8GemvWeight.mlp_tail`` (the SiLU-and-multiply, down
projection and residual add in the down launch) serves where the gate-up copy has no paired rows.
The norms stay outside the launches, and weight blocks are not loaded ahead: neither measured
faster (docs/performance-history.md, "Measured and taken back").

What it guarantees:

* Fixed order. The block sizes come from the weight's shape alone (``config_for``, no timing
  at load), and each output is one program's fp32 sum in a fixed order: every process rounds a
  request the same way (block sizes tuned by timing can differ between processes, and so can
  the rounding of a request).
* Rows do not mix. Rows are a grid dimension, so row ``m`` of an ``M``-row call is computed by
  the same program as a one-row call, bit for bit. More rows read the weight again per row
  (through L2 when their programs run together): it is a one-row kernel, and the batched step's
  16 rows stay on Marlin (``linears.Fp8Linears``).

The copy is the plain ``quant.quantize_rows`` layout ([N, K] e4m3, one fp32 scale per output
channel), so it serves tests and ``quant.dequantize`` as it is. Triton's interpreter
(``TRITON_INTERPRET=1`` before Triton is imported) runs the same kernel on CPU tensors: the CPU
tests check it there. Needs FP8 conversions in hardware (compute capability 8.9: Ada, Hopper);
older GPUs keep Marlin (``available``).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ...core.reasons import Reason
from ...graphs.compiling import triton_kernel
from . import quant


# A launch's programmatic-dependent-launch mode (``gemv``'s ``pdl``): None, or one of these.
PDL_MODES = (None, "prefetch", "wait")

NO_GEMV = Reason("one-row FP8 GEMV unavailable",
                 "a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper) with Triton; "
                 "meanwhile vLLM's Marlin reads the FP8 copies at one row too (slower: 3.31 "
                 "against 2.44 ms for the 168 layers of the measured decode step on an H200)")


def dependent_launches(device) -> str | None:
    """The ``pdl`` mode a step's row GEMV launches take on ``device`` by default: "prefetch" on
    compute capability 9.0+ with compiled Triton that has ``gdc_wait`` (Triton 3.6 under torch
    2.11, 3.7 under 2.13), else None (plain launches: the same products, sums and bits, without
    the overlap). On an H100 80GB (``benchmarks/results/h100-2026-12-07d``): the graphed bf16
    step at context 2048 6.80 against 6.88 ms, through the text loop 1.02-1.04x the plain
    launches at 512 and 2048 on vllm-omni 0.26 and 0.30; in an earlier run (``h100-2026-12-07c``)
    "prefetch" 6.77, "wait" 6.81, plain 6.86. The FP8 + ``lm_head`` step with its norm folds
    too: 4.18 against 4.39 ms (``h100-2026-12-07e``)."""
    device = torch.device(device)
    if (device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            or torch.cuda.get_device_capability(device)[0] < 9):
        return None
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return None
    return "prefetch"


def check_pdl(pdl: str | None, device) -> None:
    """Refuse a ``pdl`` mode that is not one of ``PDL_MODES``, or one asked for where no
    dependent launch can run (no compiled Triton on a GPU of compute capability 9.0+), naming
    the value and what is accepted. The row GEMV and the row GEMM (``ops/rows_gemm.py``) check
    their ``pdl`` here."""
    if pdl is None:  # a plain launch: nothing to check (every eager call passes here)
        return
    if pdl not in PDL_MODES:
        raise ValueError(f"pdl={pdl!r}: accepted: {', '.join(map(repr, PDL_MODES))}")
    device = torch.device(device)
    if (device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            or torch.cuda.get_device_capability(device)[0] < 9):
        raise ValueError(f"pdl={pdl!r} needs compiled Triton on a GPU of compute capability "
                         f"9.0 or newer (the input is on {device})")


def available(device) -> Reason | None:
    """Why the one-row GEMV cannot run on ``device`` (Marlin then serves one row too), or None."""
    device = torch.device(device)
    if device.type != "cuda" or quant.FP8_DTYPE is None:
        return NO_GEMV.because(f"device is {device}, torch {torch.__version__}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return NO_GEMV.because(f"compute capability {major}.{minor}: Triton converts e4m3 in "
                               "hardware from 8.9 on")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return NO_GEMV.because(f"triton not importable ({exc})")
    return None


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_n: int  # output channels a program owns
    block_k: int  # weight bytes a program reads per row and loop step
    num_warps: int
    num_stages: int = 1


def config_for(n: int, k: int, table: dict | None = None) -> KernelConfig:
    """The block sizes for an [n, k] weight, from its shape alone: ``table``'s entry (a hook's
    measured {(n, k): KernelConfig}, handed down), else a rule: enough programs to keep every SM
    streaming (~4 per SM of the H200's 132 at n = 4,096), 512-byte rows per step (16 bytes a
    thread)."""
    found = table.get((n, k)) if table else None
    if found is not None:
        return found
    block_n = 8 if n <= 8192 else 16
    block_k = 512 if k >= 512 else max(16, 1 << (k - 1).bit_length())
    return KernelConfig(block_n=block_n, block_k=block_k, num_warps=4)


class Fp8GemvWeight:
    """One linear layer's e4m3 copy for the one-row GEMV. ``__call__(x)``: ``x @ W.T + bias`` for
    ``x`` [..., K] bf16 (any number of rows, each computed as alone), one kernel launch. The same
    interface as ``marlin.Fp8Weight`` (``stale``, ``refresh``, ``nbytes``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 config: KernelConfig | None = None, *, swiglu: bool = False,
                 table: dict | None = None):
        self.n, self.k = weight.shape
        self.config = config or config_for(self.n, self.k, table)
        # ``swiglu``: a SwiGLU gate-up layer ([gate; up]) whose copy keeps each gate row beside
        # its up row, so that one launch ends in silu(gate) * up (``swiglu``); the model's order
        # is restored for a plain call. Only where the pairs fill whole blocks.
        self.pairs = (pair_rows(self.n, weight.device)
                      if swiglu and self.n % self.config.block_n == 0
                      and self.config.block_n % 2 == 0 else None)
        self.w8, self.scale = quant.quantize_rows(self._ordered(weight.detach()))
        self.bias = None if bias is None else self._ordered(bias.detach()).clone()
        self._source = quant.version_of(weight), quant.version_of(bias)

    def _ordered(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.pairs is None else t[self.pairs]

    def stale(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the layer's weight or bias was replaced or written since this copy."""
        return self._source != (quant.version_of(weight), quant.version_of(bias))

    def refresh(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantise ``weight`` again into this copy's own tensors (graphs captured with them
        keep valid addresses)."""
        with torch.no_grad():
            w8, scale = quant.quantize_rows(self._ordered(weight.detach()))
            self.w8.copy_(w8)
            self.scale.copy_(scale)
            if self.bias is not None and bias is not None:
                self.bias.copy_(self._ordered(bias))
        self._source = quant.version_of(weight), quant.version_of(bias)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.w8, self.scale, self.bias) if t is not None)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 pdl: str | None = None) -> torch.Tensor:
        y = gemv(x, self.w8, self.scale, self.bias, self.config, None if self.pairs is not None
                 else out, pdl=pdl)
        if self.pairs is None:
            return y
        y = torch.cat((y[..., 0::2], y[..., 1::2]), dim=-1)  # back to [gate; up]
        return y if out is None else out.view_as(y).copy_(y)

    def swiglu(self, x: torch.Tensor, pdl: str | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of this gate-up layer's output, rounded as vLLM's
        ``silu_and_mul`` rounds it, [..., N / 2], as one launch (``pairs`` only)."""
        return gemv(x, self.w8, self.scale, self.bias, self.config, swiglu_out=True, pdl=pdl)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None,
               *, norm: tuple[torch.Tensor, float] | None = None,
               counts: torch.Tensor | None = None, pdl: str | None = None):
        """``residual + self(x)`` as one launch (the product rounded first, as the model
        adds), into ``out`` if given (``residual`` itself: in place); with ``norm`` and
        ``counts`` also its RMSNorm (``gemv``'s ``norm``): ``(sum, normed)``."""
        return gemv(x, self.w8, self.scale, self.bias, self.config, out, residual=residual,
                    norm=norm, counts=counts, pdl=pdl)

    def mlp_tail(self, gate_up: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(silu(gate) * up)`` for ``gate_up`` [..., 2K] as one launch: the
        down projection of a SwiGLU MLP with the step's SiLU-and-multiply and residual add."""
        return gemv(gate_up, self.w8, self.scale, self.bias, self.config, silu_mul=True,
                    residual=residual)


def gemv(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
         config: KernelConfig | None = None, out: torch.Tensor | None = None, *,
         silu_mul: bool = False, residual: torch.Tensor | None = None,
         swiglu_out: bool = False, halves: bool = False, norm=None,
         counts: torch.Tensor | None = None, pdl: str | None = None):
    """``x @ (w8 * scale[:, None]).T + bias``, optionally with a SwiGLU input and a residual,
    or (``swiglu_out``) a SwiGLU output.

    x: [..., K] bf16 or fp16 (rows with unit stride); with ``silu_mul`` [..., 2K], gate then up,
    and the input is ``silu(gate) * up`` rounded to x's dtype (as vLLM's ``silu_and_mul`` gives
    it). w8: [N, K] float8_e4m3fn, row-major; scale: [N] float32; bias: [N] or None; residual:
    [..., N] or None, added to the product rounded to x's dtype (as ``residual + out`` adds).
    With ``swiglu_out`` the rows of ``w8`` are (gate, up) pairs (``pair_rows``) and the result
    is ``silu(gate) * up`` of the rounded product, [..., N / 2] (no residual; N a multiple of
    the block); with ``halves`` too, ``w8`` is the model's own [gate; up] order and each program
    reads its gate rows from the first half and their up rows from the second (no re-ordered
    copy). ``w8`` may be the bf16 weight itself and ``scale`` None (no scale: the bf16 row GEMV,
    ``ops/row_linears.py``). Returns [..., N] in ``x``'s dtype (``out``: [M, N] to write
    into, ``residual`` itself included: each program reads its outputs' residual before it
    writes them).

    ``norm`` = (weight [N], eps) with ``counts`` (int32 zeros, one per row at least; left at
    zero): returns ``(out, rms_norm(out))``, the norm computed by the program that writes a row's
    last block (an atomic count per row) as vLLM's ``rms_norm`` rounds it (``NORM``): one launch
    where the step ran two.

    ``pdl`` (``PDL_MODES``; None: a plain launch): a programmatic dependent launch (compute
    capability 9.0+, compiled Triton): the launch may start while the kernel before it in the
    stream finishes; each program waits for that kernel (``gdc_wait``) before it reads anything
    but the weight, and lets the kernel after it start once its weight loop is done
    (``gdc_launch_dependents``). "prefetch": before waiting, each of its rows asks for its first
    ``block_k`` weights in L2; "wait": it only waits. The same products and sums in the same
    order as a plain launch. The bf16 row GEMV step (``row_linears.RowLinears``) and the FP8
    one-row step (``linears.Fp8Linears``) take ``dependent_launches(device)``, "prefetch" on
    Hopper."""
    check_pdl(pdl, x.device)
    n, k = w8.shape
    width = 2 * k if silu_mul else k
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    res = None
    if residual is not None:
        res = residual.reshape(m, n)
        if res.stride(-1) != 1:
            res = res.contiguous()
    cfg = config or config_for(n, k)
    width_out = n // 2 if swiglu_out else n
    if swiglu_out and (res is not None or n % cfg.block_n or cfg.block_n % 2):
        raise ValueError(f"swiglu_out: N {n} in blocks of {cfg.block_n}, residual "
                         f"{res is not None}: want even blocks dividing N and no residual")
    if halves and not swiglu_out:
        raise ValueError("halves reads [gate; up] rows for swiglu_out only")
    if out is None:
        out = torch.empty(m, width_out, dtype=x.dtype, device=x.device)
    grid = (-(-n // cfg.block_n), m)  # ceil: no per-call import on the eager path
    normed = None
    if norm is not None:
        if swiglu_out or counts is None or counts.numel() < m:
            raise ValueError("norm needs a plain output and a count per row")
        normed = torch.empty_like(out)
    if scale is None:
        scale = out  # not read (HAS_SCALE off): any pointer
    _kernel()[grid](
        x2, w8, scale, bias if bias is not None else scale, res if res is not None else out,
        out, n, k, x2.stride(0), w8.stride(0), (res if res is not None else out).stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, HAS_RESIDUAL=res is not None,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWIGLU_OUT=swiglu_out,
        HAS_SCALE=scale is not out, HALVES=halves,
        norm_w_ptr=out if norm is None else norm[0], norm_out_ptr=out if normed is None
        else normed, count_ptr=out if counts is None else counts,
        norm_eps=1e-6 if norm is None else float(norm[1]), NORM=norm is not None,
        NORM_N=_next_pow2(n) if norm is not None else 16,
        w_addr=0 if pdl is None else w8.data_ptr(), PDL=pdl is not None,
        PDL_PREFETCH=pdl == "prefetch", LANES=max(32 * cfg.num_warps, cfg.block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if pdl is None else {"launch_pdl": True}))
    if normed is not None:
        return (out.reshape(*x.shape[:-1], width_out),
                normed.reshape(*x.shape[:-1], width_out))
    return out.reshape(*x.shape[:-1], width_out)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def pair_rows(n: int, device=None) -> torch.Tensor:
    """The row order of a SwiGLU gate-up weight ([gate; up], N rows) with each gate row
    followed by its up row: index ``2j`` is row ``j``, ``2j + 1`` is row ``N / 2 + j``."""
    half = torch.arange(n // 2, device=device)
    return torch.stack((half, half + n // 2), dim=1).reshape(-1)


def reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, *, silu_mul: bool = False,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """What ``gemv`` computes, in fp32 from the same e4m3 values (the sum order differs)."""
    if silu_mul:
        half = x.shape[-1] // 2
        gate, up = x[..., :half].float(), x[..., half:].float()
        x = (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype)
    out = x.reshape(-1, x.shape[-1]).float() @ quant.dequantize(w8, scale).T
    if bias is not None:
        out = out + bias.float()
    out = out.to(x.dtype).reshape(*x.shape[:-1], w8.shape[0])
    if residual is not None:
        out = (residual.float() + out.float()).to(x.dtype)
    return out


def dependent_launch_functions(triton, tl):
    """What a kernel's dependent launch calls, for its module's globals (Triton resolves a
    called function there): ``gdc_wait`` (wait for the kernel before it), ``gdc_launch_dependents``
    (let the next one start), both None on a Triton without them (compiling with ``PDL`` then
    fails naming them), and ``prefetch_l2(addr, size)``: ask for ``size`` bytes at each ``addr``
    in L2, one bulk prefetch an element whose size is above zero (addresses and sizes in
    multiples of 16 bytes, the bulk copy's unit). The one-row GEMV and the row GEMM
    (``ops/rows_gemm.py``) share them."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def prefetch_l2(addr, size):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    return gdc_wait, gdc_launch_dependents, prefetch_l2


def _define(triton, tl):
    """The Triton kernel (``compiling.triton_kernel`` defines it at first use)."""
    global _gdc_wait, _gdc_launch_dependents, _prefetch_l2
    _gdc_wait, _gdc_launch_dependents, _prefetch_l2 = dependent_launch_functions(triton, tl)

    @triton.jit
    def fp8_gemv(x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, out_ptr, N, K, stride_xm,
                 stride_wn, stride_rm, stride_om, HAS_BIAS: tl.constexpr,
                 SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_N: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SWIGLU_OUT: tl.constexpr = False, HAS_SCALE: tl.constexpr = True,
                 HALVES: tl.constexpr = False, norm_w_ptr=None, norm_out_ptr=None,
                 count_ptr=None, norm_eps=1e-6, NORM: tl.constexpr = False,
                 NORM_N: tl.constexpr = 16, w_addr=0, PDL: tl.constexpr = False,
                 PDL_PREFETCH: tl.constexpr = False, LANES: tl.constexpr = 128):
        # out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]) (+ res[m, n]): program
        # (pid_n, m). The [BLOCK_N, BLOCK_K] products accumulate elementwise in fp32 over K and
        # are summed once at the end, so a row's order depends on the block sizes only.
        pid_n = tl.program_id(0)
        row = tl.program_id(1)
        if HALVES:  # (gate, up) pairs read from the [gate; up] halves of the weight
            pair = tl.arange(0, BLOCK_N)
            offs_n = pid_n * (BLOCK_N // 2) + pair // 2 + (pair % 2) * (N // 2)
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + row * stride_xm + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if PDL:
            if PDL_PREFETCH:
                # Only the weight before the wait: it is no kernel's output. Each of the
                # program's rows asks for its first BLOCK_K weights in L2 (``w_addr``: the
                # weight's address); the whole block would not stay there (gate-up: 96 MiB).
                lane = tl.arange(0, LANES)
                if HALVES:
                    w_row = pid_n * (BLOCK_N // 2) + lane // 2 + (lane % 2) * (N // 2)
                else:
                    w_row = pid_n * BLOCK_N + lane
                elt: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
                size = tl.where((lane < BLOCK_N) & (w_row < N), BLOCK_K * elt, 0)
                _prefetch_l2(w_addr + w_row.to(tl.int64) * stride_wn * elt, size)
            _gdc_wait()
        for start in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs)
                if SILU_MUL:
                    up = tl.load(x_ptrs + K)
                if EVEN_N:
                    w = tl.load(w_ptrs, eviction_policy="evict_first")
                else:
                    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0,
                                eviction_policy="evict_first")
            else:
                k_mask = start + offs_k < K
                x = tl.load(x_ptrs, mask=k_mask, other=0.0)
                if SILU_MUL:
                    up = tl.load(x_ptrs + K, mask=k_mask, other=0.0)
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                            eviction_policy="evict_first")
            if SILU_MUL:  # the input vLLM's silu_and_mul would have written, in x's dtype
                gate = x.to(tl.float32)
                x = (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if PDL:  # the weight is read: the next launch may start
            _gdc_launch_dependents()
        out = tl.sum(acc, axis=1)
        if HAS_SCALE:
            out = out * tl.load(scale_ptr + offs_n, mask=n_mask, other=1.0)
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        out = out.to(out_ptr.dtype.element_ty)
        if SWIGLU_OUT:
            # Rows come in (gate, up) pairs (``pair_rows``): each pair's outputs, rounded as
            # stored, become silu(gate) * up as the down kernel's SILU_MUL computes it.
            gate, up = tl.split(tl.reshape(out.to(tl.float32), (BLOCK_N // 2, 2)))
            act = (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * stride_om + pid_n * (BLOCK_N // 2)
                     + tl.arange(0, BLOCK_N // 2), act)
        else:
            if HAS_RESIDUAL:  # residual + out as two bf16 tensors add: one more rounding
                res = tl.load(res_ptr + row * stride_rm + offs_n, mask=n_mask, other=0.0)
                out = (res.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * stride_om + offs_n, out, mask=n_mask)
            if NORM:
                # The program that writes the row's last block normalises the whole row as
                # vLLM's rms_norm kernel rounds it: the squares summed in fp32, x * rsqrt(mean +
                # eps) rounded to the row's dtype, times the weight, rounded again. Every
                # thread's stores before the count (release); the last to count sees every
                # block (acquire); it puts the count back to zero.
                tl.debug_barrier()
                done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
                if done == tl.num_programs(0) - 1:
                    cols = tl.arange(0, NORM_N)
                    c_mask = cols < N
                    h = tl.load(out_ptr + row * stride_om + cols, mask=c_mask, other=0.0,
                                cache_modifier=".cg").to(tl.float32)
                    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + norm_eps)
                    y = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
                    w = tl.load(norm_w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
                    tl.store(norm_out_ptr + row * stride_om + cols,
                             (y * w).to(out_ptr.dtype.element_ty), mask=c_mask)
                    tl.atomic_xchg(count_ptr + row, 0, sem="relaxed")

    return fp8_gemv


_kernel = triton_kernel(_define)
