"""prefix_graph, the mechanism under the Qwen-Image-2.1 hook, with a small arithmetic step on CPU: ownership,
pooling, LRU, and the fallbacks that need no GPU to reach."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.graphs import capture as cuda_graphs
from vllm_omni_graphdecode.graphs import prefix as pg

MODEL = "prefix_graph_test"


class Owner:
    """Stands for a request's KV-cache object: anything weakly referenceable."""


def sum_step(bufs: pg.StaticBuffers) -> torch.Tensor:
    k, v = bufs.prefix[0]
    return bufs.step["x"] @ k.T + v.sum() + bufs.request["r"]


def key(prefix_len=4) -> pg.PrefixKey:
    return pg.PrefixKey(batch=1, prefix_len=prefix_len, target=(3,), dtype=torch.float32, device="cpu",
                        backend="native")


def inputs(seed, prefix_len=4):
    g = torch.Generator().manual_seed(seed)
    prefix = [(torch.randn(prefix_len, 2, generator=g), torch.randn(prefix_len, 2, generator=g))]
    return prefix, {"r": torch.randn(3, 1, generator=g)}, {"x": torch.randn(3, 2, generator=g)}


def graphs(**kw) -> pg.PrefixGraphs:
    kw.setdefault("max_entries", 4)
    return pg.PrefixGraphs(MODEL, sum_step, capture=False, **kw)


def expected(prefix, request, step):
    return sum_step(pg.StaticBuffers(prefix=prefix, request=request, step=step))


def reasons() -> set[str]:
    return {k.split(": ", 1)[1] for k in stats.fallbacks(MODEL)}


def test_owned_entries_are_not_shared_while_their_owner_lives():
    g = graphs()
    a, b = Owner(), Owner()
    ia, ib = inputs(1), inputs(2)
    ea, eb = g.bind(a, key(), *ia), g.bind(b, key(), *ib)
    assert ea is not eb
    assert torch.equal(g.run(ea, ia[2]), expected(*ia))
    assert torch.equal(g.run(eb, ib[2]), expected(*ib))
    assert g.lookup(a) is ea and g.lookup(b) is eb


def test_a_dead_owner_frees_its_entry_for_the_same_key():
    g = graphs()
    a = Owner()
    entry = g.bind(a, key(), *inputs(1))
    del a
    gc.collect()
    c = Owner()
    ic = inputs(3)
    assert g.bind(c, key(), *ic) is entry
    assert torch.equal(g.run(entry, ic[2]), expected(*ic))
    assert g.info()["entries"] == 1


def test_other_key_does_not_take_a_free_entry():
    g = graphs()
    a = Owner()
    entry = g.bind(a, key(4), *inputs(1, 4))
    g.release(a)
    assert g.bind(Owner(), key(5), *inputs(2, 5)) is not entry
    assert g.info()["entries"] == 2


def test_full_pool_evicts_the_least_recently_used_free_entry():
    g = graphs(max_entries=2)
    owners = [Owner(), Owner()]
    first = g.bind(owners[0], key(4), *inputs(1, 4))
    second = g.bind(owners[1], key(5), *inputs(2, 5))
    g.release(owners[0])
    g.release(owners[1])
    third = g.bind(Owner(), key(6), *inputs(3, 6))
    assert third is not first and third is not second
    assert first.buffers is None and second.buffers is not None  # the older one went


def test_full_pool_of_live_entries_refuses_with_its_reason():
    g = graphs(max_entries=1)
    a = Owner()
    g.bind(a, key(), *inputs(1))
    assert g.bind(Owner(), key(), *inputs(2)) is None
    assert pg.CAPACITY.key in reasons()


def test_an_owner_that_cannot_be_weakly_referenced_is_refused():
    g = graphs()
    assert g.bind(object(), key(), *inputs(1)) is None
    assert pg.UNTRACKABLE_OWNER.key in reasons()


def test_a_step_of_another_shape_is_refused():
    g = graphs()
    a = Owner()
    entry = g.bind(a, key(), *inputs(1))
    assert g.run(entry, {"x": torch.zeros(5, 2)}) is None
    assert pg.STEP_MISMATCH.key in reasons()


def test_release_all_drops_entries_and_owners_rebind():
    g = graphs()
    a = Owner()
    ia = inputs(1)
    g.bind(a, key(), *ia)
    g.release_all()
    assert g.lookup(a) is None and g.info()["entries"] == 0
    entry = g.bind(a, key(), *ia)
    assert torch.equal(g.run(entry, ia[2]), expected(*ia))


def test_verify_mismatch_disables_the_shape_and_returns_the_eager_result():
    g = graphs(verify=True)
    a = Owner()
    ia = inputs(1)
    entry = g.bind(a, key(), *ia)
    eager = expected(*ia)
    assert g._verify(entry, eager + 1.0, eager) is eager
    assert pg.VERIFY_MISMATCH.key in reasons()
    assert stats.get(MODEL, cuda_graphs.VERIFY_MISMATCH) == 1
    assert g.run(entry, ia[2]) is None  # the shape now runs eagerly for this process


def test_verify_counts_exact_and_close_replays_under_the_shared_counter():
    """Both graph runners (this and paged_decode) count under cuda_graphs.VERIFIED."""
    g = graphs(verify=True)
    entry = g.bind(Owner(), key(), *inputs(1))
    ref = torch.ones(4, dtype=torch.bfloat16)
    g._verify(entry, ref.clone(), ref)
    g._verify(entry, ref + torch.tensor([0.0078125, 0, 0, 0], dtype=torch.bfloat16), ref)  # one ulp
    assert stats.get(MODEL, cuda_graphs.VERIFIED) == 2
    assert stats.get(MODEL, cuda_graphs.VERIFY_MISMATCH) == 0 and stats.fallbacks(MODEL) == {}


