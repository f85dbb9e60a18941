"""``decode/batch/workers.py``: the members of ``Turns`` and ``Ticks`` run on long-lived worker
threads, so the per-thread cuBLAS handles (and their device workspaces) number at most the
most members ever alive at once, whatever the timing of thread exits (why: the module's
docstring). CPU tests of the pool; the device-memory side is in the GPU batch file."""

import contextvars
import os
import signal
import threading
import time

import pytest

from vllm_omni_graphdecode.decode.batch import turns, workers


def _thread_of_each(n_members: int, runs: int) -> list[threading.Thread]:
    """Run ``runs`` groups of ``n_members`` one after another; each member waits for the group's
    launch, so every member of a group holds a worker at once (none can end and hand its worker
    on to a later member of the same group)."""
    seen: list[threading.Thread] = []
    for _ in range(runs):
        launched = []
        group = turns.Turns(lambda: launched.append(True))

        def member():
            seen.append(threading.current_thread())
            group.wait_until(lambda: bool(launched))

        group.run([member] * n_members)
        assert len(launched) == 1
    return seen


def test_groups_run_one_after_another_reuse_the_same_threads(own_pool):
    seen = _thread_of_each(4, 10)
    assert len(seen) == 40
    # Thread objects are kept alive in ``seen``: a thread per member would give 40.
    assert len({id(t) for t in seen}) == 4
    assert own_pool.started == 4 and own_pool.idle() == 4


def test_a_group_after_a_larger_one_takes_threads_it_already_had(own_pool):
    first = set(map(id, _thread_of_each(6, 1)))
    again = set(map(id, _thread_of_each(3, 5)))
    assert len(first) == 6 and len(again) >= 3
    assert again <= first
    assert own_pool.started == 6


def test_ticks_members_added_after_others_ended_reuse_their_threads():
    group = turns.Ticks(lambda: None)
    seen = []

    def body():
        seen.append(threading.current_thread())
        group.end_of_step()  # one tick parked: the thread stays the member's meanwhile
        seen.append(threading.current_thread())
        return "ok"

    for _ in range(5):
        member = group.add(body)
        group.tick()
        group.tick()
        assert member.done and member.result == "ok"
        group.forget(member)
    assert len(seen) == 10 and len({id(t) for t in seen}) == 1


def test_each_member_sees_its_own_context_and_name_on_a_shared_thread():
    var = contextvars.ContextVar("request", default=None)
    seen = []

    def first():
        var.set("first")
        seen.append((threading.current_thread(), var.get()))

    def second():
        seen.append((threading.current_thread(), var.get(), threading.current_thread().name))

    turns.Turns(lambda: None, name="group-a").run([first])
    turns.Turns(lambda: None, name="group-b").run([second])
    (t1, v1), (t2, v2, name) = seen
    assert t1 is t2
    assert v1 == "first" and v2 is None  # the first member's set does not leak
    assert name == "group-b-0"
    assert t1.name.startswith("graphdecode-worker-")  # back to its own name between members


def test_a_job_that_raises_out_leaves_its_worker_alive(caplog):
    pool = workers.Workers(prefix="test-worker")
    with caplog.at_level("ERROR"):
        pool.start(lambda: 1 / 0, "bad").wait(30)
    assert "a member raised out of its thread (bad)" in caplog.text
    where = []
    assert pool.start(lambda: where.append(threading.current_thread()), "good").wait(30)
    assert pool.started == 1 and where and where[0].is_alive()


def test_idle_workers_beyond_the_limit_exit():
    pool = workers.Workers(idle_max=1, prefix="test-worker")
    gate = threading.Event()
    threads = []

    def job():
        threads.append(threading.current_thread())
        gate.wait(30)

    ended = [pool.start(job, f"job-{i}") for i in range(3)]
    gate.set()
    for e in ended:
        assert e.wait(30)
    assert pool.started == 3 and pool.idle() == 1
    deadline = time.monotonic() + 30
    while sum(t.is_alive() for t in threads) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(t.is_alive() for t in threads) == 1


@pytest.fixture()
def own_pool(monkeypatch):
    """A pool of this test's own in place of the process's, so that what it counts is what the
    test made (the shared pool's count depends on which tests ran before)."""
    pool = workers.Workers(prefix="test-own-pool")
    monkeypatch.setattr(workers, "WORKERS", pool)
    return pool


@pytest.mark.parametrize("members", [1, 3])
def test_run_returns_only_after_every_worker_is_idle_again(members, own_pool):
    # Every member holds its worker until the group's launch (``_thread_of_each``): one worker
    # each, every one idle again when run returns.
    _thread_of_each(members, 1)
    assert own_pool.started == members and own_pool.idle() == members
    # Later groups of the same size take the idle workers: none made.
    _thread_of_each(members, 3)
    assert own_pool.started == members and own_pool.idle() == members


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_its_members_on_workers_of_its_own(own_pool):
    _thread_of_each(2, 1)  # the parent's pool has idle workers now
    assert own_pool.idle() >= 1
    pid = os.fork()
    if pid == 0:  # the child: only this thread lives; a member on a parent's worker would hang
        signal.alarm(20)
        try:
            ok = len(_thread_of_each(2, 2)) == 4 and workers.WORKERS.started >= 1
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
