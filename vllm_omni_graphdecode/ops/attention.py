"""Which attention kernel runs here, and why none does when none does: the paged single-token
kernel of a decode (``select_kernel``) and the dense one of a fast cached diffusion step
(``select_dense_attention``, at the end of this file). The head size is the caller's.

The paged decode path (``decode/paged.py``) needs an attention kernel that reads K/V through a
block table and takes the number of valid keys as a *device tensor* (``seqused_k``): that is what
lets one captured CUDA graph serve every length inside a bucket. vllm ships such a kernel,
``vllm.vllm_flash_attn.flash_attn_varlen_func``, in two builds: FA2 (sm_80+) and FA3 (Hopper).

Why pass ``fa_version`` explicitly: the function defaults to FA2, and vllm-omni 0.30's own
paged decode calls it without the argument, so it runs FA2 on Hopper. Measured on an
H200 (docs/performance.md, "How each default was set";
``benchmarks/results/h200-2026-11-30b/bench-attn.json``):
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
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..core.reasons import NOT_CUDA, Reason

Tensor = torch.Tensor

# Every argument is passed by keyword, so the probe covers all of them: an older wheel may export
# the function without the paged ones, and its version string would not say so.
PAGED_KWARGS = ("max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "seqused_k", "block_table",
                "softmax_scale", "causal")
MAX_HEAD_DIM = 256

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
    # schedule(q, k_cache, *, cu_seqlens_q, seqused_k, max_seqlen_k) -> the kernel's per-step
    # plan, passed back as ``scheduler_metadata`` (FA3: ``get_scheduler_metadata``), or None
    # when the kernel plans inside every call.
    schedule: Callable | None = dataclasses.field(default=None, repr=False)

    def __call__(self, q, k_cache, v_cache, *, cu_seqlens_q, seqused_k, block_table,
                 max_seqlen_k, softmax_scale, **more):
        return self.fn(q, k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=cu_seqlens_q,
                       max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, block_table=block_table,
                       softmax_scale=softmax_scale, causal=False, **dict(self.extra), **more)


def reference_paged_attention(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k,
                              block_table, softmax_scale, causal=False):
    """``flash_attn_varlen_func``'s paged single-token call in plain torch (fp32 math).

    Same arguments as the kernel (``max_seqlen_q`` must be 1; ``causal`` is moot for one query).
    Masks keys past ``seqused_k`` instead of slicing, so it reads no device value on the host.
    """
    if max_seqlen_q != 1:
        raise ValueError("reference_paged_attention handles one query token per sequence")
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
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
    schedule = _fa3_schedule() if version == 3 and "scheduler_metadata" in params else None
    return Kernel(name=f"FA{version} paged varlen (vllm.vllm_flash_attn)", fa_version=version,
                  fn=fn, extra=extra, schedule=schedule)


def _fa3_schedule() -> Callable | None:
    """FA3's per-step plan as ``Kernel.schedule``, or None where the build lacks it.

    The paged call otherwise runs FA3's scheduler kernel before every layer's attention (one per
    layer and token), each planning the same split from the same ``seqused_k``. The plan
    is made with exactly the arguments the call would use itself (batch 1, one query, no
    causal mask, the cache's page size), so the attention output is the same.
    """
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import get_scheduler_metadata
    except ImportError:
        return None

    def schedule(q, k_cache, *, cu_seqlens_q, seqused_k, max_seqlen_k):
        return get_scheduler_metadata(
            batch_size=1, max_seqlen_q=1, max_seqlen_k=max_seqlen_k, num_heads_q=q.shape[1],
            num_heads_kv=k_cache.shape[2], headdim=q.shape[2], cache_seqlens=seqused_k,
            qkv_dtype=q.dtype, cu_seqlens_q=cu_seqlens_q, page_size=k_cache.shape[1],
            causal=False)

    return schedule


def describe(fa_version_setting: str | None = None, *, head_dim: int) -> str:
    """One line for ``doctor``: the kernel a paged decode at ``head_dim`` would use on cuda:0
    under ``fa_version_setting`` (default: the configured one), or why none."""
    if fa_version_setting is None:
        from .. import config

        fa_version_setting = config.get().fa_version
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    found = select_kernel(device, head_dim, fa_version_setting)
    if isinstance(found, Kernel):
        cc = torch.cuda.get_device_capability(0)
        return (f"paged decode kernel: {found.name} on {device} (sm_{cc[0]}{cc[1]}, "
                f"head_dim {head_dim}, VLLM_OMNI_GRAPHDECODE_FA_VERSION={fa_version_setting})")
    return f"paged decode kernel: none: {found.describe()}; {found.hint}"


# --------------------------------------------------------------------------------------------
# Dense (non-paged) attention: a fast cached diffusion step, target queries over prefix + target
# keys. Measured on the H200 (``benchmarks/results/``, the dense-attention probe): one call with
# 4,096 queries, 32 heads x 128, bf16: 4,352 keys SDPA 0.85 ms vs FA3 0.46 ms; 12,544 keys 2.37 vs
# 1.17 ms, both 3-5e-4 from fp32 attention.
# --------------------------------------------------------------------------------------------

DENSE_SETTINGS = ("auto", "3", "2", "sdpa")
VARLEN_KWARGS = ("max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "cu_seqlens_k", "softmax_scale",
                 "causal")

NOT_HALF = Reason("FlashAttention needs fp16/bf16", "run the transformer in bfloat16")
FA_IMPORT = Reason("FlashAttention import failed",
                   "use a CUDA build of vllm (it ships vllm.vllm_flash_attn)")
FA_SIGNATURE = Reason("flash_attn_varlen_func lacks non-paged kwargs",
                      "use a vllm whose flash_attn_varlen_func takes cu_seqlens_k")
FA3_UNSUPPORTED = Reason("FA3 unsupported here", "FA3 needs compute capability 9.x and vllm's FA3 build")
FA2_UNSUPPORTED = Reason("FA2 unsupported here", "FA2 needs compute capability >= 8.0 and vllm's FA2")
FA_PROBE = Reason("FlashAttention failed its probe call", "report this with the logged detail")


class SdpaAttention:
    """``torch.nn.functional.scaled_dot_product_attention`` as diffusers' native backend calls it;
    the last resort, and the reference on CPU. Same call as ``FlashAttention``."""

    name = "SDPA (torch.nn.functional.scaled_dot_product_attention)"
    fa_version = None

    def __init__(self, skipped: tuple[Reason, ...] = ()):
        self.skipped = skipped  # why each faster kernel was passed over, for the log

    def prepare(self, batch: int, q_len: int, k_len: int, device) -> None:
        """Nothing to build for SDPA."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None = None) -> Tensor:
        # Grouped-query attention (fewer K/V heads than query heads) as FlashAttention takes it.
        gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=0.0, is_causal=False, scale=softmax_scale,
                                             **gqa)
        return out.transpose(1, 2)


