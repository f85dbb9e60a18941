"""Qwen-Image-2.1's cached step, fast mode: the block loop with the fastest kernels this GPU has.

Why this exists
    The exact mode replays diffusers' own blocks (per layer a ``torch.cat`` of prefix and target
    K/V, SDPA, a dozen unfused elementwise kernels). This is the same math with three changes, still
    captured as one graph per entry by ``graphs/prefix.py``:
    1. ``KVBuffers``: per layer one K and one V buffer ``(B, prefix + target, H, D)``
       (``graphs/prefix.py`` allocates them per entry); the prefix is written once at bind, each
       step writes the target's K/V into the tail in place (no cat).
    2. ``select_dense_attention``: vllm's FA3 on Hopper, FA2 elsewhere, SDPA last; chosen once,
       with the reason each faster kernel was skipped.
    3. ``FastBlocks(compile=True)``: Inductor fuses the elementwise work in two regions shared by
       all 32 blocks (weights are arguments, so nothing per module is guarded): *pre-attention*
       (norm1 + modulate, q/k/v, q/k RMSNorm, rotary) and *post-attention* (to_out, gated residual,
       norm2 + modulate, SwiGLU, gated residual). The attention runs between them, uncompiled.
       At batch 1 (the tail is one run of memory) the pre-attention region stores k and v
       straight into the tail, handed over with a fresh tensor's strides (``_pre_into``): the
       rotary's output is written once, where a separate copy read it back and wrote it again;
       at batch 2 and more (a strided tail) the region returns them and a copy writes the tail.
       No prefix length reaches a compiled region (the tail's offset is no guard), so prompts
       of any length reuse the code compiled for a (batch, target shape).

Numbers: what each of the three changes saves at the real shape, and the fast step's distance
from diffusers' cached forward, are in ``docs/performance.md`` (the qwen probe,
``benchmarks/results/h200-2026-11-30c/qwen-fast-probe.json``).

Precision
    ``compile=False`` with SDPA is diffusers' cached block op for op (``RMSNorm``,
    ``apply_rotary_emb_qwen(use_real=False)`` and ``_modulate`` are restated, not called, so the
    regions are plain functions of tensors): bit for bit on CPU in fp32 and bf16 (the tests).
    ``compile=True`` changes two things. Rotary runs in real arithmetic (Inductor has no complex
    codegen and would fall back to eager kernels; on CPU the two forms are bitwise equal). And
    Inductor's ``emulate_precision_casts`` is on (``emulate_casts=True``): a fused kernel rounds to
    bf16 wherever eager materializes a bf16 tensor instead of carrying fp32 through, so only sum
    order and libdevice ulps differ. Measured on CPU (tiny model, bf16): bit-exact with it, 0.625
    max abs diff on outputs up to 25 without. FA3/FA2 accumulate in fp32 like SDPA's flash kernel
    (6e-4 max abs from fp32 SDPA for the paged call on the H200).

Memory per entry: 2 x layers x B x (prefix + target) x H x D x dtype bytes; the tail adds 32 MiB
per tensor per layer at 1024x1024 bf16 (2 GiB for 32 layers) over prefix-only buffers.
``fuse_qkv=True`` copies 3 x hidden^2 weights per layer (3 GiB at the real shape), once at
construction: rebuild ``FastBlocks`` after the weights change.

FP8 (``fp8=True``, ``VLLM_OMNI_GRAPHDECODE_FP8`` naming ``qwen_image_21``): the seven linear
layers of every block run W8A8 (``w8a8.w8a8_linear``: e4m3 weights with a scale per output channel,
made here once, and each activation row quantised on the fly), so the rounding moves further from
diffusers' (the PSNR is in docs/performance.md). The e4m3 copies add half the bf16 bytes of those
layers (6.98 GB at the real shape); the bf16 weights stay for the extract step and the exact mode.
The GEMMs accumulate with Hopper's FP8 fast accumulation (``fp8_fast_accum``, as vLLM's CUTLASS
FP8 kernels do; ``benchmarks/probes/fp8_accum.py`` times both and gives each one's error).

Preconditions (the caller checks them at bind): the step's rows are the target image only, with an
all-True modulation mask (``mask_all_target``; the body reads the real-timestep rows
``modulation[:-1]``); no padded text mask; ``structure_problem`` is None. Not covered: padded text
(key_valid), FA4, FP8 attention (FA3's measured no faster at this shape, 23x the error:
docs/performance-history.md, ``benchmarks/results/h200-2026-12-01g``). Dynamo's
``recompile_limit`` (default 8) bounds the (batch, target shape, option) sets per process; past it
a call raises ``CompileFailed`` and the exact step runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.reasons import STRUCTURE, Reason
from ...graphs.compiling import (  # noqa: F401 - the names callers read from here
    COMPILE_FAILED,
    FAST_BODY_OPTIONS,
    NO_COMPILE,
    NO_CXX,
    NO_TRITON,
    CompileFailed,
    Regions,
    compile_supported,
    dense_strides as _dense_strides,
)
from ...ops.fp8.w8a8 import W8A8Copies, linear

Tensor = torch.Tensor


def mask_all_target(mask: Tensor) -> bool:
    """Whether a cached step's modulation mask (bool, ``(T,)``) selects the real-timestep row for
    every row, as the fast body assumes. Syncs the host: call it at bind."""
    return mask.dtype == torch.bool and bool(mask.all())


# -- K/V buffers --------------------------------------------------------------------------------

class KVBuffers:
    """Per layer one K and one V buffer, ``(batch, prefix_len + target_len, heads, head_dim)``,
    allocated elsewhere (``graphs/prefix.py``'s ``StaticBuffers.kv``; tests and probes:
    ``testing.qwen_fast.kv_buffers``). ``prefix``: per layer views of the first ``prefix_len`` rows
    (written once per request); ``tails``: of the rest, the target's K/V of the current step
    (written in place by the fast body). Allocates nothing."""

    def __init__(self, kv: list[tuple[Tensor, Tensor]], prefix_len: int):
        self.prefix_len, self.target_len = prefix_len, kv[0][0].shape[1] - prefix_len
        self.k, self.v = [k for k, _ in kv], [v for _, v in kv]
        self.prefix = [(k[:, :prefix_len], v[:, :prefix_len]) for k, v in kv]
        self.tails = [(k[:, prefix_len:], v[:, prefix_len:]) for k, v in kv]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


# -- the block body -----------------------------------------------------------------------------

def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """diffusers' ``RMSNorm.forward`` with a weight and no bias, op for op."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def _rope(x: Tensor, rotary: Tensor, real: bool) -> Tensor:
    """``apply_rotary_emb_qwen(x, freqs, use_real=False)``; ``rotary`` is ``view_as_real(freqs)``,
    ``(T, D // 2, 2)`` fp32. ``real``: the same product in real arithmetic (Inductor fuses it)."""
    if not real:
        x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(x_c * torch.view_as_complex(rotary).unsqueeze(1)).flatten(3).type_as(x)
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = rotary[:, None, :, 0], rotary[:, None, :, 1]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(3).type_as(x)


