"""scripts/gpu/run.py, the GPU host's runner for one device call, on CPU: steps take the stack named
before them, a bad command line is refused saying what is accepted, each step runs under its limit
and is killed whole at it, what a step left running in a session of its own is killed after it
(and nothing else), everything comes back as two files in $OUT, a step the call has no time left
for is skipped and listed, and FA2's warm-up starts once per machine for the 0.30 stack (again
after it failed)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "scripts", "gpu", "run.py")
sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))

import run as runner  # noqa: E402

NO_SETUP = {"GRAPHDECODE_SETUP": "0"}  # the project's metadata install, proven once below


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _call(tmp_path, *args, env=None):
    """run.py as the device call runs it: OUT set, the bundle sites where no bundle is."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GRAPHDECODE_RUNS": str(tmp_path / "runs"),
           "GRAPHDECODE_SITE": str(tmp_path / "site"), "PYTHON": sys.executable,
           "GRAPHDECODE_SITE_PROJECT": str(tmp_path / "site-project"), **(env or {})}
    return subprocess.run([sys.executable, RUNNER, *args], env=env, capture_output=True,
                          text=True, timeout=300)


def _summary(tmp_path, name):
    return (tmp_path / "out" / f"summary-{name}.txt").read_text()


def test_steps_take_the_stack_named_before_them_and_their_own_variables():
    opts, steps, last = runner.parse_args([
        "--name", "s1", "--call-s", "500",
        "tests 230 decode tests/test_sensenova_gpu.py tests/test_x.py -q -k 'a or b'",
        "--stack", "0.30", "--torch", "2.13",
        'GRAPHDECODE_E2E_TIMEOUT=150 bench 120 d2048 --cases sensenova_decode '
        '--tokens-per-launch "" --contexts 2048',
        "--torch", "host", "py 60 req benchmarks/sensenova_request.py --think off"])
    assert opts == {"name": "s1", "call_s": 500} and last == ("0.30", "host")
    got = [(s.kind, s.limit, s.label, s.args, s.env, s.stack, s.torch) for s in steps]
    assert got == [
        ("tests", 230, "decode", ["tests/test_sensenova_gpu.py", "tests/test_x.py", "-q", "-k",
                                  "a or b"], {}, "0.26", "host"),
        ("bench", 120, "d2048", ["--cases", "sensenova_decode", "--tokens-per-launch", "",
                                 "--contexts", "2048"], {"GRAPHDECODE_E2E_TIMEOUT": "150"},
         "0.30", "2.13"),
        ("py", 60, "req", ["benchmarks/sensenova_request.py", "--think", "off"], {}, "0.30",
         "host")]
    run = runner.Run({"name": "x", "call_s": 1}, "")
    cmd, extra = run.command(steps[0], "/r/decode")
    assert cmd == ["bash", runner.SUITE, "tests", "/r/decode", "--", "-q", "-k", "a or b"]
    assert extra["GRAPHDECODE_TESTS"] == "tests/test_sensenova_gpu.py tests/test_x.py"
    assert extra["GRAPHDECODE_E2E_OUT"] == "/r/decode/e2e" and extra["STACK"] == ""
    cmd, _ = run.command(steps[1], "/r/d2048")
    assert cmd[1:4] == [os.path.join(ROOT, "benchmarks", "bench.py"), "--out", "/r/d2048"]


@pytest.mark.parametrize("argv, accepted", [
    (["--stack", "0.28"], "--stack '0.28': accepted: 0.26, 0.30"),
    (["--torch", "2.13"], "--torch 2.13 goes with --stack 0.30"),
    (["--stack", "0.30", "--torch", "2.11"], "--torch '2.11': accepted: host, 2.13"),
    (["serve 60 x vllm serve"], "KIND one of tests, bench, py, cmd"),
    (["bench 1m x --cases memory"], "limit '1m': accepted: a positive number of seconds"),
    (["tests 60 x -q"], "tests needs test paths before the pytest arguments"),
    (["cmd 60 a true", "cmd 60 a false"], "a different label for each step"),
    (["cmd 60 ../up true"], "label '../up': accepted: a folder name"),
])
def test_a_bad_command_line_is_refused_saying_what_is_accepted(argv, accepted, capsys):
    assert runner.main(argv) == 2
    assert accepted in capsys.readouterr().err


