"""Start vLLM-Omni's OpenAI server (``vllm serve MODEL --omni``) on loopback, send it requests with
the ``openai`` client the way users do, and write what came back, for
``tests/test_e2e_serve_gpu.py`` to compare with the plugin off and on.

    python tests/e2e_serve.py --scenario sensenova --model DIR --out DIR/NAME [--env K=V ...]
                              [--serve-arg=--flag --serve-arg=value ...]

One server per run: ``python -m vllm.entrypoints.cli.main serve MODEL --omni --host 127.0.0.1
--port FREE ...`` (what the ``vllm`` console script runs; the offline bundle has no console
script), its output in ``OUT/server.log``, readiness by ``GET /health`` within ``--init-timeout``.
Scenarios (the request kinds the summary names):

* ``sensenova``: ``sensenova_text`` (``/v1/chat/completions``, ``modalities=["text"]``, greedy
  ``max_tokens``), ``sensenova_think_image`` (the same endpoint, ``modalities=["image"]``,
  ``think`` and the image size/steps/seed in the body: the model's documented request form),
  ``sensenova_concurrent`` (several text prompts sent together, each compared with its own serial
  answer), then the sleep phase.
* ``sensenova_batch``: ``sensenova_mixed_N`` (N = ``--concurrent``; a server started with
  ``--max-num-seqs N``): ceil(N/2) text answers of distinct prompts and N/2 think images of
  distinct prompts and seeds (``sensenova_mixed``), all sent at once, texts first, then the same
  N one at a time; both recorded, each image as ``.npy``. No sleep phase.
* ``sensenova_load``: what ``benchmarks/sensenova_serve.py`` times (no comparison of answers):
  one warm-up text answer and think image, then ``sensenova_load_text_N`` (N text answers of
  distinct ``--text-prompt-chars``-byte prompts, greedy ``max_tokens``) and
  ``sensenova_load_think_N`` (N think images of ``--image-size``, distinct prompts and seeds),
  each kind's N sent all at once; per request its latency, per kind the wall time from the first
  send to the last answer. Images as sha256 and mean only. No sleep phase.
* ``sensenova_trace``: what ``benchmarks/sensenova_load.py`` times, as vLLM's
  ``benchmark_serving.py`` loads a server: ``poisson_trace`` (``--trace-n`` requests arriving at
  ``--trace-rate`` a second, Poisson, ``--trace-seed``; half text answers of
  ``--text-prompt-chars``-byte prompts, a quarter think images, a quarter plain images, think
  off, of ``--image-size``); one warm-up of each kind, one after another, untimed
  (``sensenova_trace_warmup``); then, for each rate of ``--trace-rate`` (one, or a comma list
  run in turn on the same server, as ``benchmark_serving.py`` is run at one rate after another
  against one server), ``sensenova_trace_rate<RATE>`` (``trace_step``): every request sent at
  its offset from the first send, from a thread of its own (one a request: a request in flight
  never holds a later one back), each recorded with its kind, offset, when it was sent, its
  latency and its answer (text and think text cut to 200 characters, with their full length and
  sha256; images as sha256, shape and mean); the next rate starts once every request of the one
  before is answered; then ``sensenova_trace_alone`` (``--trace-alone K``): the first K of each
  kind again, one at a time, for the answers to be compared (one seed gives the same requests at
  every rate). No sleep phase.
* ``qwen``: ``qwen_t2i`` (``/v1/images/generations``), ``qwen_edit`` (``/v1/images/edits`` with
  two reference images), ``qwen_edit_chat`` (the same edit through ``/v1/chat/completions`` with
  two ``image_url`` parts), ``qwen_concurrent_N`` (N text-to-image requests of distinct seeds,
  serially and then all at once), then the sleep phase.
* ``qwen_t2i``: only ``qwen_t2i`` (a server whose plugin cannot wire, or another mode).
* ``refusal``: the server is expected to exit before serving; its exit code and the last lines
  of its output are recorded.

Sleep phase: ``POST /v1/omni/sleep`` (level 1), ``/v1/omni/wakeup``, the first request again;
then level 2 and wake-up again (vllm-omni 0.26 and 0.30 alike refuse to wake from level 2:
``AsyncOmni.wake_up`` raises NotImplementedError, the endpoint answers 501; recorded, not hidden),
and the first request once more (given ``HELD_S`` seconds after a refused wake-up: 0.26 refuses
it at once, 0.30 holds it). Without ``--enable-sleep-mode`` the weights stay where they are;
level 2 still clears the runner's graphs, which is where this plugin drops its own.

Written to ``OUT/result.json`` after every request kind (a later failure keeps what came
before): per request its latency and output (text, think text, image sha256 and the uint8 array
as ``.npy`` beside it), the server's start time and pid, and the plugin's counters as the
server's processes wrote them through ``VLLM_OMNI_GRAPHDECODE_STATS_FILE`` (``{pid}``): after each
request kind (at most one second behind: a process writes at most once a second while counting)
and after the server stopped (exact: each process writes at exit). Never imports the plugin.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import glob
import hashlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

SENSENOVA_PROMPT = "Describe a red cube on a wooden table in one sentence."
SENSENOVA_CONCURRENT_PROMPTS = ("Name three colours.", "Count from one to five.",
                                "What is a cube?", "Describe a wooden table.")
THINK_PROMPT = "A red cube on a wooden table."
THINK_PROMPTS = (THINK_PROMPT, "A blue sphere on a stone floor.", "Two green cones in the snow.",
                 "A yellow cylinder beside a window.")
MIXED_SEED = 200  # the mixed scenario's think images: seeds MIXED_SEED, MIXED_SEED + 1, ...
QWEN_PROMPT = "a red cube on a wooden table"
EDIT_PROMPT = "put the cube from the first image on the table from the second"
SEED = 0
IMAGE_SIZE = 32  # SenseNova-U1 tiny: 16 px per latent token; Qwen tiny: VAE 16x
SLEEP_ENDPOINTS = ("/v1/omni/sleep", "/v1/omni/wakeup")
SCENARIOS = ("sensenova", "sensenova_batch", "sensenova_step", "sensenova_load",
             "sensenova_trace", "qwen", "qwen_t2i", "refusal")
# sensenova_step's disconnect: the client gives up on a long text answer after this many seconds
# (closing its connection), before the answer can end at these many tokens. On the H200 the tiny
# checkpoint's step server answered 2,000 tokens inside 1.5 s (a 32-token answer took ~35 ms), so
# the client waited too long to hang up; 4,000 tokens fit the tiny model's 4,096 positions.
DISCONNECT_AFTER_S = 0.3
DISCONNECT_TOKENS = 4000
# sensenova_trace's mix, (kind, weight): half text answers, a quarter each image kind.
TRACE_MIX = (("text", 2), ("think_image", 1), ("image", 1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--model", required=True, metavar="DIR", help="tiny checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR", help="result.json, server.log, .npy")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="set in the server's environment (repeatable)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one extra argument of `vllm serve` (repeatable; write --serve-arg=--x)")
    p.add_argument("--text-tokens", type=int, default=32, help="greedy max_tokens (SenseNova)")
    p.add_argument("--sensenova-steps", type=int, default=2, help="think image steps (>= 2)")
    p.add_argument("--image-size", type=int, default=IMAGE_SIZE,
                   help="sensenova_load: the think images' height and width")
    p.add_argument("--text-prompt-chars", type=int, default=64,
                   help="sensenova_load: bytes of each text prompt (a token a byte here)")
    p.add_argument("--trace-rate", default="1",
                   help="sensenova_trace: requests a second (Poisson arrivals); a comma list "
                        "runs the trace at each rate in turn on the same server")
    p.add_argument("--trace-n", type=int, default=8, help="sensenova_trace: requests in the trace")
    p.add_argument("--trace-seed", type=int, default=0,
                   help="sensenova_trace: the seed of the arrival times and of the kinds' order")
    p.add_argument("--trace-alone", type=int, default=0, metavar="K",
                   help="sensenova_trace: after the trace, the first K requests of each kind "
                        "again, one at a time")
    p.add_argument("--qwen-steps", type=int, default=4, help="Qwen steps: 0 extracts, rest replay")
    p.add_argument("--concurrent", type=int, default=8,
                   help="concurrent requests: Qwen's, and sensenova_batch's mixed ones")
    p.add_argument("--init-timeout", type=int, default=300, help="server start limit, seconds")
    p.add_argument("--request-timeout", type=int, default=180, help="one request's limit")
    p.add_argument("--no-sleep", action="store_true", help="skip the sleep phase")
    args = p.parse_args(argv)
    for item in args.env:
        if "=" not in item:
            p.error(f"--env {item}: expected K=V")
    if args.sensenova_steps < 2 or args.qwen_steps < 2:
        p.error("steps must be >= 2 (one step divides by zero in the tiny schedulers)")
    args.trace_rates = trace_rates(args.trace_rate)
    if args.trace_rates is None or args.trace_n < 1 or args.trace_alone < 0:
        p.error(f"--trace-rate {args.trace_rate}, --trace-n {args.trace_n}, --trace-alone "
                f"{args.trace_alone}: expected rates > 0 (one, or a comma list), n >= 1 and "
                "K >= 0")
    return args


def trace_rates(text: str) -> list[float] | None:
    """``--trace-rate``'s rates in the order given, or None where one is not a number > 0."""
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        return None
    return rates if all(r > 0 for r in rates) else None


