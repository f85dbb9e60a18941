"""Capturing a CUDA graph, for both of this plugin's paths: one pool, one warm-up stream, one
capture routine with recovery, one verify comparison.

``capture(fn, device)`` is the only place a graph is recorded (``decode/paged.py`` and
``graphs/prefix.py`` both call it). Its workflow:

1. Warm up ``WARMUPS`` times on the device's one warm-up stream (lazy initialisation: cuBLAS
   handles and workspaces, Triton autotuning, torch.compile's first compile, first-call
   allocations must not happen inside the capture). The second warm-up runs exactly what the
   capture records, with whatever the first one cached in place; its output is the eager
   reference verify mode may compare a replay with.
2. Capture ``fn`` into the plugin's graph pool (below), with ``capture_error_mode="thread_local"``:
   another thread's CUDA work (a second request running eagerly on the same model, another
   model's step) neither joins the capture nor invalidates it. torch's default, ``"global"``,
   made such a thread fail with "operation not permitted when stream is capturing" and the
   capture with it (seen on the H200: a second request of the same model decoding eagerly while
   the first captured).
3. Give the device's random generator back the state it had before the warm-ups (a sampling
   step draws in them; the capture itself draws nothing). What another thread drew from it
   during the capture is drawn again after it: the paged path decodes one request at a time, so
   only an eager request sampling on another thread meanwhile would see it.
4. On any failure, repair what a failed capture leaves (``recover_failed_capture``) and raise
   ``CaptureFailed`` from the original error (``.oom`` says whether it was memory).

While a graph records, Python's cyclic garbage collector is off (``_recording``). torch does not
collect before a capture (its ``torch.cuda.graph`` does only under
``torch.compiler.config.force_cudagraph_gc``), so a collection that the capture's own Python
allocations start may free a dead object holding a CUDA graph, say a dropped pipeline's runner in
a reference cycle. Destroying a graph is illegal while this thread captures, and the capture is
lost: on the H200 (torch 2.11) a decode capture failed with "operation failed due to a previous
error during capture" after three "operation not permitted when stream is capturing (function
reset)" warnings, one test after tests that had dropped pipelines with their graphs (results
h200-2026-12-02). The garbage is collected after the capture instead.

All of it under ``CAPTURE_LOCK``, the one capture lock of the process: the warm-up stream, the
pool, the generator's state and a failed capture's repair are process-wide, so two captures (a
decode graph and a denoising graph in two threads) must never overlap, and a repair must never
swap the pool under another capture. Replays take no lock.

The memory pool:

One pool per device for every graph the plugin captures, a private one (``graph_pool()``):
replays are serialized on one stream, so intermediates of different graphs may share memory and
memory does not grow with each capture. A private pool per runner grew ~40 MiB per request
upstream.

Not vLLM's global pool (``current_platform.get_global_graph_pool()``), where vLLM's runners and
vllm-omni 0.30's in-tree decode capture. A capture that fails leaves its pool
refusing every later capture, in a way no Python binding undoes on torch 2.11: the device
allocator's mark can be ended (``recover_failed_capture`` does), but torch also marks the pool
in the pinned-host allocator at ``capture_begin``, and the pool still refused a capture after
the repair (``benchmarks/probes/capture_failure.py``, h200-2026-12-02). The plugin replaces its
own pool after a failure; vLLM's cannot be replaced. While the plugin's graphs lived in vLLM's
pool, one failed capture of the plugin's (a batched decode capture that a sync broke, in a GPU
test) left vLLM's pool refusing captures with "beginAllocateToPool: already recording to
mempool_id" (H200, torch 2.11, vllm-omni 0.30, h200-2026-12-05b): the in-tree decode of a
server whose plugin defers to it would then fail every capture. pytorch/pytorch#180395 (torch
2.12) fixes the case where ``cudaStreamEndCapture`` itself fails; a failure before the end is
pytorch/pytorch#190308 (open). What the plugin's graphs and vLLM's no longer share is their
intermediates (the in-tree decode's per-token ones on 0.30).

Why the pools are pinned. The caching allocator counts the graphs alive in a pool; when the last
one is destroyed the count drops to 0 but the pool lingers until its blocks are freed, and the
next capture into the same pool id then trips ``use_count > 0 INTERNAL ASSERT`` (seen on the H200
with torch 2.11: after it, every capture in the process failed, and the CUDA generator was left
mid-capture, so even ``torch.randn`` raised). vLLM never destroys its graphs; this plugin does
(bucket growth, LRU eviction, sleep, verify mismatch). So the first use captures one tiny graph
into the pool and keeps it for the life of the process: the count never reaches 0. vLLM's global
pool gets such an anchor too (once per device, the plugin's only capture there): vllm-omni 0.30's
in-tree decode frees its graphs when a request outgrows its buffers, and on torch 2.11 its next
capture then tripped the same assert with the plugin off (h200-2026-12-01g, ``serve-0.30/``),
where the plugin's graphs, alive in that pool, had kept its count above 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
from typing import Callable

import torch

from ..core import stats

logger = stats.logger

WARMUPS = 2

_lock = threading.Lock()
# Held by ``capture`` from the first warm-up to the end of the recording (or its repair).
# Reentrant: a capture's warm-up may compile, and a compiled body never captures, but a hook that
# captures a graph from inside another's warm-up (none does) would then not deadlock.
CAPTURE_LOCK = threading.RLock()
_pools: dict[int, object] = {}  # device index -> the pool captures go to now
_anchors: list[tuple] = []
# ``_pools``' value after a failed capture: the next capture makes a fresh private pool (and pins
# it there, inside that capture's own error handling).
_FRESH = object()


def graph_pool(device: torch.device | None = None):
    """The plugin's graph pool on the device: private, pinned, a fresh one after a failed
    capture. The first call on a device also pins vLLM's global pool (module docstring)."""
    index = _index(device)
    with _lock:
        pool = _pools.get(index)
        if pool is None or pool is _FRESH:
            where = torch.device("cuda", index)
            if pool is None:
                _pin_vllm_pool(where)
            pool = torch.cuda.graph_pool_handle()
            _anchors.append(_pin(pool, where))
            _pools[index] = pool
        return pool


