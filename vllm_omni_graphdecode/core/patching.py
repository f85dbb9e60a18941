"""What every hook needs to patch a loaded model safely, and what the loader needs from a hook.

Lives below both ``loading`` and ``hooks``: a hook imports this, never the loader.

- ``HookRefused``: a hook will not wire this model; it carries a ``Reason`` and the model stays as
  it was loaded.
- ``check_signature``: a method is patched or called only after its leading parameters were
  checked, so a changed upstream method is refused with what moved instead of patched blind.
- ``Patches``: what one wiring set on objects it does not own, undone in reverse order
  (``unwire``).
- ``release_on_sleep``: sleep level 2 discards the memory a CUDA graph was recorded against, so
  every hook registers a callback that drops its graphs there; this is the one place that decides
  how each vllm-omni version reaches it, and ``release_lost`` checks (in constant time, once per
  request) that it still does.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Callable, Iterable

from .reasons import Reason


def omni_version() -> str | None:
    """The installed vllm-omni's version, or None."""
    try:
        return importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return None


SIGNATURE_MOVED = Reason("an upstream method this plugin patches moved",
                         "use a supported vllm-omni / diffusers version (python -m "
                         "vllm_omni_graphdecode doctor lists them)")


class HookRefused(Exception):
    """The hook will not wire this model; ``reason`` says why (its key is the stats key)."""

    def __init__(self, reason: Reason):
        super().__init__(reason.describe())
        self.reason = reason


def check_signature(owner: object, name: str, params: Iterable[str]) -> Callable:
    """Return ``owner.name`` after checking it takes ``params`` (in order, as the leading ones).

    Raises HookRefused (``SIGNATURE_MOVED``, the detail naming what moved).
    """
    fn = getattr(owner, name, None)
    where = f"{getattr(owner, '__qualname__', type(owner).__qualname__)}.{name}"
    if fn is None or not callable(fn):
        raise HookRefused(SIGNATURE_MOVED.because(f"{where} not found"))
    try:
        actual = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        raise HookRefused(SIGNATURE_MOVED.because(f"{where} has no readable signature")) from None
    expected = list(params)
    if actual[: len(expected)] != expected:
        raise HookRefused(SIGNATURE_MOVED.because(
            f"{where}: expected ({', '.join(expected)}, ...), found ({', '.join(actual)})"))
    return fn


def takes_var_kwargs(fn) -> bool:
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD
                   for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


_ABSENT = object()  # an attribute an object did not have itself


class Patches:
    """What one wiring set on objects it does not own, so ``undo`` can put each back.

    ``set(obj, name, value)`` records what ``obj`` itself held under ``name`` (its own ``__dict__``
    entry, or that it had none and the class's attribute showed through) and sets ``value``;
    ``on_undo(fn)`` records a step that is not an attribute (a callback to unregister). ``undo()``
    runs them in reverse order: a previous own value is put back, an attribute the object did not
    have is deleted. An attribute someone replaced since (a wrapper stacked above ours) is left as
    it is: removing it would drop their wrapper; ``undo`` returns its name. Instance attributes
    only: not a module's parameters, buffers or submodules.
    """

    def __init__(self):
        self._done: list = []

    def set(self, obj, name: str, value) -> None:
        previous = vars(obj).get(name, _ABSENT)
        setattr(obj, name, value)
        self._done.append((obj, name, previous, value))

    def on_undo(self, fn: Callable[[], object]) -> None:
        self._done.append(fn)

    def undo(self) -> list[str]:
        """Undo everything, last first; the attributes left because they were replaced since."""
        left = []
        while self._done:
            step = self._done.pop()
            if callable(step):
                step()
                continue
            obj, name, previous, value = step
            if vars(obj).get(name, _ABSENT) is not value:
                left.append(f"{_name(obj)}.{name}")
            elif previous is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)
        return left


def _name(obj) -> str:
    return getattr(obj, "__qualname__", type(obj).__qualname__)


# -- sleep release ---------------------------------------------------------------------------

SLEEP_UNREACHABLE = Reason("sleep could not release this plugin's graphs",
                           "use a supported vllm-omni version, and do not replace the runner's "
                           "graph_runners or release_captured_graphs after load (the detail says "
                           "which)")


class ReleaseOnSleep(dict):
    """Set as ``runner.graph_runners`` on vllm-omni 0.24-0.28: its ``clear()`` also runs every
    hook's release callback. The one call those workers make at sleep level 2 is
    ``graph_runners.clear()``, guarded by ``hasattr``. No runner of 0.24-0.30 has the attribute
    itself; entries found there are kept. ``previous``: the runner's own attribute before."""

    def __init__(self, existing=None, previous=_ABSENT):
        super().__init__(existing or {})
        self.callbacks: list = []
        self.previous = previous

    def clear(self) -> None:
        super().clear()
        for callback in list(self.callbacks):
            callback()


