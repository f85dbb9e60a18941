"""Static prefix buffers and one captured cached step per entry, for prefix-KV diffusion models.

Why this exists
    A prefix-KV diffusion transformer runs its first denoising step over the whole sequence and
    keeps the prefix's (text, condition images) K/V. Every later step recomputes only the target
    image's tokens, at a shape fixed for the rest of the request, against prefix K/V that do not
    change either. That step is one fixed kernel sequence whose inputs change only in value, so a
    CUDA graph can replay it without the Python and launch cost of ~a dozen kernels per layer.
    The hooks' cached diffusion steps and denoising branches use it; this file knows no model.

Numbers
    What a replay saves is the launch gaps of an eager step: much where the step is host-bound
    (small images), little where it is kernel-bound; the step body the hook hands in decides the
    rest (an exact or a fast body). Measured figures: ``docs/performance.md``.

    Memory per entry: its prefix buffers, layers x 2 x batch x prefix_len x heads x head_dim x dtype
    bytes (32 layers of 32 heads x 128, bf16, batch 1: prefix 256 -> 134 MB; a two-reference
    edit, prefix 8,448 -> 4.4 GB), plus the graph's share of the plugin's graph pool. While an entry
    is live the request's cache is re-pointed at these buffers, so that costs nothing extra; a free
    entry keeps them until it is reused or evicted (at most ``max_entries`` entries in all).

Workflow (``PrefixGraphs``)
    1. ``bind(owner, key, prefix, request, step)``: the owner (the request's own KV-cache object,
       held by weak reference) gets an entry: a free one with the same key and buffer shapes, or a
       new one while fewer than ``max_entries`` exist (else the least recently used free one is
       evicted). The prefix K/V and per-request tensors are copied in once.
    2. ``run(entry, step)``: the per-step tensors are copied in; on the entry's first run the step
       is captured (``capture.capture``: warm-ups, then the capture into vLLM's global graph
       pool); the graph replays and a clone of its output is returned. In verify mode a new
       graph's first replay is checked against the caller's eager step; a mismatch makes that
       shape eager for the process.
    3. Whatever the graph cannot do (capacity, OOM, capture failure, verify mismatch) returns None
       with its reason counted in ``stats``; the caller then runs its own eager step. A shape
       that ran out of memory or failed to capture stays eager until ``release_all`` (sleep
       level 2); one whose replay mismatched, for the process.

Threads
    Replays take no lock: ``run`` reads the entry's buffers and graph once, into locals, and a
    release (sleep) at any moment only clears the entry's fields; a step that finds them cleared
    before its replay returns None (``RELEASED``) and the caller runs its eager step. Captures are
    serialised by ``capture.capture`` (the process's one capture lock); this object's lock
    guards only its bookkeeping (binding, pooling, eviction), never a capture or a replay.

Request safety
    The first upstream version kept one entry per key and re-pointed every caller's cache at it, so
    a second in-flight request with the same key overwrote the first one's prefix. Here an entry
    belongs to one owner for as long as that object lives; only then (or on ``release``) does it
    return to the pool for the next request with the same key. Each branch of a request (cond, and
    uncond under true CFG) has its own cache object, so it has its own prefix buffers and its own
    graph. The key has no branch field for that reason: ownership separates live branches, and a
    finished branch's graph is valid for any later one of equal shape.

Not covered here: eligibility (the hook decides which steps reach ``run``), padded or bucketed
shapes (one entry per exact shape), and multi-GPU (an entry lives on one device).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any, Callable

import torch

from ..core import stats
from ..core.reasons import CAPTURE_FAILED, OOM, RELEASED, Reason
from . import capture as graph_capture

Tensor = torch.Tensor

CAPACITY = Reason("every prefix-graph entry is held by a live request",
                  "raise VLLM_OMNI_GRAPHDECODE_MAX_ENTRIES (2 per concurrent request under true CFG)")
VERIFY_MISMATCH = Reason("graph replay differed from the eager cached step (verify mode)",
                         "report this with the logged difference; the shape runs eagerly for this "
                         "process")
UNTRACKABLE_OWNER = Reason("the request's cache object cannot be weakly referenced, so its prefix "
                           "buffers could not be kept from other requests",
                           "report this (the cache type changed)")
STEP_MISMATCH = Reason("a step's inputs changed shape or dtype within one request",
                       "report this: the hook's key missed a shape")


@dataclasses.dataclass(frozen=True)
class PrefixKey:
    """What fixes a cached step's kernel sequence. The hook fills it; equal keys with equal buffer
    shapes may share a captured graph (one request at a time)."""

    batch: int
    prefix_len: int
    target: tuple[int, ...]  # the model's target layout, e.g. (image tokens in, target tokens)
    dtype: torch.dtype
    device: str
    backend: str  # the attention backend the step dispatches to
    # Python values the step bakes into its graph (a clamp bound, a flag), as sorted (name, value)
    # pairs: entries with other values never share a graph. The step reads them from
    # ``StaticBuffers.key``.
    consts: tuple = ()

    def __str__(self) -> str:
        target = "x".join(str(t) for t in self.target)
        consts = "".join(f" {name}={value}" for name, value in self.consts)
        return (f"batch={self.batch} prefix={self.prefix_len} target={target} "
                f"{str(self.dtype).replace('torch.', '')} {self.device} attn={self.backend}"
                f"{consts}")


@dataclasses.dataclass(eq=False)
class StaticBuffers:
    """Everything a cached step reads that changes between steps or requests.

    A graph replays against these exact addresses: they are only ever written in place (``copy_``),
    never rebound.
    """

    prefix: list[tuple[Tensor, Tensor]]  # per layer (k, v): copied once per request
    request: dict[str, Tensor]  # per-request inputs (e.g. rotary rows): copied once per request
    step: dict[str, Tensor]  # per-step inputs (e.g. latents, timestep): copied every step
    # With ``tail``: per layer (k, v) of prefix + tail tokens along dim 1, whose first rows are
    # ``prefix`` (views); a step writes its own K/V into the tail in place (no concatenation).
    kv: list[tuple[Tensor, Tensor]] | None = None
    key: PrefixKey | None = None  # the entry's key (its ``consts`` are the step's Python values)


@dataclasses.dataclass(eq=False)
class Entry:
    key: PrefixKey
    sig: tuple  # shape, dtype and device of every buffer
    buffers: StaticBuffers | None
    owner: weakref.ref | None = None
    owner_id: int | None = None
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    output: Tensor | None = None  # the graph's output buffer; the next replay overwrites it
    meta: dict = dataclasses.field(default_factory=dict)  # the hook's notes on the current binding

    def live(self) -> bool:
        return self.owner is not None and self.owner() is not None


def _alloc_like(t: Tensor, rows: int | None = None) -> Tensor:
    """One static buffer like ``t`` (``rows`` along dim 1 instead of ``t``'s; a seam for tests
    that inject an OOM)."""
    shape = t.shape if rows is None else (t.shape[0], rows, *t.shape[2:])
    # A buffer made under inference_mode could not be written outside it, and a later request may
    # run under plain no_grad: make a normal tensor, which either mode may copy into.
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=t.dtype, device=t.device)


def _signature(prefix, request, step, tail: int = 0) -> tuple:
    def sig(t: Tensor) -> tuple:
        return (tuple(t.shape), t.dtype, str(t.device))

    return (tail, tuple((sig(k), sig(v)) for k, v in prefix),
            tuple((name, sig(t)) for name, t in sorted(request.items())),
            tuple((name, sig(t)) for name, t in sorted(step.items())))


class PrefixGraphs:
    """Pooled static-buffer entries, each with one captured cached step. See the module docstring.

    ``step_fn(buffers) -> Tensor`` is the cached step. It must read only ``buffers`` and the model's
    weights, must not synchronize with the host, and must not branch in Python on tensor values:
    whatever Python decides during capture (shapes, layer count, which kernel) is frozen into the
    graph, so the key has to cover it.

    ``capture=False`` runs the same static-buffer step eagerly (CPU tests, and the benchmark's
    static baseline); everything else, ownership and pooling included, is unchanged.
    """

    def __init__(self, model: str, step_fn: Callable[[StaticBuffers], Tensor], *, max_entries: int,
                 verify: bool = False, capture: bool = True, max_idle: int | None = None):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_idle is not None and max_idle < 0:
            raise ValueError(f"max_idle must be >= 0, got {max_idle}")
        self.model = model
        self.step_fn = step_fn
        self.max_entries = max_entries
        # Entries kept in the pool with no owner, least recently used dropped first (None: up to
        # max_entries). For callers whose keys vary per request (a prompt's length), so idle
        # buffers and graphs of lengths that may never come again do not pile up.
        self.max_idle = max_idle
        self.verify = verify
        self.capture = capture
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # LRU first
        self._by_owner: dict[int, Entry] = {}
        self._eager: dict[tuple, Reason] = {}  # (key, sig) -> why it runs eagerly, in this process
        # Bookkeeping only (entries, owners, eager shapes): never held across a capture or a replay.
        self._lock = threading.RLock()

    # -- owners and entries -------------------------------------------------------------------

    def lookup(self, owner: object) -> Entry | None:
        """The entry bound to this live owner, or None."""
        entry = self._by_owner.get(id(owner))
        if entry is None:
            return None
        if entry.owner is None or entry.owner() is not owner:  # a dead owner whose id was reused
            with self._lock:
                if self._by_owner.get(id(owner)) is entry:
                    del self._by_owner[id(owner)]
            return None
        return entry

    def bind(self, owner: object, key: PrefixKey, prefix: list[tuple[Tensor, Tensor]],
             request: dict[str, Tensor], step: dict[str, Tensor], tail: int = 0) -> Entry | None:
        """Give ``owner`` an entry holding copies of ``prefix`` and ``request``; None if it cannot.

        ``step`` is only read for shapes here. ``tail``: room for that many more tokens after the
        prefix in each layer's buffers (``StaticBuffers.kv``). The caller may re-point the owner's
        cache at ``entry.buffers.prefix`` afterwards: those buffers stay the owner's while it lives.
        """
        sig = _signature(prefix, request, step, tail)
        with self._lock:
            previous = self.lookup(owner)
            if previous is not None:
                # The owner may still read that entry's buffers (its cache points there), so the
                # entry must not go back to the pool, where another request would overwrite them:
                # drop it; the owner's own references keep the memory until it lets go. A caller
                # that knows the owner reads them no more calls release() first, which pools it.
                self._drop(previous)
            reason = self._eager.get((key, sig))
            if reason is not None:
                self._drop_free_of(key, sig)
                self._fallback(reason, key)
                return None
            try:
                ref = weakref.ref(owner)
            except TypeError:
                self._fallback(UNTRACKABLE_OWNER.because(type(owner).__name__), key)
                return None
            entry = self._take_free(key, sig)
            if entry is None:
                entry = self._new_entry(key, sig, prefix, request, step, tail)
                if entry is None:
                    return None
            bufs = entry.buffers
            # Copied on the caller's stream, so the copy is ordered before the next replay; the
            # source tensors may be freed by the caller right after (re-pointing drops them).
            for (bk, bv), (k, v) in zip(bufs.prefix, prefix):
                bk.copy_(k)
                bv.copy_(v)
            for name, t in request.items():
                bufs.request[name].copy_(t)
            entry.owner, entry.owner_id, entry.meta = ref, id(owner), {}
            self._by_owner[id(owner)] = entry
            self._entries.move_to_end(id(entry))
            return entry

    def release(self, owner: object) -> None:
        """Return ``owner``'s entry to the pool now instead of when the owner is collected.

        Only once the owner reads its prefix no more: a cache still pointing at the released buffers
        would see the next request's prefix.
        """
        with self._lock:
            entry = self._by_owner.pop(id(owner), None)
            if entry is not None and entry.owner is not None and entry.owner() is owner:
                entry.owner, entry.owner_id = None, None
            if self.max_idle is not None:
                idle = [e for e in self._entries.values() if not e.live()]  # LRU first
                for stale in idle[:max(len(idle) - self.max_idle, 0)]:
                    self._drop(stale)
                    stats.count(self.model, "idle_evictions")

    def release_all(self) -> None:
        """Drop every entry and graph (sleep, unload, a structure change). Live owners keep their
        prefix through their own cache's references; their next step binds a fresh entry.

        Shapes that ran out of memory or failed to capture may try again: the memory and the
        process state they failed on are not what they were (``CAPTURE_FAILED``'s hint says so).
        A verify mismatch stays: the step body itself disagreed with the eager step, which a
        release does not change (``VERIFY_MISMATCH``: for this process)."""
        with self._lock:
            for entry in list(self._entries.values()):
                self._drop(entry)
            self._by_owner.clear()
            self._eager = {k: r for k, r in self._eager.items() if VERIFY_MISMATCH.same(r)}

    def info(self) -> dict[str, int]:
        with self._lock:
            entries = list(self._entries.values())
        return {"entries": len(entries), "live": sum(e.live() for e in entries),
                "captured": sum(e.graph is not None for e in entries), "eager_keys": len(self._eager)}

    def _take_free(self, key: PrefixKey, sig: tuple) -> Entry | None:
        for entry in reversed(self._entries.values()):  # most recently used first
            if entry.key == key and entry.sig == sig and not entry.live():
                self._forget_owner(entry)
                return entry
        return None

    def _new_entry(self, key, sig, prefix, request, step, tail: int = 0) -> Entry | None:
        if len(self._entries) >= self.max_entries and not self._evict_one_free():
            self._fallback(CAPACITY.because(f"max_entries={self.max_entries}"), key)
            return None

        def allocate() -> StaticBuffers:
            kv = None
            if tail:
                rows = prefix[0][0].shape[1] + tail
                kv = [(_alloc_like(k, rows), _alloc_like(v, rows)) for k, v in prefix]
                views = [(k[:, :p.shape[1]], v[:, :p.shape[1]]) for (k, v), (p, _) in zip(kv, prefix)]
            else:
                views = [(_alloc_like(k), _alloc_like(v)) for k, v in prefix]
            return StaticBuffers(
                prefix=views,
                request={name: _alloc_like(t) for name, t in request.items()},
                step={name: _alloc_like(t) for name, t in step.items()},
                kv=kv,
                key=key,
            )

        try:
            buffers = allocate()
        except torch.OutOfMemoryError as exc:
            # The partial allocation is already unreferenced. Idle pooled entries may be what holds
            # the memory: give them back and try once more. If that fails too, stop trying this
            # shape: retrying every step would thrash the allocator at the edge.
            buffers = None
            if self._evict_free():
                stats.count(self.model, "oom_evictions")
                try:
                    buffers = allocate()
                except torch.OutOfMemoryError as again:
                    exc = again
            if buffers is None:
                self._mark_eager(key, sig, OOM.because(repr(exc)))
                return None
        entry = Entry(key=key, sig=sig, buffers=buffers)
        self._entries[id(entry)] = entry
        return entry

    def _evict_one_free(self) -> bool:
        for entry in self._entries.values():  # least recently used first
            if not entry.live():
                self._drop(entry)
                return True
        return False

    def _evict_free(self) -> int:
        free = [e for e in self._entries.values() if not e.live()]
        for entry in free:
            self._drop(entry)
        return len(free)

    def _forget_owner(self, entry: Entry) -> None:
        if entry.owner_id is not None and self._by_owner.get(entry.owner_id) is entry:
            del self._by_owner[entry.owner_id]
        entry.owner, entry.owner_id = None, None

    def _drop(self, entry: Entry) -> None:
        self._forget_owner(entry)
        self._entries.pop(id(entry), None)
        entry.graph = entry.output = entry.buffers = None

    def _mark_eager(self, key: PrefixKey, sig: tuple, reason: Reason) -> None:
        self._eager[(key, sig)] = reason
        self._drop_free_of(key, sig)
        self._fallback(reason, key)

    def _drop_free_of(self, key: PrefixKey, sig: tuple) -> None:
        # Entries of a shape that runs eagerly never replay again; a live one is dropped by the
        # first bind after its owner is gone.
        for entry in [e for e in self._entries.values() if (e.key, e.sig) == (key, sig) and not e.live()]:
            self._drop(entry)

    def _fallback(self, reason: Reason, key: PrefixKey) -> None:
        detail = f"{key}; {reason.detail}" if reason.detail else str(key)
        stats.fallback(self.model, reason.because(detail))

    # -- running a step -----------------------------------------------------------------------

    def run(self, entry: Entry, step: dict[str, Tensor],
            eager: Callable[[], Tensor] | None = None) -> Tensor | None:
        """One cached step for ``entry``'s owner; None when the caller must run its eager step.

        ``eager``, when given, computes the caller's own eager result of this step: verify mode
        checks a new graph's first replay against it (else against the warm-up of ``step_fn``).
        Takes no lock (module docstring, Threads).
        """
        # One read of what a release may clear at any moment: this step uses these objects only.
        bufs, graph, output = entry.buffers, entry.graph, entry.output
        reason = self._eager.get((entry.key, entry.sig))
        if reason is None and bufs is None:
            reason = RELEASED
        if reason is not None:
            self._fallback(reason, entry.key)
            return None
        for name, t in step.items():
            buf = bufs.step.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                self._fallback(STEP_MISMATCH.because(name), entry.key)
                return None
            # The graph reads this address, not the caller's tensor: copy in, never rebind.
            buf.copy_(t)
        warm = None
        if self.capture and graph is None:
            captured = self._capture(entry, bufs)
            if captured is None:
                return None
            graph, output, warm = captured.graph, captured.output, captured.reference
        if entry.buffers is not bufs:
            # Released since the read above (sleep): the inputs went into buffers that are no
            # longer the entry's, and their memory is about to be given back.
            self._fallback(RELEASED.because("between the step's lookup and its replay"), entry.key)
            return None
        if not self.capture:
            stats.count(self.model, "static_step")
            return self.step_fn(bufs)
        # No lock: a capture in another thread records only its own thread's work
        # (capture_error_mode="thread_local"), and graphs of the shared pool replay in order on
        # the device's stream.
        graph.replay()
        stats.count(self.model, "replay")
        # The next replay of this entry overwrites its output buffer in place.
        out = output.clone()
        if warm is not None and self.verify:
            out = self._verify(entry, out, eager() if eager is not None else warm)
        return out

    def _capture(self, entry: Entry, bufs: StaticBuffers) -> graph_capture.Captured | None:
        """Capture the step over ``bufs`` (serialised with every other capture of the process by
        ``capture.capture``) and publish it on ``entry`` unless the entry was released
        meanwhile; None when it failed (reason counted)."""
        try:
            captured = graph_capture.capture(lambda: self.step_fn(bufs),
                                             torch.device(entry.key.device))
        except graph_capture.CaptureFailed as exc:
            with self._lock:
                if exc.oom:
                    self._evict_free()
                    self._mark_eager(entry.key, entry.sig, OOM.because(exc))
                else:  # any other capture error: this shape stays eager, the step goes on
                    self._mark_eager(entry.key, entry.sig, CAPTURE_FAILED.because(exc))
            stats.logger.debug("graphdecode: %s capture failed", self.model, exc_info=True)
            return None
        with self._lock:
            if entry.buffers is bufs:
                entry.graph, entry.output = captured.graph, captured.output
        stats.count(self.model, "capture")
        return captured

    def _verify(self, entry: Entry, out: Tensor, reference: Tensor) -> Tensor:
        result = graph_capture.compare(out, reference, graph_capture.VERIFY_RTOL)
        if result.ok:
            stats.count(self.model, graph_capture.VERIFIED)
            if not result.exact:
                stats.logger.info("graphdecode: %s graph replay within tolerance of the eager "
                                  "step (max abs diff %.3g) for %s", self.model,
                                  result.max_abs_diff, entry.key)
            return out
        # Disable every graph of this shape; this step returns the eager result it was checked
        # against.
        stats.count(self.model, graph_capture.VERIFY_MISMATCH)
        with self._lock:
            entry.graph = entry.output = None
            self._mark_eager(entry.key, entry.sig,
                             VERIFY_MISMATCH.because(f"max abs diff {result.max_abs_diff:.3g}"))
        return reference
