"""Qwen-Image-2.1 (diffusers ``QwenImage21Transformer2DModel``): cached denoising steps as CUDA graphs.

Why this exists
    Qwen-Image-2.1's pipeline runs step 0 with ``kv_cache_mode="extract"`` (the whole joint sequence,
    storing the text and condition-image K/V of every layer, post-RoPE, ``(B, prefix, heads,
    head_dim)``) and every later step with ``"cached"``: only the target image's tokens are recomputed,
    each layer attending over ``torch.cat([cached_k, k])``. A cached step has the same shapes for the
    whole request. ``prefix_graph`` captures it once per entry and replays it; this file is everything
    Qwen-specific: what it reads from diffusers, eligibility, the step body and the wiring.

What runs where on a cached step
    once per request branch (bind), eager: the target's rotary rows and modulation mask from the
        model's own ``pos_embed`` and ``build_token_metadata`` (host syncs: ``.tolist()``,
        ``nonzero``, ``int()``), checked against the cached prefix length; the prefix K/V copied into
        buffers the request owns, and the request's cache re-pointed at them (so they are not held
        twice).
    every step, eager: a few Python checks and two copies (latents, timestep). No host sync.
    captured: ``img_in``, timestep embedding and the shared modulation, all blocks (each with its
        ``torch.cat`` over the prefix), ``norm_out``, ``proj_out``.
    The forward's prologue (text projection, ``repeat_interleave``, rotary over the whole sequence,
    token metadata, boolean-index scatter) does not run on a cached step at all: what it yields for
    the target rows is fixed per request. Results equal diffusers' own cached forward bit for bit on
    CPU (tests/test_qwen_image_21.py); on GPU the graph is asserted equal to the eager static step.

Numbers
    Reported upstream (A800, 1024x1024, 50 steps, CFG 4), for graphs together with other attention
    work: text-to-image 8,863 -> 7,958 ms, two-reference edit 14,043 -> 10,380 ms; SGLang saw no
    end-to-end gain on an RTX 4090. Measure here with ``bench_cached_step`` (below); no figure in this
    file is ours until that has run on the H200.

Runs eagerly, each with its own reason in ``stats`` (logged once): not a CUDA device; autograd on;
padded text mask (``encoder_hidden_states_mask`` set: the masked path depends on its contents);
sequence/ring/tensor parallel or HSDP; torch.compile'd blocks; offload or hooks on the model or
blocks; weights not resident on the device; dynamic LoRA wrappers (peft, vLLM); a custom attention
processor; quantized prefix K/V; prefix K/V not populated or not matching the request's layout; and,
from ``prefix_graph``, capacity, OOM, capture failure and verify mismatch. The extract step always
runs as diffusers runs it.

Use without vLLM-Omni (bare diffusers)::

    from diffusers import QwenImage21Pipeline
    from vllm_omni_graphdecode.hooks import qwen_image_21

    pipe = QwenImage21Pipeline.from_pretrained(path, torch_dtype=torch.bfloat16).to("cuda")
    graphs = qwen_image_21.enable(pipe)   # or enable(pipe.transformer); verify=, max_entries=
    image = pipe(prompt).images[0]        # step 0 eager, steps 1.. replay a graph
    graphs.disable()                      # the transformer's own forward again

Under vLLM-Omni, ``loading`` calls ``wire`` for the diffusers adapter's inner pipeline
(``--diffusion-load-format diffusers``). Sleep level 2 releases every graph (``_attach_release``).

Delete this file when diffusers or vLLM-Omni captures the cached step itself; until then the hook
stands aside when the model already carries one of ``INTREE_GRAPH_ATTRS``.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from typing import Any

import torch

from ... import config, stats
from ...prefix_graph import PrefixGraphs, PrefixKey, StaticBuffers
from .. import HookRefused, check_signature

MODEL = "qwen_image_21"

# What this hook reads from diffusers. Identical in 0.41.0, 0.42.0 and 0.42.1 (0.41.0 splits heads by
# count instead of by head_dim, inside the attention, which this hook does not touch). Checked when
# wiring: whatever moved leaves the model as it is, with the reason.
DIFFUSERS_MODULE = "diffusers.models.transformers.transformer_qwenimage21"
SIGNATURES = (
    ("QwenImage21Transformer2DModel", "forward",
     ("self", "hidden_states", "encoder_hidden_states", "timestep", "img_shapes", "img_mask",
      "encoder_hidden_states_mask", "attention_kwargs", "kv_cache", "kv_cache_mode", "return_dict")),
    ("QwenImage21Transformer2DModel", "build_token_metadata", ("image_pad_mask", "img_shapes")),
    ("QwenImage21TransformerBlock", "forward",
     ("self", "hidden_states", "modulation", "rotary_emb", "attention_mask", "target_token_mask",
      "layer_cache", "kv_cache_mode")),
    ("QwenImage21AdaLayerNormContinuous", "forward",
     ("self", "hidden_states", "conditioning_embedding", "target_token_mask")),
    ("QwenImage21TimestepProjEmbeddings", "forward", ("self", "timestep", "hidden_states")),
    ("QwenImage21Rope", "forward", ("self", "img_shapes", "image_pad_mask", "device")),
    ("QwenImage21KVCache", "get_layer", ("self", "layer_idx")),
    ("QwenImage21KVLayerCache", "store", ("self", "k", "v")),
)
MODULE_NAMES = ("QwenImage21KVLayerCache", "QwenImage21AttnProcessor", "QwenImage21FlexAttnProcessor",
                "_IMG_TOKENS_PER_SLOT")
TRANSFORMER_ATTRS = ("transformer_blocks", "img_in", "time_text_embed", "modulation", "norm_out",
                     "proj_out", "pos_embed", "build_token_metadata")
# A model that captures its own cached step (a future in-tree vLLM-Omni Qwen-Image-2.1, following
# the SenseNova-U1 convention of 0.30) carries one of these; ours are marked ``__graphdecode__``.
INTREE_GRAPH_ATTRS = ("release_captured_graphs", "capture_cached_step", "cached_step_graph")

# Reasons a cached step runs eagerly: (reason, what to change). One each, counted in stats.
NOT_CUDA = ("not on a CUDA device", "run the transformer on an NVIDIA GPU")
AUTOGRAD = ("autograd is enabled", "call the pipeline under torch.no_grad() (diffusers pipelines do)")
PADDED = ("padded text mask: encoder_hidden_states_mask is set, and the masked attention depends on "
          "its contents", "send prompts of one length per batch (diffusers drops an all-valid mask)")
PARALLEL = ("sequence/ring/tensor parallel or HSDP sharding on the transformer",
            "serve one replica per GPU without context parallelism or sharded weights")
COMPILED = ("torch.compile'd transformer blocks", "do not compile the transformer or its blocks")
HOOKS = ("offload or forward hooks on the transformer or its blocks (accelerate, diffusers)",
         "disable CPU/sequential/group offload and diffusers cache hooks")
NOT_RESIDENT = ("transformer weights are not resident on the step's device",
                "keep the whole transformer on the GPU (no offload)")
LORA = ("dynamic LoRA wrappers on the transformer (peft / vLLM LoRA layers)",
        "fuse the LoRA into the weights (fuse_lora, then unload_lora_weights) or serve without it")
PROCESSOR = ("an attention processor this hook does not know",
             "use QwenImage21AttnProcessor or QwenImage21FlexAttnProcessor")
QUANT_KV = ("quantized prefix K/V: the cache does not hold plain tensors in the model's dtype",
            "keep the prefix K/V cache unquantized")
NOT_POPULATED = ("prefix K/V not populated: no extract step ran for this cache",
                 "run step 0 with kv_cache_mode='extract' (the pipeline does)")
LAYOUT = ("prefix K/V do not match the request's token layout (no key for this step)",
          "report this with img_shapes and the cached prefix length")


class _Diffusers:
    """The diffusers names this hook uses, resolved once (diffusers is imported only when a model
    could be one of its own)."""

    def __init__(self, module):
        self.module = module
        self.transformer_cls = module.QwenImage21Transformer2DModel
        self.layer_cache_cls = module.QwenImage21KVLayerCache
        self.known_processors = (module.QwenImage21AttnProcessor, module.QwenImage21FlexAttnProcessor)
        self.tokens_per_slot = int(module._IMG_TOKENS_PER_SLOT)
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        self.backend_registry = _AttentionBackendRegistry
        self.output_cls = Transformer2DModelOutput


_DIFFUSERS: _Diffusers | None = None


def _diffusers() -> _Diffusers | None:
    global _DIFFUSERS
    if _DIFFUSERS is None:
        if "diffusers" not in sys.modules:  # nothing loaded can be a diffusers model
            return None
        try:
            module = importlib.import_module(DIFFUSERS_MODULE)
        except ImportError:  # diffusers < 0.41 has no Qwen-Image-2.1
            return None
        missing = [n for n in ("QwenImage21Transformer2DModel",) + MODULE_NAMES if not hasattr(module, n)]
        if missing:
            raise HookRefused(f"{DIFFUSERS_MODULE} lacks {', '.join(missing)}")
        _DIFFUSERS = _Diffusers(module)
    return _DIFFUSERS


def _candidates(obj):
    yield obj
    yield getattr(obj, "transformer", None)
    inner = getattr(obj, "_pipeline", None)  # vLLM-Omni's diffusers adapter
    if inner is not None:
        yield inner
        yield getattr(inner, "transformer", None)


def find_target(pipeline) -> Any | None:
    """The ``QwenImage21Transformer2DModel`` in ``pipeline`` (a pipeline, the adapter, the transformer
    itself, or a ``torch.compile`` wrapper of it), or None."""
    try:
        d = _diffusers()
    except HookRefused:
        return None
    if d is None:
        return None
    for candidate in _candidates(pipeline):
        if isinstance(candidate, d.transformer_cls):
            return candidate
        if isinstance(getattr(candidate, "_orig_mod", None), d.transformer_cls):
            return candidate
    return None


def support() -> dict[str, str]:
    """vLLM-Omni version -> what happens (doctor, README)."""
    served = ("served through the diffusers adapter (--diffusion-load-format diffusers) with diffusers "
              "0.41.0-0.42.1 installed --no-deps; cached steps replay graphs, step 0 stays eager")
    return {
        "0.24": served + "; only where the diffusion worker loads plugins (not a separate single-GPU "
                         "stage process); sleep level 2 releases graphs via runner.graph_runners",
        "0.26": served + "; only where the diffusion worker loads plugins (not a separate single-GPU "
                         "stage process); sleep level 2 releases graphs via runner.graph_runners",
        "0.28": served + "; sleep level 2 releases graphs via runner.graph_runners",
        "0.30": served + "; sleep level 2 releases graphs via release_captured_graphs",
    }


def _check_diffusers(d: _Diffusers) -> None:
    for cls_name, method, params in SIGNATURES:
        check_signature(getattr(d.module, cls_name), method, params)


def _intree_graph(*objs) -> str | None:
    for obj in objs:
        for name in INTREE_GRAPH_ATTRS:
            attr = getattr(obj, name, None) if obj is not None else None
            if attr is not None and not getattr(attr, "__graphdecode__", False):
                return f"{type(obj).__name__}.{name}"
    return None


def _lora_layer(module) -> bool:
    return any(c.__name__ in ("BaseTunerLayer", "BaseLayerWithLoRA") for c in type(module).__mro__)


def _fsdp(module) -> bool:
    name = type(module).__name__
    return name == "FullyShardedDataParallel" or (name.startswith("FSDP") and name != "FSDP")


def _is_dtensor(t) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def structure_reason(transformer, device: torch.device | None = None):
    """Why this transformer's cached steps cannot be captured as it is wired now, as
    ``((reason, hint), detail)``; None when they can. Checked at every bind (once per request
    branch), so offload, LoRA or compile applied after ``enable`` is seen."""
    d = _diffusers()
    blocks = transformer.transformer_blocks
    for block in blocks:
        proc = getattr(getattr(block, "attn", None), "processor", None)
        if getattr(proc, "_parallel_config", None) is not None:
            return PARALLEL, "context-parallel config on the attention processors"
    for name, module in transformer.named_modules():
        where = name or type(transformer).__name__
        if _fsdp(module):
            return PARALLEL, f"{where} is {type(module).__name__}"
        if (getattr(module, "_compiled_call_impl", None) is not None
                or type(module).__name__ == "OptimizedModule"):
            return COMPILED, where
        if hasattr(module, "_hf_hook"):
            return HOOKS, f"accelerate hook on {where}"
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and getattr(registry, "hooks", None):
            return HOOKS, f"diffusers hooks {sorted(registry.hooks)} on {where}"
        if _lora_layer(module):
            return LORA, f"{where} is {type(module).__name__}"
    for block in blocks:
        proc = block.attn.processor
        if type(proc) not in d.known_processors:
            return PROCESSOR, type(proc).__name__
    for name, param in transformer.named_parameters():
        if _is_dtensor(param):
            return PARALLEL, f"{name} is a DTensor"
        if device is not None and param.device != device:
            return NOT_RESIDENT, f"{name} on {param.device}"
    return None


def _backend_name(d: _Diffusers, transformer) -> str:
    backend = getattr(transformer.transformer_blocks[0].attn.processor, "_attention_backend", None)
    if backend is None:  # the processors follow diffusers' active backend (env var or context)
        backend = d.backend_registry.get_active_backend()[0]
    return str(getattr(backend, "value", backend))


def _fallback(reason: tuple[str, str], detail: str = "") -> None:
    stats.fallback(MODEL, reason[0], reason[1], detail)


class CachedStepGraphs:
    """The wiring on one transformer: its patched ``forward``, the ``PrefixGraphs`` behind it, and
    the original forward every non-cached or ineligible step goes to. Returned by ``enable``.

    ``original`` is the forward as it was before wiring (for baselines); ``graphs`` the mechanism;
    ``disable()`` puts the forward back and drops every graph.
    """

    def __init__(self, transformer, *, max_entries: int, verify: bool, capture: bool = True):
        self.d = _diffusers()
        self.transformer = transformer
        self.original = transformer.forward
        self.graphs = PrefixGraphs(MODEL, self._step, max_entries=max_entries, verify=verify,
                                   capture=capture)
        # With capture off (CPU tests, the benchmark's static baseline) the device is not a reason.
        self.require_cuda = capture
        self._patched = self.forward
        transformer.forward = self._patched
        transformer._graphdecode_qwen = self

    def disable(self) -> None:
        tf = self.transformer
        if tf.__dict__.get("forward") is self._patched:
            del tf.__dict__["forward"]
        if tf.__dict__.get("_graphdecode_qwen") is self:
            del tf.__dict__["_graphdecode_qwen"]
        self.graphs.release_all()

    def release_graphs(self) -> None:
        """Drop every entry and graph (sleep level 2); the next cached step binds and captures anew."""
        self.graphs.release_all()

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
                encoder_hidden_states_mask=None, attention_kwargs=None, kv_cache=None,
                kv_cache_mode=None, return_dict=True):
        def run_original(return_dict=return_dict):
            return self.original(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                timestep=timestep, img_shapes=img_shapes, img_mask=img_mask,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
                attention_kwargs=attention_kwargs, kv_cache=kv_cache, kv_cache_mode=kv_cache_mode,
                return_dict=return_dict)

        if kv_cache_mode == "cached" and kv_cache is not None:
            out = self._cached_step(hidden_states, timestep, img_shapes, img_mask,
                                    encoder_hidden_states_mask, kv_cache,
                                    eager=lambda: run_original(return_dict=False)[0])
            if out is not None:
                return self.d.output_cls(sample=out) if return_dict else (out,)
            if not torch.compiler.is_compiling():
                stats.count(MODEL, "eager_step")
        return run_original()

    # -- one cached step ---------------------------------------------------------------------

    def _cached_step(self, hidden_states, timestep, img_shapes, img_mask, text_mask, kv_cache, eager):
        if torch.compiler.is_compiling():
            # Traced by torch.compile (the whole model compiled after wiring): leave it to the
            # original forward. Not counted: a counter call here would break the traced graph;
            # compile applied before wiring is refused at wire time and counted there.
            return None
        if self.require_cuda and hidden_states.device.type != "cuda":
            _fallback(NOT_CUDA, str(hidden_states.device))
            return None
        if torch.is_grad_enabled():
            _fallback(AUTOGRAD)
            return None
        if text_mask is not None:
            _fallback(PADDED)
            return None
        backend = _backend_name(self.d, self.transformer)
        entry = self.graphs.lookup(kv_cache)
        if entry is None or not self._still_bound(entry, kv_cache, hidden_states, timestep,
                                                  img_shapes, img_mask, backend):
            if entry is not None and not _reads_entry(kv_cache, entry):
                self.graphs.release(kv_cache)  # re-extracted: the old buffers are unread, pool them
            entry = self._bind(kv_cache, hidden_states, timestep, img_shapes, img_mask, backend)
            if entry is None:
                return None
        # eager: diffusers' own cached forward, what verify mode checks a new graph against.
        return self.graphs.run(entry, {"latents": hidden_states, "timestep": timestep}, eager=eager)

    def _still_bound(self, entry, kv_cache, hidden_states, timestep, img_shapes, img_mask,
                     backend) -> bool:
        """Whether the owner's binding still describes this step. No host sync."""
        meta = entry.meta
        if (meta.get("layout") != _layout_sig(img_shapes, img_mask)
                or meta.get("step") != _step_sig(hidden_states, timestep)
                or entry.key.backend != backend):
            return False
        # A new extract into the same cache object stores new tensors: re-copy then.
        for i, (k, v) in enumerate(entry.buffers.prefix):
            layer = kv_cache.get_layer(i)
            if layer.k is not k or layer.v is not v:
                return False
        return True

    def _bind(self, kv_cache, hidden_states, timestep, img_shapes, img_mask, backend):
        tf = self.transformer
        device = hidden_states.device
        found = structure_reason(tf, device)
        if found is not None:
            _fallback(*found)
            return None
        prefix = self._read_prefix(kv_cache, hidden_states)
        if prefix is None:
            return None
        prefix_len = prefix[0][0].shape[1]
        layout = self._target_layout(hidden_states, img_shapes, img_mask, prefix_len)
        if layout is None:
            return None
        rotary, target_mask = layout
        key = PrefixKey(batch=hidden_states.shape[0], prefix_len=prefix_len,
                        target=(hidden_states.shape[1], rotary.shape[0]), dtype=tf.img_in.weight.dtype,
                        device=str(device), backend=backend)
        entry = self.graphs.bind(kv_cache, key, prefix,
                                 request={"rotary": rotary, "target_mask": target_mask},
                                 step={"latents": hidden_states, "timestep": timestep})
        if entry is None:
            return None
        for i, (k, v) in enumerate(entry.buffers.prefix):
            # The request now reads its prefix from buffers it owns while it lives (an eager step
            # later in this request sees the same values), and the extract step's copies are freed.
            kv_cache.get_layer(i).store(k, v)
        entry.meta.update(layout=_layout_sig(img_shapes, img_mask),
                          step=_step_sig(hidden_states, timestep))
        return entry

    def _read_prefix(self, kv_cache, hidden_states):
        tf = self.transformer
        n_layers = len(tf.transformer_blocks)
        dtype = tf.img_in.weight.dtype
        prefix = []
        for i in range(n_layers):
            try:
                layer = kv_cache.get_layer(i)
            except (AttributeError, IndexError, TypeError):
                _fallback(LAYOUT, f"cache of type {type(kv_cache).__name__} has no layer {i} "
                                  f"(model has {n_layers})")
                return None
            if type(layer) is not self.d.layer_cache_cls:
                _fallback(QUANT_KV, f"layer cache is {type(layer).__name__}")
                return None
            k, v = layer.k, layer.v
            if k is None or v is None:
                _fallback(NOT_POPULATED, f"layer {i}")
                return None
            for t in (k, v):
                if type(t) is not torch.Tensor or t.dtype != dtype:
                    _fallback(QUANT_KV, f"layer {i}: {type(t).__name__} {getattr(t, 'dtype', None)}, "
                                        f"model {dtype}")
                    return None
            if (k.dim() != 4 or k.shape != v.shape or k.shape[0] != hidden_states.shape[0]
                    or k.device != hidden_states.device
                    or (prefix and k.shape != prefix[0][0].shape)):
                _fallback(LAYOUT, f"layer {i}: k {tuple(k.shape)} v {tuple(v.shape)} on {k.device}")
                return None
            prefix.append((k, v))
        return prefix

    def _target_layout(self, hidden_states, img_shapes, img_mask, prefix_len):
        """The target rows' rotary (complex, ``(T, head_dim // 2)``) and modulation mask (bool,
        ``(T,)``), from the model's own functions; None when the cache does not fit this layout.
        Host syncs: once per request branch."""
        tf = self.transformer
        try:
            slots = img_mask[0]
            # Each vision-language image slot stands for a 2x2 group of latent tokens.
            image_tokens = torch.repeat_interleave(slots, torch.where(slots, self.d.tokens_per_slot, 1))
            target_tokens = math.prod(img_shapes[0][-1])
            rotary = tf.pos_embed(img_shapes[0], image_tokens, device=hidden_states.device)
            _, target_mask = tf.build_token_metadata(image_tokens, img_shapes[0])
            counts = torch.stack([(~target_mask).sum(), target_mask[prefix_len:].sum(),
                                  image_tokens.sum()]).tolist()
        except (ValueError, IndexError, RuntimeError, TypeError) as exc:
            _fallback(LAYOUT, repr(exc))
            return None
        non_target, target_in_tail, n_image = counts
        # The cached step keeps only the joint sequence's tail: the target image must be all of it.
        if (non_target != prefix_len or target_in_tail != target_tokens
                or image_tokens.shape[0] != prefix_len + target_tokens
                or hidden_states.shape[1] != n_image or hidden_states.shape[1] < target_tokens):
            _fallback(LAYOUT, f"cached prefix {prefix_len}, layout prefix {non_target}, target "
                              f"{target_tokens}, latents {hidden_states.shape[1]} of {n_image}")
            return None
        return rotary[prefix_len:], target_mask[prefix_len:]

    def _step(self, bufs: StaticBuffers) -> torch.Tensor:
        """The cached step over static buffers: what the graph replays. Mirrors the transformer's
        ``"cached"`` path from ``img_in`` to ``proj_out``, with the prologue's per-request results
        read from ``bufs.request``."""
        tf = self.transformer
        rotary, target_mask = bufs.request["rotary"], bufs.request["target_mask"]
        target_tokens = rotary.shape[0]  # a Python int frozen into the graph; part of the key
        # img_in over every latent token, as the forward does, so the GEMM shape (hence its bits) match.
        hidden = tf.img_in(bufs.step["latents"])[:, -target_tokens:]
        timestep = bufs.step["timestep"].to(hidden.dtype)
        # The extra t=0 row is what prefix tokens modulate from (causal_condition); the target rows'
        # mask selects the real rows, exactly as the forward does.
        timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        temb = tf.time_text_embed(timestep, hidden)
        modulation = tf.modulation(temb)
        for block, (k, v) in zip(tf.transformer_blocks, bufs.prefix):
            layer = self.d.layer_cache_cls()
            layer.store(k, v)
            hidden = block(hidden_states=hidden, modulation=modulation, rotary_emb=rotary,
                           attention_mask=None, target_token_mask=target_mask, layer_cache=layer,
                           kv_cache_mode="cached")
        hidden = tf.norm_out(hidden, temb, target_mask)
        return tf.proj_out(hidden)


