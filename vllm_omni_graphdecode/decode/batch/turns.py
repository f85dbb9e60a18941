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

A member's thread is one of ``workers.WORKERS``'s long-lived threads, idle again before the
group hears the member ended: the members of the next batch run on the same threads, so a new
batch makes no new thread and no new cuBLAS handle (``workers.py`` says why that matters).

Each member runs in a copy of the caller's ``contextvars`` context, taken when the group starts
it: what the caller's code keeps in context variables (vllm-omni 0.30 keeps a request's
cancellation signals in one) is what the member's code sees.

``Ticks`` is the same idea for a server that advances its requests one step at a time
(vLLM-Omni's step execution): members that live across calls, each call (``tick``) running the
batched launch at most once and giving out units of work (a prefill, denoising steps) by its
order and limit.

Model-agnostic; no CUDA.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Callable, Sequence

from . import workers

_local = threading.local()


class Member:
    """One request's thread in a ``Turns`` group."""

    __slots__ = ("index", "group", "ready", "done", "result", "error", "ended")

    def __init__(self, group: "Turns", index: int):
        self.group = group
        self.index = index
        self.ready: Callable[[], bool] | None = None  # set while waiting: can it run again?
        self.done = False
        self.result = None
        self.error: BaseException | None = None
        self.ended: threading.Event | None = None  # set when its thread has left it


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
        with self._cond:
            self._turn = 0
        for member, fn in zip(self._members, fns):
            context = contextvars.copy_context()  # one each: a context runs in one thread
            member.ended = workers.WORKERS.start(
                lambda c=context, m=member, f=fn: c.run(self._body, m, f),
                f"{self.name}-{member.index}")
        for member in self._members:
            member.ended.wait()
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


# -- requests advanced one step per call ---------------------------------------------------------

NEW, RUNNING, AT_STEP, AT_LAUNCH, DONE = "new", "running", "at step", "at launch", "done"
# How a tick gives out its denoising steps (``Ticks``).
ORDERS = ("fcfs", "round_robin")


class TickMember:
    """One request's thread in a ``Ticks`` group: where it stands (``state``), and when ``DONE``
    its ``result`` or ``error``."""

    def __init__(self, group: "Ticks", fn: Callable[[], object], name: str, setup=None):
        self.group = group
        self.fn = fn
        self.state = NEW
        self.ready: Callable[[], bool] | None = None  # AT_LAUNCH: can it go on?
        self.result = None
        self.error: BaseException | None = None
        self.stop: BaseException | None = None  # raised in its thread at its next resume
        self.steps = 0  # units of work done (resumes: a denoising step is one)
        self.serial = 0  # its place in the order members were added (``Ticks.add``)
        self._go = threading.Semaphore(0)
        self._context = contextvars.copy_context()
        self._setup = setup
        self.name = name
        self.ended: threading.Event | None = None  # set when its thread has left it

    def start(self) -> None:
        self.ended = workers.WORKERS.start(lambda: self._context.run(self._body), self.name)

    @property
    def done(self) -> bool:
        return self.state == DONE

    def _body(self) -> None:
        _local.member = self
        self._go.acquire()
        try:
            if self.stop is not None:
                raise self.stop
            self.state = RUNNING
            self.result = self._setup(self.fn)() if self._setup is not None else self.fn()
        except BaseException as exc:  # the request's own failure, or its stop: its result
            self.error = exc
        finally:
            _local.member = None
            self.state = DONE
            self.group._back.release()


class Ticks:
    """Requests that live across calls, each running its own code in a thread of its own, one
    thread at a time; ``tick()`` is one step of the server, which advances them as below.

    A member's units end where its code calls ``end_of_step()`` (a denoising step) or waits for
    the batched launch (``wait_until``, as in ``Turns``). One ``tick()``, from the caller's
    thread, in order:

    1. every member that can run runs, one after another, until it parks again or ends: the
       new ones (a new request's prefill) in the order they were added, then the denoising
       steps: one per member parked at ``end_of_step`` when the tick began, but at most
       ``beside_launch`` (when not None) where a member waits for the launch, given out by
       ``order``:

       - ``"fcfs"`` (first come, first served): to the members in the order they were added,
         each as many as it takes before it leaves its denoising: the oldest request finishes
         first, and a request ends after no more work than under ``round_robin`` where the
         requests need equal work;
       - ``"round_robin"``: one each, from the member after the last one given a step;
    2. if any member waits for a launch, ``launch()`` runs once, in the caller's thread, and
       each member it made ready runs until it parks again (its next launch is the next tick's)
       or ends.

    So a request that decodes gets one launch a tick, and waits for at most ``beside_launch``
    denoising steps between two launches; a tick's denoising work does not depend on the order;
    a request that ends leaves at the tick it ended in.
    ``stop(member, exc)`` raises ``exc`` in the member's thread where it is parked, at the next
    tick (its ``finally`` blocks run, in its turn), or at once where it never ran.

    ``setup(fn)`` (optional) wraps each member's callable in its thread (device, stream, grad
    mode). Members run in a copy of the ``contextvars`` context of the thread that added them.
    A ``launch()`` that raises fails every member that waited for it with that exception.
    """

    def __init__(self, launch: Callable[[], None], *, name: str = "graphdecode-tick",
                 setup: Callable[[Callable[[], object]], Callable[[], object]] | None = None,
                 order: str = "fcfs", beside_launch: int | None = None):
        if order not in ORDERS:
            raise ValueError(f"order {order!r}: accepted: {', '.join(ORDERS)}")
        if beside_launch is not None and beside_launch < 1:
            raise ValueError(f"beside_launch {beside_launch!r}: accepted: None (no limit) or a "
                             f"positive number of steps")
        self.order = order
        self.beside_launch = beside_launch
        self._last_served = -1  # round robin: the serial of the last member given a step
        self.held = 0  # denoising steps ``beside_launch`` put off to a later tick, in all
        self.launch = launch
        self.name = name
        self.setup = setup
        self.members: list[TickMember] = []
        self._back = threading.Semaphore(0)
        self._added = 0
        self.ticks = 0

    def add(self, fn: Callable[[], object]) -> TickMember:
        """A member for ``fn``; it first runs at the next ``tick``."""
        member = TickMember(self, fn, f"{self.name}-{self._added}", self.setup)
        member.serial = self._added
        self._added += 1
        self.members.append(member)
        member.start()  # it waits for its first turn
        return member

    def stop(self, member: TickMember, exc: BaseException) -> None:
        if member.done:
            return
        member.stop = exc
        if member.state == NEW:
            self._resume(member)  # it raises ``exc`` before running anything

    def forget(self, member: TickMember) -> None:
        """Drop an ended member (its result was read)."""
        if member.done and member in self.members:
            self.members.remove(member)

    def tick(self) -> None:
        self.ticks += 1
        stepping = [m for m in self.members if m.state == AT_STEP and m.stop is None]
        for member in list(self.members):  # new members, stopped ones, ones a launch made ready
            if member in stepping:
                continue
            if member.state in (NEW, AT_STEP) or (member.state == AT_LAUNCH
                                                  and (member.stop is not None or member.ready())):
                self._resume(member)
        self._denoise(stepping)
        waiting = [m for m in self.members if m.state == AT_LAUNCH]
        if not waiting:
            return
        try:
            self.launch()
        except BaseException as exc:
            for member in waiting:
                if member.stop is None:
                    member.stop = exc
        for member in waiting:
            if member.state == AT_LAUNCH and (member.stop is not None or member.ready()):
                self._resume(member)

    def _denoise(self, stepping: list[TickMember]) -> None:
        """The tick's denoising steps (class docstring): one per member in ``stepping`` (parked
        at ``end_of_step`` when the tick began), at most ``beside_launch`` where a member waits
        for the launch, given out by ``order``."""
        budget = len(stepping)
        if self.beside_launch is not None and any(m.state == AT_LAUNCH for m in self.members):
            budget = min(budget, self.beside_launch)
            self.held += len(stepping) - budget
        if self.order == "fcfs":
            for member in stepping:
                while budget and member.state == AT_STEP and member.stop is None:
                    self._resume(member)
                    budget -= 1
            return
        # Round robin: one each, from the member after the last one served.
        start = next((i for i, m in enumerate(stepping) if m.serial > self._last_served), 0)
        for member in stepping[start:] + stepping[:start]:
            if not budget:
                break
            self._resume(member)
            budget -= 1
            self._last_served = member.serial

    # -- inside a member's thread -----------------------------------------------------------------

    def wait_until(self, ready: Callable[[], bool]) -> None:
        """Park until ``ready()`` holds after a launch (``Turns.wait_until``'s contract)."""
        member = self._own()
        if ready():
            return
        member.ready = ready
        self._park(member, AT_LAUNCH)
        member.ready = None

    def end_of_step(self) -> None:
        """This tick's unit of work is done: park until the next tick."""
        self._park(self._own(), AT_STEP)

    def _own(self) -> TickMember:
        member = current()
        if member is None or member.group is not self:
            raise RuntimeError("called outside one of this group's members")
        return member

    def _park(self, member: TickMember, state: str) -> None:
        member.state = state
        self._back.release()
        member._go.acquire()
        member.state = RUNNING
        if member.stop is not None:
            raise member.stop

    # -- the caller's side --------------------------------------------------------------------

    def _resume(self, member: TickMember) -> None:
        """Let ``member`` run until it parks or ends; the caller's thread waits meanwhile."""
        member.steps += 1
        member._go.release()
        self._back.acquire()
        if member.state == DONE:
            # Its worker is idle again before the next member can ask for one (workers.py).
            member.ended.wait()
