"""SenseNova-U1's q/k norm + 3-D rope and the paged K/V write of a decode step as one launch:
HAND-WRITTEN Triton, because no library kernel writes this model's roped keys into a paged cache.

Why: otherwise each layer's qkv GEMV is followed by two small kernels, vllm-omni's
``triton_qk_norm_rope`` (1.68 us a layer on the H200) and vLLM's ``reshape_and_cache_flash``
(2.02 us), 84 launches a token at 42 layers, 0.16 ms a token plus their launch gaps in the FP8
step; this launch takes 1.88 us a layer (``benchmarks/results/h200-2026-12-03c/profile-0.26``).
vllm-omni's kernel returns new query and key tensors and cannot write into the cache (its
output pointer would be fixed at capture, while the slot moves every step); vLLM's FA3 builds
here are compiled without append-K/V (``FLASHATTENTION_DISABLE_APPENDKV``), so the write cannot
ride on the attention call either. This kernel reads the slot from a device
tensor at replay, like ``reshape_and_cache_flash`` does.

What it computes, per token row and head, from the qkv GEMV's output row (q heads, then k heads,
then v heads, as ``_project_and_rope`` splits it): q and k heads get the model's norm + rope,
the same operations in the same order and dtypes as vllm-omni's kernel (the first half of a head
RMS-normed with ``q_norm``/``k_norm`` and rotated by the t tables; the second half normed with
``*_norm_hw``, its two quarters rotated by the h and w tables; fp32 sums, the normed value rounded
to the activation dtype before the weight multiply); q goes to a ``(rows, q_heads, head_dim)``
buffer, k to the cache at its row's slot, and v is copied to the value cache at that slot. The
GPU test checks it bit for bit against vllm-omni's kernel followed by vLLM's writer.

Scope: the decode step's rows (one sequence, or the batched step's rows as one sequence); caches
``(blocks, block_size, kv_heads, head_dim)`` contiguous, in the activations' dtype (no FP8 K/V);
``head_dim`` a power of two divisible by 8. Triton's interpreter (``TRITON_INTERPRET=1`` before
Triton is imported) runs it on CPU tensors for the CPU tests.
"""

from __future__ import annotations

import torch

from ...core.reasons import Reason
from ...graphs.compiling import triton_kernel

NO_ROPE_STORE = Reason("two-kernel q/k rope and K/V write",
                       "a CUDA GPU with Triton, a bf16/fp16 paged cache and a power-of-two "
                       "head_dim (see the detail); the step writes K/V with vLLM's kernel")

def _define(triton, tl):
    """The Triton kernel (``compiling.triton_kernel`` defines it at first use)."""
    @triton.jit
    def qk_norm_rope_store(qkv, query, k_cache, v_cache, slot, wq, wk, wq_hw, wk_hw,
                           cos_t, sin_t, cos_h, sin_h, cos_w, sin_w,
                           qkv_stride, query_stride, cache_stride, head_stride,
                           t_stride, h_stride, w_stride,
                           Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, D: tl.constexpr,
                           eps: tl.constexpr, ROUND_NORM: tl.constexpr,
                           ROUND_ROPE: tl.constexpr):
        # Program (row, head): heads [0, Q_HEADS) are q, then K_HEADS k heads, then K_HEADS v
        # heads, each D wide in the qkv row at head * D.
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, D)
        src = qkv + row * qkv_stride + head * D
        dest = tl.load(slot + row)  # flat token index into the cache, read at replay
        if head >= Q_HEADS + K_HEADS:
            tl.store(v_cache + dest * cache_stride + (head - Q_HEADS - K_HEADS) * head_stride
                     + offs, tl.load(src + offs))
        else:
            is_q = head < Q_HEADS
            half: tl.constexpr = D // 2
            quarter: tl.constexpr = D // 4
            eighth: tl.constexpr = D // 8
            in_t = offs < half
            in_h = (offs >= half) & (offs < half + quarter)
            in_w = offs >= half + quarter
            act = query.dtype.element_ty
            # Scalar branches, not tl.where over pointers (Triton's interpreter mishandles that).
            if is_q:
                w_t = wq
                w_hw = wq_hw
                out_ptr = query + row * query_stride + head * D
            else:
                w_t = wk
                w_hw = wk_hw
                out_ptr = k_cache + dest * cache_stride + (head - Q_HEADS) * head_stride
            x = tl.load(src + offs).to(tl.float32)
            # One RMS over each half of the head: t, then h and w together.
            rms_t = tl.rsqrt(tl.sum(tl.where(in_t, x, 0.0) * tl.where(in_t, x, 0.0), axis=0)
                             / half + eps)
            rms_hw = tl.rsqrt(tl.sum(tl.where(in_t, 0.0, x) * tl.where(in_t, 0.0, x), axis=0)
                              / half + eps)
            rms = tl.where(in_t, rms_t, rms_hw)
            # rotate_half within each section: t is half wide, h and w a quarter each; the
            # lower half of a section pairs with its upper half and takes the minus sign.
            width = tl.where(in_t, quarter, eighth)  # half a section
            start = tl.where(in_t, 0, tl.where(in_h, half, half + quarter))
            local = offs - start
            lower = local < width
            partner = tl.where(lower, offs + width, offs - width)
            px = tl.load(src + partner).to(tl.float32)
            weight = tl.where(in_t, tl.load(w_t + offs, mask=in_t, other=0.0),
                              tl.load(w_hw + (offs - half), mask=~in_t, other=0.0))
            p_weight = tl.where(in_t, tl.load(w_t + partner, mask=in_t, other=0.0),
                                tl.load(w_hw + (partner - half), mask=~in_t, other=0.0))
            # The normed value is rounded to the activation dtype, then scaled by the weight:
            # in fp32 and rounded again where the model's kernel multiplies two activation-dtype
            # values (a product of two bf16 values is exact in fp32, so one rounding gives the
            # same bits as a bf16 multiply; Triton's interpreter cannot multiply bf16 itself).
            normed = (x * rms).to(act).to(tl.float32) * weight.to(tl.float32)
            p_normed = (px * rms).to(act).to(tl.float32) * p_weight.to(tl.float32)
            if ROUND_NORM:
                normed = normed.to(act).to(tl.float32)
                p_normed = p_normed.to(act).to(tl.float32)
            cos = tl.where(in_t, tl.load(cos_t + row * t_stride + local, mask=in_t, other=0.0),
                           tl.where(in_h,
                                    tl.load(cos_h + row * h_stride + local, mask=in_h, other=0.0),
                                    tl.load(cos_w + row * w_stride + local, mask=in_w,
                                            other=0.0))).to(tl.float32)
            sin = tl.where(in_t, tl.load(sin_t + row * t_stride + local, mask=in_t, other=0.0),
                           tl.where(in_h,
                                    tl.load(sin_h + row * h_stride + local, mask=in_h, other=0.0),
                                    tl.load(sin_w + row * w_stride + local, mask=in_w,
                                            other=0.0))).to(tl.float32)
            sign = tl.where(lower, -1.0, 1.0)
            rotated = normed * cos
            if ROUND_ROPE:
                rotated = rotated.to(act).to(tl.float32)
            out = rotated + sign * p_normed * sin
            tl.store(out_ptr + offs, out)

    return qk_norm_rope_store


