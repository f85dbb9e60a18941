"""Test-harness shim for the end-to-end engine runs (tests/test_e2e_engine_gpu.py), put on
PYTHONPATH of every engine process, plugin on and off alike. Not part of the plugin.

vllm-omni 0.26.0's diffusion worker gives vllm a stand-in model config
(``_DiffusionVllmModelConfig``) without ``head_dtype``, and vllm 0.26.0's ``LogitsProcessor``
reads ``model_config.head_dtype`` when it is built, so SenseNova-U1 (whose language model has a
``LogitsProcessor``) fails to load in that worker: ``AttributeError: '_DiffusionVllmModelConfig'
object has no attribute 'head_dtype'`` (seen on the GPU host). ``None`` is what vllm uses when
there is no model config (the head then runs in the model's dtype), so the shim gives the class
that default when the module is first imported. Where the attribute exists, nothing changes.

Any other ``sitecustomize`` further down ``sys.path`` is still run.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_TARGET = "vllm_omni.diffusion.worker.diffusion_worker"
_HERE = os.path.dirname(os.path.abspath(__file__))


class _AddHeadDtype(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # once, and no recursion through find_spec below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            cls = getattr(module, "_DiffusionVllmModelConfig", None)
            if cls is not None and not hasattr(cls, "head_dtype"):
                cls.head_dtype = None
                print("e2e_shim: gave vllm_omni's _DiffusionVllmModelConfig head_dtype=None",
                      file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _AddHeadDtype())

_other = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _HERE])
if _other is not None and _other.loader is not None:
    _module = importlib.util.module_from_spec(_other)
    _other.loader.exec_module(_module)
