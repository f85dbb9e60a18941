"""What of the serving test (tests/test_e2e_serve_gpu.py) holds without a GPU:

* a bad plugin variable stops ``vllm serve MODEL --omni`` itself, on this machine: vllm builds its
  argument parser, which loads the general plugins, which parse the plugin's variables, before
  anything touches a device; the message names the variable, the value and what is accepted
  (measured here: ~15-20 s, most of it importing vllm);
* each request the serving test sends with the ``openai`` client, captured off the wire by a stub
  server on loopback, is read by vLLM-Omni's own request models the way the serving test needs:
  the chat body validates as its ``ChatCompletionRequest`` and its diffusion arguments come out as
  the server computes them (SenseNova-U1's ``think`` and ``max_tokens`` as model extras; height,
  width, steps, seed, modalities), ``/v1/images/generations`` as its ``ImageGenerationRequest``,
  and the two-image ``/v1/images/edits`` multipart form through FastAPI with the signature of the
  server's own ``edit_images`` route;
* the ``sensenova_batch`` scenario against a stub that echoes each request: its requests (texts
  first, then think images, all distinct), each concurrent answer recorded beside its own serial
  answer, and the serving test's verdicts on them: ``mixed_equal`` (exact: a text one character
  off, an image one level off both count), ``batch_evidence`` (what the batch counters prove) and
  the summary's entry;
* the ``sensenova_load`` scenario (benchmarks/sensenova_serve.py) against a stub that echoes:
  the warm-ups, then each kind's requests at the asked size, steps and token limit, all distinct.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "e2e_serve.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import e2e_serve
import test_e2e_serve_gpu as serve_gpu  # its comparisons and summary are pure; its tests need a GPU


def test_driver_help_lists_its_scenarios():
    out = subprocess.run([sys.executable, DRIVER, "--help"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    for scenario in e2e_serve.SCENARIOS:
        assert scenario in out.stdout


def test_bad_plugin_variable_stops_vllm_serve_naming_variable_value_and_accepted(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_OMNI_GRAPHDECODE")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    out = tmp_path / "out"
    cmd = [sys.executable, DRIVER, "--scenario", "refusal", "--model", str(model), "--out",
           str(out), "--env", "VLLM_OMNI_GRAPHDECODE=1",
           "--env", "VLLM_OMNI_GRAPHDECODE_QWEN_MODE=turbo", "--init-timeout", "150",
           "--serve-arg=--diffusion-load-format", "--serve-arg=diffusers"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    result = json.loads((out / "result.json").read_text())
    log = (out / "server.log").read_text()
    assert proc.returncode == 0, (proc.stdout, proc.stderr, log[-3000:])
    assert result["start"] == "exited" and result["rc"] not in (0, None), result
    assert "Starting vLLM API server" not in log
    assert ("VLLM_OMNI_GRAPHDECODE_QWEN_MODE='turbo' is not accepted; accepted: fast, exact"
            in log), log[-3000:]


# ---------------------------------------------------------------------------------------------
# The requests, off the wire
# ---------------------------------------------------------------------------------------------

def _png_b64() -> str:
    import numpy as np

    return base64.b64encode(e2e_serve.png_bytes(np.zeros((32, 32, 3), dtype=np.uint8))).decode()


class _Stub(BaseHTTPRequestHandler):
    """Records every request; answers with the shapes vLLM-Omni's server answers with."""

    captured: ClassVar[list] = []

    def log_message(self, *args):
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0,
                                                "owned_by": "vllm-omni"}]})

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.captured.append((self.path, self.headers["Content-Type"], body))
        if self.path.endswith("/chat/completions"):
            request = json.loads(body)
            if "image" in request.get("modalities", []):
                content = [{"type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + _png_b64()}}]
            else:
                content = "hello"
            self._send({"id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": content}}],
                        "metrics": {"think_text": "abc"}})
        else:
            self._send({"created": 0, "data": [{"b64_json": _png_b64()}]})


