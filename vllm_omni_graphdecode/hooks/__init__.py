"""The hooks, one package per model, and ``load``: the hook module of a model key. The list of
models is ``vllm_omni_graphdecode.models`` (below config and this package, which both read it);
adding a model is a hook package here plus one row there.

A hook module exposes:

    MODEL: str                            its key (the row's key in ``models.MODELS``)
    find_target(pipeline) -> obj | None   the object it would wire in this loaded pipeline, or None
    wire(target, cfg, runner) -> str      patch it; return a one-line summary for the load log.
                                          Raise ``patching.HookRefused(reason)`` to leave it alone.
    support() -> dict[str, str]           vllm-omni version -> what happens (doctor, README)

Importing this package is cheap (no model code); a hook module is imported only when a loaded
pipeline is offered to it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..models import MODEL_KEYS, MODELS, Model

__all__ = ["MODELS", "MODEL_KEYS", "Model", "load"]


def load(key: str) -> ModuleType:
    """The hook module of ``key`` (one of ``MODEL_KEYS``)."""
    for model in MODELS:
        if model.key == key:
            return importlib.import_module(model.module)
    raise KeyError(f"no hook for {key!r}; known: {', '.join(MODEL_KEYS)}")
