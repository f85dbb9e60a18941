"""SenseNova-U1 image denoising: each CFG branch's step replayed as a CUDA graph over static buffers.

Why
    After think decode is fast, most of a SenseNova-U1 text-to-image request is its denoising:
    upstream measured the think steps at 2.8 s of an 8.2 s request (vllm-omni #7679, #7730:
    https://github.com/vllm-project/vllm-omni/issues/7679,
    https://github.com/vllm-project/vllm-omni/issues/7730). Every step runs the language model's
    generation pathway (``*_mot_gen``) over the image tokens once per CFG branch (cond, uncond,
    and img_cond for edits), attending to the branch's prefix K/V, which do not change during the
    request: vllm-omni 0.24-0.30 copy them once into per-layer ``flash_k_cache`` /
    ``flash_v_cache`` buffers of prefix + image rows (``prepare_flash_kv_cache``), and each step
    writes its image K/V into the tail. So a branch step is one fixed kernel sequence per
    (branch, shape), the case ``graphs/prefix.py`` exists for.

What is replayed
    The branch step is the pipeline's own ``_t2i_predict_v`` (its code, called with a stand-in
    for ``self`` that forwards everything but the model), with the model's forward replaced by
    ``GenForward``: the same decoder layers, norm and rope modules, in the same order and with the
    same arguments as ``SenseNovaU1Model.forward`` passes on the generation path, less its two
    host syncs (``image_gen_indicators.any().item()``, which a capture cannot hold). The graph
    therefore computes what the pipeline computes, kernel for kernel: equal bit for bit (GPU test).
    The rest of a denoising step (the generation vision embedding of the noisy image, the timestep
    embedders, the CFG combination, the Euler update) stays the pipeline's own eager code.

Per request and branch
    The owner of a prefix entry (``graphs/prefix.py``) is the branch's cache object (one per branch
    and request), so two requests in flight never share prefix buffers. At the branch's first step
    the prefix rows are copied into the entry and the cache's ``flash_*`` buffers are re-pointed at
    the entry's (no second copy of the K/V lives while the request runs); the entry goes back to the
    pool when ``_run_denoising_loop`` returns or raises. The timestep, the image embeddings and
    the latents are copied into the entry's step buffers each step. Every branch step first checks
    an ``eligibility.Watch`` on what the step reads (the language model, the flow-matching head,
    the denoising adapter) in constant time: a hook, adapter or compile added, or weights moved
    by ``.to()``, drops every entry (weights moved: counted under ``WEIGHTS_MOVED``), and each
    branch is gated and bound again at its next step.

Counted under ``sensenova_u1_image``: ``capture``, ``replay``, ``static_step`` (the static-buffer
step without a graph: tests), ``eager_branch`` (branches that run the pipeline's own step),
``structure_changed`` (entries dropped for a change other than weights moved), and each fallback
by its reason, once per request branch.

Measured (H200, 1024x1024, 50 steps, CFG 4): a step of both branches with and without the graph,
on vllm-omni 0.26 (its generation path launches thousands of kernels a branch step: the eager step
waits on the host) and 0.30, images identical: ``docs/performance.md``
(``benchmarks/results/h200-2026-12-01b``). On by default
(``VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE=off`` turns it off).
``VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE=fast`` replays ``fast_denoise.FastGen`` instead of the
pipeline's code: faster, with another rounding (``fast_denoise``'s docstring). Not done (issue
#13): graphing the per-step work outside the branches (its host syncs).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref

import torch

from ...core import eligibility, patching, stats
from ...core.patching import HookRefused, check_signature
from ...core.reasons import (ARGUMENTS, AUTOGRAD, FAST_NOT_HERE, LORA, NOT_CUDA, PARALLEL, QUANT_KV,
                             WEIGHTS_MOVED, Reason)
from ...graphs.prefix import Entry, PrefixGraphs, PrefixKey, StaticBuffers
from ...ops.fp8 import w8a8
from . import fast_denoise, layouts, ops, rules

MODEL = "sensenova_u1_image"

# The pipeline's branch step and its callers, as vllm-omni 0.24-0.30 define them (0.30 adds a
# ``t_eps`` parameter, which the stand-in passes through like any other value).
PREDICT_V = ("self", "input_embeds", "indexes_image", "attn_mask", "past_key_values", "t", "z",
             "image_token_num")
LOOP = ("self", "ns", "caches", "p")
GEN_FORWARD = ("self", "hidden_states", "indexes", "attention_mask", "past_key_values")
# Entries (buffers and graph) kept between requests. The cond branch's key follows the prompt's
# length, so a server sees a new one with most prompts; the uncond branch's (a fixed prompt) comes
# back every request. Three covers one whole edit request (cond, uncond, img_cond) or the uncond
# entry and the last two prompts' cond entries; at 1024x1024 an idle entry with its graph holds
# ~0.5 GB (H200 measurement: 1,026 MiB for two).
IDLE_ENTRIES = 3
# Branches one request holds at once: cond, uncond and img_cond (an edit). A server running
# ``rows`` requests at once needs this many live entries a request (``Denoiser``'s cap): a live
# entry costs nothing beyond the request's own caches, which are re-pointed at its buffers.
BRANCHES = 3
# Tensors the step reads: copied into the entry (step: every step; request: once per branch).
STEP_TENSORS = ("input_embeds", "t", "z")
REQUEST_TENSORS = ("indexes_image",)
NOT_CONSTANT = STEP_TENSORS + REQUEST_TENSORS + ("past_key_values", "attn_mask")

# This hook's own reasons; the shared ones (``reasons``) carry its case in their detail.
CACHE_BACKEND = Reason("a cache backend (cache-dit, TeaCache) drives the denoising steps",
                       "unset cache_backend (DIFFUSION_CACHE_BACKEND) for graph denoising: the "
                       "backend decides in Python at every step which blocks run")
MASKED = Reason("the branch attends with an attention mask",
                "report this: vllm-omni's denoising branches attend without one")
NO_BUFFERS = Reason("the branch's cache has no prefix + image buffers (prepare_flash_kv_cache)",
                    "report this with the vllm-omni version: the pipeline prepares them before "
                    "denoising")
FP8_NEEDS_FAST = Reason("FP8 weights need the fast denoising mode",
                        "set VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE=fast: the graph mode replays "
                        "the pipeline's own layers, which read the bf16 weights")
NOT_WIRED = Reason("SenseNova-U1's denoising code moved",
                   "use vllm-omni 0.24-0.30 (python -m vllm_omni_graphdecode doctor)")


def check(pipeline, language_model) -> None:
    """Everything the branch step calls or patches, checked before anything is patched."""
    cls = type(pipeline)
    check_signature(cls, "_t2i_predict_v", PREDICT_V)
    check_signature(cls, "_run_denoising_loop", LOOP)
    model = getattr(language_model, "model", None)
    for name in ("layers", "norm_mot_gen"):
        if getattr(model, name, None) is None:
            raise HookRefused(NOT_WIRED.because(f"language_model.model has no {name}"))
    if layouts.output_class(language_model) is None:
        raise HookRefused(NOT_WIRED.because(
            f"{type(language_model).__module__} has no SenseNovaU1CausalLMOutput"))
    layer = model.layers[0]
    check_signature(type(layer), "_forward_gen", GEN_FORWARD)
    check_signature(type(layer.self_attn), "forward_gen", GEN_FORWARD)


class GenForward:
    """``SenseNovaU1Model.forward`` on the generation path (every token an image token), for a
    step a graph can hold: the model's own layers and norm, called as its forward calls them,
    without reading ``image_gen_indicators`` back to the host. Returns what
    ``SenseNovaU1ForCausalLM.forward(..., compute_logits=False)`` returns for that path."""

    def __init__(self, language_model, layout: layouts.Layout):
        self.lm = language_model
        self.layout = layout
        self.output = layouts.output_class(language_model)  # what the model's forward returns

    def __call__(self, inputs_embeds, image_gen_indicators, indexes, attention_mask,
                 past_key_values, use_cache=True, compute_logits=False, **kwargs):
        model = self.lm.model
        hidden = inputs_embeds
        extra = dict(kwargs)
        if not self.layout.rope_per_layer:
            # 0.30's forward builds the three rope tables once and hands them to every layer.
            extra["position_embeddings"] = ops.rope_tables(model.rotary_emb, model.rotary_emb_hw,
                                                           hidden, indexes)
        for layer in model.layers:
            hidden = layer(hidden, image_gen_indicators=image_gen_indicators, exist_und=False,
                           exist_gen=True, indexes=indexes, attention_mask=attention_mask,
                           past_key_values=past_key_values, use_cache=use_cache, **extra)
        return self.output(hidden_states=model.norm_mot_gen(hidden),
                           past_key_values=past_key_values)


class _StandIn:
    """``self`` for the pipeline's ``_t2i_predict_v`` inside the step: every attribute is the
    pipeline's, except the two models it may call, which are ``GenForward``."""

    def __init__(self, pipeline, forward: GenForward):
        object.__setattr__(self, "_pipeline", pipeline)
        object.__setattr__(self, "language_model", forward)
        object.__setattr__(self, "denoising_transformer", forward)

    def __getattr__(self, name):
        return getattr(self._pipeline, name)