def next_capture_in_a_new_pool(device: torch.device | None = None) -> None:
    """The device's next capture, and every one after it, goes to a new pool of the plugin's.
    Graphs that will replay at the same time on two streams must not share a pool: a pool's
    graphs share their intermediates' memory on the promise that they replay one at a time."""
    with _lock:
        _pools[_index(device)] = _FRESH


def _vllm_pool():
    """vLLM's global graph pool, or None without vLLM (bare diffusers) or on a platform without
    one (vLLM's Platform answers an attribute it lacks with None, not an error)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    get_pool = getattr(current_platform, "get_global_graph_pool", None)
    return get_pool() if callable(get_pool) else None


def _pin_vllm_pool(device: torch.device) -> None:
    """One anchor graph in vLLM's global pool, kept for the life of the process; nothing without
    vLLM. Where that pool cannot take even this capture, vLLM's own captures will say so: the
    plugin's graphs do not use it, so a warning is all."""
    pool = _vllm_pool()
    if pool is None:
        return
    try:
        _anchors.append(_pin(pool, device))
    except RuntimeError as exc:
        logger.warning("graphdecode: vLLM's CUDA graph pool did not take an anchor graph (%s); "
                       "the plugin's graphs use a pool of their own and are not affected", exc)


def recover_failed_capture(device: torch.device | None, pool, stream) -> None:
    """Undo what a capture that raised leaves behind, so the process can go on (eagerly, and
    with later captures).

    A capture whose ``capture_end`` raised (a host sync or an illegal call inside it) skips the
    bookkeeping that follows it in torch: (1) this thread's current stream stays the capture
    stream; (2) the caching allocator keeps the pool marked as recording, so every later capture
    into it fails with "already recording to mempool_id"; (3) the CUDA generator stays in capture
    mode, so every later random op on the device raises "Offset increment outside graph capture"
    (all three seen on the H200, torch 2.11). Each is repaired here as far as Python reaches; the
    pool is also replaced by a fresh private one, since torch 2.11 leaves a mark no binding ends
    (module docstring) and what else it left half-done cannot be checked.
    """
    if not torch.cuda.is_available():  # the capture failed before touching a device
        return
    index = _index(device)
    if stream is not None and torch.cuda.current_stream(index) != stream:
        torch.cuda.set_stream(stream)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if pool is not None and end is not None:
        try:
            end(index, pool)
        except RuntimeError:  # capture_end got far enough to end it: the fine case
            pass
    try:
        generator = torch.cuda.default_generators[index]
        # A cloned state starts outside capture mode, with the same seed and offset.
        generator.graphsafe_set_state(generator.clone_state())
    except (AttributeError, RuntimeError):  # older torch: no graph-safe generator state
        pass
    with _lock:
        if _pools.get(index) is pool:
            # Not pinned here: a pin that raised would escape this repair.
            _pools[index] = _FRESH


_warmup_streams: dict[int, object] = {}


def warmup_stream(device: torch.device | None = None):
    """The one side stream per device that every capture's warm-up runs on. cuBLAS keeps a
    workspace per stream it ran on, in the caching allocator: a new stream per capture left more
    memory allocated after every request that captured (seen on the H200)."""
    index = _index(device)
    with _lock:
        stream = _warmup_streams.get(index)
        if stream is None:
            stream = _warmup_streams[index] = torch.cuda.Stream(device=index)
        return stream