_kernel = triton_kernel(_define)


def qk_norm_rope_store(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
                       norm_weights, tables, eps: float, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot: torch.Tensor,
                       query: torch.Tensor | None = None) -> torch.Tensor:
    """Norm and rope q and k, store k and v at ``slot``; returns the query ``(rows, q_heads,
    head_dim)``.

    qkv: ``(1, rows, (q_heads + 2 * kv_heads) * head_dim)`` or ``(rows, ...)``, the qkv GEMV's
    output, rows with unit stride. norm_weights: ``(q_norm, k_norm, q_norm_hw, k_norm_hw)``
    weights, each ``(head_dim / 2,)``. tables: ``((cos_t, sin_t), (cos_h, sin_h), (cos_w,
    sin_w))``, each ``(1, rows, d)`` with d = head_dim / 2 for t and head_dim / 4 for h and w
    (what the model's rotary modules return). k_cache / v_cache: ``(blocks, block_size, kv_heads,
    head_dim)`` contiguous, qkv's dtype. slot: ``(rows,)`` int64 device tensor, each row's flat
    token index ``block * block_size + offset``. query: ``(rows, q_heads, head_dim)`` to write
    into, or None (a new tensor)."""
    rows = qkv.shape[-2] if qkv.dim() > 1 else 1
    if qkv.dim() == 3 and qkv.shape[0] != 1:
        raise ValueError(f"qkv batch {qkv.shape[0]}: the decode step's rows are one sequence")
    flat = qkv.reshape(rows, qkv.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if query is None:
        query = torch.empty(rows, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    (cos_t, sin_t), (cos_h, sin_h), (cos_w, sin_w) = tables
    t_stride, h_stride, w_stride = (_row_stride(c, s, rows) for c, s in
                                    ((cos_t, sin_t), (cos_h, sin_h), (cos_w, sin_w)))
    wq, wk, wq_hw, wk_hw = norm_weights
    _kernel()[(rows, q_heads + 2 * kv_heads)](
        flat, query, k_cache, v_cache, slot, wq, wk, wq_hw, wk_hw,
        cos_t, sin_t, cos_h, sin_h, cos_w, sin_w,
        flat.stride(0), query.stride(0), k_cache.stride(1), k_cache.stride(2),
        t_stride, h_stride, w_stride,
        Q_HEADS=q_heads, K_HEADS=kv_heads, D=head_dim, eps=eps,
        # Where the model's kernel multiplies two activation-dtype values it rounds the product.
        ROUND_NORM=wq.dtype == qkv.dtype,
        ROUND_ROPE=wq.dtype == qkv.dtype and cos_t.dtype == qkv.dtype)
    return query


def _row_stride(cos: torch.Tensor, sin: torch.Tensor, rows: int) -> int:
    """The stride between the rows of a ``(1, rows, d)`` cos/sin pair, checked to be laid out
    alike with unit stride along d."""
    if (cos.shape != sin.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1
            or cos.shape[-2] != rows):
        raise ValueError(f"rope tables {tuple(cos.shape)}/{tuple(sin.shape)} with strides "
                         f"{cos.stride()}/{sin.stride()} for {rows} rows: want (1, rows, d) "
                         f"alike, unit stride along d")
    return cos.stride(-2)


def why_not(head_dim: int, dtype, cache_dtype, device) -> Reason | None:
    """Why the one-launch write cannot serve this model's cache here, or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return NO_ROPE_STORE.because(f"device is {device}")
    if head_dim < 8 or head_dim & (head_dim - 1):
        return NO_ROPE_STORE.because(f"head_dim {head_dim}")
    if dtype not in (torch.bfloat16, torch.float16) or cache_dtype != dtype:
        return NO_ROPE_STORE.because(f"activations {dtype}, cache {cache_dtype}")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return NO_ROPE_STORE.because(f"triton not importable ({exc})")
    return None