class _LayerBuffers:
    """One layer of the step's cache: the entry's prefix + image K/V rows, in the attributes
    ``forward_gen`` reads (``prepare_flash_kv_cache``'s)."""

    def __init__(self, k, v, prefix_len: int):
        self.flash_k_cache, self.flash_v_cache = k, v
        self.flash_prefix_len, self.flash_total_len = prefix_len, k.shape[1]
        self.keys = self.values = None  # forward_gen with update_cache=False reads flash_* only


class _BufferCache:
    def __init__(self, kv, prefix_len: int):
        self.layers = [_LayerBuffers(k, v, prefix_len) for k, v in kv]


@dataclasses.dataclass
class _Branch:
    """What was decided for one branch cache (the owner) at its first step."""

    entry: Entry | None
    reason: Reason | None = None


class Denoiser:
    """The denoising wiring of one pipeline: gate, per-branch entries, the replayed step."""

    def __init__(self, pipeline, layout: layouts.Layout, cfg, *, rows: int = 1,
                 capture: bool | None = None,
                 runner=None):
        self.pipeline = pipeline
        self.lm = pipeline.language_model
        self.layout = layout
        self.cfg = cfg
        # None: graphs where the branch runs on CUDA, the pipeline's own step elsewhere.
        # False: the static-buffer step without capture on any device (CPU tests).
        self.capture = capture
        # The runner sleep reaches this pipeline through (``patching.release_on_sleep``): each
        # branch's first step checks that it still would. None: not checked.
        self.runner = runner
        predict = type(pipeline)._t2i_predict_v
        self._step_code = functools.partial(predict, _StandIn(pipeline, GenForward(self.lm, layout)))
        # fast mode: the FastGen body where it applies, else the Reason it does not; None in the
        # exact mode, and in the fast mode until the next bind builds it again (after a release
        # or a structure change).
        self.fast: fast_denoise.FastGen | Reason | None = None
        self._fast_code = None
        self._fast_mode = cfg.sensenova_denoise == "fast"
        self._fp8 = "sensenova_denoise" in cfg.fp8
        self._copies: w8a8.W8A8Copies | None = None  # a rebuilt fast body's FP8 copies: the last's
        if self._fast_mode:  # built now, so the load's summary says what runs
            self.fast = self._build_fast()
        elif self._fp8:
            stats.degraded(MODEL, FP8_NEEDS_FAST.because(f"mode {cfg.sensenova_denoise}"))
        self.graphs = PrefixGraphs(MODEL, self._static_step,
                                   max_entries=max(cfg.max_entries, BRANCHES * rows),
                                   verify=cfg.verify,
                                                capture=capture is not False,
                                                max_idle=IDLE_ENTRIES)
        # id(branch cache) -> (weak reference to it, what was decided at its first step)
        self._branches: dict[int, tuple[weakref.ref, _Branch]] = {}
        self._lock = threading.Lock()
        # What a branch step reads besides its buffers: the language model, the flow-matching
        # head and the adapter the step stands in for. Checked at every branch step in constant
        # time (armed by ``install`` after every patch); a change drops every entry
        # (``_structure_changed``). The walk the gate reads is kept until then.
        roots = [m for m in (self.lm, getattr(pipeline, "fm_modules", None),
                             getattr(pipeline, "denoising_transformer", None))
                 if isinstance(m, torch.nn.Module)]
        self.watch = eligibility.Watch(*roots)
        self._found: eligibility.Structure | None = None
        self._change_lock = threading.Lock()

    # -- the step -----------------------------------------------------------------------------

    def _static_step(self, bufs: StaticBuffers) -> torch.Tensor:
        kwargs = dict(bufs.key.consts)
        prefix_len = bufs.prefix[0][0].shape[1]
        code = self._step_code
        if isinstance(self.fast, fast_denoise.FastGen):
            code = self._fast_code
        try:
            return self._call_step(code, bufs, prefix_len, kwargs)
        except fast_denoise.CompileFailed as exc:
            # Raised by a warm-up (a compile that failed), before any capture: the exact step
            # from here on, over the same buffers.
            self._no_fast(exc.reason)
            return self._call_step(self._step_code, bufs, prefix_len, kwargs)

    def _call_step(self, code, bufs, prefix_len: int, kwargs) -> torch.Tensor:
        return code(
            input_embeds=bufs.step["input_embeds"], t=bufs.step["t"], z=bufs.step["z"],
            indexes_image=bufs.request["indexes_image"], attn_mask={"full_attention": None},
            past_key_values=_BufferCache(bufs.kv, prefix_len), **kwargs)

    # -- per call -----------------------------------------------------------------------------

    def predict_v(self, original, args, kwargs):
        """One branch step: the replayed graph's result, or the pipeline's own step."""
        if self.watch.changed():
            self._structure_changed()
        owner = kwargs.get("past_key_values")
        branch = self._branch(owner, args, kwargs)
        if branch.entry is not None:
            step = {name: kwargs[name] for name in STEP_TENSORS}
            # Verify compares a new graph with the pipeline's own step where the graph runs the
            # same code; the fast body's first replay is checked against its own warm-up.
            exact = not isinstance(self.fast, fast_denoise.FastGen)
            eager = (lambda: original(*args, **kwargs)) if self.cfg.verify and exact else None
            out = self.graphs.run(branch.entry, step, eager=eager)
            if out is not None:
                return out
            branch.entry = None  # the reason is counted by run(); the branch goes on eagerly
        stats.count(MODEL, "eager_branch")
        return original(*args, **kwargs)

    def _branch(self, owner, args, kwargs) -> _Branch:
        if owner is None or args:
            reason = ARGUMENTS.because("_t2i_predict_v: " + (
                "positional arguments" if args else "no past_key_values"))
            self._refuse(reason)
            return _Branch(None, reason)
        with self._lock:
            known = self._branches.get(id(owner))
        if known is not None and known[0]() is owner:
            branch = known[1]
            # A bound branch whose entry was dropped since (sleep) binds again: its cache still
            # holds the prefix rows the dropped entry had.
            if branch.entry is None or self.graphs.lookup(owner) is branch.entry:
                return branch
        reason = self.gate(owner, kwargs)
        entry = None
        if reason is None:
            entry = self._bind(owner, kwargs)
        else:
            self._refuse(reason)
        branch = _Branch(entry, reason)
        try:
            ref = weakref.ref(owner)
        except TypeError:
            return branch  # bind() counted it; decided again at every step
        with self._lock:
            for key in [k for k, (r, _) in self._branches.items() if r() is None]:
                del self._branches[key]
            self._branches[id(owner)] = (ref, branch)
        return branch

    def _refuse(self, reason: Reason) -> None:
        stats.fallback(MODEL, reason)

    def _structure_changed(self) -> None:
        """The watch saw a change: every entry's graph read the old structure or weight
        addresses, and the fast body holds the old weights. Drop them all (counted: weights
        moved under ``WEIGHTS_MOVED``, anything else as ``structure_changed``); every branch is
        gated again at its next step (a hook now: ``HOOKS``) and binds anew from its cache."""
        with self._change_lock:
            if not self.watch.changed():
                return  # another branch's thread saw it first
            moved = self.watch.moved()
            self.watch.arm()  # settles; modules added since are watched too
            self._found = None
            self.graphs.release_all()
            with self._lock:
                self._branches.clear()
            if isinstance(self.fast, fast_denoise.FastGen):
                self._copies = self.fast.fp8  # refreshed in place where a weight moved
            if self._fast_mode:
                self.fast = None
            if moved:
                stats.degraded(MODEL, WEIGHTS_MOVED.because("language_model"))
            else:
                stats.count(MODEL, "structure_changed")

    def _structure(self) -> eligibility.Structure:
        """The language model's walk: made once the watch is armed, then again after a change."""
        found = self._found
        if found is None:
            found = eligibility.scan(self.lm, "language_model")
            if self.watch.armed:
                self._found = found
        return found

    def gate(self, cache, kwargs) -> Reason | None:
        """Why this branch runs the pipeline's own step, or None. Checked once per request
        branch."""
        z, t = kwargs.get("z"), kwargs.get("t")
        missing = [n for n in STEP_TENSORS + REQUEST_TENSORS if not torch.is_tensor(kwargs.get(n))]
        if missing:
            return ARGUMENTS.because(f"not tensors: {', '.join(missing)}")
        # The step's other arguments are baked into its graph as they were at capture, keyed by
        # their values: a tensor among them would be read at its capture-time address, whatever
        # a later step passes. vllm-omni 0.24-0.30 pass none (ints, floats, the image size).
        held = [n for n, v in kwargs.items() if n not in NOT_CONSTANT and _holds_tensor(v)]
        if held:
            return ARGUMENTS.because(f"_t2i_predict_v: tensor argument {', '.join(held)}, which "
                                     f"a graph would read at its capture-time address")
        if self.capture is not False and z.device.type != "cuda":
            return NOT_CUDA.because(f"device is {z.device}")
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            return AUTOGRAD
        lost = patching.release_lost(self.runner)
        if lost is not None:
            self.graphs.release_all()  # a sleep may have discarded memory under them unseen
            return lost
        if t.dim() != 0:
            return ARGUMENTS.because(f"timestep of shape {tuple(t.shape)}")
        mask = kwargs.get("attn_mask")
        if not (isinstance(mask, dict) and all(v is None for v in mask.values())):
            return MASKED.because(type(mask).__name__)
        reason = self.structure_reason()
        if reason is not None:
            return reason
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) != len(self.lm.model.layers):
            return NO_BUFFERS.because(f"{type(cache).__name__} has "
                                      f"{len(layers) if layers else 0} layers")
        dtype = kwargs["input_embeds"].dtype
        image = kwargs["input_embeds"].shape[1]
        prefix = getattr(layers[0], "flash_prefix_len", None)
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "flash_k_cache", None), getattr(layer, "flash_v_cache", None)
            if not (torch.is_tensor(k) and torch.is_tensor(v)):
                return NO_BUFFERS.because(f"layer {i}")
            if k.dtype != dtype or v.dtype != dtype:
                return QUANT_KV.because(f"prefix K/V of layer {i}: {k.dtype} with {dtype} "
                                        f"activations")
            if (getattr(layer, "flash_prefix_len", None) != prefix or k.shape[1] != prefix + image
                    or v.shape != k.shape):
                return NO_BUFFERS.because(f"layer {i}: rows {tuple(k.shape)} for prefix {prefix} "
                                          f"+ {image} image tokens")
        if not prefix:
            return NO_BUFFERS.because("no prefix rows")
        return None

    def structure_reason(self) -> Reason | None:
        """The pipeline as it is wired now: parallelism, cache backends, offload, hooks, LoRA."""
        pipe, lm = self.pipeline, self.lm
        od = getattr(pipe, "od_config", None)
        backend = getattr(od, "cache_backend", None)
        if backend not in (None, "none", ""):
            return CACHE_BACKEND.because(f"cache_backend={backend}")
        par = getattr(od, "parallel_config", None)
        for name in ("cfg_parallel_size", "sequence_parallel_size", "ulysses_degree",
                     "ring_degree"):
            size = getattr(par, name, 1) or 1
            if size > 1:
                return PARALLEL.because(f"{name}={size}")
        gate, lora = rules.verdict(pipe, lm, self._structure())
        if gate is not None:
            return gate
        adapter = getattr(pipe, "denoising_transformer", None)
        if adapter is not None and eligibility.module_hooks(adapter):
            return CACHE_BACKEND.because("hooks on denoising_transformer")
        if lora:
            return LORA.because("language_model")
        return None

    def _bind(self, owner, kwargs) -> Entry | None:
        layers = owner.layers
        prefix = layers[0].flash_prefix_len
        image = kwargs["input_embeds"].shape[1]
        consts = tuple(sorted((name, _hashable(value)) for name, value in kwargs.items()
                              if name not in NOT_CONSTANT))
        key = PrefixKey(
            batch=kwargs["z"].shape[0], prefix_len=prefix, target=(image,),
            dtype=kwargs["input_embeds"].dtype, device=str(kwargs["z"].device),
            backend=_attention_backend(self.lm), consts=consts)
        prefix_kv = [(layer.flash_k_cache[:, :prefix], layer.flash_v_cache[:, :prefix])
                     for layer in layers]
        request = {name: kwargs[name] for name in REQUEST_TENSORS}
        step = {name: kwargs[name] for name in STEP_TENSORS}
        entry = self.graphs.bind(owner, key, prefix_kv, request, step, tail=image)
        if entry is None:
            return None
        fast = self._fast_for()
        if fast is not None:
            fast.prepare(key.batch, image, prefix + image, kwargs["z"].device)
        bufs = entry.buffers
        if bufs is None:  # released by another thread since (sleep): run() says so
            return entry
        # The cache reads the entry's rows from now on (the entry is the owner's while it lives):
        # the request's own copy is freed, and an eager step of this branch writes the same rows.
        for layer, (k, v) in zip(layers, bufs.kv):
            layer.flash_k_cache, layer.flash_v_cache = k, v
        return entry

    def _fast_for(self) -> fast_denoise.FastGen | None:
        """The fast body (built at install, and again after a release or a structure change),
        or None: the exact mode, or the fast one does not apply here (the reason counted as a
        degraded path each time a branch binds)."""
        if self.fast is None and self._fast_mode:
            self.fast = self._build_fast()
        if isinstance(self.fast, Reason):
            stats.degraded(MODEL, FAST_NOT_HERE.because(self.fast.describe()))
            return None
        return self.fast

    def _build_fast(self, dtype=None):
        """The fast body over the model's weights now (``dtype``: their dtype), or its Reason."""
        from ...ops import attention as attention_ops

        attn0 = self.lm.model.layers[0].self_attn
        dtype = dtype or attn0.qkv_proj_mot_gen.weight.dtype
        device = attn0.qkv_proj_mot_gen.weight.device
        problem = fast_denoise.structure_problem(self.lm, self.layout.rope_per_layer)
        if problem is not None:
            return problem
        attention = attention_ops.select_dense_attention(device, attn0.head_dim, dtype)
        if isinstance(attention, Reason):
            return attention
        copies = None
        if self._fp8:
            why = w8a8.w8a8_available(device)
            if why is None:
                # A rebuilt body keeps the copies it can: a weight that moved is quantised again
                # into its copy in place, one replaced gets a new one.
                copies, self._copies = self._copies or w8a8.W8A8Copies(), None
            else:  # the fast body in bf16
                stats.degraded(MODEL, why)
        try:
            fast = fast_denoise.FastGen(self.lm, self.layout, attention,
                                        layouts.output_class(self.lm), fp8=copies)
        except fast_denoise.CompileFailed as exc:
            return exc.reason
        predict = type(self.pipeline)._t2i_predict_v
        self._fast_code = functools.partial(predict, _StandIn(self.pipeline, fast))
        return fast

    def _no_fast(self, reason: Reason) -> None:
        self.fast = reason
        stats.degraded(MODEL, FAST_NOT_HERE.because(reason.describe()))

    def finish(self, caches) -> None:
        """The request's denoising loop returned or raised: its branches' entries go back to the
        pool (nothing of this request reads the caches' rows any more; a failed request's
        caches may live on in its traceback until a collection, and must not hold the entries
        that long: ~0.5 GB at 1024x1024)."""
        if not isinstance(caches, dict):
            return
        for cache in caches.values():
            if not hasattr(cache, "layers"):
                continue  # the indexes and masks beside the caches
            with self._lock:
                self._branches.pop(id(cache), None)
            self.graphs.release(cache)

    def release(self) -> None:
        """Drop every entry and graph (sleep level 2), then the FP8 copies they read (made again
        at the next step). Shapes that failed to capture or ran out of memory capture again
        (``PrefixGraphs.release_all``); a fast body that failed to build or compile is built
        again at the next bind."""
        self.graphs.release_all()
        if isinstance(self.fast, fast_denoise.FastGen):
            self.fast.release_copies()
        elif self._fast_mode and isinstance(self.fast, Reason):
            self.fast = None

    def describe(self) -> str:
        where = "CUDA graphs" if self.capture is not False else "static buffers, no graphs"
        body = "the pipeline's own code"
        if isinstance(self.fast, fast_denoise.FastGen):
            body = f"fast mode: restated layers, Inductor-fused, {self.fast.attention.name}"
            if self.fast.fp8 is not None:
                body += (f", FP8 (W8A8) GEMMs from e4m3 copies of "
                         f"{self.fast.fp8_nbytes / 1e9:.2f} GB")
        elif isinstance(self.fast, Reason):
            body += f"; fast mode not applicable: {self.fast.describe()}"
        line = f"image denoising: each CFG branch's step replayed ({where}, {body})"
        device = torch.device(getattr(self.pipeline, "device", "cpu"))
        if self.capture is None and device.type != "cuda":
            line += f"; branches run the pipeline's own steps while: not on a CUDA device ({device})"
        return line


