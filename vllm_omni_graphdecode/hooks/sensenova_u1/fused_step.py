"""The fused one-token step of SenseNova-U1's decode, for both code layouts (``layouts.py``).

Delete the rope-once part (``rope_kernel``) with the backport layout when vllm-omni < 0.30 is no
longer supported: 0.30's model computes its rope tables once per forward itself.

Why: at batch 1 a SenseNova-U1 decoder layer's four GEMVs read ~380 MB (~90 us at the H200's
bandwidth); around them the 0.24-0.28 model code launches ~50 small kernels (three rope-table
computations of ~10 kernels each, two RMSNorms of 8, SiLU-and-multiply, residual adds), 2-3 us
each even inside a CUDA graph: about half of a graphed step. Measured on the H200
(docs/performance-history.md, "The decode step, change by change"): the model's own step
~2,500 kernels a token,
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
import weakref

import torch

from ...core.reasons import Reason
from ...ops import gemv, layer_ops
from ...ops.fp8 import marlin, quant
from ...ops.fp8.linears import HEAD_KEPT, LAYER_KEPT, Fp8Linears
from . import gemv_table, layouts, ops, rope_store
from .step_args import FOLDED, PAGED_KWARG

UNFUSED = Reason("decode step unfused",
                 "a CUDA build of vllm and vllm-omni's Triton qk-norm + rope kernel (see the detail)")


class Fusion:
    """What the decode step fuses for this model on this device, and why not where it does not.

    ``rope_kernel``: vllm-omni's own qk-norm + rope kernel, fed tables computed once per step, or
    None (each layer computes its own, as the model does). ``layer_ops``: ``layer_ops.LayerOps``
    or None (the model's own norms and activation). ``reasons``: why a part is off.
    """

    def __init__(self, rope_kernel=None, layer_ops_=None, reasons=(), gemv_=None,
                 rope_store_=None, tables_from_forward=False):
        self.rope_kernel = rope_kernel
        self.layer_ops = layer_ops_
        self.gemv = gemv_
        # ``rope_store.qk_norm_rope_store`` (q/k norm + rope and the K/V write as one launch) or
        # None; its rope tables come from the model's forward (0.30) or from ``step.rope``.
        self.rope_store = rope_store_
        self.tables_from_forward = tables_from_forward
        self.reasons = list(reasons)

    @property
    def active(self) -> bool:
        return (self.rope_kernel is not None or self.layer_ops is not None
                or self.gemv is not None or self.rope_store is not None)

    def linear(self, module, x):
        """``module``'s output for the step's one token: through the compiled GEMV when there
        is one (``gemv.py``), else the module's own forward."""
        if self.gemv is not None:
            return self.gemv(module, x)
        return module(x)[0]

    def swiglu_mlp(self, mlp, x, residual):
        """``residual + mlp(x)`` in two launches where the FP8 one-row GEMV serves both of its
        layers (``linears.Fp8Linears.swiglu_mlp``), else None (the caller runs its steps)."""
        fn = getattr(self.gemv, "swiglu_mlp", None)
        return None if fn is None else fn(mlp.gate_up_proj, mlp.down_proj, x, residual)

    @property
    def folds_norms(self) -> bool:
        """Whether the step's linears compute the RMSNorms in their o_proj and down launches
        (``row_linears.RowLinears.add_norm`` / ``swiglu_mlp_norm``)."""
        return bool(getattr(self.gemv, "fold_norms", False)) and self.layer_ops is not None

    def attention_out(self, module, out, step):
        """The attention's o_proj for ``out``: where the layer handed its residual and
        post-attention norm (``StepArgs.attn_norm``) and the linears fold them, the residual is
        updated in place and the norm returned (``attn_norm`` becomes ``FOLDED``); else the
        projection (``linear``)."""
        pending = step.attn_norm
        if pending is not None and pending is not FOLDED:
            residual, norm = pending
            normed = self.gemv.add_norm(module, out, residual, norm.weight,
                                        norm.variance_epsilon)
            if normed is not None:
                step.attn_norm = FOLDED
                return normed
        return self.linear(module, out)

    def swiglu_mlp_norm(self, mlp, x, residual, norm):
        """``(residual + mlp(x), norm(that))`` in two launches, or None (the caller runs
        ``swiglu_mlp`` and the next layer its own norm)."""
        fn = getattr(self.gemv, "swiglu_mlp_norm", None)
        if fn is None or not self.folds_norms:
            return None
        return fn(mlp.gate_up_proj, mlp.down_proj, x, residual, norm.weight,
                  norm.variance_epsilon)

    def mlp_tail(self, down_proj, gate_up, residual):
        """``residual + down_proj(silu(gate) * up)`` as one compiled kernel (``gemv.Gemv``), or
        None where that does not apply (the caller runs the three steps)."""
        if self.gemv is not None:
            return self.gemv.mlp_tail(down_proj, gate_up, residual)
        return None

    @property
    def linear_head(self):
        """The step's linears when they compute the logits too (an FP8 ``lm_head`` copy,
        ``linears.Fp8Linears.logits``, or the bf16 row GEMV on the head,
        ``row_linears.RowLinears.logits``), else None: the model's own head computes them."""
        return self.gemv if getattr(self.gemv, "has_head", False) else None

    def projection(self, module):
        """``module`` as the model's code calls a projection (``out, _ = proj(x)``)."""
        return module if self.gemv is None else gemv.Projection(self.gemv, module)

    @classmethod
    def select(cls, language_model, layout: layouts.Layout, device, dtype=torch.bfloat16, *,
               tuned_gemv: bool = False, linears=None):
        """The production parts this device and layout support. ``linears``: the linear layers
        through these (``linears.Fp8Linears``, from ``fp8_linears``, or the bf16 row GEMV's
        ``row_linears.RowLinears``); else with ``tuned_gemv``
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
        store = _select_rope_store(language_model, layout, fusion, device, dtype)
        if isinstance(store, Reason):
            fusion.reasons.append(store.describe())
        else:
            fusion.rope_store = store
            fusion.tables_from_forward = not layout.rope_per_layer
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
        if self.rope_store is not None:
            parts.append("q/k rope + K/V write in one launch")
        if self.layer_ops is not None:
            parts.append("fused norms + SiLU")
        if callable(getattr(self.gemv, "describe", None)):  # FP8 copies, the bf16 row GEMV
            parts.append(self.gemv.describe())
        elif self.gemv is not None:
            parts.append("Inductor GEMVs")
        return parts

    def patch_layers(self, language_model, patches=None) -> None:
        """Give every decoder layer its fused one-token variant (idempotent; inert without
        ``PAGED_KWARG`` or when the step's fusion has no layer ops). ``patches``: as
        ``step.patch_attention``."""
        layers = list(language_model.model.layers)
        for i, layer in enumerate(layers):
            current = layer._forward_und
            if not getattr(current, "__graphdecode__", False):
                following = weakref.ref(layers[i + 1]) if i + 1 < len(layers) else None
                patched = _fused_layer_forward_und(layer, current, following)
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

    def project_rope_store(self, attn, hidden_states, rope_input, step):
        """The qkv projection, then q/k norm + rope with this step's K/V written at the
        cache's slot in the same launch (``rope_store``); returns the query ``(rows, q_heads,
        head_dim)`` for ``cache.attend_stored``. ``rope_input``: what the layout hands
        ``_project_and_rope`` (``Layout.rope_input``): 0.30's forward's rope tables, or
        0.24-0.28's indexes, from which the first layer of this step computes them for all."""
        if self.tables_from_forward:
            tables = rope_input
        else:
            if step.rope is None:
                step.rope = _rope_tables(attn, hidden_states, rope_input)
            tables = step.rope
        qkv, _ = self.projection(attn.qkv_proj)(hidden_states)
        k_cache, v_cache, slot = step.cache.store_target(attn.layer_idx)
        return self.rope_store(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                               _norm_weights(attn), tables, attn.config.rms_norm_eps,
                               k_cache, v_cache, slot)


def fp8_linears(language_model, device, model: str, one_row: bool = False,
                lm_head: bool = False):
    """``(linears.Fp8Linears or None, why not / what stays bf16)``: e4m3 copies of every decoder
    layer's qkv, o, gate-up and down projections (what a decode step reads), made now.
    ``one_row``: only the one-request step reads them (``linears.Fp8Linears``). ``lm_head``: the
    head too, through the one-row GEMV (``linears.Fp8Linears.quantize_head``; else its reason)."""
    why = marlin.available(device)
    if why is not None:
        return None, [why]
    linears = Fp8Linears(model, one_row=one_row, device=device,
                                     gemv_table=gemv_table.MEASURED)
    modules = {}
    attns = layouts.attention_modules(language_model)
    for i, (layer, attn) in enumerate(zip(language_model.model.layers, attns)):
        for name, module in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj),
                             ("down_proj", layer.mlp.down_proj)):
            modules[f"layers.{i}.{name}"] = gemv.base_of_inactive_lora(module)
    kept = linears.quantize(modules)
    if not len(linears):
        return None, [quant.NO_FP8.because(f"no layer can take a copy ({', '.join(kept[:3])} ...)")]
    more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
    why = [LAYER_KEPT.because(", ".join(kept[:3]) + more)] if kept else []
    if linears.why_not_gemv is not None:
        why.append(linears.why_not_gemv)
    if lm_head:
        if not _takes(language_model, "compute_logits"):
            why.append(HEAD_KEPT.because(
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


def _norm_weights(attn):
    return attn.q_norm.weight, attn.k_norm.weight, attn.q_norm_hw.weight, attn.k_norm_hw.weight


def _select_rope_store(language_model, layout, fusion, device, dtype):
    """``rope_store.qk_norm_rope_store`` when every attention layer fits its contract and it
    agrees with the model's formula (``ops.qk_norm_rope``) on this device; else the Reason."""
    if layout.rope_per_layer and fusion.rope_kernel is None:
        # It takes one set of tables for every layer: this layout computes them per layer
        # unless the rope-once part could be wired (its reason is beside this one).
        return rope_store.NO_ROPE_STORE.because("the rope tables are not computed once per step")
    attns = layouts.attention_modules(language_model)
    first = attns[0]
    why = rope_store.why_not(first.head_dim, dtype, dtype, device)
    if why is not None:
        return why
    half = first.head_dim // 2
    for attn in attns:
        weights = _norm_weights(attn)
        if (attn.q_size != attn.num_heads * attn.head_dim
                or attn.kv_size != attn.num_kv_heads * attn.head_dim
                or not isinstance(getattr(attn.config, "rms_norm_eps", None), float)
                or any(not torch.is_tensor(w) or w.shape != (half,) for w in weights)):
            return rope_store.NO_ROPE_STORE.because(
                f"layer {attn.layer_idx}'s q/k norms or head sizes differ from the model's "
                f"_project_and_rope contract")
    try:
        with torch.inference_mode():
            return _checked_rope_store(first, device, dtype)
    except Exception as exc:
        return rope_store.NO_ROPE_STORE.because(f"running it on {device}: {exc!r}"[:300])


def _checked_rope_store(attn, device, dtype):
    """The kernel, run once on random rows with ``attn``'s own norm weights against the
    model's formula in plain torch (``ops.qk_norm_rope``, which rounds its rope in bf16 where
    the kernel rounds once: within 2 bf16 units of the largest value), or the Reason."""
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = 2
    qkv = torch.randn(1, rows, (heads + 2 * kv_heads) * d, generator=gen).to(device, dtype)
    angles = [torch.randn(1, rows, n, generator=gen).to(device) for n in (d // 2, d // 4, d // 4)]
    tables = tuple((a.cos().to(dtype), a.sin().to(dtype)) for a in angles)
    k_cache = torch.zeros(2, 16, kv_heads, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slot = torch.tensor([3, 21], device=device)
    eps = attn.config.rms_norm_eps
    query = rope_store.qk_norm_rope_store(qkv, heads, kv_heads, d, _norm_weights(attn), tables,
                                          eps, k_cache, v_cache, slot)
    q, k, v = qkv.view(1, rows, -1, d).split([heads, kv_heads, kv_heads], dim=2)
    want_q, want_k = ops.qk_norm_rope(q, k, *_norm_weights(attn), tables, eps, cast_chain=True)
    got_k = k_cache.view(-1, kv_heads, d)[slot]
    got_v = v_cache.view(-1, kv_heads, d)[slot]
    scale = max(float(want_q.abs().max()), float(want_k.abs().max()), 1.0)
    bad = [name for name, got, want in (("query", query, want_q[0]), ("key", got_k, want_k[0]))
           if float((got.float() - want.float()).abs().max()) > 2 * 2.0 ** -7 * scale]
    if not torch.equal(got_v, v[0]):
        bad.append("value")
    if int(torch.count_nonzero(k_cache)) != int(torch.count_nonzero(got_k)):
        bad.append("key written outside its slot")
    if bad:
        return rope_store.NO_ROPE_STORE.because("disagrees with the model's formula: "
                                                + ", ".join(bad))
    return rope_store.qk_norm_rope_store


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


def _fused_layer_forward_und(layer, original, following=None):
    """``following``: a weak reference to the next decoder layer (None for the last), whose
    input norm this layer's down launch computes where the step's linears fold norms."""
    @functools.wraps(original)
    def _forward_und(hidden_states, indexes, attention_mask, past_key_values, **kwargs):
        step = kwargs.get(PAGED_KWARG)
        ops = step.fusion.layer_ops if step is not None and step.fusion is not None else None
        if ops is None:
            return original(hidden_states, indexes, attention_mask, past_key_values, **kwargs)
        ln1, ln2, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
        handed, step.normed = step.normed, None
        if handed is not None and handed[0] is hidden_states:
            x = handed[1]  # the previous layer's down launch normalised this layer's input
        else:
            x = ops.rms_norm(hidden_states, ln1.weight, ln1.variance_epsilon)
        fold = step.fusion.folds_norms
        # hidden_states is this step's own tensor: the embedding or the previous layer's output.
        step.attn_norm = (hidden_states, ln2) if fold else None
        x = layer.self_attn(x, image_gen_indicators=None, exist_und=True, exist_gen=False,
                            indexes=indexes, attention_mask=attention_mask,
                            past_key_values=past_key_values, **kwargs)
        folded, step.attn_norm = step.attn_norm is FOLDED, None
        if not folded:
            # hidden_states <- hidden_states + x (the residual stream), x <- its
            # post-attention norm (the o_proj launch did both where ``folded``).
            ops.add_rms_norm_(x, hidden_states, ln2.weight, ln2.variance_epsilon)
        nxt = following() if fold and following is not None else None
        if nxt is not None and getattr(nxt._forward_und, "__graphdecode__", False):
            got = step.fusion.swiglu_mlp_norm(mlp, x, hidden_states, nxt.input_layernorm)
            if got is not None:
                step.normed = got
                return got[0]
        fused = step.fusion.swiglu_mlp(mlp, x, hidden_states)
        if fused is not None:
            return fused
        gate_up = step.fusion.linear(mlp.gate_up_proj, x)
        fused = step.fusion.mlp_tail(mlp.down_proj, gate_up, hidden_states)
        if fused is not None:
            return fused
        out = step.fusion.linear(mlp.down_proj, ops.silu_and_mul(gate_up))
        return hidden_states + out

    _forward_und.__graphdecode__ = True
    return _forward_und