class ReleaseCapturedGraphs:
    """Set as ``runner.release_captured_graphs`` on vllm-omni 0.30, whose
    ``DiffusionWorker.sleep(level=2)`` calls ``DiffusionModelRunner.release_captured_graphs``:
    runs every hook's release callback, then the runner's own (``__wrapped__``).
    ``previous``: the runner's own attribute before (normally none: the class's method)."""

    def __init__(self, original, previous=_ABSENT):
        self.__wrapped__ = original
        self.callbacks: list = []
        self.previous = previous

    def __call__(self):
        for callback in list(self.callbacks):
            callback()
        return self.__wrapped__()


def _release_attr(runner) -> str:
    """The runner attribute sleep level 2 reaches on this vllm-omni version (decided by the
    runner's class, so that what this module sets on the instance does not change the answer)."""
    if callable(getattr(type(runner), "release_captured_graphs", None)):
        return "release_captured_graphs"
    return "graph_runners"


def _ours(current, attr: str):
    """The ``ReleaseOnSleep`` / ``ReleaseCapturedGraphs`` that ``current`` is, or wraps (through
    ``__wrapped__``: a wrapper another party stacked on the runner's method still calls ours)."""
    kind = ReleaseCapturedGraphs if attr == "release_captured_graphs" else ReleaseOnSleep
    for _ in range(8):
        if isinstance(current, kind):
            return current
        current = getattr(current, "__wrapped__", None) if attr == "release_captured_graphs" \
            else None
        if current is None:
            return None
    return None


def runner_releases_pipeline(runner) -> bool:
    """vllm-omni 0.30's runner: its ``release_captured_graphs`` (what sleep level 2 calls) calls
    the pipeline's own ``release_captured_graphs``, so a hook that sets that on the pipeline is
    reached without registering anything on the runner."""
    return runner is not None and _release_attr(runner) == "release_captured_graphs"


def can_release_on_sleep(runner) -> Reason | None:
    """Why sleep could not reach this runner's release callbacks, or None (checked at wiring)."""
    if runner is None or _release_attr(runner) == "release_captured_graphs":
        return None
    existing = getattr(runner, "graph_runners", None)
    if existing is not None and not isinstance(existing, dict):
        return SLEEP_UNREACHABLE.because(f"{type(runner).__qualname__}.graph_runners is a "
                                         f"{type(existing).__name__}")
    return None


class SleepRelease:
    """One callback registered by ``release_on_sleep``: ``lost()`` says whether sleep still reaches
    it, ``remove()`` unregisters it (and puts the runner's attribute back after the last one)."""

    def __init__(self, runner, attr: str, installed, callback):
        self.runner, self.attr, self.installed, self.callback = runner, attr, installed, callback

    def lost(self) -> Reason | None:
        """Why sleep level 2 would not run the callback now, or None. Constant time."""
        return release_lost(self.runner, self.callback)

    def remove(self) -> None:
        installed = self.installed
        if self.callback in installed.callbacks:
            installed.callbacks.remove(self.callback)
        if installed.callbacks or vars(self.runner).get(self.attr) is not installed:
            return  # another hook still needs it, or someone replaced it since: leave theirs
        previous = installed.previous
        if previous is _ABSENT:
            delattr(self.runner, self.attr)
            return
        if self.attr == "graph_runners":  # the runner's own dict, with what it holds now
            previous.clear()
            previous.update(installed)
        setattr(self.runner, self.attr, previous)


def release_on_sleep(runner, callback, patches: Patches | None = None) -> SleepRelease:
    """Run ``callback`` when vllm-omni puts ``runner`` to sleep at level 2: through
    ``runner.release_captured_graphs`` (0.30) or ``runner.graph_runners.clear()`` (0.24-0.28).
    The first registration on a runner installs the shared object; later ones join it. With
    ``patches``, their ``undo()`` unregisters it."""
    attr = _release_attr(runner)
    installed = _ours(getattr(runner, attr, None), attr)
    if installed is None:
        previous = vars(runner).get(attr, _ABSENT)
        if attr == "graph_runners":
            installed = ReleaseOnSleep(None if previous is _ABSENT else previous, previous)
        else:
            installed = ReleaseCapturedGraphs(getattr(runner, attr), previous)
        setattr(runner, attr, installed)
    installed.callbacks.append(callback)
    handle = SleepRelease(runner, attr, installed, callback)
    if patches is not None:
        patches.on_undo(handle.remove)
    return handle


def release_lost(runner, callback=None) -> Reason | None:
    """Why sleep level 2 would no longer reach what ``release_on_sleep`` registered on ``runner``
    (someone replaced ``graph_runners`` or ``release_captured_graphs`` since; with ``callback``:
    or that callback is no longer registered), or None. Constant time: call it when a request
    binds, and run that request eagerly with the reason, its graphs dropped (memory the release
    never reached may have been discarded under them)."""
    if runner is None:
        return None
    attr = _release_attr(runner)
    current = getattr(runner, attr, None)
    installed = _ours(current, attr)
    if installed is None:
        return SLEEP_UNREACHABLE.because(f"{type(runner).__qualname__}.{attr} is now "
                                         f"{type(current).__name__}")
    if callback is not None and callback not in installed.callbacks:
        return SLEEP_UNREACHABLE.because(f"the callback is no longer on "
                                         f"{type(runner).__qualname__}.{attr}")
    return None
