"""A one-row decode step's linear layers through the plugin's one-row GEMV on the bf16 weights
themselves (issue #42): ``RowLinears``, what a hook's fused step calls in place of the modules'
cuBLAS GEMMs (``gemv.Gemv``'s interface, as ``fp8.linears.Fp8Linears``).

Why: at one row cuBLAS reads the small layers' weights well short of the copy bandwidth
(``gemv.py``'s table: qkv 71%, o_proj 61%, down 80%), and Inductor's GEMVs that beat it pick
their block sizes by timing, so another process may round a request differently (``tuned``);
its deterministic mode was slower than cuBLAS. The plugin's FP8 GEMV (``fp8/gemv.py``,
HAND-WRITTEN) takes its block sizes from the shape alone and reads any weight dtype: here it
reads the bf16 weight in place (no copy, no scale), and its launches carry the MLP's
SiLU-and-multiply (the gate-up launch reads each gate row's up row from the weight's second
half) and the residual add (the down launch). Two launches for the MLP where the cuBLAS step
runs four (or six with its split-K reduces). Measured on an H100 80GB
(``benchmarks/results/h100-2026-12-05d``): the step's GEMVs read the weights at 0.96 of the copy
bandwidth against cuBLAS's 0.88 (``benchmarks/probes/fp8_gemv.py --bf16-gemv``: qkv 18.8 against
20.8 us, o_proj 13.5 against 16.4, down 36.8 against 39.3), and the step is 1.10-1.12x the cuBLAS
step at contexts 512-8192 (``bench.py --step-modes rowgemv``); on the H200 the same, 1.10-1.12x
(5.48 against 6.07 ms a token at 2048, ``benchmarks/results/h200-2026-12-05c``). The step
mode ``rowgemv`` (docs/configuration.md), the default on Hopper (``auto``) since the batch,
step-execution, fault, structure-change and denoising GPU files ran with it as the default on an
H100 (``benchmarks/results/h100-2026-12-06e``).

Rounding: one fp32 sum per output in a fixed order, the bias added in fp32, one bf16 rounding;
the SwiGLU and the residual add round where vLLM's ``silu_and_mul`` and the model's ``+`` do. It
differs from cuBLAS in the sum order only, and is the same in every process.

A one-row kernel: a step of several rows would read every weight once per row, so where the
engine batches (``--max-num-seqs`` above 1) ``rowgemv`` reads the 16-row GEMM instead
(``rows_gemm.RowsLinears``), for every step of the process: one process never serves a request
through both (its answer must not depend on whether it ran alone).
"""

from __future__ import annotations

import weakref

import torch

from ..core import stats
from ..core.reasons import Reason
from . import gemv
from .counts import CountBuffers
from .fp8 import gemv as row_gemv

ROW_LAYER_KEPT = Reason("layer kept on cuBLAS",
                        "nothing to change for LoRA: an adapter's layer runs its own kernel. The "
                        "one-row GEMV, and the batched step's row GEMM (at most 16 rows), read "
                        "unquantised, unsharded vllm linear layers without active LoRA adapters "
                        "or hooks (the detail names the layer)")
ROW_HEAD_KEPT = Reason("lm_head kept on cuBLAS",
                       "the row GEMV reads an unquantised, unsharded bf16 lm_head whose logits "
                       "processor only projects (no scale, soft cap or other head dtype) and a "
                       "language model whose forward takes compute_logits; the detail says "
                       "which is missing. Meanwhile the model's own head computes the logits")
NO_ROW_GEMV = Reason("bf16 row GEMV unavailable",
                     "a CUDA GPU with Triton; meanwhile the step's linear layers run the "
                     "modules' cuBLAS GEMMs")