def _pre_attention(x, modulation, rotary, qkv, norm_q, norm_k, ln_eps: float, q_eps: float,
                   k_eps: float, head_dim: int, real_rope: bool):
    """norm1 + modulate, q/k/v, q/k RMSNorm, rotary. x ``(B, T, dim)``; modulation ``(B + 1,
    4 * dim)``: [scale1, gate1, scale2, gate2], row -1 is the t=0 row the target never reads;
    qkv ``(w_q, w_k, w_v)`` or ``(w_qkv,)``. Returns q, k, v ``(B, T, H, D)`` in x's dtype."""
    dim = x.shape[-1]
    h = F.layer_norm(x, (dim,), eps=ln_eps) * (1 + modulation[:-1, None, :dim])
    q, k, v = linear(h, qkv[0]).chunk(3, dim=-1) if len(qkv) == 1 else (linear(h, w) for w in qkv)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))
    q = _rms_norm(q, norm_q, q_eps).to(v.dtype)
    k = _rms_norm(k, norm_k, k_eps).to(v.dtype)
    return _rope(q, rotary, real_rope), _rope(k, rotary, real_rope), v


def _pre_into(x, modulation, rotary, k_out, v_out, *rest):
    """``_pre_attention`` writing k and v into ``k_out`` / ``v_out`` (the step's tail, batch 1);
    returns q."""
    q, k, v = _pre_attention(x, modulation, rotary, *rest)
    k_out.copy_(k)
    v_out.copy_(v)
    return q


