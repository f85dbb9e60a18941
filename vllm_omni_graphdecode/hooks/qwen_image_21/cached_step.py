"""Qwen-Image-2.1's cached step, wired onto one transformer: the patched ``forward``, the
checks each step passes, the binding of a request's prefix, and the step body a graph records.

What runs where on a cached step
    once per request branch (bind), eager: the target's rotary rows and modulation mask from the
        model's own ``pos_embed`` and ``build_token_metadata`` (host syncs: ``.tolist()``,
        ``nonzero``, ``int()``), checked against the cached prefix length; the prefix K/V copied
        into buffers the request owns, and the request's cache re-pointed at them (so they are not
        held twice).
    every step, eager: a few constant-time checks (``eligibility.Watch`` among them: an adapter
        or hook added in the middle of a request drops every graph, and so do weights moved by
        ``.to()``, counted under ``WEIGHTS_MOVED``), a lookup, two copies (latents, timestep) and
        the replay. No host sync, no walk of the module tree.
    captured: ``img_in``, timestep embedding and the shared modulation, all blocks, ``norm_out``,
        ``proj_out``.
    The forward's prologue (text projection, ``repeat_interleave``, rotary over the whole
    sequence, token metadata, boolean-index scatter) does not run on a cached step at all: what it
    yields for the target rows is fixed per request.
"""

from __future__ import annotations

import functools
import math
import time
import weakref

import torch

from ...core import eligibility, patching, stats
from ...core.reasons import ARGUMENTS, FAST_NOT_HERE, WEIGHTS_MOVED, Reason
from ...graphs.prefix import PrefixGraphs, PrefixKey, StaticBuffers
from ...ops import attention as attention_ops
from ...ops.fp8.w8a8 import w8a8_available
from . import fast_step, names
from .rules import (AUTOGRAD, COMPILED, LAYOUT, NOT_CUDA, NOT_POPULATED, PADDED, QUANT_KV,
                    structure_reason)

MODEL = "qwen_image_21"
MODES = ("fast", "exact")

# The fast mode without one of its parts: counted (stats.degraded) and logged once; the graph
# path still runs, with the part named in the detail replaced by the exact step's.
FAST_PARTIAL = Reason("fast cached step without one of its parts",
                      "see the detail: FlashAttention needs vllm's build on an sm_80+ GPU, "
                      "torch.compile needs Triton; VLLM_OMNI_GRAPHDECODE_QWEN_MODE=exact is "
                      "diffusers' own rounding")


FP8_NEEDS_FAST = Reason("FP8 weights need the fast cached step",
                       "unset VLLM_OMNI_GRAPHDECODE_QWEN_MODE (fast): exact replays diffusers' "
                       "own blocks, which read the bf16 weights")


class _Fast:
    """What the fast mode runs on one device: the attention kernel, whether Inductor compiles
    the block regions, the blocks. Built at the first bind."""

    def __init__(self, transformer, device, *, attention: str, compile: bool, fp8: bool = False):
        dtype = transformer.img_in.weight.dtype
        head_dim = transformer.transformer_blocks[0].attn.inner_dim // \
            transformer.transformer_blocks[0].attn.heads
        found = attention_ops.select_dense_attention(device, head_dim, dtype, attention)
        if isinstance(found, Reason):  # an explicit kernel that cannot run: the last resort
            stats.degraded(MODEL, FAST_PARTIAL.because(f"attention: {found.describe()}"))
            found = attention_ops.SdpaAttention((found,))
        for skipped in found.skipped:
            stats.degraded(MODEL, FAST_PARTIAL.because(f"attention {found.name}: "
                                                       f"{skipped.describe()}"))
        self.attention = found
        if compile:
            why = fast_step.compile_supported(device)
            if why is not None:
                stats.degraded(MODEL, FAST_PARTIAL.because(f"no compile: {why.describe()}"))
                compile = False
        self.compile = compile
        if fp8:
            why = w8a8_available(device)
            if why is not None:
                stats.degraded(MODEL, why)
                fp8 = False
        self.blocks = fast_step.FastBlocks(transformer, found, compile=compile, fp8=fp8)

    @property
    def name(self) -> str:
        return (f"fast:{self.attention.name}:{'compiled' if self.compile else 'eager'}"
                + (":fp8" if self.blocks.fp8 else ""))


