"""Serving for real (issues #14 and #22): ``vllm serve MODEL --omni`` on loopback, talked to over
HTTP with the ``openai`` client, with the plugin off and on, on the tiny checkpoints of
``tests/test_e2e_engine_gpu.py`` (the same builder, the same tolerances and their reasons).

Both stacks: ``scripts/gpu/run_suite.sh tests DIR`` runs this file against vllm-omni 0.26,
``STACK=0.30 scripts/gpu/run_suite.sh tests DIR`` against vllm-omni 0.30 (the servers import
whatever the test's PYTHONPATH holds; ``OMNI_RELEASE`` is read from its metadata). Where the
releases differ, the test says so: on 0.30 SenseNova-U1 has its own paged decode, which the
plugin leaves in charge at ``--max-num-seqs 1`` (``VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE=defer``,
the default), so ``sensenova_on``'s replays are its image denoising's; above 1 the plugin's batched
decode serves every request on both releases.

``tests/e2e_serve.py`` runs one server per case, all started side by side:

    sensenova_off / sensenova_on   VLLM_OMNI_GRAPHDECODE=0 / 1; text, think image, 4 concurrent
                                   text requests, sleep level 1 and 2 (``--model-class-name
                                   SenseNovaU1Pipeline``: the tiny config says ``sensenova_u1``)
    qwen_off / qwen_on             =0 / =1 (fast mode); text-to-image, a two-reference edit
                                   (``/v1/images/edits`` and chat with two image parts), 8
                                   concurrent text-to-image requests, sleep level 1 and 2
    qwen_exact                     =1 with ``VLLM_OMNI_GRAPHDECODE_QWEN_MODE=exact``: t2i + edits,
                                   which must equal plugin-off's
    qwen_batch8                    =1 and ``--max-num-seqs 8``: vllm-omni 0.26 (and 0.30) refuses
                                   request batching for its diffusers adapter
                                   (``supports_request_batch = False``) before loading anything;
                                   if a release accepts it, the 8 concurrent requests run there
    sensenova_batch8_off           =0 with ``--max-num-seqs 8``: vllm-omni refuses request batching
                                   for SenseNova-U1 (its class does not declare it) before
                                   loading anything, "'SenseNovaU1Pipeline' does not support
                                   request-level batching"; the server must not start
    sensenova_step_off / _on       =0 / =1 with ``--step-execution --max-num-seqs 16`` (issue
                                   #41): off, vLLM-Omni's runner refuses at load; on, the
                                   ``sensenova_step`` scenario: ``sensenova_batch``'s, each
                                   answer as alone, then a client that hangs up mid-answer
    sensenova_batch8_on            =1 with ``--max-num-seqs 8`` (issue #22: the plugin declares
                                   request batching): the server starts; 4 text answers and 4
                                   think images (distinct prompts and seeds) sent at once, then
                                   the same 8 one at a time; each answer sent together must equal
                                   its serial answer exactly, and the worker's counters must show
                                   batched forwards and launches of several requests. Before
                                   vllm-omni 0.28 the plugin declares nothing (its executor can
                                   lose a batch's outputs) and the server must refuse, saying why
    qwen_cannot_wire               =1 with ``tests/e2e_shim_moved`` on PYTHONPATH, which gives one
                                   diffusers method the plugin checks another signature (the
                                   method still works): the plugin refuses to wire, the server
                                   serves eagerly, the image equals plugin-off's
    bad_variable                   VLLM_OMNI_GRAPHDECODE_QWEN_MODE=turbo: the server must not start

Qwen servers get ``--diffusers-call-kwargs '{"output_resolution": 32}'`` (condition images are
resized to that area; the default 1024 would make the tiny edit's prefix 1024x1024 per image).
Every server: ``DIFFUSION_ATTENTION_BACKEND=TORCH_SDPA`` and ``tests/e2e_shim`` first on
PYTHONPATH (two upstream problems of 0.26, identical with the plugin off and on; see
tests/test_e2e_engine_gpu.py).

Concurrency: a diffusion stage runs one request at a time unless its pipeline declares request
batching and the server runs ``--max-num-seqs`` above 1. Upstream, neither SenseNova-U1's nor the
diffusers adapter's pipeline declares it (0.26 and 0.30), and every server here but
``sensenova_batch8_on`` runs at the default of 1, so their concurrent requests queue in the engine;
each must still equal its own serial answer. At ``--max-num-seqs 8`` vLLM-Omni's scheduler hands one
``forward`` the waiting requests in arrival order while their sampling-parameter key (size, steps,
guidance, ...) matches the first's: text answers and think images never share a forward, text
answers batch among themselves, think images among themselves.

Sleep: vllm-omni's ``/v1/omni/sleep`` and ``/v1/omni/wakeup`` (vllm's own ``/sleep`` needs
VLLM_SERVER_DEV_MODE and calls ``sleep(level)`` positionally, which AsyncOmni reads as
``stage_ids``). Level 2 clears the runner's graphs (the plugin's are released there); 0.26 and
0.30 then refuse ``wake_up`` (``AsyncOmni.wake_up``: NotImplementedError, weights discarded at
level 2 cannot be reloaded yet; the endpoint answers 501) and the next request is refused (0.26:
the engine is asleep) or held (0.30: ``AsyncOmni.sleep`` closes admission and only a wake-up that
succeeds opens it; the driver gives it ``e2e_serve.HELD_S``), with the plugin off and on alike:
counted as vLLM-Omni's refusal, the wake-up's 501 naming it (``_refused_wakeup``), and skipped.
The servers run without ``--enable-sleep-mode``, so weights stay and the request after a level-1
sleep must equal the one before, graphs re-captured.

Data parallelism (two replicas) is not tested here (issue #43): vllm-omni 0.26 and 0.30 reject
``--data-parallel-size`` under ``--omni`` (replicas come from a per-stage ``num_replicas`` in a
deploy YAML or ``--omni-dp-size-local`` on headless stage processes) and this test runs on one GPU.

``GRAPHDECODE_SERVE_OUT`` (default: a temporary folder) receives each server's ``server.log``,
``result.json``, stats files and images, and ``summary.json`` (one entry per request kind);
``GRAPHDECODE_SERVE_TIMEOUT`` (default 300 s) bounds each server's start,
``GRAPHDECODE_SERVE_PARALLEL`` (default: all) how many run at once, ``GRAPHDECODE_SERVE_CASES``
(comma-separated case names, default all) which start: the tests of the others skip. On one H200 the whole file
took 3-5 minutes with eight servers (each server start is 30-60 s of imports, worker spawn and
CUDA init, longer when eight start together); the two batch cases start beside them, and
``sensenova_batch8_on``'s requests (8 at once, 8 in turn: four 32-token texts and four 32x32 think
images of 2 steps, 1,024 think tokens each) take seconds on the tiny checkpoint.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import test_e2e_engine_gpu as offline

pytestmark = pytest.mark.gpu

ROOT = offline.ROOT
DRIVER = os.path.join(ROOT, "tests", "e2e_serve.py")
MOVED_SHIM = os.path.join(ROOT, "tests", "e2e_shim_moved")
TEXT_TOKENS, THINK_PREFIX = offline.TEXT_TOKENS, offline.THINK_PREFIX
IMAGE_TOLERANCE, FAST_MIN_PSNR_DB = offline.IMAGE_TOLERANCE, offline.FAST_MIN_PSNR_DB
CONCURRENT = 8
QWEN_ARGS = ["--diffusion-load-format", "diffusers",
             "--diffusers-call-kwargs", json.dumps({"output_resolution": 32})]
SENSENOVA_ARGS = ["--model-class-name", "SenseNovaU1Pipeline"]
BATCH_ARGS = ["--max-num-seqs", str(CONCURRENT)]
STEP_ARGS = ["--step-execution", "--max-num-seqs", "16"]
BAD = ("VLLM_OMNI_GRAPHDECODE_QWEN_MODE", "turbo")
# name: (model, scenario, plugin env, extra serve args, extra PYTHONPATH entries)
CASES = {
    "sensenova_off": ("sensenova_u1", "sensenova", {"VLLM_OMNI_GRAPHDECODE": "0"}, SENSENOVA_ARGS, []),
    "sensenova_on": ("sensenova_u1", "sensenova", {"VLLM_OMNI_GRAPHDECODE": "1"}, SENSENOVA_ARGS, []),
    "qwen_off": ("qwen_image_21", "qwen", {"VLLM_OMNI_GRAPHDECODE": "0"}, QWEN_ARGS, []),
    "qwen_on": ("qwen_image_21", "qwen", {"VLLM_OMNI_GRAPHDECODE": "1"}, QWEN_ARGS, []),
    "qwen_exact": ("qwen_image_21", "qwen", {"VLLM_OMNI_GRAPHDECODE": "1",
                                             "VLLM_OMNI_GRAPHDECODE_QWEN_MODE": "exact"},
                   QWEN_ARGS, []),
    "qwen_batch8": ("qwen_image_21", "qwen", {"VLLM_OMNI_GRAPHDECODE": "1"},
                    QWEN_ARGS + BATCH_ARGS, []),
    "sensenova_batch8_off": ("sensenova_u1", "refusal", {"VLLM_OMNI_GRAPHDECODE": "0"},
                             SENSENOVA_ARGS + BATCH_ARGS, []),
    "sensenova_batch8_on": ("sensenova_u1", "sensenova_batch", {"VLLM_OMNI_GRAPHDECODE": "1"},
                            SENSENOVA_ARGS + BATCH_ARGS, []),
    "sensenova_step_off": ("sensenova_u1", "refusal", {"VLLM_OMNI_GRAPHDECODE": "0"},
                           SENSENOVA_ARGS + STEP_ARGS, []),
    "sensenova_step_on": ("sensenova_u1", "sensenova_step", {"VLLM_OMNI_GRAPHDECODE": "1"},
                          SENSENOVA_ARGS + STEP_ARGS, []),
    "qwen_cannot_wire": ("qwen_image_21", "qwen_t2i", {"VLLM_OMNI_GRAPHDECODE": "1"}, QWEN_ARGS,
                         [MOVED_SHIM]),
    "bad_variable": ("qwen_image_21", "refusal", {"VLLM_OMNI_GRAPHDECODE": "1", BAD[0]: BAD[1]},
                     QWEN_ARGS, []),
}
# What vllm-omni says when a pipeline cannot batch requests (diffusion_engine.py, 0.26 and 0.30:
# f"{od_config.model_class_name!r} does not support request-level batching. ...").
NO_REQUEST_BATCH = "does not support request-level batching"
MIXED = f"sensenova_mixed_{CONCURRENT}"  # e2e_serve.py's request kind of sensenova_batch8_on
# SenseNova-U1's counters of the batched path (hooks/sensenova_u1/batch.py,
# decode/batch/decoder.py).
BATCH_COUNTERS = ("batch_declared", "batch_forward", "batch_requests", "batch_launch",
                  "batch_rows", "batch_row_join", "batch_capture", "batch_eager_launch")


def _omni_release() -> tuple[int, ...]:
    """vllm-omni's (major, minor) on this PYTHONPATH, which the servers import too; () if none."""
    try:
        version = importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


