"""One model's paged decode in two tiers of buffers: what ``session.py`` serves requests from.

The *pinned* tier is the first allocation (the pre-capture buckets, or the first request's) and
is never reallocated, so its graphs survive a longer request; a request that outgrows it moves,
tokens and all, to the *overflow* tier, which grows in the bucket schedule and drops only its own
graphs when it does. Under memory pressure the pinned tier gives way (one tier, as before).

Model-agnostic: a hook supplies a ``StepModel``. ``session.py`` re-exports ``PagedDecoder`` and
``StepModel``, beside the sessions that serve requests from them.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from ..graphs.capture import is_oom
from .paged import DecodeGraphRunner, PagedKVCache
from .token_loop import Lookahead, Sampling, TokenProgram

# Sampling temperatures whose multi-token programs (and graphs) a tier keeps at once.
SAMPLED_PROGRAMS = 2


class StepModel(Protocol):
    """What a hook supplies: one decode step of its model over a ``PagedKVCache``.

    ``forward(cache)`` reads only static tensors (the model's weights, the inputs written by
    ``set_inputs``, the cache's buffers and device state) and returns the logits; it is what a
    graph records. ``set_inputs`` writes the step's token and position into those tensors in place.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    device: torch.device
    writer: Callable | None  # the cache's one-kernel K/V writer, or None

    def set_inputs(self, token, position: int) -> None: ...

    def forward(self, cache: PagedKVCache) -> torch.Tensor: ...


class _Tier:
    def __init__(self, decoder: "PagedDecoder", length: int, dtype):
        m = decoder.model
        self.decoder = decoder
        self.cache = PagedKVCache(m.num_layers, m.kv_heads, m.head_dim, dtype=dtype,
                                  device=m.device, buckets=decoder.buckets, kernel=decoder.kernel,
                                  length=length, writer=m.writer)
        self.runner = DecodeGraphRunner(self.step, self.cache, model=decoder.name,
                                        graphs=decoder.graphs, verify=decoder.verify,
                                        on_capture_failed=decoder.capture_failed_hook())
        # (k, sampling) -> program; sampling None: greedy
        self.programs: dict[tuple[int, Sampling | None], TokenProgram] = {}

    def step(self) -> torch.Tensor:
        self.cache.begin_step()
        return self.decoder.model.forward(self.cache)

    def program(self, k: int, sampling: Sampling | None = None) -> TokenProgram:
        """The ``k``-token program over this tier's cache (``token_loop``), greedy or sampling.
        At most ``SAMPLED_PROGRAMS`` sampling temperatures keep their programs (and graphs):
        the least recently used goes first."""
        key = (k, sampling)
        program = self.programs.pop(key, None)
        if program is None:
            d = self.decoder
            program = TokenProgram(d.model, self.cache, k, self.step, name=d.name,
                                   graphs=d.graphs, verify=d.verify,
                                   sampling=sampling, on_capture_failed=d.capture_failed_hook())
            sampled = [other for other in self.programs if other[1] is not None]
            if sampling is not None and len(sampled) >= SAMPLED_PROGRAMS:
                self.programs.pop(sampled[0]).runner.drop_graphs()
        self.programs[key] = program  # re-inserted: the dict's order is the order of use
        return program

    @property
    def runners(self) -> list[DecodeGraphRunner]:
        return [self.runner] + [p.runner for p in self.programs.values()]

    def drop_graphs(self) -> None:
        for runner in self.runners:
            runner.drop_graphs()

    def reset(self) -> None:
        for runner in self.runners:
            runner.reset()

    def release(self) -> None:
        self.drop_graphs()
        self.cache.release()


class PagedDecoder:
    """One model's paged decode: ``begin`` a sequence from its prefill cache, ``step`` token by
    token, ``write_back`` the decoded K/V. See the module docstring for the two tiers.

    ``step`` returns the logits; with graphs this is the graph's static output, overwritten by the
    next step. On an exception (OOM while growing, ``CaptureFailed``) the current tier still holds
    exactly the tokens before the failed step.

    ``on_capture_failed``: None (a failed capture raises ``CaptureFailed``), or called with the
    error after ``graphs_off()``, the step then running eagerly (``DecodeGraphRunner``).
    """

    def __init__(self, model: StepModel, *, name: str, kernel, buckets: Sequence[int],
                 graphs: bool = True, verify: bool = False, tokens_per_launch: int = 1):
        self.model = model
        self.name = name
        self.kernel = kernel
        self.buckets = tuple(buckets)
        self.graphs = graphs
        self.verify = verify
        self.tokens_per_launch = tokens_per_launch
        self.pinned: _Tier | None = None
        self.overflow: _Tier | None = None
        self.current: _Tier | None = None
        self.on_capture_failed = None

    def capture_failed_hook(self):
        """What this decoder's runners call when a capture fails (None: they raise)."""
        return self._capture_failed if self.on_capture_failed is not None else None

    def _capture_failed(self, exc: Exception) -> None:
        self.graphs_off()
        self.on_capture_failed(exc)

    def graphs_off(self) -> None:
        """Drop every graph and run every step without one from now on: the same kernels on the
        same buffers (a failed capture, a release in the middle of a request)."""
        self.graphs = False
        for tier in self.tiers:
            for runner in tier.runners:
                runner.graphs_enabled = False
            tier.drop_graphs()

    @property
    def tiers(self) -> list[_Tier]:
        return [t for t in (self.pinned, self.overflow) if t is not None]

    @property
    def cache(self) -> PagedKVCache | None:
        return self.current.cache if self.current else None

    @property
    def num_graphs(self) -> int:
        return sum(r.num_graphs for t in self.tiers for r in t.runners)

    @property
    def nbytes(self) -> int:
        return sum(t.cache.nbytes for t in self.tiers)

    def _fits(self, tier: _Tier | None, dtype) -> bool:
        m = self.model
        return tier is not None and tier.cache.fits(m.num_layers, m.kv_heads, m.head_dim, dtype,
                                                    m.device)

    def _pinned(self, length: int, dtype) -> _Tier:
        if not self._fits(self.pinned, dtype):
            self.release()
            self.pinned = _Tier(self, length, dtype)
        return self.pinned

    def _overflow(self, length: int, dtype, *, pinned_may_go: bool) -> _Tier:
        if self._fits(self.overflow, dtype):
            return self.overflow
        try:
            self.overflow = _Tier(self, length, dtype)
        except Exception as exc:
            # pinned_may_go: no request's tokens live in the pinned tier (a request starts). Then,
            # with no room for both, it gives way with its graphs: one tier from now on.
            if not (is_oom(exc) and pinned_may_go and self.pinned is not None):
                raise
            self.release()
            self.pinned = _Tier(self, length, dtype)
            return self.pinned
        return self.overflow

    @torch.inference_mode()
    def begin(self, past_key_values) -> int:
        """Load the prefill ``DynamicCache``; returns its length. May raise an OOM (nothing kept)."""
        keys = past_key_values.layers[0].keys
        need, dtype = keys.shape[2] + 1, keys.dtype
        tier = self._pinned(need, dtype)
        if need > tier.cache.capacity:
            tier = self._overflow(need, dtype, pinned_may_go=True)
        tier.reset()
        self.current = tier
        return tier.cache.load(past_key_values)

    def room(self, n: int) -> _Tier:
        """Make the current tier hold ``n`` tokens, moving to the overflow tier (the valid tokens
        with it) when the pinned one is too small. Returns the current tier."""
        tier = self.current
        if n > tier.cache.capacity and tier is self.pinned:
            over = self._overflow(n, tier.cache.dtype, pinned_may_go=False)
            if over is not tier:
                over.cache.copy_from(tier.cache, tier.cache.length)
                over.reset()
                self.current = tier = over
        return tier

    def lookahead(self, *, stops=(), limit: int | None = None,
                  sampling: Sampling | None = None) -> Lookahead:
        """A loop's token server over this decoder (``token_loop``): greedy, or sampling as
        ``sampling`` says."""
        return Lookahead(self, self.tokens_per_launch, stops=stops, limit=limit,
                         sampling=sampling)

    @torch.inference_mode()
    def step(self, token, position: int) -> torch.Tensor:
        """Decode ``token`` (a (1,) long tensor or an int) at ``position``."""
        n = self.current.cache.length + 1
        tier = self.room(n)
        tier.cache.reserve(n)
        tier.cache.set_length(n)
        try:
            self.model.set_inputs(token, position)
            return tier.runner.step()
        except BaseException:
            tier.cache.set_length(n - 1)
            raise

    @torch.inference_mode()
    def write_back(self, past_key_values) -> None:
        self.current.cache.write_back(past_key_values)

    @torch.inference_mode()
    def precapture(self, buckets: Sequence[int], dtype) -> float:
        """Allocate the pinned tier for the largest of ``buckets`` and capture each bucket's graph
        there. Returns capture seconds."""
        tier = self._pinned(max(buckets), dtype)
        tier.cache.reserve(max(buckets))
        tier.cache.set_length(1)  # step 0 writes slot 0; the next load() overwrites it
        seconds = 0.0
        k = self.tokens_per_launch
        for bucket in sorted(buckets):
            tier.cache.reserve(bucket)
            seconds += tier.runner.capture()
            if k > 1 and bucket >= k:
                # A launch starting at the first token writes rows 0..k-1: harmless, as above.
                program = tier.program(k)
                program.start_length.fill_(1)
                seconds += program.runner.capture()
        self.current = tier
        return seconds

    def drop_graphs(self) -> None:
        for tier in self.tiers:
            tier.drop_graphs()

    def release(self) -> None:
        """Drop every graph and buffer."""
        for tier in self.tiers:
            tier.release()
        self.pinned = self.overflow = self.current = None