class CachedStepGraphs:
    """The wiring on one transformer: its patched ``forward``, the ``PrefixGraphs`` behind it, and
    the original forward every non-cached or ineligible step goes to. Returned by ``enable``.

    ``original`` is the forward as it was before wiring (for baselines); ``graphs`` the mechanism;
    ``patches`` what the wiring set on objects it does not own; ``unwire()`` puts all of it back
    and drops every graph.
    """

    def __init__(self, transformer, *, max_entries: int, verify: bool, capture: bool = True,
                 mode: str = "exact", attention: str = "auto", compile: bool = True,
                 fp8: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.d = names.resolve()
        self.transformer = transformer
        self.original = transformer.forward
        self.mode = mode
        self._fast_options = {"attention": attention, "compile": compile, "fp8": fp8}
        if fp8 and mode != "fast":  # FP8 weights exist only in the fast body
            stats.degraded(MODEL, FP8_NEEDS_FAST.because(f"mode {mode}"))
        self._fast: _Fast | Reason | None = None  # built at the first fast bind
        self.graphs = PrefixGraphs(MODEL, self._step, max_entries=max_entries, verify=verify,
                                   capture=capture)
        # With capture off (CPU tests, the benchmark's static baseline) the device is not a reason.
        self.require_cuda = capture
        # Structure is decided at bind (one walk per request branch); between binds the watch
        # notices, in constant time per step, a module, parameter or forward hook that changed.
        self.watch = eligibility.Watch(transformer)
        self._rearm = True  # the watch needs a walk at the next bind that passes the gate
        # id(owner) -> (its weak reference, why the gate refused it): a refused request branch
        # does not walk the tree again at every step while the watch sees no change.
        self._refused: dict[int, tuple[weakref.ref, Reason]] = {}
        self._release: patching.SleepRelease | None = None
        self._active = True
        self.patches = patching.Patches()
        self.patches.on_undo(self.watch.disarm)

        def forward(*args, **kwargs):
            return self.call(args, kwargs)

        # inspect.signature follows __wrapped__ to the original's parameters.
        functools.update_wrapper(forward, self.original)
        forward.__graphdecode__ = True
        self.patches.set(transformer, "forward", forward)
        self.patches.set(transformer, "_graphdecode_qwen", self)

    def attach_release(self, runner) -> None:
        """Make sleep level 2 on ``runner`` drop every graph (``patching.release_on_sleep``);
        each bind checks it still would."""
        self._release = patching.release_on_sleep(runner, self.release_graphs, self.patches)

    def unwire(self) -> list[str]:
        """Put back what the wiring set (the transformer's forward, the sleep release, the module
        tables the watch observes) and drop every graph. A wrapper stacked above the patched
        forward since stays (its name is returned) and from now on passes straight through to
        the original forward."""
        self._active = False
        left = self.patches.undo()
        self.graphs.release_all()
        return left

    def disable(self) -> None:
        """``unwire()``, under the name the bare-diffusers example uses."""
        self.unwire()

    def release_graphs(self) -> None:
        """Drop every entry and graph (sleep level 2), then the fast body's FP8 copies they read;
        the next cached step binds and captures anew (the copies made again from the weights
        present then). Shapes that failed to capture or ran out of memory capture again
        (``PrefixGraphs.release_all``), and a fast body that failed to build or compile is
        built again at the next bind."""
        self.graphs.release_all()
        if isinstance(self._fast, _Fast):
            self._fast.blocks.release_copies()
        elif isinstance(self._fast, Reason):
            self._fast = None

    def call(self, args: tuple, kwargs: dict):
        """The transformer's forward as wired: a cached step replays its graph; anything else,
        and any call with arguments this hook does not know (counted), runs the original forward
        with the very arguments it was given."""
        if not self._active:  # unwired: a wrapper stacked above ours still calls in
            return self.original(*args, **kwargs)
        call, unknown = self.d.forward_arguments(args, kwargs)
        if call is None or call["kv_cache_mode"] != "cached" or call["kv_cache"] is None:
            return self.original(*args, **kwargs)
        out = None
        if unknown:
            if not torch.compiler.is_compiling():
                stats.fallback(MODEL, ARGUMENTS.because(f"forward: {', '.join(unknown)}"))
        else:
            out = self._cached_step(
                call, eager=lambda: self.original(**dict(call, return_dict=False))[0])
        if out is not None:
            return self.d.output_cls(sample=out) if call["return_dict"] else (out,)
        if not torch.compiler.is_compiling():
            stats.count(MODEL, "eager_step")
        return self.original(*args, **kwargs)

    # -- one cached step ---------------------------------------------------------------------

    def _cached_step(self, call: dict, eager):
        hidden_states, timestep = call["hidden_states"], call["timestep"]
        kv_cache = call["kv_cache"]
        if torch.compiler.is_compiling():
            # Traced by torch.compile (the whole model compiled after wiring): leave it to the
            # original forward. Not counted: a counter call here would break the traced graph;
            # compile applied before wiring is refused at wire time and counted there.
            return None
        if self.require_cuda and hidden_states.device.type != "cuda":
            stats.fallback(MODEL, NOT_CUDA.because(hidden_states.device))
            return None
        if torch.is_grad_enabled():
            stats.fallback(MODEL, AUTOGRAD)
            return None
        if call["encoder_hidden_states_mask"] is not None:
            stats.fallback(MODEL, PADDED)
            return None
        if self.watch.changed():
            # Graphs captured before froze the old structure (no adapter, no hook) or read the
            # old weight addresses, and the fast body holds the old weights: none may run again.
            # The next bind decides anew.
            moved = self.watch.moved()
            self.graphs.release_all()
            self._fast = None
            self._refused.clear()
            if moved:
                stats.degraded(MODEL, WEIGHTS_MOVED.because(type(self.transformer).__name__))
            elif not self._rearm:
                stats.count(MODEL, "structure_changed")
            self._rearm = True
            self.watch.settle()
        img_shapes, img_mask = call["img_shapes"], call["img_mask"]
        backend = names.backend_name(self.d, self.transformer)
        entry = self.graphs.lookup(kv_cache)
        bufs = entry.buffers if entry is not None else None  # a release may clear it any time
        if bufs is None or not self._still_bound(entry, bufs, kv_cache, hidden_states, timestep,
                                                 img_shapes, img_mask, backend):
            if bufs is not None and not _reads_entry(kv_cache, bufs):
                self.graphs.release(kv_cache)  # re-extracted: the old buffers are unread, pool them
            entry = self._bind(kv_cache, hidden_states, timestep, img_shapes, img_mask, backend)
            if entry is None:
                return None
            bufs = entry.buffers
        # eager: diffusers' own cached forward, what verify mode checks a new exact graph
        # against; a fast graph is checked against its own warm-up (same kernels, same rounding).
        exact = bufs is None or bufs.kv is None
        return self.graphs.run(entry, {"latents": hidden_states, "timestep": timestep},
                               eager=eager if exact else None)

    def _still_bound(self, entry, bufs, kv_cache, hidden_states, timestep, img_shapes, img_mask,
                     backend) -> bool:
        """Whether the owner's binding still describes this step. No host sync."""
        meta = entry.meta
        if (meta.get("layout") != _layout_sig(img_shapes, img_mask)
                or meta.get("step") != _step_sig(hidden_states, timestep)
                or meta.get("backend") != backend):
            return False
        # A new extract into the same cache object stores new tensors: re-copy then.
        for i, (k, v) in enumerate(bufs.prefix):
            layer = kv_cache.get_layer(i)
            if layer.k is not k or layer.v is not v:
                return False
        return True

    def _bind(self, kv_cache, hidden_states, timestep, img_shapes, img_mask, backend):
        tf = self.transformer
        device = hidden_states.device
        lost = self._release.lost() if self._release is not None else None
        if lost is not None:  # a sleep may have discarded memory under the graphs without us
            self.graphs.release_all()
            stats.fallback(MODEL, lost)
            return None
        found = self._structure_reason(kv_cache, device)
        if found is not None:
            stats.fallback(MODEL, found)
            return None
        if self._rearm:
            self.watch.arm()
            self._rearm = False
        prefix = self._read_prefix(kv_cache, hidden_states)
        if prefix is None:
            return None
        prefix_len = prefix[0][0].shape[1]
        layout = self._target_layout(hidden_states, img_shapes, img_mask, prefix_len)
        if layout is None:
            return None
        rotary, target_mask = layout
        fast = self._fast_for(device, target_mask)
        if fast is None and self.mode == "fast":
            compiled = eligibility.scan(tf).compiled
            if compiled is not None:  # the exact body would call the compiled blocks in a capture
                stats.fallback(MODEL, COMPILED.because(compiled))
                return None
        key = PrefixKey(batch=hidden_states.shape[0], prefix_len=prefix_len,
                        target=(hidden_states.shape[1], rotary.shape[0]), dtype=tf.img_in.weight.dtype,
                        device=str(device),
                        backend=f"{fast.name}" if fast is not None else f"exact:{backend}")
        entry = self.graphs.bind(kv_cache, key, prefix,
                                 request={"rotary": rotary, "target_mask": target_mask},
                                 step={"latents": hidden_states, "timestep": timestep},
                                 tail=rotary.shape[0] if fast is not None else 0)
        bufs = entry.buffers if entry is not None else None
        if bufs is None:  # refused (counted), or released by another thread since (run says so)
            return entry
        for i, (k, v) in enumerate(bufs.prefix):
            # The request now reads its prefix from buffers it owns while it lives (an eager step
            # later in this request sees the same values), and the extract step's copies are freed.
            kv_cache.get_layer(i).store(k, v)
        entry.meta.update(layout=_layout_sig(img_shapes, img_mask),
                          step=_step_sig(hidden_states, timestep), backend=backend)
        return entry

    def _structure_reason(self, kv_cache, device) -> Reason | None:
        """The structure gate for this request branch: decided at its first bind (a walk), then
        remembered while the watch sees no change."""
        known = self._refused.get(id(kv_cache))
        if known is not None and known[0]() is kv_cache:
            return known[1]
        # The fast body reads the blocks' weights, never their forward: blocks compiled by
        # vLLM-Omni's runner (regional compile) are no obstacle to it.
        found = structure_reason(self.transformer, device, compiled_ok=self.mode == "fast")
        if found is not None:
            try:
                ref = weakref.ref(kv_cache)
            except TypeError:
                return found
            for key in [k for k, (r, _) in self._refused.items() if r() is None]:
                del self._refused[key]
            self._refused[id(kv_cache)] = (ref, found)
        return found

    def _read_prefix(self, kv_cache, hidden_states):
        tf = self.transformer
        n_layers = len(tf.transformer_blocks)
        dtype = tf.img_in.weight.dtype
        prefix = []
        for i in range(n_layers):
            try:
                layer = kv_cache.get_layer(i)
            except (AttributeError, IndexError, TypeError):
                stats.fallback(MODEL, LAYOUT.because(
                    f"cache of type {type(kv_cache).__name__} has no layer {i} (model has "
                    f"{n_layers})"))
                return None
            if type(layer) is not self.d.layer_cache_cls:
                stats.fallback(MODEL, QUANT_KV.because(f"layer cache is {type(layer).__name__}"))
                return None
            k, v = layer.k, layer.v
            if k is None or v is None:
                stats.fallback(MODEL, NOT_POPULATED.because(f"layer {i}"))
                return None
            for t in (k, v):
                if type(t) is not torch.Tensor or t.dtype != dtype:
                    stats.fallback(MODEL, QUANT_KV.because(
                        f"layer {i}: {type(t).__name__} {getattr(t, 'dtype', None)}, model {dtype}"))
                    return None
            if (k.dim() != 4 or k.shape != v.shape or k.shape[0] != hidden_states.shape[0]
                    or k.device != hidden_states.device
                    or (prefix and k.shape != prefix[0][0].shape)):
                stats.fallback(MODEL, LAYOUT.because(
                    f"layer {i}: k {tuple(k.shape)} v {tuple(v.shape)} on {k.device}"))
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
            stats.fallback(MODEL, LAYOUT.because(repr(exc)))
            return None
        non_target, target_in_tail, n_image = counts
        # The cached step keeps only the joint sequence's tail: the target image must be all of it.
        if (non_target != prefix_len or target_in_tail != target_tokens
                or image_tokens.shape[0] != prefix_len + target_tokens
                or hidden_states.shape[1] != n_image or hidden_states.shape[1] < target_tokens):
            stats.fallback(MODEL, LAYOUT.because(
                f"cached prefix {prefix_len}, layout prefix {non_target}, target {target_tokens}, "
                f"latents {hidden_states.shape[1]} of {n_image}"))
            return None
        return rotary[prefix_len:], target_mask[prefix_len:]

    def precompile(self, target_tokens: int = 4096, batch: int = 1) -> str:
        """Compile the fast regions for ``target_tokens`` (4,096: 1024x1024) at ``batch`` now, so
        the first request of that size pays no compile. Runs the fast step itself, uncaptured, on
        zeros laid out as a request's static buffers with a 16-token prefix (compiled code is
        keyed by batch and target shape, never by the prefix). Returns the log's words."""
        tf = self.transformer
        device = next(tf.parameters()).device
        if device.type != "cuda" and self.require_cuda:
            return "fast step not pre-compiled: not CUDA"
        start = time.perf_counter()
        fast = self._fast_for(device, torch.ones(1, dtype=torch.bool, device=device))
        if fast is None or not fast.compile:
            return "fast step not pre-compiled: " + (
                "compile off" if fast is not None else self._fast.describe())
        attn = tf.transformer_blocks[0].attn
        head_dim, dtype, prefix = attn.inner_dim // attn.heads, tf.img_in.weight.dtype, 16
        try:
            # vLLM-Omni runs requests under inference_mode: compile under it too (Dynamo guards
            # on the grad mode), so the first request reuses this code.
            with torch.inference_mode():
                with torch.inference_mode(False):  # as graphs/prefix.py allocates its buffers
                    kv = [tuple(torch.zeros(batch, prefix + target_tokens, attn.heads, head_dim,
                                            dtype=dtype, device=device) for _ in range(2))
                          for _ in tf.transformer_blocks]
                    bufs = StaticBuffers(
                        prefix=[(k[:, :prefix], v[:, :prefix]) for k, v in kv],
                        request={"rotary": torch.zeros(target_tokens, head_dim // 2,
                                                       dtype=torch.complex64, device=device),
                                 "target_mask": torch.ones(target_tokens, dtype=torch.bool,
                                                           device=device)},
                        step={"latents": torch.zeros(batch, target_tokens, tf.config.in_channels,
                                                     dtype=dtype, device=device),
                              "timestep": torch.zeros(batch, dtype=dtype, device=device)},
                        kv=kv)
                self._fast_step(bufs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except fast_step.CompileFailed as exc:
            self._fast = exc.reason
            stats.degraded(MODEL, FAST_NOT_HERE.because(exc.reason.describe()))
            return f"fast step compile failed ({exc.reason.describe()}): exact step"
        finally:
            kv = bufs = None
        return (f"fast step compiled for {target_tokens} target tokens x batch {batch} in "
                f"{time.perf_counter() - start:.1f} s ({fast.name})")

    def _fast_for(self, device, target_mask) -> _Fast | None:
        """The fast mode's parts for this bind, or None for the exact step (the reason counted)."""
        if self.mode != "fast":
            return None
        if self._fast is None:
            why = fast_step.structure_problem(self.transformer)
            if why is None:
                try:
                    self._fast = _Fast(self.transformer, device, **self._fast_options)
                except fast_step.CompileFailed as exc:
                    why = exc.reason
            if why is not None:
                self._fast = why
        if isinstance(self._fast, Reason):
            stats.degraded(MODEL, FAST_NOT_HERE.because(self._fast.describe()))
            return None
        if not fast_step.mask_all_target(target_mask):  # host sync: once per bind
            stats.degraded(MODEL, FAST_NOT_HERE.because("a target row modulates from t=0"))
            return None
        return self._fast

    def _step(self, bufs: StaticBuffers) -> torch.Tensor:
        """What the graph replays: the fast body for entries bound with K/V tail buffers, the exact
        one otherwise."""
        if bufs.kv is not None and isinstance(self._fast, _Fast):
            try:
                return self._fast_step(bufs)
            except fast_step.CompileFailed as exc:
                # Raised by a warm-up (a compile or recompile that failed), before any capture:
                # this process runs the exact step from here on, over the same buffers.
                self._fast = exc.reason
                stats.degraded(MODEL, FAST_NOT_HERE.because(exc.reason.describe()))
        return self._exact_step(bufs)

    def _head(self, bufs: StaticBuffers):
        """img_in, the timestep embedding and the shared modulation: (hidden, temb, modulation)."""
        tf = self.transformer
        target_tokens = bufs.request["rotary"].shape[0]  # a Python int frozen into the graph
        # img_in over every latent token, as the forward does, so the GEMM shape (hence its bits) match.
        hidden = tf.img_in(bufs.step["latents"])[:, -target_tokens:]
        timestep = bufs.step["timestep"].to(hidden.dtype)
        # The extra t=0 row is what prefix tokens modulate from (causal_condition); the target rows'
        # mask selects the real rows, exactly as the forward does.
        timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        temb = tf.time_text_embed(timestep, hidden)
        return hidden, temb, tf.modulation(temb)

    def _fast_step(self, bufs: StaticBuffers) -> torch.Tensor:
        """The fast body (``fast_step``): each block writes its target K/V into the tail of the
        entry's buffers and attends over prefix + target with the selected kernel."""
        tf = self.transformer
        hidden, temb, modulation = self._head(bufs)
        kv = fast_step.KVBuffers(bufs.kv, bufs.prefix[0][0].shape[1])
        self._fast.blocks.prepare(kv)
        hidden = self._fast.blocks(hidden, modulation, bufs.request["rotary"], kv)
        hidden = tf.norm_out(hidden, temb, bufs.request["target_mask"])
        return tf.proj_out(hidden)

    def _exact_step(self, bufs: StaticBuffers) -> torch.Tensor:
        """The cached step over static buffers, diffusers' own block code. Mirrors the transformer's
        ``"cached"`` path from ``img_in`` to ``proj_out``, with the prologue's per-request results
        read from ``bufs.request``."""
        tf = self.transformer
        rotary, target_mask = bufs.request["rotary"], bufs.request["target_mask"]
        hidden, temb, modulation = self._head(bufs)
        for block, (k, v) in zip(tf.transformer_blocks, bufs.prefix):
            layer = self.d.layer_cache_cls()
            layer.store(k, v)
            hidden = block(hidden_states=hidden, modulation=modulation, rotary_emb=rotary,
                           attention_mask=None, target_token_mask=target_mask, layer_cache=layer,
                           kv_cache_mode="cached")
        hidden = tf.norm_out(hidden, temb, target_mask)
        return tf.proj_out(hidden)


def _reads_entry(kv_cache, bufs: StaticBuffers) -> bool:
    """Whether any layer of the cache still points at an entry's prefix buffers."""
    for i, (k, v) in enumerate(bufs.prefix):
        layer = kv_cache.get_layer(i)
        if layer.k is k or layer.v is v:
            return True
    return False


def _layout_sig(img_shapes, img_mask) -> tuple:
    return tuple(tuple(s) for s in img_shapes[0]), tuple(img_mask.shape)


def _step_sig(hidden_states, timestep) -> tuple:
    return (tuple(hidden_states.shape), hidden_states.dtype, tuple(timestep.shape), timestep.dtype)