def _holds_tensor(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return isinstance(value, torch.Tensor)


def _hashable(value):
    """A constant argument as part of the key. Never a tensor: ``gate`` refuses those."""
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        raise TypeError("a tensor argument cannot be part of a graph's key (gate refuses it)")
    return value


def _attention_backend(language_model) -> str:
    """The diffusion attention implementation the generation path dispatches to (part of the key:
    a graph captured with one kernel must not replay for another)."""
    attn = getattr(language_model.model.layers[0].self_attn, "attn", None)
    impl = getattr(attn, "attn_impl_cls", None)
    if isinstance(impl, type):
        return impl.__name__
    return type(getattr(attn, "attention", attn)).__name__


def install(pipeline, layout: layouts.Layout, cfg, *, capture: bool | None = None, runner=None,
            patches=None, rows: int = 1):
    """Patch ``pipeline``'s branch step and denoising loop; returns the ``Denoiser``.
    HookRefused (nothing patched) when the code moved. ``runner``: the one sleep's release was
    registered on (``patching.release_on_sleep``); each branch's first step then checks that
    sleep still reaches it (``patching.release_lost``) and runs eagerly with the reason if not."""
    lm = pipeline.language_model
    check(pipeline, lm)
    denoiser = Denoiser(pipeline, layout, cfg, rows=rows, capture=capture, runner=runner)
    predict = pipeline._t2i_predict_v
    loop = pipeline._run_denoising_loop

    @functools.wraps(predict)
    def _t2i_predict_v(*args, **kwargs):
        return denoiser.predict_v(predict, args, kwargs)

    @functools.wraps(loop)
    def _run_denoising_loop(ns, caches, p, *args, **kwargs):
        try:
            return loop(ns, caches, p, *args, **kwargs)
        finally:  # a request that fails mid-denoise gives its entries back too
            denoiser.finish(caches)

    _t2i_predict_v.__graphdecode__ = True
    _run_denoising_loop.__graphdecode__ = True
    patches = patches if patches is not None else patching.Patches()
    patches.set(pipeline, "_t2i_predict_v", _t2i_predict_v)
    patches.set(pipeline, "_run_denoising_loop", _run_denoising_loop)
    # Every patch is in place (the decode wiring's came first): what changes from here is not
    # the plugin's.
    denoiser.watch.arm()
    patches.on_undo(denoiser.watch.disarm)
    return denoiser


__all__ = ["ARGUMENTS", "AUTOGRAD", "CACHE_BACKEND", "Denoiser", "GenForward", "LORA", "MASKED",
           "MODEL", "NOT_CUDA", "NO_BUFFERS", "PARALLEL", "QUANT_KV", "check", "install"]
