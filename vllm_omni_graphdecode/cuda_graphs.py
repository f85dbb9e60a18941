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
_fallback_pool = None
_anchors: dict[tuple, tuple] = {}


def graph_pool(device: torch.device | None = None):
    """vLLM's global graph pool (a private one without vLLM), pinned on ``device``."""
    global _fallback_pool
    try:
        from vllm.platforms import current_platform

        pool = current_platform.get_global_graph_pool()
    except ImportError:  # bare diffusers use without vLLM installed
        if _fallback_pool is None:
            _fallback_pool = torch.cuda.graph_pool_handle()
        pool = _fallback_pool
    device = torch.device("cuda", torch.cuda.current_device()) if device is None or \
        device.index is None else device
    key = (pool, device.index)
    with _lock:
        if key not in _anchors:
            _anchors[key] = _pin(pool, device)
    return pool


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
