"""Which paged-attention kernel runs single-token decode here, and why none does when none does.

The paged decode path (``paged_decode``) needs an attention kernel that reads K/V through a block
table and takes the number of valid keys as a *device tensor* (``seqused_k``): that is what lets one
captured CUDA graph serve every length inside a bucket. vllm ships such a kernel,
``vllm.vllm_flash_attn.flash_attn_varlen_func``, in two builds: FA2 (sm_80+) and FA3 (Hopper).

Why pass ``fa_version`` explicitly: the function defaults to FA2, and vllm-omni 0.30's own
SenseNova paged decode calls it without the argument, so it runs FA2 on Hopper. Measured on an
H200 (FACTS §4): FA3 paged varlen at 32 q heads / 8 KV heads / d 128 costs 56 us per call from
Python and 10-11 us as a graph replay, max abs diff 6e-4 against fp32 SDPA in bf16. The FA2
library has no sm_90 machine code in vllm's wheel: its first call JIT-compiles PTX for ~106 s.

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

# Every argument is passed by keyword, so the probe covers all of them: an older wheel may export
# the function without the paged ones, and its version string would not say so.
PAGED_KWARGS = ("max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "seqused_k", "block_table",
                "softmax_scale", "causal")
MAX_HEAD_DIM = 256

# Reason strings: stable, short, used as stats keys. Each has a hint in HINTS.
NOT_CUDA = "not CUDA"
BAD_HEAD_DIM = "head_dim not a multiple of 8 or > 256"
IMPORT_FAILED = "paged-attention kernel import failed"
NO_PAGED_KWARGS = "kernel signature lacks paged kwargs"
FA_VERSION_UNSUPPORTED = "requested FA version unsupported"
NO_FA_VERSION = "no FlashAttention build supported on this GPU"

HINTS = {
    NOT_CUDA: "run on a CUDA GPU",
    BAD_HEAD_DIM: "nothing to change: FlashAttention's paged kernel does not take this head size",
    IMPORT_FAILED: "use a CUDA build of vllm (it ships vllm.vllm_flash_attn)",
    NO_PAGED_KWARGS: "use a vllm whose flash_attn_varlen_func takes seqused_k and block_table",
    FA_VERSION_UNSUPPORTED: "set VLLM_OMNI_GRAPHDECODE_FA_VERSION=auto",
    NO_FA_VERSION: "use an Ampere (sm_80) or newer GPU",
}


class Unavailable(str):
    """Why no kernel runs: the reason string itself (stable), with ``detail`` for the log line."""

    detail: str

    def __new__(cls, reason: str, detail: str = ""):
        obj = super().__new__(cls, reason)
        obj.detail = detail
        return obj

    @property
    def hint(self) -> str:
        return HINTS.get(str(self), "")


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
    capturable: bool
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


REFERENCE = Kernel(name="reference (plain torch, tests only)", fa_version=None, capturable=True,
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


def select_kernel(device, head_dim: int, fa_version_setting: str = "auto") -> Kernel | Unavailable:
    """The kernel paged decode uses on ``device`` for ``head_dim``, or why there is none.

    ``fa_version_setting``: "auto" (FA3 on compute capability 9.x when the build has it, else
    FA2, else FA3), "2" or "3" (that one or nothing).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return Unavailable(NOT_CUDA, f"device is {device}")
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return Unavailable(BAD_HEAD_DIM, f"head_dim={head_dim}")
    try:
        fn = _import_varlen()
    except Exception as exc:  # an ImportError, or a library that fails to load
        return Unavailable(IMPORT_FAILED, f"vllm.vllm_flash_attn: {exc!r}")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return Unavailable(NO_PAGED_KWARGS, "flash_attn_varlen_func has no readable signature")
    missing = [p for p in PAGED_KWARGS if p not in params]
    if missing:
        return Unavailable(NO_PAGED_KWARGS, f"flash_attn_varlen_func lacks {', '.join(missing)}")

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
            return Unavailable(FA_VERSION_UNSUPPORTED, f"FA{version}: {why}")
    else:
        major = torch.cuda.get_device_capability(device)[0]
        order = (3, 2) if major == 9 else (2, 3)
        version = next((v for v in order if supported(v)[0]), None)
        if version is None:
            return Unavailable(NO_FA_VERSION, "; ".join(f"FA{v}: {supported(v)[1]}" for v in order))
    extra = (("fa_version", version),) if has_version_arg else ()
    return Kernel(name=f"FA{version} paged varlen (vllm.vllm_flash_attn)", fa_version=version,
                  capturable=True, fn=fn, extra=extra)


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
    detail = f" ({found.detail})" if found.detail else ""
    return f"paged decode kernel: none: {found}{detail}; {found.hint}"


