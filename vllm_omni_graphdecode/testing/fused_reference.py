"""The fused decode step's structure with plain-torch kernels, on any device: what the CPU tests
run the fused step with (the rope tables once per step, fused norms and SiLU), and vllm-omni's
Triton q/k-norm + rope kernel restated. Test scaffolding, not a runtime path (issue #21)."""

from __future__ import annotations

from ..core.patching import HookRefused
from ..core.reasons import Reason
from ..hooks.sensenova_u1 import layouts, ops
from ..hooks.sensenova_u1.fused_step import Fusion, _layers_not_fusable, _rope_once_kernel
from ..ops import layer_ops

NOT_FUSABLE = Reason("decode step cannot be fused",
                     "nothing to change: the model's own step runs (see the detail)")


def reference_qk_norm_rope(q, k, q_weight, k_weight, q_hw_weight, k_hw_weight,
                           cos_t, sin_t, cos_h, sin_h, cos_w, sin_w, eps):
    """vllm-omni's ``triton_qk_norm_rope`` contract in plain torch: q ``(B, S, Hq, D)``, k
    ``(B, S, Hk, D)``; the first half of each head RMS-normed with ``*_weight`` and rotated by
    the t tables, the second half normed with ``*_hw_weight`` and its two quarters rotated by the
    h and w tables. Returns query, key as ``(B, H, S, D)``: ``ops.qk_norm_rope`` with 0.24-0.28's
    cast chain (bit for bit: tests/test_sensenova_fast_denoise.py)."""
    tables = ((cos_t, sin_t), (cos_h, sin_h), (cos_w, sin_w))
    query, key = ops.qk_norm_rope(q, k, q_weight, k_weight, q_hw_weight, k_hw_weight, tables, eps,
                                  cast_chain=True)
    return query.transpose(1, 2), key.transpose(1, 2)


def reference_fusion(language_model, layout: layouts.Layout | None = None) -> Fusion:
    """The fused step's structure with plain-torch kernels (HookRefused where it does not apply)."""
    layout = layout or layouts.detect_layout(language_model)
    rope = None
    if layout.rope_per_layer:
        rope = _rope_once_kernel(language_model, kernel=reference_qk_norm_rope)
        if isinstance(rope, str):
            raise HookRefused(NOT_FUSABLE.because(f"rope once per step: {rope}"))
    why = _layers_not_fusable(language_model)
    if why is not None:
        raise HookRefused(NOT_FUSABLE.because(f"fused norms: {why}"))
    return Fusion(rope, layer_ops.REFERENCE_LAYER_OPS)


__all__ = ["reference_fusion", "reference_qk_norm_rope"]
