"""Autoregressive decode sessions: one sequence at a time through paged K/V and captured graphs.

Model-agnostic. A model hook supplies a ``StepModel`` (its static inputs and one decode step over
a ``PagedKVCache``) and a gate (why a request may not take this path); this module does the rest
of what every autoregressive model would repeat:

- ``PagedDecoder``: the paged buffers and their graphs for one model, in two tiers. The *pinned*
  tier is the first allocation (the pre-capture buckets, or the first request's) and is never
  reallocated, so its graphs survive a longer request; a request that outgrows it moves, tokens
  and all, to the *overflow* tier, which grows in the bucket schedule and drops only its own
  graphs when it does. Under memory pressure the pinned tier gives way (one tier, as before).
- ``ARSessions``: the per-pipeline gate and the life of each request's session:
  ``open`` (the gate, then the pipeline's lock: one sequence decodes on the paged path at a
  time; a request from another thread waits for it, then takes the path itself. Waiting, not
  decoding eagerly beside it: a capture records this device's work, and another thread's eager
  decode running into one made that thread fail and the capture with it on the H200),
  ``Session.step``, ``finish``
  (decoded K/V written back before the caller reads its cache), ``close``; hand-backs on OOM or
  a failed capture (the request continues eagerly from exactly the tokens decoded so far);
  per-request graphs when dynamic LoRA wrappers are present (a capture freezes the adapter
  branch); pre-capture at load; and ``release`` (sleep level 2), which waits for a request
  decoding in another thread to finish, or hands back the calling thread's own request first.

Counted under the model's key: ``paged_request``, ``lora_request``, and from ``paged_decode``
``capture``, ``replay``, ``paged_eager_step``, ``verified`` / ``verify_mismatch``; fallbacks by
reason (``BUSY``, ``OOM``, ``CAPTURE_FAILED``, ``CACHE_SHAPE``, ``RELEASED``, and the hook's own).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol, Sequence

import torch

from . import stats
from .cuda_graphs import CaptureFailed, is_oom
from .paged_decode import DecodeGraphRunner, PagedKVCache
from .reasons import Reason
from .token_loop import Lookahead, Sampling, TokenProgram

logger = stats.logger

BUSY = Reason("another request is decoding on this pipeline",
              "nothing to change: one sequence at a time decodes on the paged path; a request "
              "that finds it taken waits its turn (up to WAIT_S), and runs eagerly after that or "
              "when its own thread already holds it")
# How long a request waits for the one decoding before it: decode loops are bounded (a
# 1024-token think is ~7 s on the graph path, ~60 s eagerly on vllm-omni 0.26).
WAIT_S = 300.0
# Sampling temperatures whose multi-token programs (and graphs) a tier keeps at once.
SAMPLED_PROGRAMS = 2
OOM = Reason("out of memory allocating paged K/V",
             "lower VLLM_OMNI_GRAPHDECODE_BUCKETS / _PRECAPTURE_BUCKETS or free device memory")
CAPTURE_FAILED = Reason("graph capture failed",
                        "report it with the log; sleep level 2 (release_captured_graphs) retries "
                        "capture")
CACHE_SHAPE = Reason("prefix cache is not one bf16/fp16 sequence",
                     "nothing to change (the pipeline decodes one sequence), or serve in bf16/fp16")
RELEASED = Reason("graphs released (sleep) during this request",
                  "nothing to change: the request finishes eagerly; the next one captures again")


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


def dynamic_cache_reason(cache, kernel) -> Reason | None:
    """Why a transformers ``DynamicCache`` cannot be loaded into paged buffers, or None."""
    layers = getattr(cache, "layers", None)
    keys = getattr(layers[0], "keys", None) if layers else None
    if keys is None or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[2] == 0:
        return CACHE_SHAPE.because(f"keys shape {None if keys is None else tuple(keys.shape)}")
    if kernel.fa_version is not None and keys.dtype not in (torch.float16, torch.bfloat16):
        return CACHE_SHAPE.because(f"dtype {keys.dtype}")
    return None


class _Tier:
    def __init__(self, decoder: "PagedDecoder", length: int, dtype):
        m = decoder.model
        self.decoder = decoder
        self.cache = PagedKVCache(m.num_layers, m.kv_heads, m.head_dim, dtype=dtype,
                                  device=m.device, buckets=decoder.buckets, kernel=decoder.kernel,
                                  length=length, writer=m.writer)
        self.runner = DecodeGraphRunner(self.step, self.cache, model=decoder.name,
                                        graphs=decoder.graphs, verify=decoder.verify,
                                        pool=decoder.pool)
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
                                   graphs=d.graphs, verify=d.verify, pool=d.pool,
                                   sampling=sampling)
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
    """

    def __init__(self, model: StepModel, *, name: str, kernel, buckets: Sequence[int],
                 graphs: bool = True, verify: bool = False, pool=None, tokens_per_launch: int = 1):
        self.model = model
        self.name = name
        self.kernel = kernel
        self.buckets = tuple(buckets)
        self.graphs = graphs
        self.verify = verify
        self.pool = pool
        self.tokens_per_launch = tokens_per_launch
        self.pinned: _Tier | None = None
        self.overflow: _Tier | None = None
        self.current: _Tier | None = None

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


