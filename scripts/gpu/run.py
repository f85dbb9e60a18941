#!/usr/bin/env python3
"""One device call on the GPU host: unpack what came, pick the stack, run steps, pack results.

    python3 scripts/gpu/run.py [--name NAME] [--call-s S] [--stack 0.26|0.30] [--torch host|2.13]
                               [STEP ...]

A device call runs one command for at most 10 minutes and brings back at most 8 files from $OUT,
two folders deep. This runner fits a session's steps into that, in order:

1. every ``.gpu-bundle*`` folder the call carried is unpacked (``scripts/gpu/run_suite.sh``: each
   folder's unpack.py, idempotent; a folder carried by an earlier call on the same warm machine is
   already there, parts of an archive still waiting for a later folder are stashed), with the
   serving wheels and the plugin's entry-point metadata;
2. once a step needs the 0.30 stack, vLLM's FA2 is warmed (``scripts/gpu/warm_fa2.py``), once per
   machine and torch (again at the next call where it failed, as it does while a bundle folder is
   still to come), in a session of its own so that it outlives the call, and the step waits for
   it: FA2's first call compiles its PTX for about two minutes, and a test that pays that inside
   its own limit looks hung;
3. each STEP runs under its own limit, cut to what is left of the call (``--call-s``, default 570
   s), in its stack's environment and a process group of its own, killed whole at the limit; then
   whatever it started in sessions of their own (engine runners, servers) is killed too, found by
   the run's marker in their environment;
4. after every step what is done is packed into $OUT: ``results-NAME.tgz`` (every step's folder)
   and ``summary-NAME.txt`` (each step's exit status, seconds and limit): two files a name, so a
   call cut short still brings back every step that finished.

``--stack`` and ``--torch`` apply to the steps after them (one call can run both stacks); given
with no step after them they still name the stack to prepare (unpack, warm FA2): a call that only
carries another bundle folder.

STEP is one argument, split like a shell line: ``[VAR=VALUE ...] KIND LIMIT LABEL [ARGS ...]``,
VAR=VALUE setting environment variables for that step alone, ``{dir}`` in ARGS standing for the
step's folder (RUNS/NAME/LABEL):

    tests LIMIT LABEL PATH... [PYTEST ARGS]   GPU-marked tests (run_suite.sh tests); the engine and
                                              serving runs' logs go under LABEL/
    bench LIMIT LABEL ARGS...                 python3 benchmarks/bench.py --out {dir} ARGS
    py LIMIT LABEL SCRIPT ARGS...             python3 SCRIPT --out {dir} ARGS (sensenova_request.py,
                                              sensenova_batch.py, sensenova_serve.py, a probe)
    cmd LIMIT LABEL PROGRAM ARGS...           PROGRAM ARGS as given (no shell; bash -c '...' is one)

For example (scripts/gpu/README.md has more):

    python3 scripts/gpu/run.py --name decode --stack 0.30 --torch 2.13 \\
      'tests 230 decode tests/test_sensenova_gpu.py -q -rfE' \\
      'bench 200 decode-2048 --cases sensenova_decode --fa 3 --tokens-per-launch "" --contexts 2048'

Environment: OUT (where the two files go; the device tool sets it), GRAPHDECODE_RUNS (default
/tmp/graphdecode-runs), GRAPHDECODE_SETUP=0 (nothing to unpack or install: the stack and the
plugin are installed), GRAPHDECODE_FA2_WAIT_S (most a step waits for FA2, default 240; 0: no
wait), GRAPHDECODE_REAP=0 (leave what a step started running). Exits 0 when every step did.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITE = os.path.join(HERE, "scripts", "gpu", "run_suite.sh")
KINDS = ("tests", "bench", "py", "cmd")
STACKS = ("0.26", "0.30")
TORCHES = ("host", "2.13")
PACK_MARGIN_S = 10  # kept back from the call for packing the last step
MIN_STEP_S = 5
MARKER = "GRAPHDECODE_RUN_ID"


class Refused(ValueError):
    """A command line this runner does not accept; the message says what is accepted."""


def _read(path: str) -> str:
    """A marker file's text, stripped; "" where there is none."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


class Step:
    def __init__(self, kind, limit, label, args, env, stack, torch):
        self.kind, self.limit, self.label, self.args = kind, limit, label, args
        self.env, self.stack, self.torch = env, stack, torch

    def __repr__(self):
        return f"Step({self.kind} {self.limit} {self.label} {self.args} {self.env} " \
               f"{self.stack}/{self.torch})"


