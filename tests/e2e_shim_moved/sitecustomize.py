"""Test-harness shim for tests/test_e2e_serve_gpu.py's ``qwen_cannot_wire`` server: makes one
diffusers method this plugin checks before wiring Qwen-Image-2.1 look moved, without changing
what it does. Not part of the plugin.

``QwenImage21KVLayerCache.store(self, k, v)`` is replaced by a pass-through whose signature is
``(self, *args, **kwargs)``, as an upstream refactor might leave it. The plugin's signature check
then refuses to wire the model (``an upstream method this plugin patches moved``), and the server
must serve it eagerly with the same image as plugin off. Put after ``tests/e2e_shim`` on
PYTHONPATH: that shim runs this one (the next ``sitecustomize`` on the path), and this one runs
any further one, skipping both folders.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_TARGET = "diffusers.models.transformers.transformer_qwenimage21"
_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIP = {_HERE, os.path.join(os.path.dirname(_HERE), "e2e_shim")}


class _MoveStore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # once, and no recursion through find_spec below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_move(module):
            exec_module(module)
            cls = getattr(module, "QwenImage21KVLayerCache", None)
            if cls is None:
                return
            original = cls.store

            def store(self, *args, **kwargs):  # no functools.wraps: the signature must differ
                return original(self, *args, **kwargs)

            cls.store = store
            print("e2e_shim_moved: QwenImage21KVLayerCache.store now takes (self, *args, **kwargs)",
                  file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_and_move
        return spec


sys.meta_path.insert(0, _MoveStore())

_other = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") not in _SKIP])
if _other is not None and _other.loader is not None:
    _module = importlib.util.module_from_spec(_other)
    _other.loader.exec_module(_module)
