"""patching: the record of what a wiring set (``Patches``), and the one place that decides how
sleep level 2 reaches a hook's release on each vllm-omni version (``release_on_sleep``), with its
constant-time check (``release_lost``)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from vllm_omni_graphdecode.core import patching


class Owner:
    def method(self):
        return "class"


# -- Patches ------------------------------------------------------------------------------------

def test_undo_puts_back_own_attributes_and_lets_class_attributes_show_again():
    obj = Owner()
    obj.own = own = object()
    patches = patching.Patches()
    patches.set(obj, "own", "patched")
    patches.set(obj, "method", lambda: "patched")
    patches.set(obj, "new", 1)
    assert obj.own == "patched" and obj.method() == "patched" and obj.new == 1
    assert patches.undo() == []
    assert obj.own is own and obj.method() == "class" and "method" not in vars(obj)
    assert not hasattr(obj, "new")
    assert patches.undo() == []  # nothing left to undo


def test_undo_runs_last_first_and_leaves_what_someone_replaced_since():
    obj, order = Owner(), []
    patches = patching.Patches()
    patches.on_undo(lambda: order.append("first"))
    patches.set(obj, "method", lambda: "ours")
    patches.on_undo(lambda: order.append("last"))
    ours = obj.method
    obj.method = lambda: ours() + " wrapped"  # a wrapper stacked above ours
    assert patches.undo() == ["Owner.method"]
    assert obj.method() == "ours wrapped" and order == ["last", "first"]


def test_patches_work_on_classes():
    class Target:
        value = 1

    patches = patching.Patches()
    patches.set(Target, "value", 2)
    patches.set(Target, "added", 3)
    assert Target.value == 2 and Target.added == 3
    patches.undo()
    assert Target.value == 1 and not hasattr(Target, "added")


# -- sleep release, vllm-omni 0.24-0.28: runner.graph_runners.clear() ---------------------------

def _sleep_024(runner):
    if hasattr(runner, "graph_runners"):  # DiffusionWorker.sleep(level=2), 0.24-0.28
        runner.graph_runners.clear()


def test_graph_runners_path_releases_every_callback_and_keeps_entries():
    own = {"existing": 1}
    runner, calls = SimpleNamespace(graph_runners=own), []
    first = patching.release_on_sleep(runner, lambda: calls.append("a"))
    patching.release_on_sleep(runner, lambda: calls.append("b"))
    assert runner.graph_runners == {"existing": 1} and first.lost() is None
    _sleep_024(runner)
    assert calls == ["a", "b"] and runner.graph_runners == {}


def test_graph_runners_path_is_put_back_after_the_last_callback_goes():
    own = {"existing": 1}
    runner = SimpleNamespace(graph_runners=own)
    patches_a, patches_b = patching.Patches(), patching.Patches()
    patching.release_on_sleep(runner, lambda: None, patches_a)
    patching.release_on_sleep(runner, lambda: None, patches_b)
    runner.graph_runners["added"] = 2
    patches_a.undo()
    assert isinstance(runner.graph_runners, patching.ReleaseOnSleep)  # b still needs it
    patches_b.undo()
    assert runner.graph_runners is own and own == {"existing": 1, "added": 2}
    bare = SimpleNamespace()
    patches = patching.Patches()
    patching.release_on_sleep(bare, lambda: None, patches)
    patches.undo()
    assert not hasattr(bare, "graph_runners")


def test_a_replaced_graph_runners_is_lost_with_its_reason():
    runner = SimpleNamespace()
    handle = patching.release_on_sleep(runner, lambda: None)
    assert patching.release_lost(runner) is None
    runner.graph_runners = {}  # someone's init code, after the plugin wired
    lost = patching.release_lost(runner)
    assert patching.SLEEP_UNREACHABLE.same(lost) and "graph_runners" in lost.detail
    assert patching.SLEEP_UNREACHABLE.same(handle.lost())


def test_an_unreachable_graph_runners_is_refused_before_wiring():
    assert patching.can_release_on_sleep(SimpleNamespace(graph_runners=[])) is not None
    assert patching.can_release_on_sleep(SimpleNamespace(graph_runners={})) is None
    assert patching.can_release_on_sleep(None) is None


# -- sleep release, vllm-omni 0.30: runner.release_captured_graphs() ----------------------------

@pytest.fixture
def runner_030():
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    if not callable(getattr(DiffusionModelRunner, "release_captured_graphs", None)):
        pytest.skip("this vllm-omni's runner has no release_captured_graphs (0.24-0.28)")
    runner = object.__new__(DiffusionModelRunner)  # the real class, without its GPU constructor
    calls = []
    runner.pipeline = SimpleNamespace(release_captured_graphs=lambda: calls.append("pipeline"))
    return runner, calls


def test_release_captured_graphs_path_runs_callbacks_then_the_runners_own(runner_030):
    runner, calls = runner_030
    patches = patching.Patches()
    handle = patching.release_on_sleep(runner, lambda: calls.append("hook"), patches)
    assert not hasattr(runner, "graph_runners")  # 0.30 is not reached through the dict
    runner.release_captured_graphs()  # what DiffusionWorker.sleep(level=2) calls on 0.30
    assert calls == ["hook", "pipeline"] and handle.lost() is None
    patches.undo()
    assert "release_captured_graphs" not in vars(runner)
    runner.release_captured_graphs()
    assert calls == ["hook", "pipeline", "pipeline"]


def test_a_wrapper_stacked_on_the_method_still_reaches_the_callbacks(runner_030):
    runner, calls = runner_030
    patching.release_on_sleep(runner, lambda: calls.append("hook"))
    ours = runner.release_captured_graphs

    @functools.wraps(ours)
    def profiled():
        calls.append("profiler")
        return ours()

    runner.release_captured_graphs = profiled
    assert patching.release_lost(runner) is None
    runner.release_captured_graphs = lambda: None  # replaced outright: sleep skips the plugin
    assert patching.SLEEP_UNREACHABLE.same(patching.release_lost(runner))


def test_a_removed_callback_is_lost_for_that_callback_only(runner_030):
    runner, _ = runner_030
    keep, drop = (lambda: None), (lambda: None)
    patching.release_on_sleep(runner, keep)
    handle = patching.release_on_sleep(runner, drop)
    handle.remove()
    assert patching.release_lost(runner, keep) is None
    assert patching.SLEEP_UNREACHABLE.same(patching.release_lost(runner, drop))
