"""A real, tiny diffusers Qwen-Image-2.1 for tests: the transformer the plugin patches, with random
weights, its KV cache, and inputs laid out as ``QwenImage21Pipeline`` lays them out.

Nothing the plugin reads or patches is replaced. The only stand-in is ``StubProcessor``: the real
pipeline asks its Qwen3-VL processor for two token ids at construction, and the tests hand it
prompt embeddings instead of prompts, so no tokenizer runs.
"""

from __future__ import annotations

import torch

from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.hooks.qwen_image_21 import MODEL
from vllm_omni_graphdecode.testing.qwen import synthetic_inputs
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21KVCache,
    QwenImage21Transformer2DModel,
)

# head_dim = sum(axes_dims_rope): the rotary embedding concatenates one frequency block per axis.
CPU_CONFIG = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, context_in_dim=24,
                  in_channels=8, out_channels=8, axes_dims_rope=(4, 6, 6), mlp_ratio=3)
GPU_CONFIG = dict(num_layers=3, attention_head_dim=64, num_attention_heads=4, context_in_dim=64,
                  in_channels=16, out_channels=16, axes_dims_rope=(16, 24, 24), mlp_ratio=3)

diffusers_forward = QwenImage21Transformer2DModel.forward  # diffusers' own, whatever is wired


def fallback_reasons() -> set[str]:
    """The reasons Qwen-Image-2.1's fallbacks were counted under so far (the model key dropped)."""
    return {key.split(": ", 1)[1] for key in stats.fallbacks(MODEL)}


def tiny_transformer(config: dict | None = None, *, dtype=torch.float32, device="cpu", seed: int = 0):
    """A ``QwenImage21Transformer2DModel`` with weights drawn so every layer changes the result
    (the defaults leave zero-initialised norms and near-identity blocks)."""
    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(**(config or CPU_CONFIG))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(device=device, dtype=dtype).eval()


def request(model, *, batch: int = 1, text_tokens: int = 6, reference_shapes=(), target_shape=(4, 4),
            seed: int = 1) -> dict:
    """Keyword arguments of one request's transformer calls (no cache): text, then each reference
    image's slots inside the prompt, more text, then the target's slots (one slot per 2x2 latents),
    as the plugin's ``synthetic_inputs`` lays them out, at timestep 0.9."""
    kwargs = synthetic_inputs(model, batch=batch, text_tokens=text_tokens,
                              reference_shapes=tuple(reference_shapes), target_shape=target_shape,
                              seed=seed)
    kwargs["timestep"] = torch.full_like(kwargs["timestep"], 0.9)
    return kwargs


def new_cache(model) -> QwenImage21KVCache:
    return QwenImage21KVCache(len(model.transformer_blocks))


@torch.no_grad()
def extract(model, kwargs: dict, cache: QwenImage21KVCache | None = None) -> QwenImage21KVCache:
    """Step 0 as the pipeline runs it, through diffusers' own forward."""
    cache = cache if cache is not None else new_cache(model)
    diffusers_forward(model, **kwargs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)
    return cache


def at_step(kwargs: dict, step: int) -> dict:
    """The same request at a later denoising step: other latents and timestep, same layout."""
    gen = torch.Generator().manual_seed(1000 + step)
    latents = kwargs["hidden_states"]
    noise = torch.randn(latents.shape, generator=gen).to(latents.device, latents.dtype)
    out = dict(kwargs)
    out["hidden_states"] = latents + 0.1 * noise
    out["timestep"] = torch.full_like(kwargs["timestep"], 0.9 - 0.1 * step)
    return out


@torch.no_grad()
def cached_reference(model, kwargs: dict, cache: QwenImage21KVCache) -> torch.Tensor:
    """diffusers' own ``kv_cache_mode="cached"`` forward."""
    return diffusers_forward(model, **kwargs, kv_cache=cache, kv_cache_mode="cached",
                             return_dict=False)[0]


@torch.no_grad()
def cached_call(model, kwargs: dict, cache: QwenImage21KVCache) -> torch.Tensor:
    """The model as the pipeline calls it: through whatever forward is wired."""
    return model(**kwargs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]


class _StubTokenizer:
    def encode(self, text):
        return [151655]


class StubProcessor:
    """What ``QwenImage21Pipeline.__init__`` asks of its processor; prompts are never tokenized."""

    tokenizer = _StubTokenizer()

    def apply_chat_template(self, *args, **kwargs):
        return [[0, 1, 2]]


def tiny_pipeline(model) -> QwenImage21Pipeline:
    """The real pipeline around ``model``; call it with prompt embeddings and output_type="latent"."""
    return QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
                               vae=None, text_encoder=None, processor=StubProcessor(),
                               transformer=model)
