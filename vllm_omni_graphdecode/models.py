"""The one list of models this plugin wires: each one's key, title and hook module.

Below ``config``, ``core`` and ``hooks``: config takes the accepted values of
``VLLM_OMNI_GRAPHDECODE`` from here, ``load`` imports a row's hook module on first use (the
loader in ``core/loading.py`` calls it, so nothing in ``core`` imports ``hooks``), ``doctor`` and
the loader read the same rows. Adding a model is a hook package under ``hooks/`` plus one row
below. The module is named as a string, so reading the list imports no model code.
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
    # (upstream module, hook function): when the plugin is on for this model, the loader calls
    # ``hook.function(module, cfg)`` right after that module is imported, in every process that
    # loads the plugin (vLLM-Omni's engine reads class attributes before any model is loaded).
    on_import: tuple[tuple[str, str], ...] = ()


MODELS: tuple[Model, ...] = (
    Model("sensenova_u1", "SenseNova-U1", "vllm_omni_graphdecode.hooks.sensenova_u1",
          on_import=(("vllm_omni.diffusion.models.sensenova_u1.pipeline_sensenova_u1",
                      "declare_batching"),
                     ("vllm_omni.diffusion.sched.step_scheduler", "widen_step_admission"))),
    Model("qwen_image_21", "Qwen-Image-2.1", "vllm_omni_graphdecode.hooks.qwen_image_21"),
)

MODEL_KEYS: tuple[str, ...] = tuple(m.key for m in MODELS)


def load(key: str) -> ModuleType:
    """The hook module of ``key`` (one of ``MODEL_KEYS``)."""
    for model in MODELS:
        if model.key == key:
            return importlib.import_module(model.module)
    raise KeyError(f"no hook for {key!r}; known: {', '.join(MODEL_KEYS)}")