def parse_step(text: str, stack: str, torch: str) -> Step:
    words = shlex.split(text)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        var, value = words.pop(0).split("=", 1)
        env[var] = value
    if len(words) < 3 or words[0] not in KINDS:
        raise Refused(f"step {text!r}: accepted: [VAR=VALUE ...] KIND LIMIT LABEL [ARGS ...], "
                      f"KIND one of {', '.join(KINDS)}")
    kind, limit, label, args = words[0], words[1], words[2], words[3:]
    if not limit.isdigit() or int(limit) <= 0:
        raise Refused(f"step {text!r}: limit {limit!r}: accepted: a positive number of seconds")
    if not label or "/" in label or label.startswith("."):
        raise Refused(f"step {text!r}: label {label!r}: accepted: a folder name")
    if kind in ("py", "cmd") and not args:
        raise Refused(f"step {text!r}: {kind} needs what to run")
    if kind == "tests" and (not args or args[0].startswith("-")):
        raise Refused(f"step {text!r}: tests needs test paths before the pytest arguments")
    return Step(kind, int(limit), label, args, env, stack, torch)


def parse_args(argv):
    """(options, steps, the stack and torch named last): --stack/--torch apply to later steps."""
    opts = {"name": "run", "call_s": 570}
    steps, stack, torch = [], "0.26", "host"
    argv = list(argv)
    while argv:
        arg = argv.pop(0)
        if arg in ("--name", "--call-s", "--stack", "--torch"):
            if not argv:
                raise Refused(f"{arg} needs a value")
            value = argv.pop(0)
            if arg == "--name":
                if not value or "/" in value:
                    raise Refused(f"--name {value!r}: accepted: a file name")
                opts["name"] = value
            elif arg == "--call-s":
                if not value.isdigit():
                    raise Refused(f"--call-s {value!r}: accepted: seconds, a whole number")
                opts["call_s"] = int(value)
            elif arg == "--stack":
                if value not in STACKS:
                    raise Refused(f"--stack {value!r}: accepted: {', '.join(STACKS)}")
                stack = value
            else:
                if value not in TORCHES:
                    raise Refused(f"--torch {value!r}: accepted: {', '.join(TORCHES)}")
                torch = value
            if torch == "2.13" and stack != "0.30":
                raise Refused("--torch 2.13 goes with --stack 0.30 (the one 2.13 stack built)")
        elif arg in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        else:
            steps.append(parse_step(arg, stack, torch))
    labels = [s.label for s in steps]
    if len(set(labels)) != len(labels):
        raise Refused(f"labels {labels}: accepted: a different label for each step")
    return opts, steps, (stack, torch)


def _tag(stack, torch):
    return stack + ("-torch2.13" if torch == "2.13" else "")


