"""SenseNova-U1's real classes at any size, with random weights: for the demo, the tests and the
benchmarks. Nothing is downloaded.

vllm-omni's own ``SenseNovaU1ForCausalLM`` and ``SenseNovaU1Pipeline`` think/text loops, with a
tokenizer built locally. Nothing this plugin patches is replaced by a stand-in.

On CPU the model needs four adjustments, none of which touches the code the plugin patches:
a world-size-1 vllm process group (gloo), an SDPA diffusion attention backend for the CPU
platform (it has none), SDPA's CUDA forward used as its forward (it is plain torch), and the
Triton fused qk-norm+rope kernel hidden so the model takes its PyTorch fallback.

The pipeline object is made with ``object.__new__`` and ``nn.Module.__init__``: its real
``__init__`` resolves a checkpoint directory. The think/text loops only read ``language_model``,
``tokenizer`` and ``device`` from it, and the plugin's eligibility rules read ``od_config``.

Works for vllm-omni 0.28 (run from a subprocess with its tree first on ``sys.path``) and 0.30 on
CPU, and for 0.26/0.30 on a CUDA host (``device="cuda"``, where the real CUDA platform is used).

The whole pipeline at the tiny checkpoint's size, and image requests through it
(``load_sensenova_pipeline``, ``generate_image``, ``interleaved``): the scaffolding of the
denoising and batching tests. What is not SenseNova's (the LoRA adapter binding, ``ObservedLock``)
is in ``common.py``; Qwen-Image-2.1's builders are in ``qwen.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from types import SimpleNamespace

import torch
import torch.nn as nn

_FUSED_ROPE = "vllm_omni.diffusion.models.sensenova_u1.fused_rmsnorm_rope"
SDPA_BACKEND = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<img>", "</img>",
                  "<IMG_CONTEXT>", "\n\n"]
# The think loop ends on these; the tests keep the model from choosing them (see build_lm).
STOP_TOKENS = ("<|im_end|>", "</think>")

_lock = threading.Lock()
_runtime: dict = {}


def setup_runtime(device: str = "cpu") -> None:
    """Make vllm/vllm-omni able to build and run the model on ``device`` in this process.
    Idempotent per device; one world-size-1 process group serves both."""
    with _lock:
        if device in _runtime:
            return
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        # Without a GPU vllm's platform is "unspecified" and cannot infer a device: name it.
        vllm_config = VllmConfig(device_config=DeviceConfig(device=device))
        ctx = set_current_vllm_config(vllm_config)
        ctx.__enter__()  # stays entered: vllm layers read the current config when they are built
        _runtime[device] = ctx
        if device == "cuda":
            torch.cuda.set_device(0)
        if not ps.model_parallel_is_initialized():
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0,
                backend="nccl" if device == "cuda" else "gloo",
                distributed_init_method=f"tcp://127.0.0.1:{port}")
            ps.ensure_model_parallel_initialized(1, 1)
        _omni_groups("nccl" if device == "cuda" else "gloo")
        if device == "cpu":
            _cpu_attention()
            # The Triton kernel cannot run without a GPU; the module falls back to PyTorch.
            sys.modules[_FUSED_ROPE] = None


def _omni_groups(backend: str) -> None:
    """vllm-omni's world group and classifier-free-guidance group, of one rank each. Its
    diffusion worker makes them beside vllm's groups: SenseNova-U1's denoising asks for the CFG
    group's size at every CFG step (0.24-0.28 assert that it exists), and the worker's
    cancellation check (0.30) reads the world group's size. Only those two: the others vllm's
    initialisation above made."""
    try:
        from vllm_omni.diffusion.distributed import parallel_state as ops
    except ImportError:
        return
    if getattr(ops, "_WORLD", "absent") is None:
        ops._WORLD = ops.init_world_group([0], 0, backend)
    if getattr(ops, "_CFG", "absent") is None:
        ops._CFG = ops.init_model_parallel_group(
            group_ranks=[[0]], local_rank=0, backend=backend,
            parallel_mode="classifier_free_guidance")


@contextlib.contextmanager
def production_rope():
    """Let CUDA models use the Triton fused qk-norm+rope kernel even if a CPU model hid it."""
    hidden = _FUSED_ROPE in sys.modules and sys.modules[_FUSED_ROPE] is None
    if hidden:
        del sys.modules[_FUSED_ROPE]
    try:
        yield
    finally:
        if hidden:
            sys.modules[_FUSED_ROPE] = None


def _cpu_attention() -> None:
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
    from vllm_omni.platforms import current_omni_platform

    platform_cls = type(current_omni_platform)

    def get_diffusion_attn_backend_cls(cls, *args, **kwargs):
        return SDPA_BACKEND

    platform_cls.get_diffusion_attn_backend_cls = classmethod(get_diffusion_attn_backend_cls)
    SDPAImpl.forward = SDPAImpl.forward_cuda


def llm_config(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=96,
               intermediate=128):
    return SimpleNamespace(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_act="silu", rms_norm_eps=1e-6, vocab_size=vocab, rope_theta=1000000.0,
        rope_theta_hw=10000.0, max_position_embeddings=4096, max_position_embeddings_hw=1000,
        attention_bias=True, layer_types=["full_attention"] * num_layers,
        tie_word_embeddings=False,
    )


def transformer_module():
    from vllm_omni.diffusion.models.sensenova_u1 import sensenova_u1_transformer

    return sensenova_u1_transformer


def pipeline_module():
    from vllm_omni.diffusion.models.sensenova_u1 import pipeline_sensenova_u1

    return pipeline_sensenova_u1


def build_lm(config=None, *, device="cpu", dtype=torch.float32, seed=0, banned_ids=(),
             on_device_init=False):
    """A real ``SenseNovaU1ForCausalLM`` with random weights.

    ``banned_ids``: vocabulary rows of ``lm_head`` set to zero, so those tokens get logit 0 while
    the best of the others is almost surely positive: the loops then run to their step limit
    instead of stopping early at an end token.
    ``on_device_init``: draw the weights on ``device`` with its own generator (same distribution,
    other values): the benchmarks' real shape (17.5 B parameters) would otherwise spend most of
    its build drawing them on the host.
    """
    from vllm.utils.torch_utils import set_default_torch_dtype

    setup_runtime(device)
    T = transformer_module()
    config = config or llm_config()
    torch.manual_seed(seed)
    with set_default_torch_dtype(dtype), torch.device(device):
        lm = T.SenseNovaU1ForCausalLM(config, prefix="language_model")
    on_device = on_device_init and torch.device(device).type != "cpu"
    gen = torch.Generator(device=device if on_device else "cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif on_device:
                p.normal_(0.0, 0.15, generator=gen)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        for i in banned_ids:
            lm.lm_head.weight[i].zero_()
    for module in lm.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            try:
                method.process_weights_after_loading(module)
            except AttributeError as exc:
                # vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu) on a CPU with AMX packs a small
                # bf16 weight through vllm._C's convert_weight_packed, which vLLM's CUDA wheel
                # lacks; the layer then computes as vLLM does where no packed kernel exists.
                if "convert_weight_packed" not in str(exc):
                    raise
                module.cpu_linear = torch.nn.functional.linear
    return lm.eval()


def build_tokenizer(vocab_size=96):
    """A WordLevel tokenizer with SenseNova's special tokens, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS) - 1)]
    vocab = {"[UNK]": 0}
    for tok in SPECIAL_TOKENS + words:
        vocab[tok] = len(vocab)
    assert len(vocab) <= vocab_size
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return fast


