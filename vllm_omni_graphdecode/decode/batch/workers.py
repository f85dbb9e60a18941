"""Long-lived threads for the members of ``turns.Turns`` and ``turns.Ticks``: a member runs on an
idle worker, or on a new one when none is idle, and its worker waits for the next member after.

Why not a thread per member: each thread that runs a cuBLAS call takes a cuBLAS handle of its
own from torch's handle pool, and torch keeps a workspace per handle and stream (32 MiB on
Hopper) until the process ends. A thread hands its handle back only in its C++ thread-exit
destructors, which can run after Python's ``join()`` has returned: a batch whose members start
right after the last batch's members were joined can find those handles still taken and make
new ones, each with a new workspace, as often as the threads' exits happen to interleave so.
A worker keeps its handle for its life, so the handles, and their workspaces, number at most the
workers: the most members ever alive at once (the idle ones kept up to ``IDLE_MAX``).

This was read in torch's code as the likely cause of device memory that grew by 70 MiB over
eight batches of eight mixed requests in one H200 run (5 MiB in another). Measured since, it is
not: over 12 batches of 8 requests at a real model's shape, a thread per member made 96 threads
and grew device memory by 0 MiB, as the pool did with 8 (the batch benchmark's ``memory`` case,
h200-2026-12-05b); over 6 batches of 8 mixed requests (half think images) it grew in the first
batches only (+318 MiB, +4, then flat from batch 3) on the pool, and a thread per member, run
after it in the same process, kept it flat over 6 more (h100-2026-12-05c).
The pool stays: 8 threads instead of one per member per batch.

Not ``concurrent.futures.ThreadPoolExecutor``: its future is done before its worker counts as
idle again (the next batch can then start a new thread, the race above), and past
``max_workers`` it queues work, where a member parked in a ``Ticks`` group holds its thread for
as long as its request lives (queued members would wait for parked ones forever).

Each member still runs alone on its thread, in the ``contextvars`` context its group gave it.
After each member its worker's CUDA device and current stream are set back to what a new
thread starts with: a member's ``torch.cuda.set_stream`` does not leak into the next. A forked
child starts with an empty pool (the parent's workers do not exist there).

Model-agnostic.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from typing import Callable

logger = logging.getLogger(__name__)

# Idle workers kept beyond this many exit (the next burst makes new ones).
IDLE_MAX = 64


class _Worker:
    def __init__(self, pool: "Workers", index: int):
        self.pool = pool
        self.base = f"{pool.prefix}-{index}"
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=self.base, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, name, done = self.jobs.get()
            threading.current_thread().name = name
            try:
                before = _snapshot()
            except Exception:  # a broken device: the member's own setup raises it to its request
                before = None
            try:
                fn()
            except BaseException:  # members catch their own; a worker must outlive a bug
                logger.exception("graphdecode: a member raised out of its thread (%s)", name)
            threading.current_thread().name = self.base
            try:
                _restore(before)
            except Exception:  # a broken device: the next member's own setup raises it
                logger.exception("graphdecode: could not reset this worker's CUDA stream")
            # Back to the idle list before the caller hears it ended: a group that starts its
            # next members at once finds this worker idle (the point of the pool).
            keep = self.pool._idle_again(self)
            done.set()
            if not keep:
                return


class Workers:
    """A pool of worker threads; ``start(fn, name)`` runs ``fn`` on one and returns an event set
    when ``fn`` has returned (``fn`` must not raise: a member catches its own exceptions)."""

    def __init__(self, idle_max: int = IDLE_MAX, prefix: str = "graphdecode-worker"):
        self.idle_max = idle_max
        self.prefix = prefix  # each worker's thread name between members: PREFIX-N
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self.started = 0  # workers made over the pool's life

    def start(self, fn: Callable[[], None], name: str) -> threading.Event:
        done = threading.Event()
        with self._lock:
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                self.started += 1
                index = self.started
        if worker is None:
            worker = _Worker(self, index)
        worker.jobs.put((fn, name, done))
        return done

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def _idle_again(self, worker: _Worker) -> bool:
        with self._lock:
            if len(self._idle) >= self.idle_max:
                return False
            self._idle.append(worker)
            return True


WORKERS = Workers()


def _forget_after_fork() -> None:
    """In a forked child only the forking thread lives: the pool's idle workers are gone, and a
    member handed to one would never run. The child starts with an empty pool."""
    WORKERS._lock = threading.Lock()
    WORKERS._idle = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _snapshot():
    """This thread's CUDA device and current stream, where torch has initialised CUDA; else
    None (nothing to look at, and looking must not initialise it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    return device, torch.cuda.current_stream(device)


def _restore(before) -> None:
    """Undo what a member did to this thread's CUDA state: the stream it made current on the
    device it ended on goes back to that device's default stream, and the device and stream
    the thread had before the member come back. Where CUDA was not initialised before the
    member, no device is set (setting one would create its context)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    now = torch.cuda.current_device()
    torch.cuda.set_stream(torch.cuda.default_stream(now))
    if before is not None:
        torch.cuda.set_device(before[0])
        torch.cuda.set_stream(before[1])
