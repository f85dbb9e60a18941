"""The fused one-token step of SenseNova-U1's decode, for both code layouts (``layouts.py``).

Delete the rope-once part (``rope_kernel``) with the backport layout when vllm-omni < 0.30 is no
longer supported: 0.30's model computes its rope tables once per forward itself.

Why: at batch 1 a SenseNova-U1 decoder layer's four GEMVs read ~380 MB (~90 us at the H200's
bandwidth); around them the 0.24-0.28 model code launches ~50 small kernels (three rope-table
computations of ~10 kernels each, two RMSNorms of 8, SiLU-and-multiply, residual adds), 2-3 us
each even inside a CUDA graph: about half of a graphed step. Measured on the H200
(docs/performance.md, "Where the time goes"): the model's own step ~2,500 kernels a token,
9.9 ms at context 2048; this step 6.14 ms (``benchmarks/results/h200-2026-12-01e/``).

What it does: on 0.24-0.28 the rope tables are computed once per step for all 42 layers
(bit-identical: every layer's tables are the same function of the same index, checked at
construction) and fed to vllm-omni's own qk-norm + rope kernel; on every layout each decoder
layer's norms, residual add and SiLU run through vllm's fused kernels (``layer_ops.LayerOps``).
The linear layers are the modules' own (cuBLAS): the same in every process. With
``VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP=tuned`` they run through Inductor's GEMVs tuned by timing
(``gemv.py``: 5.88 against 6.14 ms/token, but another process may round differently;
LoRA-wrapped or quantised layers stay the module's own), and the MLP's SiLU-and-multiply, down
GEMV and residual add are one compiled kernel (``Gemv.mlp_tail``, rounding differently from the
three kernels, within the GPU test's bound). Against 0.24-0.28's eager code the step keeps the
rounding points (the fp32 sum order differs); 0.30's ``F.rms_norm`` rounds once, after the weight
multiply, so there the fused step rounds differently: ``..._SENSENOVA_STEP=exact`` runs the
model's own modules instead. Everything else (the projections, LoRA wrappers included,
attention) is the model's own modules. Each part has its own availability check;
``Fusion.reasons`` says why a part is off.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from ... import fp8, gemv, layer_ops
from ...reasons import Reason
from . import layouts, ops
from .step import PAGED_KWARG

UNFUSED = Reason("decode step unfused",
                 "a CUDA build of vllm and vllm-omni's Triton qk-norm + rope kernel (see the detail)")


class Fusion:
    """What the decode step fuses for this model on this device, and why not where it does not.

    ``rope_kernel``: vllm-omni's own qk-norm + rope kernel, fed tables computed once per step, or
    None (each layer computes its own, as the model does). ``layer_ops``: ``layer_ops.LayerOps``
    or None (the model's own norms and activation). ``reasons``: why a part is off.
    """

    def __init__(self, rope_kernel=None, layer_ops_=None, reasons=(), gemv_=None):
        self.rope_kernel = rope_kernel
        self.layer_ops = layer_ops_
        self.gemv = gemv_
        self.reasons = list(reasons)

    @property
    def active(self) -> bool:
        return (self.rope_kernel is not None or self.layer_ops is not None
                or self.gemv is not None)

    def linear(self, module, x):
        """``module``'s output for the step's one token: through the compiled GEMV when there
        is one (``gemv.py``), else the module's own forward."""
        if self.gemv is not None:
            return self.gemv(module, x)
        return module(x)[0]

    def mlp_tail(self, down_proj, gate_up, residual):
        """``residual + down_proj(silu(gate) * up)`` as one compiled kernel (``gemv.Gemv``), or
        None where that does not apply (the caller runs the three steps)."""
        if self.gemv is not None:
            return self.gemv.mlp_tail(down_proj, gate_up, residual)
        return None

    @property
    def fp8_head(self):
        """The FP8 copies when they hold an ``lm_head`` copy (``fp8.Fp8Linears.logits``), else
        None: the model's own head computes the step's logits."""
        linears = self.gemv
        return linears if isinstance(linears, fp8.Fp8Linears) and linears.has_head else None

    def projection(self, module):
        """``module`` as the model's code calls a projection (``out, _ = proj(x)``)."""
        return module if self.gemv is None else gemv.Projection(self.gemv, module)

    @classmethod
    def select(cls, language_model, layout: layouts.Layout, device, dtype=torch.bfloat16, *,
               tuned_gemv: bool = False, linears=None):
        """The production parts this device and layout support. ``linears``: the linear layers
        through these (``fp8.Fp8Linears``, from ``fp8_linears``); else with ``tuned_gemv``
        through Inductor's GEMVs tuned by timing (``gemv.py``: faster, but another process may
        round differently); otherwise the modules' own GEMMs."""
        if not layout.fused_step:
            return cls(reasons=[f"{layout.name} layout runs the model's own step"])
        if torch.device(device).type != "cuda":
            return cls(reasons=[f"not CUDA ({device})"])
        fusion = cls()
        rope = _rope_once_kernel(language_model) if layout.rope_per_layer else None
        if isinstance(rope, str):
            fusion.reasons.append(f"rope per layer: {rope}")
        else:
            fusion.rope_kernel = rope
        why = _layers_not_fusable(language_model)
        ops = layer_ops.select_layer_ops(device, dtype) if why is None else None
        if why is not None:
            fusion.reasons.append(f"model's own norms: {why}")
        elif isinstance(ops, Reason):
            fusion.reasons.append(f"model's own norms: {ops.describe()}")
        else:
            fusion.layer_ops = ops
        if linears is not None:
            fusion.gemv = linears
        elif tuned_gemv:
            found = gemv.select_gemv(device)
            if isinstance(found, Reason):
                fusion.reasons.append(f"cuBLAS GEMVs: {found.describe()}")
            else:
                fusion.gemv = found
        return fusion

    def describe(self) -> list[str]:
        parts = []
        if self.rope_kernel is not None:
            parts.append("rope once per step")
        if self.layer_ops is not None:
            parts.append("fused norms + SiLU")
        if isinstance(self.gemv, fp8.Fp8Linears):
            parts.append(self.gemv.describe())
        elif self.gemv is not None:
            parts.append("Inductor GEMVs")
        return parts

    def patch_layers(self, language_model, patches=None) -> None:
        """Give every decoder layer its fused one-token variant (idempotent; inert without
        ``PAGED_KWARG`` or when the step's fusion has no layer ops). ``patches``: as
        ``step.patch_attention``."""
        for layer in language_model.model.layers:
            current = layer._forward_und
            if not getattr(current, "__graphdecode__", False):
                patched = _fused_layer_forward_und(layer, current)
                if patches is not None:
                    patches.set(layer, "_forward_und", patched)
                else:
                    layer._forward_und = patched

    def project_and_rope(self, attn, hidden_states, indexes, step):
        """The backport layout's ``_project_and_rope`` on its fused-kernel path, with the tables
        the first layer of this step computed for all."""
        if step.rope is None:
            step.rope = _rope_tables(attn, hidden_states, indexes)
        return _project_and_rope_once(attn, hidden_states, step.rope, self.rope_kernel,
                                      self.projection(attn.qkv_proj))


def fp8_linears(language_model, device, model: str, one_row: bool = False,
                lm_head: bool = False):
    """``(fp8.Fp8Linears or None, why not / what stays bf16)``: e4m3 copies of every decoder
    layer's qkv, o, gate-up and down projections (what a decode step reads), made now.
    ``one_row``: only the one-request step reads them (``fp8.Fp8Linears``). ``lm_head``: the
    head too, through the one-row GEMV (``fp8.Fp8Linears.quantize_head``; else its reason)."""
    why = fp8.available(device)
    if why is not None:
        return None, [why]
    linears = fp8.Fp8Linears(model, one_row=one_row, device=device)
    modules = {}
    attns = layouts.attention_modules(language_model)
    for i, (layer, attn) in enumerate(zip(language_model.model.layers, attns)):
        for name, module in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj),
                             ("down_proj", layer.mlp.down_proj)):
            modules[f"layers.{i}.{name}"] = gemv.base_of_inactive_lora(module)
    kept = linears.quantize(modules)
    if not len(linears):
        return None, [fp8.NO_FP8.because(f"no layer can take a copy ({', '.join(kept[:3])} ...)")]
    more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
    why = [fp8.LAYER_KEPT.because(", ".join(kept[:3]) + more)] if kept else []
    if linears.why_not_gemv is not None:
        why.append(linears.why_not_gemv)
    if lm_head:
        if not _takes(language_model, "compute_logits"):
            why.append(fp8.HEAD_KEPT.because(
                f"{type(language_model).__name__}.forward takes no compute_logits"))
        else:
            kept_head = linears.quantize_head(language_model)
            if kept_head is not None:
                why.append(kept_head)
    return linears, why


