"""Why a Qwen-Image-2.1 cached step cannot replay a graph: the hook's reasons and its one gate.

``structure_reason`` is the gate over the transformer as it is wired now (offload, hooks, LoRA,
compile, parallelism, an unknown attention processor, weights off the device); the per-step
reasons (not CUDA, autograd, a padded text mask) and the per-request ones (the prefix cache's
content) are checked where the step's inputs are (``cached_step.py``). Each is a ``Reason`` with
its hint; the step then runs diffusers' own forward and the reason is counted and logged once.
"""

from __future__ import annotations

import torch

from ... import eligibility
from ...reasons import Reason
from . import names

NOT_CUDA = Reason("not on a CUDA device", "run the transformer on an NVIDIA GPU")
AUTOGRAD = Reason("autograd is enabled",
                  "call the pipeline under torch.no_grad() (diffusers pipelines do)")
PADDED = Reason("padded text mask: encoder_hidden_states_mask is set, and the masked attention "
                "depends on its contents",
                "send prompts of one length per batch (diffusers drops an all-valid mask)")
PARALLEL = Reason("sequence/ring/tensor parallel or HSDP sharding on the transformer",
                  "serve one replica per GPU without context parallelism or sharded weights")
COMPILED = Reason("torch.compile'd transformer blocks",
                  "do not compile the transformer or its blocks: this plugin's fast mode compiles "
                  "the cached step itself (VLLM_OMNI_GRAPHDECODE_QWEN_MODE)")
OFFLOAD = Reason("offload hooks on the transformer or its blocks (accelerate, diffusers)",
                 "disable CPU/sequential/group offload: offload moves weights between steps")
HOOKS = Reason("forward hooks on the transformer or its blocks (accelerate, diffusers, torch)",
               "remove diffusers cache hooks and other forward hooks: a hook runs once during "
               "capture and never at replay")
NOT_RESIDENT = Reason("transformer weights are not resident on the step's device",
                      "keep the whole transformer on the GPU (no offload)")
LORA = Reason("dynamic LoRA wrappers on the transformer (peft / vLLM LoRA layers)",
              "fuse the LoRA into the weights (fuse_lora, then unload_lora_weights) or serve "
              "without it")
PROCESSOR = Reason("an attention processor this hook does not know",
                   "use QwenImage21AttnProcessor or QwenImage21FlexAttnProcessor")
QUANT_KV = Reason("quantized prefix K/V: the cache does not hold plain tensors in the model's dtype",
                  "keep the prefix K/V cache unquantized")
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
    Checked at every bind (once per request branch); a change in the middle of a request is seen
    through ``eligibility.fingerprint`` at every step (``cached_step.py``).
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