class ARSessions:
    """The paged decode path of one pipeline: its gate, its one live session, pre-capture and
    release. See the module docstring.

    ``gate()`` returns why no request may take the path now (the hook's rules), or None.
    ``per_request()`` says whether graphs must not outlive a request (dynamic LoRA wrappers).
    ``make_decoder()`` builds the ``PagedDecoder`` on first use.
    """

    def __init__(self, model: str, *, make_decoder: Callable[[], PagedDecoder],
                 gate: Callable[[], Reason | None], per_request: Callable[[], bool], kernel):
        self.model = model
        self.make_decoder = make_decoder
        self.gate = gate
        self.per_request = per_request
        self.kernel = kernel
        self.lock = threading.Lock()
        self.decoder: PagedDecoder | None = None
        self.session: Session | None = None
        self.capture_failed: str | None = None  # sticky until release(): capture is retried then

    def refusal(self) -> Reason | None:
        """Why a request cannot take the paged path now (not counting the lock), or None."""
        reason = self.gate()
        if reason is None and self.capture_failed is not None:
            reason = CAPTURE_FAILED.because(self.capture_failed)
        return reason

    def open(self, past_key_values, *, finish_on_close: bool) -> "Session | None":
        """A session for this request's decode loop, or None (the reason counted) to run it
        eagerly. ``finish_on_close``: write the decoded K/V back when the loop ends (the caller
        reads the cache afterwards)."""
        reason = self.refusal() or dynamic_cache_reason(past_key_values, self.kernel)
        if reason is not None:
            stats.fallback(self.model, reason)
            return None
        holder = self.session
        if holder is not None and holder.thread == threading.get_ident():
            stats.fallback(self.model, BUSY.because("a decode loop inside this thread's own"))
            return None
        start = time.perf_counter()
        if not self.lock.acquire(blocking=False):
            if not self.lock.acquire(timeout=WAIT_S):
                stats.fallback(self.model, BUSY.because(f"waited {WAIT_S:.0f} s"))
                return None
            stats.count(self.model, "decode_waits")
            logger.debug("graphdecode: %s request waited %.3f s for the paged decode", self.model,
                         time.perf_counter() - start)
            if self.capture_failed is not None:  # the request it waited for found out
                self.lock.release()
                stats.fallback(self.model, CAPTURE_FAILED.because(self.capture_failed))
                return None
        try:
            per_request = self.per_request()
            if self.decoder is None:
                self.decoder = self.make_decoder()
            if per_request:
                # Graphs from an earlier request froze that request's adapter state.
                self.decoder.drop_graphs()
                stats.count(self.model, "lora_request")
            self.decoder.begin(past_key_values)
        except BaseException as exc:
            self.lock.release()
            if not is_oom(exc):
                raise
            # Under memory pressure keep nothing: the eager request needs room for its cache.
            self._drop_decoder()
            stats.fallback(self.model, OOM.because(f"{type(exc).__name__}: {exc}"))
            return None
        stats.count(self.model, "paged_request")
        self.session = Session(self, past_key_values, per_request, finish_on_close)
        return self.session

    def _drop_decoder(self) -> None:
        decoder, self.decoder = self.decoder, None
        if decoder is not None:
            decoder.release()

    def precapture(self, buckets: Sequence[int], dtype) -> str:
        """Capture ``buckets`` now (model load). Returns the line for the load log."""
        reason = self.refusal()
        if reason is not None:
            return f"pre-capture skipped: {reason.key}"
        if self.per_request():
            return "pre-capture skipped: dynamic LoRA wrappers present (graphs are per request)"
        with self.lock:
            try:
                torch.cuda.synchronize()
                reserved, start = torch.cuda.memory_reserved(), time.perf_counter()
                free_before = torch.cuda.mem_get_info()[0]
                if self.decoder is None:
                    self.decoder = self.make_decoder()
                self.decoder.precapture(buckets, dtype)
                torch.cuda.synchronize()
            except Exception as exc:
                self._drop_decoder()
                if is_oom(exc):
                    stats.fallback(self.model, OOM.because(f"pre-capture: {exc}"))
                    return f"pre-capture skipped: {OOM.key}"
                self.capture_failed = str(exc)[:300]
                stats.fallback(self.model, CAPTURE_FAILED.because(self.capture_failed))
                return f"pre-capture failed: {exc}"
            seconds = time.perf_counter() - start
            # Free device memory catches what graphs hold outside the caching allocator too.
            took = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
            grown = (torch.cuda.memory_reserved() - reserved) / 2**20
            kv = self.decoder.nbytes / 2**20
        line = (f"pre-captured buckets {','.join(map(str, buckets))} in {seconds:.2f} s, took "
                f"{took:.0f} MiB (+{grown:.0f} MiB reserved; paged K/V {kv:.0f} MiB)")
        logger.info("graphdecode: %s %s", self.model, line)
        return line

    def release(self) -> None:
        """Sleep level 2: drop graphs and buffers; the next request allocates and captures anew.

        A request decoding in another thread keeps its buffers until its loop ends: this waits
        for it. Called from inside the calling thread's own request, that request is handed back
        to the eager path first (its cache then holds every token decoded so far).
        """
        session = self.session
        if session is not None and session.thread == threading.get_ident():
            if session.live:
                session.hand_back(RELEASED)
            self._drop_decoder()
            self.capture_failed = None
            return
        with self.lock:
            self._drop_decoder()
            self.capture_failed = None