OMNI_RELEASE = _omni_release()
# From 0.30 SenseNova-U1 ships its own paged decode, which the plugin defers to by default at
# --max-num-seqs 1 (hooks/sensenova_u1/wiring.py: "... which stays in charge").
IN_TREE_DECODE = OMNI_RELEASE >= (0, 30)
# Before 0.28 vllm-omni's executor can lose a request batch's outputs, so the plugin declares no
# request batching there (hooks/sensenova_u1/batch.py, ENGINE_LOSES_BATCHES): --max-num-seqs 8
# is refused with the plugin on too (seen on 0.26 before the plugin checked: two of four
# batched text answers never came back and failed after the engine's 30 s timeout).
BATCHING = OMNI_RELEASE >= (0, 28)
NOT_DECLARED = "request batching not declared: this vllm-omni loses batched outputs"
# vLLM-Omni's step execution (``--step-execution``) is in 0.28 and 0.30; its runner refuses a
# pipeline without the protocol at load (diffusion_model_runner.py, 0.28 and 0.30).
STEPS = OMNI_RELEASE >= (0, 28)
NO_STEP_PROTOCOL = "step_execution=True requires a pipeline implementing"


def _run_case(name: str, ckpts: dict[str, str], outdir: str, timeout: int) -> dict:
    model, scenario, plugin_env, serve_args, extra_path = CASES[name]
    case_dir = os.path.join(outdir, name)
    os.makedirs(case_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_OMNI_GRAPHDECODE") and k != "VLLM_PLUGINS"}
    path = [offline.SHIM, *extra_path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(plugin_env, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(path),
               DIFFUSION_ATTENTION_BACKEND="TORCH_SDPA",
               VLLM_OMNI_GRAPHDECODE_STATS_FILE=os.path.join(case_dir, "stats-{pid}.json"))
    cmd = [sys.executable, DRIVER, "--scenario", scenario, "--model", ckpts[model],
           "--out", case_dir, "--text-tokens", str(TEXT_TOKENS), "--concurrent", str(CONCURRENT),
           "--init-timeout", str(timeout)] + [f"--serve-arg={a}" for a in serve_args]
    start = time.monotonic()
    with open(os.path.join(case_dir, "driver.log"), "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              timeout=timeout + 600, check=False)
    result = None
    if os.path.exists(os.path.join(case_dir, "result.json")):
        with open(os.path.join(case_dir, "result.json")) as f:
            result = json.load(f)
    with open(os.path.join(case_dir, "server.log"), errors="replace") as f:
        log_text = f.read()
    return {"name": name, "rc": proc.returncode, "result": result, "dir": case_dir,
            "log": log_text, "log_path": os.path.join(case_dir, "server.log"),
            "seconds": round(time.monotonic() - start, 1)}


class _Runs(dict):
    """The servers' runs by case; a case that ``GRAPHDECODE_SERVE_CASES`` left out skips the
    tests that read it, naming the setting."""

    def __init__(self, done, only):
        super().__init__(done)
        self.only = only

    def __getitem__(self, name):
        if name not in self and name in CASES and self.only is not None:
            pytest.skip(f"server case {name} not started: GRAPHDECODE_SERVE_CASES="
                        f"{','.join(self.only)}")
        return super().__getitem__(name)


def _cases_asked() -> list[str] | None:
    """``GRAPHDECODE_SERVE_CASES`` (comma-separated case names; unset: every case): which
    servers the module starts, for a device call with room for a few."""
    value = os.environ.get("GRAPHDECODE_SERVE_CASES", "").strip()
    if not value:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"GRAPHDECODE_SERVE_CASES: {', '.join(unknown)} not accepted; "
                         f"accepted: {', '.join(CASES)}")
    return names


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    outdir = os.environ.get("GRAPHDECODE_SERVE_OUT") or str(tmp_path_factory.mktemp("e2e_serve"))
    os.makedirs(outdir, exist_ok=True)
    ckpts = offline._make_checkpoints(str(tmp_path_factory.mktemp("serve_checkpoints")))
    timeout = int(os.environ.get("GRAPHDECODE_SERVE_TIMEOUT", "300"))
    parallel = int(os.environ.get("GRAPHDECODE_SERVE_PARALLEL", str(len(CASES))))
    only = _cases_asked()
    done = {}
    try:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            futures = {n: pool.submit(_run_case, n, ckpts, outdir, timeout)
                       for n in (only or CASES)}
            for name, future in futures.items():
                try:
                    done[name] = future.result()
                except Exception as exc:  # noqa: BLE001 - a driver past its limit, say
                    done[name] = {"name": name, "rc": repr(exc), "result": None, "log": "",
                                  "log_path": "", "dir": os.path.join(outdir, name), "seconds": None}
    finally:
        summary = build_summary(done)
        with open(os.path.join(outdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
        print(f"\ne2e serve runs ({outdir}): "
              f"{ {n: (r['rc'], r['seconds']) for n, r in done.items()} }")
    return _Runs(done, only)


# ---------------------------------------------------------------------------------------------
# Comparisons (shared by the tests and the summary)
# ---------------------------------------------------------------------------------------------

def _entry(run, kind):
    result = (run or {}).get("result") or {}
    return (result.get("requests") or {}).get(kind)


def _load(run, record):
    import numpy as np

    return np.load(os.path.join(run["dir"], record["npy"]))


def images_match(run_a, rec_a, run_b, rec_b) -> tuple[bool, str]:
    """Equal within IMAGE_TOLERANCE (tests/test_e2e_engine_gpu.py says why)."""
    import numpy as np

    if rec_a["sha256"] == rec_b["sha256"]:
        return True, "identical"
    a, b = _load(run_a, rec_a), _load(run_b, rec_b)
    if a.shape != b.shape:
        return False, f"shapes {a.shape} vs {b.shape}"
    delta = np.abs(a.astype(np.int16) - b.astype(np.int16))
    frac = float((delta > 0).mean())
    ok = delta.max() <= IMAGE_TOLERANCE[0] and frac <= IMAGE_TOLERANCE[1]
    return ok, f"max |diff| {int(delta.max())}/255 on {frac:.2%} of values"


def psnr(run_a, rec_a, run_b, rec_b) -> float:
    import numpy as np

    a = _load(run_a, rec_a).astype(np.float64) / 255
    b = _load(run_b, rec_b).astype(np.float64) / 255
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else float(10 * np.log10(1 / mse))


def first_difference(a, b):
    return offline._first_difference(list(a), list(b))


def compare_think(off_run, on_run) -> dict:
    """Tokens first (one character per token: the checkpoint only emits printable ASCII), then
    the image when the think tokens agree in full: the image is denoised on their K/V."""
    off, on = _entry(off_run, "sensenova_think_image"), _entry(on_run, "sensenova_think_image")
    if not off or not on or "error" in off or "error" in on:
        return {"equal": False, "detail": "a think request failed"}
    if off.get("think_text") is None or on.get("think_text") is None:
        # The response carries no think text (``think_text`` is an extra output vllm-omni copies
        # from the pipeline's metadata): only the images can be compared, and must be equal.
        ok, detail = images_match(off_run, off["image"], on_run, on["image"])
        return {"equal": ok, "image": detail, "think_text": "not in the response"}
    diff = first_difference(off["think_text"], on["think_text"])
    out = {"think_tokens_off": len(off["think_text"]), "think_tokens_on": len(on["think_text"]),
           "first_difference": diff}
    if diff is None:
        ok, detail = images_match(off_run, off["image"], on_run, on["image"])
        out.update(equal=ok, image=detail)
    else:
        out.update(equal=diff >= THINK_PREFIX, image="not compared: think tokens part at "
                   f"{diff} (bf16 near-tie; must agree on the first {THINK_PREFIX})")
    return out


def _counters(run) -> dict:
    """The plugin's counters summed over the server's processes, as written at exit."""
    total: dict = {}
    for snap in ((run or {}).get("result") or {}).get("final_stats") or []:
        for key, value in (snap.get("counters") or {}).items():
            total[key] = total.get(key, 0) + value
        for key, value in (snap.get("fallbacks") or {}).items():
            total[f"fallback:{key}"] = total.get(f"fallback:{key}", 0) + value
    return total


def _stats_at(run, kind) -> dict:
    total: dict = {}
    for snap in (_entry(run, kind) or {}).get("stats") or []:
        for key, value in (snap.get("counters") or {}).items():
            total[key] = total.get(key, 0) + value
    return total


def _concurrent_equal(run, kind) -> tuple[bool | None, str]:
    entry = _entry(run, kind)
    if not entry or "error" in entry:
        return None, "not run" if not entry else entry["error"]
    if kind.startswith("sensenova"):
        bad = [i for i, (s, c) in enumerate(zip(entry["serial"], entry["concurrent"]))
               if s["text"] != c["text"]]
    else:
        bad = [i for i, (s, c) in enumerate(zip(entry["serial"], entry["concurrent"]))
               if not images_match(run, s["image"], run, c["image"])[0]]
    return not bad, f"{len(entry['serial'])} requests, differing: {bad}"


def mixed_equal(run, kind: str = MIXED) -> tuple[bool | None, dict | str]:
    """Each request of ``kind`` sent together equals the same request sent alone, exactly: the
    same text; the same think text and a bit-identical image (sha256 of the uint8 array;
    ``images_match`` says how far apart when not). None when the step did not run."""
    entry = _entry(run, kind)
    if not entry or "error" in entry:
        return None, "not run" if not entry else entry["error"]
    specs, serial, together = entry["requests"], entry["serial"], entry["concurrent"]
    if not len(specs) == len(serial) == len(together):
        return False, f"{len(specs)} requests, {len(serial)} serial, {len(together)} concurrent"
    differing = {}
    for i, (spec, alone, mixed) in enumerate(zip(specs, serial, together)):
        if spec["kind"] == "text":
            diff = first_difference(alone["text"], mixed["text"])
            if diff is not None:
                differing[i] = f"text parts at character {diff}"
        elif alone.get("think_text") != mixed.get("think_text"):
            diff = first_difference(alone["think_text"] or "", mixed["think_text"] or "")
            differing[i] = f"think text parts at token {diff}"
        elif alone["image"]["sha256"] != mixed["image"]["sha256"]:
            differing[i] = "image: " + images_match(run, alone["image"], run, mixed["image"])[1]
    kinds = [spec["kind"] for spec in specs]
    return not differing, {"requests": len(specs), "texts": kinds.count("text"),
                           "think_images": kinds.count("think_image"), "differing": differing}


def batch_evidence(run) -> dict:
    """SenseNova-U1's batched-path counters summed over the server's processes at exit (exact:
    each process writes at exit), and what they prove by counting:

    * ``batch_forward`` (batch.py): a ``forward`` served through the batched path, the
      ``turns`` group whose decode loops meet in one launch; ``batch_requests``: the requests
      of those forwards. ``batch_requests > batch_forward``: some forward was handed two or more.
    * ``batch_launch`` (decode/batch/decoder.py): one batched decode launch; ``batch_rows``: the
      rows decoded, summed over launches (no per-launch count is recorded). ``batch_rows >
      batch_launch``: some launch decoded two or more requests' rows together.
    """
    counters = _counters(run)
    found = {key: counters.get(f"sensenova_u1.{key}", 0) for key in BATCH_COUNTERS}
    return dict(found,
                several_requests_in_one_forward=found["batch_requests"] > found["batch_forward"],
                several_rows_in_one_launch=found["batch_rows"] > found["batch_launch"],
                fallbacks={k: v for k, v in counters.items() if k.startswith("fallback:")})


def build_summary(done: dict) -> dict:
    """summary.json: one entry per request kind (off vs on, concurrent vs serial, latencies,
    worker counters), every server's start and exit, and where its log is."""
    g = done.get
    requests = []

    def add(kind, on_case, off_case, equal, detail, concurrent=None, entry_kind=None):
        entry_kind = entry_kind or kind.removesuffix("_fast")
        on_e, off_e = _entry(g(on_case), entry_kind) or {}, _entry(g(off_case), entry_kind) or {}
        refusal = _vllm_omni_refusal(g(off_case), g(on_case), entry_kind)
        if refusal is not None:  # the same answer with the plugin on and off: vLLM-Omni's refusal
            equal, detail = True, {"refused_by_vllm_omni_with_plugin_off_and_on": refusal}
        requests.append({
            "kind": kind, "on": on_case, "off": off_case, "plugin_on_equals_off": equal,
            "compare": detail, "concurrent_equals_serial": concurrent,
            "latency_s_on": on_e.get("s", on_e.get("concurrent_wall_s")),
            "latency_s_off": off_e.get("s", off_e.get("concurrent_wall_s")),
            "serial_s_on": on_e.get("serial_s"), "serial_s_off": off_e.get("serial_s"),
            "worker_counters_on_after": _stats_at(g(on_case), kind),
            "errors": {c: e["error"] for c, e in ((on_case, on_e), (off_case, off_e))
                       if "error" in e}})

    safe = _safe(lambda: _text_equal(g("sensenova_off"), g("sensenova_on")))
    add("sensenova_text", "sensenova_on", "sensenova_off", *safe)
    think = _safe(lambda: (compare_think(g("sensenova_off"), g("sensenova_on")),))[0]
    add("sensenova_think_image", "sensenova_on", "sensenova_off",
        think.get("equal") if isinstance(think, dict) else False, think)
    conc = _safe(lambda: _concurrent_equal(g("sensenova_on"), "sensenova_concurrent"))
    add("sensenova_concurrent", "sensenova_on", "sensenova_off",
        *_safe(lambda: _texts_equal_across(g("sensenova_off"), g("sensenova_on"))),
        concurrent=conc[0])
    for kind in ("qwen_t2i", "qwen_edit", "qwen_edit_chat"):
        add(kind, "qwen_exact", "qwen_off", *_safe(lambda k=kind: _image_equal(
            g("qwen_off"), g("qwen_exact"), k)))
        add(kind + "_fast", "qwen_on", "qwen_off", *_safe(lambda k=kind: _image_psnr(
            g("qwen_off"), g("qwen_on"), k)))
    kind = f"qwen_concurrent_{CONCURRENT}"
    conc = _safe(lambda: _concurrent_equal(g("qwen_on"), kind))
    add(kind, "qwen_on", "qwen_off", *_safe(lambda: _concurrent_psnr(g("qwen_off"), g("qwen_on"),
                                                                     kind)), concurrent=conc[0])
    batch8 = (g("qwen_batch8") or {}).get("result") or {}
    add(kind + "_max_num_seqs_8", "qwen_batch8", "qwen_off", None,
        {"server_start": batch8.get("start"), "refused_by_vllm_omni":
         NO_REQUEST_BATCH in (g("qwen_batch8") or {}).get("log", "")},
        concurrent=_safe(lambda: _concurrent_equal(g("qwen_batch8"), kind))[0])
    batch_off = g("sensenova_batch8_off") or {}
    mixed = _safe(lambda: mixed_equal(g("sensenova_batch8_on")))
    add(MIXED, "sensenova_batch8_on", "sensenova_batch8_off", None,
        {"max_num_seqs": CONCURRENT,
         "plugin_off_server_start": (batch_off.get("result") or {}).get("start"),
         "refused_by_vllm_omni_with_plugin_off": NO_REQUEST_BATCH in batch_off.get("log", ""),
         "concurrent_vs_serial": mixed[1],
         "batch_counters_at_exit": batch_evidence(g("sensenova_batch8_on"))},
        concurrent=mixed[0])
    for model, on_case, off_case in (("sensenova", "sensenova_on", "sensenova_off"),
                                     ("qwen", "qwen_on", "qwen_off")):
        for level in (1, 2):
            add(f"{model}_sleep_level{level}", on_case, off_case,
                *_safe(lambda c=on_case, lv=level: _sleep_equal(g(c), lv)),
                entry_kind=f"sleep_level{level}")
    add("qwen_cannot_wire_t2i", "qwen_cannot_wire", "qwen_off",
        *_safe(lambda: _image_equal(g("qwen_off"), g("qwen_cannot_wire"), "qwen_t2i")),
        entry_kind="qwen_t2i")
    servers = {}
    for name, run in done.items():
        result = run.get("result") or {}
        servers[name] = {"driver_rc": run.get("rc"), "start": result.get("start"),
                         "start_s": result.get("start_s"), "total_s": result.get("total_s"),
                         "server_rc": result.get("rc"), "log": os.path.relpath(
                             run["log_path"], os.path.dirname(run["dir"])) if run.get("log_path")
                         else None, "worker_counters_at_exit": _counters(run),
                         "cmd": result.get("cmd"), "env": result.get("env")}
    return {"requests": requests, "servers": servers,
            "bad_variable": _bad_variable_lines(g("bad_variable")),
            "vllm_omni": ".".join(map(str, OMNI_RELEASE)) or None,
            "data_parallel": "not run: vllm-omni 0.26 and 0.30 reject --data-parallel-size under "
                             "--omni (replicas come from a deploy YAML's num_replicas or "
                             "headless --omni-dp-size-local) and this run has one GPU"}


def _safe(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the summary must be written whatever failed
        return False, f"could not compare: {type(exc).__name__}: {exc}"


def _text_equal(off_run, on_run):
    off, on = _entry(off_run, "sensenova_text"), _entry(on_run, "sensenova_text")
    diff = first_difference(off["text"][:TEXT_TOKENS], on["text"][:TEXT_TOKENS])
    return diff is None and len(off["text"]) > 0, {"first_difference": diff,
                                                   "off": off["text"], "on": on["text"]}


def _texts_equal_across(off_run, on_run):
    off = _entry(off_run, "sensenova_concurrent")["serial"]
    on = _entry(on_run, "sensenova_concurrent")["serial"]
    same = [a["text"] == b["text"] for a, b in zip(off, on)]
    return all(same), {"serial answers equal per prompt": same}


def _image_equal(off_run, on_run, kind):
    off, on = _entry(off_run, kind), _entry(on_run, kind)
    ok, detail = images_match(off_run, off["image"], on_run, on["image"])
    return ok, detail


def _image_psnr(off_run, on_run, kind):
    off, on = _entry(off_run, kind), _entry(on_run, kind)
    value = psnr(off_run, off["image"], on_run, on["image"])
    return value >= FAST_MIN_PSNR_DB, f"fast mode: PSNR {value:.1f} dB (>= {FAST_MIN_PSNR_DB})"


def _concurrent_psnr(off_run, on_run, kind):
    off, on = _entry(off_run, kind)["serial"], _entry(on_run, kind)["serial"]
    values = [psnr(off_run, a["image"], on_run, b["image"]) for a, b in zip(off, on)]
    return (min(values) >= FAST_MIN_PSNR_DB,
            f"fast mode: serial answers' PSNR vs plugin off, min {min(values):.1f} dB")


def _sleep_equal(run, level):
    """The request after sleep (and the wake-up attempt) equals the same request before it."""
    entry = _entry(run, f"sleep_level{level}")
    first = _entry(run, "sensenova_text") or _entry(run, "qwen_t2i")
    detail = {"sleep": entry["sleep"]["status"], "wakeup": entry["wakeup"]["status"],
              "wakeup_body": entry["wakeup"]["body"][:300]}
    if "text" in first:
        return entry.get("text") == first["text"], detail
    ok, how = images_match(run, first["image"], run, entry["image"])
    return ok, dict(detail, image=how)


def _bad_variable_lines(run) -> dict:
    result = (run or {}).get("result") or {}
    lines = [line for line in (run or {}).get("log", "").splitlines() if BAD[0] in line]
    return {"start": result.get("start"), "server_rc": result.get("rc"), "lines": lines[-3:]}


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def _tail(run, n=60) -> str:
    return f"{run['log_path']} (last lines):\n" + "\n".join(run["log"].splitlines()[-n:])


def _error_core(error: str) -> str:
    """An error's text without what differs between servers of one request (list orders, ids)."""
    return re.sub(r"\[[^\]]*\]|[0-9a-f]{8}-[0-9a-f-]{27}", "[]", error)[:240]


COUNTERPART = {"sensenova_on": "sensenova_off", "sensenova_off": "sensenova_on",
               "qwen_on": "qwen_off", "qwen_exact": "qwen_off", "qwen_off": "qwen_on",
               # plugin off, this server does not start: no request of it is a refusal to share
               "sensenova_batch8_on": "sensenova_batch8_off"}


def _vllm_omni_refusal(run_a, run_b, kind) -> str | None:
    """The error this vLLM-Omni gave ``kind`` on both servers, when it is the same one: a limit of
    the release (it refuses with the plugin off too), not something the plugin did. Or, for a
    request after a wake-up that vLLM-Omni refused (``_refused_wakeup``) on every server of the
    two that ran, that refusal."""
    a, b = (_entry(run, kind) or {} if run else {} for run in (run_a, run_b))
    if a.get("error") and b.get("error") and _error_core(a["error"]) == _error_core(b["error"]):
        return _error_core(a["error"])
    wakes = [_refused_wakeup(e) for e in (a, b) if e]
    if wakes and all(wakes):
        return wakes[0]
    return None


def _refused_wakeup(entry) -> str | None:
    """What vLLM-Omni said when it refused ``entry``'s wake-up (0.26 and 0.30 after level 2:
    ``AsyncOmni.wake_up`` raises NotImplementedError, the endpoint answers 501), when the request
    after it then failed: refused at once (0.26) or held past ``e2e_serve.HELD_S`` (0.30's
    admission stays closed until a wake-up succeeds). None otherwise."""
    wake = entry.get("wakeup") or {}
    if entry.get("error") and wake.get("status") == 501:
        held = entry.get("held_after_refused_wakeup")
        then = f"held {held} s" if held else _error_core(entry["error"])
        return (f"wake-up refused (501: {_error_core(wake.get('body', ''))[:120]}); the request "
                f"after it: {then}")
    return None


def _ok_unless_refused(off_run, on_run, kind):
    """Both answered (returns their entries), or pytest.skip when vLLM-Omni refused ``kind``
    alike with the plugin off and on (the reason is the refusal)."""
    refusal = _vllm_omni_refusal(off_run, on_run, kind)
    if refusal is not None:
        pytest.skip(f"vLLM-Omni refuses {kind} with the plugin off and on alike: {refusal}")
    return _ok(off_run, kind), _ok(on_run, kind)


def _ok(run, kind):
    entry = _entry(run, kind)
    result = run.get("result")
    assert result is not None, f"{run['name']}: the driver wrote no result. {_tail(run)}"
    assert result.get("start") == "ready", f"{run['name']}: server {result.get('start')}. {_tail(run)}"
    assert entry is not None, f"{run['name']}: no {kind}. {_tail(run)}"
    assert "error" not in entry, (f"{run['name']}: {kind} failed: {entry['error']}\n"
                                  f"{entry.get('traceback', '')}\n{_tail(run)}")
    return entry


SERVING = ("sensenova_off", "sensenova_on", "qwen_off", "qwen_on", "qwen_exact") + (
    ("sensenova_batch8_on",) if BATCHING else ())


@pytest.mark.parametrize("case", SERVING)
def test_server_answers_every_request_kind_over_http(runs, case):
    run = runs[case]
    assert run["result"] and run["result"].get("start") == "ready", _tail(run)
    other = runs.get(COUNTERPART[case])
    refused = 0
    for kind, entry in run["result"]["requests"].items():
        if "error" in entry and _vllm_omni_refusal(run, other, kind) is not None:
            refused += 1  # refused with the plugin off and on alike: vLLM-Omni's limit
            continue
        assert "error" not in entry, f"{case}: {kind}: {entry['error']}\n{entry.get('traceback')}"
    assert "error" not in run["result"], f"{case}: {run['result']['error']}. {_tail(run)}"
    # The driver exits 1 when any request failed: here only the refusals above may have.
    assert run["rc"] == (1 if refused else 0), f"{case}: driver exit {run['rc']}. {_tail(run)}"


def test_sensenova_text_over_http_equals_plugin_off(runs):
    _ok(runs["sensenova_off"], "sensenova_text"), _ok(runs["sensenova_on"], "sensenova_text")
    ok, detail = _text_equal(runs["sensenova_off"], runs["sensenova_on"])
    assert ok, detail


def test_sensenova_think_image_over_http_matches_plugin_off(runs):
    _ok(runs["sensenova_off"], "sensenova_think_image")
    _ok(runs["sensenova_on"], "sensenova_think_image")
    out = compare_think(runs["sensenova_off"], runs["sensenova_on"])
    print(f"think over http: {out}")
    assert out["equal"], out


@pytest.mark.parametrize("case", ["sensenova_off", "sensenova_on"])
def test_concurrent_sensenova_requests_complete_and_equal_their_serial_answers(runs, case):
    _ok(runs[case], "sensenova_concurrent")
    ok, detail = _concurrent_equal(runs[case], "sensenova_concurrent")
    assert ok, detail


@pytest.mark.parametrize("kind", ["qwen_t2i", "qwen_edit", "qwen_edit_chat"])
def test_qwen_exact_mode_over_http_equals_plugin_off(runs, kind):
    _ok_unless_refused(runs["qwen_off"], runs["qwen_exact"], kind)
    ok, detail = _image_equal(runs["qwen_off"], runs["qwen_exact"], kind)
    print(f"{kind} exact vs off: {detail}")
    assert ok, detail


@pytest.mark.parametrize("kind", ["qwen_t2i", "qwen_edit", "qwen_edit_chat"])
def test_qwen_fast_mode_over_http_is_within_its_psnr_of_plugin_off(runs, kind):
    _ok_unless_refused(runs["qwen_off"], runs["qwen_on"], kind)
    ok, detail = _image_psnr(runs["qwen_off"], runs["qwen_on"], kind)
    print(f"{kind}: {detail}")
    assert ok, detail


@pytest.mark.parametrize("case", ["qwen_off", "qwen_on"])
def test_eight_concurrent_qwen_requests_equal_their_serial_results(runs, case):
    kind = f"qwen_concurrent_{CONCURRENT}"
    _ok(runs[case], kind)
    ok, detail = _concurrent_equal(runs[case], kind)
    assert ok, detail


def test_max_num_seqs_8_serves_equal_results_or_is_refused_by_vllm_omni(runs):
    """The issue asks for ``--max-num-seqs 8``. vllm-omni refuses it for a pipeline without
    request batching, the diffusers adapter among them, before any model is loaded: then that
    refusal (upstream's, with the plugin on) is what this records; the 8 concurrent requests of
    ``qwen_on`` ran queued instead."""
    run = runs["qwen_batch8"]
    result = run["result"] or {}
    if result.get("start") != "ready":
        assert NO_REQUEST_BATCH in run["log"], f"qwen_batch8 did not start, and not for " \
                                               f"request batching. {_tail(run)}"
        print("qwen_batch8: refused by vllm-omni: the diffusers adapter cannot batch requests")
        return
    ok, detail = _concurrent_equal(run, f"qwen_concurrent_{CONCURRENT}")
    assert ok, detail


@pytest.mark.parametrize("case,model", [("sensenova_on", "sensenova_u1"),
                                        ("qwen_on", "qwen_image_21"),
                                        ("qwen_exact", "qwen_image_21")])
def test_worker_counters_show_graph_replays_over_http(runs, case, model):
    """On vllm-omni 0.30 SenseNova-U1's own paged decode stays in charge at ``--max-num-seqs 1``
    (``defer``, the default; the load line says so and "decode not wired"): there the replays
    are the image denoising's, ``sensenova_u1_image.replay``."""
    run = runs[case]
    counters = _counters(run)
    snaps = (run["result"] or {}).get("final_stats") or []
    deferred = model == "sensenova_u1" and IN_TREE_DECODE
    if deferred:
        def says(w):
            return "which stays in charge" in w and "nothing wired" not in w
        replays = f"{model}_image.replay"
    else:
        def says(w):
            return "not wired" not in w
        replays = f"{model}.replay"
    wired = [s for s in snaps if any(f"graphdecode: {model}: " in w and says(w)
                                     for w in s.get("wired", []))]
    assert wired, f"{case}: {model} not wired (vllm-omni {OMNI_RELEASE}): {snaps}"
    assert counters.get(replays, 0) > 0, f"{case}: no {replays}: {counters}"
    assert all(s["pid"] != run["result"]["client_pid"] for s in wired)
    print(f"{case}: {counters}")


def test_sensenova_max_num_seqs_8_with_plugin_off_is_refused_by_vllm_omni(runs):
    """Plugin off, SenseNova-U1's class declares no request batching: vllm-omni's engine refuses
    ``--max-num-seqs 8`` at start-up, naming the pipeline (0.26 and 0.30 alike)."""
    run = runs["sensenova_batch8_off"]
    result = run["result"] or {}
    assert result.get("start") == "exited", f"sensenova_batch8_off: server {result.get('start')}"
    assert result.get("rc") not in (0, None), result
    plain = re.sub(r"\x1b\[[0-9;]*m", "", run["log"])
    assert f"'SenseNovaU1Pipeline' {NO_REQUEST_BATCH}" in plain, _tail(run)


def test_sensenova_max_num_seqs_8_with_plugin_on_starts_with_batched_decode_wired(runs):
    """Plugin on: the class declares request batching where the engine starts, the server
    starts, and the worker wires the batched decode for ``--max-num-seqs 8`` (its load line).
    Before vllm-omni 0.28 (``BATCHING``) the plugin declares nothing, names why in the log, and
    the engine refuses as without the plugin."""
    run = runs["sensenova_batch8_on"]
    result = run["result"] or {}
    if not BATCHING:  # the plugin declares nothing here and says why; the engine refuses
        plain = re.sub(r"\x1b\[[0-9;]*m", "", run["log"])
        assert result.get("start") == "exited", f"sensenova_batch8_on: server {result.get('start')}"
        assert f"'SenseNovaU1Pipeline' {NO_REQUEST_BATCH}" in plain, _tail(run)
        assert NOT_DECLARED in plain, _tail(run)
        return
    assert result.get("start") == "ready", f"sensenova_batch8_on: server {result.get('start')}. " \
                                           f"{_tail(run)}"
    assert NO_REQUEST_BATCH not in run["log"], _tail(run)
    lines = [w for s in result.get("final_stats") or [] for w in s.get("wired", [])
             if "graphdecode: sensenova_u1: " in w]
    batched = f"batched decode of up to {CONCURRENT} requests"
    assert any(batched in w and f"{batched} refused" not in w for w in lines), lines
    assert batch_evidence(run)["batch_declared"] > 0, batch_evidence(run)


def test_mixed_sensenova_requests_sent_together_equal_their_serial_answers_exactly(runs):
    """``--max-num-seqs 8``, plugin on: 4 text answers and 4 think images sent at once, each equal
    to the same request sent alone afterwards: the same text, the same think text, a
    bit-identical image (issue #22: a request's answer does not depend on what decodes beside
    it; batch of one and batch of several run the same batched path). vLLM-Omni's scheduler
    batches only requests of one sampling-parameter key, so a text answer and a think image
    never share a forward; the texts batch among themselves, the images too."""
    if not BATCHING:
        pytest.skip(f"vllm-omni {OMNI_RELEASE}: no request batching declared ({NOT_DECLARED})")
    _ok(runs["sensenova_batch8_on"], MIXED)
    ok, detail = mixed_equal(runs["sensenova_batch8_on"])
    print(f"{MIXED}: {detail}")
    assert ok, detail
    assert detail["requests"] == CONCURRENT and detail["texts"] and detail["think_images"], detail


def test_worker_counters_show_batched_forwards_and_launches_of_several_requests(runs):
    """The batched path ran and really batched (``batch_evidence``: counters of
    hooks/sensenova_u1/batch.py and decode/batch/decoder.py): ``batch_forward`` and
    ``batch_launch`` > 0; ``batch_requests > batch_forward`` (a forward was handed several
    requests) and ``batch_rows > batch_launch`` (a launch decoded several rows:
    decode/batch/decoder.py records rows summed over launches, not per launch, so this is how "a
    launch of more than one row" shows).
    The first request to arrive may run alone; the ones queued behind it share a forward."""
    if not BATCHING:
        pytest.skip(f"vllm-omni {OMNI_RELEASE}: no request batching declared ({NOT_DECLARED})")
    run = runs["sensenova_batch8_on"]
    _ok(run, MIXED)
    evidence = batch_evidence(run)
    print(f"sensenova_batch8_on: {evidence}")
    assert evidence["batch_forward"] > 0 and evidence["batch_launch"] > 0, evidence
    assert evidence["several_requests_in_one_forward"], evidence
    assert evidence["several_rows_in_one_launch"], evidence
    launched = [s for s in run["result"]["final_stats"]
                if (s.get("counters") or {}).get("sensenova_u1.batch_launch")]
    assert all(s["pid"] != run["result"]["client_pid"] for s in launched), launched


def test_sensenova_step_execution_with_plugin_off_is_refused_at_load(runs):
    """Plugin off: SenseNova-U1 implements no step-execution protocol, and vLLM-Omni's runner
    refuses ``--step-execution`` at load (0.28 and 0.30)."""
    if not STEPS:
        pytest.skip(f"vllm-omni {OMNI_RELEASE}: no step execution")
    run = runs["sensenova_step_off"]
    result = run["result"] or {}
    assert result.get("start") == "exited", f"sensenova_step_off: server {result.get('start')}"
    assert NO_STEP_PROTOCOL in re.sub(r"\x1b\[[0-9;]*m", "", run["log"]), _tail(run)


def test_sensenova_step_execution_with_plugin_on_serves_mixed_requests_as_each_alone(runs):
    """Plugin on, ``--step-execution --max-num-seqs 16`` (issue #41): the server starts; 4 text
    answers and 4 think images sent at once each equal the same request sent alone afterwards,
    exactly; the worker ran ticks, and a launch decoded several requests' rows (text answers
    and think decode share launches in step mode)."""
    if not STEPS:
        pytest.skip(f"vllm-omni {OMNI_RELEASE}: no step execution")
    run = runs["sensenova_step_on"]
    result = run["result"] or {}
    assert result.get("start") == "ready", f"sensenova_step_on: server {result.get('start')}. " \
                                           f"{_tail(run)}"
    _ok(run, MIXED)
    ok, detail = mixed_equal(run)
    print(f"sensenova_step_on {MIXED}: {detail}")
    assert ok, detail
    counters = _counters(run)
    assert counters.get("sensenova_u1.step_tick", 0) > 0, counters
    assert counters.get("sensenova_u1.step_admission_widened", 0) > 0, counters
    evidence = batch_evidence(run)
    assert evidence["several_rows_in_one_launch"], evidence


def test_sensenova_step_execution_client_that_hangs_up_stops_its_request_and_the_next_answers(runs):
    """Plugin on, step execution (issue #41): a client gives up on a long text answer and closes
    its connection; the server aborts the request, the worker stops that request's member at its
    next step (``step_stopped``), and the next request answers exactly as the same prompt did
    in the mixed phase."""
    if not STEPS:
        pytest.skip(f"vllm-omni {OMNI_RELEASE}: no step execution")
    run = runs["sensenova_step_on"]
    entry = _ok(run, "sensenova_disconnect")
    assert entry["cut"], ("the long answer ended before the client gave up "
                          f"({entry.get('answered')}): nothing was aborted, so this run proves "
                          "nothing about a disconnect")
    mixed = _ok(run, MIXED)
    assert entry["after"]["text"] == mixed["serial"][0]["text"]
    counters = _counters(run)
    assert counters.get("sensenova_u1.step_stopped", 0) >= 1, counters


@pytest.mark.parametrize("case", ["sensenova_off", "qwen_off"])
def test_plugin_off_writes_no_counters(runs, case):
    assert (runs[case]["result"] or {}).get("final_stats") == [], runs[case]["result"]


@pytest.mark.parametrize("case", ["sensenova_on", "qwen_on", "sensenova_off", "qwen_off"])
@pytest.mark.parametrize("level", [1, 2])
def test_request_after_sleep_equals_the_one_before(runs, case, level):
    """Level 2 on vLLM-Omni 0.26 and 0.30: its wake-up is refused (NotImplementedError, 501) and
    the next request is refused with the plugin off as with it on; that is skipped with the
    refusal."""
    _ok_unless_refused(runs[COUNTERPART[case]], runs[case], f"sleep_level{level}")
    ok, detail = _sleep_equal(runs[case], level)
    print(f"{case} sleep level {level}: {detail}")
    assert detail["sleep"] == 200, detail
    assert ok, detail


def test_bad_plugin_variable_stops_the_server_naming_variable_value_and_accepted(runs):
    run = runs["bad_variable"]
    result = run["result"] or {}
    assert result.get("start") == "exited", f"bad_variable: server {result.get('start')}"
    assert result.get("rc") not in (0, None), result
    lines = _bad_variable_lines(run)["lines"]
    assert any(f"{BAD[0]}='{BAD[1]}'" in line and "fast" in line and "exact" in line
               for line in lines), _tail(run)


def test_plugin_that_cannot_wire_leaves_the_server_serving_eagerly(runs):
    run = runs["qwen_cannot_wire"]
    _ok(run, "qwen_t2i"), _ok(runs["qwen_off"], "qwen_t2i")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", run["log"])  # the worker's log lines are coloured
    lines = [line for line in plain.splitlines() if "] graphdecode: qwen_image_21: " in line]
    assert lines and all("not wired" in line for line in lines), _tail(run)
    counters = _counters(run)
    assert counters.get("qwen_image_21.replay", 0) == 0, counters
    ok, detail = _image_equal(runs["qwen_off"], run, "qwen_t2i")
    assert ok, detail
