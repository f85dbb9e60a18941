"""The one place that intercepts model loading.

vllm-omni has no post-load callback, so this wraps ``DiffusionModelRunner.load_model`` (same
signature in 0.24-0.30). When the real load returns, ``runner.pipeline`` is final (loaded,
offloaded, compiled) and the warm-up request has not run yet: that is when each enabled hook is
offered the pipeline (and, for the diffusers adapter, the inner diffusers pipeline at
``pipeline._pipeline``). Whatever a hook does, the load itself never fails because of this plugin.

``register()`` must stay cheap and runs in processes that never load a diffusion model (vllm's API
server), so the runner module is not imported here: if it is not imported yet, a post-import hook
patches it the moment vllm-omni imports it.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading

from .. import config
from ..models import MODELS
from ..models import load as load_hook
from . import stats
from .patching import HookRefused, check_signature, omni_version
from .reasons import Reason

RUNNER_MODULE = "vllm_omni.diffusion.worker.diffusion_model_runner"
RUNNER_CLASS = "DiffusionModelRunner"
LOAD_PARAMS = ("self", "memory_pool_context_fn", "load_format", "custom_pipeline_name")
SUPPORTED_OMNI = ("0.24", "0.26", "0.28", "0.30")

LOAD_MOVED = Reason("DiffusionModelRunner.load_model moved",
                    "use a supported vllm-omni version (python -m vllm_omni_graphdecode doctor)")
NO_RUNNER = Reason("DiffusionModelRunner not found",
                   "use a supported vllm-omni version (python -m vllm_omni_graphdecode doctor)")
HOOK_ERROR = Reason("hook error", "report this with the traceback in the log; the model is "
                                  "served eagerly")

logger = stats.logger
_lock = threading.Lock()
_patched_classes: set[type] = set()


def check_omni_version(version: str | None) -> str | None:
    """None when supported, else the WARNING text (an unsupported version is not a crash)."""
    if version is None:
        return "vllm-omni is not installed"
    if ".".join(version.split(".")[:2]) not in SUPPORTED_OMNI:
        return (f"vllm-omni {version} is not a supported version (supported: "
                f"{', '.join(v + '.x' for v in SUPPORTED_OMNI)}); hooks still check every target "
                f"they patch and refuse what moved")
    return None


def patch_runner_class(cls: type) -> bool:
    """Wrap ``cls.load_model`` once. False (and a WARNING) when its signature moved."""
    with _lock:
        if cls in _patched_classes or getattr(cls.load_model, "__graphdecode__", False):
            return True
        try:
            original = check_signature(cls, "load_model", LOAD_PARAMS)
        except HookRefused as exc:
            stats.refused("plugin", LOAD_MOVED.because(exc.reason.detail))
            return False

        @functools.wraps(original)
        def load_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            after_load(self)
            return result

        load_model.__graphdecode__ = True
        cls.load_model = load_model
        _patched_classes.add(cls)
        return True


def after_load(runner) -> list[str]:
    """Offer the loaded pipeline to each enabled hook; log one INFO line. Never raises."""
    cfg = config.get()
    pipeline = getattr(runner, "pipeline", None)
    lines = []
    if pipeline is None:
        lines.append("no pipeline loaded (load_format=dummy?)")
    else:
        candidates = [pipeline]
        inner = getattr(pipeline, "_pipeline", None)  # the diffusers adapter's diffusers pipeline
        if inner is not None:
            candidates.append(inner)
        for model in sorted(cfg.models):
            line = _offer(model, candidates, cfg, runner)
            if line:
                lines.append(line)
        if not lines:
            lines.append(f"{type(pipeline).__name__} is not a model this plugin accelerates "
                         f"(enabled: {', '.join(sorted(cfg.models))})")
    summary = "graphdecode: " + "; ".join(lines)
    logger.info(summary)
    stats.wired(summary)
    return lines


def _offer(model: str, candidates: list, cfg: config.Config, runner) -> str | None:
    try:
        hook = load_hook(model)
        for candidate in candidates:
            target = hook.find_target(candidate)
            if target is not None:
                break
        else:
            return None
    except Exception as exc:  # a hook that cannot even look must not break the load
        logger.exception("graphdecode: %s hook failed while inspecting the pipeline", model)
        stats.refused(model, HOOK_ERROR.because(f"inspecting the pipeline: {exc!r}"))
        return f"{model}: not wired (hook error: {exc!r})"
    try:
        return f"{model}: {hook.wire(target, cfg, runner)}"
    except HookRefused as exc:
        stats.refused(model, exc.reason)
        return f"{model}: not wired ({exc.reason.describe()})"
    except Exception as exc:
        logger.exception("graphdecode: %s hook raised while wiring; serving it eagerly", model)
        stats.refused(model, HOOK_ERROR.because(f"wiring: {exc!r}"))
        return f"{model}: not wired (hook error: {exc!r})"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs each registered callback right after vllm-omni imports its module (the runner
    class's module; a model's pipeline module, ``models.Model.on_import``)."""

    def __init__(self):
        self.callbacks: dict[str, list] = {}

    def add(self, module_name: str, callback) -> None:
        """``callback(module)`` now if ``module_name`` is imported, else right after it is."""
        module = sys.modules.get(module_name)
        if module is not None:
            callback(module)
            return
        self.callbacks.setdefault(module_name, []).append(callback)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname, path, target=None):
        callbacks = self.callbacks.pop(fullname, None)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module):
                    _exec(module)
                    for callback in callbacks:
                        callback(module)

                spec.loader.exec_module = exec_and_patch
                return spec
        self.callbacks[fullname] = callbacks  # not found now: a later import may find it
        return None


_finder = _PatchOnImport()


def _on_import(model: str, function: str, cfg: config.Config):
    def call(module) -> None:
        try:
            line = getattr(load_hook(model), function)(module, cfg)
        except Exception as exc:  # never break the import of vllm-omni's own module
            logger.exception("graphdecode: %s: %s failed", model, function)
            stats.refused(model, HOOK_ERROR.because(f"{function}: {exc!r}"))
            return
        if line:
            logger.info("graphdecode: %s: %s", model, line)
    return call


def _patch_module(module) -> None:
    cls = getattr(module, RUNNER_CLASS, None)
    if cls is None:
        stats.refused("plugin", NO_RUNNER.because(f"{RUNNER_MODULE} has no {RUNNER_CLASS}"))
        return
    patch_runner_class(cls)


def install() -> None:
    """Arrange for the runner class to be patched (now, or when it is imported). Idempotent."""
    problem = check_omni_version(omni_version())
    if problem:
        logger.warning("graphdecode: %s", problem)
    install_model_hooks(config.get())
    _finder.add(RUNNER_MODULE, _patch_module)


def install_model_hooks(cfg: config.Config) -> None:
    """Each enabled model's ``on_import`` hooks (``models.Model``), now or when vllm-omni imports
    their module: what ``install`` does besides patching the runner."""
    for model in MODELS:
        if model.key in cfg.models:
            for module_name, function in model.on_import:
                _finder.add(module_name, _on_import(model.key, function, cfg))
