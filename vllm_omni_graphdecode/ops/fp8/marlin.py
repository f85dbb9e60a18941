"""Weight-only FP8 through vLLM's Marlin GEMM (W8A16: e4m3 weights, bf16 activations), what a
decode step at 2-16 rows reads its copies with (this package's docstring has the measurements)."""

from __future__ import annotations

import contextlib
import logging

import torch

from ...core.reasons import Reason
from .quant import FP8_DTYPE, NO_FP8, quantize_rows, version_of


def available(device) -> Reason | None:
    """Why FP8 weights cannot run on ``device``, or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return NO_FP8.because(f"device is {device}")
    if FP8_DTYPE is None:
        return NO_FP8.because(f"torch {torch.__version__} has no float8_e4m3fn")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return NO_FP8.because(f"compute capability {major}.{minor}")
    try:
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no Marlin here
        return NO_FP8.because(f"vllm's Marlin FP8 not importable ({type(exc).__name__}: {exc})")
    if not hasattr(torch.ops._C, "marlin_gemm"):
        return NO_FP8.because("vllm's _C has no marlin_gemm")
    return None


@contextlib.contextmanager
def _quiet_marlin_notice():
    # prepare_fp8_layer_for_marlin logs, once, that "your GPU does not have native support for
    # FP8": written for checkpoints stored in FP8 on older GPUs, untrue and alarming here.
    log = logging.getLogger("vllm.model_executor.layers.quantization.utils.marlin_utils_fp8")
    was = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = was

class Fp8Weight:
    """One linear layer's e4m3 copy, repacked for Marlin. ``__call__(x)``: ``x @ W.T + bias`` for
    ``x`` [..., K] bf16, one kernel launch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as marlin

        self.n, self.k = weight.shape
        w8, scale = quantize_rows(weight.detach())
        holder = torch.nn.Module()  # what vLLM's helper reads and rewrites: not the model's layer
        holder.weight = torch.nn.Parameter(w8, requires_grad=False)
        holder.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        holder.bias = (None if bias is None
                       else torch.nn.Parameter(bias.detach().clone(), requires_grad=False))
        holder.output_size_per_partition, holder.input_size_per_partition = self.n, self.k
        holder.orig_dtype = weight.dtype
        with _quiet_marlin_notice():
            marlin.prepare_fp8_layer_for_marlin(holder, size_k_first=False)
        self._apply = marlin.apply_fp8_marlin_linear
        self._holder = holder
        self._source = version_of(weight), version_of(bias)

    def stale(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the layer's weight or bias was replaced or written since this copy."""
        return self._source != (version_of(weight), version_of(bias))

    def refresh(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantise ``weight`` again into this copy's own tensors: a graph captured with them
        reads the new values (a new copy would leave it reading freed memory)."""
        fresh = Fp8Weight(weight, bias)
        with torch.no_grad():
            for mine, new in zip(self._holder.parameters(), fresh._holder.parameters()):
                mine.copy_(new)
        self._source = fresh._source

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._holder.parameters())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self._holder
        return self._apply(x, h.weight, h.weight_scale, h.workspace, self.n, self.k, h.bias)
