"""What the Qwen-Image-2.1 hook reads from diffusers, resolved once and checked before wiring.

Identical in diffusers 0.41.0, 0.42.0 and 0.42.1 (0.41.0 splits heads by count instead of by
head_dim, inside the attention, which this hook does not read). Whatever moved leaves the model as
it is, with the reason.
"""

from __future__ import annotations

import importlib
import inspect
import sys

from ...core.patching import HookRefused, check_signature
from ...core.reasons import Reason

MOVED = Reason("diffusers' Qwen-Image-2.1 code moved",
               "use diffusers 0.41.0-0.42.1 (python -m vllm_omni_graphdecode doctor)")

DIFFUSERS_MODULE = "diffusers.models.transformers.transformer_qwenimage21"
SIGNATURES = (
    ("QwenImage21Transformer2DModel", "forward",
     ("self", "hidden_states", "encoder_hidden_states", "timestep", "img_shapes", "img_mask",
      "encoder_hidden_states_mask", "attention_kwargs", "kv_cache", "kv_cache_mode", "return_dict")),
    ("QwenImage21Transformer2DModel", "build_token_metadata", ("image_pad_mask", "img_shapes")),
    ("QwenImage21TransformerBlock", "forward",
     ("self", "hidden_states", "modulation", "rotary_emb", "attention_mask", "target_token_mask",
      "layer_cache", "kv_cache_mode")),
    ("QwenImage21AdaLayerNormContinuous", "forward",
     ("self", "hidden_states", "conditioning_embedding", "target_token_mask")),
    ("QwenImage21TimestepProjEmbeddings", "forward", ("self", "timestep", "hidden_states")),
    ("QwenImage21Rope", "forward", ("self", "img_shapes", "image_pad_mask", "device")),
    ("QwenImage21KVCache", "get_layer", ("self", "layer_idx")),
    ("QwenImage21KVLayerCache", "store", ("self", "k", "v")),
)
MODULE_NAMES = ("QwenImage21KVLayerCache", "QwenImage21AttnProcessor", "QwenImage21FlexAttnProcessor",
                "_IMG_TOKENS_PER_SLOT")
TRANSFORMER_ATTRS = ("transformer_blocks", "img_in", "time_text_embed", "modulation", "norm_out",
                     "proj_out", "pos_embed", "build_token_metadata")
# A model that captures its own cached step (a future in-tree vLLM-Omni Qwen-Image-2.1, following
# the SenseNova-U1 convention of 0.30) carries one of these; ours are marked ``__graphdecode__``.
INTREE_GRAPH_ATTRS = ("release_captured_graphs", "capture_cached_step", "cached_step_graph")


# The transformer forward's parameters this hook reads, in order (``self`` left out).
FORWARD = SIGNATURES[0][2][1:]


class Diffusers:
    """The diffusers names this hook uses, resolved once (diffusers is imported only when a model
    could be one of its own)."""

    def __init__(self, module):
        self.module = module
        self.transformer_cls = module.QwenImage21Transformer2DModel
        params = inspect.signature(self.transformer_cls.forward).parameters
        self.forward_defaults = {name: params[name].default for name in FORWARD if name in params
                                 and params[name].default is not params[name].empty}
        self.layer_cache_cls = module.QwenImage21KVLayerCache
        self.known_processors = (module.QwenImage21AttnProcessor, module.QwenImage21FlexAttnProcessor)
        self.tokens_per_slot = int(module._IMG_TOKENS_PER_SLOT)
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        self.backend_registry = _AttentionBackendRegistry
        self.output_cls = Transformer2DModelOutput


    def forward_arguments(self, args: tuple, kwargs: dict) -> tuple[dict | None, list[str]]:
        """A call of the transformer's forward by parameter name, defaults filled (None when a
        required one is missing: the forward itself raises then), and the arguments this hook
        does not know: a parameter a newer diffusers added, or a name given twice."""
        call = dict(self.forward_defaults)
        call.update(zip(FORWARD, args))
        unknown = [f"positional argument {i + 1}" for i in range(len(FORWARD), len(args))]
        for name, value in kwargs.items():
            if name in FORWARD and name not in FORWARD[:len(args)]:
                call[name] = value
            else:
                unknown.append(name)
        return (call if all(name in call for name in FORWARD) else None), unknown


_DIFFUSERS: Diffusers | None = None


def resolve() -> Diffusers | None:
    global _DIFFUSERS
    if _DIFFUSERS is None:
        if "diffusers" not in sys.modules:  # nothing loaded can be a diffusers model
            return None
        try:
            module = importlib.import_module(DIFFUSERS_MODULE)
        except ImportError:  # diffusers < 0.41 has no Qwen-Image-2.1
            return None
        missing = [n for n in ("QwenImage21Transformer2DModel",) + MODULE_NAMES if not hasattr(module, n)]
        if missing:
            raise HookRefused(MOVED.because(f"{DIFFUSERS_MODULE} lacks {', '.join(missing)}"))
        _DIFFUSERS = Diffusers(module)
    return _DIFFUSERS


def candidates(obj):
    yield obj
    yield getattr(obj, "transformer", None)
    inner = getattr(obj, "_pipeline", None)  # vLLM-Omni's diffusers adapter
    if inner is not None:
        yield inner
        yield getattr(inner, "transformer", None)


def find_target(pipeline):
    """The ``QwenImage21Transformer2DModel`` in ``pipeline`` (a pipeline, the adapter, the
    transformer itself, or a ``torch.compile`` wrapper of it), or None."""
    try:
        d = resolve()
    except HookRefused:
        return None
    if d is None:
        return None
    for candidate in candidates(pipeline):
        if isinstance(candidate, d.transformer_cls):
            return candidate
        if isinstance(getattr(candidate, "_orig_mod", None), d.transformer_cls):
            return candidate
    return None


def check_signatures(d: Diffusers) -> None:
    for cls_name, method, params in SIGNATURES:
        check_signature(getattr(d.module, cls_name), method, params)


def intree_graph(*objs) -> str | None:
    """Where a model carries its own captured cached step (``INTREE_GRAPH_ATTRS``), or None."""
    for obj in objs:
        for name in INTREE_GRAPH_ATTRS:
            attr = getattr(obj, name, None) if obj is not None else None
            if attr is not None and not getattr(attr, "__graphdecode__", False):
                return f"{type(obj).__name__}.{name}"
    return None


def backend_name(d: Diffusers, transformer) -> str:
    """The attention backend the cached step dispatches to (part of every graph's key)."""
    backend = getattr(transformer.transformer_blocks[0].attn.processor, "_attention_backend", None)
    if backend is None:  # the processors follow diffusers' active backend (env var or context)
        backend = d.backend_registry.get_active_backend()[0]
    return str(getattr(backend, "value", backend))