def _post_attention(x, attn, modulation, w_out, w_gate, w_up, w_down, ln_eps: float):
    """to_out, gated residual, norm2 + modulate, SwiGLU, gated residual. attn ``(B, T, H, D)``."""
    dim = x.shape[-1]
    x = x + modulation[:-1, None, dim:2 * dim].tanh() * linear(attn.flatten(2, 3), w_out)
    h = F.layer_norm(x, (dim,), eps=ln_eps) * (1 + modulation[:-1, None, 2 * dim:3 * dim])
    x = x + modulation[:-1, None, 3 * dim:].tanh() * linear(
        F.silu(linear(h, w_gate)) * linear(h, w_up), w_down)
    if x.dtype == torch.float16:
        x = x.clip(-65504, 65504)
    return x


REGIONS = Regions(_pre_attention, _post_attention, _pre_into)


def compiled_graphs() -> int:
    """Graphs Inductor compiled for fast blocks in this process (first compiles and recompiles)."""
    return REGIONS.compiled_graphs()


_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer",
            "img_mlp.proj", "img_mlp.out")


def structure_problem(transformer) -> Reason | None:
    """Why the fast body would not compute what these blocks compute; None when it would."""
    for i, block in enumerate(transformer.transformer_blocks):
        try:
            m = dict(block.named_modules())
            attn = block.attn
            bad = [n for n in _LINEARS if type(m[n]) is not torch.nn.Linear or m[n].bias is not None]
            bad += [n for n in ("img_norm1", "img_norm2") if type(m[n]) is not torch.nn.LayerNorm
                    or m[n].weight is not None or m[n].bias is not None]
            bad += [n for n in ("attn.norm_q", "attn.norm_k") if type(m[n]).__name__ != "RMSNorm"
                    or m[n].weight is None or m[n].bias is not None]
            if type(block.img_mlp.activation_fn) is not torch.nn.SiLU:
                bad.append("img_mlp.activation_fn")
            if type(attn.processor).__name__ not in ("QwenImage21AttnProcessor",
                                                     "QwenImage21FlexAttnProcessor"):
                bad.append(f"attn.processor ({type(attn.processor).__name__})")
            if attn.to_q.out_features != attn.inner_dim or attn.inner_dim % attn.heads:
                bad.append("attn heads (sharded or uneven)")
        except (AttributeError, KeyError, TypeError) as exc:
            return STRUCTURE.because(f"block {i}: {exc!r}")
        if bad:
            return STRUCTURE.because(f"block {i}: {', '.join(bad)}")
    return None