def stop_ids(tokenizer):
    return [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]


def default_od_config(**overrides):
    """The ``OmniDiffusionConfig`` fields the plugin reads, at their defaults."""
    values = dict(enable_cpu_offload=False, enable_layerwise_offload=False,
                  enable_distributed_layerwise_offload=False, diffusion_kv_cache_dtype=None,
                  parallel_config=SimpleNamespace(tensor_parallel_size=1))
    values.update(overrides)
    return SimpleNamespace(**values)


def build_pipeline(lm, tokenizer, *, device="cpu", od_config=None, cls=None):
    """A ``SenseNovaU1Pipeline`` holding ``lm`` and ``tokenizer``, without its checkpoint load."""
    cls = cls or pipeline_module().SenseNovaU1Pipeline
    pipe = object.__new__(cls)
    nn.Module.__init__(pipe)
    pipe.language_model = lm
    pipe.tokenizer = tokenizer
    pipe.device = torch.device(device)
    pipe.od_config = od_config or default_od_config()
    return pipe


def prompt_ids(tokenizer, n, seed=1, device="cpu"):
    """``n`` ordinary word tokens (no special tokens), as a [1, n] tensor."""
    gen = torch.Generator().manual_seed(seed)
    words = [f"w{int(i)}" for i in torch.randint(0, 40, (n,), generator=gen)]
    ids = tokenizer(" ".join(words), return_tensors="pt", add_special_tokens=False)["input_ids"]
    return ids.to(device)