@pytest.fixture(scope="module")
def captured():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = e2e_serve.make_client(f"http://127.0.0.1:{server.server_address[1]}", 30)
        model = client.models.list().data[0].id
        got = {
            "text": e2e_serve.sensenova_text(client, model, "hi", 32),
            "think": e2e_serve.sensenova_think_image(client, model, 2),
            "t2i": e2e_serve.qwen_t2i(client, model, 4),
            "edit": e2e_serve.qwen_edit(client, model, 4),
            "edit_chat": e2e_serve.qwen_edit_chat(client, model, 4),
        }
    finally:
        server.shutdown()
    requests = dict(zip(["text", "think", "t2i", "edit", "edit_chat"], _Stub.captured))
    return got, requests


def test_driver_reads_what_the_server_answers(captured):
    got, _ = captured
    assert got["text"]["text"] == "hello"
    assert got["think"]["think_text"] == "abc" and got["think"]["image"].shape == (32, 32, 3)
    for kind in ("t2i", "edit", "edit_chat"):
        assert got[kind]["image"].shape == (32, 32, 3)


def _diffusion_args(body: dict, model_class: str):
    """(request, extras, diffusion args) exactly as vLLM-Omni's chat handler computes them."""
    from vllm_omni.entrypoints.openai import api_server
    from vllm_omni.entrypoints.openai.serving_chat import OmniOpenAIServingChat
    from vllm_omni.model_extras.registry import get_extra_body_params

    request = api_server.ChatCompletionRequest.model_validate(body)
    handler = OmniOpenAIServingChat.__new__(OmniOpenAIServingChat)
    handler._diffusion_extra_body_params = get_extra_body_params(model_class)
    extras, args = handler._normalize_diffusion_request_args(request)
    return request, extras, args


def test_sensenova_text_request_is_a_greedy_text_request_to_the_server(captured):
    path, _, body = captured[1]["text"]
    assert path == "/v1/chat/completions"
    _, extras, args = _diffusion_args(json.loads(body), "SenseNovaU1Pipeline")
    assert args["modalities"] == ["text"] and args["seed"] == e2e_serve.SEED
    assert extras["max_tokens"] == 32 and "think" not in extras


def test_sensenova_think_request_carries_think_size_steps_and_seed(captured):
    _, _, body = captured[1]["think"]
    _, extras, args = _diffusion_args(json.loads(body), "SenseNovaU1Pipeline")
    assert extras["think"] is True
    assert args["modalities"] == ["image"]
    assert (args["height"], args["width"], args["num_inference_steps"], args["seed"]) == (
        32, 32, 2, e2e_serve.SEED)


def test_qwen_chat_edit_request_carries_two_reference_images(captured):
    from vllm_omni.entrypoints.openai.serving_chat import OmniOpenAIServingChat

    _, _, body = captured[1]["edit_chat"]
    request, _, args = _diffusion_args(json.loads(body), "DiffusersAdapterPipeline")
    handler = OmniOpenAIServingChat.__new__(OmniOpenAIServingChat)
    messages = [m.model_dump() if hasattr(m, "model_dump") else m for m in request.messages]
    prompt, images = handler._extract_diffusion_prompt_and_media(messages)[:2]
    assert prompt == e2e_serve.EDIT_PROMPT and len(images) == 2
    assert (args["height"], args["width"], args["num_inference_steps"]) == (32, 32, 4)


def test_qwen_t2i_request_validates_as_the_servers_image_generation_request(captured):
    from vllm_omni.entrypoints.openai import api_server

    path, _, body = captured[1]["t2i"]
    assert path == "/v1/images/generations"
    request = api_server.ImageGenerationRequest.model_validate(json.loads(body))
    assert (request.size, request.n, request.num_inference_steps, request.seed) == (
        "32x32", 1, 4, e2e_serve.SEED)
    assert str(getattr(request.response_format, "value", request.response_format)) == "b64_json"