class FastBlocks:
    """All transformer blocks of a Qwen-Image-2.1 cached step, fast mode (module docstring).

    ``attention``: from ``select_dense_attention``. ``compile``: Inductor regions (raises
    ``CompileFailed`` here when ``compile_supported`` says no, and from a call whose compile
    fails). ``fuse_qkv``: one GEMM for q/k/v over a concatenated copy of the weights. Raises
    ValueError when ``structure_problem`` finds one. Workflow::

        blocks = FastBlocks(transformer, attention, compile=True)   # once per model
        buffers = KVBuffers(kv, prefix_len)                        # at bind, prefix written
        blocks.prepare(buffers)                                    # at bind, outside capture
        hidden = blocks(hidden, modulation, rotary, buffers)       # each step, capturable
    """

    def __init__(self, transformer, attention, *, compile: bool = False, fuse_qkv: bool = False,
                 emulate_casts: bool = True, fp8: bool = False, fp8_fast_accum: bool = True):
        problem = structure_problem(transformer)
        if problem is not None:
            raise ValueError(problem.describe())
        self.attention = attention
        self.compile = compile
        blocks = transformer.transformer_blocks
        self.head_dim = blocks[0].attn.inner_dim // blocks[0].attn.heads
        # Per block: the pre region's arguments after (x, modulation, rotary), the post region's
        # after (x, attn, modulation). Weights by reference, except a fused QKV copy.
        self._pre_args, self._post_args = [], []
        for b in blocks:
            a, mlp = b.attn, b.img_mlp
            qkv = (a.to_q.weight, a.to_k.weight, a.to_v.weight)
            if fuse_qkv:
                with torch.no_grad(), torch.inference_mode(False):
                    qkv = (torch.cat(qkv, dim=0),)
            post = (a.to_out[0].weight, mlp.gate_layer.weight, mlp.proj.weight, mlp.out.weight)
            self._pre_args.append((qkv, a.norm_q.weight, a.norm_k.weight, b.img_norm1.eps,
                                   a.norm_q.eps, a.norm_k.eps, self.head_dim, compile))
            self._post_args.append((*post, b.img_norm2.eps))
        # e4m3 copies, one scale per output channel (the bf16 weights stay), made now so that the
        # load's memory shows them; ``release_copies`` drops them (sleep level 2).
        self.copies = W8A8Copies(fast_accum=fp8_fast_accum) if fp8 else None
        for i in range(len(blocks) if fp8 else 0):
            self._weights(i)
        self.fp8 = fp8
        self.options = {**FAST_BODY_OPTIONS, "emulate_precision_casts": emulate_casts}  # Inductor's
        self._pre, self._post, self._pre_into = REGIONS.select(
            blocks[0].attn.to_q.weight.device, compile=compile, **self.options)

    def _weights(self, i: int):
        """Block ``i``'s region arguments, with the e4m3 copies in place of the weights (fp8)."""
        pre, post = self._pre_args[i], self._post_args[i]
        if self.copies is None:
            return pre, post
        c = self.copies
        return (tuple(c(w) for w in pre[0]), *pre[1:]), (*(c(w) for w in post[:4]), post[4])

    def release_copies(self) -> None:
        """Drop the e4m3 copies (after the graphs that read them); the next call makes them
        again from the weights present then."""
        if self.copies is not None:
            self.copies.release()

    def prepare(self, buffers: KVBuffers) -> None:
        """Build what the attention needs for these buffers' shapes (call at bind)."""
        k = buffers.k[0]
        self.attention.prepare(k.shape[0], buffers.target_len, k.shape[1], k.device)

    def __call__(self, hidden: Tensor, modulation: Tensor, rotary: Tensor, buffers: KVBuffers) -> Tensor:
        """All blocks. hidden ``(B, T, dim)``: the target rows after ``img_in``; modulation
        ``(B + 1, 4 * dim)``: ``transformer.modulation(temb)``; rotary ``(T, D // 2)`` complex64:
        the target rows' rotary (or its ``view_as_real``); buffers: prefix written. Returns
        ``(B, T, dim)``. No host sync, no data-dependent allocation or branch: capturable."""
        if hidden.shape[0] + 1 != modulation.shape[0] or hidden.shape[1] != buffers.target_len:
            raise ValueError(f"hidden {tuple(hidden.shape)}, modulation {tuple(modulation.shape)}, "
                             f"buffers for {buffers.target_len} target tokens")
        for i in range(len(self._pre_args)):
            hidden = self.block(i, hidden, modulation, rotary, buffers)
        return hidden

    def block(self, i: int, hidden: Tensor, modulation: Tensor, rotary: Tensor,
              buffers: KVBuffers) -> Tensor:
        """Block ``i`` alone; arguments as for the call. Writes layer ``i``'s target K/V."""
        rotary = torch.view_as_real(rotary) if rotary.is_complex() else rotary
        hidden = _dense_strides(hidden)
        pre, post = self._weights(i)
        k_tail, v_tail = buffers.tails[i]
        if k_tail.is_contiguous() and v_tail.is_contiguous():  # batch 1
            q = self._pre_into(hidden, modulation, rotary, _dense_strides(k_tail),
                               _dense_strides(v_tail), *pre)
        else:
            q, k, v = self._pre(hidden, modulation, rotary, *pre)
            k_tail.copy_(k)
            v_tail.copy_(v)
        out = self.attention(q, buffers.k[i], buffers.v[i])
        return self._post(hidden, out, modulation, *post)