class FlashAttention:
    """vllm's ``flash_attn_varlen_func`` without paging, called as::

        out = attention(q, k, v, softmax_scale=None)

    q:    (B, Tq, H, D), fp16/bf16, contiguous (else copied).
    k, v: (B, Tk, Hk, D), q's dtype, contiguous (``KVBuffers``' per-layer buffers are); Hk divides
          H (grouped-query attention, as FlashAttention takes it).
    softmax_scale: float, default ``D ** -0.5``.
    returns (B, Tq, H, D), q's dtype. No mask, not causal.

    ``cu_seqlens`` per (B, Tq, Tk) are built by ``prepare`` (call it at bind, outside any capture)
    and reused, so a step allocates nothing that depends on data; an unprepared shape is built on
    first use, except while a graph is being captured (RuntimeError).
    """

    def __init__(self, fn: Callable, fa_version: int, pass_version: bool,
                 skipped: tuple[Reason, ...] = ()):
        self.name = f"FA{fa_version} varlen (vllm.vllm_flash_attn)"
        self.fa_version = fa_version
        self.skipped = skipped
        self._fn = fn
        self._extra = {"fa_version": fa_version} if pass_version else {}
        self._cu: dict[tuple, tuple[Tensor, Tensor]] = {}

    def prepare(self, batch: int, q_len: int, k_len: int, device) -> tuple[Tensor, Tensor]:
        key = (batch, q_len, k_len, str(torch.device(device)))
        if key not in self._cu:
            with torch.inference_mode(False):
                self._cu[key] = tuple(torch.arange(0, (batch + 1) * n, n, dtype=torch.int32,
                                                   device=device) for n in (q_len, k_len))
        return self._cu[key]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None = None) -> Tensor:
        b, tq, h, d = q.shape
        tk = k.shape[1]
        cu = self._cu.get((b, tq, tk, str(q.device)))
        if cu is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.name}: prepare({b}, {tq}, {tk}) was not called before "
                                   f"capture (cu_seqlens would live in the graph's pool)")
            cu = self.prepare(b, tq, tk, q.device)
        # max_seqlen_* are host ints a captured graph keeps: shapes are fixed per entry.
        hk = k.shape[2]  # K/V heads: fewer than h under grouped-query attention
        out = self._fn(q.reshape(b * tq, h, d), k.reshape(b * tk, hk, d), v.reshape(b * tk, hk, d),
                       max_seqlen_q=tq, cu_seqlens_q=cu[0], max_seqlen_k=tk, cu_seqlens_k=cu[1],
                       softmax_scale=softmax_scale, causal=False, **self._extra)
        return out.view(b, tq, h, d)