def _reads_entry(kv_cache, entry) -> bool:
    """Whether any layer of the cache still points at the entry's prefix buffers."""
    for i, (k, v) in enumerate(entry.buffers.prefix):
        layer = kv_cache.get_layer(i)
        if layer.k is k or layer.v is v:
            return True
    return False


def _layout_sig(img_shapes, img_mask) -> tuple:
    return tuple(tuple(s) for s in img_shapes[0]), tuple(img_mask.shape)


def _step_sig(hidden_states, timestep) -> tuple:
    return (tuple(hidden_states.shape), hidden_states.dtype, tuple(timestep.shape), timestep.dtype)


# -- wiring ---------------------------------------------------------------------------------------

def _prepare(target, *extra_owners) -> Any:
    """Check what the hook reads and return the transformer to wire. Raises HookRefused."""
    d = _diffusers()
    if d is None:
        raise HookRefused("diffusers with Qwen-Image-2.1 (>= 0.41) is not importable")
    _check_diffusers(d)
    if not isinstance(target, d.transformer_cls):
        raise HookRefused(f"{type(target).__name__} wraps the transformer with torch.compile; "
                          f"captured steps and a compiled forward do not mix")
    if getattr(target, "_compiled_call_impl", None) is not None:
        raise HookRefused("the transformer was compiled in place (module.compile()); captured steps "
                          "and a compiled forward do not mix")
    missing = [a for a in TRANSFORMER_ATTRS if not hasattr(target, a)]
    if missing:
        raise HookRefused(f"QwenImage21Transformer2DModel lacks {', '.join(missing)}")
    if not target.config.causal_condition:
        raise HookRefused("causal_condition=False: this checkpoint has no prefix K/V to decode from")
    intree = _intree_graph(target, *extra_owners)
    if intree is not None:
        raise HookRefused(f"the model captures its own cached step ({intree}); standing aside")
    return target


