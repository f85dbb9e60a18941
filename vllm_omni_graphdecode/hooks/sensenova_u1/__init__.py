"""SenseNova-U1: think and text decode through paged K/V and one CUDA graph per length bucket.

Why: SenseNova-U1 decodes its think text (before an image) and its text answers one token per
``language_model`` call inside the pipeline's own loop, with a ``DynamicCache`` that grows by
``torch.cat``. Measured on an H200 with vllm-omni 0.26 (FACTS §4): 55.0 ms/token at context 512
and 58.5 ms/token at 2048, about 14x the time needed to read the weights a token uses once; a
1024-token think then costs ~56 s. Upstream measured the same change on an A800 as think decode
16.1 s eager -> 6.2 s paged -> 3.5 s paged + graph.

What this wires, per pipeline, at load (``loading`` calls ``wire``):

- each attention layer's ``forward_und`` gets a single-token branch keyed on our own keyword
  (``PAGED_KWARG``): it projects and ropes as before, then attends through
  ``paged_decode.PagedKVCache``. The branch is keyed on the keyword, not on ``attention_mask is
  None``: vllm-omni 0.24-0.28 pass an all-zeros mask for one query token;
- on 0.24-0.28 each decoder layer's ``_forward_und`` gets a fused one-token variant under the same
  keyword (``Fusion``: rope tables once per step, vllm's fused RMSNorm / add+RMSNorm / SiLU-and-
  multiply, one-kernel K/V write), which halves the kernels a graphed step launches;
- ``_generate_think`` / ``_generate_text`` open a decode session from the prefill cache,
  ``_ar_step`` runs through it, and ``_append_text_tokens_to_cache`` (the think path's next reader
  of the cache) first gets the decoded K/V written back;
- ``release_captured_graphs`` on the pipeline, reached at sleep level 2 (0.30's runner calls it;
  on 0.24-0.28 through the runner's ``graph_runners.clear()``, the only call those workers make);
- pre-capture of the first buckets at load, so the first think request pays no capture.

Every request that cannot take the fast path runs the pipeline's own code unchanged, with its
reason counted in ``stats`` and logged once (see ``RULES``). One sequence per pipeline: a second
request entering a decode loop while one is active runs eagerly ("another request is decoding
on this pipeline") instead of sharing the buffers.

vllm-omni 0.30 ships its own paged decode (``_decode_context``). By default this hook defers to
it and wires nothing; with ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE=takeover`` the in-tree
context is replaced by one that returns None (so it cannot run too) and this hook's path runs.

Counted in ``stats`` under "sensenova_u1": ``paged_request`` (sessions opened), ``capture``,
``replay``, ``paged_eager_step`` (paged step without a graph), ``eager_step`` (a step of the
pipeline's own decode), ``lora_request`` (graphs captured for one request only), ``verified`` /
``verify_mismatch``, and each fallback by its reason.

Scope: batch 1, greedy or sampled (the loops' own sampling runs on the returned logits), TP 1.
Delete the backport half when vllm-omni < 0.30 is no longer supported, and the takeover half when
the in-tree path selects FA3 on Hopper itself.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import sys
import threading
import time

import torch

from ... import kernels, paged_decode, stats
from .. import HookRefused, check_signature

MODEL = "sensenova_u1"
# Our own keyword down the model's **kwargs chain (ForCausalLM -> Model -> DecoderLayer ->
# Attention.forward -> forward_und; FACTS §1). Upstream 0.30 uses "paged_cache"; never collide.
PAGED_KWARG = "graphdecode_paged_kv"
_STATE_ATTR = "_graphdecode_sensenova_u1"

logger = stats.logger


# --------------------------------------------------------------------------------------------
# Versions: the one place where vllm-omni releases differ for this hook.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    versions: str
    # second parameter of SenseNovaU1Attention._project_and_rope, and where forward_und finds it
    rope_param: str
    # the pipeline has vllm-omni's own paged decode (_decode_context, release_captured_graphs)
    in_tree: bool
    # the decode step computes the rope tables once for all layers and runs the decoder layer's
    # norms and SiLU through fused kernels (the in-tree layout already computes rope once per
    # forward and uses F.rms_norm, whose rounding differs from vllm's ops: left as it is)
    fused_step: bool


    def rope_input(self, indexes, kwargs):
        return indexes if self.rope_param == "indexes" else kwargs[self.rope_param]


LAYOUTS = (
    Layout("backport", "vllm-omni 0.24, 0.26, 0.28", rope_param="indexes", in_tree=False,
           fused_step=True),
    Layout("in-tree", "vllm-omni 0.30", rope_param="position_embeddings", in_tree=True,
           fused_step=False),
)

# Leading parameters of everything patched or called, identical across LAYOUTS (0.30's _ar_step
# adds a trailing `decode`, which the wrapper passes through).
PIPELINE_METHODS = {
    "_generate_think": ("self", "prefix_outputs", "past_key_values", "t_idx"),
    "_generate_text": ("self", "prefix_logits", "past_key_values", "t_idx"),
    "_ar_step": ("self", "next_token", "t_idx", "past_key_values"),
    "_append_text_tokens_to_cache": ("self", "cache", "t_idx", "input_ids"),
}
LM_FORWARD = ("self", "input_ids", "indexes", "attention_mask", "past_key_values",
              "inputs_embeds", "use_cache")
FORWARD_UND = ("self", "hidden_states", "indexes", "attention_mask", "past_key_values")
ATTN_ATTRS = ("qkv_proj", "q_norm", "k_norm", "q_norm_hw", "k_norm_hw", "o_proj", "layer_idx",
              "scaling", "head_dim", "num_kv_heads")


def support() -> dict[str, str]:
    done = "think + text decode: paged K/V + CUDA graph per bucket (backport)"
    return {
        "0.24": done,
        "0.26": done,
        "0.28": done,
        "0.30": ("in-tree paged decode present: defer (default) leaves it in charge; "
                 "takeover replaces its decode context with this plugin's (FA3 on Hopper)"),
    }


def detect_layout(language_model, pipeline_cls=None) -> Layout:
    """The layout of this model (and pipeline class, when given), or HookRefused."""
    attn = _attention_modules(language_model)[0]
    try:
        params = list(inspect.signature(type(attn)._project_and_rope).parameters)
    except (AttributeError, TypeError, ValueError):
        raise HookRefused(f"{type(attn).__qualname__}._project_and_rope not found") from None
    rope_param = params[2] if len(params) > 2 else None
    in_tree = pipeline_cls is not None and hasattr(pipeline_cls, "_decode_context")
    for layout in LAYOUTS:
        if layout.rope_param == rope_param and (pipeline_cls is None or layout.in_tree == in_tree):
            return layout
    raise HookRefused(
        f"unknown SenseNova-U1 layout: _project_and_rope({', '.join(params)}), "
        f"_decode_context {'present' if in_tree else 'absent'}; known: "
        + "; ".join(f"{l.versions} ({l.rope_param}, in-tree {l.in_tree})" for l in LAYOUTS))


def _attention_modules(language_model) -> list:
    layers = getattr(getattr(language_model, "model", None), "layers", None)
    if not layers:
        raise HookRefused(f"{type(language_model).__qualname__} has no model.layers")
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    if any(a is None for a in attns):
        raise HookRefused("a decoder layer has no self_attn")
    return attns


def _takes_var_kwargs(fn) -> bool:
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD
                   for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def _check_model(language_model, layout: Layout) -> None:
    """Everything the paged branch and the decode step touch, checked before any patch."""
    check_signature(type(language_model), "forward", LM_FORWARD)
    model = language_model.model
    layer = model.layers[0]
    chain = [(type(model), "forward"), (type(layer), "forward"), (type(layer), "_forward_und"),
             (type(layer.self_attn), "forward"), (type(layer.self_attn), "forward_und")]
    for owner, name in chain:
        fn = getattr(owner, name, None)
        if fn is None or not _takes_var_kwargs(fn):
            raise HookRefused(f"{owner.__qualname__}.{name} no longer passes **kwargs through, so "
                              f"the paged cache cannot reach attention")
    for attn in _attention_modules(language_model):
        cls = type(attn)
        check_signature(cls, "forward_und", FORWARD_UND)
        check_signature(cls, "_project_and_rope",
                        ("self", "hidden_states", layout.rope_param, "qkv_proj", "q_norm",
                         "k_norm", "q_norm_hw", "k_norm_hw"))
        missing = [a for a in ATTN_ATTRS if not hasattr(attn, a)]
        if missing:
            raise HookRefused(f"{cls.__qualname__} lacks {', '.join(missing)}")
    if _output_class(language_model) is None:
        raise HookRefused(f"{type(language_model).__module__} has no SenseNovaU1CausalLMOutput")


def _output_class(language_model):
    module = sys.modules.get(type(language_model).__module__)
    return getattr(module, "SenseNovaU1CausalLMOutput", None)


# --------------------------------------------------------------------------------------------
# Eligibility: each rule answers why not, with its own reason string.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Refusal:
    reason: str
    hint: str
    detail: str = ""


TP = "tensor parallel > 1"
OFFLOAD = "CPU or layerwise offload"
COMPILED = "language model is torch.compile'd"
KV_QUANT = "quantized KV cache"
HOOKED = "forward hooks on the language model"
BUSY = "another request is decoding on this pipeline"
OOM = "out of memory allocating paged K/V"
CAPTURE_FAILED = "graph capture failed"
CACHE_SHAPE = "prefix cache is not one bf16/fp16 sequence"


def _rule_kernel(pipe, state):
    k = state.kernel
    if isinstance(k, str):
        return Refusal(str(k), kernels.HINTS.get(str(k), ""), getattr(k, "detail", ""))
    return None


def _rule_tensor_parallel(pipe, state):
    tp = getattr(getattr(getattr(pipe, "od_config", None), "parallel_config", None),
                 "tensor_parallel_size", 1) or 1
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp = max(tp, get_tensor_model_parallel_world_size())
    except Exception:  # no process group in this process: nothing is sharded by vllm
        pass
    if tp > 1:
        return Refusal(TP, "serve SenseNova-U1 with tensor parallel size 1 for graph decode "
                       "(the captured step would hold collectives)", f"tp={tp}")
    return None


_OFFLOAD_FLAGS = ("enable_cpu_offload", "enable_layerwise_offload",
                  "enable_distributed_layerwise_offload")


def _hook_names(module) -> list[str]:
    registry = getattr(module, "_hook_registry", None)  # vllm-omni's HookRegistry
    names = list(getattr(registry, "_hooks", {}) or {})
    if getattr(module, "_hf_hook", None) is not None:  # accelerate
        names.append(type(module._hf_hook).__name__)
    return names


def _rule_offload(pipe, state):
    od = getattr(pipe, "od_config", None)
    flags = [f for f in _OFFLOAD_FLAGS if getattr(od, f, False)]
    if not flags:
        for name, module in state.lm.named_modules():
            found = [h for h in _hook_names(module) if "offload" in h.lower()]
            if found:
                flags.append(f"{found[0]} on {name or 'language_model'}")
                break
    if flags:
        # Offload moves weights between steps: a graph would replay over storage that moved.
        return Refusal(OFFLOAD, "disable --enable-cpu-offload / --enable-layerwise-offload for "
                       "graph decode", ", ".join(flags))
    return None


def _rule_compiled(pipe, state):
    for name, module in state.lm.named_modules():
        compiled = getattr(module, "_compiled_call_impl", None) is not None
        fwd = module.__dict__.get("forward") or module.__dict__.get("_omni_original_forward")
        if compiled or hasattr(fwd, "_torchdynamo_orig_callable") or \
                type(module).__name__ == "OptimizedModule":
            return Refusal(COMPILED, "compile off for SenseNova-U1 (diffusion_compile_granularity="
                           "regional, or --enforce-eager): Dynamo would trace the decode step",
                           name or "language_model")
    return None


def _rule_kv_quant(pipe, state):
    dtype = getattr(getattr(pipe, "od_config", None), "diffusion_kv_cache_dtype", None)
    if dtype in (None, "auto", "float"):
        dtype = next((m._kv_cache_dtype for m in state.lm.modules()
                      if getattr(m, "_kv_cache_dtype", None) not in (None, "auto", "float")), None)
    if dtype is not None:
        return Refusal(KV_QUANT, "unset diffusion_kv_cache_dtype: the paged kernel reads the "
                       "cache unquantized, so its output would differ", f"kv_cache_dtype={dtype}")
    return None


def _replaced_forward(module) -> bool:
    """An instance-level ``forward`` other than vllm-omni's hook dispatcher (cache-dit patches
    blocks this way)."""
    fwd = module.__dict__.get("forward")
    return fwd is not None and type(fwd).__name__ != "_WrappedForward"


def _rule_hooks(pipe, state):
    for name, module in state.lm.named_modules():
        hooks = _hook_names(module)
        if module._forward_hooks or module._forward_pre_hooks:
            hooks.append("torch forward hook")
        if _replaced_forward(module):
            hooks.append("replaced forward")
        if hooks:
            # A hook runs once while a graph is captured and never at replay.
            where = name or "language_model"
            return Refusal(HOOKED, "remove hooks from the language model (cache backends, "
                           "profilers) for graph decode", f"{hooks[0]} on {where}")
    return None


RULES = (_rule_kernel, _rule_tensor_parallel, _rule_offload, _rule_compiled, _rule_kv_quant,
         _rule_hooks)


def _cache_refusal(cache, kernel) -> Refusal | None:
    layers = getattr(cache, "layers", None)
    keys = getattr(layers[0], "keys", None) if layers else None
    if keys is None or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[2] == 0:
        shape = None if keys is None else tuple(keys.shape)
        return Refusal(CACHE_SHAPE, "nothing to change (the pipeline decodes one sequence)",
                       f"keys shape {shape}")
    if kernel.fa_version is not None and keys.dtype not in (torch.float16, torch.bfloat16):
        return Refusal(CACHE_SHAPE, "serve in bf16 or fp16", f"dtype {keys.dtype}")
    return None


def lora_wrappers_present(module) -> bool:
    """True once vllm-omni's LoRA manager has wrapped layers under ``module``.

    The wrappers stay in the tree and switch adapters between requests by Python branches
    (active slices) that a capture freezes, invisibly to shape, dtype and bucket. So nothing
    captured may outlive a request then: graphs are captured per request and dropped after.
    """
    try:
        from vllm.lora.layers import BaseLayerWithLoRA
    except Exception:
        return False
    return any(isinstance(m, BaseLayerWithLoRA) for m in module.modules())


def _is_oom(exc: BaseException | None) -> bool:
    """An allocation failure, also when wrapped (a ``CaptureError`` caused by one)."""
    while exc is not None:
        if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
            return True
        # The CPU allocator raises a plain RuntimeError.
        text = str(exc)
        if isinstance(exc, RuntimeError) and ("out of memory" in text.lower()
                                              or "can't allocate memory" in text):
            return True
        exc = exc.__cause__
    return False


# --------------------------------------------------------------------------------------------
# The decode step (public: the benchmark drives it directly).
# --------------------------------------------------------------------------------------------

class PagedDecoder:
    """SenseNova-U1 single-token decode through ``paged_decode``, given the language model.

    Usage (what the pipeline wrappers do; ``benchmarks/`` times it against the eager loop)::

        dec = PagedDecoder(lm, kernel=kernels.select_kernel("cuda", 128), buckets=(512, 1024))
        dec.begin(past_key_values)            # prefilled DynamicCache, batch 1
        for ...:
            logits = dec.step(token, t_index)  # token: (1,) long tensor or int; t_index: its
                                               # rope time index (the pipeline's t_idx + 1)
        dec.write_back(past_key_values)       # the cache now holds prefix + decoded tokens
        dec.release()

    ``step`` returns ``(1, 1, vocab)`` logits; with graphs this is the graph's static output,
    overwritten by the next step. Patches ``lm``'s attention (``forward_und``) on construction
    (idempotent, inert without ``PAGED_KWARG``).
    """

    def __init__(self, language_model, *, kernel, buckets, graphs: bool = True,
                 verify: bool = False, pool=None, layout: Layout | None = None,
                 fusion: "Fusion | None" = None):
        self.lm = language_model
        self.layout = layout or detect_layout(language_model)
        _check_model(language_model, self.layout)
        patch_attention(language_model, self.layout)
        attn = _attention_modules(language_model)[0]
        self.num_layers = len(language_model.model.layers)
        self.kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.kernel = kernel
        self.buckets = tuple(buckets)
        self.graphs = graphs
        self.verify = verify
        self.pool = pool
        self.device = next(language_model.parameters()).device
        self.cache: paged_decode.PagedKVCache | None = None
        self.runner: paged_decode.DecodeGraphRunner | None = None
        self.input_ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        # rows: t, h, w rope indexes; decode tokens are text, so h = w = 0 (as _ar_step builds)
        self.indexes = torch.zeros(3, 1, dtype=torch.long, device=self.device)
        self.fusion = fusion or Fusion(language_model, self.layout, self.device,
                                       next(language_model.parameters()).dtype)

    @property
    def num_graphs(self) -> int:
        return self.runner.num_graphs if self.runner else 0

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes if self.cache else 0

    def _forward(self) -> torch.Tensor:
        return self.lm(input_ids=self.input_ids, indexes=self.indexes, past_key_values=None,
                       use_cache=False, **{PAGED_KWARG: _Step(self.cache, self.fusion)}).logits

    def _ensure(self, length: int, dtype) -> None:
        if self.cache is not None and self.cache.fits(self.num_layers, self.kv_heads,
                                                      self.head_dim, dtype, self.device):
            return
        self.release()
        self.cache = paged_decode.PagedKVCache(
            self.num_layers, self.kv_heads, self.head_dim, dtype=dtype, device=self.device,
            buckets=self.buckets, kernel=self.kernel, length=length,
            writer=self.fusion.kv_writer)
        self.runner = paged_decode.DecodeGraphRunner(
            self._forward, self.cache, model=MODEL, graphs=self.graphs, verify=self.verify,
            pool=self.pool)

    @torch.inference_mode()
    def begin(self, past_key_values) -> int:
        """Load the prefill cache; returns its length. May raise an OOM (nothing kept)."""
        keys = past_key_values.layers[0].keys
        self._ensure(keys.shape[2] + 1, keys.dtype)
        self.runner.reset()
        return self.cache.load(past_key_values)

    @torch.inference_mode()
    def step(self, token, t_index: int) -> torch.Tensor:
        """Decode ``token`` at rope time index ``t_index``. On an exception (OOM while growing,
        ``paged_decode.CaptureError``) the cache still holds exactly the tokens before it."""
        n = self.cache.length + 1
        self.cache.reserve(n)
        self.cache.set_length(n)
        try:
            if torch.is_tensor(token):
                self.input_ids.copy_(token.reshape(1, 1))
            else:
                self.input_ids.fill_(int(token))
            self.indexes[0].fill_(t_index)
            return self.runner.step()
        except BaseException:
            self.cache.set_length(n - 1)
            raise

    @torch.inference_mode()
    def write_back(self, past_key_values) -> None:
        self.cache.write_back(past_key_values)

    @torch.inference_mode()
    def precapture(self, buckets, dtype) -> float:
        """Allocate for the largest of ``buckets`` and capture each. Returns capture seconds."""
        self._ensure(max(buckets), dtype)
        self.cache.reserve(max(buckets))
        self.cache.set_length(1)  # step 0 writes slot 0; the next load() overwrites it
        seconds = 0.0
        for bucket in sorted(buckets):
            self.cache.reserve(bucket)
            seconds += self.runner.capture()
        return seconds

    def drop_graphs(self) -> None:
        if self.runner is not None:
            self.runner.drop_graphs()

    def release(self) -> None:
        """Drop graphs and buffers (sleep level 2; also before reallocating for a new dtype)."""
        if self.runner is not None:
            self.runner.drop_graphs()
        if self.cache is not None:
            self.cache.release()
        self.runner = None
        self.cache = None


def patch_attention(language_model, layout: Layout) -> None:
    """Give every attention layer the paged single-token branch and every decoder layer its
    fused one-token variant. Idempotent; both are inert without ``PAGED_KWARG``."""
    for attn in _attention_modules(language_model):
        current = attn.forward_und
        if not getattr(current, "__graphdecode__", False):
            attn.forward_und = _paged_forward_und(attn, current, layout)
    if layout.fused_step:
        for layer in language_model.model.layers:
            current = layer._forward_und
            if not getattr(current, "__graphdecode__", False):
                layer._forward_und = _fused_layer_forward_und(layer, current)


def _paged_forward_und(attn, original, layout: Layout):
    @functools.wraps(original)
    def forward_und(hidden_states, indexes, attention_mask, past_key_values=None, **kwargs):
        step = kwargs.get(PAGED_KWARG)
        if step is None:
            return original(hidden_states, indexes, attention_mask, past_key_values, **kwargs)
        # One query token attends to every valid cached key, so the mask (all zeros in 0.24-0.28,
        # None in 0.30) carries nothing and is not read.
        rope_kernel = step.fusion.rope_kernel
        if rope_kernel is not None:
            if step.rope is None:  # the first layer of this step: the tables every layer uses
                step.rope = _rope_tables(attn, hidden_states, indexes)
            query, key, value = _project_and_rope_once(attn, hidden_states, step.rope,
                                                       rope_kernel)
        else:
            query, key, value = attn._project_and_rope(
                hidden_states, layout.rope_input(indexes, kwargs), attn.qkv_proj, attn.q_norm,
                attn.k_norm, attn.q_norm_hw, attn.k_norm_hw)
        out = step.cache.attend(attn.layer_idx, query, key, value, attn.scaling)
        out, _ = attn.o_proj(out.reshape(*hidden_states.shape[:-1], -1))
        return out

    forward_und.__graphdecode__ = True
    return forward_und


# --------------------------------------------------------------------------------------------
# The fused one-token step (backport layout). At batch 1 a SenseNova-U1 decoder layer's four
# GEMVs read ~380 MB (~90 us at the H200's bandwidth); around them the model's Python code
# launches ~50 small kernels (three rope-table computations of ~10 kernels each, two RMSNorms of
# 8, SiLU-and-multiply, residual adds), 2-3 us each even inside a CUDA graph: about half of a
# graphed step. The step computes the rope tables once for all 42 layers (bit-identical: every
# layer's tables are the same function of the same index, checked at construction) and runs the
# layer's norms and activation through vllm's fused kernels (``kernels.LayerOps``; same rounding
# points, fp32 sum order differs). Everything else (the projections, LoRA wrappers included, the
# qk-norm + rope kernel, attention) is the model's own modules.
# --------------------------------------------------------------------------------------------

class _Step:
    """``PAGED_KWARG``'s value for one decode step: the paged cache, what is fused, and the rope
    tables once the first layer has computed them."""

    __slots__ = ("cache", "fusion", "rope")

    def __init__(self, cache, fusion: "Fusion"):
        self.cache = cache
        self.fusion = fusion
        self.rope = None


UNFUSED = "decode step unfused"


class Fusion:
    """What the decode step fuses for this model on this device, and why not where it does not.

    ``rope_kernel``: vllm-omni's own qk-norm + rope kernel, fed tables computed once per step, or
    None (each layer computes its own, as the model does). ``layer_ops``: ``kernels.LayerOps`` or
    None (the model's own norms and activation). ``reasons``: why a part is off.
    """

    def __init__(self, language_model, layout: Layout, device, dtype=torch.bfloat16):
        self.rope_kernel = None
        self.layer_ops = None
        self.kv_writer = None
        self.reasons: list[str] = []
        if torch.device(device).type == "cuda":
            writer = kernels.select_kv_writer(device, dtype)
            if isinstance(writer, kernels.Unavailable):
                self.reasons.append(f"two-kernel K/V write: {writer} ({writer.detail})")
            else:
                self.kv_writer = writer
        if not layout.fused_step:
            self.reasons.append(f"{layout.name} layout runs the model's own step")
            return
        if torch.device(device).type != "cuda":
            self.reasons.append(f"not CUDA ({device})")
            return
        rope = _rope_once_kernel(language_model)
        if isinstance(rope, str):
            self.reasons.append(f"rope per layer: {rope}")
        else:
            self.rope_kernel = rope
        why = _layers_not_fusable(language_model)
        ops = kernels.select_layer_ops(device, dtype) if why is None else None
        if why is not None:
            self.reasons.append(f"model's own norms: {why}")
        elif isinstance(ops, kernels.Unavailable):
            self.reasons.append(f"model's own norms: {ops}" + (f" ({ops.detail})"
                                                               if ops.detail else ""))
        else:
            self.layer_ops = ops

    @classmethod
    def off(cls, reason: str = "turned off") -> "Fusion":
        """The model's own step (tests compare the fused step with it)."""
        fusion = cls.__new__(cls)
        fusion.rope_kernel, fusion.layer_ops, fusion.kv_writer = None, None, None
        fusion.reasons = [reason]
        return fusion

    @classmethod
    def reference(cls, language_model) -> "Fusion":
        """The fused step's structure with plain-torch kernels, on any device (tests, CPU)."""
        fusion = cls.off()
        fusion.reasons = []
        fusion.rope_kernel = kernels.reference_qk_norm_rope
        fusion.layer_ops = kernels.REFERENCE_LAYER_OPS
        why = _rope_once_kernel(language_model, kernel=kernels.reference_qk_norm_rope)
        if isinstance(why, str):
            raise HookRefused(f"rope once per step: {why}")
        why = _layers_not_fusable(language_model)
        if why is not None:
            raise HookRefused(f"fused norms: {why}")
        return fusion

    def describe(self) -> str:
        parts = []
        if self.rope_kernel is not None:
            parts.append("rope once per step")
        if self.layer_ops is not None:
            parts.append("fused norms + SiLU")
        if self.kv_writer is not None:
            parts.append("one-kernel K/V write")
        done = " + ".join(parts) if parts else "unfused"
        return done + (f" ({'; '.join(self.reasons)})" if self.reasons else "")


_ROPE_ATTRS = ("q_size", "kv_size", "num_heads", "num_kv_heads", "head_dim", "config",
               "rotary_emb", "rotary_emb_hw")


def _rope_once_kernel(language_model, kernel=None):
    """vllm-omni's fused qk-norm + rope function (or ``kernel``), when one set of rope tables
    serves every layer; else why not (a string)."""
    attns = _attention_modules(language_model)
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
    every layer, computed the same way once."""
    return (attn.rotary_emb(hidden_states, indexes[0].unsqueeze(0)),
            attn.rotary_emb_hw(hidden_states, indexes[1].unsqueeze(0)),
            attn.rotary_emb_hw(hidden_states, indexes[2].unsqueeze(0)))


def _project_and_rope_once(attn, hidden_states, rope, rope_kernel):
    """The backport layout's ``_project_and_rope`` on its fused-kernel path, with given tables."""
    shape = hidden_states.shape[:-1]
    qkv, _ = attn.qkv_proj(hidden_states)
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
        ops = step.fusion.layer_ops if step is not None else None
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
        gate_up, _ = mlp.gate_up_proj(x)
        out, _ = mlp.down_proj(ops.silu_and_mul(gate_up))
        return hidden_states + out

    _forward_und.__graphdecode__ = True
    return _forward_und


# --------------------------------------------------------------------------------------------
# Per-pipeline state and per-request sessions.
# --------------------------------------------------------------------------------------------

class _State:
    def __init__(self, pipeline, layout: Layout, cfg, kernel, graphs: bool, fusion: "Fusion"):
        self.pipeline = pipeline
        self.lm = pipeline.language_model
        self.layout = layout
        self.fusion = fusion
        self.cfg = cfg
        self.kernel = kernel
        self.graphs = graphs
        self.lock = threading.Lock()
        self.decoder: PagedDecoder | None = None
        self.session: _Session | None = None
        self.capture_failed: str | None = None  # sticky until release(): capture is retried then

    def static_refusal(self) -> Refusal | None:
        for rule in RULES:
            refusal = rule(self.pipeline, self)
            if refusal is not None:
                return refusal
        if self.capture_failed is not None:
            return Refusal(CAPTURE_FAILED, "report it with the log; sleep level 2 "
                           "(release_captured_graphs) retries capture", self.capture_failed)
        return None

    def _decoder(self) -> PagedDecoder:
        if self.decoder is None:
            self.decoder = PagedDecoder(self.lm, kernel=self.kernel, buckets=self.cfg.buckets,
                                        graphs=self.graphs, verify=self.cfg.verify,
                                        layout=self.layout, fusion=self.fusion)
        return self.decoder

    def open(self, past_key_values, think: bool) -> _Session | None:
        refusal = self.static_refusal() or _cache_refusal(past_key_values, self.kernel)
        if refusal is not None:
            stats.fallback(MODEL, refusal.reason, refusal.hint, refusal.detail)
            return None
        if not self.lock.acquire(blocking=False):
            stats.fallback(MODEL, BUSY, "nothing to change: this pipeline decodes one sequence at "
                           "a time on the paged path; concurrent ones run eagerly")
            return None
        try:
            per_request = lora_wrappers_present(self.lm)
            decoder = self._decoder()
            if per_request:
                # Graphs from an earlier request froze that request's adapter state.
                decoder.drop_graphs()
                stats.count(MODEL, "lora_request")
            decoder.begin(past_key_values)
        except BaseException as exc:
            self.lock.release()
            if not _is_oom(exc):
                raise
            # Under memory pressure keep nothing: the eager request needs room for its cache.
            self._drop_decoder()
            stats.fallback(MODEL, OOM, "lower VLLM_OMNI_GRAPHDECODE_BUCKETS or free device memory",
                           f"{type(exc).__name__}: {str(exc)[:200]}")
            return None
        stats.count(MODEL, "paged_request")
        self.session = _Session(self, past_key_values, decoder, per_request, think)
        return self.session

    def _drop_decoder(self) -> None:
        decoder, self.decoder = self.decoder, None
        if decoder is not None:
            decoder.release()

    def precapture(self) -> str:
        cfg = self.cfg
        if not cfg.precapture:
            return "pre-capture off"
        refusal = self.static_refusal()
        if refusal is not None:
            return f"pre-capture skipped: {refusal.reason}"
        if not self.graphs:
            return "pre-capture skipped: graphs off"
        if lora_wrappers_present(self.lm):
            return "pre-capture skipped: dynamic LoRA wrappers present (graphs are per request)"
        dtype = self.lm.model.layers[0].self_attn.qkv_proj.weight.dtype
        if self.kernel.fa_version is not None and dtype not in (torch.float16, torch.bfloat16):
            return f"pre-capture skipped: {dtype} is not a FlashAttention dtype"
        with self.lock:
            try:
                torch.cuda.synchronize()
                reserved, start = torch.cuda.memory_reserved(), time.perf_counter()
                self._decoder().precapture(cfg.precapture_buckets, dtype)
                torch.cuda.synchronize()
            except Exception as exc:
                self._drop_decoder()
                if _is_oom(exc):
                    stats.fallback(MODEL, OOM, "lower VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS",
                                   f"pre-capture: {str(exc)[:200]}")
                    return f"pre-capture skipped: {OOM}"
                self.capture_failed = str(exc)[:300]
                stats.fallback(MODEL, CAPTURE_FAILED, "report it with the log", self.capture_failed)
                return f"pre-capture failed: {exc}"
            seconds = time.perf_counter() - start
            grown = (torch.cuda.memory_reserved() - reserved) / 2**20
            kv = self.decoder.nbytes / 2**20
        line = (f"pre-captured buckets {','.join(map(str, cfg.precapture_buckets))} in "
                f"{seconds:.2f} s, +{grown:.0f} MiB reserved (paged K/V {kv:.0f} MiB)")
        logger.info("graphdecode: %s %s", MODEL, line)
        return line

    def release(self) -> None:
        """Sleep level 2: drop graphs and buffers. The next request allocates and captures anew."""
        self._drop_decoder()
        self.capture_failed = None


class _Session:
    """One request's decode loop on the paged path. Owns the state's lock until ``close``."""

    def __init__(self, state: _State, cache, decoder: PagedDecoder, per_request: bool,
                 think: bool):
        self.state = state
        self.cache = cache
        self.decoder = decoder
        self.per_request = per_request
        self.think = think
        self.thread = threading.get_ident()
        self.live = True
        self.steps = 0

    def serves(self, cache) -> bool:
        return self.live and cache is self.cache and threading.get_ident() == self.thread

    def step(self, next_token, t_idx):
        """Logits for ``next_token``, or None after handing the request back to the eager path
        (the cache then holds every token decoded so far)."""
        try:
            logits = self.decoder.step(next_token, t_idx + 1)
        except Exception as exc:
            if _is_oom(exc):  # growing the buffers, or allocating inside a capture
                self._hand_back(OOM, "lower VLLM_OMNI_GRAPHDECODE_BUCKETS or free device memory",
                                f"at {self.decoder.cache.length} tokens: {str(exc)[:200]}")
                return None
            if not isinstance(exc, paged_decode.CaptureError):
                raise
            self.state.capture_failed = str(exc)[:300]
            self._hand_back(CAPTURE_FAILED, "report it with the log", self.state.capture_failed)
            return None
        self.steps += 1
        return logits

    def _hand_back(self, reason, hint, detail) -> None:
        self.decoder.write_back(self.cache)
        self.live = False
        stats.fallback(MODEL, reason, hint, detail)
        if reason == OOM:
            # The eager loop that takes over grows its own cache: give it this memory.
            self.state._drop_decoder()
        else:
            self.decoder.drop_graphs()

    def finish(self) -> None:
        """The cache is about to be read: write the decoded K/V back and stop serving it."""
        if self.live and self.steps:
            self.decoder.write_back(self.cache)
        self.live = False

    def close(self) -> None:
        try:
            if self.think:
                self.finish()
            self.live = False
            if self.per_request:
                self.decoder.drop_graphs()
        finally:
            self.state.session = None
            self.state.lock.release()


# --------------------------------------------------------------------------------------------
# Wiring.
# --------------------------------------------------------------------------------------------

def find_target(pipeline):
    """The pipeline itself when it is (or derives from) vllm-omni's SenseNovaU1Pipeline."""
    for cls in type(pipeline).__mro__:
        if cls.__name__ == "SenseNovaU1Pipeline" and cls.__module__.startswith("vllm_omni."):
            return pipeline
    return None


def wire(target, cfg, runner) -> str:
    return install(target, cfg, runner)


def install(pipeline, cfg, runner=None, *, kernel=None, graphs: bool | None = None) -> str:
    """Wire ``pipeline``; returns the one-line summary. HookRefused leaves it untouched.

    ``kernel``/``graphs`` override the kernel selection and the graph switch (tests run the paged
    path on CPU with ``kernels.REFERENCE`` and ``graphs=False``).
    """
    if getattr(pipeline, _STATE_ATTR, None) is not None:
        return "already wired"
    lm = getattr(pipeline, "language_model", None)
    if lm is None:
        raise HookRefused(f"{type(pipeline).__qualname__} has no language_model")
    cls = type(pipeline)
    layout = detect_layout(lm, cls)
    if layout.in_tree and cfg.sensenova_intree == "defer":
        return (f"{cls.__name__} ({layout.versions}) has its own paged decode, which stays in "
                f"charge (VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE=defer); nothing wired")
    originals = {name: check_signature(cls, name, params)
                 for name, params in PIPELINE_METHODS.items()}
    if layout.in_tree:
        check_signature(cls, "_decode_context", ("self", "past_key_values"))
    _check_model(lm, layout)
    if runner is not None and not callable(getattr(runner, "release_captured_graphs", None)):
        existing = getattr(runner, "graph_runners", None)
        if existing is not None and not isinstance(existing, dict):
            raise HookRefused(f"{type(runner).__qualname__}.graph_runners is a "
                              f"{type(existing).__name__}; sleep could not release decode graphs")

    attn = _attention_modules(lm)[0]
    device = torch.device(pipeline.device)
    if kernel is None:
        kernel = kernels.select_kernel(device, attn.head_dim, cfg.fa_version)
    if graphs is None:
        graphs = (isinstance(kernel, kernels.Kernel) and kernel.capturable
                  and device.type == "cuda")
    fusion = Fusion(lm, layout, device, next(lm.parameters()).dtype)
    if fusion.reasons and layout.fused_step and device.type == "cuda":
        stats.degraded(MODEL, UNFUSED, "a CUDA build of vllm and vllm-omni's Triton qk-norm + "
                       "rope kernel (see the detail)", "; ".join(fusion.reasons))
    state = _State(pipeline, layout, cfg, kernel, graphs, fusion)

    # From here on nothing is checked any more: patch.
    patch_attention(lm, layout)
    bound = {name: getattr(pipeline, name) for name in originals}
    pipeline._generate_think = _wrap_loop(state, bound["_generate_think"], think=True)
    pipeline._generate_text = _wrap_loop(state, bound["_generate_text"], think=False)
    pipeline._ar_step = _wrap_ar_step(state, bound["_ar_step"], _output_class(lm))
    pipeline._append_text_tokens_to_cache = _wrap_append(
        state, bound["_append_text_tokens_to_cache"])
    if layout.in_tree:
        pipeline._decode_context = _decode_context_taken_over
    _wire_release(pipeline, state, runner)
    setattr(pipeline, _STATE_ATTR, state)

    what = (f"{kernel.name}, {'CUDA graphs' if graphs else 'no graphs'}"
            if isinstance(kernel, kernels.Kernel) else f"requests run eagerly: {kernel}")
    refusal = state.static_refusal()
    if refusal is not None and isinstance(kernel, kernels.Kernel):
        what += f"; requests run eagerly now: {refusal.reason}"
    buckets = ",".join(map(str, cfg.buckets))
    tail = paged_decode.tail_step(cfg.buckets)
    taken = "; in-tree decode context taken over" if layout.in_tree else ""
    return (f"{cls.__name__} ({layout.name} layout, {layout.versions}): think/text decode paged "
            f"({what}; step {fusion.describe()}); buckets {buckets} (+{tail} tail){taken}; "
            f"{state.precapture()}")


def _wrap_loop(state: _State, original, think: bool):
    @functools.wraps(original)
    def decode_loop(*args, **kwargs):
        cache = args[1] if len(args) > 1 else kwargs.get("past_key_values")
        session = state.open(cache, think)
        try:
            return original(*args, **kwargs)
        finally:
            if session is not None:
                session.close()

    decode_loop.__graphdecode__ = True
    return decode_loop


def _wrap_ar_step(state: _State, original, output_cls):
    @functools.wraps(original)
    def ar_step(next_token, t_idx, past_key_values, *args, **kwargs):
        session = state.session
        if session is not None and session.serves(past_key_values):
            logits = session.step(next_token, t_idx)
            if logits is not None:
                # The caller reassigns its cache handle from this field; the paged tokens reach
                # that cache at write-back.
                return output_cls(logits=logits, past_key_values=past_key_values)
        stats.count(MODEL, "eager_step")
        return original(next_token, t_idx, past_key_values, *args, **kwargs)

    ar_step.__graphdecode__ = True
    return ar_step


def _wrap_append(state: _State, original):
    @functools.wraps(original)
    def append_text_tokens_to_cache(cache, t_idx, input_ids, *args, **kwargs):
        session = state.session
        if session is not None and session.serves(cache):
            # The think loop is over and the cache is read next: it must hold the decoded tokens.
            session.finish()
        return original(cache, t_idx, input_ids, *args, **kwargs)

    append_text_tokens_to_cache.__graphdecode__ = True
    return append_text_tokens_to_cache


def _decode_context_taken_over(past_key_values):
    """vllm-omni 0.30's in-tree paged decode, disabled: this plugin's path decodes instead
    (VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE=takeover). Returning None sends the in-tree loop to
    its plain ``_ar_step``, which this plugin routes."""
    return None


def _wire_release(pipeline, state: _State, runner) -> None:
    previous = getattr(pipeline, "release_captured_graphs", None)  # 0.30's in-tree one, if any

    def release_captured_graphs() -> None:
        """Drop this plugin's decode graphs and paged K/V (and the in-tree ones, if any)."""
        state.release()
        if previous is not None:
            previous()

    pipeline.release_captured_graphs = release_captured_graphs
    if runner is not None:
        from ... import loading

        loading.release_on_sleep(runner, pipeline.release_captured_graphs)
