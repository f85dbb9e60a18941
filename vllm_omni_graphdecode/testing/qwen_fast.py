"""Qwen-Image-2.1 fast step buffers outside a server: what ``graphs/prefix.py`` allocates per entry
and writes at bind, made directly for the tests and the probes (``benchmarks/probes``)."""

from __future__ import annotations

import torch

from ..hooks.qwen_image_21.fast_step import KVBuffers

Tensor = torch.Tensor


def empty_kv_buffers(layers: int, batch: int, prefix_len: int, target_len: int, heads: int,
                     head_dim: int, *, dtype: torch.dtype, device) -> KVBuffers:
    """Per layer one K and one V buffer ``(batch, prefix_len + target_len, heads, head_dim)``,
    uninitialised. Plain tensors whatever the caller's mode (a later call under no_grad may write
    them), as ``graphs/prefix.py`` allocates them."""
    shape = (batch, prefix_len + target_len, heads, head_dim)
    with torch.inference_mode(False):
        kv = [(torch.empty(shape, dtype=dtype, device=device),
               torch.empty(shape, dtype=dtype, device=device)) for _ in range(layers)]
    return KVBuffers(kv, prefix_len)


def kv_buffers(prefix: list[tuple[Tensor, Tensor]], target_len: int) -> KVBuffers:
    """Buffers shaped for ``prefix`` (per layer (k, v), ``(B, P, H, D)``) with it written into
    their first rows, room for ``target_len`` more."""
    k0 = prefix[0][0]
    batch, prefix_len, heads, head_dim = k0.shape
    bufs = empty_kv_buffers(len(prefix), batch, prefix_len, target_len, heads, head_dim,
                            dtype=k0.dtype, device=k0.device)
    for (bk, bv), (k, v) in zip(bufs.prefix, prefix):
        bk.copy_(k)
        bv.copy_(v)
    return bufs
