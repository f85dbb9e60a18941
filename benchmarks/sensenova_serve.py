"""SenseNova-U1 under load over HTTP: ``vllm serve MODEL --omni`` as users start it, N requests
sent at once with the ``openai`` client, the release one at a time against the plugin's batch
(issue #22: "one run over HTTP at N = 8 on the real shape").

    python3 benchmarks/sensenova_serve.py --out DIR [--sides release,plugin,step] [--n 8]
                                          [--checkpoint DIR] [--tiny] [--plugin-env VAR=VALUE]

``sensenova_batch.py`` calls ``forward`` as vLLM-Omni's runner does; this starts the server
(``tests/e2e_serve.py --scenario sensenova_load``, one server per side, one after the other on
the same GPU), so the figures include the API server, the engine's scheduler, the request queue,
the image's PNG round trip and when requests happen to arrive.

- ``release``: ``VLLM_OMNI_GRAPHDECODE=0``, the server's defaults: ``--max-num-seqs 1`` (the
  release refuses more for this pipeline), so the N requests queue and run one after another
  (vllm-omni 0.30: its in-tree paged decode).
- ``plugin``: ``VLLM_OMNI_GRAPHDECODE=1``, otherwise defaults, and ``--max-num-seqs N``: the
  plugin declares request batching and the requests the engine hands one ``forward`` decode as
  rows of its batched step; its counters (``VLLM_OMNI_GRAPHDECODE_STATS_FILE``) say how the
  engine grouped them. The engine starts a forward as soon as one request waits, so requests
  sent together but arriving a few milliseconds apart split into a forward of the first alone
  and one of the rest, unless ``--batch-wait-ms`` passes vLLM-Omni's own
  ``--request-batch-max-wait-ms`` (it holds the first request until the queue stops growing or
  the wait ends).
- ``step`` (only when named): ``VLLM_OMNI_GRAPHDECODE=1``, ``--step-execution --max-num-seqs
  16`` (N, if larger): the plugin's continuous batching (issue #41), the N requests joining the
  running batch as they arrive; its rows are named ``..._step`` and compared with the release.

``--plugin-env VAR=VALUE`` (repeated) gives the plugin's servers a setting, e.g. the batched
step's ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP=rowgemv``; each row names them (``plugin_env``). With
``--release-from`` and another ``--out``, one release run serves as the baseline of several.

Each server first answers one warm-up request of each kind (untimed: first-call compiles and
captures), then N text answers at once (``--text-prompt-chars``-byte prompts, ``--text-tokens``
greedy tokens) and N think text-to-image requests at once (``--size``, ``--steps``, the
pipeline's CFG 4 and 1,024 think tokens). ``eager_ms``: the release's wall time from the first
send to the last answer; ``ours_ms``: the plugin's; p50/p99 of the requests' latencies as the
client saw them. Both sides may run in one call or in two (``--sides``): each side's record is kept
in ``sensenova-serve.json`` and the rows are rebuilt from whatever both sides have.

The checkpoint (``--checkpoint``, written there unless it is already complete): the released
shape (``sensenova_request.real_config``: 42 layers, hidden 4096, vocabulary 151,936; ~17.5 B
parameters, ~35 GB) with random bf16 weights drawn on the GPU and the tiny checkpoints' byte-level
tokenizer (one token a byte), the end tokens' ``lm_head`` rows zero so that every think runs
1,024 tokens and every text answer to its limit. ``--tiny``: the tiny checkpoint's shape.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

DRIVER = os.path.join(ROOT, "tests", "e2e_serve.py")
SIDES = ("release", "plugin", "step")
SILENT = ("<|im_end|>", "</think>")  # the think loop's and the answer's stops
SHARD_BYTES = 4 << 30
MODEL_ARGS = ["--model-class-name", "SenseNovaU1Pipeline"]
STEP_MAX_NUM_SEQS = 16
# Set by this benchmark for each side; --plugin-env may not name them.
PLUGIN_ENV_FIXED = ("VLLM_OMNI_GRAPHDECODE_STATS_FILE",)


def step_args(requests: int = 0) -> tuple[str, ...]:
    """The plugin's continuous batching as users start it, room for at least ``requests`` at once
    (this file's step side; the load benchmark's step sides take ``STEP_ARGS``)."""
    return ("--step-execution", "--max-num-seqs", str(max(STEP_MAX_NUM_SEQS, requests)))


STEP_ARGS = step_args()


def log(msg):
    print(f"[sensenova-serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_checkpoint(path: str, *, tiny: bool, device: str, seed: int = 0) -> dict:
    """The serving checkpoint (module docstring), written into ``PATH.partial`` and renamed to
    ``path`` when complete; kept when ``path`` already exists."""
    import sensenova_request as sr  # and through it examples/make_tiny_checkpoints.py
    import torch

    if os.path.exists(os.path.join(path, "config.json")):
        return {"path": path, "written": False}
    cfg = None if tiny else sr.real_config()  # None: the tiny checkpoint's own
    started = time.perf_counter()
    partial = path + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # an earlier run cut short
    info = sr.tiny.write_sensenova_u1(partial, seed=seed, cfg=cfg, device=device,
                                      shard_bytes=SHARD_BYTES, silent_tokens=SILENT)
    os.replace(partial, path)  # only a complete checkpoint ever has this name
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"path": path, "written": True, "num_params": info["num_params"],
            "num_tensors": info["num_tensors"], "seconds": round(time.perf_counter() - started, 1)}


def run_side(side: str, args, checkpoint: str) -> dict:
    """One server, the load scenario against it; the driver's ``result.json`` and timings."""
    out = os.path.join(args.out, side)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_OMNI_GRAPHDECODE") and k != "VLLM_PLUGINS"}
    env["PYTHONUNBUFFERED"] = "1"
    serve_args = list(MODEL_ARGS)
    env["VLLM_OMNI_GRAPHDECODE"] = "0" if side == "release" else "1"
    if side != "release":
        env["VLLM_OMNI_GRAPHDECODE_STATS_FILE"] = os.path.join(out, "stats-{pid}.json")
        env.update(plugin_env(args.plugin_env))
    if side == "plugin":
        serve_args += ["--max-num-seqs", str(args.n)]
        if args.batch_wait_ms:
            serve_args += ["--request-batch-max-wait-ms", str(args.batch_wait_ms)]
    elif side == "step":
        serve_args += step_args(args.n)
    cmd = [sys.executable, DRIVER, "--scenario", "sensenova_load", "--model", checkpoint,
           "--out", out, "--concurrent", str(args.n), "--image-size", str(args.size),
           "--sensenova-steps", str(args.steps), "--text-tokens", str(args.text_tokens),
           "--text-prompt-chars", str(args.text_prompt_chars),
           "--init-timeout", str(args.init_timeout), "--request-timeout",
           str(args.request_timeout)] + [f"--serve-arg={a}" for a in serve_args]
    rc, took, result = run_driver(cmd, env, out, side)
    return {"rc": rc, "seconds": took, "env": {k: v for k, v in env.items()
                                               if k.startswith("VLLM_OMNI_GRAPHDECODE")},
            "serve_args": serve_args, "result": result}