def available(device) -> Reason | None:
    """Why the bf16 row GEMV cannot run on ``device``, or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return NO_ROW_GEMV.because(f"device is {device}")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return NO_ROW_GEMV.because(f"triton not importable ({exc})")
    return None


class RowLinears:
    """``linears(module, x)``: ``module``'s output for ``x`` (one row) through the one-row GEMV
    on the module's own bf16 weight, or through the module where it is not a plain vllm linear
    layer (counted under ``ROW_LAYER_KEPT``; inside a graph decided once, at capture).
    ``table``: the hook's block sizes per weight shape (``fp8.gemv.config_for``; None: the
    shape rule). ``model``: the stats key."""

    def __init__(self, model: str, table: dict | None = None, fold_norms: bool = True,
                 pdl: str | None = None):
        self.model = model
        self.table = table
        self._head = None  # (weakref to the lm_head, the rows it keeps) once ``take_head``
        # ``fold_norms``: ``add_norm`` and ``swiglu_mlp_norm`` serve (the RMSNorm after o_proj
        # and after down computed by the launch's last program); else they answer None.
        self.fold_norms = fold_norms
        # ``pdl``: every launch's ``fp8.gemv.gemv`` ``pdl`` mode (None: plain launches). The
        # hook passes ``fp8.gemv.dependent_launches(device)``: "prefetch" on Hopper.
        self.pdl = pdl
        self._counts = CountBuffers(16)

    def _counts_on(self, device: torch.device) -> torch.Tensor | None:
        """The zeroed per-row count buffer of ``device`` (``counts.CountBuffers``: the one-row
        step's launches run on one stream); None without ``fold_norms``."""
        return self._counts.on(device) if self.fold_norms else None

    def add_norm(self, module, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
        """``residual <- residual + module(x)`` in place, then ``rms_norm(residual) * weight``
        returned, in one launch (what vLLM's ``fused_add_rms_norm`` does after the GEMV, with
        its roundings), or None where ``module`` is not plain, the shapes do not fit or there is
        no count buffer (the caller runs its own steps)."""
        base = self._readable(module)
        counts = self._counts_on(x.device)
        if (base is None or counts is None or residual.shape[-1] != base.weight.shape[0]
                or residual.numel() != base.weight.shape[0] or not residual.is_contiguous()
                or weight.shape != (base.weight.shape[0],)):
            return None
        _, normed = row_gemv.gemv(x, base.weight, None, base.bias, self._config(base.weight),
                                  out=residual.view(1, -1), residual=residual,
                                  norm=(weight, eps), counts=counts, pdl=self.pdl)
        return normed.view(residual.shape)

    def swiglu_mlp_norm(self, gate_up_module, down_module, x, residual, weight, eps):
        """``(residual + down(silu(gate) * up), rms_norm(that) * weight)`` in two launches (the
        down launch's last program normalises: the next layer's input norm), or None where
        ``swiglu_mlp`` would not serve or there is no count buffer."""
        down = self._readable(down_module)
        counts = self._counts_on(x.device)
        if (counts is None or down is None or weight.shape != (down.weight.shape[0],)
                or residual.numel() != down.weight.shape[0]):
            return None
        act = self._swiglu(gate_up_module, x)
        if act is None:
            return None
        out, normed = row_gemv.gemv(act, down.weight, None, down.bias, self._config(down.weight),
                                    residual=residual, norm=(weight, eps), counts=counts,
                                    pdl=self.pdl)
        return out.view(residual.shape), normed.view(residual.shape)

    def _config(self, weight: torch.Tensor) -> row_gemv.KernelConfig:
        n, k = weight.shape
        return row_gemv.config_for(n, k, self.table)

    @staticmethod
    def _readable(module):
        """``module``'s layer the GEMV reads (its base where a LoRA wrapper is inactive), or
        None."""
        base = gemv.base_of_inactive_lora(module)
        if gemv.Gemv.plain(base) and base.weight.dtype in (torch.bfloat16, torch.float16):
            return base
        return None

    def _base(self, module):
        """``_readable``, counting a layer kept on its own kernel (once per call that runs it)."""
        base = self._readable(module)
        if base is not None:
            return base
        stats.degraded(self.model, ROW_LAYER_KEPT.because(
            f"{type(module).__name__} (LoRA adapter active, quantised, hooked or not bf16)"))
        return None

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        base = self._base(module)
        if base is None:
            return module(x)[0]
        return row_gemv.gemv(x, base.weight, None, base.bias, self._config(base.weight),
                             pdl=self.pdl)

    def swiglu_mlp(self, gate_up_module, down_module, x, residual):
        """``residual + down(silu(gate) * up)`` of ``x`` in two launches: the gate-up one reads
        its (gate, up) row pairs from the weight's halves and ends in silu(gate) * up, the down
        one adds the residual. None where either layer is not plain, or the gate-up blocks do
        not pair (the caller runs the layers one by one, counting a kept layer there)."""
        down = self._readable(down_module)
        act = None if down is None else self._swiglu(gate_up_module, x)
        if act is None:
            return None
        return row_gemv.gemv(act, down.weight, None, down.bias, self._config(down.weight),
                             residual=residual, pdl=self.pdl)

    def _swiglu(self, gate_up_module, x):
        """silu(gate) * up of ``x`` in one launch, or None (not plain, or blocks do not pair)."""
        up = self._readable(gate_up_module)
        if up is None:
            return None
        cfg = self._config(up.weight)
        if cfg.block_n % 2 or up.weight.shape[0] % cfg.block_n:
            return None
        return row_gemv.gemv(x, up.weight, None, up.bias, cfg, swiglu_out=True, halves=True,
                             pdl=self.pdl)

    def mlp_tail(self, module, gate_up, residual):
        """``residual + down(silu(gate) * up)`` as one launch, or None where ``module`` is not
        plain (the caller runs the three steps)."""
        base = self._base(module)
        if base is None:
            return None
        return row_gemv.gemv(gate_up, base.weight, None, base.bias, self._config(base.weight),
                             silu_mul=True, residual=residual)

    def take_head(self, language_model) -> Reason | None:
        """Read ``language_model.lm_head`` through the GEMV too (``logits``), or why not
        (``ROW_HEAD_KEPT``): a plain unsharded bf16 head whose logits processor only projects
        (``fp8.linears.head_not_copyable``'s checks)."""
        from .fp8.linears import head_not_copyable

        head = getattr(language_model, "lm_head", None)
        processor = getattr(language_model, "logits_processor", None)
        why = head_not_copyable(head, processor, True)
        if why is not None:
            return ROW_HEAD_KEPT.because(why)
        self._head = (weakref.ref(head), int(getattr(processor, "org_vocab_size",
                                                     head.weight.shape[0])))
        return None

    @property
    def has_head(self) -> bool:
        return self._head is not None

    def logits(self, hidden_states: torch.Tensor, module=None) -> torch.Tensor | None:
        """The logits of ``hidden_states`` (``[..., hidden]``) through the GEMV on the head's
        own weight, or None (the caller runs the model's head): no head taken, or the model's
        ``lm_head`` (``module``) is no longer that head (replaced, or a LoRA adapter active;
        counted under ``ROW_HEAD_KEPT``)."""
        if self._head is None:
            return None
        head = self._head[0]()
        if head is None or (module is not None and gemv.base_of_inactive_lora(module) is not head):
            stats.degraded(self.model, ROW_HEAD_KEPT.because(
                f"lm_head is now {type(module).__name__} (replaced, or a LoRA adapter active)"))
            return None
        weight = head.weight[:self._head[1]]
        return row_gemv.gemv(hidden_states, weight, None, None, self._config(weight),
                             pdl=self.pdl)

    def release(self) -> None:
        """Nothing to drop: the GEMV reads the modules' own weights."""

    nbytes = 0

    def describe(self) -> str:
        head = " and lm_head" if self._head is not None else ""
        norms = ", the RMSNorms in the o_proj and down launches" if self.fold_norms else ""
        pdl = (f", programmatic dependent launches ({self.pdl})" if self.pdl is not None
               else "")
        return f"bf16 row GEMVs{head}, SiLU-and-multiply in the gate-up launch{norms}{pdl}"