def _takes(module, name: str) -> bool:
    try:
        return name in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


_ROPE_ATTRS = ("q_size", "kv_size", "num_heads", "num_kv_heads", "head_dim", "config",
               "rotary_emb", "rotary_emb_hw")


def _rope_once_kernel(language_model, kernel=None):
    """vllm-omni's fused qk-norm + rope function (or ``kernel``), when one set of rope tables
    serves every layer; else why not (a string)."""
    attns = layouts.attention_modules(language_model)
    first = attns[0]
    missing = [a for a in _ROPE_ATTRS if not hasattr(first, a)]
    if missing:
        return f"attention lacks {', '.join(missing)}"
    if not hasattr(first.config, "rms_norm_eps"):
        return "config lacks rms_norm_eps"
    for name in ("rotary_emb", "rotary_emb_hw"):
        ref = getattr(first, name)
        if not torch.is_tensor(getattr(ref, "inv_freq", None)):
            return f"{name} has no inv_freq"
        for attn in attns[1:]:
            mod = getattr(attn, name, None)
            if (type(mod) is not type(ref) or "forward" in vars(mod)
                    or getattr(mod, "attention_scaling", None)
                    != getattr(ref, "attention_scaling", None)
                    or not torch.equal(mod.inv_freq, ref.inv_freq)):
                return f"layer {attn.layer_idx}'s {name} differs from layer 0's"
    if kernel is not None:
        return kernel
    package = type(first).__module__.rpartition(".")[0]
    try:
        return importlib.import_module(f"{package}.fused_rmsnorm_rope").triton_qk_norm_rope
    except (ImportError, AttributeError) as exc:
        return f"vllm-omni's fused qk-norm + rope kernel not importable ({exc!r})"