def test_max_entries_must_be_positive():
    with pytest.raises(ValueError):
        graphs(max_entries=0)


def test_oom_first_gives_back_idle_entries_and_retries(monkeypatch):
    g = graphs()
    a = Owner()
    g.bind(a, key(4), *inputs(1, 4))
    g.release(a)  # idle in the pool, holding memory
    real, calls = pg._alloc_like, []

    def fail_once(t):
        calls.append(t)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return real(t)

    monkeypatch.setattr(pg, "_alloc_like", fail_once)
    b = Owner()
    ib = inputs(2, 5)
    entry = g.bind(b, key(5), *ib)
    assert entry is not None and torch.equal(g.run(entry, ib[2]), expected(*ib))
    assert g.info()["entries"] == 1 and g.info()["eager_keys"] == 0
    assert stats.get(MODEL, "oom_evictions") == 1 and stats.fallbacks(MODEL) == {}


def test_oom_with_nothing_to_give_back_makes_the_shape_eager(monkeypatch):
    def no_memory(t):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(pg, "_alloc_like", no_memory)
    g = graphs()
    assert g.bind(Owner(), key(), *inputs(1)) is None
    monkeypatch.undo()
    assert g.bind(Owner(), key(), *inputs(2)) is None  # eager until a release (sleep)
    assert g.info()["eager_keys"] == 1 and pg.OOM.key in reasons()


def test_a_step_holds_no_lock_another_request_binds_while_it_runs():
    """Replays take no lock: while thread A is inside its step, thread B binds its own entry
    (which takes the pool's bookkeeping lock). Synchronised by events; the waits' limits only
    turn a deadlock into a failure."""
    in_step, bound = threading.Event(), threading.Event()

    def blocking_step(bufs):
        if not in_step.is_set():
            in_step.set()
            assert bound.wait(60), "B could not bind while A's step ran"
        return sum_step(bufs)

    g = pg.PrefixGraphs(MODEL, blocking_step, capture=False, max_entries=4)
    a, b = Owner(), Owner()
    ia, ib = inputs(1), inputs(2)
    entry_a = g.bind(a, key(), *ia)
    out, error = [], []

    def run_a():
        try:
            out.append(g.run(entry_a, ia[2]))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            error.append(exc)

    thread = threading.Thread(target=run_a)
    thread.start()
    assert in_step.wait(60)
    entry_b = g.bind(b, key(), *ib)
    bound.set()
    thread.join(60)
    assert error == [] and torch.equal(out[0], expected(*ia))
    assert entry_b is not None and torch.equal(g.run(entry_b, ib[2]), expected(*ib))


def test_a_release_before_the_step_reads_its_entry_returns_none_with_its_reason():
    g = graphs()
    a = Owner()
    ia = inputs(1)
    entry = g.bind(a, key(), *ia)
    g.release_all()  # sleep, between the caller's lookup and its run
    assert g.run(entry, ia[2]) is None
    assert pg.RELEASED.key in reasons()


# -- sleep (release_all) and what it lets capture again ------------------------------------------

class _CpuGraph:
    """Stands in for a CUDA graph on CPU, where none can be captured: ``replay`` runs the step
    again into the captured output buffer, as a replay overwrites it."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.output.copy_(self.fn())


def _capture_failing_first(monkeypatch, oom=False):
    """``cuda_graphs.capture`` whose first call fails (a capture error, or out of memory inside
    the capture) and whose later calls record a ``_CpuGraph``."""
    calls = []

    def capture(fn, device=None, **kw):
        calls.append(1)
        if len(calls) == 1:
            cause = torch.OutOfMemoryError("injected") if oom else RuntimeError("injected")
            try:
                raise cause
            except Exception as exc:
                raise cuda_graphs.CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
        graph = _CpuGraph(fn)
        graph.output = fn()
        return cuda_graphs.Captured(graph, graph.output, graph.output.clone())

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    return calls


@pytest.mark.parametrize("oom", [False, True], ids=["capture_failed", "out_of_memory"])
def test_a_shape_that_failed_to_capture_runs_eagerly_until_release_all_then_replays(
        monkeypatch, oom):
    calls = _capture_failing_first(monkeypatch, oom=oom)
    g = pg.PrefixGraphs(MODEL, sum_step, max_entries=4, capture=True)
    a = Owner()
    ia = inputs(1)
    assert g.run(g.bind(a, key(), *ia), ia[2]) is None  # the failed capture: eager
    b = Owner()
    assert g.bind(b, key(), *inputs(2)) is None  # sticky: the shape stays eager
    assert g.info()["eager_keys"] == 1 and calls == [1]
    assert (pg.OOM if oom else pg.CAPTURE_FAILED).key in reasons()
    g.release_all()  # sleep level 2
    assert g.info()["eager_keys"] == 0
    c = Owner()
    ic = inputs(3)
    entry = g.bind(c, key(), *ic)
    assert torch.equal(g.run(entry, ic[2]), expected(*ic))  # captured now, and replayed
    assert torch.equal(g.run(entry, inputs(4)[2]), expected(ic[0], ic[1], inputs(4)[2]))
    assert calls == [1, 1] and stats.get(MODEL, "capture") == 1
    assert stats.get(MODEL, "replay") == 2


def test_a_verify_mismatch_stays_eager_after_release_all():
    g = graphs(verify=True)
    a = Owner()
    ia = inputs(1)
    entry = g.bind(a, key(), *ia)
    eager = expected(*ia)
    g._verify(entry, eager + 1.0, eager)
    g.release_all()
    assert g.bind(Owner(), key(), *inputs(2)) is None  # the step body disagreed: for the process
    assert g.info()["eager_keys"] == 1
