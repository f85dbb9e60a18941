"""SenseNova-U1's denoising branch step, fast mode: the generation pathway's layers restated
around their GEMMs, the elementwise work fused by Inductor, the attention through FlashAttention.

Why
    The exact mode replays the pipeline's own step. Its GEMMs already run at the measured matmul
    rate; the rest is per layer a Triton q/k norm + 3-D rope kernel, transposes of q, k and v
    around it, the diffusion attention, RMSNorm, residual adds, SiLU and the multiply as separate
    kernels (0.26: many more). Where a branch step's time goes on each release:
    ``docs/performance.md`` (``benchmarks/results/h200-2026-12-01b``, ``request-0.30.json``);
    a probe, since retired, timed these parts against what this body runs instead
    (``benchmarks/results/h200-2026-12-01c``; docs/performance-history.md, the retired probes).

What runs, per layer (``FastGen``; the same interface as ``denoise.GenForward``)
    pre   (compiled) qkv GEMM, split, per-head RMSNorm of the t half and the h/w half with their
          own weights, rope on the t, h and w parts, q/k/v left in (B, S, H, D);
    then  k and v written into the image rows of the entry's prefix + image buffers;
    attn  FlashAttention (vllm's FA3 on Hopper, FA2 elsewhere, SDPA last) over prefix + image;
    post  (compiled) o_proj, residual add, RMSNorm, gate_up GEMM, SiLU * up, down GEMM, residual
          add, and the next layer's input RMSNorm (the last layer's: the final ``norm_mot_gen``).
    The rope tables are computed once per step (every layer's are the same: checked). RMSNorm,
    the rope tables and the q/k norm + rope are ``ops.py``'s (the exact step's forward and the
    fused decode step take their rope tables from there too).

Precision
    Not the pipeline's bits: the compiled regions round where Inductor's fused kernels do
    (``emulate_precision_casts`` keeps eager's bf16 rounding points) and the attention kernel
    differs. The RMSNorm is restated as the release computes it: ``F.rms_norm`` (0.30) or its
    fp32 cast chain (0.24-0.28). ``compile=False`` with the same attention as the pipeline runs the
    restated math op for op (CPU test: equal to the pipeline's step within bf16 rounding of the
    attention; the retired probe checked each restated part bit for bit against the modules,
    ``benchmarks/results/h200-2026-12-01c``).

Measured (issue #13, H200): the step's GPU work against the pipeline's on 0.26 and 0.30, and the
image's PSNR from the pipeline's with random weights, are in ``docs/performance.md`` (the fast
denoising mode; ``benchmarks/results/h200-2026-12-01c``). The image moves as far from the
pipeline's as vllm-omni's own rounding variants do, short of the 40 dB bar a default that changes
rounding must clear: ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE=fast`` is opt-in and the exact mode
(``graph``) the default.

FP8 (``fp8=``: ``VLLM_OMNI_GRAPHDECODE_FP8`` naming ``sensenova_denoise``): the four linear
layers of every layer run W8A8 (``w8a8.w8a8_linear`` via ``w8a8.linear``: e4m3 copies with a scale
per output channel, each activation row quantised inside the compiled regions, the bias added
after the GEMM). Measured (H200, vllm-omni 0.30, 1024x1024, ``benchmarks/results/h200-2026-12-01g``):
a step of both branches 44.4 ms against the release's 73.3 (the bf16 fast body: 61.6); with random
weights the image is 13.4 dB from the release's; the compiled FP8 step is 2.2-2.9% of max |v|
from its fp32 restatement on the tiny model (GPU test). The copies are 8.11 GB at the real shape.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ...core.reasons import STRUCTURE, Reason
from ...graphs.compiling import (COMPILE_FAILED, FAST_BODY_OPTIONS, CompileFailed, Regions,
                                 dense_strides)
from ...ops.fp8.w8a8 import W8A8Copies, linear
from .ops import qk_norm_rope, rms_norm, rope_tables

Tensor = torch.Tensor


# -- the restated layer, around its attention ---------------------------------------------------

def pre_attention(normed: Tensor, w_qkv: Tensor, b_qkv: Tensor | None, wq, wk, wq_hw, wk_hw,
                  tables, eps: float, cast_chain: bool, heads: int, kv_heads: int, head_dim: int):
    """One layer up to the attention: (q, k, v), each (B, S, heads, D). A weight is a bf16
    tensor or an e4m3 copy (``w8a8.linear``)."""
    b, s = normed.shape[:2]
    qkv = linear(normed, w_qkv, b_qkv)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = qk_norm_rope(q.view(b, s, heads, head_dim), k.view(b, s, kv_heads, head_dim),
                        wq, wk, wq_hw, wk_hw, tables, eps, cast_chain)
    return q, k, v.reshape(b, s, kv_heads, head_dim)


def post_attention(x: Tensor, attn: Tensor, w_o: Tensor, b_o: Tensor | None, w_post: Tensor,
                   w_gate_up: Tensor, w_down: Tensor, w_next: Tensor, eps: float,
                   next_eps: float, cast_chain: bool):
    """One layer after the attention, and the next layer's input norm: (x, normed next)."""
    h = x + linear(attn.flatten(2), w_o, b_o)
    gate, up = linear(rms_norm(h, w_post, eps, cast_chain), w_gate_up).chunk(2, dim=-1)
    out = h + linear(F.silu(gate) * up, w_down)
    return out, rms_norm(out, w_next, next_eps, cast_chain)


