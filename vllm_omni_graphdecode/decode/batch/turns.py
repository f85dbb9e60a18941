"""Several requests through one pipeline's own code, taking turns: what lets their decode loops
meet in one batched launch.

Why: vLLM-Omni hands a pipeline that declares ``supports_request_batch`` several requests in one
``forward`` call. A pipeline's ``forward`` may be written for one request (its prefill, its think or
text loop, its denoising, each a Python loop over the model). Rather than restate that code for a
batch, each request runs the pipeline's own code in a thread of its own (a *member*), and the
members take turns: exactly one runs at a time, and a member gives its turn away only where it
waits for something another member's work provides (``wait_until``): here, a decode loop waiting
for the batch's next launch. When no member can run, the one holding the turn runs ``on_idle``
(the batched launch), which makes waiting members ready again.

So, for the code each member runs, nothing is concurrent: the pipeline's caches, a capture, the
CUDA generator and the plugin's own state see one request at a time, as without batching, and
every member's work is issued on the same stream in turn order. What runs together is only what
``on_idle`` runs together.

Order: members start in request order; the turn passes to the next member that can run, in
request order from the one that gave it away (round robin), so every member's prefill has run
before the first launch, and a member that finished its decode runs its denoising while the
others wait for the next launch.

A member that raises ends alone: its exception is its result, the others go on. ``on_idle``
raising is a bug in the caller; it is re-raised in every member still waiting (each request
fails with it rather than hanging).

Model-agnostic; no CUDA.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

_local = threading.local()


class Member:
    """One request's thread in a ``Turns`` group."""

    __slots__ = ("index", "group", "ready", "done", "result", "error", "thread")

    def __init__(self, group: "Turns", index: int):
        self.group = group
        self.index = index
        self.ready: Callable[[], bool] | None = None  # set while waiting: can it run again?
        self.done = False
        self.result = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None


def current() -> Member | None:
    """The member this thread runs, or None outside a ``Turns`` group."""
    return getattr(_local, "member", None)


class Stuck(RuntimeError):
    """Every live member waits and ``on_idle`` made none of them ready."""


class Turns:
    """Run ``fns`` (one per request) in threads of their own, one at a time (module docstring).

    ``on_idle()`` is called, by the thread holding the turn, whenever no member can run and at
    least one waits; it must make at least one waiting member ready. ``run`` returns each
    callable's result or the exception it raised, in order.
    """

    def __init__(self, on_idle: Callable[[], None], *, name: str = "graphdecode-turn"):
        self.on_idle = on_idle
        self.name = name
        self._cond = threading.Condition()
        self._members: list[Member] = []
        self._turn: int | None = None
        self._failure: BaseException | None = None

    def run(self, fns: Sequence[Callable[[], object]]) -> list[object]:
        self._members = [Member(self, i) for i in range(len(fns))]
        if not fns:
            return []
        for member, fn in zip(self._members, fns):
            member.thread = threading.Thread(target=self._body, args=(member, fn),
                                             name=f"{self.name}-{member.index}", daemon=True)
        with self._cond:
            self._turn = 0
        for member in self._members:
            member.thread.start()
        for member in self._members:
            member.thread.join()
        return [m.error if m.error is not None else m.result for m in self._members]

    # -- inside a member's thread -----------------------------------------------------------------

    def wait_until(self, ready: Callable[[], bool]) -> None:
        """Give the turn away until ``ready()`` holds (checked whenever the turn could come back).
        Called from the member's own thread; returns holding the turn."""
        member = current()
        if member is None or member.group is not self:
            raise RuntimeError("wait_until called outside one of this group's members")
        with self._cond:
            if ready():
                return
            member.ready = ready
            self._pass_turn(member)
            self._await_turn(member)
            member.ready = None

    # -- the scheduler ------------------------------------------------------------------------

    def _body(self, member: Member, fn: Callable[[], object]) -> None:
        _local.member = member
        try:
            with self._cond:
                self._await_turn(member)
            member.result = fn()
        except BaseException as exc:  # the request's own failure: its result
            member.error = exc
        finally:
            _local.member = None
            with self._cond:
                member.done = True
                self._pass_turn(member)

    def _await_turn(self, member: Member) -> None:
        while self._turn != member.index:
            if self._failure is not None:
                raise self._failure
            self._cond.wait()
        if self._failure is not None and member.ready is not None:
            raise self._failure

    def _runnable(self, member: Member) -> bool:
        return not member.done and (member.ready is None or member.ready())

    def _pass_turn(self, member: Member) -> None:
        """The turn leaves ``member`` (waiting or done): to the next member that can run, after
        as many idle launches as it takes. Called holding the condition."""
        n = len(self._members)
        while True:
            order = [self._members[(member.index + 1 + i) % n] for i in range(n)]
            nxt = next((m for m in order if self._runnable(m)), None)
            if nxt is not None:
                self._turn = nxt.index
                self._cond.notify_all()
                return
            waiting = [m for m in self._members if not m.done]
            if not waiting:
                self._turn = None
                self._cond.notify_all()
                return
            # No one can run: the holder of the turn (this thread) runs the idle work. The others
            # all sleep in wait(), so releasing the condition meanwhile lets nobody in.
            self._cond.release()
            try:
                self.on_idle()
                failure = None
            except BaseException as exc:
                failure = exc
            finally:
                self._cond.acquire()
            if failure is not None:
                self._failure = failure
                self._cond.notify_all()
                return
            if not any(self._runnable(m) for m in waiting):
                self._failure = Stuck(f"{len(waiting)} members wait and the idle work made none "
                                      f"of them ready")
                self._cond.notify_all()
                return