def test_qwen_edit_multipart_form_parses_with_the_servers_edit_route_signature(captured):
    import inspect

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm_omni.entrypoints.openai import api_server

    path, content_type, body = captured[1]["edit"]
    assert path == "/v1/images/edits" and content_type.startswith("multipart/form-data")
    seen = {}

    async def edit_images(**kwargs):
        for key in ("image", "image_array"):
            files = kwargs.get(key) or []
            seen[key] = [(f.filename, len(await f.read())) for f in files]
        seen.update({k: v for k, v in kwargs.items()
                     if k not in ("image", "image_array", "raw_request")})
        return {}

    signature = inspect.signature(api_server.edit_images)  # its form fields, not its response
    edit_images.__signature__ = signature.replace(return_annotation=inspect.Signature.empty)
    app = FastAPI()
    app.post("/v1/images/edits", response_model=None)(edit_images)
    response = TestClient(app).post("/v1/images/edits", content=body,
                                    headers={"Content-Type": content_type})
    assert response.status_code == 200, response.text
    images = seen["image"] + seen["image_array"]
    assert len(images) == 2 and all(size > 0 for _, size in images), seen
    assert seen["prompt"] == e2e_serve.EDIT_PROMPT
    assert (seen["size"], seen["response_format"], seen["num_inference_steps"], seen["seed"]) == (
        "32x32", "b64_json", 4, e2e_serve.SEED)


# ---------------------------------------------------------------------------------------------
# The mixed SenseNova-U1 batch (issue #22), against a stub that answers each request its own way
# ---------------------------------------------------------------------------------------------

def test_mixed_requests_are_distinct_texts_first_then_distinct_think_images():
    requests = e2e_serve.sensenova_mixed(8)
    assert [r["kind"] for r in requests] == ["text"] * 4 + ["think_image"] * 4
    images = requests[4:]
    assert len({r["prompt"] for r in requests[:4]}) == 4 and len({r["prompt"] for r in images}) == 4
    assert len({r["seed"] for r in images}) == 4
    more = e2e_serve.sensenova_mixed(11)
    assert [r["kind"] for r in more].count("text") == 6
    assert len({(r["kind"], r["prompt"]) for r in more}) == 11


class _EchoStub(_Stub):
    """Text: "echo: PROMPT"; image: every value the request's seed; think text: the prompt."""

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = request["messages"][0]["content"]
        prompt = content if isinstance(content, str) else content[0]["text"]
        if "image" in request["modalities"]:
            pixels = np.full((32, 32, 3), request["seed"] % 256, dtype=np.uint8)
            url = "data:image/png;base64," + base64.b64encode(e2e_serve.png_bytes(pixels)).decode()
            answer = [{"type": "image_url", "image_url": {"url": url}}]
        else:
            answer = f"echo: {prompt}"
        self._send({"id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": answer}}],
                    "metrics": {"think_text": f"think: {prompt}"}})


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """The ``sensenova_batch`` scenario's step, recorded as the serving test reads a server's."""
    out = tmp_path_factory.mktemp("mixed")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoStub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        args = e2e_serve.parse_args(["--scenario", "sensenova_batch", "--model", "tiny",
                                     "--out", str(out)])
        rec = e2e_serve.Recorder(str(out), {"scenario": args.scenario, "client_pid": os.getpid()})
        e2e_serve.run_sensenova_batch(rec, e2e_serve.make_client(url, 30), url, "tiny", args)
    finally:
        server.shutdown()
    return {"name": "sensenova_batch8_on", "rc": 0, "dir": str(out), "log": "", "log_path": "",
            "result": dict(rec.report, start="ready")}


def _mixed_entry(run):
    return run["result"]["requests"][serve_gpu.MIXED]


def test_mixed_step_records_each_concurrent_answer_beside_its_own_serial_answer(mixed_run):
    entry = _mixed_entry(mixed_run)
    assert "error" not in entry, entry.get("traceback")
    assert entry["requests"] == e2e_serve.sensenova_mixed(serve_gpu.CONCURRENT)
    for phase in ("concurrent", "serial"):
        for spec, answer in zip(entry["requests"], entry[phase]):
            if spec["kind"] == "text":
                assert answer["text"] == f"echo: {spec['prompt']}", (phase, spec, answer)
            else:
                assert answer["think_text"] == f"think: {spec['prompt']}"
                image = np.load(os.path.join(mixed_run["dir"], answer["image"]["npy"]))
                assert image.shape == (32, 32, 3) and (image == spec["seed"] % 256).all()
    assert entry["concurrent_wall_s"] >= 0 and entry["serial_s"] >= 0


