"""The plugin's own keyword down SenseNova-U1's ``**kwargs`` chain (``PAGED_KWARG``) and its value
for one decode step (``StepArgs``): what the one-token step (``step.py``) passes and the patched
layers of the fused step (``fused_step.py``) read. Its own module so that neither of those two
imports the other for it."""

from __future__ import annotations

# Our own keyword down the model's **kwargs chain. Upstream 0.30 uses "paged_cache"; never collide.
PAGED_KWARG = "graphdecode_paged_kv"


class StepArgs:
    """``PAGED_KWARG``'s value for one decode step: the paged cache, the fused step's parts (or
    None), and the rope tables once the first layer has computed them. ``normed``: (a layer's
    output, its next layer's input norm) where the layer's down launch computed that norm;
    ``attn_norm``: what the layer running hands its o_proj launch to fold in (the residual and
    the post-attention norm), ``FOLDED`` once that launch did (``fused_step``)."""

    __slots__ = ("cache", "fusion", "rope", "normed", "attn_norm")

    def __init__(self, cache, fusion):
        self.cache = cache
        self.fusion = fusion
        self.rope = None
        self.normed = None
        self.attn_norm = None


FOLDED = "folded"  # ``StepArgs.attn_norm`` once the o_proj launch added and normalised