class Session:
    """One request's decode loop on the paged path. Owns the sessions' lock until ``close``."""

    def __init__(self, owner: ARSessions, cache, per_request: bool, finish_on_close: bool):
        self.owner = owner
        self.cache = cache
        self.per_request = per_request
        self.finish_on_close = finish_on_close
        self.thread = threading.get_ident()
        self.live = True
        self.steps = 0
        self.ahead: Lookahead | None = None

    def launches(self, *, stops=(), limit: int | None = None,
                 sampling: Sampling | None = None) -> None:
        """Serve the loop's tokens from multi-token launches (``decode``): it picks each next
        token by argmax (``sampling`` None) or draws it as ``sampling`` says. ``stops``/``limit``:
        the loop's stop tokens and token limit, when known."""
        if self.decoder.tokens_per_launch > 1:
            self.ahead = self.decoder.lookahead(stops=stops, limit=limit, sampling=sampling)

    @property
    def decoder(self) -> PagedDecoder:
        return self.owner.decoder

    def serves(self, cache) -> bool:
        return self.live and cache is self.cache and threading.get_ident() == self.thread

    def step(self, token, position: int):
        """Logits for ``token``, or None after handing the request back to the eager path (the
        cache then holds every token decoded so far)."""
        return self._run(self.decoder.step, token, position)

    def decode(self, token: int, position: int) -> int | None:
        """The token after ``token`` (``launches`` first), or None after a hand-back."""
        return self._run(self.ahead.next, token, position)

    def _run(self, fn, token, position):
        try:
            out = fn(token, position)
        except Exception as exc:
            if is_oom(exc):  # growing the buffers, or allocating inside a capture
                length = self.decoder.cache.length
                self.hand_back(OOM.because(f"at {length} tokens: {exc}"))
                return None
            if not isinstance(exc, CaptureFailed):
                raise
            self.owner.capture_failed = str(exc)[:300]
            self.hand_back(CAPTURE_FAILED.because(self.owner.capture_failed))
            return None
        self.steps += 1
        return out

    def _settle(self) -> None:
        """Nothing runs ahead any more (the valid length already excludes it)."""
        if self.ahead is not None:
            self.ahead.drain()
            self.ahead = None

    def hand_back(self, reason: Reason) -> None:
        """Write the decoded K/V back and let the eager path take over this request."""
        self._settle()
        self.decoder.write_back(self.cache)
        self.live = False
        stats.fallback(self.owner.model, reason)
        if OOM.same(reason):
            # The eager loop that takes over grows its own cache: give it this memory.
            self.owner._drop_decoder()
        else:
            self.decoder.drop_graphs()

    def finish(self) -> None:
        """The cache is about to be read: write the decoded K/V back and stop serving it."""
        self._settle()
        if self.live and self.steps:
            self.decoder.write_back(self.cache)
        self.live = False

    def close(self) -> None:
        try:
            self._settle()
            if self.finish_on_close:
                self.finish()
            self.live = False
            if self.per_request and self.owner.decoder is not None:
                self.owner.decoder.drop_graphs()
        finally:
            self.owner.session = None
            self.owner.lock.release()
