"""Pull a weight into the GPU's L2 cache on a side stream, while the step waits on other work.

Why: at batch 1 a decoder layer's attention (FA3 over the paged K/V, ~12 us a layer at context
2048 on the H200) reads a few MB of K/V and leaves the memory bus nearly idle, and the o_proj GEMV
right after it reads its whole weight (32 MiB for SenseNova-U1) from HBM at ~75% of the copy
bandwidth: a matrix that small does not keep enough reads in flight to fill the bus (every
library GEMV measured, ``benchmarks/results/h200-2026-12-01/gemv.json``, stops at ~85%). Issued
on a side stream as the attention starts, L2 prefetches of that weight fetch it while the bus is
idle, and the GEMV then reads from L2 (50 MB on the H100/H200). Nothing a kernel computes changes:
the step's results are bit for bit the same with and without it.

What runs: ``start(weight)`` forks a side stream from the current one (inside a graph capture the
fork and the ``finish`` join become graph edges, so the prefetch is a parallel branch of the
replay), launches one kernel there that issues a PTX ``prefetch.global.L2`` for every 128-byte
line of the weight, and ``finish`` makes the current stream wait for it before the weight's
reader. A kernel of this plugin's own because no library issues L2 prefetches: torch, vllm and
Inductor read memory only into registers (a side-stream ``sum`` of the weight would do the same
job, at the cost of the SMs the attention needs; the probe, ``bench.py --cases
sensenova_prefetch``, times both).

When to delete: when the GEMV libraries reach copy bandwidth on these matrices, or when the
attention kernel prefetches the next layer's weights itself.
"""

from __future__ import annotations

import threading

import torch

from .reasons import Reason

NO_PREFETCH = Reason("L2 prefetch unavailable",
                     "a CUDA GPU of compute capability 8.0 or newer with Triton (the step reads "
                     "its weights from memory as it needs them)")

LINE = 128  # bytes an L2 prefetch pulls
MODES = ("lines", "evict_last", "bulk", "sum")

_lock = threading.Lock()
_streams: dict[int, object] = {}


def side_stream(device: torch.device):
    """The one prefetch stream per device (graph captures fork onto it and join it back)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
        return stream


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_l2(base, chunks, per_program, last, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    MODE: tl.constexpr):
        # base: the weight's bytes; chunk c starts at byte min(c * CHUNK, last) (the last chunk is
        # clamped to end at the weight's end, so its lines may be named twice: harmless).
        pid = tl.program_id(0)
        lo = pid * per_program
        hi = tl.minimum(lo + per_program, chunks)
        for first in range(lo, hi, BLOCK):
            chunk = tl.minimum(first + tl.arange(0, BLOCK), hi - 1).to(tl.int64)
            addr = base + tl.minimum(chunk * CHUNK, last)
            if MODE == 0:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                          [addr], dtype=tl.int32, is_pure=False, pack=1)
            elif MODE == 1:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                          "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK};\n\tmov.u32 $0, 0;",
                    "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)

    return prefetch_l2


_KERNEL = None
BULK_CHUNK = 4096  # bytes one bulk prefetch names (a multiple of 16)


class L2Prefetch:
    """``pending = pf.start(weight)`` ... ``pf.finish(pending)``: ``weight`` is pulled into L2 on
    the side stream between the two calls (see the module docstring).

    ``mode``: ``lines`` (one ``prefetch.global.L2`` per 128-byte line), ``evict_last`` (the same
    with the evict-last hint), ``bulk`` (Hopper's ``cp.async.bulk.prefetch.L2``, 4 KiB each) or
    ``sum`` (a side-stream ``torch.sum`` of the weight: loads through registers, every SM);
    ``programs``: the prefetch kernel's grid (few: the SMs stay free for the attention).
    """

    def __init__(self, device, mode: str = "lines", programs: int = 16, block: int = 256):
        if mode not in MODES:
            raise ValueError(f"L2 prefetch mode {mode!r}; accepted: {', '.join(MODES)}")
        self.device = torch.device(device)
        self.mode = mode
        self.programs = programs
        self.block = block
        self.stream = side_stream(self.device)
        self._sink = torch.zeros((), dtype=torch.float32, device=self.device)

    @property
    def name(self) -> str:
        return f"L2 prefetch of o_proj during attention ({self.mode}, {self.programs} programs)"

    def start(self, weight: torch.Tensor):
        """Fork: the side stream waits for the current one, then prefetches ``weight``."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self._prefetch(weight)
        return self.stream

    def finish(self, pending) -> None:
        """Join: the current stream waits for the prefetch (call before the weight's reader)."""
        torch.cuda.current_stream(self.device).wait_stream(pending)

    def _prefetch(self, weight: torch.Tensor) -> None:
        if self.mode == "sum":
            torch.sum(weight, dtype=torch.float32, out=self._sink)
            return
        global _KERNEL
        if _KERNEL is None:
            _KERNEL = _kernel()
        flat = weight.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        mode = {"lines": 0, "evict_last": 1, "bulk": 2}[self.mode]
        # A bulk prefetch needs a 16-byte aligned start and size: else (and for a weight smaller
        # than one chunk) lines.
        if mode == 2 and (nbytes < BULK_CHUNK or nbytes % 16 or flat.data_ptr() % 16):
            mode = 0
        chunk = BULK_CHUNK if mode == 2 else LINE
        chunks = -(-nbytes // chunk)
        per_program = -(-chunks // self.programs)
        _KERNEL[(self.programs,)](flat, chunks, per_program, max(0, nbytes - chunk),
                                  CHUNK=chunk, BLOCK=self.block, MODE=mode, num_warps=4)


def select_prefetch(device, mode: str = "lines", programs: int = 16) -> "L2Prefetch | Reason":
    """An ``L2Prefetch`` for ``device``, or why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return NO_PREFETCH.because(f"device is {device}")
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return NO_PREFETCH.because(f"compute capability {major}.x")
    if mode == "bulk" and major < 9:
        return NO_PREFETCH.because(f"bulk prefetch needs compute capability 9.0, not {major}.x")
    if mode != "sum":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            return NO_PREFETCH.because("torch.utils._triton missing")
        if not has_triton():
            return NO_PREFETCH.because("Triton not usable on this device")
    return L2Prefetch(device, mode, programs)