def _flash():
    """vllm's ``flash_attn_varlen_func`` and its (is_supported, reason) pair, None on old wheels."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    try:
        from vllm.vllm_flash_attn.flash_attn_interface import (
            fa_version_unsupported_reason,
            is_fa_version_supported,
        )
    except ImportError:
        return flash_attn_varlen_func, None
    return flash_attn_varlen_func, (is_fa_version_supported, fa_version_unsupported_reason)


def _probe(kernel: FlashAttention, device, head_dim: int, dtype) -> str | None:
    """One small batched call against fp32 SDPA: catches a library that loads but fails to run."""
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(2, n, 2, head_dim, generator=gen).to(device, dtype) for n in (8, 40, 40))
        got = kernel(q, k, v)
        want = SdpaAttention()(q.float(), k.float(), v.float())
        worst = float((got.float() - want).abs().max())
    except Exception as exc:
        return repr(exc)[:300]
    return None if worst <= 1e-2 else f"max abs diff {worst:.3g} vs fp32 SDPA"


def select_dense_attention(device, head_dim: int, dtype: torch.dtype, setting: str = "auto",
                           probe: bool = True) -> FlashAttention | SdpaAttention | Reason:
    """The attention the fast step uses on ``device``, or why the requested one cannot run.

    ``setting``: "auto" (FA3 on compute capability 9.x, else FA2, else SDPA, whose ``skipped``
    says why each faster one was passed over), "3" or "2" (that FlashAttention, or the Reason it
    cannot run), "sdpa". Nothing is read from version strings: the function's signature is
    probed, vllm says which builds load, and ``probe`` runs one small call (the FA2 build JIT-
    compiles for ~100 s on its first call on Hopper, where FA3 is tried first).
    """
    if setting not in DENSE_SETTINGS:
        raise ValueError(f"attention setting {setting!r}: expected one of {', '.join(DENSE_SETTINGS)}")
    if setting == "sdpa":
        return SdpaAttention()
    device = torch.device(device)

    def none(reason, detail):
        found = reason.because(detail)
        return SdpaAttention((found,)) if setting == "auto" else found

    if device.type != "cuda":
        return none(NOT_CUDA, f"device is {device}")
    if dtype not in (torch.float16, torch.bfloat16):
        return none(NOT_HALF, str(dtype))
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return none(BAD_HEAD_DIM, f"head_dim={head_dim}")
    try:
        fn, support = _flash()
        params = inspect.signature(fn).parameters
    except Exception as exc:  # an ImportError, a library that fails to load, no signature
        return none(FA_IMPORT, f"vllm.vllm_flash_attn: {exc!r}"[:300])
    missing = [p for p in VARLEN_KWARGS if p not in params]
    if missing:
        return none(FA_SIGNATURE, f"flash_attn_varlen_func lacks {', '.join(missing)}")
    pass_version = "fa_version" in params

    def why_not(version: int) -> str | None:
        if not pass_version:  # such a function runs FA2 only (its historical default)
            return None if version == 2 else "flash_attn_varlen_func has no fa_version argument"
        if support is None or support[0](version):
            return None
        return str(support[1](version) or "vllm says unsupported")

    if setting in ("2", "3"):
        versions = (int(setting),)
    else:
        versions = (3, 2) if torch.cuda.get_device_capability(device)[0] == 9 else (2,)
    skipped: list[Reason] = []
    for version in versions:
        why = why_not(version)
        if why is not None:
            skipped.append((FA3_UNSUPPORTED if version == 3 else FA2_UNSUPPORTED).because(why))
            continue
        kernel = FlashAttention(fn, version, pass_version, tuple(skipped))
        bad = _probe(kernel, device, head_dim, dtype) if probe else None
        if bad is None:
            return kernel
        skipped.append(FA_PROBE.because(f"FA{version}: {bad}"))
    return SdpaAttention(tuple(skipped)) if setting == "auto" else skipped[-1]


def describe_dense(setting: str = "auto", *, head_dim: int) -> str:
    """One line for ``doctor``: the dense attention a fast step at ``head_dim`` would use on
    cuda:0."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    found = select_dense_attention(device, head_dim, torch.bfloat16, setting, probe=False)
    if isinstance(found, Reason):
        return f"dense attention: none: {found.describe()}; {found.hint}"
    skipped = "; ".join(r.describe() for r in getattr(found, "skipped", ()))
    return f"dense attention: {found.name} on {device}" + (f" (skipped: {skipped})" if skipped else "")