def trace_step(rate: float) -> str:
    """The result's step of the trace at ``rate``: ``sensenova_trace_rate0.4``."""
    return f"sensenova_trace_rate{rate:g}"


# ---------------------------------------------------------------------------------------------
# The server process
# ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--omni",
            "--host", "127.0.0.1", "--port", str(port), *extra]


class Server:
    """One ``vllm serve --omni`` process group: start, wait until healthy, stop."""

    def __init__(self, model: str, extra: list[str], env: dict[str, str], log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = serve_command(model, self.port, extra)
        self.env, self.log_path = env, log_path
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            log.flush()
            # A session of its own: stopping it reaches the engine and workers it spawned.
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> tuple[str, float]:
        """("ready" | "exited" | "timeout", seconds since start)."""
        import httpx

        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return "exited", self.elapsed()
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return "ready", self.elapsed()
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        return "timeout", self.elapsed()

    def elapsed(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def stop(self, grace: float = 60.0) -> int | str:
        """SIGINT (uvicorn's graceful shutdown, which shuts the engine down), then SIGKILL."""
        if self.proc is None:
            return "not started"
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        self.proc.wait()
        return self.proc.returncode

    def log_tail(self, n: int = 40) -> list[str]:
        with open(self.log_path, errors="replace") as f:
            return f.read().splitlines()[-n:]


# ---------------------------------------------------------------------------------------------
# Requests, through the openai client
# ---------------------------------------------------------------------------------------------

def make_client(url: str, timeout: float):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", timeout=timeout, max_retries=0)


def png_bytes(array) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def reference_images() -> list[bytes]:
    """Two distinct 32x32 RGB PNGs, the same bytes in every run."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    return [png_bytes(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))
            for _ in range(2)]


def decode_image(b64: str):
    """base64 PNG (or a data: URL of one) -> uint8 HxWxC array."""
    import numpy as np
    from PIL import Image

    if b64.startswith("data:"):
        b64 = b64.split(",", 1)[1]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def find_key(value, key: str):
    """The first value stored under ``key`` anywhere inside nested dicts/lists, or None."""
    if isinstance(value, dict):
        if key in value:
            return value[key]
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


def chat_images(body: dict) -> list[str]:
    """The image URLs of a chat completion's first choice (vllm-omni returns a list of parts)."""
    content = body["choices"][0]["message"].get("content")
    if not isinstance(content, list):
        return []
    return [part["image_url"]["url"] for part in content
            if isinstance(part, dict) and part.get("type") == "image_url"]


def _timed(fn):
    start = time.perf_counter()
    raw = fn()
    elapsed = time.perf_counter() - start
    return raw.http_response.json(), round(elapsed, 3)


def sensenova_text(client, model: str, prompt: str, max_tokens: int) -> dict:
    body, took = _timed(lambda: client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}], modalities=["text"],
        max_tokens=max_tokens, seed=SEED))
    text = body["choices"][0]["message"].get("content")
    # vllm-omni answers a text request that produced no text through its image path, with this.
    if not isinstance(text, str) or text.startswith("Image generation completed but no images"):
        raise TypeError(f"no text in the answer: {json.dumps(body)[:400]}")
    return {"text": text, "s": took}