def enable(pipe_or_transformer, *, verify: bool | None = None, max_entries: int | None = None,
           capture: bool = True) -> CachedStepGraphs:
    """Wire cached-step graphs onto a diffusers Qwen-Image-2.1 pipeline or transformer.

    ``verify`` and ``max_entries`` default to ``VLLM_OMNI_GRAPHDECODE_VERIFY`` / ``_MAX_ENTRIES``.
    ``capture=False`` runs the same static-buffer step eagerly (any device). Returns the wiring
    (``disable()`` undoes it); enabling an already wired transformer returns the existing one.
    Raises HookRefused when this diffusers version moved what the hook reads, and ValueError when no
    Qwen-Image-2.1 transformer is found.
    """
    if _diffusers() is None:
        raise ValueError("diffusers with Qwen-Image-2.1 (>= 0.41) is not importable")
    target = find_target(pipe_or_transformer)
    if target is None:
        raise ValueError(f"no QwenImage21Transformer2DModel in {type(pipe_or_transformer).__name__}")
    existing = getattr(target, "_graphdecode_qwen", None)
    if existing is not None:
        return existing
    transformer = _prepare(target, pipe_or_transformer)
    cfg = config.get()
    return CachedStepGraphs(transformer, verify=cfg.verify if verify is None else verify,
                            max_entries=cfg.max_entries if max_entries is None else max_entries,
                            capture=capture)


