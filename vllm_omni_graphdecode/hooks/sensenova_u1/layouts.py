"""SenseNova-U1's code layouts: the one place where vllm-omni releases differ for this hook.

A layout is recognised from the code itself (``_project_and_rope``'s second parameter and whether
the pipeline has vllm-omni's own paged decode), never from a version string, and everything the
hook patches or calls is checked (``check_model``, ``PIPELINE_METHODS``) before anything is
patched. Dropping vllm-omni 0.24-0.28 means deleting the "backport" row and the rope-once part of
``fused_step.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

from ...core.patching import HookRefused, check_signature, takes_var_kwargs
from ...core.reasons import Reason

UNKNOWN_LAYOUT = Reason("unknown SenseNova-U1 code layout",
                        "use vllm-omni 0.24-0.30 (python -m vllm_omni_graphdecode doctor)")
MODEL_MOVED = Reason("SenseNova-U1's model code moved",
                     "use vllm-omni 0.24-0.30 (python -m vllm_omni_graphdecode doctor)")


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    versions: str
    # second parameter of SenseNovaU1Attention._project_and_rope, and where forward_und finds it
    rope_param: str
    # the pipeline has vllm-omni's own paged decode (_decode_context, release_captured_graphs)
    in_tree: bool
    # the fused decode step (fused_step.py) runs the decoder layer's norms, residual add and SiLU
    # through vllm's fused kernels. 0.30's F.rms_norm rounds once after the weight multiply,
    # vllm's kernel before it (as 0.24-0.28's cast chain does), so there it changes rounding.
    fused_step: bool
    # the model computes the rope tables in every layer; the fused step computes them once per
    # step and feeds vllm-omni's qk-norm + rope kernel. 0.30's model already does it once.
    rope_per_layer: bool

    def rope_input(self, indexes, kwargs):
        return indexes if self.rope_param == "indexes" else kwargs[self.rope_param]


LAYOUTS = (
    Layout("backport", "vllm-omni 0.24, 0.26, 0.28", rope_param="indexes", in_tree=False,
           fused_step=True, rope_per_layer=True),
    Layout("in-tree", "vllm-omni 0.30", rope_param="position_embeddings", in_tree=True,
           fused_step=True, rope_per_layer=False),
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


def attention_modules(language_model) -> list:
    layers = getattr(getattr(language_model, "model", None), "layers", None)
    if not layers:
        raise HookRefused(MODEL_MOVED.because(
            f"{type(language_model).__qualname__} has no model.layers"))
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    if any(a is None for a in attns):
        raise HookRefused(MODEL_MOVED.because("a decoder layer has no self_attn"))
    return attns


def detect_layout(language_model, pipeline_cls=None) -> Layout:
    """The layout of this model (and pipeline class, when given), or HookRefused."""
    attn = attention_modules(language_model)[0]
    try:
        params = list(inspect.signature(type(attn)._project_and_rope).parameters)
    except (AttributeError, TypeError, ValueError):
        raise HookRefused(UNKNOWN_LAYOUT.because(
            f"{type(attn).__qualname__}._project_and_rope not found")) from None
    rope_param = params[2] if len(params) > 2 else None
    in_tree = pipeline_cls is not None and hasattr(pipeline_cls, "_decode_context")
    for layout in LAYOUTS:
        if layout.rope_param == rope_param and (pipeline_cls is None or layout.in_tree == in_tree):
            return layout
    raise HookRefused(UNKNOWN_LAYOUT.because(
        f"_project_and_rope({', '.join(params)}), _decode_context "
        f"{'present' if in_tree else 'absent'}; known: "
        + "; ".join(f"{lay.versions} ({lay.rope_param}, in-tree {lay.in_tree})"
                    for lay in LAYOUTS)))


def check_model(language_model, layout: Layout) -> None:
    """Everything the paged branch and the decode step touch, checked before any patch."""
    check_signature(type(language_model), "forward", LM_FORWARD)
    model = language_model.model
    layer = model.layers[0]
    chain = [(type(model), "forward"), (type(layer), "forward"), (type(layer), "_forward_und"),
             (type(layer.self_attn), "forward"), (type(layer.self_attn), "forward_und")]
    for owner, name in chain:
        fn = getattr(owner, name, None)
        if fn is None or not takes_var_kwargs(fn):
            raise HookRefused(MODEL_MOVED.because(
                f"{owner.__qualname__}.{name} no longer passes **kwargs through, so the paged "
                f"cache cannot reach attention"))
    for attn in attention_modules(language_model):
        cls = type(attn)
        check_signature(cls, "forward_und", FORWARD_UND)
        check_signature(cls, "_project_and_rope",
                        ("self", "hidden_states", layout.rope_param, "qkv_proj", "q_norm",
                         "k_norm", "q_norm_hw", "k_norm_hw"))
        missing = [a for a in ATTN_ATTRS if not hasattr(attn, a)]
        if missing:
            raise HookRefused(MODEL_MOVED.because(f"{cls.__qualname__} lacks {', '.join(missing)}"))
    if output_class(language_model) is None:
        raise HookRefused(MODEL_MOVED.because(
            f"{type(language_model).__module__} has no SenseNovaU1CausalLMOutput"))


def output_class(language_model):
    module = sys.modules.get(type(language_model).__module__)
    return getattr(module, "SenseNovaU1CausalLMOutput", None)
