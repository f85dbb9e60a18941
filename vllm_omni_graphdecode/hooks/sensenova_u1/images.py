"""SenseNova-U1: ``n`` images for one request (OpenAI ``n``, ``num_outputs_per_prompt``).

Why: vLLM-Omni's SenseNova-U1 pipeline reads its image batch from ``extra_args["batch_size"]``
and returns only the first image of the batch (``images[0]``, vllm-omni 0.24-0.30), so a request
for ``n`` images gets one. Its own code already denoises a batch from one prefill: the prompt's
K/V (and a think request's think tokens) are computed once and expanded to the batch
(``_expand_and_prepare_kv``: a view, not a copy), and the noise of the ``n`` images is drawn from
the request's seed in one call.

What this adds, around a request's ``forward`` (``wrap``): a request whose
``num_outputs_per_prompt`` is ``n`` > 1 and that names no ``batch_size`` runs with
``batch_size = n``; the images ``_to_pil`` made for it (the module function, wrapped once to
keep its result for the calling thread) become the request's payload, all ``n`` of them. The
first image is what the pipeline returns for ``batch_size = n``; the others are the ones it
dropped. A request that names ``batch_size`` keeps the pipeline's own behaviour.

Counted under "sensenova_u1": ``n_images_request``, ``n_images``.
"""

from __future__ import annotations

import copy
import functools
import threading

from ...core import stats
from .step import MODEL

IMAGES_FN = "_to_pil"
_local = threading.local()


def declare(module) -> str:
    """Wrap ``module._to_pil`` (idempotent); returns what was done, for the log."""
    fn = getattr(module, IMAGES_FN, None)
    if fn is None:
        return f"n images per request not declared: the pipeline module has no {IMAGES_FN}"
    if getattr(fn, "__graphdecode__", False):
        return "n images per request already declared"

    @functools.wraps(fn)
    def to_pil(batch):
        images = fn(batch)
        if getattr(_local, "keep", False):
            _local.images = images
        return images

    to_pil.__graphdecode__ = True
    setattr(module, IMAGES_FN, to_pil)
    return "n images per request"


def requested(request) -> int:
    """How many images ``request`` asks for, where the plugin serves them (else 1)."""
    sampling = getattr(request, "sampling_params", None)
    try:
        n = int(getattr(sampling, "num_outputs_per_prompt", 1) or 1)
    except (TypeError, ValueError):
        return 1
    extra = getattr(sampling, "extra_args", None) or {}
    if n <= 1 or "batch_size" in extra:
        return 1
    return n


def widen(request, n: int):
    """A copy of ``request`` whose image batch is ``n`` (its sampling parameters copied)."""
    sampling = copy.copy(request.sampling_params)
    sampling.extra_args = {**(sampling.extra_args or {}), "batch_size": n}
    out = copy.copy(request)
    out.sampling_params = sampling
    return out


def wrap(forward):
    """``forward(req)`` for a batch of one request (the pipeline's own), serving ``n`` images
    (module docstring)."""

    @functools.wraps(forward)
    def serve(req, *args, **kwargs):
        requests = list(getattr(req, "requests", None) or [])
        n = requested(requests[0]) if len(requests) == 1 else 1
        if n <= 1:
            return forward(req, *args, **kwargs)
        one = type(req)(requests=[widen(requests[0], n)])
        _local.keep, _local.images = True, None
        try:
            out = forward(one, *args, **kwargs)
            images = _local.images
        finally:
            _local.keep, _local.images = False, None
        payload = ((getattr(out, "output", None) or {}).get("payload")
                   if isinstance(getattr(out, "output", None), dict) else None)
        if isinstance(payload, dict) and "image" in payload and images:
            payload["image"] = list(images)
            stats.count(MODEL, "n_images_request")
            stats.count(MODEL, "n_images", len(images))
        return out

    return serve