def prefill(pipe, input_ids):
    """The prefill the pipeline runs before a think/text loop (``_forward_t2i``, ``_forward_text``).

    Returns (outputs, past_key_values, t_idx).
    """
    T = transformer_module()
    t = torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    indexes = torch.stack([t, torch.zeros_like(t), torch.zeros_like(t)], dim=0)
    mask = {"full_attention": T.create_block_causal_mask(indexes[0])}
    with torch.inference_mode():
        out = pipe.language_model(input_ids=input_ids, indexes=indexes, attention_mask=mask,
                                  use_cache=True)
    return out, out.past_key_values, int(indexes[0].max().item())


def run_think(pipe, input_ids, max_think_tokens):
    """Prefill + ``_generate_think``; returns (cache, t_idx, think_text)."""
    out, cache, t_idx = prefill(pipe, input_ids)
    with torch.inference_mode():
        return pipe._generate_think(out, cache, t_idx, max_think_tokens=max_think_tokens)


def run_text(pipe, input_ids, max_tokens):
    """Prefill + ``_generate_text``; returns the decoded text."""
    out, cache, t_idx = prefill(pipe, input_ids)
    with torch.inference_mode():
        return pipe._generate_text(out.logits, cache, t_idx, max_tokens=max_tokens)


def run_sampled_text(pipe, input_ids, max_tokens, *, seed: int, temperature: float):
    """Prefill + ``_generate_text`` sampling (``do_sample``) at ``temperature``, the default
    generators seeded with ``seed`` after the prefill; returns the decoded text."""
    out, cache, t_idx = prefill(pipe, input_ids)
    torch.manual_seed(seed)
    with torch.inference_mode():
        return pipe._generate_text(out.logits, cache, t_idx, max_tokens=max_tokens,
                                   do_sample=True, temperature=temperature)


def record_ar_steps(pipe) -> list:
    """Observe every ``_ar_step`` the loops make on ``pipe``: returns a list that fills with the
    last-position logits (float32 copies) of each step.

    Wraps whatever ``_ar_step`` the instance has now (the plugin's, when wired), from outside: the
    plugin's code runs unchanged underneath. Copies are taken at once because a graph replay
    reuses its output buffer.
    """
    inner = pipe._ar_step
    seen: list[torch.Tensor] = []

    def _ar_step(*args, **kwargs):
        out = inner(*args, **kwargs)
        seen.append(out.logits[:, -1].detach().float().clone())
        return out

    pipe._ar_step = _ar_step
    return seen


def add_lora_wrappers(lm, rank=8):
    """Wrap every layer's ``o_proj`` the way vllm-omni's diffusion LoRA manager does
    (``from_layer_diffusion``), with no adapter bound yet. Returns the wrappers."""
    from vllm_omni.diffusion.lora.utils import from_layer_diffusion

    try:  # vllm-omni 0.26 has its own LoRAConfig; 0.28+ use vllm's
        from vllm_omni.config.lora import LoRAConfig
    except ImportError:
        from vllm.config.lora import LoRAConfig

    dtype = next(lm.parameters()).dtype
    lora_config = LoRAConfig(max_lora_rank=rank, max_loras=1, max_cpu_loras=1, lora_dtype=dtype,
                             fully_sharded_loras=False)
    wrappers = []
    for layer in lm.model.layers:
        attn = layer.self_attn
        wrapper = from_layer_diffusion(layer=attn.o_proj, max_loras=1, lora_config=lora_config,
                                       packed_modules_list=[], model_config=None)
        assert wrapper is not attn.o_proj, "o_proj was not wrapped"
        attn.o_proj = wrapper
        wrappers.append(wrapper)
    return wrappers


