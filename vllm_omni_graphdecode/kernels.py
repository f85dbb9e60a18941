"""Which paged-attention kernel runs single-token decode here, and why none does when none does.

The paged decode path (``paged_decode``) needs an attention kernel that reads K/V through a block
table and takes the number of valid keys as a *device tensor* (``seqused_k``): that is what lets one
captured CUDA graph serve every length inside a bucket. vllm ships such a kernel,
``vllm.vllm_flash_attn.flash_attn_varlen_func``, in two builds: FA2 (sm_80+) and FA3 (Hopper).

Why pass ``fa_version`` explicitly: the function defaults to FA2, and vllm-omni 0.30's own
SenseNova paged decode calls it without the argument, so it runs FA2 on Hopper. Measured on an
H200 (README, "How each default was set"; ``benchmarks/results/h200-2026-11-30b/bench-attn.json``):
FA3 paged varlen at 32 q heads / 8 KV heads / d 128 costs 9.9-18.2 us per call as a graph replay
(context 512-8192) against FA2's 10.5-24.4 and FlashInfer's 16.5-30.3. The FA2 library has no
sm_90 machine code in vllm's wheel: its first call JIT-compiles PTX for ~100 s.

Nothing is decided from version strings: the function's signature is probed for the paged
keyword arguments and for ``fa_version``, and vllm's own ``is_fa_version_supported`` says which
builds load on this GPU.

``reference_paged_attention`` is the same contract in plain torch, for tests and CPU runs. It is
not a production path: on CPU a request runs the model's own eager decode (reason "not CUDA").
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import torch

from .reasons import Reason

# Every argument is passed by keyword, so the probe covers all of them: an older wheel may export
# the function without the paged ones, and its version string would not say so.
PAGED_KWARGS = ("max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "seqused_k", "block_table",
                "softmax_scale", "causal")
MAX_HEAD_DIM = 256

NOT_CUDA = Reason("not CUDA", "run on a CUDA GPU")
BAD_HEAD_DIM = Reason("head_dim not a multiple of 8 or > 256",
                      "nothing to change: FlashAttention's paged kernel does not take this head size")
IMPORT_FAILED = Reason("paged-attention kernel import failed",
                       "use a CUDA build of vllm (it ships vllm.vllm_flash_attn)")
NO_PAGED_KWARGS = Reason("kernel signature lacks paged kwargs",
                         "use a vllm whose flash_attn_varlen_func takes seqused_k and block_table")
FA_VERSION_UNSUPPORTED = Reason("requested FA version unsupported",
                                "set VLLM_OMNI_GRAPHDECODE_FA_VERSION=auto")
NO_FA_VERSION = Reason("no FlashAttention build supported on this GPU",
                       "use an Ampere (sm_80) or newer GPU")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A paged single-token attention kernel, called as::

        out = kernel(q, k_cache, v_cache, cu_seqlens_q=..., seqused_k=..., block_table=...,
                     max_seqlen_k=..., softmax_scale=...)

    q:            (batch, q_heads, head_dim), fp16/bf16 (any float for the reference): one query
                  token per sequence.
    k_cache:      (num_blocks, block_size, kv_heads, head_dim), q's dtype. q_heads is a multiple
    v_cache:      of kv_heads; query head h reads KV head h // (q_heads // kv_heads).
    cu_seqlens_q: (batch + 1,) int32, ``arange(batch + 1)``.
    seqused_k:    (batch,) int32: valid keys of each sequence, this step's included. A device
                  tensor, read when the kernel runs (so also at every graph replay).
    block_table:  (batch, blocks) int32: the blocks of each sequence, in order.
    max_seqlen_k: int, at least every ``seqused_k``; ``blocks * block_size`` (the bucket). A host
                  int: a captured graph keeps the value it was captured with.
    softmax_scale: float.
    returns       (batch, q_heads, head_dim), q's dtype.
    """

    name: str
    fa_version: int | None
    fn: Callable = dataclasses.field(repr=False)
    extra: tuple = ()  # extra keyword arguments, as (name, value) pairs

    def __call__(self, q, k_cache, v_cache, *, cu_seqlens_q, seqused_k, block_table,
                 max_seqlen_k, softmax_scale):
        return self.fn(q, k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=cu_seqlens_q,
                       max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, block_table=block_table,
                       softmax_scale=softmax_scale, causal=False, **dict(self.extra))