def test_mixed_answers_equal_their_serial_answers_when_every_one_is_identical(mixed_run):
    ok, detail = serve_gpu.mixed_equal(mixed_run)
    assert ok and detail == {"requests": 8, "texts": 4, "think_images": 4, "differing": {}}, detail


def test_mixed_comparison_names_a_text_one_character_off_and_an_image_one_level_off(mixed_run):
    run = json.loads(json.dumps(mixed_run))  # a copy to change
    together = _mixed_entry(run)["concurrent"]
    together[0]["text"] = together[0]["text"][:-1] + "?"
    # request 7's image (seed + 1: every value one level up) in place of request 6's, same think
    # text: within images_match's tolerance, and still not bit-identical
    together[6]["image"] = together[7]["image"]
    ok, detail = serve_gpu.mixed_equal(run)
    assert not ok
    assert sorted(detail["differing"]) == [0, 6], detail
    assert detail["differing"][0].startswith("text parts at character ")
    assert detail["differing"][6] == "image: max |diff| 1/255 on 100.00% of values", detail
    together[5]["think_text"] += "!"
    assert serve_gpu.mixed_equal(run)[1]["differing"][5] == "think text parts at token " + str(
        len(together[5]["think_text"]) - 1)


def test_mixed_comparison_of_a_step_that_failed_or_did_not_run_is_none(mixed_run):
    run = json.loads(json.dumps(mixed_run))
    _mixed_entry(run).clear()
    _mixed_entry(run)["error"] = "APITimeoutError: Request timed out."
    assert serve_gpu.mixed_equal(run) == (None, "APITimeoutError: Request timed out.")
    assert serve_gpu.mixed_equal({"result": None}) == (None, "not run")


def _with_counters(run, *processes):
    return dict(run, result=dict(run["result"], final_stats=[
        {"pid": 100 + i, "counters": {f"sensenova_u1.{k}": v for k, v in counters.items()},
         "fallbacks": {}} for i, counters in enumerate(processes)]))


def test_batch_evidence_proves_several_requests_and_rows_only_by_counting_more_than_calls():
    engine = {"batch_declared": 1}
    batched = {"batch_declared": 1, "batch_forward": 11, "batch_requests": 16,
               "batch_launch": 600, "batch_rows": 1100}
    evidence = serve_gpu.batch_evidence(_with_counters({"result": {}}, engine, batched))
    assert evidence["batch_declared"] == 2 and evidence["batch_forward"] == 11
    assert evidence["several_requests_in_one_forward"] and evidence["several_rows_in_one_launch"]
    # every request alone: one request per forward, one row per launch
    alone = {"batch_forward": 8, "batch_requests": 8, "batch_launch": 300, "batch_rows": 300}
    evidence = serve_gpu.batch_evidence(_with_counters({"result": {}}, alone))
    assert not evidence["several_requests_in_one_forward"]
    assert not evidence["several_rows_in_one_launch"]
    assert serve_gpu.batch_evidence(None)["batch_launch"] == 0


