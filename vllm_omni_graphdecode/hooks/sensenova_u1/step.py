"""SenseNova-U1's one-token decode step over paged K/V: what a CUDA graph records.

Each attention layer's ``forward_und`` gets a single-token branch keyed on this plugin's own
keyword (``PAGED_KWARG``), passed down the model's ``**kwargs`` chain (``ForCausalLM.forward`` ->
``Model.forward`` -> ``DecoderLayer.forward`` -> ``_forward_und`` -> ``Attention.forward`` ->
``forward_und``, unchanged in vllm-omni 0.24-0.30): it projects and ropes as the model does (or
through the fused step's once-per-token tables, ``fused_step.py``), then attends through
``paged.PagedKVCache``. The branch is keyed on the keyword, not on ``attention_mask is
None``: vllm-omni 0.24-0.28 pass an all-zeros mask for one query token. Without the keyword every
patched method runs the model's own code.

``Step`` is the ``session.StepModel`` for this model: its static inputs (token, rope indexes)
and the forward a graph records. ``paged_decoder(lm, ...)`` is the standalone API the benchmarks
and tests drive::

    dec = paged_decoder(lm, kernel=attention.select_kernel("cuda", 128), buckets=(512, 1024))
    dec.begin(past_key_values)            # prefilled DynamicCache, batch 1
    for ...:
        logits = dec.step(token, t_index)  # token: (1,) long tensor or int; t_index: its rope time
                                           # index (the pipeline's t_idx + 1)
    dec.write_back(past_key_values)       # the cache now holds prefix + decoded tokens
    dec.release()
"""

from __future__ import annotations

import functools

import torch

from ...core.reasons import Reason
from ...decode.session import PagedDecoder
from ...ops import layer_ops
from . import layouts
from .step_args import PAGED_KWARG, StepArgs

MODEL = "sensenova_u1"


class Step:
    """The ``session.StepModel`` of a SenseNova-U1 language model. ``fusion``: a
    ``fused_step.Fusion`` or None (the model's own step); ``kv_writer``: ``layer_ops.KVWriter``
    or None (two ``index_copy_`` per layer)."""

    def __init__(self, language_model, layout: layouts.Layout, *, fusion=None, kv_writer=None):
        layouts.check_model(language_model, layout)
        patch_attention(language_model, layout)
        if fusion is not None:
            fusion.patch_layers(language_model)
        attn = layouts.attention_modules(language_model)[0]
        self.lm = language_model
        self.fusion = fusion
        self.writer = kv_writer
        self.num_layers = len(language_model.model.layers)
        self.kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.device = next(language_model.parameters()).device
        self.input_ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        # rows: t, h, w rope indexes; decode tokens are text, so h = w = 0 (as _ar_step builds)
        self.indexes = torch.zeros(3, 1, dtype=torch.long, device=self.device)

    def set_inputs(self, token, position: int) -> None:
        if torch.is_tensor(token):
            self.input_ids.copy_(token.reshape(1, 1))
        else:
            self.input_ids.fill_(int(token))
        self.indexes[0].fill_(position)

    def load_inputs(self, token: torch.Tensor, position: torch.Tensor) -> None:
        """Device-side ``set_inputs`` from (1,) long device tensors (recorded in a graph)."""
        self.input_ids.view(1).copy_(token)
        self.indexes[0].copy_(position)

    def advance(self, token: torch.Tensor) -> None:
        """Device-side: ``token`` is the next step's input, one position later."""
        self.input_ids.view(1).copy_(token)
        self.indexes[0].add_(1)

    def forward(self, cache) -> torch.Tensor:
        head = self.fusion.linear_head if self.fusion is not None else None
        if head is None:
            return self.lm(input_ids=self.input_ids, indexes=self.indexes, past_key_values=None,
                           use_cache=False, **{PAGED_KWARG: StepArgs(cache, self.fusion)}).logits
        # The FP8 lm_head (VLLM_OMNI_GRAPHDECODE_FP8=...,sensenova_lm_head) or the bf16 row
        # GEMV's (..._SENSENOVA_STEP=rowgemv): the model stops at the final norm's hidden state
        # and the linears project it (what the logits processor would do with the bf16 head;
        # head_not_copyable checked it does nothing more).
        hidden = self.lm(input_ids=self.input_ids, indexes=self.indexes, past_key_values=None,
                         use_cache=False, compute_logits=False,
                         **{PAGED_KWARG: StepArgs(cache, self.fusion)}).hidden_states
        logits = head.logits(hidden, self.lm.lm_head)
        if logits is None:  # the head was replaced or wrapped since: the model's own
            logits = self.lm.logits_processor(self.lm.lm_head, hidden)
        return logits