def _rope_tables(attn, hidden_states, indexes):
    """(cos, sin) for the t, h and w rope of this token: what ``_project_and_rope`` computes in
    every layer, computed the same way once (``ops.rope_tables``)."""
    return ops.rope_tables(attn.rotary_emb, attn.rotary_emb_hw, hidden_states, indexes)


def _project_and_rope_once(attn, hidden_states, rope, rope_kernel, qkv_proj=None):
    """The backport layout's ``_project_and_rope`` on its fused-kernel path, with given tables."""
    shape = hidden_states.shape[:-1]
    qkv, _ = (qkv_proj or attn.qkv_proj)(hidden_states)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(*shape, attn.num_heads, attn.head_dim)
    k = k.view(*shape, attn.num_kv_heads, attn.head_dim)
    v = v.view(*shape, attn.num_kv_heads, attn.head_dim)
    (cos_t, sin_t), (cos_h, sin_h), (cos_w, sin_w) = rope
    query, key = rope_kernel(q, k, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm_hw.weight,
                             attn.k_norm_hw.weight, cos_t, sin_t, cos_h, sin_h, cos_w, sin_w,
                             attn.config.rms_norm_eps)
    return query, key, v.transpose(1, 2)


def _layers_not_fusable(language_model) -> str | None:
    for i, layer in enumerate(language_model.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name, None)
            if not (torch.is_tensor(getattr(norm, "weight", None))
                    and isinstance(getattr(norm, "variance_epsilon", None), float)):
                return f"layer {i}'s {name} is not an RMSNorm with weight and variance_epsilon"
            if norm._forward_hooks or norm._forward_pre_hooks:
                return f"layer {i}'s {name} has forward hooks"
        mlp = getattr(layer, "mlp", None)
        if not all(hasattr(mlp, a) for a in ("gate_up_proj", "down_proj", "act_fn")):
            return f"layer {i}'s mlp lacks gate_up_proj, down_proj or act_fn"
        if not _is_silu(mlp.act_fn):
            return f"layer {i}'s activation is {type(mlp.act_fn).__name__}, not SiLU"
        if "forward" in vars(mlp) or mlp._forward_hooks or mlp._forward_pre_hooks:
            return f"layer {i}'s mlp forward is replaced or hooked"
    return None


def _is_silu(act) -> bool:
    """torch's SiLU, or transformers' ``SiLUActivation`` (what ``ACT2FN["silu"]`` gives), with
    its forward not replaced."""
    return ((isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation")
            and "forward" not in vars(act))


def _fused_layer_forward_und(layer, original):
    @functools.wraps(original)
    def _forward_und(hidden_states, indexes, attention_mask, past_key_values, **kwargs):
        step = kwargs.get(PAGED_KWARG)
        ops = step.fusion.layer_ops if step is not None and step.fusion is not None else None
        if ops is None:
            return original(hidden_states, indexes, attention_mask, past_key_values, **kwargs)
        ln1, ln2, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
        x = ops.rms_norm(hidden_states, ln1.weight, ln1.variance_epsilon)
        x = layer.self_attn(x, image_gen_indicators=None, exist_und=True, exist_gen=False,
                            indexes=indexes, attention_mask=attention_mask,
                            past_key_values=past_key_values, **kwargs)
        # hidden_states <- hidden_states + x (the residual stream), x <- its post-attention norm.
        # hidden_states is this step's own tensor: the embedding or the previous layer's output.
        ops.add_rms_norm_(x, hidden_states, ln2.weight, ln2.variance_epsilon)
        gate_up = step.fusion.linear(mlp.gate_up_proj, x)
        fused = step.fusion.mlp_tail(mlp.down_proj, gate_up, hidden_states)
        if fused is not None:
            return fused
        out = step.fusion.linear(mlp.down_proj, ops.silu_and_mul(gate_up))
        return hidden_states + out

    _forward_und.__graphdecode__ = True
    return _forward_und