def test_summary_entry_of_the_mixed_batch_says_refused_off_equal_on_and_what_batched(mixed_run):
    on = _with_counters(mixed_run, {"batch_declared": 1, "batch_forward": 10,
                                    "batch_requests": 16, "batch_launch": 500, "batch_rows": 900})
    off = {"name": "sensenova_batch8_off", "rc": 0, "dir": mixed_run["dir"], "log_path": "",
           "result": {"start": "exited", "rc": 1, "requests": {}},
           "log": "ValueError: 'SenseNovaU1Pipeline' does not support request-level batching."}
    summary = serve_gpu.build_summary({"sensenova_batch8_on": on, "sensenova_batch8_off": off})
    json.dumps(summary)
    [entry] = [r for r in summary["requests"] if r["kind"] == serve_gpu.MIXED]
    assert entry["concurrent_equals_serial"] is True and entry["plugin_on_equals_off"] is None
    compare = entry["compare"]
    assert compare["refused_by_vllm_omni_with_plugin_off"] is True
    assert compare["plugin_off_server_start"] == "exited" and compare["max_num_seqs"] == 8
    assert compare["concurrent_vs_serial"]["differing"] == {}
    counters = compare["batch_counters_at_exit"]
    assert counters["several_rows_in_one_launch"] and counters["several_requests_in_one_forward"]
    assert entry["latency_s_on"] == _mixed_entry(mixed_run)["concurrent_wall_s"]
    assert entry["serial_s_on"] == _mixed_entry(mixed_run)["serial_s"]
    assert summary["servers"]["sensenova_batch8_off"]["start"] == "exited"


class _RecordingEchoStub(_EchoStub):
    """``_EchoStub`` that also keeps each request's body (a list of its own)."""

    bodies: ClassVar[list] = []

    def do_POST(self):
        import io

        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.bodies.append(json.loads(body))
        self.rfile = io.BytesIO(body)
        super().do_POST()