def plugin_env(pairs: list[str]) -> dict[str, str]:
    """``--plugin-env VAR=VALUE`` (repeated): the plugin's settings for its servers, e.g. the
    decode step ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP=rowgemv``; the release never takes them.
    Anything but ``VLLM_OMNI_GRAPHDECODE_*=VALUE`` is refused, naming it."""
    out = {}
    for pair in pairs:
        var, sep, value = pair.partition("=")
        if not sep or not var.startswith("VLLM_OMNI_GRAPHDECODE_") or var in PLUGIN_ENV_FIXED:
            raise ValueError(f"--plugin-env {pair!r}: expected VLLM_OMNI_GRAPHDECODE_NAME=VALUE, "
                             f"NAME not one this benchmark sets ({', '.join(PLUGIN_ENV_FIXED)})")
        out[var] = value
    return out


def run_driver(cmd: list[str], env: dict, out: str, label: str) -> tuple[int, float, dict | None]:
    """Run ``tests/e2e_serve.py`` (``cmd``) with its output in ``OUT/driver.log``: its exit code,
    seconds, and the ``result.json`` it wrote (None if none)."""
    log(f"{label}: {' '.join(cmd)}")
    started = time.perf_counter()
    with open(os.path.join(out, "driver.log"), "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                            check=False).returncode
    result = None
    path = os.path.join(out, "result.json")
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    took = round(time.perf_counter() - started, 1)
    log(f"{label}: driver exited {rc} after {took} s")
    return rc, took, result


BATCH_COUNTERS = ("batch_forward", "batch_requests", "batch_launch", "batch_rows",
                  "batch_row_join", "batch_eager_launch")
STEP_COUNTERS = ("step_tick", "step_request", "step_finished", "step_denoise_held",
                 "batch_launch", "batch_rows", "batch_eager_launch")
# The plugin's sides: (side, row-name suffix, the counters its rows keep).
PLUGIN_SIDES = (("plugin", "", BATCH_COUNTERS), ("step", "_step", STEP_COUNTERS))


def counters(side: dict | None, part: str = "counters") -> dict:
    """The plugin's ``counters`` (or ``fallbacks``) summed over the server's processes, from
    what each wrote at exit."""
    snaps = ((side or {}).get("result") or {}).get("final_stats") or []
    out: dict[str, int] = {}
    for snap in snaps:
        for key, value in (snap.get(part) or {}).items():
            if isinstance(value, int):
                out[key] = out.get(key, 0) + value
    return out


def _kind(side: dict | None, kind: str) -> dict | None:
    entry = (((side or {}).get("result") or {}).get("requests") or {}).get(kind)
    return entry if entry and "wall_s" in entry else None


def rows(sides: dict, args) -> list[dict]:
    """A row for each kind and plugin side (``plugin``: request mode; ``step``: its rows end in
    ``_step``) that it or the release answered (an errored kind has no wall time): wall times,
    their ratio where both sides have one, latency percentiles, the side's counters."""
    import common

    names = {f"sensenova_load_text_{args.n}": f"sensenova_serve_text_n{args.n}",
             f"sensenova_load_think_{args.n}":
                 f"sensenova_serve_think_t2i_{args.size}_n{args.n}"}
    out = []
    for side, suffix, kept in PLUGIN_SIDES:
        if side == "step" and side not in sides:
            continue  # named only: no release-only rows of its own
        for kind, case in names.items():
            release, plugin = _kind(sides.get("release"), kind), _kind(sides.get(side), kind)
            if release is None and plugin is None:
                continue
            row = common.case(case + suffix, release and 1000 * release["wall_s"],
                              plugin and 1000 * plugin["wall_s"], None, requests=args.n)
            for name, entry in (("eager", release), ("ours", plugin)):
                if entry is not None:
                    lat = common.percentiles([1000 * s for s in entry["latency_s"]])
                    row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = lat["p50"], lat["p99"]
                    row[f"{name}_errors"] = sum("error" in a for a in entry["answers"])
            row["plugin_serve_args"] = (sides.get(side) or {}).get("serve_args")
            row["plugin_env"] = {k: v for k, v in ((sides.get(side) or {}).get("env") or {}).items()
                                 if k not in ("VLLM_OMNI_GRAPHDECODE", *PLUGIN_ENV_FIXED)}
            plugin_counters = counters(sides.get(side))
            row["plugin_counters_whole_run"] = {k: v for k, v in plugin_counters.items()
                                                if k.rsplit(".", 1)[-1] in kept}
            row["plugin_fallbacks_whole_run"] = counters(sides.get(side), "fallbacks")
            out.append(row)
    return out

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sides", default="release,plugin",
                    help="which servers to run now, in order (release, plugin, step)")
    ap.add_argument("--n", type=int, default=8, help="requests sent at once, per kind")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--text-prompt-chars", type=int, default=500,
                    help="bytes of each text prompt (one token each; the template adds ~12)")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--checkpoint", default=None,
                    help="the serving checkpoint's folder (written there if not complete; "
                         "default: OUT/../sensenova-u1-serve-checkpoint)")
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint's shape")
    ap.add_argument("--device", default="cuda", help="where the checkpoint's weights are drawn")
    ap.add_argument("--batch-wait-ms", type=float, default=0.0,
                    help="the plugin's server: --request-batch-max-wait-ms (vLLM-Omni's own "
                         "admission wait for compatible requests before a forward; 0: not set)")
    ap.add_argument("--plugin-env", action="append", default=[], metavar="VAR=VALUE",
                    help="a plugin setting for the plugin's servers, e.g. "
                         "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP=rowgemv (repeat for more)")
    ap.add_argument("--release-from", default=None,
                    help="a sensenova-serve.json whose release side stands for this run's "
                         "(recorded as release_from) instead of running it here")
    ap.add_argument("--init-timeout", type=int, default=600)
    ap.add_argument("--request-timeout", type=int, default=900)
    args = ap.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        ap.error(f"--sides {args.sides}: unknown {unknown}; accepted: {', '.join(SIDES)}")
    if args.tiny and args.size % 16:
        ap.error(f"--size {args.size}: the tiny model needs a multiple of 16")
    try:
        plugin_env(args.plugin_env)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    checkpoint = args.checkpoint or os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                                 "sensenova-u1-serve-checkpoint")
    path = os.path.join(args.out, "sensenova-serve.json")
    record = {"environment": {}, "sides": {}, "cases": []}
    if os.path.exists(path):
        with open(path) as f:
            record = json.load(f)
    import common

    env = record["environment"]
    env.setdefault("commands", []).append(" ".join([os.path.basename(sys.executable)] + sys.argv))
    env["versions"] = common.versions()
    env["args"] = vars(args)
    env["checkpoint"] = write_checkpoint(checkpoint, tiny=args.tiny, device=args.device)
    log(f"checkpoint: {env['checkpoint']}")
    import torch

    if torch.cuda.is_available():
        env.update(common.gpu_info())

    def write():
        record["cases"] = rows(record["sides"], args)
        with open(path, "w") as f:
            json.dump(record, f, indent=2, default=str)

    if args.release_from:
        if "release" in sides:
            ap.error("--release-from and --sides release together: one release side")
        with open(args.release_from) as f:
            earlier = json.load(f)
        record["sides"]["release"] = earlier["sides"]["release"]
        env["release_from"] = {"file": args.release_from,
                               "commands": earlier["environment"].get("commands")}
    write()
    machine = common.machine(env)  # each side's own
    for side in sides:
        record["sides"][side] = run_side(side, args, checkpoint) | {"machine": machine}
        write()
    print(json.dumps(record["cases"], indent=2))
    return 0 if all(record["sides"][s]["rc"] == 0 for s in sides) else 1


if __name__ == "__main__":
    sys.exit(main())