def sensenova_think_image(client, model: str, steps: int, prompt: str = THINK_PROMPT,
                          seed: int = SEED, size: int = IMAGE_SIZE, think: bool = True) -> dict:
    """A text-to-image request; ``think=False``: the plain one (the body says ``think: false``,
    which the pipeline also assumes when it is absent)."""
    body, took = _timed(lambda: client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        modalities=["image"], seed=seed,
        extra_body={"think": think, "height": size, "width": size,
                    "num_inference_steps": steps}))
    urls = chat_images(body)
    if len(urls) != 1:
        raise RuntimeError(f"expected one image, got {len(urls)}: {json.dumps(body)[:400]}")
    return {"think_text": find_key(body, "think_text"), "image": decode_image(urls[0]), "s": took}


def qwen_t2i(client, model: str, steps: int, seed: int = SEED) -> dict:
    body, took = _timed(lambda: client.images.with_raw_response.generate(
        model=model, prompt=QWEN_PROMPT, n=1, size=f"{IMAGE_SIZE}x{IMAGE_SIZE}",
        response_format="b64_json", extra_body={"num_inference_steps": steps, "seed": seed}))
    return {"image": decode_image(body["data"][0]["b64_json"]), "s": took}


def qwen_edit(client, model: str, steps: int) -> dict:
    refs = [(f"ref{i}.png", data, "image/png") for i, data in enumerate(reference_images())]
    body, took = _timed(lambda: client.images.with_raw_response.edit(
        model=model, image=refs, prompt=EDIT_PROMPT, n=1, size=f"{IMAGE_SIZE}x{IMAGE_SIZE}",
        response_format="b64_json", extra_body={"num_inference_steps": steps, "seed": SEED}))
    return {"image": decode_image(body["data"][0]["b64_json"]), "s": took}


