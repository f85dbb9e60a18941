"""``VLLM_OMNI_GRAPHDECODE_STATS_FILE``: the process that counts writes its stats where a test can
read them (the end-to-end engine test reads the diffusion worker's this way)."""

import json
import logging
import os
import subprocess
import sys
import time

from vllm_omni_graphdecode import cli, config
from vllm_omni_graphdecode.core import stats
from vllm_omni_graphdecode.core.reasons import Reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use(monkeypatch, value):
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE_STATS_FILE", value)
    config.reset_for_tests()
    stats.reset()


def test_stats_file_is_off_by_default(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_OMNI_GRAPHDECODE_STATS_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    stats.wired("graphdecode: test")
    stats.count("sensenova_u1", "replay")
    assert stats.dump_path() == ""
    assert list(tmp_path.iterdir()) == []
    assert config.parse({"VLLM_OMNI_GRAPHDECODE_STATS_FILE": "0"}).stats_file == ""


def test_wiring_and_fallbacks_are_written_at_once_with_pid_in_the_name(monkeypatch, tmp_path):
    _use(monkeypatch, str(tmp_path / "stats-{pid}.json"))
    path = tmp_path / f"stats-{os.getpid()}.json"
    stats.wired("graphdecode: sensenova_u1: wired for the test")
    data = json.loads(path.read_text())
    assert data["wired"] == ["graphdecode: sensenova_u1: wired for the test"]
    assert data["pid"] == os.getpid()
    stats.fallback("sensenova_u1", Reason("not CUDA", "run on a GPU").because("cpu"))
    assert json.loads(path.read_text())["fallbacks"] == {"sensenova_u1: not CUDA": 1}


def test_counts_are_written_at_most_once_per_interval(monkeypatch, tmp_path):
    monkeypatch.setattr(stats, "DUMP_INTERVAL_S", 60.0)  # no interval ends inside the test
    _use(monkeypatch, str(tmp_path / "stats.json"))
    path = tmp_path / "stats.json"
    stats.count("sensenova_u1", "replay")  # the first count writes
    assert json.loads(path.read_text())["counters"] == {"sensenova_u1.replay": 1}
    for _ in range(99):
        stats.count("sensenova_u1", "replay")
    assert json.loads(path.read_text())["counters"] == {"sensenova_u1.replay": 1}
    monkeypatch.setitem(stats._dump, "last", 0.0)  # as if the interval had passed
    stats.count("sensenova_u1", "replay")
    assert json.loads(path.read_text())["counters"] == {"sensenova_u1.replay": 101}


def test_the_last_counts_of_an_interval_are_written_when_it_ends(monkeypatch, tmp_path):
    # A process that goes on serving after its last event (vllm-omni 0.30's inline diffusion
    # stage) must not leave the file short of that last second's events until it exits.
    monkeypatch.setattr(stats, "DUMP_INTERVAL_S", 0.3)
    _use(monkeypatch, str(tmp_path / "stats.json"))
    path = tmp_path / "stats.json"
    for _ in range(10):
        stats.count("qwen_image_21", "replay")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if json.loads(path.read_text())["counters"] == {"qwen_image_21.replay": 10}:
            break
        time.sleep(0.05)
    assert json.loads(path.read_text())["counters"] == {"qwen_image_21.replay": 10}
    stats.reset()
    assert stats._dump["timer"] is None


def test_reset_cancels_a_pending_write(monkeypatch, tmp_path):
    monkeypatch.setattr(stats, "DUMP_INTERVAL_S", 60.0)
    _use(monkeypatch, str(tmp_path / "first.json"))
    stats.count("sensenova_u1", "replay")  # writes, and starts the interval
    stats.count("sensenova_u1", "replay")  # inside it: a write is scheduled for its end
    assert stats._dump["timer"] is not None
    stats.reset()  # another test (or bench case) takes over: the old write must not land
    assert stats._dump["timer"] is None
    assert json.loads((tmp_path / "first.json").read_text())["counters"] == {
        "sensenova_u1.replay": 1}


def test_no_thread_for_the_interval_writes_at_once_and_never_raises(monkeypatch, tmp_path):
    # Python 3.12 starts no thread from an atexit handler; a process can be at its thread limit.
    monkeypatch.setattr(stats, "DUMP_INTERVAL_S", 60.0)
    _use(monkeypatch, str(tmp_path / "stats.json"))

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(stats.threading.Timer, "start", refuse)
    stats.count("sensenova_u1", "replay")  # writes, and starts the interval
    stats.count("sensenova_u1", "replay")  # inside it: no timer, so written now
    assert json.loads((tmp_path / "stats.json").read_text())["counters"] == {
        "sensenova_u1.replay": 2}
    assert stats._dump["timer"] is None


def test_a_forked_child_writes_its_own_file(monkeypatch, tmp_path):
    monkeypatch.setattr(stats, "DUMP_INTERVAL_S", 60.0)
    _use(monkeypatch, str(tmp_path / "stats-{pid}.json"))
    stats.count("qwen_image_21", "replay")  # the parent's file, and a pending trailing write
    stats.count("qwen_image_21", "replay")
    pid = os.fork()
    if pid == 0:  # the child: count, write its final snapshot, leave without pytest's teardown
        code = 1
        try:
            stats.count("sensenova_u1", "replay")
            stats._final_write()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    child = json.loads((tmp_path / f"stats-{pid}.json").read_text())
    assert child["pid"] == pid
    assert child["counters"]["sensenova_u1.replay"] == 1
    parent = json.loads((tmp_path / f"stats-{os.getpid()}.json").read_text())
    assert "sensenova_u1.replay" not in parent["counters"]
    stats.reset()


def _count_in_a_multiprocessing_child(n):
    for _ in range(n):
        stats.count("sensenova_u1", "replay")


def test_a_multiprocessing_childs_last_interval_is_written_when_it_ends(monkeypatch, tmp_path):
    """A multiprocessing child ends with os._exit(): no atexit there, and the trailing write's
    daemon thread dies with it; its finalizers run _final_write."""
    import multiprocessing

    monkeypatch.setattr(stats, "DUMP_INTERVAL_S", 60.0)  # every count after the first waits
    _use(monkeypatch, str(tmp_path / "stats-{pid}.json"))
    child = multiprocessing.get_context("fork").Process(
        target=_count_in_a_multiprocessing_child, args=(100,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    data = json.loads((tmp_path / f"stats-{child.pid}.json").read_text())
    assert data["counters"] == {"sensenova_u1.replay": 100}
    stats.reset()


def test_a_trailing_write_from_before_a_reset_writes_nothing_after_it(monkeypatch, tmp_path):
    monkeypatch.setattr(stats, "DUMP_INTERVAL_S", 60.0)
    _use(monkeypatch, str(tmp_path / "first.json"))
    stats.count("sensenova_u1", "replay")
    before = stats._dump["generation"]
    _use(monkeypatch, str(tmp_path / "second.json"))  # reset(), and the next case's file
    stats.wired("graphdecode: the next case")
    stats._trailing_write(before)  # a timer of the old case that fired as reset() ran
    assert json.loads((tmp_path / "first.json").read_text())["counters"] == {
        "sensenova_u1.replay": 1}
    assert json.loads((tmp_path / "second.json").read_text())["wired"] == [
        "graphdecode: the next case"]
    assert stats.dump_path() == str(tmp_path / "second.json")
    stats.reset()


def test_counts_after_the_final_write_are_written_at_once(monkeypatch, tmp_path):
    # Exit handlers registered before the plugin's run after its final write.
    monkeypatch.setattr(stats, "DUMP_INTERVAL_S", 60.0)
    _use(monkeypatch, str(tmp_path / "stats.json"))
    stats.count("sensenova_u1", "replay")
    stats._final_write()
    stats.count("sensenova_u1", "replay")
    assert stats._dump["timer"] is None
    assert json.loads((tmp_path / "stats.json").read_text())["counters"] == {
        "sensenova_u1.replay": 2}
    stats.reset()
    assert not stats._dump["exiting"]


def test_final_counts_are_written_at_process_exit(tmp_path):
    template = str(tmp_path / "stats-{pid}.json")
    code = ("from vllm_omni_graphdecode.core import stats\n"
            "for _ in range(500): stats.count('qwen_image_21', 'replay')\n"
            "import os; print(os.getpid())\n")
    env = dict(os.environ, VLLM_OMNI_GRAPHDECODE_STATS_FILE=template,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    pid = int(out.stdout.split()[-1])
    data = json.loads((tmp_path / f"stats-{pid}.json").read_text())
    assert data["counters"] == {"qwen_image_21.replay": 500}
    assert not list(tmp_path.glob("*.tmp"))


def test_unwritable_stats_file_warns_once_and_never_raises(monkeypatch, tmp_path):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    stats.logger.addHandler(handler)  # vllm's "vllm" logger does not propagate to pytest's
    try:
        _use(monkeypatch, str(tmp_path / "missing-dir" / "stats.json"))
        stats.count("sensenova_u1", "replay")
        stats.wired("graphdecode: x")
    finally:
        stats.logger.removeHandler(handler)
    assert stats.dump_path() == ""
    assert sum("cannot write VLLM_OMNI_GRAPHDECODE_STATS_FILE" in r.getMessage()
               for r in records) == 1


def test_stats_command_prints_one_table_across_worker_processes(tmp_path, capsys):
    """What an operator runs on the files the workers wrote: every process's wiring, counters,
    fallbacks and degraded paths, by pid."""
    (tmp_path / "stats-11.json").write_text(json.dumps({
        "pid": 11, "wired": ["graphdecode: sensenova_u1: wired"],
        "counters": {"sensenova_u1.replay": 1056}, "fallbacks": {"sensenova_u1: not CUDA": 2},
        "degraded": {"sensenova_u1: decode step unfused": 1}}))
    (tmp_path / "stats-12.json").write_text(json.dumps({
        "pid": 12, "wired": [], "counters": {"qwen_image_21.replay": 3}, "fallbacks": {}}))
    assert cli.main(["stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["pid", "kind", "what", "count"]
    rows = [line.split(None, 2) for line in out[1:]]
    assert ["11", "wired", "graphdecode: sensenova_u1: wired"] in rows
    assert any(r[:2] == ["11", "counters"] and r[2].split()[-1] == "1056" for r in rows)
    assert any(r[:2] == ["11", "fallbacks"] and "not CUDA" in r[2] for r in rows)
    assert any(r[:2] == ["11", "degraded"] and "unfused" in r[2] for r in rows)
    assert any(r[:2] == ["12", "counters"] and r[2].split() == ["qwen_image_21.replay", "3"]
               for r in rows)


def test_stats_command_says_when_nothing_is_there(tmp_path, capsys):
    assert cli.main(["stats", str(tmp_path)]) == 1
    assert "no snapshot found" in capsys.readouterr().out