def test_steps_run_under_their_limits_and_come_back_as_two_files(tmp_path):
    # Not started by the runner: must survive its clean-up.
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        proc = _call(
            tmp_path, "--name", "t",
            'X=7 cmd 60 ok python3 -c "import os; '
            'print(os.environ[\'X\'], os.environ[\'PYTHONPATH\'])"',
            # A child in the step's own group: killed with it at the limit (the clean-up after
            # the step switched off, so that the limit's kill alone is what is checked).
            'GRAPHDECODE_REAP=0 cmd 3 slow python3 -c "import subprocess, sys, time; '
            'p = subprocess.Popen([\'sleep\', \'300\']); '
            'open(sys.argv[1], \'w\').write(str(p.pid)); time.sleep(300)" {dir}/child.pid',
            # A child in a session of its own, left running as a cut server would be.
            'cmd 60 detached python3 -c "import subprocess, sys; '
            'p = subprocess.Popen([\'sleep\', \'300\'], start_new_session=True); '
            'open(sys.argv[1], \'w\').write(str(p.pid))" {dir}/child.pid')
        assert proc.returncode == 1, proc.stderr  # the slow step failed
        assert sorted(os.listdir(tmp_path / "out")) == ["results-t.tgz", "summary-t.txt"]
        summary = _summary(tmp_path, "t")
        assert "ok: exit 0" in summary
        assert "slow: exit 124" in summary and "cut at its limit" in summary
        detached = next(line for line in summary.splitlines() if "detached:" in line)
        assert "exit 0" in detached and "leftover process group(s) killed" in detached
        runs = tmp_path / "runs" / "t"
        for label in ("slow", "detached"):
            child = int((runs / label / "child.pid").read_text())
            assert not _alive(child), label
        assert _alive(bystander.pid)
        out = (runs / "ok" / "log").read_text().split()
        assert out[0] == "7" and out[1].split(os.pathsep)[0] == ROOT  # the stack's PYTHONPATH
        with tarfile.open(tmp_path / "out" / "results-t.tgz") as tf:
            names = set(tf.getnames())
        assert {"t/summary.txt", "t/ok/log", "t/ok/command.txt", "t/slow/child.pid",
                "t/env-0.26.txt"} <= names
    finally:
        bystander.kill()
        bystander.wait()


def test_a_step_the_call_has_no_time_left_for_is_skipped_and_listed(tmp_path):
    proc = _call(tmp_path, "--name", "late", "--call-s", "0", "cmd 60 never true", env=NO_SETUP)
    assert proc.returncode == 1
    assert "never: skipped" in _summary(tmp_path, "late")
    assert not (tmp_path / "runs" / "late" / "never").exists()


def test_fa2_warms_once_per_machine_for_the_0_30_stack(tmp_path):
    (tmp_path / "site-omni-0.30.0").mkdir(parents=True)  # the 0.30 tree, unpacked
    env = {"GRAPHDECODE_FA2_WAIT_S": "1", **NO_SETUP}
    first = _call(tmp_path, "--name", "a", "--stack", "0.30", "cmd 60 one true", env=env)
    assert first.returncode == 0, first.stderr
    assert "FA2 warm-up started (0.30" in _summary(tmp_path, "a")
    assert (tmp_path / "runs" / "fa2-host.started").exists()
    done = tmp_path / "runs" / "fa2-host.done"
    for _ in range(2400):  # the warm-up fails here (no vLLM, ~16 s): wait, then say how it ended
        if done.exists():
            break
        time.sleep(0.1)
    done.write_text("0\n")  # it finished
    second = _call(tmp_path, "--name", "b", "--stack", "0.30", "cmd 60 two true", env=env)
    assert second.returncode == 0, second.stderr
    assert "FA2 warm-up started" not in _summary(tmp_path, "b")
    done.write_text("1\n")  # it failed, as it does while a bundle is still to come: again
    wait = f"while [ ! -e {done} ]; do sleep 0.2; done"  # the first step outlasts the warm-up,
    third = _call(tmp_path, "--name", "b2", "--stack", "0.30",  # which fails again here
                  f"cmd 240 two bash -c '{wait}'", "cmd 60 three true", env=env)
    assert third.returncode == 0, third.stderr
    assert "FA2 warm-up started (0.30" in _summary(tmp_path, "b2")
    assert _summary(tmp_path, "b2").count("FA2 warm-up started") == 1  # once a call, not a step
    _call(tmp_path, "--name", "c", "cmd 60 three true", env=NO_SETUP)  # 0.26: no FA2 at all
    assert "FA2" not in _summary(tmp_path, "c")
