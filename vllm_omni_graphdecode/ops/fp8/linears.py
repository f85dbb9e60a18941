"""A decode step's linear layers through FP8 copies (``Fp8Linears``): vLLM's Marlin
(``marlin.py``) for a batched step, the plugin's one-row GEMV (``gemv.py``) where one request
decodes alone, the lm_head's copy, and the layers kept in bf16 (counted under ``LAYER_KEPT``)."""

from __future__ import annotations

import functools
import weakref

import torch

from ...core import stats
from ...core.reasons import Reason
from .. import gemv
from ..counts import CountBuffers
from .marlin import Fp8Weight

LAYER_KEPT = Reason("layer kept in bf16",
                    "nothing to change for LoRA: an adapter's layer runs its own bf16 kernel. "
                    "FP8 copies cover unquantised vllm linear layers without active LoRA "
                    "adapters, hooks or tensor parallelism (the detail names the layer)")
HEAD_KEPT = Reason("lm_head kept in bf16",
                   "an FP8 lm_head (its entry in VLLM_OMNI_GRAPHDECODE_FP8) reads through the "
                   "one-row FP8 GEMV only: one request at a time (--max-num-seqs 1), on a GPU that "
                   "runs it, with an unquantised, unsharded lm_head and plain logits (no scale, "
                   "soft cap or other head dtype); the detail says which is missing. Meanwhile "
                   "the step's logits come from the bf16 lm_head, as without it")


