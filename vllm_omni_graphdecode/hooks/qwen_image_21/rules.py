"""Why a Qwen-Image-2.1 cached step cannot replay a graph: the hook's reasons and its one gate.

``structure_reason`` is the gate over the transformer as it is wired now (offload, hooks, LoRA,
compile, parallelism, an unknown attention processor, weights off the device); the per-step
reasons (not CUDA, autograd, a padded text mask) and the per-request ones (the prefix cache's
content) are checked where the step's inputs are (``cached_step.py``). Each is a ``Reason`` with
its hint; the step then runs diffusers' own forward and the reason is counted and logged once.
"""

from __future__ import annotations

import torch

from ...core import eligibility
from ...core.reasons import (AUTOGRAD, COMPILED, HOOKS, LORA, NOT_CUDA, OFFLOAD, PARALLEL, QUANT_KV,
                             Reason)
from . import names

__all__ = ["AUTOGRAD", "COMPILED", "HOOKS", "LAYOUT", "LORA", "NOT_CUDA", "NOT_POPULATED",
           "NOT_RESIDENT", "OFFLOAD", "PADDED", "PARALLEL", "PROCESSOR", "QUANT_KV",
           "structure_reason"]

# This hook's own reasons; the shared ones (``reasons``) carry this hook's case in their detail.
PADDED = Reason("padded text mask: encoder_hidden_states_mask is set, and the masked attention "
                "depends on its contents",
                "send prompts of one length per batch (diffusers drops an all-valid mask)")
NOT_RESIDENT = Reason("transformer weights are not resident on the step's device",
                      "keep the whole transformer on the GPU (no offload)")
PROCESSOR = Reason("an attention processor this hook does not know",
                   "use QwenImage21AttnProcessor or QwenImage21FlexAttnProcessor")
NOT_POPULATED = Reason("prefix K/V not populated: no extract step ran for this cache",
                       "run step 0 with kv_cache_mode='extract' (the pipeline does)")
LAYOUT = Reason("prefix K/V do not match the request's token layout (no key for this step)",
                "report this with img_shapes and the cached prefix length")


def _is_dtensor(t) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def structure_reason(transformer, device: torch.device | None = None, *,
                     compiled_ok: bool = False) -> Reason | None:
    """Why this transformer's cached steps cannot be captured as it is wired now, or None.

    ``compiled_ok``: compiled blocks are no reason (the fast body reads their weights only).
    A walk of the module tree: checked at every bind (once per request branch), never per step;
    a change in the middle of a request is seen through ``eligibility.Watch`` (``cached_step.py``).
    """
    d = names.resolve()
    blocks = transformer.transformer_blocks
    for block in blocks:
        proc = getattr(getattr(block, "attn", None), "processor", None)
        if getattr(proc, "_parallel_config", None) is not None:
            return PARALLEL.because("context-parallel config on the attention processors")
    found = eligibility.scan(transformer)
    if found.sharded:
        return PARALLEL.because(found.sharded)
    if found.compiled and not compiled_ok:
        return COMPILED.because(found.compiled)
    if found.offload:
        return OFFLOAD.because(found.offload)
    if found.hooks:
        return HOOKS.because(found.hooks)
    if found.lora:
        return LORA.because(found.lora)
    for block in blocks:
        proc = block.attn.processor
        if type(proc) not in d.known_processors:
            return PROCESSOR.because(type(proc).__name__)
    for name, param in transformer.named_parameters():
        if _is_dtensor(param):
            return PARALLEL.because(f"{name} is a DTensor")
        if device is not None and param.device != device:
            return NOT_RESIDENT.because(f"{name} on {param.device}")
    return None
