"""Per-model hooks. One module per model; ``loading`` offers each loaded pipeline to them.

A hook module exposes:

    MODEL: str                           the key used in VLLM_OMNI_GRAPHDECODE
    find_target(pipeline) -> obj | None  the object it would wire in this loaded pipeline, or None
    wire(target, cfg, runner) -> str     patch it; return a one-line summary for the load log.
                                         Raise HookRefused(reason) to leave it untouched.
    support() -> dict[str, str]          vllm-omni version -> what happens (doctor, README)

Runtime fallbacks (a request the fast path cannot take) go through ``stats.fallback``.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Callable, Iterable

HOOK_MODULES = {
    "sensenova_u1": "vllm_omni_graphdecode.hooks.sensenova_u1",
    "qwen_image_21": "vllm_omni_graphdecode.hooks.qwen_image_21",
}


class HookRefused(Exception):
    """The hook will not wire this model; the message says why and the model stays eager."""


def load(model: str) -> ModuleType:
    return importlib.import_module(HOOK_MODULES[model])


def check_signature(owner: object, name: str, params: Iterable[str]) -> Callable:
    """Return ``owner.name`` after checking it takes ``params`` (in order, as the leading ones).

    Raises HookRefused naming what moved, so a changed upstream method leaves the model eager
    instead of being patched blind.
    """
    fn = getattr(owner, name, None)
    where = f"{getattr(owner, '__qualname__', type(owner).__qualname__)}.{name}"
    if fn is None or not callable(fn):
        raise HookRefused(f"{where} not found")
    try:
        actual = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        raise HookRefused(f"{where} has no readable signature") from None
    expected = list(params)
    if actual[: len(expected)] != expected:
        raise HookRefused(f"{where} signature moved: expected ({', '.join(expected)}, ...), "
                          f"found ({', '.join(actual)})")
    return fn
