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
  server's own ``edit_images`` route.
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

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "e2e_serve.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import e2e_serve


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