def random_prefix(lm, length: int, *, seed: int = 0):
    """A prefill's result without running it: random post-RoPE-like K/V of ``length`` tokens per
    layer and random last-position logits. Returns (prefix_logits, make_cache), ``make_cache()``
    giving a fresh ``DynamicCache`` over the same tensors (the eager loop appends by ``torch.cat``,
    which leaves them untouched)."""
    from transformers import DynamicCache

    cfg = lm.config
    param = next(lm.parameters())
    gen = torch.Generator(device=param.device).manual_seed(seed)
    shape = (1, cfg.num_key_value_heads, length, cfg.head_dim)
    kv = [(torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype),
           torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype))
          for _ in range(cfg.num_hidden_layers)]
    logits = torch.randn(1, 1, cfg.vocab_size, generator=gen, device=param.device,
                         dtype=torch.float32)

    def make_cache():
        cache = DynamicCache()
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
        return cache

    return logits, make_cache


def has_intree_paged_decode() -> bool:
    """vllm-omni >= 0.30 ships its own SenseNova-U1 paged decode."""
    return hasattr(pipeline_module().SenseNovaU1Pipeline, "_decode_context")


def flashinfer_status() -> str:
    """Why the benchmark's end-to-end FlashInfer decode row carries a note instead of a time."""
    kernel_level = ("kernel level: rows attention_paged_decode_ctxN (bench.py --cases attention, "
                    "with .gpu-bundle-fi from scripts/gpu/build_flashinfer_bundle.sh)")
    try:
        import flashinfer
    except Exception as exc:
        return (f"not measured: flashinfer is not importable here ({type(exc).__name__}: {exc}); "
                f"vllm 0.26.0 pins flashinfer-python 0.6.14, which the offline bundle leaves out; "
                f"{kernel_level}")
    return (f"not measured end to end: flashinfer {getattr(flashinfer, '__version__', '?')} is "
            f"importable, but the plugin's paged decode calls FlashAttention only; {kernel_level}")


# -- the whole pipeline (image generation included) -------------------------------------------

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


class StepServer:
    """vLLM-Omni's step execution as its engine drives it, in this process: the real
    ``StepScheduler`` (admission, its batch key) and the real ``DiffusionModelRunner``'s
    stepwise path (``_execute_stepwise``: states, input batch, ``prepare_encode``,
    ``denoise_step``, ``step_scheduler``, ``post_decode``) around ``pipe``, which is the runner's
    pipeline. ``tick()`` is one pass of the engine's busy loop: schedule, execute, update.

    Not the engine's process split or its output formatting: the runner's peak-memory sampling
    is off (vLLM's CPU platform has none)."""

    def __init__(self, pipe, *, max_num_seqs: int = 8, device: str = "cpu"):
        from vllm.config import DeviceConfig, VllmConfig
        from vllm_omni.diffusion.sched.step_scheduler import StepScheduler
        from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

        od = pipe.od_config
        od.step_execution = True
        od.max_num_seqs = max_num_seqs
        od.model_class_name = type(pipe).__name__
        self.pipe = pipe
        self.runner = DiffusionModelRunner(VllmConfig(device_config=DeviceConfig(device=device)),
                                           od, torch.device(device))
        self.runner.pipeline = pipe
        self.scheduler = StepScheduler()
        self.scheduler.initialize(od)
        self.outputs: dict[str, object] = {}  # request id -> DiffusionOutput
        self.finished_at: dict[str, int] = {}  # request id -> tick
        self.ticks = 0

    def add(self, request) -> None:
        self.scheduler.add_request(request)

    def running(self) -> list[str]:
        return list(self.scheduler._running)

    def abort(self, request_id: str) -> None:
        from vllm_omni.diffusion.sched.interface import DiffusionRequestStatus

        self.scheduler.finish_requests(request_id, DiffusionRequestStatus.FINISHED_ABORTED)

    def tick(self) -> list[str]:
        """One engine step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        result = self.runner._execute_stepwise(out, validate_kv_metadata=True,
                                               record_output_peak_memory=False)
        finished = []
        for o in result.runner_outputs:
            if o.finished:
                self.outputs[o.request_id] = o.result
                self.finished_at[o.request_id] = self.ticks
                finished.append(o.request_id)
        self.scheduler.update_from_output(out, result)
        self.ticks += 1
        return finished

    def run(self, limit: int = 10_000) -> dict[str, object]:
        """Tick until no request is left; returns every output by request id."""
        while self.scheduler.has_requests():
            self.tick()
            if self.ticks > limit:
                raise RuntimeError(f"requests still running after {limit} steps")
        return self.outputs