NO_KV_WRITER_HERE = Reason("two-kernel K/V write", "run on a CUDA GPU with a CUDA build of vllm")


def select_kv_writer(device, dtype) -> "layer_ops.KVWriter | Reason":
    if torch.device(device).type != "cuda":
        return NO_KV_WRITER_HERE.because(f"device is {device}")
    return layer_ops.select_kv_writer(device, dtype)


def paged_decoder(language_model, *, kernel, buckets, graphs: bool = True, verify: bool = False,
                  layout: layouts.Layout | None = None, fusion="auto",
                  kv_writer="auto", tokens_per_launch: int = 1) -> PagedDecoder:
    """A standalone paged decoder for ``language_model`` (see the module docstring).

    ``fusion`` / ``kv_writer``: "auto" selects what this device and layout support; None runs the
    model's own step; or pass one. ``tokens_per_launch``: for ``PagedDecoder.lookahead``.
    Patches the model's attention (idempotent, inert without ``PAGED_KWARG``).
    """
    layout = layout or layouts.detect_layout(language_model)
    param = next(language_model.parameters())
    if isinstance(fusion, str):
        from . import fused_step

        fusion = fused_step.Fusion.select(language_model, layout, param.device, param.dtype)
        fusion = fusion if fusion.active else None
    if isinstance(kv_writer, str):
        kv_writer = select_kv_writer(param.device, param.dtype)
        kv_writer = None if isinstance(kv_writer, Reason) else kv_writer
    step = Step(language_model, layout, fusion=fusion, kv_writer=kv_writer)
    return PagedDecoder(step, name=MODEL, kernel=kernel, buckets=buckets, graphs=graphs,
                        verify=verify, tokens_per_launch=tokens_per_launch)


def patch_attention(language_model, layout: layouts.Layout, patches=None) -> None:
    """Give every attention layer the paged single-token branch. Idempotent; inert without
    ``PAGED_KWARG``. ``patches`` (``patching.Patches``): where ``unwire`` finds what to undo."""
    for attn in layouts.attention_modules(language_model):
        current = attn.forward_und
        if not getattr(current, "__graphdecode__", False):
            patched = _paged_forward_und(attn, current, layout)
            if patches is not None:
                patches.set(attn, "forward_und", patched)
            else:
                attn.forward_und = patched


def _paged_forward_und(attn, original, layout: layouts.Layout):
    @functools.wraps(original)
    def forward_und(hidden_states, indexes, attention_mask, past_key_values=None, **kwargs):
        step = kwargs.get(PAGED_KWARG)
        if step is None:
            return original(hidden_states, indexes, attention_mask, past_key_values, **kwargs)
        # One query token attends to every valid cached key, so the mask (all zeros in 0.24-0.28,
        # None in 0.30) carries nothing and is not read.
        fusion = step.fusion
        if fusion is not None and fusion.rope_store is not None:
            # q/k norm + rope and the K/V write in one launch (fused_step.project_rope_store)
            query = fusion.project_rope_store(attn, hidden_states,
                                              layout.rope_input(indexes, kwargs), step)
            out = step.cache.attend_stored(attn.layer_idx, query, attn.scaling)
            out = out.reshape(*hidden_states.shape[:-1], -1)
            return fusion.attention_out(attn.o_proj, out, step)
        if fusion is not None and fusion.rope_kernel is not None:
            query, key, value = fusion.project_and_rope(attn, hidden_states, indexes, step)
        else:
            qkv_proj = attn.qkv_proj if fusion is None else fusion.projection(attn.qkv_proj)
            query, key, value = attn._project_and_rope(
                hidden_states, layout.rope_input(indexes, kwargs), qkv_proj, attn.q_norm,
                attn.k_norm, attn.q_norm_hw, attn.k_norm_hw)
        out = step.cache.attend(attn.layer_idx, query, key, value, attn.scaling)
        out = out.reshape(*hidden_states.shape[:-1], -1)
        if fusion is not None:
            return fusion.attention_out(attn.o_proj, out, step)
        out, _ = attn.o_proj(out)
        return out

    forward_und.__graphdecode__ = True
    return forward_und
