"""W8A8 (e4m3 weights and activations, ``torch._scaled_mm`` with row-wise scales) for the
many-row GEMMs of a denoising step: the copies a compiled step body reads in place of its bf16
weights (``W8A8Copies``) and the one ``linear`` that serves both."""

from __future__ import annotations

import weakref

import torch

from ...core.reasons import Reason
from .quant import FP8_DTYPE, FP8_MAX, NO_FP8, quantize_rows, version_of


def w8a8_available(device) -> Reason | None:
    """Why W8A8 GEMMs (``torch._scaled_mm`` with row-wise scales) cannot run on ``device``, or
    None. CUDA needs FP8 tensor cores (compute capability 8.9: Ada, Hopper); torch's CPU kernel
    serves the tests."""
    device = torch.device(device)
    if FP8_DTYPE is None:
        return NO_FP8.because(f"torch {torch.__version__} has no float8_e4m3fn")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return NO_FP8.because(f"compute capability {major}.{minor} has no FP8 tensor cores")
    elif device.type != "cpu":
        return NO_FP8.because(f"device is {device}")
    return None


def w8a8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w8, scale)`` for ``w8a8_linear``: ``quantize_rows`` with the scale as a ``(1, N)`` row."""
    w8, scale = quantize_rows(weight.detach())
    return w8, scale.view(1, -1)


def w8a8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """``x @ (w8 * scale).T + bias`` with ``x`` quantised to e4m3 on the fly, one scale per row
    (its ``amax / 448``): the dynamic per-token W8A8 of vLLM's ``--quantization fp8``, through
    ``torch._scaled_mm`` (row-wise scales, bf16 out). Written in plain torch ops so that inside
    an Inductor region the quantisation fuses into the kernel that produces ``x`` (and the bias
    add into the one that reads the product); a row of zeros keeps scale 1. ``fast_accum``:
    Hopper's FP8 fast accumulation (``use_fast_accum``: the tensor cores' own accumulator
    throughout, no periodic promotion to fp32; the schedule vLLM's CUTLASS FP8 kernels run),
    faster and rounding differently; a fixed choice, so every process rounds alike."""
    x2 = x.reshape(-1, x.shape[-1])
    amax = x2.abs().amax(dim=-1, keepdim=True).float()
    sx = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    x8 = (x2.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=scale, out_dtype=x.dtype,
                           use_fast_accum=fast_accum)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], w8.shape[0])


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a bf16 weight tensor, ``w8a8_linear`` for a ``(w8, scale)`` copy, or a
    ``(w8, scale, fast_accum)`` one (``W8A8Copies``): what a compiled step body calls, so that
    one body serves both."""
    if torch.is_tensor(weight):
        return torch.nn.functional.linear(x, weight, bias)
    w8, scale, *accum = weight
    return w8a8_linear(x, w8, scale, bias, fast_accum=bool(accum and accum[0]))


def w8a8_reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``w8a8_linear`` computes, in fp32 from the same e4m3 values (tests)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    amax = x2.abs().amax(dim=-1, keepdim=True)
    sx = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    xq = (x2 / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * sx
    out = xq @ (w8.float() * scale.view(-1, 1)).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w8.shape[0])


class W8A8Copies:
    """The e4m3 copies (``w8a8_weight``) a W8A8 step body reads in place of bf16 weights: made
    on first use (``copies(weight)`` -> ``(w8, scale)``), quantised again in place when the
    weight was replaced or written through itself (captured graphs keep reading the copy's
    addresses), dropped by ``release`` (sleep level 2, with the graphs that read them; re-made
    from the weights present at the next use). A write through ``param.data`` (how vLLM's
    weight loaders write) leaves no trace on the parameter: a weight update outside sleep needs
    ``release`` too. ``fast_accum``: each copy comes as ``(w8, scale, True)``, which ``linear``
    runs with FP8 fast accumulation (``w8a8_linear``)."""

    def __init__(self, fast_accum: bool = False):
        self._made: dict[int, tuple[weakref.ref, tuple, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.fast_accum = fast_accum
        self._flag = (True,) if fast_accum else ()

    def __call__(self, weight: torch.Tensor) -> tuple:
        made = self._made.get(id(weight))
        if made is not None and made[0]() is weight:
            if made[1] == version_of(weight):
                return made[2] + self._flag
            w8, scale = made[2]
            with torch.no_grad():
                fresh = w8a8_weight(weight)
                w8.copy_(fresh[0])
                scale.copy_(fresh[1])
            self._made[id(weight)] = (made[0], version_of(weight), made[2])
            return made[2] + self._flag
        with torch.no_grad():
            copy = w8a8_weight(weight)
        key = id(weight)

        def forget(ref, made=self._made):  # a replaced weight's copy goes with it
            if key in made and made[key][0] is ref:
                del made[key]

        self._made[key] = (weakref.ref(weight, forget), version_of(weight), copy)
        return copy + self._flag

    def release(self) -> None:
        self._made.clear()

    def __len__(self) -> int:
        return len(self._made)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, _, copy in self._made.values() for t in copy)
