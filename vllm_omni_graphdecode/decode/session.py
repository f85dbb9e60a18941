"""Autoregressive decode sessions: one sequence at a time through paged K/V and captured graphs.

Model-agnostic. A model hook supplies a ``StepModel`` (its static inputs and one decode step over
a ``PagedKVCache``) and a gate (why a request may not take this path); this module does the rest
of what every autoregressive model would repeat:

- ``PagedDecoder`` (``decode/tiers.py``): the paged buffers and their graphs for one model, in a
  pinned and an overflow tier.
- ``ARSessions``: the per-pipeline gate and the life of each request's session:
  ``open`` (the gate, then the pipeline's lock: one sequence decodes on the paged path at a
  time; a request from another thread waits for it, then takes the path itself. Waiting, not
  decoding eagerly beside it: a capture records this device's work, and another thread's eager
  decode running into one made that thread fail and the capture with it on the H200),
  ``Session.step``, ``finish``
  (decoded K/V written back before the caller reads its cache), ``close``; a hand-back on OOM
  (the request continues on the pipeline's eager path from exactly the tokens decoded so far);
  per-request graphs when dynamic LoRA wrappers are present (a capture freezes the adapter
  branch); pre-capture at load; and ``release`` (sleep level 2), which waits for a request
  decoding in another thread to finish; called from inside the calling thread's own request,
  that request goes on with the same step without graphs and its buffers go when it ends.
- A failed capture does not change an answer either: the decoder drops its graphs and runs the
  same step eagerly (the same kernels on the same buffers), for this request and the next ones,
  until a release lets capture try again.

Counted under the model's key: ``paged_request``, ``lora_request``, and from ``decode/paged.py``
``capture``, ``replay``, ``paged_eager_step``, ``verified`` / ``verify_mismatch``; fallbacks by
reason (``BUSY``, ``OOM``, ``CAPTURE_FAILED``, ``CACHE_SHAPE``, ``RELEASED``, and the hook's own).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch

from ..core import stats
from ..core.reasons import CAPTURE_FAILED, OOM, RELEASED, Reason
from ..graphs.capture import CaptureFailed, is_oom
from .tiers import PagedDecoder, StepModel
from .token_loop import Lookahead, Sampling

__all__ = ["ARSessions", "BUSY", "CACHE_SHAPE", "CAPTURE_FAILED", "OOM", "PagedDecoder",
           "RELEASED", "Session", "StepModel", "dynamic_cache_reason"]

logger = stats.logger

BUSY = Reason("another request is decoding on this pipeline",
              "nothing to change: one sequence at a time decodes on the paged path; a request "
              "that finds it taken waits its turn (up to WAIT_S), and runs eagerly after that or "
              "when its own thread already holds it")
# How long a request waits for the one decoding before it: decode loops are bounded (a
# 1024-token think is ~7 s on the graph path, ~60 s eagerly on vllm-omni 0.26).
WAIT_S = 300.0
CACHE_SHAPE = Reason("prefix cache is not one bf16/fp16 sequence",
                     "nothing to change (the pipeline decodes one sequence), or serve in bf16/fp16")


def dynamic_cache_reason(cache, kernel) -> Reason | None:
    """Why a transformers ``DynamicCache`` cannot be loaded into paged buffers, or None."""
    layers = getattr(cache, "layers", None)
    keys = getattr(layers[0], "keys", None) if layers else None
    if keys is None or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[2] == 0:
        return CACHE_SHAPE.because(f"keys shape {None if keys is None else tuple(keys.shape)}")
    if kernel.fa_version is not None and keys.dtype not in (torch.float16, torch.bfloat16):
        return CACHE_SHAPE.because(f"dtype {keys.dtype}")
    return None


class ARSessions:
    """The paged decode path of one pipeline: its gate, its one live session, pre-capture and
    release. See the module docstring.

    ``gate()`` returns why no request may take the path now (the hook's rules), or None.
    ``per_request()`` says whether graphs must not outlive a request (dynamic LoRA wrappers).
    ``make_decoder()`` builds the ``PagedDecoder`` on first use.
    ``changed()``, checked before every token a session serves (constant time), returns why the
    model changed under the request, or None: the request is then handed back to the eager path.
    """

    def __init__(self, model: str, *, make_decoder: Callable[[], PagedDecoder],
                 gate: Callable[[], Reason | None], per_request: Callable[[], bool], kernel,
                 changed: Callable[[], Reason | None] | None = None):
        self.model = model
        self.changed = changed
        self.make_decoder = make_decoder
        self.gate = gate
        self.per_request = per_request
        self.kernel = kernel
        self.lock = threading.Lock()
        self.decoder: PagedDecoder | None = None
        self.session: Session | None = None
        # Until release(): steps run without graphs (capture is tried again after a release).
        self.capture_failed: str | None = None

    def refusal(self) -> Reason | None:
        """Why a request cannot take the paged path now (not counting the lock), or None."""
        return self.gate()

    def _new_decoder(self) -> PagedDecoder:
        decoder = self.make_decoder()
        decoder.on_capture_failed = self._graphs_failed
        if self.capture_failed is not None:
            decoder.graphs_off()
        return decoder

    def _graphs_failed(self, exc: Exception) -> None:
        """A capture failed (its decoder has turned graphs off): counted for this request."""
        self.capture_failed = str(exc)[:300]
        stats.fallback(self.model, CAPTURE_FAILED.because(
            f"decode goes on without graphs, the same step: {self.capture_failed}"))

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
        try:
            per_request = self.per_request()
            if self.decoder is None:
                self.decoder = self._new_decoder()
            elif self.capture_failed is not None:
                stats.fallback(self.model, CAPTURE_FAILED.because(
                    f"decode runs without graphs, the same step: {self.capture_failed}"))
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
                # Cached blocks freed during capture (load-time temporaries, e.g. the FP8 copies'
                # quantisation) would count against it: measured once as -378 MiB.
                torch.cuda.empty_cache()
                reserved, start = torch.cuda.memory_reserved(), time.perf_counter()
                free_before = torch.cuda.mem_get_info()[0]
                if self.decoder is None:
                    self.decoder = self._new_decoder()
                self.decoder.precapture(buckets, dtype)
                torch.cuda.synchronize()
            except Exception as exc:
                if is_oom(exc):
                    self._drop_decoder()
                    stats.fallback(self.model, OOM.because(f"pre-capture: {exc}"))
                    return f"pre-capture skipped: {OOM.key}"
                if not isinstance(exc, CaptureFailed):
                    self._drop_decoder()
                    raise
                self.decoder.graphs_off()
                self._graphs_failed(exc)
                return f"pre-capture failed, decode runs without graphs: {exc}"
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
            self.capture_failed = None
            if session.live and self.decoder is not None:
                session.graphless(RELEASED.because("decode goes on without graphs, the same "
                                                   "step"))
                return
            self._drop_decoder()
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
        self.drop_decoder_at_close = False

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
        changed = self.owner.changed() if self.owner.changed is not None else None
        if changed is not None:
            self.hand_back(changed)
            return None
        try:
            out = fn(token, position)
        except Exception as exc:
            if not is_oom(exc):  # a failed capture runs eagerly inside (``_graphs_failed``)
                raise
            # Growing the buffers: the eager loop taking over grows its own cache.
            length = self.decoder.cache.length
            self.hand_back(OOM.because(f"at {length} tokens: {exc}"))
            return None
        self.steps += 1
        return out

    def graphless(self, reason: Reason) -> None:
        """Sleep released the graphs under this request: it goes on with the same step without
        them (a launch already running ahead finishes and is served), and the decoder's buffers
        go when it closes. Counted once per request."""
        if self.drop_decoder_at_close:
            return
        self.decoder.graphs_off()
        self.drop_decoder_at_close = True
        stats.fallback(self.owner.model, reason)

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
            if self.drop_decoder_at_close:
                self.owner._drop_decoder()
            elif self.per_request and self.owner.decoder is not None:
                self.owner.decoder.drop_graphs()
        finally:
            self.owner.session = None
            self.owner.lock.release()
