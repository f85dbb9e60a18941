"""The CUDA graph memory pool every graph of this plugin is captured into.

One pool, vLLM's global one (``current_platform.get_global_graph_pool()``): replays are serialized
on one stream, so intermediates of different graphs may share memory and memory does not grow
with each capture. A private pool per runner grew ~40 MiB per request upstream.

Why the pool is pinned. The caching allocator counts the graphs alive in a pool; when the last
one is destroyed the count drops to 0 but the pool lingers until its blocks are freed, and the
next capture into the same pool id then trips ``use_count > 0 INTERNAL ASSERT`` (seen on the H200
with torch 2.11: after it, every capture in the process failed, and the CUDA generator was left
mid-capture, so even ``torch.randn`` raised). vLLM never destroys its graphs; this plugin does
(bucket growth, LRU eviction, sleep, verify mismatch). So the first use captures one tiny graph
into the pool and keeps it for the life of the process: the count never reaches 0.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_pools: dict[int, object] = {}  # device index -> the pool captures go to now
_anchors: list[tuple] = []


def graph_pool(device: torch.device | None = None):
    """vLLM's global graph pool (a private one without vLLM, or after a failed capture), pinned."""
    index = _index(device)
    with _lock:
        pool = _pools.get(index)
        if pool is None:
            try:
                from vllm.platforms import current_platform

                pool = current_platform.get_global_graph_pool()
            except ImportError:  # bare diffusers use without vLLM installed
                pool = torch.cuda.graph_pool_handle()
            _anchors.append(_pin(pool, torch.device("cuda", index)))
            _pools[index] = pool
        return pool


def recover_failed_capture(device: torch.device | None, pool, stream) -> None:
    """Undo what a capture that raised leaves behind, so the process can go on (eagerly, and
    with later captures).

    A capture whose ``capture_end`` raised (a host sync or an illegal call inside it) skips the
    bookkeeping that follows it in torch: (1) this thread's current stream stays the capture
    stream; (2) the caching allocator keeps the pool marked as recording, so every later capture
    into it fails with "already recording to mempool_id"; (3) the CUDA generator stays in capture
    mode, so every later random op on the device raises "Offset increment outside graph capture"
    (all three seen on the H200, torch 2.11). Each is repaired here; the pool is also replaced by a
    fresh private one, since what else torch left half-done in it cannot be checked.
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
            fresh = torch.cuda.graph_pool_handle()
            _anchors.append(_pin(fresh, torch.device("cuda", index)))
            _pools[index] = fresh


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
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, pool=pool):
            x.add_(1)
    torch.cuda.current_stream(device).wait_stream(side)
    return graph, x