def _attach_release(runner, wiring: CachedStepGraphs) -> str:
    """Make sleep level 2 drop our graphs (it discards the memory they were recorded against)."""
    if runner is None:
        return "no runner: release graphs yourself before sleeping"
    from ... import loading

    loading.release_on_sleep(runner, wiring.release_graphs)
    return "sleep level 2 releases them"


def wire(target, cfg: config.Config, runner) -> str:
    """Patch the transformer found by ``find_target``; one summary line for the load log."""
    pipeline = getattr(runner, "pipeline", None)
    existing = getattr(target, "_graphdecode_qwen", None)
    if existing is not None:
        return "already wired"
    transformer = _prepare(target, pipeline, getattr(pipeline, "_pipeline", None))
    wiring = CachedStepGraphs(transformer, verify=cfg.verify, max_entries=cfg.max_entries)
    release = _attach_release(runner, wiring)
    line = (f"cached steps of {type(transformer).__name__} ({len(transformer.transformer_blocks)} "
            f"layers) replay CUDA graphs; max_entries={cfg.max_entries}, "
            f"verify={'on' if cfg.verify else 'off'}; {release}")
    try:
        device = next(transformer.parameters()).device
        found = structure_reason(transformer, device)
        if found is None and device.type != "cuda":
            found = (NOT_CUDA, str(device))
    except StopIteration:
        found = None
    if found is not None:
        line += f"; steps run eagerly while: {found[0][0]} ({found[1]})"
    return line