def test_load_scenario_sends_warmups_then_each_kind_at_once_at_the_asked_shape(tmp_path):
    """``sensenova_load`` (what benchmarks/sensenova_serve.py times): one warm-up of each kind,
    then N text answers and N think images, each request read by vLLM-Omni's own chat handler as
    the size, steps, think flag and token limit asked for, every prompt distinct."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingEchoStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        args = e2e_serve.parse_args([
            "--scenario", "sensenova_load", "--model", "tiny", "--out", str(tmp_path),
            "--concurrent", "3", "--image-size", "1024", "--sensenova-steps", "50",
            "--text-tokens", "512", "--text-prompt-chars", "500"])
        rec = e2e_serve.Recorder(str(tmp_path), {"scenario": args.scenario})
        e2e_serve.run_sensenova_load(rec, e2e_serve.make_client(url, 30), url, "tiny", args)
    finally:
        server.shutdown()
    report = json.loads((tmp_path / "result.json").read_text())["requests"]
    assert list(report) == ["sensenova_load_warmup", "sensenova_load_text_3",
                            "sensenova_load_think_3"]
    bodies = _RecordingEchoStub.bodies
    assert len(bodies) == 2 + 3 + 3
    texts = [b for b in bodies if b["modalities"] == ["text"]]
    thinks = [b for b in bodies if b["modalities"] == ["image"]]
    assert len(texts) == len(thinks) == 4
    for body in texts:
        _, extras, _ = _diffusion_args(body, "SenseNovaU1Pipeline")
        assert extras["max_tokens"] == 512
        assert len(body["messages"][0]["content"]) == 500
    for body in thinks:
        _, extras, diffusion = _diffusion_args(body, "SenseNovaU1Pipeline")
        assert extras["think"] is True
        assert (diffusion["height"], diffusion["width"], diffusion["num_inference_steps"]) == (
            1024, 1024, 50)
    assert len({b["messages"][0]["content"] for b in texts}) == 4
    assert len({(b["messages"][0]["content"][0]["text"], b["seed"]) for b in thinks}) == 4
    for kind in ("sensenova_load_text_3", "sensenova_load_think_3"):
        entry = report[kind]
        assert "error" not in entry, entry.get("traceback")
        assert len(entry["answers"]) == len(entry["latency_s"]) == 3
        assert entry["wall_s"] >= max(entry["latency_s"])
    think = report["sensenova_load_think_3"]["answers"]
    assert all(a["image_shape"] == [32, 32, 3] and "image" not in a for a in think)
    assert len({a["think_text"] for a in think}) == 3


def test_serve_cases_setting_starts_the_named_servers_and_refuses_unknown_names(monkeypatch):
    """``GRAPHDECODE_SERVE_CASES`` names the servers the GPU module starts (a device call with
    room for a few); a test that reads a case left out skips naming the setting; an unknown
    name is refused with the accepted ones."""
    monkeypatch.delenv("GRAPHDECODE_SERVE_CASES", raising=False)
    assert serve_gpu._cases_asked() is None
    monkeypatch.setenv("GRAPHDECODE_SERVE_CASES", "sensenova_step_on, sensenova_on")
    assert serve_gpu._cases_asked() == ["sensenova_step_on", "sensenova_on"]
    monkeypatch.setenv("GRAPHDECODE_SERVE_CASES", "sensenova_step_on,nope")
    with pytest.raises(ValueError, match="nope not accepted; accepted: sensenova_off"):
        serve_gpu._cases_asked()
    runs = serve_gpu._Runs({"sensenova_step_on": {"rc": 0}}, ["sensenova_step_on"])
    assert runs["sensenova_step_on"] == {"rc": 0}
    with pytest.raises(pytest.skip.Exception, match="sensenova_off not started: "
                                                    "GRAPHDECODE_SERVE_CASES=sensenova_step_on"):
        runs["sensenova_off"]
    every = serve_gpu._Runs({}, None)  # every case asked: a missing one is the fixture's fault
    with pytest.raises(KeyError):
        every["sensenova_off"]


class _Asleep(BaseHTTPRequestHandler):
    """vLLM-Omni 0.30's server around a level-2 sleep, on the wire: sleep answers, wake-up from
    level 1 answers, wake-up from level 2 answers 501 (``AsyncOmni.wake_up`` raises
    NotImplementedError), and a chat request after that is held (admission stays closed)."""

    level = 0
    release = threading.Event()

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/omni/sleep":
            type(self).level = body["level"]
            return self._send(200, {"status": "SUCCESS", "acks": []})
        if self.path == "/v1/omni/wakeup":
            if self.level == 2:
                return self._send(501, {"error": {"message": "wake_up() after sleep(level=2) "
                                                             "is not yet implemented"}})
            return self._send(200, {"status": "SUCCESS", "acks": []})
        if self.level == 2:
            self.release.wait(20)  # held: the client gives up first
        self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "hello"}}]})


def test_request_after_a_refused_wake_up_is_recorded_held_and_named_vllm_omnis_refusal(
        tmp_path, monkeypatch):
    """After level 2 the driver sends the request anyway with ``HELD_S`` to answer; held past
    it, the entry keeps the sleep and the 501 and says it was held, and the GPU module counts it
    as vLLM-Omni's refusal (no counterpart needed: the refusal is the wake-up's). Level 1's
    request is answered and is no refusal; an error after a wake-up that answered is none."""
    monkeypatch.setattr(e2e_serve, "HELD_S", 1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Asleep)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    rec = e2e_serve.Recorder(str(tmp_path), {"start": "ready"})
    args = type("Args", (), {"request_timeout": 30})()
    try:
        e2e_serve._sleep_phase(rec, url, lambda c: e2e_serve.sensenova_text(c, "tiny", "hi", 8),
                               e2e_serve.make_client(url, 30), args)
    finally:
        _Asleep.release.set()
        server.shutdown()
    requests = json.loads((tmp_path / "result.json").read_text())["requests"]
    one, two = requests["sleep_level1"], requests["sleep_level2"]
    assert "error" not in one and one["text"] == "hello" and one["wakeup"]["status"] == 200
    assert two["sleep"]["status"] == 200 and two["wakeup"]["status"] == 501
    assert two["wakeup_refused"] and two["held_after_refused_wakeup"] == 1
    assert "Timeout" in two["error"], two["error"]
    run = {"result": {"requests": requests}}
    refusal = serve_gpu._vllm_omni_refusal(run, None, "sleep_level2")
    assert refusal and "501" in refusal and "held 1 s" in refusal, refusal
    assert serve_gpu._vllm_omni_refusal(run, None, "sleep_level1") is None
    answered = {"result": {"requests": {"sleep_level2": dict(two, wakeup={"status": 200})}}}
    assert serve_gpu._vllm_omni_refusal(answered, None, "sleep_level2") is None