# -- structure ----------------------------------------------------------------------------------

def _linear_problem(name: str, module) -> str | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return f"{name} has no 2-D weight"
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{name} weight is {weight.dtype} (quantised)"
    method = type(getattr(module, "quant_method", None)).__name__
    if method not in ("NoneType", "UnquantizedLinearMethod"):
        return f"{name} quant_method {method}"
    if getattr(module, "tp_size", 1) not in (None, 1):
        return f"{name} tensor-parallel"
    return None


def _norm_problem(name: str, module) -> str | None:
    if not isinstance(getattr(module, "weight", None), torch.Tensor):
        return f"{name} has no weight"
    if not isinstance(getattr(module, "variance_epsilon", None), float):
        return f"{name} has no variance_epsilon"
    return None


def cast_chain_norm(norm) -> bool | None:
    """Whether the release's ``Qwen3RMSNorm`` normalises through the fp32 cast chain (True),
    ``F.rms_norm`` (False), or neither that this body knows (None)."""
    try:
        source = inspect.getsource(type(norm).forward)
    except (OSError, TypeError):
        return None
    if "rms_norm(" in source:
        return False
    if "rsqrt" in source and "float32" in source:
        return True
    return None


def structure_problem(language_model, rope_per_layer: bool) -> Reason | None:
    """Why the fast body would not compute what the generation pathway computes; None if it
    would."""
    model = language_model.model
    try:
        layers = model.layers
        kinds = {cast_chain_norm(model.norm_mot_gen)}
        first = layers[0].self_attn
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp_mot_gen
            bad = [p for p in (
                _linear_problem("qkv_proj_mot_gen", attn.qkv_proj_mot_gen),
                _linear_problem("o_proj_mot_gen", attn.o_proj_mot_gen),
                _linear_problem("gate_up_proj", mlp.gate_up_proj),
                _linear_problem("down_proj", mlp.down_proj)) if p]
            norms = {"input_layernorm_mot_gen": layer.input_layernorm_mot_gen,
                     "post_attention_layernorm_mot_gen": layer.post_attention_layernorm_mot_gen,
                     "q_norm_mot_gen": attn.q_norm_mot_gen, "k_norm_mot_gen": attn.k_norm_mot_gen,
                     "q_norm_hw_mot_gen": attn.q_norm_hw_mot_gen,
                     "k_norm_hw_mot_gen": attn.k_norm_hw_mot_gen}
            bad += [p for p in (_norm_problem(n, m) for n, m in norms.items()) if p]
            kinds |= {cast_chain_norm(m) for m in norms.values()}
            if getattr(mlp.gate_up_proj, "bias", None) is not None or \
                    getattr(mlp.down_proj, "bias", None) is not None:
                bad.append("MLP bias")
            if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
                bad.append(f"MLP activation {type(getattr(mlp, 'act_fn', None)).__name__}")
            if attn.q_size != attn.num_heads * attn.head_dim or \
                    attn.kv_size != attn.num_kv_heads * attn.head_dim:
                bad.append("sharded attention heads")
            if rope_per_layer and layer is not layers[0]:
                for rot in ("rotary_emb", "rotary_emb_hw"):
                    if not torch.equal(getattr(attn, rot).inv_freq, getattr(first, rot).inv_freq):
                        bad.append(f"{rot} differs from layer 0's")
            if bad:
                return STRUCTURE.because(f"layer {i}: {', '.join(bad)}")
        if len(kinds) != 1 or None in kinds:
            return STRUCTURE.because("RMSNorm is neither F.rms_norm nor the fp32 cast chain, or "
                                     "mixed")
    except (AttributeError, IndexError, TypeError) as exc:
        return STRUCTURE.because(repr(exc)[:300])
    return None


# -- the body -----------------------------------------------------------------------------------

REGIONS = Regions(pre_attention, post_attention)


def compiled_graphs() -> int:
    """Graphs Inductor compiled for this body in this process (first compiles and recompiles)."""
    return REGIONS.compiled_graphs()


