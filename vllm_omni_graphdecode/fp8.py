"""FP8 (e4m3) copies of a hot path's linear weights (no model): weight-only for decode steps,
through vLLM's Marlin GEMM at 1-16 rows (the batched step) or the plugin's one-row GEMV
(``fp8_gemv.py``, the one-request step), and W8A8 (``w8a8_linear``) for the many-row GEMMs of a
denoising step.

Decode (``Fp8Weight``, ``Fp8Linears``).

Why: a decode step at 1-16 rows is bound by the bytes of its weights. On the H200 the 42 layers
of SenseNova-U1's decode GEMVs read 16.2 GB in bf16 and take 4.59 ms as one graph; with e4m3
weights they read half. Measured there, the same chain as one graph at 1 / 8 / 16 rows
(``benchmarks/probes/fp8_gemv.py``, ``benchmarks/results/h200-2026-12-01f/fp8-probe-0.26``), ms:

    cuBLAS bf16                                     4.59 / 4.84 / 4.62   (relative error 0)
    vLLM Marlin W8A16 (e4m3 weights, bf16 inputs)   3.31 / 3.33 / 3.38   (2.66%)
    vLLM CUTLASS W8A8, dynamic per-token inputs     3.09 / 3.16 / 3.18   (3.75%)
    torch._scaled_mm W8A8, the same inputs          5.02 / 5.01 / 4.86   (3.74%)
    a hand-written Triton W8A16 (tensor-core tile)  5.15 / 5.85 / 5.10   (2.65%)

Marlin is what runs at 2-16 rows: the activations stay bf16 (only the weights' rounding changes,
error 2.66% of a layer's output against 3.75% when the inputs are quantised too), 7% behind
CUTLASS W8A8 and well-kept by vLLM. The hand-written tensor-core kernel above was slower than
cuBLAS and is not used. At one row a plain GEMV beats them all: ``fp8_gemv`` (hand-written, bf16
activations, the same copies' values), 2.44 ms for the chain against Marlin's 3.31
(``h200-2026-12-01h``); it runs where no batched step shares the copies
(``Fp8Linears(one_row=True)``). Marlin's
configuration is chosen from the shape by fixed rules (no timing at load) and its reduction
across thread blocks runs in a fixed order (``use_atomic_add`` stays off, vLLM's default), so
every process rounds a request the same way (a configuration tuned by timing could differ
between processes, and with it a request's rounding); a step at a fixed row count
(the batched step's 16 rows) computes each row the same whatever the others hold.

Quantisation: per output channel (one scale a weight row, ``amax / 448``), once, when the step
is built, from the layer's bf16 weight, which stays where it is: prefill, the eager fallbacks,
the unquantised step modes and LoRA still read it, so the copies cost half the bf16 bytes of the
layers they cover (``Fp8Linears.nbytes``). A copy remembers its source's storage and version and
is made again when the weight was replaced or written (sleep level 2 and wake-up, an update).
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from . import gemv, stats
from .reasons import Reason

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # largest finite e4m3fn value

NO_FP8 = Reason("FP8 weights unavailable",
                "a CUDA GPU with FP8 support: weight-only FP8 (decode steps, vLLM's Marlin GEMM) "
                "needs compute capability 8.0 or newer and a CUDA build of vllm, W8A8 GEMMs "
                "(denoising steps) 8.9 or newer (Ada, Hopper); meanwhile the path reads its bf16 "
                "weights")
LAYER_KEPT = Reason("layer kept in bf16",
                    "nothing to change for LoRA: an adapter's layer runs its own bf16 kernel. "
                    "FP8 copies cover unquantised vllm linear layers without active LoRA "
                    "adapters, hooks or tensor parallelism (the detail names the layer)")
HEAD_KEPT = Reason("lm_head kept in bf16",
                   "FP8 lm_head (VLLM_OMNI_GRAPHDECODE_FP8=...,sensenova_lm_head) reads through the "
                   "one-row FP8 GEMV only: one request at a time (--max-num-seqs 1), on a GPU that "
                   "runs it, with an unquantised, unsharded lm_head and plain logits (no scale, "
                   "soft cap or other head dtype); the detail says which is missing. Meanwhile "
                   "the step's logits come from the bf16 lm_head, as without it")


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


class Fp8Linears:
    """The step's linear layers through FP8 copies: what ``fused_step.Fusion`` calls in place of
    the modules' own GEMMs (``gemv.Gemv``'s interface). ``model``: the stats key's model.

    ``one_row``: the copies serve a one-row step only (no batched step in this process), so they
    are laid out for the one-row GEMV (``fp8_gemv``: faster than Marlin at one row) where the
    GPU runs it; else, and for the batched step's 16 rows, Marlin's layout. One layout per
    process: the two would cost the copies' bytes twice.

    ``quantize(modules)`` makes the copies at load; a call for a layer that cannot use one (a LoRA
    wrapper with an active adapter, a quantised or hooked layer) runs the module itself, counted
    under ``LAYER_KEPT``. Inside a graph that decision is taken once, at capture."""

    def __init__(self, model: str, one_row: bool = False, device="cuda"):
        self.model = model
        self.gemv = False
        self.why_not_gemv = None  # with one_row: why Marlin serves the one row (counted by the hook)
        self._make = Fp8Weight
        if one_row:
            from . import fp8_gemv

            self.why_not_gemv = fp8_gemv.available(device)
            if self.why_not_gemv is None:
                self.gemv, self._make = True, fp8_gemv.Fp8GemvWeight
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
        why = _head_not_copyable(head, processor, self.gemv)
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
        return self._head_copy(hidden_states)

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
        return copy(x)

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
        return down.add_to(up.swiglu(x), residual)

    def mlp_tail(self, module, gate_up, residual):
        """``residual + down_proj(silu(gate) * up)`` as one launch of the one-row GEMV; None
        for Marlin's copies or a layer without a copy (the caller runs the three steps)."""
        if not self.gemv:
            return None
        copy = self._copy_for(module)
        if copy is None:
            return None
        return copy.mlp_tail(gate_up, residual)


def _head_not_copyable(head, processor, one_row_gemv: bool) -> str | None:
    """Why an ``lm_head`` cannot be read through an FP8 copy in the one-row step, or None."""
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
