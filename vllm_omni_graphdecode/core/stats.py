"""What the plugin did in this process: wiring, captures, replays and fallbacks by reason.

Every fallback goes through ``fallback()``: it is counted under its reason and logged once per
process at WARNING with the model and what to change. A fallback that is not counted here is a
bug: the server would be slow and nobody would know why.

The counters live in the process that loaded the model: in vLLM-Omni that is the diffusion worker,
which no client can reach. ``VLLM_OMNI_GRAPHDECODE_STATS_FILE`` makes that process write its
snapshot to a file (after each wiring and each fallback reason, at most once a second while events
are counted, the last of them within a second of being counted, and at exit, a ``multiprocessing``
child's exit included), so an end-to-end test or an operator can read what happened there. With
``{pid}`` in the path each process writes a file of its own; a forked child's file starts from its
parent's record at the fork. Without ``{pid}``, processes write over one file.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import multiprocessing.util
import os
import threading
import time

from .reasons import Reason

# vllm attaches its handlers to the "vllm" logger only: a logger outside that tree loses INFO.
logger = logging.getLogger("vllm.vllm_omni_graphdecode")

_lock = threading.Lock()
_counters: collections.Counter[str] = collections.Counter()
_fallbacks: collections.Counter[tuple[str, str]] = collections.Counter()
_degraded: collections.Counter[tuple[str, str]] = collections.Counter()
_wired: list[str] = []
_warned: set[tuple[str, str]] = set()

DUMP_INTERVAL_S = 1.0
# generation: bumped by reset() and a fork, so a trailing write scheduled before either does
# nothing after it; exiting: set by the final write, after which every event is written at once
# (no timer thread is left to run); finalize_pid: the process whose multiprocessing exit runs
# _final_write.
_dump = {"resolved": False, "path": "", "last": 0.0, "atexit": False, "timer": None,
         "generation": 0, "exiting": False, "finalize_pid": None}
_dump_lock = threading.Lock()
_timer_lock = threading.Lock()


def count(model: str, event: str, n: int = 1) -> None:
    """Count an event (``capture``, ``replay``, ``eager_step`` ...) for a model."""
    with _lock:
        _counters[f"{model}.{event}"] += n
    if _dump["path"] or not _dump["resolved"]:
        _maybe_dump()


def fallback(model: str, reason: Reason) -> None:
    """Record that ``model`` ran eagerly because of ``reason`` (counted under ``reason.key``; the
    first occurrence in the process is logged at WARNING with its detail and hint)."""
    _record(_fallbacks, model, reason, "runs eagerly", "To use the graph path")


def degraded(model: str, reason: Reason) -> None:
    """Record that ``model``'s graph path runs without one of its optimisations (counted apart
    from the eager fallbacks, under ``reason.key``; logged once the same way)."""
    _record(_degraded, model, reason, "runs the graph path without an optimisation", "To get it")


def refused(model: str, reason: Reason) -> None:
    """Record that ``model`` was not wired at load because of ``reason`` (counted with the
    fallbacks, logged once the same way; the load's INFO line says it too)."""
    _record(_fallbacks, model, reason, "is not wired and is served eagerly", "To wire it")


def _record(counter, model: str, reason: Reason, what: str, to_get: str) -> None:
    key = (model, reason.key)
    with _lock:
        counter[key] += 1
        first = key not in _warned
        _warned.add(key)
    _maybe_dump(force=first)
    if first:
        extra = f" ({reason.detail})" if reason.detail else ""
        logger.warning("graphdecode: %s %s: %s%s. %s: %s. (logged once per process; counted in "
                       "stats)", model, what, reason.key, extra, to_get, reason.hint)


def wired(line: str) -> None:
    with _lock:
        _wired.append(line)
    _maybe_dump(force=True)


def get(model: str, event: str) -> int:
    with _lock:
        return _counters[f"{model}.{event}"]


def fallbacks(model: str | None = None) -> dict[str, int]:
    with _lock:
        return {f"{m}: {r}": n for (m, r), n in _fallbacks.items() if model in (None, m)}


def degraded_paths(model: str | None = None) -> dict[str, int]:
    with _lock:
        return {f"{m}: {r}": n for (m, r), n in _degraded.items() if model in (None, m)}


def snapshot() -> dict:
    with _lock:
        return {
            "wired": list(_wired),
            "counters": dict(sorted(_counters.items())),
            "fallbacks": {f"{m}: {r}": n for (m, r), n in sorted(_fallbacks.items())},
            "degraded": {f"{m}: {r}": n for (m, r), n in sorted(_degraded.items())},
        }


def dumps() -> str:
    return json.dumps(snapshot(), indent=2)


def dump_path() -> str:
    """Where this process writes its snapshot ("" when VLLM_OMNI_GRAPHDECODE_STATS_FILE is off)."""
    if not _dump["resolved"]:
        from .. import config

        try:
            template = config.get().stats_file
        except config.ConfigError:  # reported by register() at start-up; counting must not raise
            template = ""
        _dump["path"] = template.replace("{pid}", str(os.getpid()))
        _dump["resolved"] = True
        if _dump["path"] and not _dump["atexit"]:
            atexit.register(_final_write)
            _dump["atexit"] = True
        if _dump["path"] and _dump["finalize_pid"] != os.getpid():
            # A multiprocessing child ends with os._exit(): atexit does not run there, but its
            # finalizers do (registered here, after the child's start cleared its parent's).
            multiprocessing.util.Finalize(None, _final_write, exitpriority=0)
            _dump["finalize_pid"] = os.getpid()
    return _dump["path"]


def write_snapshot(path: str) -> None:
    """Write this process's snapshot (plus its pid) to ``path`` as JSON, atomically."""
    data = dict(snapshot(), pid=os.getpid())
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def _maybe_dump(force: bool = False, generation: int | None = None) -> None:
    """``generation``: a trailing write's, which writes nothing once reset() or a fork has
    started another."""
    path = dump_path()
    if not path:
        return
    now = time.monotonic()
    wait = DUMP_INTERVAL_S - (now - _dump["last"])
    if not force and not _dump["exiting"] and wait > 0:
        _write_when_the_interval_ends(wait)
        return
    _dump["last"] = now
    try:
        with _dump_lock:
            if generation is not None and generation != _dump["generation"]:
                return
            write_snapshot(path)
    except Exception as exc:  # a stats file must never break serving
        logger.warning("graphdecode: cannot write VLLM_OMNI_GRAPHDECODE_STATS_FILE %s: %s", path,
                       exc)
        try:
            os.remove(f"{path}.{os.getpid()}.tmp")
        except OSError:
            pass
        if _dump["path"] == path:  # not a path that reset() has resolved since
            _dump["path"] = ""


def _write_when_the_interval_ends(wait: float) -> None:
    """Events counted inside an interval reach the file when it ends, not only with the next event
    or at exit: a process that serves on after its last event (vllm-omni 0.30 runs a single
    diffusion stage inside the client process, which goes on to the next engine) would otherwise
    show a file short of its last second's events."""
    if _dump["timer"] is not None:  # the common case inside an interval: no lock taken
        return
    with _timer_lock:
        if _dump["timer"] is not None:
            return
        timer = threading.Timer(wait, _trailing_write, args=(_dump["generation"],))
        timer.daemon = True
        _dump["timer"] = timer
    try:
        timer.start()
    except RuntimeError:  # no new thread (interpreter shutdown, the process's thread limit)
        with _timer_lock:
            _dump["timer"] = None
        _maybe_dump(force=True)  # counting must not raise: write now instead


def _trailing_write(generation: int) -> None:
    with _timer_lock:
        if generation == _dump["generation"]:
            _dump["timer"] = None
    _maybe_dump(force=True, generation=generation)


def _cancel_trailing_write() -> None:
    with _timer_lock:
        timer, _dump["timer"] = _dump["timer"], None
    if timer is not None:
        timer.cancel()


def _final_write() -> None:
    """At exit: the last snapshot, with no trailing write left to race it; events counted
    after it (by other exit handlers) are written at once."""
    _dump["exiting"] = True
    _cancel_trailing_write()
    _maybe_dump(force=True)


def _after_fork_in_child() -> None:
    """A forked child has its own pid (its own file where the path names ``{pid}``) and none of
    the parent's threads: resolve its file afresh, with fresh locks (the parent's may have been
    held by its timer thread)."""
    global _lock, _dump_lock, _timer_lock
    _lock, _dump_lock, _timer_lock = threading.Lock(), threading.Lock(), threading.Lock()
    _dump.update(resolved=False, path="", last=0.0, timer=None, exiting=False,
                 generation=_dump["generation"] + 1)


if hasattr(os, "register_at_fork"):  # every platform vLLM runs on; not Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)


def reset_counters() -> None:
    """Zero the event counters (keep fallbacks and the wiring record)."""
    with _lock:
        _counters.clear()


def reset() -> None:
    """Forget everything (tests, and `bench` between cases)."""
    with _lock:
        _counters.clear()
        _fallbacks.clear()
        _degraded.clear()
        _wired.clear()
        _warned.clear()
    _cancel_trailing_write()
    with _dump_lock:  # a trailing write already writing finishes first; later ones do nothing
        _dump.update(resolved=False, path="", last=0.0, exiting=False,
                     generation=_dump["generation"] + 1)