def reference_paged_attention(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k,
                              block_table, softmax_scale, causal=False):
    """``flash_attn_varlen_func``'s paged single-token call in plain torch (fp32 math).

    Same arguments as the kernel (``max_seqlen_q`` must be 1; ``causal`` is moot for one query).
    Masks keys past ``seqused_k`` instead of slicing, so it reads no device value on the host.
    """
    if max_seqlen_q != 1:
        raise ValueError("reference_paged_attention handles one query token per sequence")
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k.shape[1], k.shape[2]
    table = block_table.long()
    keys = k[table].reshape(batch, -1, kv_heads, head_dim)[:, :max_seqlen_k]
    values = v[table].reshape(batch, -1, kv_heads, head_dim)[:, :max_seqlen_k]
    group = q_heads // kv_heads
    keys = keys.repeat_interleave(group, dim=2).float()
    values = values.repeat_interleave(group, dim=2).float()
    scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * softmax_scale
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < seqused_k[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhl,blhd->bhd", scores.softmax(dim=-1), values)
    return out.to(q.dtype)


REFERENCE = Kernel(name="reference (plain torch, tests only)", fa_version=None,
                   fn=reference_paged_attention)


def _import_varlen():
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def _fa_support():
    """(is_supported(version) -> bool, reason(version) -> str | None), or None on old wheels."""
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import (
            fa_version_unsupported_reason,
            is_fa_version_supported,
        )
    except ImportError:
        return None
    return is_fa_version_supported, fa_version_unsupported_reason


def select_kernel(device, head_dim: int, fa_version_setting: str = "auto") -> Kernel | Reason:
    """The kernel paged decode uses on ``device`` for ``head_dim``, or why there is none.

    ``fa_version_setting``: "auto" (FA3 on compute capability 9.x when the build has it, else
    FA2, else FA3), "2" or "3" (that one or nothing).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return NOT_CUDA.because(f"device is {device}")
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return BAD_HEAD_DIM.because(f"head_dim={head_dim}")
    try:
        fn = _import_varlen()
    except Exception as exc:  # an ImportError, or a library that fails to load
        return IMPORT_FAILED.because(f"vllm.vllm_flash_attn: {exc!r}")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return NO_PAGED_KWARGS.because("flash_attn_varlen_func has no readable signature")
    missing = [p for p in PAGED_KWARGS if p not in params]
    if missing:
        return NO_PAGED_KWARGS.because(f"flash_attn_varlen_func lacks {', '.join(missing)}")

    has_version_arg = "fa_version" in params
    support = _fa_support()

    def supported(version: int) -> tuple[bool, str]:
        if not has_version_arg:
            # The function then runs FA2 only (its historical default).
            return version == 2, "flash_attn_varlen_func has no fa_version argument"
        if support is None:
            return True, ""
        ok = bool(support[0](version))
        return ok, "" if ok else str(support[1](version) or "")

    if fa_version_setting in ("2", "3"):
        version = int(fa_version_setting)
        ok, why = supported(version)
        if not ok:
            return FA_VERSION_UNSUPPORTED.because(f"FA{version}: {why}")
    else:
        major = torch.cuda.get_device_capability(device)[0]
        order = (3, 2) if major == 9 else (2, 3)
        version = next((v for v in order if supported(v)[0]), None)
        if version is None:
            return NO_FA_VERSION.because("; ".join(f"FA{v}: {supported(v)[1]}" for v in order))
    extra = (("fa_version", version),) if has_version_arg else ()
    return Kernel(name=f"FA{version} paged varlen (vllm.vllm_flash_attn)", fa_version=version,
                  fn=fn, extra=extra)


def describe(fa_version_setting: str | None = None, head_dim: int = 128) -> str:
    """One line for ``doctor``: the kernel SenseNova-U1 decode (head_dim 128) would use on
    cuda:0 under ``fa_version_setting`` (default: the configured one), or why none."""
    if fa_version_setting is None:
        from . import config

        fa_version_setting = config.get().fa_version
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    found = select_kernel(device, head_dim, fa_version_setting)
    if isinstance(found, Kernel):
        cc = torch.cuda.get_device_capability(0)
        return (f"paged decode kernel: {found.name} on {device} (sm_{cc[0]}{cc[1]}, "
                f"head_dim {head_dim}, VLLM_OMNI_GRAPHDECODE_FA_VERSION={fa_version_setting})")
    return f"paged decode kernel: none: {found.describe()}; {found.hint}"
