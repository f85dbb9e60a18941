"""SenseNova-U1's small formulas, written once: its RMSNorm as each release computes it, the three
rope tables of a step, and the q/k norm + 3-D rope of ``_project_and_rope``.

The fused decode step (``fused_step``), the denoising step's model forward (``denoise``) and the
fast denoising body (``fast_denoise``) read them from here, so the three cannot drift apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, cast_chain: bool) -> Tensor:
    """``Qwen3RMSNorm`` as the release defines it: ``F.rms_norm`` (0.30) or, with
    ``cast_chain``, normalised in fp32, rounded to the input's dtype, then scaled (0.24-0.28)."""
    if not cast_chain:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(rotary, rotary_hw, hidden: Tensor, indexes: Tensor):
    """((cos, sin) of t, of h, of w): the model's own rotary modules (``rotary_emb`` for the t
    index, ``rotary_emb_hw`` for h and w) at the step's ``indexes`` ``(3, S)``, as
    ``_project_and_rope`` computes them in every layer (0.24-0.28) and 0.30's forward once.
    Each table is ``(1, S, d)``."""
    return (rotary(hidden, indexes[0].unsqueeze(0)),
            rotary_hw(hidden, indexes[1].unsqueeze(0)),
            rotary_hw(hidden, indexes[2].unsqueeze(0)))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``apply_rotary_pos_emb`` on ``(B, S, H, d)`` with tables ``(B, S, d)``."""
    return x * cos.unsqueeze(2) + _rotate_half(x) * sin.unsqueeze(2)


def qk_norm_rope(q: Tensor, k: Tensor, wq: Tensor, wk: Tensor, wq_hw: Tensor, wk_hw: Tensor,
                 tables, eps: float, cast_chain: bool):
    """vllm-omni's ``_project_and_rope`` after the qkv GEMM (its PyTorch fallback, the contract
    its Triton kernel computes too) on q ``(B, S, Hq, D)`` and k ``(B, S, Hk, D)``, returned in
    that layout: the first half of each head RMS-normed with ``w*`` and rotated by the t tables;
    the second half normed with ``w*_hw``, its two quarters rotated by the h and w tables."""
    (cos_t, sin_t), (cos_h, sin_h), (cos_w, sin_w) = tables

    def one(x, w_t, w_hw):
        x_t, x_hw = x.chunk(2, dim=-1)
        x_t = apply_rope(rms_norm(x_t, w_t, eps, cast_chain), cos_t, sin_t)
        x_h, x_w = rms_norm(x_hw, w_hw, eps, cast_chain).chunk(2, dim=-1)
        return torch.cat([x_t, apply_rope(x_h, cos_h, sin_h), apply_rope(x_w, cos_w, sin_w)],
                         dim=-1)

    return one(q, wq, wq_hw), one(k, wk, wk_hw)