class Fp8Linears:
    """The step's linear layers through FP8 copies: what a hook's fused step calls in place of
    the modules' own GEMMs (``gemv.Gemv``'s interface). ``model``: the stats key's model.

    ``one_row``: the copies serve a one-row step only (no batched step in this process), so they
    are laid out for the one-row GEMV (``gemv.py``: faster than Marlin at one row) where the
    GPU runs it; else, and for the batched step's 16 rows, Marlin's layout. One layout per
    process: the two would cost the copies' bytes twice. ``gemv_table``: the hook's measured
    block sizes per weight shape for that GEMV (``gemv.config_for``; None: the shape rule).

    ``quantize(modules)`` makes the copies at load; a call for a layer that cannot use one (a LoRA
    wrapper with an active adapter, a quantised or hooked layer) runs the module itself, counted
    under ``LAYER_KEPT``. Inside a graph that decision is taken once, at capture.

    Through the one-row GEMV, as the bf16 row GEMV step (``ops/row_linears.py``): the o_proj and
    down launches also compute the RMSNorm after them (``add_norm``, ``swiglu_mlp_norm``;
    ``fold_norms``), and on Hopper every launch is a programmatic dependent launch (``pdl``,
    ``gemv.dependent_launches``)."""

    def __init__(self, model: str, one_row: bool = False, device="cuda", gemv_table=None):
        self.model = model
        self.gemv = False
        self.why_not_gemv = None  # with one_row: why Marlin serves the one row (counted by the hook)
        self._make = Fp8Weight
        self.fold_norms = False  # the o_proj and down launches normalise (one-row GEMV only)
        self.pdl = None  # every one-row GEMV launch's ``gemv.gemv`` ``pdl`` mode
        self._counts = CountBuffers(16)
        if one_row:
            from . import gemv as row_gemv

            self.why_not_gemv = row_gemv.available(device)
            if self.why_not_gemv is None:
                self.gemv = True
                self._make = functools.partial(row_gemv.Fp8GemvWeight, table=gemv_table)
                self.fold_norms = True
                self.pdl = row_gemv.dependent_launches(device)
        self._copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._covered: weakref.WeakSet = weakref.WeakSet()  # what ``release`` lets be re-made
        # SwiGLU gate-up layers: with the one-row GEMV their copies pair gate and up rows, so
        # that the gate-up launch ends in silu(gate) * up (``swiglu_mlp``).
        self._gate_up: weakref.WeakSet = weakref.WeakSet()
        self._head = None  # (weakref to the lm_head, the rows it keeps) once ``quantize_head``
        self._head_copy = None

    def quantize_head(self, language_model) -> Reason | None:
        """An e4m3 copy of ``language_model.lm_head`` for the one-row GEMV (``logits``), or why
        not (``HEAD_KEPT``): only where the GEMV serves, the head is a plain unsharded bf16
        weight and vLLM's ``LogitsProcessor`` would only project (no scale, soft cap, other head
        dtype or logits as input). Those logits then equal ``lm_head`` times the hidden state,
        through the FP8 copy: the step's greedy token can differ from the bf16 head's (the
        layer that picks the token; ``docs/performance.md`` measures how often)."""
        head = getattr(language_model, "lm_head", None)
        processor = getattr(language_model, "logits_processor", None)
        why = head_not_copyable(head, processor, self.gemv)
        if why is not None:
            return HEAD_KEPT.because(why)
        rows = int(getattr(processor, "org_vocab_size", head.weight.shape[0]))
        self._head = (weakref.ref(head), rows)
        self._head_copy = self._make(head.weight[:rows], None)
        return None

    @property
    def has_head(self) -> bool:
        return self._head is not None

    def logits(self, hidden_states: torch.Tensor, module=None) -> torch.Tensor | None:
        """The logits of ``hidden_states`` (``[..., hidden]``) through the FP8 ``lm_head`` copy,
        ``[..., vocab]`` in their dtype; None without one (the caller runs the model's head).
        ``module``: the model's ``lm_head`` now; where it is no longer the copied head (replaced,
        or wrapped by a LoRA adapter that is active) the caller's head runs, counted under
        ``HEAD_KEPT``. A released copy is made again, a stale one quantised again in place (as
        the layers' copies)."""
        if self._head is None:
            return None
        head = self._head[0]()
        if head is None or (module is not None and gemv.base_of_inactive_lora(module) is not head):
            stats.degraded(self.model, HEAD_KEPT.because(
                f"lm_head is now {type(module).__name__} (replaced, or a LoRA adapter active)"))
            return None
        weight = head.weight[:self._head[1]]
        if self._head_copy is None:  # released since
            self._head_copy = self._make(weight, None)
        elif self._head_copy.stale(weight, None):
            self._head_copy.refresh(weight, None)
        return self._head_copy(hidden_states, pdl=self.pdl)

    def quantize(self, modules) -> list[str]:
        """Make the copies of ``modules`` (name -> layer); returns why each one left is kept.
        A name ending in ``gate_up_proj`` is a SwiGLU MLP's [gate; up] projection."""
        kept = []
        for name, module in modules.items():
            if gemv.Gemv.plain(module):
                if self.gemv and name.endswith("gate_up_proj"):
                    self._gate_up.add(module)
                self._copies[module] = self._made(module)
                self._covered.add(module)
            else:
                kept.append(name)
        return kept

    def _made(self, module):
        if module in self._gate_up:
            return self._make(module.weight, module.bias, swiglu=True)
        return self._make(module.weight, module.bias)

    def release(self) -> None:
        """Drop every copy (sleep level 2, with the graphs that read them): each is made again
        from the layer's weight at the next capture. Sleep is also how a weight written through
        ``param.data`` (vLLM's loaders) reaches the copies: such a write leaves no trace."""
        self._copies.clear()
        self._head_copy = None

    @property
    def nbytes(self) -> int:
        head = self._head_copy.nbytes if self._head_copy is not None else 0
        return sum(c.nbytes for c in self._copies.values()) + head

    def describe(self) -> str:
        """The load line's clause for these copies."""
        kernel = "the plugin's one-row FP8 GEMV" if self.gemv else "vLLM Marlin"
        if self.gemv and len(self._gate_up):
            kernel += ", SiLU-and-multiply in the gate-up launch"
        if self.gemv and self.fold_norms:
            kernel += ", the RMSNorms in the o_proj and down launches"
        if self.gemv and self.pdl is not None:
            kernel += f", programmatic dependent launches ({self.pdl})"
        head = " and lm_head" if self._head is not None else ""
        return (f"FP8 weights for {len(self)} linear layers{head} ({self.nbytes / 1e9:.2f} GB "
                f"beside the bf16 ones; {kernel})")

    def __len__(self) -> int:
        return len(self._copies)

    def _copy_for(self, module):
        base = gemv.base_of_inactive_lora(module)
        if base not in self._covered or not gemv.Gemv.plain(base):
            return None
        copy = self._copies.get(base)
        if copy is None:  # released since
            copy = self._copies[base] = self._made(base)
        elif copy.stale(base.weight, base.bias):
            copy.refresh(base.weight, base.bias)
        return copy

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        copy = self._copy_for(module)
        if copy is None:
            stats.degraded(self.model, LAYER_KEPT.because(
                f"{type(module).__name__} (LoRA adapter active, quantised, hooked or not copied)"))
            return module(x)[0]
        return copy(x, pdl=self.pdl) if self.gemv else copy(x)

    def swiglu_mlp(self, gate_up_module, down_module, x, residual):
        """``residual + down(silu(gate) * up)`` of ``x`` in two launches of the one-row GEMV:
        the gate-up one ends in silu(gate) * up (its copy pairs the rows), the down one adds
        the residual. The same roundings as the gate-up launch then ``mlp_tail``, without the
        down launch recomputing the SiLU in every program. None where either layer has no
        such copy (the caller runs them one by one)."""
        if not self.gemv:
            return None
        up = self._copy_for(gate_up_module)
        down = self._copy_for(down_module)
        if up is None or down is None or getattr(up, "pairs", None) is None:
            return None
        return down.add_to(up.swiglu(x, pdl=self.pdl), residual, pdl=self.pdl)

    def add_norm(self, module, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
        """``residual <- residual + module(x)`` in place, then ``rms_norm(residual) * weight``
        returned, in one launch of the one-row GEMV (``row_linears.RowLinears.add_norm``'s
        contract), or None: Marlin's copies, no copy for ``module``, shapes that do not fit,
        no count buffer (the caller runs its own steps)."""
        copy = self._copy_for(module) if self.gemv else None
        counts = self._counts.on(x.device) if self.fold_norms else None
        if (copy is None or counts is None or getattr(copy, "pairs", None) is not None
                or residual.numel() != copy.n or not residual.is_contiguous()
                or weight.shape != (copy.n,)):
            return None
        _, normed = copy.add_to(x, residual, residual.view(1, -1), norm=(weight, eps),
                                counts=counts, pdl=self.pdl)
        return normed.view(residual.shape)

    def swiglu_mlp_norm(self, gate_up_module, down_module, x, residual, weight, eps):
        """``(residual + down(silu(gate) * up), rms_norm(that) * weight)`` in two launches (the
        down launch's last program normalises: the next layer's input norm), or None where
        ``swiglu_mlp`` would not serve or there is no count buffer."""
        if not self.gemv:
            return None
        up = self._copy_for(gate_up_module)
        down = self._copy_for(down_module)
        counts = self._counts.on(x.device) if self.fold_norms else None
        if (up is None or down is None or getattr(up, "pairs", None) is None or counts is None
                or residual.numel() != down.n or weight.shape != (down.n,)):
            return None
        out, normed = down.add_to(up.swiglu(x, pdl=self.pdl), residual, norm=(weight, eps),
                                  counts=counts, pdl=self.pdl)
        return out.view(residual.shape), normed.view(residual.shape)

    def mlp_tail(self, module, gate_up, residual):
        """``residual + down_proj(silu(gate) * up)`` as one launch of the one-row GEMV; None
        for Marlin's copies or a layer without a copy (the caller runs the three steps)."""
        if not self.gemv:
            return None
        copy = self._copy_for(module)
        if copy is None:
            return None
        return copy.mlp_tail(gate_up, residual)


def head_not_copyable(head, processor, one_row_gemv: bool) -> str | None:
    """Why an ``lm_head`` cannot be read through the one-row GEMV (an FP8 copy, or the bf16
    weight itself, ``ops/row_linears.py``) in the one-row step, or None."""
    if not one_row_gemv:
        return ("the step reads its copies through vLLM's Marlin (a batched step shares them, or "
                "the one-row GEMV cannot run here)")
    if head is None or processor is None:
        return "the language model has no lm_head and logits_processor"
    weight = getattr(head, "weight", None)
    if not torch.is_tensor(weight) or weight.dim() != 2 or weight.dtype not in (
            torch.bfloat16, torch.float16):
        return f"lm_head weight is {getattr(weight, 'dtype', type(weight).__name__)}, not bf16"
    method = type(getattr(head, "quant_method", None)).__name__
    if method not in ("UnquantizedEmbeddingMethod", "NoneType"):
        return f"lm_head is quantised ({method})"
    if int(getattr(head, "tp_size", 1) or 1) != 1:
        return f"lm_head is sharded over {head.tp_size} ranks"
    if getattr(processor, "logits_as_input", False):
        return "the logits processor takes logits as input"
    if getattr(processor, "soft_cap", None) is not None:
        return f"the logits processor soft-caps at {processor.soft_cap}"
    if float(getattr(processor, "scale", 1.0)) != 1.0:
        return f"the logits processor scales by {processor.scale}"
    head_dtype = getattr(processor, "head_dtype", None)
    if head_dtype is not None and head_dtype != weight.dtype:
        return f"the head computes in {head_dtype}"
    rows = int(getattr(processor, "org_vocab_size", weight.shape[0]))
    if rows > weight.shape[0]:
        return f"the processor keeps {rows} logits of {weight.shape[0]} rows"
    return None
