"""The model registry: the one list of models this plugin wires. Config, the loader, ``doctor``
and the tests read it; adding a model is a hook package (or module) here plus one line below.

A hook module exposes:

    MODEL: str                            its key (the row's key below)
    find_target(pipeline) -> obj | None   the object it would wire in this loaded pipeline, or None
    wire(target, cfg, runner) -> str      patch it; return a one-line summary for the load log.
                                          Raise ``patching.HookRefused(reason)`` to leave it alone.
    support() -> dict[str, str]           vllm-omni version -> what happens (doctor, README)

Importing this package is cheap (no model code); a hook module is imported only when a loaded
pipeline is offered to it.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType


@dataclasses.dataclass(frozen=True)
class Model:
    key: str  # the value in VLLM_OMNI_GRAPHDECODE and the stats prefix
    title: str
    module: str  # the hook, imported on first use


MODELS: tuple[Model, ...] = (
    Model("sensenova_u1", "SenseNova-U1", "vllm_omni_graphdecode.hooks.sensenova_u1"),
    Model("qwen_image_21", "Qwen-Image-2.1", "vllm_omni_graphdecode.hooks.qwen_image_21"),
)

MODEL_KEYS: tuple[str, ...] = tuple(m.key for m in MODELS)


def load(key: str) -> ModuleType:
    """The hook module of ``key`` (one of ``MODEL_KEYS``)."""
    for model in MODELS:
        if model.key == key:
            return importlib.import_module(model.module)
    raise KeyError(f"no hook for {key!r}; known: {', '.join(MODEL_KEYS)}")
