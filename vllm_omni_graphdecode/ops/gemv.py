"""Batch-1 linear layers (GEMVs) of a decode step through Inductor's tuned reduction.

Why: at one token a decoder layer's linear layers are GEMVs that must read their weights once,
and cuBLAS does not reach the bandwidth the GPU has for the small ones. Measured on the H200
inside CUDA graphs at a 42-layer decoder's shapes (``benchmarks/results/h200-2026-12-01/gemv.json``;
read bandwidth of a graphed sum 4.33 TB/s):

    shape (N x K)        cuBLAS    Inductor, coordinate-descent tuned reduction
    o_proj 4096x4096     12.5 us   9.2 us
    qkv    6144x4096     15.6 us   13.3 us
    down   4096x12288    28.7 us   25.9 us
    gate_up 24576x4096   48.0 us   45.3 us

cuBLASLt, cuBLAS without split-K, Inductor's Triton mm templates and vllm's linear dispatch were
no faster than cuBLAS (vllm's skinny-GEMM kernels are ROCm-only); a hand-written Triton GEMV
was between the two. Inductor, with ``coordinate_descent_tuning``, turns an M = 1 matmul into a
multiply + sum reduction and tunes its block sizes: that is what runs here, compiled once per
weight shape (the weight is an argument, so one compiled kernel serves every layer).

The fp32 accumulation order differs from cuBLAS's, so results differ in the last bits of bf16:
this belongs to the fused step, never to the exact one.

Opt-in (a hook's "tuned" step mode, docs/configuration.md): the reduction's block sizes are tuned by
timing at first use, and two processes can pick different ones and so round the same request
differently (two engine runs of one request with these GEMVs parted at think token 693).
Measured on the H200, that decoder's fused step at context 2048
(``benchmarks/results/h200-2026-12-01e/step-probe-0.26``): tuned 5.88 ms/token, the modules'
own cuBLAS GEMMs 6.14, Inductor's deterministic mode (``deterministic``: each reduction's
configuration fixed by its heuristics) 7.50. So the default fused step runs cuBLAS, the same in
every process, and the tuned GEMVs are the 4% faster mode for one process's own consistency only.

A LoRA wrapper of vllm-omni whose adapter is not active on a layer computes exactly its base
layer (``DiffusionBaseLinearLayerWithLoRA.apply`` skips the adapter's matmuls), so it runs the
base layer's GEMV here: a base request after a LoRA request decodes as a base request on a
model without the adapter's wrappers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.reasons import Reason

NO_GEMV = Reason("Inductor GEMVs unavailable",
                 "a CUDA GPU with Triton (the step's linear layers then run through cuBLAS)")
# vllm linear layers whose forward at tensor-parallel size 1 is quant_method.apply(x, weight,
# bias), i.e. F.linear: anything else (LoRA wrappers, quantised weights, a bias returned apart)
# is called as the module itself.
PLAIN_LINEARS = ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear",
                 "RowParallelLinear", "ReplicatedLinear")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The bias is added apart: F.linear with a bias lowers to addmm, which Inductor hands to
    # cuBLAS (seen in the H200 profile: qkv_proj and o_proj, which have biases, stayed cuBLAS
    # kernels); a plain mm is what it turns into the tuned reduction, and the add fuses into it.
    out = F.linear(x, weight)
    return out if bias is None else out + bias


def _silu_mul_linear_add(gate_up: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    # The MLP's tail for one token: residual + down(silu(gate) * up). Compiled as one function, the
    # SiLU-and-multiply is computed where the reduction loads its input and the residual add in
    # its epilogue: one kernel where the step ran three (SiLU * up, the GEMV, the add).
    half = gate_up.shape[-1] // 2
    out = F.linear(F.silu(gate_up[..., :half]) * gate_up[..., half:], weight)
    out = out if bias is None else out + bias
    return residual + out


class Gemv:
    """``gemv(module, x)``: ``module``'s output for ``x`` (batch 1), through the compiled
    reduction when the module is a plain vllm linear layer, else through the module.

    ``mlp_tail(down_proj, gate_up, residual)``: ``residual + down_proj(silu(gate) * up)`` as one
    compiled kernel when ``fuse_mlp_tail`` and ``down_proj`` is plain, else None (the caller runs
    the three steps)."""

    name = "Inductor GEMVs (coordinate-descent tuned)"

    def __init__(self, fuse_mlp_tail: bool = True, deterministic: bool = False):
        # deterministic=True: Inductor's deterministic mode, no tuning by timing (slower than
        # cuBLAS here: the module docstring); the decode step probe times it.
        options = {"coordinate_descent_tuning": True, "deterministic": deterministic}
        self._fn = torch.compile(_linear, dynamic=False, options=options)
        self._tail = torch.compile(_silu_mul_linear_add, dynamic=False, options=options)
        self.fuse_mlp_tail = fuse_mlp_tail

    def mlp_tail(self, module, gate_up: torch.Tensor, residual: torch.Tensor):
        module = base_of_inactive_lora(module)
        if self.fuse_mlp_tail and self.plain(module):
            return self._tail(gate_up, module.weight, module.bias, residual)
        return None

    @staticmethod
    def plain(module) -> bool:
        """Checked at every call (inside a graph: once, at capture): a LoRA wrapper put in
        place later must be called as itself."""
        method = getattr(module, "quant_method", None)
        bias = getattr(module, "bias", None)
        return (type(module).__name__ in PLAIN_LINEARS
                and type(method).__name__ == "UnquantizedLinearMethod"
                and (bias is None or (torch.is_tensor(bias)
                                      and not getattr(module, "skip_bias_add", False)))
                and getattr(module, "tp_size", 1) == 1
                and torch.is_tensor(getattr(module, "weight", None))
                and "forward" not in vars(module)
                and not module._forward_hooks and not module._forward_pre_hooks)

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        base = base_of_inactive_lora(module)
        if self.plain(base):
            return self._fn(x, base.weight, base.bias)
        return module(x)[0]


def base_of_inactive_lora(module):
    """``module``'s base layer when it is a vllm-omni diffusion LoRA wrapper with no adapter
    slice active (it then computes exactly its base layer), else ``module``. Read at every call:
    inside a graph, at capture (graphs are captured per request while LoRA wrappers exist)."""
    active = getattr(module, "_diffusion_lora_active_slices", None)
    if active is None or any(active):
        return module
    base = module.__dict__.get("_diffusion_base_layer_ref")
    return base if isinstance(base, torch.nn.Module) else module


def select_gemv(device) -> Gemv | Reason:
    device = torch.device(device)
    if device.type != "cuda":
        return NO_GEMV.because(f"device is {device}")
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return NO_GEMV.because("torch.utils._triton missing")
    if not has_triton():
        return NO_GEMV.because("Triton not usable on this device")
    return Gemv()


class Projection:
    """``module`` called the way the model calls its projections (``out, bias = proj(x)``), with
    ``gemv`` doing the work: what 0.30's ``_project_and_rope`` is handed for ``qkv_proj``."""

    __slots__ = ("gemv", "module")

    def __init__(self, gemv: Gemv, module):
        self.gemv = gemv
        self.module = module

    def __call__(self, x):
        return self.gemv(self.module, x), None
