"""What every hook needs to patch a loaded model safely, and what the loader needs from a hook.

Lives below both ``loading`` and ``hooks``: a hook imports this, never the loader.

- ``HookRefused``: a hook will not wire this model; it carries a ``Reason`` and the model stays as
  it was loaded.
- ``check_signature``: a method is patched or called only after its leading parameters were
  checked, so a changed upstream method is refused with what moved instead of patched blind.
- ``release_on_sleep``: sleep level 2 discards the memory a CUDA graph was recorded against, so
  every hook registers a callback that drops its graphs there.
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable

from .reasons import Reason

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


class ReleaseOnSleep(dict):
    """Set as ``runner.graph_runners``: its ``clear()`` also runs every hook's release callback.

    The one call every vllm-omni worker makes at sleep level 2 is ``graph_runners.clear()``
    (0.24-0.28 only that, guarded by ``hasattr``; 0.30 from
    ``DiffusionModelRunner.release_captured_graphs``). No runner of 0.24-0.30 has the attribute
    itself; entries found there are kept.
    """

    def __init__(self, existing=None):
        super().__init__(existing or {})
        self.callbacks: list = []

    def clear(self) -> None:
        super().clear()
        for callback in self.callbacks:
            callback()


def can_release_on_sleep(runner) -> Reason | None:
    """Why sleep could not reach this runner's release callbacks, or None."""
    if runner is None or callable(getattr(runner, "release_captured_graphs", None)):
        return None
    existing = getattr(runner, "graph_runners", None)
    if existing is not None and not isinstance(existing, dict):
        return SLEEP_UNREACHABLE.because(f"{type(runner).__qualname__}.graph_runners is a "
                                         f"{type(existing).__name__}")
    return None


SLEEP_UNREACHABLE = Reason("sleep could not release this plugin's graphs",
                           "use a supported vllm-omni version")


def release_on_sleep(runner, callback) -> None:
    """Run ``callback`` when vllm-omni puts ``runner`` to sleep at level 2 (or releases graphs)."""
    current = getattr(runner, "graph_runners", None)
    if not isinstance(current, ReleaseOnSleep):
        current = ReleaseOnSleep(current)
        runner.graph_runners = current
    current.callbacks.append(callback)