# -- benchmark --------------------------------------------------------------------------------

def _timed(fn, iters: int) -> float:
    """Mean milliseconds per call, synchronizing once around the loop."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def bench_cached_step(transformer, *, batch: int = 1, text_tokens: int = 256,
                      reference_shapes: tuple[tuple[int, int], ...] = (),
                      target_shape: tuple[int, int] = (64, 64), iters: int = 20,
                      warmup: int = 3) -> dict:
    """Time one cached step of ``transformer`` (on CUDA, under no_grad) eager vs graph replay.

    Runs one real extract step to fill a ``QwenImage21KVCache``, then times, per call:
    ``eager_ms`` diffusers' own cached forward; ``static_ms`` this hook's static-buffer step run
    eagerly; ``graph_ms`` the wired forward replaying its graph (the per-step copies included).
    ``first_graph_step_ms`` is the step that binds, warms up and captures. ``exact`` says whether the
    replay equals diffusers' cached forward bit for bit, ``max_abs_diff`` by how much it does not.
    ``prefix_buffer_mb`` is what one entry's static prefix buffers hold.
    Real shape for 1024x1024 text-to-image: defaults; a two-reference edit:
    ``reference_shapes=((64, 64), (64, 64))``. The transformer must not be wired already.
    """
    if getattr(transformer, "_graphdecode_qwen", None) is not None:
        raise ValueError("bench_cached_step needs an unwired transformer")
    _prepare(transformer)
    d = _diffusers()
    from ...testing.random_models import synthetic_inputs

    kwargs = synthetic_inputs(transformer, batch=batch, text_tokens=text_tokens,
                              reference_shapes=reference_shapes, target_shape=target_shape)
    with torch.no_grad():
        cache = d.module.QwenImage21KVCache(len(transformer.transformer_blocks))
        transformer(**kwargs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)
        prefix_len = cache.get_layer(0).k.shape[1]
        prefix_bytes = sum(2 * layer.k.numel() * layer.k.element_size() for layer in cache.layer_caches)

        def eager():
            return transformer(**kwargs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]

        for _ in range(warmup):
            reference = eager()
        eager_ms = _timed(eager, iters)

        results = {}
        for capture in (False, True):
            wiring = CachedStepGraphs(transformer, max_entries=2, verify=False, capture=capture)
            try:
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = eager()  # the wired forward: binds (and captures) on the first call
                torch.cuda.synchronize()
                first_ms = (time.perf_counter() - start) * 1e3
                for _ in range(warmup):
                    out = eager()
                results[capture] = (_timed(eager, iters), first_ms, out)
            finally:
                wiring.disable()
    graph_ms, first_graph_ms, out = results[True]
    diff = (out.float() - reference.float()).abs()
    return {
        "batch": batch, "prefix_len": prefix_len, "target_tokens": target_shape[0] * target_shape[1],
        "layers": len(transformer.transformer_blocks), "dtype": str(reference.dtype),
        "prefix_buffer_mb": prefix_bytes / 2**20,
        "eager_ms": eager_ms, "static_ms": results[False][0], "graph_ms": graph_ms,
        "first_graph_step_ms": first_graph_ms, "exact": bool(torch.equal(out, reference)),
        "max_abs_diff": float(diff.max()), "captures": stats.get(MODEL, "capture"),
        "fallbacks": stats.fallbacks(MODEL),
    }