class Run:
    def __init__(self, opts, out):
        self.name, self.out = opts["name"], out
        self.deadline = time.monotonic() + opts["call_s"]
        self.root = os.path.join(os.environ.get("GRAPHDECODE_RUNS", "/tmp/graphdecode-runs"),
                                 self.name)
        os.makedirs(self.root, exist_ok=True)
        self.summary = os.path.join(self.root, "summary.txt")
        self.marker = f"{self.name}-{os.getpid()}-{int(time.time())}"
        self.envs: dict = {}
        self.failed = False

    def left(self) -> float:
        return self.deadline - time.monotonic() - PACK_MARGIN_S

    def note(self, line: str) -> None:
        with open(self.summary, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        print(f"[run] {line}", flush=True)

    def env(self, stack, torch):
        """The stack's environment (run_suite.sh env), unpacking and installing on first use."""
        key = (stack, torch)
        if key not in self.envs:
            # Unpack and install once a call (GRAPHDECODE_SETUP=0 from the caller: never, for a
            # host with the stack installed).
            first = not self.envs and os.environ.get("GRAPHDECODE_SETUP", "1") != "0"
            env = dict(os.environ, GRAPHDECODE_SETUP="1" if first else "0")
            for var in ("STACK", "TORCH"):
                env.pop(var, None)
            if stack == "0.30":
                env["STACK"] = "0.30"
            if torch == "2.13":
                env["TORCH"] = "2.13"
            setup = os.path.join(self.root, "setup")
            proc = subprocess.run(["bash", SUITE, "env", setup], env=env, capture_output=True,
                                  timeout=max(self.left(), 30))
            if proc.returncode != 0:
                self.note(f"environment {_tag(stack, torch)}: exit {proc.returncode}: "
                          + proc.stderr.decode(errors="replace").strip()[-300:])
                self.envs[key] = None
            else:
                pairs = (kv.split("=", 1) for kv in proc.stdout.decode().split("\0") if "=" in kv)
                built = dict(pairs)
                built.pop("GRAPHDECODE_SETUP", None)
                self.envs[key] = built
                with open(os.path.join(self.root, f"env-{_tag(stack, torch)}.txt"), "w") as f:
                    for var in ("PYTHONPATH", "LD_PRELOAD", "VLLM_TARGET_DEVICE",
                                "CUDA_CACHE_MAXSIZE", "PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK"):
                        if var in built:
                            f.write(f"{var}={built[var]}\n")
        return self.envs[key]

    def fa2(self, stack, torch, wait: bool):
        """Start FA2's warm-up for this stack once per machine; with ``wait``, wait for it."""
        if stack != "0.30":
            return
        site = os.environ.get("GRAPHDECODE_SITE", "/tmp/site")
        torch_site = os.environ.get("GRAPHDECODE_TORCH_SITE", "/tmp/site-torch-2.13.0")
        torch_ready = os.path.exists(os.path.join(torch_site, ".bundle-state.json"))
        if not os.path.isdir(site + "-omni-0.30.0") or (torch == "2.13" and not torch_ready):
            return  # not all carried yet: a later call warms it
        env = self.env(stack, torch)
        if env is None:
            return
        base = os.path.join(os.path.dirname(self.root), f"fa2-{torch}")  # once per machine
        if _read(base + ".done") not in ("", "0") and _read(base + ".started") != self.marker:
            for end in (".started", ".done"):  # failed in an earlier call (a bundle was still
                with contextlib.suppress(FileNotFoundError):  # missing): once again in this one
                    os.remove(base + end)
        if not os.path.exists(base + ".started"):
            with open(base + ".started", "w") as f:
                f.write(self.marker)
            warm = os.path.join(HERE, "scripts", "gpu", "warm_fa2.py")
            script = (f"{shlex.quote(sys.executable)} {shlex.quote(warm)} >{base}.log 2>&1; "
                      f"echo $? >{base}.done")
            subprocess.Popen(["bash", "-c", script], env=env, cwd=HERE, start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            self.note(f"FA2 warm-up started ({_tag(stack, torch)}, {base}.log)")
        if not wait:
            return
        most = min(float(os.environ.get("GRAPHDECODE_FA2_WAIT_S", "240")), self.left() / 2)
        start = time.monotonic()
        while not os.path.exists(base + ".done") and time.monotonic() - start < most:
            time.sleep(1)
        if os.path.exists(base + ".done") and os.path.exists(base + ".log"):
            with open(base + ".log", "rb") as src, \
                    open(os.path.join(self.root, f"warm-fa2-{torch}.log"), "wb") as dst:
                dst.write(src.read())
        waited = time.monotonic() - start
        if waited >= 1:
            state = "done" if os.path.exists(base + ".done") else "not done, going on"
            self.note(f"waited {waited:.0f} s for FA2's warm-up: {state}")

    def command(self, step, folder):
        args = [a.replace("{dir}", folder) for a in step.args]
        if step.kind == "tests":
            paths = []
            while args and not args[0].startswith("-"):
                paths.append(args.pop(0))
            return ["bash", SUITE, "tests", folder, "--", *args], {
                "GRAPHDECODE_TESTS": " ".join(paths), "GRAPHDECODE_SETUP": "0",
                "GRAPHDECODE_E2E_OUT": os.path.join(folder, "e2e"),
                "GRAPHDECODE_SERVE_OUT": os.path.join(folder, "serve-out"),
                "STACK": "0.30" if step.stack == "0.30" else "",
                "TORCH": "2.13" if step.torch == "2.13" else ""}
        if step.kind == "bench":
            return [sys.executable, os.path.join(HERE, "benchmarks", "bench.py"), "--out", folder,
                    *args], {}
        if step.kind == "py":
            return [sys.executable, args[0], "--out", folder, *args[1:]], {}
        return args, {}

    def step(self, step) -> None:
        if self.left() < MIN_STEP_S:
            self.note(f"{step.label}: skipped, {max(self.left(), 0):.0f} s left of the call")
            self.failed = True
            return
        env = self.env(step.stack, step.torch)
        if env is None:
            self.note(f"{step.label}: skipped, no {_tag(step.stack, step.torch)} environment")
            self.failed = True
            return
        if step.env.get("GRAPHDECODE_FA2_WAIT_S", os.environ.get("GRAPHDECODE_FA2_WAIT_S")) != "0":
            self.fa2(step.stack, step.torch, wait=True)
            if self.left() < MIN_STEP_S:
                self.note(f"{step.label}: skipped after FA2's warm-up, no time left")
                self.failed = True
                return
        limit = min(step.limit, int(self.left()))
        folder = os.path.join(self.root, step.label)
        os.makedirs(folder, exist_ok=True)
        cmd, extra = self.command(step, folder)
        # run_suite.sh builds a tests step's stack environment itself, from the host's.
        env = {**(os.environ if step.kind == "tests" else env), **extra, **step.env}
        env[MARKER] = self.marker
        env = {k: v for k, v in env.items() if v != "" or k not in ("STACK", "TORCH")}
        with open(os.path.join(folder, "command.txt"), "w") as f:
            f.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
            for var, value in sorted({**extra, **step.env}.items()):
                f.write(f"{var}={value}\n")
        out_name = "stdout.json" if step.kind == "bench" else "stdout.txt"
        split = step.kind in ("bench", "py")
        start = time.monotonic()
        with open(os.path.join(folder, out_name if split else "log"), "wb") as out, \
                open(os.path.join(folder, "log"), "ab" if split else "wb") as err:
            try:
                proc = subprocess.Popen(cmd, env=env, cwd=HERE, stdout=out,
                                        stderr=err if split else subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                self.note(f"{step.label}: could not start: {e}")
                self.failed = True
                return
            try:
                rc = proc.wait(timeout=limit)
                how = ""
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()
                rc, how = 124, ", cut at its limit"
        if step.env.get("GRAPHDECODE_REAP", os.environ.get("GRAPHDECODE_REAP", "1")) != "0":
            reaped = reap(self.marker)
            if reaped:
                how += f", {reaped} leftover process group(s) killed"
        self.failed |= rc != 0
        self.note(f"{step.label}: exit {rc} ({time.monotonic() - start:.0f} s of {limit} s "
                  f"[{step.kind}, {_tag(step.stack, step.torch)}]{how})")

    def pack(self) -> None:
        if not self.out:
            return
        os.makedirs(self.out, exist_ok=True)
        target = os.path.join(self.out, f"results-{self.name}.tgz")
        with tarfile.open(target + ".tmp", "w:gz") as tf:
            tf.add(self.root, arcname=self.name)
        os.replace(target + ".tmp", target)
        with open(self.summary, "rb") as src, \
                open(os.path.join(self.out, f"summary-{self.name}.txt"), "wb") as dst:
            dst.write(src.read())
        files = [n for _, _, ns in os.walk(self.out) for n in ns]
        if len(files) > 8:
            print(f"[run] {len(files)} files under $OUT: the device brings back 8", file=sys.stderr)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def reap(marker: str) -> int:
    """Kill the process group of every process whose environment carries ``marker`` (what a
    step started, in any session), except this runner's own; returns how many groups."""
    mine = os.getpgrp()
    groups = set()
    needle = f"{MARKER}={marker}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            group = os.getpgid(int(pid))
        except (OSError, ProcessLookupError):
            continue
        if group != mine:
            groups.add(group)
    for group in groups:
        _kill_group(group)
    return len(groups)


def main(argv=None) -> int:
    try:
        opts, steps, (stack, torch) = parse_args(sys.argv[1:] if argv is None else argv)
    except Refused as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 2
    run = Run(opts, os.environ.get("OUT", ""))
    run.note(f"start ({len(steps)} step(s), {opts['call_s']} s for the call)")
    try:
        with open(os.path.join(run.root, "nvidia-smi.txt"), "wb") as f:
            subprocess.run(["nvidia-smi"], stdout=f, stderr=subprocess.STDOUT, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    # Unpack first, and start FA2's warm-up at once for every 0.30 stack this call names, so
    # that it overlaps the steps before the first one that needs it.
    wanted = list(dict.fromkeys([(s.stack, s.torch) for s in steps] + [(stack, torch)]))
    run.env(*wanted[0])
    for st, tc in wanted:
        run.fa2(st, tc, wait=False)
    run.pack()
    for step in steps:
        run.step(step)
        run.pack()
    run.note("done")
    run.pack()
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