# --------------------------------------------------------------------------------------------
# Fused elementwise ops for the one-token decoder layer.
# --------------------------------------------------------------------------------------------

# Reasons the decode step runs the model's own (unfused) norms and activation. Not a fallback to
# eager: the step is still paged and graphed, it just launches more small kernels.
NO_LAYER_OPS = "vllm's fused RMSNorm/SiLU ops unavailable"
LAYER_OPS_MISMATCH = "vllm's fused RMSNorm/SiLU ops disagree with the reference"
HINTS[NO_LAYER_OPS] = "use a CUDA build of vllm (its _C library has rms_norm, " \
    "fused_add_rms_norm and silu_and_mul)"
HINTS[LAYER_OPS_MISMATCH] = "report it with the log line; the step runs the model's own norms"

_LAYER_OP_NAMES = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")


class LayerOps:
    """vllm's own CUDA kernels for the elementwise work of a one-token decoder layer.

    At batch 1 a decoder layer's GEMVs read ~380 MB and take ~90 us; the model's Python RMSNorm
    (cast, square, mean, add, rsqrt, multiply, cast, multiply: 8 launches) and SiLU-and-multiply
    (2) run ~20 kernels per layer of a few microseconds each, which inside a CUDA graph is still
    ~2-3 us apiece. These replace each group by one kernel with the same rounding points as the
    model's code (normalise in fp32, round to the activation dtype, then multiply by the weight in
    that dtype); only the fp32 sum's order differs, so results agree to within a unit in the last
    place of bf16, not bit for bit.
    """

    name = "vllm _C rms_norm / fused_add_rms_norm / silu_and_mul"

    def __init__(self, ops):
        self._ops = ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._ops.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> None:
        """In place: ``residual <- x + residual`` (in x's dtype), ``x <- rms_norm(residual)``."""
        self._ops.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = cat([gate, up], -1)``."""
        d = gate_up.shape[-1] // 2
        out = torch.empty(gate_up.shape[:-1] + (d,), dtype=gate_up.dtype, device=gate_up.device)
        self._ops.silu_and_mul(out, gate_up)
        return out


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (vllm-omni 0.24-0.28 ``Qwen3RMSNorm``) with its rounding points."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def select_layer_ops(device, dtype=torch.bfloat16) -> LayerOps | Unavailable:
    """vllm's fused layer ops on ``device``, checked on a small input against the reference, or
    why they are not used."""
    device = torch.device(device)
    if device.type != "cuda":
        return Unavailable(NOT_CUDA, f"device is {device}")
    try:
        import vllm._custom_ops  # noqa: F401  (loads vllm's _C library and registers its ops)

        ops = torch.ops._C
        missing = [n for n in _LAYER_OP_NAMES if not hasattr(ops, n)]
    except Exception as exc:
        return Unavailable(NO_LAYER_OPS, f"loading vllm._custom_ops: {exc!r}")
    if missing:
        return Unavailable(NO_LAYER_OPS, f"torch.ops._C lacks {', '.join(missing)}")
    layer_ops = LayerOps(ops)
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(2, 256, generator=gen).to(device, dtype)
        r = torch.randn(2, 256, generator=gen).to(device, dtype)
        w = (1 + 0.1 * torch.randn(256, generator=gen)).to(device, dtype)
        normed = layer_ops.rms_norm(x, w, 1e-6)
        want_sum, want = x + r, reference_rms_norm(x + r, w, 1e-6)
        x2, r2 = x.clone(), r.clone()
        layer_ops.add_rms_norm_(x2, r2, w, 1e-6)
        act = layer_ops.silu_and_mul(torch.cat([x, r], -1))
        want_act = torch.nn.functional.silu(x) * r
        checks = {
            "rms_norm": (normed, reference_rms_norm(x, w, 1e-6)),
            "fused_add_rms_norm (sum)": (r2, want_sum),
            "fused_add_rms_norm (norm)": (x2, want),
            "silu_and_mul": (act, want_act),
        }
        bad = [f"{n}: max diff {(a.float() - b.float()).abs().max().item():.3g}"
               for n, (a, b) in checks.items()
               if not torch.allclose(a.float(), b.float(), rtol=1.6e-2, atol=1e-2)]
    except Exception as exc:
        return Unavailable(NO_LAYER_OPS, f"running them on {device}: {exc!r}")
    if bad:
        return Unavailable(LAYER_OPS_MISMATCH, "; ".join(bad))
    return layer_ops


class _ReferenceLayerOps:
    """``torch.ops._C``'s three layer ops, same signatures, in plain torch with the model's own
    rounding: for tests and CPU runs of the fused step (``REFERENCE_LAYER_OPS``)."""

    @staticmethod
    def rms_norm(out, x, weight, eps):
        out.copy_(reference_rms_norm(x, weight, eps))

    @staticmethod
    def fused_add_rms_norm(x, residual, weight, eps):
        residual.add_(x)
        x.copy_(reference_rms_norm(residual, weight, eps))

    @staticmethod
    def silu_and_mul(out, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        out.copy_(torch.nn.functional.silu(gate) * up)


REFERENCE_LAYER_OPS = LayerOps(_ReferenceLayerOps())
REFERENCE_LAYER_OPS.name = "reference (plain torch, tests only)"


def reference_qk_norm_rope(q, k, q_weight, k_weight, q_hw_weight, k_hw_weight,
                           cos_t, sin_t, cos_h, sin_h, cos_w, sin_w, eps):
    """vllm-omni's ``triton_qk_norm_rope`` contract in plain torch (tests and CPU runs).

    q ``(B, S, Hq, D)``, k ``(B, S, Hk, D)``: the first half of each head is RMS-normed with
    ``*_weight`` and rotated by the t tables; the second half is normed with ``*_hw_weight``, and
    its two quarters are rotated by the h and w tables. Returns query, key as ``(B, H, S, D)``.
    """
    def rotate(x, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def one(x, w_t, w_hw):
        x_t, x_hw = x.chunk(2, dim=-1)
        x_t = reference_rms_norm(x_t, w_t, eps).transpose(1, 2)
        x_hw = reference_rms_norm(x_hw, w_hw, eps).transpose(1, 2)
        x_h, x_w = x_hw.chunk(2, dim=-1)
        return torch.cat([rotate(x_t, cos_t, sin_t), rotate(x_h, cos_h, sin_h),
                          rotate(x_w, cos_w, sin_w)], dim=-1)

    return one(q, q_weight, q_hw_weight), one(k, k_weight, k_hw_weight)


NO_KV_WRITER = "vllm's reshape_and_cache_flash unavailable"
HINTS[NO_KV_WRITER] = "use a CUDA build of vllm (its _C library has reshape_and_cache_flash)"


class KVWriter:
    """One token's K and V into the paged buffers with vllm's ``reshape_and_cache_flash``: one
    kernel per layer where two ``index_copy_`` ran (84 launches a token at 42 layers). A copy, so
    bit-identical to the ``index_copy_`` path. Called as ``writer(key, value, k_cache, v_cache,
    slot)``: key/value ``(1, kv_heads, head_dim)``, caches ``(blocks, block_size, kv_heads,
    head_dim)``, slot a ``(1,)`` int64 device tensor (read at replay)."""

    name = "vllm _C_cache_ops reshape_and_cache_flash"

    def __init__(self, op, device):
        self._op = op
        # Scales of an unquantized ("auto") cache: unused by the kernel, but it takes tensors.
        self._scale = torch.ones((), dtype=torch.float32, device=device)

    def __call__(self, key, value, k_cache, v_cache, slot) -> None:
        self._op(key, value, k_cache, v_cache, slot, "auto", self._scale, self._scale)


def select_kv_writer(device, dtype=torch.bfloat16) -> KVWriter | Unavailable:
    """vllm's one-kernel K/V writer on ``device``, checked against ``index_copy_``, or why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return Unavailable(NOT_CUDA, f"device is {device}")
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C_cache_ops)

        writer = KVWriter(torch.ops._C_cache_ops.reshape_and_cache_flash, device)
        k_cache = torch.zeros(4, 16, 2, 64, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn(1, 2, 64, device=device).to(dtype)
        value = torch.randn(1, 2, 64, device=device).to(dtype)
        writer(key, value, k_cache, v_cache, torch.tensor([37], device=device))
        ok = (torch.equal(k_cache.view(-1, 2, 64)[37], key[0])
              and torch.equal(v_cache.view(-1, 2, 64)[37], value[0])
              and int(torch.count_nonzero(k_cache)) == int(torch.count_nonzero(key)))
    except Exception as exc:
        return Unavailable(NO_KV_WRITER, repr(exc)[:200])
    if not ok:
        return Unavailable(NO_KV_WRITER, "it wrote elsewhere than index_copy_ does")
    return writer


def describe_step_ops() -> str:
    """One line for ``doctor``: whether the fused decode step's vllm ops run on cuda:0."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    found = [select_layer_ops(device), select_kv_writer(device)]
    ok = [f.name for f in found if not isinstance(f, Unavailable)]
    bad = [f"{f}" + (f" ({f.detail})" if f.detail else "") for f in found
           if isinstance(f, Unavailable)]
    if not bad:
        return f"fused decode-step ops on {device}: " + "; ".join(ok)
    return (f"fused decode-step ops on {device}: " + ("; ".join(ok) + "; " if ok else "")
            + "not available: " + "; ".join(dict.fromkeys(bad)))
