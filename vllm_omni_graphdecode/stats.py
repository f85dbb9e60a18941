"""What the plugin did in this process: wiring, captures, replays and fallbacks by reason.

Every fallback goes through ``fallback()``: it is counted under its reason and logged once per
process at WARNING with the model and what to change. A fallback that is not counted here is a
bug: the server would be slow and nobody would know why.
"""

from __future__ import annotations

import collections
import json
import logging
import threading

# vllm attaches its handlers to the "vllm" logger only: a logger outside that tree loses INFO.
logger = logging.getLogger("vllm.vllm_omni_graphdecode")

_lock = threading.Lock()
_counters: collections.Counter[str] = collections.Counter()
_fallbacks: collections.Counter[tuple[str, str]] = collections.Counter()
_wired: list[str] = []
_warned: set[tuple[str, str]] = set()


def count(model: str, event: str, n: int = 1) -> None:
    """Count an event (``capture``, ``replay``, ``eager_step`` ...) for a model."""
    with _lock:
        _counters[f"{model}.{event}"] += n


def fallback(model: str, reason: str, hint: str, detail: str = "") -> None:
    """Record that ``model`` ran eagerly because of ``reason`` (a short stable string).

    ``hint`` says what to change to get the fast path; ``detail`` is context for the first log line.
    """
    _record(model, reason, "runs eagerly", "To use the graph path", hint, detail)


def degraded(model: str, reason: str, hint: str, detail: str = "") -> None:
    """Record that ``model``'s graph path runs without one of its optimisations (counted under
    ``reason`` with the fallbacks, logged once the same way)."""
    _record(model, reason, "runs the graph path without an optimisation", "To get it", hint,
            detail)


def _record(model, reason, what, to_get, hint, detail) -> None:
    key = (model, reason)
    with _lock:
        _fallbacks[key] += 1
        first = key not in _warned
        _warned.add(key)
    if first:
        extra = f" ({detail})" if detail else ""
        logger.warning("graphdecode: %s %s: %s%s. %s: %s. (logged once per process; counted in "
                       "stats)", model, what, reason, extra, to_get, hint)


def wired(line: str) -> None:
    with _lock:
        _wired.append(line)


def get(model: str, event: str) -> int:
    with _lock:
        return _counters[f"{model}.{event}"]


def fallbacks(model: str | None = None) -> dict[str, int]:
    with _lock:
        return {f"{m}: {r}": n for (m, r), n in _fallbacks.items() if model in (None, m)}


def snapshot() -> dict:
    with _lock:
        return {
            "wired": list(_wired),
            "counters": dict(sorted(_counters.items())),
            "fallbacks": {f"{m}: {r}": n for (m, r), n in sorted(_fallbacks.items())},
        }


def dumps() -> str:
    return json.dumps(snapshot(), indent=2)


def reset_counters() -> None:
    """Zero the event counters (keep fallbacks and the wiring record)."""
    with _lock:
        _counters.clear()


def reset() -> None:
    """Forget everything (tests, and `bench` between cases)."""
    with _lock:
        _counters.clear()
        _fallbacks.clear()
        _wired.clear()
        _warned.clear()