class FastGen:
    """The generation pathway's forward over a branch step's image tokens, fast mode (module
    docstring). Called as ``denoise.GenForward`` is: ``past_key_values`` holds per layer
    ``flash_k_cache`` / ``flash_v_cache`` ``(B, prefix + image, kv_heads, D)`` and
    ``flash_prefix_len``; the image rows are overwritten. ``attention``: from
    ``attention.select_dense_attention``; call ``prepare`` for each buffer shape outside a capture.
    Raises ``CompileFailed`` (compile unavailable here, or a compile that failed).

    ``ops/fp8``: the four linear layers of every layer run W8A8 (``w8a8.w8a8_linear``) from these
    copies, made now (``fp8.nbytes``); ``release_copies`` drops them (sleep level 2, after the
    graphs that read them), and the next call makes them again."""

    def __init__(self, language_model, layout, attention, output, *, compile: bool = True,
                 fp8: W8A8Copies | None = None):
        problem = structure_problem(language_model, layout.rope_per_layer)
        if problem is not None:
            raise ValueError(problem.describe())
        self.lm = language_model
        self.layout = layout
        self.attention = attention
        self.output = output
        self.compile = compile
        model = language_model.model
        layers = model.layers
        self.cast_chain = bool(cast_chain_norm(model.norm_mot_gen))
        first = layers[0].self_attn
        self._rope_modules = ((first.rotary_emb, first.rotary_emb_hw) if layout.rope_per_layer
                              else (model.rotary_emb, model.rotary_emb_hw))
        self.scale = float(getattr(first, "scaling", first.head_dim ** -0.5))
        self._input_norm = (layers[0].input_layernorm_mot_gen.weight,
                            layers[0].input_layernorm_mot_gen.variance_epsilon)
        self._pre_args, self._post_args = [], []
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp_mot_gen
            nxt = (layers[i + 1].input_layernorm_mot_gen if i + 1 < len(layers)
                   else model.norm_mot_gen)
            self._pre_args.append((
                a.qkv_proj_mot_gen.weight, getattr(a.qkv_proj_mot_gen, "bias", None),
                a.q_norm_mot_gen.weight, a.k_norm_mot_gen.weight, a.q_norm_hw_mot_gen.weight,
                a.k_norm_hw_mot_gen.weight))
            self._post_args.append((
                a.o_proj_mot_gen.weight, getattr(a.o_proj_mot_gen, "bias", None),
                layer.post_attention_layernorm_mot_gen.weight, mlp.gate_up_proj.weight,
                mlp.down_proj.weight, nxt.weight, layer.post_attention_layernorm_mot_gen
                .variance_epsilon, nxt.variance_epsilon))
        self._shape = (first.num_heads, first.num_kv_heads, first.head_dim,
                       first.q_norm_mot_gen.variance_epsilon)
        self.fp8 = fp8
        if fp8 is not None:  # made at load, so the load's memory shows them
            for i in range(len(layers)):
                self._weights(i)
        self.options = dict(FAST_BODY_OPTIONS)  # Inductor's, when compile is on
        self._pre, self._post = REGIONS.select(layers[0].self_attn.qkv_proj_mot_gen.weight.device,
                                               compile=compile, **self.options)

    def prepare(self, batch: int, image: int, total: int, device) -> None:
        """What the attention needs for these shapes (at bind, outside any capture)."""
        self.attention.prepare(batch, image, total, device)

    @property
    def fp8_nbytes(self) -> int:
        return self.fp8.nbytes if self.fp8 is not None else 0

    def release_copies(self) -> None:
        if self.fp8 is not None:
            self.fp8.release()

    def _weights(self, i: int):
        """Layer ``i``'s region arguments: the bf16 weights, or their e4m3 copies in their place."""
        pre, post = self._pre_args[i], self._post_args[i]
        if self.fp8 is None:
            return pre, post
        c = self.fp8
        return (c(pre[0]), *pre[1:]), (c(post[0]), post[1], post[2], c(post[3]), c(post[4]),
                                       *post[5:])

    def tables(self, hidden: Tensor, indexes: Tensor):
        return rope_tables(*self._rope_modules, hidden, indexes)

    def __call__(self, inputs_embeds, image_gen_indicators, indexes, attention_mask,
                 past_key_values, use_cache=True, compute_logits=False, **kwargs):
        heads, kv_heads, head_dim, qk_eps = self._shape
        x = dense_strides(inputs_embeds)
        tables = self.tables(x, indexes)
        w_in, eps_in = self._input_norm
        normed = rms_norm(x, w_in, eps_in, self.cast_chain)
        for i, cache in enumerate(past_key_values.layers):
            pre, post = self._weights(i)
            q, k, v = self._pre(normed, *pre, tables, qk_eps, self.cast_chain, heads, kv_heads,
                                head_dim)
            prefix = cache.flash_prefix_len
            keys, values = cache.flash_k_cache, cache.flash_v_cache
            keys[:, prefix:].copy_(k)
            values[:, prefix:].copy_(v)
            out = self.attention(q, keys, values, softmax_scale=self.scale)
            x, normed = self._post(x, out, *post, self.cast_chain)
        return self.output(hidden_states=normed, past_key_values=past_key_values)


__all__ = ["COMPILE_FAILED", "CompileFailed", "FastGen", "STRUCTURE", "cast_chain_norm",
           "compiled_graphs", "post_attention", "pre_attention", "qk_norm_rope", "rms_norm",
           "structure_problem"]
