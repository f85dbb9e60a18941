"""The e4m3 rounding every FP8 copy shares: one fp32 scale per output row (``amax / 448``), and
what a copy remembers of its source to see it replaced or written (``version_of``). Why FP8 and
which kernels read the copies: this package's docstring."""

from __future__ import annotations

import torch

from ...core.reasons import Reason

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # largest finite e4m3fn value

NO_FP8 = Reason("FP8 weights unavailable",
                "a CUDA GPU with FP8 support: weight-only FP8 (decode steps, vLLM's Marlin GEMM) "
                "needs compute capability 8.0 or newer and a CUDA build of vllm, W8A8 GEMMs "
                "(denoising steps) 8.9 or newer (Ada, Hopper); meanwhile the path reads its bf16 "
                "weights")

def quantize_rows(weight: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w8, scale)``: ``weight`` [N, K] as e4m3 with one fp32 scale per row, ``weight[n] ~=
    w8[n] * scale[n]``. Rows of zeros get scale 1 (their e4m3 values are zeros). Done ``chunk``
    rows at a time so the fp32 temporary stays small."""
    n, _ = weight.shape
    w8 = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, chunk):
        rows = weight[start:start + chunk].float()
        amax = rows.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        w8[start:start + chunk] = (rows / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[start:start + chunk] = s
    return w8, scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight an e4m3 copy stands for (tests, accuracy reports)."""
    return w8.float() * scale[:, None]


def version_of(t: torch.Tensor | None):
    """What a copy remembers of its source tensor to see it replaced or written through itself:
    its storage and version counter (None for no tensor)."""
    if t is None:
        return None
    try:
        version = t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter: storage only
        version = None
    return t.data_ptr(), version