def _index(device: torch.device | None) -> int:
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def _pin(pool, device: torch.device) -> tuple:
    x = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), _recording():
        with torch.cuda.graph(graph, pool=pool):
            x.add_(1)
    torch.cuda.current_stream(device).wait_stream(side)
    return graph, x


class CaptureFailed(RuntimeError):
    """Capturing a graph failed; the process was repaired and nothing of the attempt is kept."""

    @property
    def oom(self) -> bool:
        return is_oom(self.__cause__)


def is_oom(exc: BaseException | None) -> bool:
    """An allocation failure, also when wrapped (an error caused by one)."""
    while exc is not None:
        if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
            return True
        text = str(exc)  # the CPU allocator raises a plain RuntimeError
        if isinstance(exc, RuntimeError) and ("out of memory" in text.lower()
                                              or "can't allocate memory" in text):
            return True
        exc = exc.__cause__
    return False


@dataclasses.dataclass
class Captured:
    graph: object  # torch.cuda.CUDAGraph
    output: torch.Tensor  # the graph's static output: every replay overwrites it
    reference: torch.Tensor  # the last warm-up's output: the eager step on the same inputs


def capture(fn: Callable[[], torch.Tensor], device: torch.device | None = None, *,
            pool=None, warmups: int = WARMUPS) -> Captured:
    """Warm ``fn`` up and record it as a CUDA graph (see the module docstring).

    ``fn`` must read only tensors whose addresses stay fixed while the graph lives, must not
    synchronize with the host and must not branch in Python on tensor values. Raises
    ``CaptureFailed``.
    """
    with CAPTURE_LOCK:
        return _capture(fn, device, pool, warmups)


def _capture(fn, device, pool, warmups) -> Captured:
    current = graph = rng = None
    try:
        device = torch.device("cuda", _index(device))
        current = torch.cuda.current_stream(device)
        if pool is None:
            pool = graph_pool(device)
        # A step that samples draws from the device's generator: what the warm-ups draw is given
        # back, so a seeded request draws the same with or without a capture in it.
        rng = torch.cuda.get_rng_state(device)
        side = warmup_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(max(1, warmups)):
                reference = fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Entering synchronizes the device, so the warm-up's reference is complete before
        # anything else reads it.
        with _recording(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = fn()
    except Exception as exc:
        graph = None
        recover_failed_capture(device, pool, current)
        _restore_rng(rng, device)
        raise CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
    _restore_rng(rng, device)
    return Captured(graph, output, reference)


@contextlib.contextmanager
def _recording():
    """No cyclic garbage collection while a graph records (see the module docstring); the
    collector's state before it is restored after, also when the capture raises.

    The switch is process-wide, so two recordings in two threads could restore it out of order:
    every capture here runs under ``CAPTURE_LOCK`` (``_pin`` from ``graph_pool`` inside
    ``capture``; the GPU test and the probe call it on one thread)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _restore_rng(state, device) -> None:
    if state is not None:
        torch.cuda.set_rng_state(state, device)


# Verify mode, for both runners (``decode/paged.py``, ``graphs/prefix.py``): a new graph's first
# replay is compared with the eager step; a difference beyond this fraction of the eager output's
# largest magnitude (at least 1) disables the graph. Graph and eager run the same kernels, so honest
# differences are rounding: cuBLAS may pick another algorithm under capture, and a decode logit
# sums thousands of such products (the H200 measured up to 6 bf16 ulps, 3.2% of the largest
# magnitude, between a diffusion transformer's static step outside a capture and its replay, in
# a hook's GPU test). A stale address or a Python value baked into the capture is off by O(1).
VERIFY_RTOL = 0.05
# The stats counters verify mode adds under the model's key, in both runners.
VERIFIED = "verified"  # a first replay within VERIFY_RTOL (logged at INFO when not bit-equal)
VERIFY_MISMATCH = "verify_mismatch"  # one beyond it: that graph is disabled


@dataclasses.dataclass(frozen=True)
class Comparison:
    ok: bool
    exact: bool
    max_abs_diff: float
    limit: float


def compare(out: torch.Tensor, ref: torch.Tensor, rtol: float) -> Comparison:
    """A replay's output against the eager step's: equal, within ``rtol`` of the reference's
    largest magnitude (at least 1), or not (NaN and a shape or dtype change are never ok).

    Host syncs: verify mode only.
    """
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return Comparison(False, False, float("inf"), 0.0)
    if torch.equal(out, ref):
        return Comparison(True, True, 0.0, 0.0)
    diff = (out.float() - ref.float()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    limit = rtol * max(1.0, float(ref.float().abs().max()))
    return Comparison(worst <= limit, False, worst, limit)  # NaN <= x is False