def qwen_edit_chat(client, model: str, steps: int) -> dict:
    parts = [{"type": "text", "text": EDIT_PROMPT}] + [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                            + base64.b64encode(data).decode()}}
        for data in reference_images()]
    body, took = _timed(lambda: client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": parts}], modalities=["image"],
        seed=SEED, extra_body={"height": IMAGE_SIZE, "width": IMAGE_SIZE,
                               "num_inference_steps": steps}))
    urls = chat_images(body)
    if len(urls) != 1:
        raise RuntimeError(f"expected one image, got {len(urls)}: {json.dumps(body)[:400]}")
    return {"image": decode_image(urls[0]), "s": took}


def concurrently(fns: list) -> tuple[list[dict], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        results = [f.result() for f in [pool.submit(fn) for fn in fns]]
    return results, round(time.perf_counter() - start, 3)


def omni_endpoint(url: str, path: str, payload: dict, timeout: float) -> dict:
    import httpx

    start = time.perf_counter()
    try:
        r = httpx.post(url + path, json=payload, timeout=timeout)
        return {"status": r.status_code, "body": r.text[:2000],
                "s": round(time.perf_counter() - start, 3)}
    except httpx.HTTPError as exc:
        return {"status": None, "body": repr(exc), "s": round(time.perf_counter() - start, 3)}


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------

class Recorder:
    """``result.json`` in ``outdir``, rewritten after every step; images as ``.npy`` beside it."""

    def __init__(self, outdir: str, base: dict, stats_template: str = ""):
        self.outdir, self.stats_template = outdir, stats_template
        self.report = dict(base, requests={})
        self.write()

    def write(self) -> None:
        tmp = os.path.join(self.outdir, "result.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.report, f, indent=2, default=str)
        os.replace(tmp, os.path.join(self.outdir, "result.json"))

    def image(self, array, stem: str) -> dict:
        import numpy as np

        np.save(os.path.join(self.outdir, f"{stem}.npy"), array)
        return {"npy": f"{stem}.npy", "shape": list(array.shape), "mean": float(array.mean()),
                "sha256": hashlib.sha256(array.tobytes()).hexdigest()}

    def entry(self, kind: str, result: dict) -> dict:
        entry = {}
        for key, value in result.items():
            entry[key] = self.image(value, kind) if key == "image" else value
        return entry

    def add(self, kind: str, entry: dict) -> None:
        entry["stats"] = stats_snapshots(self.stats_template)
        self.report["requests"][kind] = entry
        self.write()


def stats_snapshots(template: str) -> list[dict]:
    """What the server's processes last wrote to ``VLLM_OMNI_GRAPHDECODE_STATS_FILE``."""
    if template in ("", "0"):
        return []
    snaps = []
    for path in sorted(glob.glob(template.replace("{pid}", "*"))):
        try:
            with open(path) as f:
                snaps.append(dict(json.load(f), file=os.path.basename(path)))
        except (OSError, ValueError) as exc:  # being rewritten this instant
            snaps.append({"file": os.path.basename(path), "error": repr(exc)})
    return snaps


# ---------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------

def _step(rec: Recorder, kind: str, fn) -> dict | None:
    print(f"e2e_serve: {kind} ...", flush=True)
    try:
        entry = fn()
    except Exception as exc:  # noqa: BLE001 - recorded; the next kind's evidence still counts
        before = exc.entry if isinstance(exc, _Recorded) else {}
        entry = dict(before, error=str(exc) if before else f"{type(exc).__name__}: {exc}",
                     traceback=traceback.format_exc())
        print(f"e2e_serve: {kind}: FAILED: {entry['error']}", flush=True)
    rec.add(kind, entry)
    return entry


HELD_S = 30  # the request after a refused wake-up: answered or refused at once, or held


def _sleep_phase(rec: Recorder, url: str, again, client, args) -> None:
    """Level 1 then level 2 through vllm-omni's endpoints; the first request after each
    (``again(client)``). Where the wake-up is refused (vllm-omni 0.26 and 0.30 after level 2:
    501) the request is sent anyway, with ``HELD_S`` seconds to answer: 0.26 refuses it at once
    (the engine is asleep), 0.30 holds it (``AsyncOmni.sleep`` closes admission and only a wake-up
    that succeeds opens it again), recorded as ``held_after_refused_wakeup``."""
    timeout = args.request_timeout
    for level in (1, 2):
        def run(level=level):
            entry = {"sleep": omni_endpoint(url, SLEEP_ENDPOINTS[0],
                                            {"stage_ids": [0], "level": level}, timeout)}
            entry["wakeup"] = omni_endpoint(url, SLEEP_ENDPOINTS[1], {"stage_ids": [0]}, timeout)
            refused = entry["wakeup"]["status"] not in (200, None)
            if refused:
                entry["wakeup_refused"] = True
            try:
                entry.update(rec.entry(f"sleep_level{level}_after", again(
                    client.with_options(timeout=HELD_S) if refused else client)))
            except Exception as exc:  # noqa: BLE001 - recorded in the entry, as _step records
                import openai

                if refused and isinstance(exc, openai.APITimeoutError):
                    entry["held_after_refused_wakeup"] = HELD_S
                raise _Recorded(entry, exc) from exc
            return entry
        _step(rec, f"sleep_level{level}", run)


class _Recorded(Exception):
    """A step's failure with what it had recorded before it (``_step`` keeps both)."""

    def __init__(self, entry: dict, exc: Exception):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.entry = entry


def run_sensenova(rec: Recorder, client, url: str, model: str, args) -> None:
    _step(rec, "sensenova_text", lambda: rec.entry(
        "sensenova_text", sensenova_text(client, model, SENSENOVA_PROMPT, args.text_tokens)))
    _step(rec, "sensenova_think_image", lambda: rec.entry(
        "sensenova_think_image", sensenova_think_image(client, model, args.sensenova_steps)))

    def concurrent():
        serial = [sensenova_text(client, model, p, args.text_tokens)
                  for p in SENSENOVA_CONCURRENT_PROMPTS]
        together, wall = concurrently([
            (lambda p=p: sensenova_text(client, model, p, args.text_tokens))
            for p in SENSENOVA_CONCURRENT_PROMPTS])
        return {"prompts": list(SENSENOVA_CONCURRENT_PROMPTS), "serial": serial,
                "concurrent": together, "concurrent_wall_s": wall,
                "serial_s": round(sum(r["s"] for r in serial), 3)}
    _step(rec, "sensenova_concurrent", concurrent)
    if not args.no_sleep:
        _sleep_phase(rec, url, lambda c: sensenova_text(c, model, SENSENOVA_PROMPT,
                                                        args.text_tokens), client, args)


def _nth(prompts: tuple[str, ...], i: int) -> str:
    """The i-th of ``prompts``, made distinct past their number."""
    take = i // len(prompts)
    return prompts[i % len(prompts)] + (f" Take {take + 1}." if take else "")


def sensenova_mixed(n: int) -> list[dict]:
    """The ``sensenova_mixed_N`` requests, in sending order: ceil(n/2) text answers, then n/2 think
    images, every prompt distinct, every image its own seed.

    vLLM-Omni's scheduler takes waiting requests in arrival order into one ``forward`` while
    their sampling-parameter key (size, steps, guidance, ...) matches the first's, and a text
    answer's never matches a think image's: texts first and images after lets each kind batch
    among itself (interleaved, every wave would end at the next request of the other kind)."""
    texts = [{"kind": "text", "prompt": _nth(SENSENOVA_CONCURRENT_PROMPTS, i)}
             for i in range((n + 1) // 2)]
    images = [{"kind": "think_image", "prompt": _nth(THINK_PROMPTS, i), "seed": MIXED_SEED + i}
              for i in range(n // 2)]
    return texts + images


def run_sensenova_batch(rec: Recorder, client, url: str, model: str, args) -> None:
    """``sensenova_mixed_N``: the N requests all at once, then the same N one at a time."""
    n = args.concurrent
    kind = f"sensenova_mixed_{n}"
    requests = sensenova_mixed(n)

    def send(spec):
        if spec["kind"] == "text":
            return sensenova_text(client, model, spec["prompt"], args.text_tokens)
        return sensenova_think_image(client, model, args.sensenova_steps, spec["prompt"],
                                     spec["seed"])

    def mixed():
        together, wall = concurrently([(lambda s=s: send(s)) for s in requests])
        serial = [send(s) for s in requests]
        return {"requests": requests, "concurrent_wall_s": wall,
                "serial_s": round(sum(r["s"] for r in serial), 3),
                "concurrent": [rec.entry(f"{kind}-concurrent-{i}", r)
                               for i, r in enumerate(together)],
                "serial": [rec.entry(f"{kind}-serial-{i}", r) for i, r in enumerate(serial)]}
    _step(rec, kind, mixed)


def run_sensenova_step(rec: Recorder, client, url: str, model: str, args) -> None:
    """``sensenova_batch``'s mixed requests, then a client that hangs up: a long text answer whose
    client gives up after ``DISCONNECT_AFTER_S`` (its HTTP connection closes), then the first
    mixed request again. The server must abort the request it was serving (the counters say
    whether its batch member was stopped) and answer the next one as before."""
    run_sensenova_batch(rec, client, url, model, args)
    first = sensenova_mixed(args.concurrent)[0]

    def disconnect():
        import openai

        impatient = make_client(url, DISCONNECT_AFTER_S)
        answered = None
        try:
            whole = sensenova_text(impatient, model, first["prompt"], DISCONNECT_TOKENS)
            answered = {"chars": len(whole["text"]), "s": whole["s"]}  # what beat the client
        except openai.APITimeoutError:
            pass
        time.sleep(3 * DISCONNECT_AFTER_S)  # the server notices and aborts at its next step
        after = sensenova_text(client, model, first["prompt"], args.text_tokens)
        return {"cut": answered is None, "answered": answered,
                "after": rec.entry("sensenova_disconnect_after", after)}
    _step(rec, "sensenova_disconnect", disconnect)


def load_prompt(i: int, chars: int) -> str:
    """Text prompt ``i`` of the load scenario: ``chars`` bytes of words, distinct for each ``i``
    and the same in every run."""
    text, j = "", 0
    while len(text) < chars:
        text += f"{' ' if text else ''}w{(i * 7919 + j * 104729) % 150000}"
        j += 1
    return text[:chars]


def _answer(a: dict) -> dict:
    """A request function's result as the load scenarios record it: no pixels (the image's
    sha256, shape and mean), text and think text cut to 200 characters beside their full length
    and the sha256 of the whole (what answers are compared by)."""
    entry = {k: v for k, v in a.items() if k != "image"}
    if "image" in a:
        entry["image_sha256"] = hashlib.sha256(a["image"].tobytes()).hexdigest()
        entry["image_shape"] = list(a["image"].shape)
        entry["image_mean"] = float(a["image"].mean())
    for key, short in (("think_text", "think"), ("text", "text")):
        if isinstance(entry.get(key), str):
            entry[f"{short}_chars"] = len(entry[key])
            entry[f"{short}_sha256"] = hashlib.sha256(entry[key].encode()).hexdigest()
            entry[key] = entry[key][:200]
    return entry


def _loaded(fns: list) -> dict:
    """The requests of ``fns`` all at once: each one's latency and answer, the wall time."""
    answers, wall = concurrently(fns)
    return {"wall_s": wall, "latency_s": [a["s"] for a in answers],
            "answers": [_answer(a) for a in answers]}


def run_sensenova_load(rec: Recorder, client, url: str, model: str, args) -> None:
    """One warm-up of each kind, then N text answers at once, then N think images at once."""
    n = args.concurrent

    def text(i):
        return sensenova_text(client, model, load_prompt(i, args.text_prompt_chars),
                              args.text_tokens)

    def think(i):
        return sensenova_think_image(client, model, args.sensenova_steps, _nth(THINK_PROMPTS, i),
                                     MIXED_SEED + i, args.image_size)

    _step(rec, "sensenova_load_warmup", lambda: _loaded([lambda: text(n)]) | {
        "think": _loaded([lambda: think(n)])})
    _step(rec, f"sensenova_load_text_{n}",
          lambda: _loaded([(lambda i=i: text(i)) for i in range(n)]))
    _step(rec, f"sensenova_load_think_{n}",
          lambda: _loaded([(lambda i=i: think(i)) for i in range(n)]))


def trace_request(i: int, kind: str, offset_s: float, prompt_chars: int) -> dict:
    """Request ``i`` of the trace scenario: a text answer's prompt is ``load_prompt(i, ...)``; an
    image's (think or plain) ``_nth(THINK_PROMPTS, i)`` with seed ``MIXED_SEED + i``: every
    request distinct, the same in every run."""
    if kind == "text":
        return {"i": i, "kind": kind, "offset_s": offset_s,
                "prompt": load_prompt(i, prompt_chars), "seed": SEED}
    return {"i": i, "kind": kind, "offset_s": offset_s, "prompt": _nth(THINK_PROMPTS, i),
            "seed": MIXED_SEED + i}


def mix_counts(n: int, mix=TRACE_MIX) -> dict[str, int]:
    """How many of ``n`` requests each kind of ``mix`` ((kind, weight), ...) gets: n times its
    share rounded down, the requests left over one each to the largest remainders (ties in the
    mix's order). Exact when n times each share is whole (the default mix: n divisible by 4);
    otherwise each kind is within one request of n times its share."""
    total = sum(w for _, w in mix)
    counts = {kind: n * w // total for kind, w in mix}
    by_remainder = sorted(range(len(mix)), key=lambda k: -(n * mix[k][1] % total))
    for k in by_remainder[:n - sum(counts.values())]:
        counts[mix[k][0]] += 1
    return counts


def poisson_trace(rate: float, n: int, seed: int, mix=TRACE_MIX,
                  prompt_chars: int = 64) -> list[dict]:
    """The ``sensenova_trace`` requests in sending order: ``n`` dicts (``trace_request``) whose
    ``offset_s`` (seconds after the first send) are Poisson arrivals at ``rate`` a second, the
    first at 0 and each gap exponential with mean 1/rate (vLLM's ``benchmark_serving.py``), and
    whose kinds, counted by ``mix_counts``, are in an order drawn from ``seed``. A pure function
    of its arguments (``random.Random(seed)``: the Mersenne Twister and ``expovariate``, the same
    on every Python 3): every side meets the same trace. The order is drawn before the gaps and a
    gap is ``-log(1 - u) / rate``, so one seed at another rate gives the same requests with the
    offsets scaled by the ratio of the rates."""
    rng = random.Random(seed)
    kinds = [kind for kind, count in mix_counts(n, mix).items() for _ in range(count)]
    rng.shuffle(kinds)
    offsets, t = [], 0.0
    for i in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return [trace_request(i, kind, offsets[i], prompt_chars) for i, kind in enumerate(kinds)]


def _sent(spec: dict, send, start: float, started: threading.Event | None = None) -> dict:
    """``spec`` sent now through ``send``: the spec and, in seconds after ``start``, when it was
    sent (``sent_s``) and answered (``done_s``), its latency (``latency_s``: the HTTP round trip
    as the client saw it) and answer (``_answer``), or its ``error``. ``started`` is set just
    before the request goes out."""
    record = dict(spec, sent_s=round(time.perf_counter() - start, 3))
    if started is not None:
        started.set()
    try:
        record.update(_answer(send(spec)))
        record["latency_s"] = record.pop("s")
    except Exception as exc:  # noqa: BLE001 - recorded per request; the trace goes on
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["done_s"] = round(time.perf_counter() - start, 3)
    return record


def send_trace(trace: list[dict], send) -> dict:
    """Each request of ``trace`` sent through ``send`` at its ``offset_s`` after the first send,
    from a thread of its own (``len(trace)`` threads: a request in flight never delays a later
    one's sending). The next request is dispatched only once the previous one's thread has taken
    its send time, so the requests go out in trace order; a request sent late (the client fell
    behind) says so in ``late_s_max``. ``wall_s``: from the first send to the last answer."""
    records: list[dict | None] = [None] * len(trace)
    start = time.perf_counter()

    def one(k: int, started: threading.Event) -> None:
        records[k] = _sent(trace[k], send, start, started)

    with ThreadPoolExecutor(max_workers=max(1, len(trace))) as pool:
        for k, spec in enumerate(trace):
            delay = start + spec["offset_s"] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            started = threading.Event()
            pool.submit(one, k, started)
            started.wait()
    return _with_errors({"wall_s": round(time.perf_counter() - start, 3),
                         "late_s_max": round(max(r["sent_s"] - r["offset_s"] for r in records), 3),
                         "requests": records})


def _with_errors(entry: dict) -> dict:
    """``entry`` with ``errors`` (how many of its requests failed) and, when some did, an
    ``error`` naming the first: the step, and the driver's exit code, say so."""
    failed = [r for r in entry["requests"] if "error" in r]
    entry["errors"] = len(failed)
    if failed:
        entry["error"] = (f"{len(failed)} of {len(entry['requests'])} requests failed; request "
                          f"{failed[0]['i']}: {failed[0]['error']}")
    return entry


def run_sensenova_trace(rec: Recorder, client, url: str, model: str, args) -> None:
    """A warm-up of each kind, the trace at its arrival times at each rate in turn, then
    (``--trace-alone K``) the first K of each kind one at a time."""

    def send(spec):
        if spec["kind"] == "text":
            return sensenova_text(client, model, spec["prompt"], args.text_tokens)
        return sensenova_think_image(client, model, args.sensenova_steps, spec["prompt"],
                                     spec["seed"], args.image_size,
                                     think=spec["kind"] == "think_image")

    def one_at_a_time(specs):
        start = time.perf_counter()
        return _with_errors({"requests": [_sent(s, send, start) for s in specs]})

    warmups = [trace_request(args.trace_n + j, kind, 0.0, args.text_prompt_chars)
               for j, (kind, _) in enumerate(TRACE_MIX)]  # past the trace: prompts of their own
    _step(rec, "sensenova_trace_warmup", lambda: one_at_a_time(warmups))
    for rate in args.trace_rates:
        trace = poisson_trace(rate, args.trace_n, args.trace_seed,
                              prompt_chars=args.text_prompt_chars)
        params = {"rate": rate, "n": args.trace_n, "seed": args.trace_seed,
                  "mix": dict(TRACE_MIX), "counts": mix_counts(args.trace_n)}
        _step(rec, trace_step(rate), lambda: params | send_trace(trace, send))
    if args.trace_alone:  # the same requests at every rate: the last trace's specs serve
        taken: dict[str, int] = {}
        alone = []
        for spec in trace:
            if taken.get(spec["kind"], 0) < args.trace_alone:
                taken[spec["kind"]] = taken.get(spec["kind"], 0) + 1
                alone.append(spec)
        _step(rec, "sensenova_trace_alone",
              lambda: {"k": args.trace_alone} | one_at_a_time(alone))


def run_qwen(rec: Recorder, client, url: str, model: str, args, only_t2i: bool = False) -> None:
    _step(rec, "qwen_t2i", lambda: rec.entry("qwen_t2i", qwen_t2i(client, model, args.qwen_steps)))
    if only_t2i:
        return
    _step(rec, "qwen_edit", lambda: rec.entry("qwen_edit", qwen_edit(client, model,
                                                                     args.qwen_steps)))
    _step(rec, "qwen_edit_chat", lambda: rec.entry("qwen_edit_chat", qwen_edit_chat(
        client, model, args.qwen_steps)))

    n = args.concurrent
    kind = f"qwen_concurrent_{n}"

    def concurrent():
        seeds = list(range(100, 100 + n))
        serial = [qwen_t2i(client, model, args.qwen_steps, seed) for seed in seeds]
        together, wall = concurrently([(lambda s=s: qwen_t2i(client, model, args.qwen_steps, s))
                                       for s in seeds])
        entry = {"seeds": seeds, "concurrent_wall_s": wall,
                 "serial_s": round(sum(r["s"] for r in serial), 3),
                 "serial": [rec.entry(f"{kind}-serial-{s}", r) for s, r in zip(seeds, serial)],
                 "concurrent": [rec.entry(f"{kind}-concurrent-{s}", r)
                                for s, r in zip(seeds, together)]}
        return entry
    _step(rec, kind, concurrent)
    if not args.no_sleep:
        _sleep_phase(rec, url, lambda c: qwen_t2i(c, model, args.qwen_steps), client, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ)
    env.update(item.split("=", 1) for item in args.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    server = Server(args.model, args.serve_arg, env, os.path.join(args.out, "server.log"))
    shown = {k: v for k, v in env.items()
             if k.startswith(("VLLM_OMNI_GRAPHDECODE", "VLLM_PLUGINS", "DIFFUSION_", "CUDA_VISIBLE"))}
    rec = Recorder(args.out, {"scenario": args.scenario, "cmd": server.cmd, "env": shown,
                              "client_pid": os.getpid()},
                   env.get("VLLM_OMNI_GRAPHDECODE_STATS_FILE", ""))
    print(f"e2e_serve: starting {' '.join(server.cmd)}", flush=True)
    server.start()
    rec.report["server_pid"] = server.proc.pid
    state, took = server.wait_ready(args.init_timeout)
    rec.report.update(start=state, start_s=took)
    rec.write()
    failed = False
    try:
        if args.scenario == "refusal" or state != "ready":
            rec.report["log_tail"] = server.log_tail()
            failed = args.scenario != "refusal"
            return 1 if failed or state == "ready" else 0
        client = make_client(server.url, args.request_timeout)
        models = client.models.list()
        model = models.data[0].id  # the name the server answers to (the path unless renamed)
        rec.report["model"] = model
        if args.scenario == "sensenova":
            run_sensenova(rec, client, server.url, model, args)
        elif args.scenario == "sensenova_batch":
            run_sensenova_batch(rec, client, server.url, model, args)
        elif args.scenario == "sensenova_step":
            run_sensenova_step(rec, client, server.url, model, args)
        elif args.scenario == "sensenova_load":
            run_sensenova_load(rec, client, server.url, model, args)
        elif args.scenario == "sensenova_trace":
            run_sensenova_trace(rec, client, server.url, model, args)
        else:
            run_qwen(rec, client, server.url, model, args, only_t2i=args.scenario == "qwen_t2i")
        failed = any("error" in e for e in rec.report["requests"].values())
    except Exception as exc:  # noqa: BLE001 - recorded in result.json, and the run fails
        rec.report["error"] = f"{type(exc).__name__}: {exc}"
        rec.report["traceback"] = traceback.format_exc()
        failed = True
    finally:
        rec.report["stop_rc"] = server.stop()
        rec.report["rc"] = server.proc.returncode
        time.sleep(0.5)  # let the exit-time stats writes land
        rec.report["final_stats"] = stats_snapshots(rec.stats_template)
        rec.report["total_s"] = server.elapsed()
        rec.write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
