"""Qwen-Image-2.1's real transformer at any size, with random weights, and request inputs laid out
as ``QwenImage21Pipeline`` lays them out: for the demo, the tests and the benchmarks. Nothing is
downloaded."""

from __future__ import annotations

import torch


def random_transformer(*, device="cuda", dtype=torch.bfloat16, **config_overrides):
    """A ``QwenImage21Transformer2DModel`` with diffusers' random initialisation, built directly on
    ``device``. The default config is the released model's shape (32 layers, 32 heads x 128, hidden
    4096, SwiGLU 12288, in_channels 64): ~7 B parameters, built in fp32 then cast (peak ~42 GB)."""
    from diffusers.models.transformers.transformer_qwenimage21 import (
        QwenImage21Transformer2DModel,
    )

    with torch.device(device):
        model = QwenImage21Transformer2DModel(**config_overrides)
    return model.to(dtype=dtype).eval()


def synthetic_inputs(transformer, *, batch: int = 1, text_tokens: int = 256,
                     reference_shapes: tuple[tuple[int, int], ...] = (),
                     target_shape: tuple[int, int] = (64, 64), seed: int = 0) -> dict:
    """Transformer keyword arguments for one request, laid out as the pipeline lays them out.

    ``text_tokens`` text positions, then each reference image's ``(h, w)`` latent grid as image
    slots inside the prompt, then the target's slots; 1024x1024 is ``target_shape=(64, 64)`` (4,096
    tokens). Prefix length = ``text_tokens + sum(h * w)``. Random values; ``kv_cache`` not included.
    """
    cfg = transformer.config
    param = next(transformer.parameters())
    device, dtype = param.device, param.dtype
    gen = torch.Generator(device="cpu").manual_seed(seed)
    th, tw = target_shape
    if th % 2 or tw % 2 or any(h % 2 or w % 2 for h, w in reference_shapes):
        raise ValueError("latent grids must have even sides (one slot per 2x2 latent tokens)")
    head = text_tokens // 2
    mask = [False] * head
    for h, w in reference_shapes:
        mask += [True] * (h * w // 4)
    mask += [False] * (text_tokens - head)
    n_context = len(mask)
    mask += [True] * (th * tw // 4)
    image_tokens = sum(h * w for h, w in reference_shapes) + th * tw
    img_mask = torch.tensor(mask, dtype=torch.bool).expand(batch, -1).to(device)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return dict(
        hidden_states=rand(batch, image_tokens, cfg.in_channels),
        encoder_hidden_states=rand(batch, n_context, cfg.context_in_dim),
        timestep=torch.full((batch,), 0.5, dtype=dtype, device=device),
        img_shapes=[[(1, h, w) for h, w in reference_shapes] + [(1, th, tw)]] * batch,
        img_mask=img_mask,
    )
