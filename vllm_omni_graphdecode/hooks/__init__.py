"""The hooks, one package per model. The list of models, and ``load`` (the hook module of a model
key), is ``vllm_omni_graphdecode.models`` (below config, the loader and this package, which all
read it); adding a model is a hook package here plus one row there.

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

from ..models import MODEL_KEYS, MODELS, Model, load

__all__ = ["MODELS", "MODEL_KEYS", "Model", "load"]
