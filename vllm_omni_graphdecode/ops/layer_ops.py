"""vllm's own CUDA ops for the elementwise work of a one-token decoder layer, and its one-kernel
paged K/V write: each selected on a device after a check against plain torch, or the reason not.

Not attention (``ops/attention.py``) and not model code: a hook's fused step decides where they
go. The plain-torch references here
restate the same contracts for tests and CPU runs.
"""

from __future__ import annotations

import torch

from ..core.reasons import NOT_CUDA, Reason

# Why the decode step runs the model's own (unfused) norms and activation. Not a fallback to
# eager: the step is still paged and graphed, it just launches more small kernels.
NO_LAYER_OPS = Reason("vllm's fused RMSNorm/SiLU ops unavailable",
                      "use a CUDA build of vllm (its _C library has rms_norm, fused_add_rms_norm "
                      "and silu_and_mul)")
LAYER_OPS_MISMATCH = Reason("vllm's fused RMSNorm/SiLU ops disagree with the reference",
                            "report it with the log line; the step runs the model's own norms")

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
    """The model's RMSNorm (vllm-omni 0.24-0.28's language models) with its rounding points."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def select_layer_ops(device, dtype=torch.bfloat16) -> LayerOps | Reason:
    """vllm's fused layer ops on ``device``, checked on a small input against the reference, or
    why they are not used."""
    device = torch.device(device)
    if device.type != "cuda":
        return NOT_CUDA.because(f"device is {device}")
    try:
        import vllm._custom_ops  # noqa: F401  (loads vllm's _C library and registers its ops)

        ops = torch.ops._C
        missing = [n for n in _LAYER_OP_NAMES if not hasattr(ops, n)]
    except Exception as exc:
        return NO_LAYER_OPS.because(f"loading vllm._custom_ops: {exc!r}")
    if missing:
        return NO_LAYER_OPS.because(f"torch.ops._C lacks {', '.join(missing)}")
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
        return NO_LAYER_OPS.because(f"running them on {device}: {exc!r}")
    if bad:
        return LAYER_OPS_MISMATCH.because("; ".join(bad))
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


NO_KV_WRITER = Reason("vllm's reshape_and_cache_flash unavailable",
                      "use a CUDA build of vllm (its _C library has reshape_and_cache_flash)")


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


def select_kv_writer(device, dtype=torch.bfloat16) -> KVWriter | Reason:
    """vllm's one-kernel K/V writer on ``device``, checked against ``index_copy_``, or why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return NOT_CUDA.because(f"device is {device}")
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
        return NO_KV_WRITER.because(repr(exc)[:200])
    if not ok:
        return NO_KV_WRITER.because("it wrote elsewhere than index_copy_ does")
    return writer


def describe_step_ops() -> str:
    """One line for ``doctor``: whether the fused decode step's vllm ops run on cuda:0."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    found = [select_layer_ops(device), select_kv_writer(device)]
    ok = [f.name for f in found if not isinstance(f, Reason)]
    bad = [f.describe() for f in found if isinstance(f, Reason)]
    if not bad:
        return f"fused decode-step ops on {device}: " + "; ".join(ok)
    return (f"fused decode-step ops on {device}: " + ("; ".join(ok) + "; " if ok else "")
            + "not available: " + "; ".join(dict.fromkeys(bad)))
