"""SenseNova-U1's whole pipeline at the tiny checkpoint's size, and image requests through it: the
scaffolding of the denoising and batching tests (split from ``random_models``, which re-exports
every name here)."""

from __future__ import annotations

import contextlib
import os
import threading
from types import SimpleNamespace

import torch


TINY_CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "make_tiny_checkpoints.py")


def write_tiny_checkpoints(out: str) -> str:
    """Run ``examples/make_tiny_checkpoints.py`` into ``out`` (it lives in the repository, not in
    the installed package: FileNotFoundError elsewhere); returns ``out``."""
    import importlib.util

    if not os.path.exists(TINY_CHECKPOINTS):
        raise FileNotFoundError(TINY_CHECKPOINTS)
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoints", TINY_CHECKPOINTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.main([str(out)]) != 0:
        raise RuntimeError(f"{TINY_CHECKPOINTS} {out} failed")
    return str(out)


def load_sensenova_pipeline(checkpoint: str, *, device: str = "cpu", dtype=torch.float32):
    """vllm-omni's ``SenseNovaU1Pipeline`` built by its own ``__init__`` from ``checkpoint`` (a
    directory ``examples/make_tiny_checkpoints.py`` writes) and loaded as vLLM-Omni's loader
    does: every module real, the image heads and the generation pathway included."""
    from .random_models import pipeline_module, setup_runtime

    setup_runtime(device)
    from vllm.config import LoadConfig
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    od_config = OmniDiffusionConfig(model=checkpoint, dtype=dtype)
    with set_default_torch_dtype(dtype):  # as the loader builds it
        pipe = pipeline_module().SenseNovaU1Pipeline(od_config=od_config)
    loader = DiffusersPipelineLoader(LoadConfig(), od_config)
    pipe.load_weights(loader._get_weights_iterator(pipe.weights_sources[0]))
    # What the loader's load_model does next: each linear layer's quant method finishes its
    # weights (on vllm's CPU platform the unquantized method builds its ``cpu_linear`` here).
    with _no_packed_cpu_gemm(device):
        loader._process_weights_after_loading(pipe, torch.device(device))
    return pipe.to(device).eval()


@contextlib.contextmanager
def _no_packed_cpu_gemm(device: str):
    """On vllm's CPU platform without its compiled ``_C`` ops (the test venv), bf16 linear
    layers would be packed for sgl-kernel's GEMM, which lives in ``_C``: route them to the
    dispatcher's next choice instead. Nothing this plugin patches is involved."""
    import vllm.model_executor.layers.utils as layer_utils

    check = getattr(layer_utils, "check_cpu_sgl_kernel", None)
    if device != "cpu" or check is None or hasattr(torch.ops._C, "convert_weight_packed"):
        yield
        return
    layer_utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False
    try:
        yield
    finally:
        layer_utils.check_cpu_sgl_kernel = check


def image_request(prompt: str = "a red cube on a table", **overrides) -> SimpleNamespace:
    """The parsed request ``SenseNovaU1Pipeline._forward_t2i`` / ``_forward_it2i`` take, with
    ``_parse_request``'s fields and defaults (CFG 4, 3 steps, 64x64 here)."""
    values = dict(first_prompt=prompt, prompt=prompt, extra_args={}, image_size=(64, 64),
                  num_steps=3, cfg_scale=4.0, img_cfg_scale=1.0, cfg_norm="none",
                  timestep_shift=3.0, cfg_interval=(0.0, 1.0), batch_size=1, seed=0,
                  think_mode=False, t_eps=0.02)
    values.update(overrides)
    return SimpleNamespace(**values)


def reference_images(n: int = 2, size: int = 48, seed: int = 3) -> list:
    """``n`` random RGB PIL images (edit requests' reference images)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size + 16 * i, 3), dtype=np.uint8))
            for i in range(n)]


def _image(pipe, request, references: int = 0):
    import numpy as np

    with torch.inference_mode():
        if references:
            result = pipe._forward_it2i(request, reference_images(references))
        else:
            result = pipe._forward_t2i(request)
    return np.asarray(result.output["payload"]["image"])


def generate_image(pipe, request, references: int = 0):
    """One image request through the pipeline's own entry (``_forward_t2i``, or ``_forward_it2i``
    with ``references`` random reference images). Returns (the image as a uint8 array, every
    denoising branch step's result in call order, the branch cache of each call)."""
    outs, caches = [], []
    inner = pipe.__dict__.get("_t2i_predict_v")
    step = inner or pipe._t2i_predict_v

    def recorded(*args, **kwargs):
        out = step(*args, **kwargs)
        outs.append(out.clone())
        caches.append(kwargs.get("past_key_values"))
        return out

    pipe._t2i_predict_v = recorded
    try:
        image = _image(pipe, request, references)
    finally:
        _restore(pipe, inner)
    return image, outs, caches


def _restore(pipe, inner) -> None:
    if inner is None:
        del pipe._t2i_predict_v
    else:
        pipe._t2i_predict_v = inner


def interleaved(pipe, requests, *, on_step=None, timeout: float = 300.0) -> list:
    """Run ``requests`` (text-to-image) on ``pipe`` from one thread each, taking turns at every
    denoising branch step (request 0's step, request 1's, ...): requests in flight at once, as a
    server holds them. ``on_step()`` runs after each step, under the turn lock. Returns, per
    request, (image, branch step results) as ``generate_image`` does."""
    inner = pipe.__dict__.get("_t2i_predict_v")
    step = inner or pipe._t2i_predict_v
    n = len(requests)
    turn = threading.Condition()
    state = {"turn": 0}
    done = [False] * n
    names: dict[int, int] = {}
    outs: dict[int, list] = {i: [] for i in range(n)}
    images: dict[int, object] = {}

    def pass_turn(me):
        nxt = (me + 1) % n
        while done[nxt] and nxt != me:
            nxt = (nxt + 1) % n
        state["turn"] = nxt

    def taking_turns(*args, **kwargs):
        me = names[threading.get_ident()]
        with turn:
            if not turn.wait_for(lambda: state["turn"] == me, timeout=timeout):
                raise TimeoutError(f"request {me} never got its turn")
            out = step(*args, **kwargs)
            outs[me].append(out.clone())
            if on_step is not None:
                on_step()
            pass_turn(me)
            turn.notify_all()
        return out

    def worker(i):
        names[threading.get_ident()] = i
        try:
            images[i] = _image(pipe, requests[i])
        finally:
            with turn:
                done[i] = True
                if state["turn"] == i:
                    pass_turn(i)
                turn.notify_all()

    pipe._t2i_predict_v = taking_turns
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        _restore(pipe, inner)
    return [(images.get(i), outs[i]) for i in range(n)]
