"""One Qwen-Image-2.1 cached step timed three ways at any shape: diffusers' own cached forward,
the plugin's static-buffer step run eagerly, and the plugin's graph replay. ``bench.py`` runs it at
the real shape (``--cases qwen_image_21_step``); the GPU tests run it small.
"""

from __future__ import annotations

import time

import torch

from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.hooks import qwen_image_21 as q
from vllm_omni_graphdecode.hooks.qwen_image_21 import names
from vllm_omni_graphdecode.testing.qwen import synthetic_inputs


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
                      warmup: int = 3, mode: str = "exact") -> dict:
    """Time one cached step of ``transformer`` (on CUDA, under no_grad) eager vs graph replay.

    Runs one real extract step to fill a ``QwenImage21KVCache``, then times, per call:
    ``eager_ms`` diffusers' own cached forward; ``static_ms`` this hook's static-buffer step run
    eagerly; ``graph_ms`` the wired forward replaying its graph (the per-step copies included).
    ``first_graph_step_ms`` is the step that binds, warms up and captures. ``exact`` says whether the
    replay equals diffusers' cached forward bit for bit, ``max_abs_diff`` by how much it does not.
    ``prefix_buffer_mb`` is what one entry's static prefix buffers hold. ``mode``: the plugin's
    "exact" (diffusers' block code) or "fast" step (first step includes its compile).
    Real shape for 1024x1024 text-to-image: defaults; a two-reference edit:
    ``reference_shapes=((64, 64), (64, 64))``. The transformer must not be wired already.
    """
    if getattr(transformer, "_graphdecode_qwen", None) is not None:
        raise ValueError("bench_cached_step needs an unwired transformer")
    q._prepare(transformer)
    d = names.resolve()

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
            wiring = q.CachedStepGraphs(transformer, max_entries=2, verify=False, capture=capture,
                                        mode=mode)
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
        "mode": mode, "batch": batch, "prefix_len": prefix_len, "target_tokens": target_shape[0] * target_shape[1],
        "layers": len(transformer.transformer_blocks), "dtype": str(reference.dtype),
        "prefix_buffer_mb": prefix_bytes / 2**20,
        "eager_ms": eager_ms, "static_ms": results[False][0], "graph_ms": graph_ms,
        "first_graph_step_ms": first_graph_ms, "exact": bool(torch.equal(out, reference)),
        "max_abs_diff": float(diff.max()), "max_abs_ref": float(reference.float().abs().max()),
        "captures": stats.get(q.MODEL, "capture"), "fallbacks": stats.fallbacks(q.MODEL),
        "degraded": stats.degraded_paths(q.MODEL),
    }
