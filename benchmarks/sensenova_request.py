"""One whole SenseNova-U1 text-to-image request through vllm-omni's own pipeline: eager vs wired.

    python3 benchmarks/sensenova_request.py --out DIR --size 1024 --steps 50 --cfg 4 --think both

(the H200 command: real layer shapes, random bf16 weights, ~5 minutes, ~38 GB of device memory)
prints the rows as JSON and writes ``DIR/sensenova-request.json`` and
``DIR/sensenova-request.log``.
``--tiny --device cpu --size 64 --steps 2 --think-tokens 8`` runs the same harness on the tiny
checkpoint (``examples/make_tiny_checkpoints.py``) in seconds, for the CPU test. On the offline
GPU host run it in the environment ``scripts/gpu/run_suite.sh`` sets up (bundle unpacked;
``STACK=0.30``: ``PYTHONPATH=CHECKOUT:/tmp/site-project:/tmp/site-omni-0.30.0:/tmp/site``,
``VLLM_TARGET_DEVICE=cuda``, ``CUDA_CACHE_MAXSIZE=4294967296`` so FA2's ~100 s JIT of the in-tree
decode is paid once per host, in the eager side's first think request).

Why this exists (issue #13, step 1: measure first)
    ``bench.py`` times SenseNova-U1's think decode and nothing else. A user waits for a whole
    image: the prefill of both CFG prompts, the think decode (think on), the copy of each prefix
    into the denoising buffers, ``--steps`` denoising steps of the generation pathway per CFG
    branch, and the conversion to a PIL image. This file measures that, through
    ``SenseNovaU1Pipeline.forward`` with a real ``DiffusionRequestBatch``, nothing stubbed, and
    says where the time goes, so the plugin's next step is chosen by numbers.

Sides (one process, one pipeline object, same seed and request)
    eager   the pipeline as vllm-omni ships it. On 0.30 that is its default path: the in-tree
            paged decode (``VLLM_OMNI_SENSENOVA_PAGED_DECODE``, default on) for think tokens,
            the pipeline's own denoising steps.
    plugin  then ``vllm_omni_graphdecode.hooks.sensenova_u1.install(pipeline, cfg, None)`` on the
            same object, ``cfg`` parsed from the environment with ``VLLM_OMNI_GRAPHDECODE=1`` and
            ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE`` (``--denoise``: graph, or fast) set for
            that side only (both recorded in the JSON; a value the config rejects is recorded
            and the side goes on without it).
            Under the default ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE=defer`` the think decode
            stays vllm-omni's own on 0.30, so the plugin side differs in its denoising only.
    The plugin is installed on the eager side's object (there is no uninstall, so eager runs
    first): both sides use the very same weight tensors, and on 0.30 the same in-tree decode
    buffers and graphs, so a second capture into vLLM's graph pool after freed graphs (torch
    2.11's ``use_count > 0`` assert, FACTS 4) cannot happen here.

What is timed, per side and think mode
    ``--warmup`` requests (default 1; the first one's time is ``first_ms``: captures, compiles,
    FA2's JIT on the first in-tree decode), then ``--repeats`` timed requests (``ms``: median). A
    request is timed from a synchronised start to a synchronised end, CUDA events on a GPU
    (``perf_counter`` on a CPU). Inside it, events are recorded (never waited on) by wrappers on
    the pipeline *instance* (the class and the language model are left alone: a hook on the
    language model would make the plugin refuse it), outermost over whatever the plugin wired:

        setup_ms           ``_init_noise_and_schedule`` (noise, timesteps)
        prefill_cond_ms    think off: ``_t2i_prefix_forward`` of the cond prompt; think on: from
                           the last ``_build_t2i_image_indexes`` to ``_generate_think``, i.e. the
                           ``language_model`` prefill with logits and its ``.item()``
        prefill_uncond_ms  ``_t2i_prefix_forward`` of the uncond prompt
        think_ms           ``_generate_think`` (decode, then its "\\n\\n<img>" append)
        prepare_kv_ms      ``_expand_and_prepare_kv`` (each prefix copied into prefix + image
                           buffers)
        denoise_steps_ms   the steps of ``_run_denoising_loop``: step i ends when its ``_denoise``
                           returns; its Euler update and unpatchify land in step i + 1
        final_image_ms     last ``_denoise`` return to ``_run_denoising_loop`` return: the last
                           update, cache cleanup and ``_to_pil`` (device-to-host copy, uint8)
        host_gap_ms        total minus the parts above (parsing, tokenizing, index building)

    Per step: each ``_t2i_predict_v`` call, grouped by branch (the cache object passed is
    ``caches["cond"]`` or ``caches["uncond"]``), and ``outside_ms`` = step minus its branches
    (``_extract_feature``'s generation vision embedding, the timestep and noise-scale embedders,
    ``combine_cfg_noise``, the Euler update, and the host syncs of ``_denoise``'s interval tests);
    ``extract_feature_ms`` and ``combine_ms`` are measured inside it.

    Think on decodes exactly ``--think-tokens`` tokens: the pipeline's ``_forward_t2i`` calls
    ``_generate_think`` without a limit (1024 fixed), so the instance wrapper passes
    ``max_think_tokens``; and the ``lm_head`` rows of ``<|im_end|>`` and ``</think>`` are zero
    (logit exactly 0 while the best of the other ~152k random logits is positive: the loop never
    stops early), as ``bench.py``'s think case does. That changes one row of one matrix, not the
    work. The decoded count is checked from ``_generate_think``'s returned position.

    With CUDA, one more request per side and mode (2 steps, untimed) runs under
    ``torch.cuda.set_sync_debug_mode("warn")`` and counts the host syncs by phase (``syncs``):
    what a captured step must not contain.

    ``--rounding-references``: after the eager side, the think-off request again under each
    rounding vllm-omni ships or has shipped (``ROUNDING_REFERENCES``: its PyTorch rope fallback
    for its Triton kernel; the other releases' ``Qwen3RMSNorm``), with its PSNR against eager's
    image and the plugin's (``environment.rounding_references``). With random weights 50 steps
    amplify any rounding difference; these say how far the release's own variants drift, the
    scale on which a fast mode's PSNR is read.

Rows
    ``sensenova_t2i_SIZE`` (think off), ``sensenova_t2i_think_SIZE`` (think on): whole request,
    ``eager_ms``, ``ours_ms``, ``speedup``, ``first_*_ms``, ``psnr_db`` and ``ssim`` of the
    plugin's PIL image against eager's (``"inf"`` and 1.0: equal), ``breakdown`` per side, think tokens, the plugin's counters
    over its timed request and its fallbacks, host syncs.
    ``sensenova_image_step_SIZE``: one denoising step, all branches (median over the steps of the
    think-off request, else the think-on one): ``eager_ms``, ``ours_ms``, and ``floor_ms`` = the
    branches' FLOPs over the bf16 matmul rate measured in this run (``common.matmul_flops_per_s``):
    per branch ``2 * P * T`` for the generation pathway's linear weights (every ``*_mot_gen``
    projection and MLP of the 42 layers, plus ``fm_head``) over the ``T`` image tokens, plus
    ``4 * T * (prefix + T) * heads * head_dim`` of attention per layer, ``prefix`` being that
    branch's measured prefix. ``outside_floor_ms`` is the same bound for the work outside the
    branches (generation vision embedding, timestep and noise-scale embedders).
    ``--tiny`` rows carry a ``_tiny`` suffix.

What is real and what is random (``--size`` is the image side; the model is the real shape)
    Real: vllm-omni's ``SenseNovaU1Pipeline`` built by its own ``__init__`` from a config.json
    written here (every module, the ``*_mot_gen`` generation weights included), its
    ``forward``, request parsing, prompts (its system message), schedule, CFG and image
    conversion; the plugin's ``install``.
    Random: every weight (bf16, drawn on the device: norms 1, biases N(0, 0.02), the rest
    N(0, 1/fan_in)); so the think text and the image are noise. The tokenizer is a word-level
    stand-in (one token per word or punctuation run, "\\n" and "\\n\\n" as tokens, 151,936 ids)
    built here: the system message is ~280 positions with it and the cond prompt 350, close to
    Qwen's BPE on that English text; the uncond prompt has the same 9 tokens as with Qwen's. The
    prefix lengths each branch attends to are reported.
    Model shape (``REAL``): language model 42 layers, hidden 4096, 32 heads, 8 KV heads, head_dim
    128, MLP 12288, vocabulary 151,936, no attention bias, rope theta 5e6 (hw 1e4) -- FACTS 6 and
    bench.py. Vision (understanding and generation copies): hidden 1024, patch 16, downsample 0.5:
    not read from the release's config.json (not downloadable here); 1024 is vllm-omni's
    ``SenseNovaU1VisionConfig`` default and what public test fixtures quoting the 8B-MoT config
    say, 16 is what ``make_tiny_checkpoints`` names as the released patch. fm_head: vllm-omni's
    fixed 4096-wide 2-layer MLP to 3 * 32**2 (its ``fm_head_dim`` is ignored); noise-scale
    embedder on, noise scale mode "resolution", base 64, max 16 (the same fixtures; they change
    values, not work). 17.55 B parameters, the released model's count (FACTS 6; the test builds
    this shape on the meta device and checks it), 35.1 GB bf16.

Numbers: ``benchmarks/results/h200-2026-12-01b`` (eager, exact mode) and ``h200-2026-12-01c``
(fast mode, rounding references). 35.1 GB of weights, a peak of ~34-36 GB (prefill logits,
prefix + image K/V buffers of both branches, the in-tree decode cache, the plugin's static
buffers and graphs; measured: ``*_peak_memory_mib`` in the environment). The wrappers add a
few Python calls and event records per step (microseconds against a step of tens of
milliseconds).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from types import SimpleNamespace
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here loads from the Hub; never try

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "examples"), os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import common  # noqa: E402
import make_tiny_checkpoints as tiny  # noqa: E402  (examples/: the tiny checkpoint and its layout)

PROMPT = (
    "A cozy bookshop on a rainy evening in an old European street, warm light spilling from tall "
    "windows onto wet cobblestones, a ginger cat asleep on a stack of books in the display, a "
    "hand-painted wooden sign above the door reading \"Chapter One Books\", people with umbrellas "
    "walking past, reflections in the puddles, soft cinematic lighting, rich colors, ultra "
    "detailed, photorealistic, 4K."
)

# The released SenseNova-U1-8B-MoT shape (see the module docstring for each number's source).
REAL = dict(num_layers=42, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
            vision_hidden=1024, patch_size=16, add_noise_scale_embedding=True)
REAL_VOCAB = 151936
REAL_TOP = dict(noise_scale=1.0, noise_scale_mode="resolution", noise_scale_base_image_seq_len=64,
                noise_scale_max_value=16.0, t_eps=0.05)
REAL_LLM = dict(max_position_embeddings=262144, max_position_embeddings_hw=10000)
REAL_SOURCES = {
    "language_model": "42 layers, hidden 4096, 32/8 heads x 128, MLP 12288, vocab 151936: FACTS 6, "
                      "bench.py SENSENOVA_SHAPE",
    "vision_hidden_size": "1024: vllm-omni SenseNovaU1VisionConfig default and public fixtures "
                          "quoting the 8B-MoT config.json; the release's file not seen (guess)",
    "patch_size": "16: make_tiny_checkpoints ('the released model uses 16') and the same fixtures",
    "fm_head": "Linear(4096, 4096) GELU Linear(4096, 3072): fixed in vllm-omni's pipeline",
    "noise_scale": "mode resolution, base 64, max 16, noise-scale embedder on: public fixtures "
                   "(guess; values only, not work)",
    "tokenizer": "word-level stand-in built here, 151936 ids (not Qwen's BPE)",
}

# Set for the plugin side only.
PLUGIN_ENV = {"VLLM_OMNI_GRAPHDECODE": "1", "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE": "graph"}
DENOISE_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE"
FP8_VAR = "VLLM_OMNI_GRAPHDECODE_FP8"
INTREE_VAR = "VLLM_OMNI_SENSENOVA_PAGED_DECODE"
END_TOKENS = ("<|im_end|>", "</think>")  # the think loop's stops: lm_head rows zeroed
BRANCHES = ("cond", "img_cond", "uncond")
PARTS = ("setup_ms", "prefill_cond_ms", "prefill_uncond_ms", "think_ms", "prepare_kv_ms",
         "denoise_steps_ms", "final_image_ms")


class Log:
    """Lines to stderr and to ``sensenova-request.log``."""

    def __init__(self, path: str | None = None):
        self.path = path

    def __call__(self, msg: str) -> None:
        line = f"[sensenova-request {time.strftime('%H:%M:%S')}] {msg}"
        print(line, file=sys.stderr, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


# -- building ------------------------------------------------------------------------------------

def _pipeline_module():
    from vllm_omni.diffusion.models.sensenova_u1 import pipeline_sensenova_u1

    return pipeline_sensenova_u1


def word_tokenizer(texts: list[str], vocab_size: int):
    """A word-level ``PreTrainedTokenizerFast``: SenseNova's special tokens, "\\n\\n" and "\\n"
    atomic, one id per word or punctuation run of ``texts``, filler words up to ``vocab_size``
    (so every id the model can emit decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = tiny.SENSENOVA_SPECIAL_TOKENS + ["\n\n", "\n"]
    split = pre_tokenizers.Whitespace()
    vocab = {"[UNK]": 0}
    for token in special:
        vocab[token] = len(vocab)
    for text in texts:
        for word, _ in split.pre_tokenize_str(text):
            vocab.setdefault(word, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = split
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": [
        t for t in special if t not in ("<|im_end|>", "<|endoftext|>")]})
    return fast


def real_config(shape: dict = REAL, vocab_size: int = REAL_VOCAB) -> dict:
    """``config.json`` at the released shape (or ``shape``), in make_tiny_checkpoints' layout."""
    cfg = tiny.sensenova_config(vocab_size, **shape)
    cfg.update(REAL_TOP)
    cfg["llm_config"].update(REAL_LLM)
    return cfg


def write_real_checkpoint(path: str, prompt: str, shape: dict = REAL,
                          vocab_size: int = REAL_VOCAB) -> str:
    """config.json and the word-level tokenizer; no weights (they are drawn on the device)."""
    mod = _pipeline_module()
    os.makedirs(path, exist_ok=True)
    queries = [mod._build_t2i_query(prompt, system_message=mod.SYSTEM_MESSAGE_FOR_GEN,
                                    append_text="<think>\n"),
               mod._build_t2i_query("", append_text="<img>")]
    word_tokenizer(queries, vocab_size).save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(real_config(shape, vocab_size), f, indent=2)
    return path


def construct_pipeline(checkpoint: str, device: torch.device, dtype: torch.dtype):
    """``SenseNovaU1Pipeline`` by its own ``__init__``, every parameter allocated on ``device``
    (uninitialised; ``meta`` allocates nothing), as vLLM-Omni's loader builds it."""
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    od_config = OmniDiffusionConfig(model=checkpoint, dtype=dtype)
    with set_default_torch_dtype(dtype), torch.device(device):
        return _pipeline_module().SenseNovaU1Pipeline(od_config=od_config)


@torch.no_grad()
def init_random_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn in place on its device, in ``named_parameters`` order from one
    seeded generator: norms 1, biases N(0, 0.02), the rest N(0, 1/fan_in) (the scale
    make_tiny_checkpoints uses: activations stay O(1) through 42 layers in bf16)."""
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in module.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.02, generator=gen)
        else:
            fan_in = math.prod(p.shape[1:]) if p.dim() > 1 else p.shape[0]
            p.normal_(0.0, fan_in ** -0.5, generator=gen)


def build_real_pipeline(device: torch.device, dtype: torch.dtype, seed: int, workdir: str,
                        prompt: str, shape: dict = REAL, vocab_size: int = REAL_VOCAB):
    """The pipeline at the released shape (``shape``: the CPU test's small one) on ``device``,
    weights drawn there, the end tokens' ``lm_head`` rows zeroed, then finished as vLLM-Omni's
    loader finishes them."""
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    from vllm_omni_graphdecode.testing import sensenova as rm

    rm.setup_runtime(device.type)
    ckpt = write_real_checkpoint(os.path.join(workdir, "sensenova_u1_real"), prompt, shape,
                                 vocab_size)
    pipe = construct_pipeline(ckpt, device, dtype)
    init_random_(pipe, seed)
    with torch.no_grad():
        pipe.language_model.lm_head.weight[end_token_ids(pipe.tokenizer)] = 0
    loader = DiffusersPipelineLoader(LoadConfig(), pipe.od_config)
    with rm._no_packed_cpu_gemm(device.type):  # CPU without vllm's _C (the CPU test)
        loader._process_weights_after_loading(pipe, device)
    return pipe.eval()


def build_tiny_pipeline(device: torch.device, dtype: torch.dtype, seed: int, workdir: str):
    """The tiny checkpoint (make_tiny_checkpoints) with its end tokens' ``lm_head`` rows zeroed in
    the file, loaded by vLLM-Omni's own loader (``sensenova.load_sensenova_pipeline``)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from vllm_omni_graphdecode.testing import sensenova as rm

    ckpt = os.path.join(workdir, "sensenova_u1_tiny")
    tiny.write_sensenova_u1(ckpt, seed=seed)
    weights = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(weights)
    tensors["language_model.lm_head.weight"][end_token_ids(AutoTokenizer.from_pretrained(ckpt))] = 0
    save_file(tensors, weights, metadata={"format": "pt"})
    return rm.load_sensenova_pipeline(ckpt, device=device.type, dtype=dtype)


def end_token_ids(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in END_TOKENS]


def param_counts(pipe) -> dict[str, int]:
    counts = collections.Counter()
    for name, p in pipe.named_parameters():
        if name.startswith("language_model."):
            part = "language_model_gen" if "_mot_gen" in name else "language_model_und"
            counts[part] += p.numel()
        else:
            counts[name.split(".")[0]] += p.numel()
    counts["total"] = sum(p.numel() for p in pipe.parameters())
    return dict(counts)


# -- the request ---------------------------------------------------------------------------------

def make_request(*, size: int, steps: int, cfg: float, think: bool, seed: int, prompt: str,
                 tag: str):
    """What vLLM-Omni's runner hands ``forward``: a ``DiffusionRequestBatch`` of one request."""
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    params = OmniDiffusionSamplingParams(
        seed=seed, height=size, width=size, num_inference_steps=steps,
        extra_args={"cfg_scale": float(cfg), "think": bool(think)})
    try:
        from vllm_omni.diffusion.request import OmniDiffusionRequest
        from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    except ImportError:  # before 0.30 the runner handed the request itself, with a prompt list
        return SimpleNamespace(prompts=[{"prompt": prompt}], sampling_params=params,
                               request_id=f"bench-{tag}")
    return DiffusionRequestBatch([OmniDiffusionRequest(prompt={"prompt": prompt},
                                                       sampling_params=params,
                                                       request_id=f"bench-{tag}")])


class Instrumented:
    """Wrappers on the pipeline instance (never the class, never the language model), outermost
    over whatever is there now (the plugin's wrappers included), for one request; restored on
    exit. ``think_tokens`` is passed to ``_generate_think`` as ``max_think_tokens``."""

    METHODS = ("_init_noise_and_schedule", "_build_t2i_image_indexes", "_t2i_prefix_forward",
               "_generate_think", "_expand_and_prepare_kv", "_run_denoising_loop",
               "_extract_feature", "_denoise", "_t2i_predict_v", "combine_cfg_noise")

    def __init__(self, pipe, marks: common.Marks, think_tokens: int):
        self.pipe, self.marks, self.think_tokens = pipe, marks, think_tokens
        self.saved: dict[str, Any] = {}
        self.setup: list = []
        self.prefix: list = []          # (start, end, returned cache)
        self.last_indexes = None        # end mark of the latest _build_t2i_image_indexes
        self.think: list = []           # (prefill start, start, end, t_idx in, t_idx out)
        self.prepare: list = []
        self.loop = None                # (start, end)
        self.labels: dict[int, str] = {}  # id(branch cache) -> "cond" / "uncond" / "img_cond"
        self.branch_info: dict[str, dict] = {}
        self.step_ends: list = []
        self.calls: list = []           # (start, end, branch, step)
        self.extract: list = []         # (start, end, step)
        self.combine: list = []         # (start, end, step)
        self.num_steps = 0
        self.phase: list[str] = []

    # -- phases (the sync audit attributes each host sync to the innermost one) --------------

    def current_phase(self) -> str:
        if not self.phase:
            return "request_other"
        top = self.phase[-1]
        if top == "loop":
            return "final_image" if len(self.step_ends) >= self.num_steps else "step_outside"
        return top

    def _timed(self, name, phase, record):
        inner = getattr(self.pipe, name)
        mark, stack = self.marks.mark, self.phase

        def wrapper(*args, **kwargs):
            start = mark()
            stack.append(phase(args, kwargs) if callable(phase) else phase)
            try:
                out = inner(*args, **kwargs)
            finally:
                stack.pop()
            record(start, mark(), args, kwargs, out)
            return out

        return wrapper

    def __enter__(self):
        m = self.marks
        pipe = self.pipe
        for name in self.METHODS:
            if name in vars(pipe):
                self.saved[name] = vars(pipe)[name]

        def step() -> int:
            return len(self.step_ends)

        def label(kwargs) -> str:
            return self.labels.get(id(kwargs.get("past_key_values")), "unknown")

        wrapped = {
            "_init_noise_and_schedule": self._timed(
                "_init_noise_and_schedule", "setup",
                lambda a, b, *_: self.setup.append((a, b))),
            "_build_t2i_image_indexes": self._timed(
                "_build_t2i_image_indexes", "request_other",
                lambda a, b, *_: setattr(self, "last_indexes", b)),
            "_t2i_prefix_forward": self._timed(
                "_t2i_prefix_forward", "prefill",
                lambda a, b, args, kwargs, out: self.prefix.append((a, b, out[0]))),
            "_expand_and_prepare_kv": self._timed(
                "_expand_and_prepare_kv", "prepare_kv",
                lambda a, b, *_: self.prepare.append((a, b))),
            "_extract_feature": self._timed(
                "_extract_feature", "extract_feature",
                lambda a, b, *_: self.extract.append((a, b, step()))),
            "combine_cfg_noise": self._timed(
                "combine_cfg_noise", "combine",
                lambda a, b, *_: self.combine.append((a, b, step()))),
            "_t2i_predict_v": self._timed(
                "_t2i_predict_v", lambda args, kwargs: f"branch:{label(kwargs)}",
                self._record_call),
        }

        think_inner = getattr(pipe, "_generate_think")

        def _generate_think(prefix_outputs, past_key_values, t_idx, *args, **kwargs):
            prefill_start = self.last_indexes
            if args:  # the limit passed positionally
                args = (self.think_tokens, *args[1:])
            else:
                kwargs["max_think_tokens"] = self.think_tokens
            start = m.mark()
            self.phase.append("think")
            try:
                out = think_inner(prefix_outputs, past_key_values, t_idx, *args, **kwargs)
            finally:
                self.phase.pop()
            self.think.append((prefill_start, start, m.mark(), int(t_idx), int(out[1])))
            return out

        loop_inner = getattr(pipe, "_run_denoising_loop")

        def _run_denoising_loop(ns, caches, p, *args, **kwargs):
            self.labels = {id(v): k for k, v in caches.items() if hasattr(v, "layers")}
            self.num_steps = int(p.num_steps)
            start = m.mark()
            self.phase.append("loop")
            try:
                out = loop_inner(ns, caches, p, *args, **kwargs)
            finally:
                self.phase.pop()
            self.loop = (start, m.mark())
            return out

        denoise_inner = getattr(pipe, "_denoise")

        def _denoise(*args, **kwargs):
            out = denoise_inner(*args, **kwargs)
            self.step_ends.append(m.mark())
            return out

        wrapped.update(_generate_think=_generate_think, _run_denoising_loop=_run_denoising_loop,
                       _denoise=_denoise)
        for name, fn in wrapped.items():
            setattr(pipe, name, fn)
        return self

    def _record_call(self, a, b, args, kwargs, out) -> None:
        branch = self.labels.get(id(kwargs.get("past_key_values")), "unknown")
        self.calls.append((a, b, branch, len(self.step_ends)))
        if branch not in self.branch_info:
            layer = kwargs["past_key_values"].layers[0]
            self.branch_info[branch] = {
                "prefix_tokens": int(getattr(layer, "flash_prefix_len", 0) or 0),
                "image_tokens": int(kwargs["input_embeds"].shape[1])}

    def __exit__(self, *exc):
        for name in self.METHODS:
            if name in self.saved:
                setattr(self.pipe, name, self.saved[name])
            elif name in vars(self.pipe):
                delattr(self.pipe, name)

    # -- the breakdown ------------------------------------------------------------------------

    def breakdown(self, start, end) -> dict:
        """Milliseconds by part (``PARTS``, disjoint, in request order), ``host_gap_ms`` (the
        rest), and the per-step split. Call after ``marks.sync()``."""
        ms = self.marks.ms
        total = ms(start, end)
        out: dict[str, Any] = {"total_ms": total}
        out["setup_ms"] = sum(ms(a, b) for a, b in self.setup)
        prefill = collections.defaultdict(float)
        for a, b, cache in self.prefix:
            prefill[self.labels.get(id(cache), "unknown")] += ms(a, b)
        think_tokens = None
        if self.think:
            pre, a, b, t_in, t_out = self.think[-1]
            prefill["cond"] += ms(pre, a) if pre is not None else 0.0
            append = len(self.pipe.tokenizer("\n\n<img>", add_special_tokens=False)["input_ids"])
            think_tokens = t_out - t_in - append
        out["prefill_cond_ms"] = prefill.pop("cond", 0.0)
        out["prefill_uncond_ms"] = prefill.pop("uncond", 0.0)
        out["think_ms"] = float(sum(ms(a, b) for _, a, b, _, _ in self.think))
        out["prepare_kv_ms"] = sum(ms(a, b) for a, b in self.prepare)
        steps: list[dict] = []
        if self.loop is not None and self.step_ends:
            bounds = [self.loop[0]] + self.step_ends
            for i in range(len(self.step_ends)):
                step_ms = ms(bounds[i], bounds[i + 1])
                branches = collections.defaultdict(float)
                for a, b, branch, s in self.calls:
                    if s == i:
                        branches[branch] += ms(a, b)
                extract = sum(ms(a, b) for a, b, s in self.extract if s == i)
                combine = sum(ms(a, b) for a, b, s in self.combine if s == i)
                outside = step_ms - sum(branches.values())
                steps.append({"step_ms": step_ms, "branch_ms": dict(branches),
                              "outside_ms": outside, "extract_feature_ms": extract,
                              "combine_ms": combine,
                              "outside_other_ms": outside - extract - combine})
            out["denoise_steps_ms"] = sum(s["step_ms"] for s in steps)
            out["final_image_ms"] = ms(self.step_ends[-1], self.loop[1])
            out["denoise_loop_ms"] = ms(*self.loop)
        else:
            out["denoise_steps_ms"] = out["final_image_ms"] = 0.0
        out["host_gap_ms"] = total - sum(out[p] for p in PARTS)
        out["parts"] = list(PARTS) + ["host_gap_ms"]
        out["think_tokens"] = think_tokens
        if think_tokens:
            out["think_ms_per_token"] = out["think_ms"] / think_tokens
        out["prefix_tokens"] = {k: v["prefix_tokens"] for k, v in self.branch_info.items()}
        out["image_tokens"] = next(iter(self.branch_info.values()), {}).get("image_tokens")
        out.update(_step_summary(steps))
        out["steps"] = steps
        return _rounded(out)


def _step_summary(steps: list[dict]) -> dict:
    if not steps:
        return {}
    branches = sorted({b for s in steps for b in s["branch_ms"]},
                      key=lambda b: BRANCHES.index(b) if b in BRANCHES else len(BRANCHES))

    def med(key):
        return statistics.median(s[key] for s in steps)

    return {
        "branches": branches,
        "step_ms_median": med("step_ms"),
        "first_step_ms": steps[0]["step_ms"],
        "branch_ms_median": {b: statistics.median(s["branch_ms"].get(b, 0.0) for s in steps)
                             for b in branches},
        "branch_ms_total": {b: sum(s["branch_ms"].get(b, 0.0) for s in steps) for b in branches},
        "outside_ms_median": med("outside_ms"),
        "outside_ms_total": sum(s["outside_ms"] for s in steps),
        "extract_feature_ms_total": sum(s["extract_feature_ms"] for s in steps),
        "combine_ms_total": sum(s["combine_ms"] for s in steps),
        "outside_other_ms_total": sum(s["outside_other_ms"] for s in steps),
    }


def _rounded(value):
    if isinstance(value, float):
        return common.significant(value)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def run_request(pipe, request, device: torch.device, think_tokens: int):
    """One ``pipe.forward(request)``; returns (image as a uint8 array, breakdown)."""
    import numpy as np

    marks = common.Marks(device)
    with Instrumented(pipe, marks, think_tokens) as ins:
        marks.sync()
        start = marks.mark()
        out = pipe.forward(request)
        end = marks.mark()
        marks.sync()
        breakdown = ins.breakdown(start, end)
    return np.asarray(out.output["payload"]["image"]), breakdown


def audit_syncs(pipe, request, device: torch.device, think_tokens: int) -> dict:
    """Host syncs of one request by phase, under ``torch.cuda.set_sync_debug_mode("warn")``
    (every synchronizing CUDA call warns: ``.item()``, ``bool(tensor)``, ``nonzero``,
    ``repeat_interleave`` with tensor repeats, pageable host-device copies)."""
    if device.type != "cuda":
        return {"skipped": "CUDA only (torch.cuda.set_sync_debug_mode)"}
    counts: collections.Counter = collections.Counter()
    marks = common.Marks(device)
    with Instrumented(pipe, marks, think_tokens) as ins:
        def showwarning(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                counts[(ins.current_phase(), len(ins.step_ends))] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = showwarning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pipe.forward(request)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        steps, calls = ins.num_steps, collections.Counter(b for _, _, b, _ in ins.calls)
    by_phase = collections.Counter()
    for (phase, _), n in counts.items():
        by_phase[phase] += n
    outside = ("step_outside", "extract_feature", "combine")
    per_step = [sum(n for (ph, s), n in counts.items() if ph in outside and s == i)
                for i in range(steps)]
    return {
        "steps": steps, "by_phase": dict(sorted(by_phase.items())),
        "outside_per_step": per_step,
        "per_branch_call": {b[len("branch:"):]: by_phase[b] / calls[b[len("branch:"):]]
                            for b in by_phase if b.startswith("branch:")
                            and calls[b[len("branch:"):]]},
        "think_per_token": (by_phase["think"] / think_tokens
                            if by_phase.get("think") and think_tokens else None),
    }


def at_first_branch(pipe, args, fn, *, seed: int, prompt: str, tag: str):
    """Run a one-step text-to-image request at ``args.size``/``args.cfg`` and call
    ``fn(branch, kwargs)`` once, at the cond branch's first ``_t2i_predict_v`` call: inside the
    loop, where the branch's prefix + image buffers are live (the loop's cleanup drops them when
    it returns). ``branch()`` runs that call again (the pipeline's step as it stands: eager, or
    the plugin's replay). Returns what ``fn`` returned."""
    saved = {}
    original = pipe._t2i_predict_v

    def hook(*a, **kw):
        if "result" not in saved:
            saved["result"] = fn(functools.partial(original, *a, **kw), kw)
        return original(*a, **kw)

    request = make_request(size=args.size, steps=1, cfg=args.cfg, think=False, seed=seed,
                           prompt=prompt, tag=tag)
    pipe._t2i_predict_v = hook
    try:
        pipe.forward(request)
    finally:
        pipe._t2i_predict_v = original
    return saved["result"]


def profile_branch_step(pipe, args, device: torch.device, steps: int = 3) -> dict:
    """Kernels of one CFG branch step (the pipeline's ``_t2i_predict_v`` as it stands: eager, or
    the plugin's replay), by category, with GPU busy against wall time (``profile_step``). The
    branch's arguments are taken from the cond branch's first call in a one-step request."""
    import profile_step

    def measure(fn, kw):
        fn()
        wall = profile_step.wall_ms(fn, steps, device_type=device.type)
        trace = profile_step.profile(fn, steps, device_type=device.type)
        layer0 = kw["past_key_values"].layers[0]
        return profile_step.report(
            trace, steps, wall, image_tokens=int(kw["input_embeds"].shape[1]),
            prefix_tokens=int(getattr(layer0, "flash_prefix_len", 0) or 0))

    rep = at_first_branch(pipe, args, measure, seed=args.seed, prompt=args.prompt, tag="profile")
    rep.pop("other_kernel_names", None)
    return rep


# -- floors --------------------------------------------------------------------------------------

def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a dense matmul: bf16 8192^3 with CUDA events on a GPU (``common``); a small
    perf_counter figure on a CPU (only so the tiny run has a floor)."""
    if device.type == "cuda":
        return common.matmul_flops_per_s()
    n = 256
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def gen_linear_params(pipe) -> int:
    """Weights of the linear layers one branch step multiplies by every image token: each layer's
    ``*_mot_gen`` qkv, o, gate_up and down projections, and ``fm_head``."""
    lm = sum(p.numel() for n, p in pipe.language_model.named_parameters()
             if "_mot_gen" in n and p.dim() == 2)
    head = sum(p.numel() for p in pipe.fm_modules["fm_head"].parameters() if p.dim() == 2)
    return lm + head


def branch_flops(pipe, image_tokens: int, prefix_tokens: int) -> float:
    cfg = pipe.language_model.config
    attn_width = cfg.num_attention_heads * cfg.head_dim
    attention = 4 * image_tokens * (prefix_tokens + image_tokens) * attn_width
    return 2 * gen_linear_params(pipe) * image_tokens + cfg.num_hidden_layers * attention


def outside_flops(pipe, image_tokens: int) -> float:
    """The step's work outside the branches: the generation vision embedding (patch conv over
    every patch, then the merge conv per token) and the timestep / noise-scale embedder MLPs."""
    emb = pipe.fm_modules["vision_model_mot_gen"].embeddings
    merge = emb.downsample_factor
    patch = emb.patch_embedding.weight.numel() * image_tokens * merge * merge
    dense = emb.dense_embedding.weight.numel() * image_tokens
    embedders = sum(p.numel() for name in ("timestep_embedder", "noise_scale_embedder")
                    if name in pipe.fm_modules
                    for p in pipe.fm_modules[name].parameters() if p.dim() == 2) * image_tokens
    return 2 * (patch + dense + embedders)


# -- the sides -----------------------------------------------------------------------------------

def plugin_config(log: Log, denoise: str = "graph", fp8: str = "off"):
    """The plugin side's config, parsed from the environment with ``PLUGIN_ENV`` set (the
    denoising mode ``denoise``, ``VLLM_OMNI_GRAPHDECODE_FP8=fp8``; the caller restores the
    environment from the returned ``saved``). A rejected or unknown denoising variable is
    recorded and dropped."""
    from vllm_omni_graphdecode import config

    env = dict(PLUGIN_ENV, **{DENOISE_VAR: denoise, FP8_VAR: fp8})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    load = getattr(config, "load", None)
    record: dict[str, Any] = {"env": dict(env),
                              "function": "config.load()" if load else "config.parse()"}
    load = load or config.parse
    try:
        cfg = load()
    except config.ConfigError as exc:
        record["error"] = f"{exc}; the side runs without {DENOISE_VAR}"
        log(f"plugin config: {record['error']}")
        del os.environ[DENOISE_VAR]
        record["env"].pop(DENOISE_VAR)
        cfg = load()
    if not hasattr(cfg, "sensenova_denoise"):
        record["error"] = (f"config has no sensenova_denoise setting: {DENOISE_VAR} is not read "
                           f"by this plugin version")
        log(f"plugin config: {record['error']}")
    record["parsed"] = cfg.as_env()
    return cfg, record, saved


def _restore_env(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _free_mib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return round(torch.cuda.mem_get_info()[0] / 2**20, 1)


def run_side(pipe, side: str, args, modes: list[bool], device: torch.device, log: Log) -> dict:
    """Warm-up, timed and (CUDA) sync-audit requests of one side for each think mode."""
    from vllm_omni_graphdecode.core import stats

    results = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for think in modes:
        mode = "think" if think else "no_think"
        request = make_request(size=args.size, steps=args.steps, cfg=args.cfg, think=think,
                               seed=args.seed, prompt=args.prompt, tag=f"{side}-{mode}")
        first = None
        for i in range(args.warmup):
            _, bd = run_request(pipe, request, device, args.think_tokens)
            first = first or bd
            log(f"{side} {mode}: warm-up {i + 1}/{args.warmup} {bd['total_ms']:.1f} ms")
        timed = []
        for i in range(args.repeats):
            before = stats.snapshot()["counters"]
            image, bd = run_request(pipe, request, device, args.think_tokens)
            after = stats.snapshot()["counters"]
            bd["plugin_counters"] = {k: v - before.get(k, 0) for k, v in after.items()
                                     if v != before.get(k, 0)}
            timed.append((bd, image))
            log(f"{side} {mode}: {bd['total_ms']:.1f} ms = setup {bd['setup_ms']:.1f} + prefill "
                f"{bd['prefill_cond_ms']:.1f}/{bd['prefill_uncond_ms']:.1f} + think "
                f"{bd['think_ms']:.1f} ({bd['think_tokens']} tokens) + prepare "
                f"{bd['prepare_kv_ms']:.1f} + steps {bd['denoise_steps_ms']:.1f} (median "
                f"{bd.get('step_ms_median', 0):.2f}: branches {bd.get('branch_ms_median')}, "
                f"outside {bd.get('outside_ms_median', 0):.2f}) + image "
                f"{bd['final_image_ms']:.1f} + host gaps {bd['host_gap_ms']:.1f}")
        timed.sort(key=lambda r: r[0]["total_ms"])
        bd, image = timed[len(timed) // 2]
        audit = None
        if args.audit:
            audit_request = make_request(size=args.size, steps=min(2, args.steps), cfg=args.cfg,
                                         think=think, seed=args.seed, prompt=args.prompt,
                                         tag=f"{side}-{mode}-audit")
            try:
                audit = audit_syncs(pipe, audit_request, device, args.think_tokens)
            except Exception as exc:  # a diagnostic: never the reason a run ends
                audit = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{side} {mode}: host syncs {audit}")
        results[mode] = {"ms": statistics.median(r[0]["total_ms"] for r in timed),
                         "first_ms": (first or bd)["total_ms"], "breakdown": bd,
                         "first_breakdown": {k: (first or bd)[k] for k in
                                             ("total_ms", *PARTS, "host_gap_ms")},
                         "image": image, "syncs": audit}
    if device.type == "cuda":
        results["peak_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return results


# -- rows ----------------------------------------------------------------------------------------

def psnr_db(a, b) -> float:
    """PSNR of two uint8 images (peak 255), in dB; ``inf`` when equal."""
    import numpy as np

    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(255.0 ** 2 / mse)


# -- rounding references ---------------------------------------------------------------------------
#
# How far apart two images are that vllm-omni itself would call the same computation: the eager
# request run again with one rounding difference the release ships or has shipped. The plugin's
# fast denoising mode (its own rounding) is read against these, not against "identical".

ROUNDING_REFERENCES = {
    "rope_fallback": "vllm-omni's own PyTorch q/k norm + 3-D rope (what it runs when its Triton "
                     "kernel does not import) in place of the Triton kernel",
    "other_release_rmsnorm": "Qwen3RMSNorm as the other releases define it (0.24-0.28: the fp32 "
                             "cast chain; 0.30: F.rms_norm), swapped on the class",
}
TRITON_ROPE_MODULE = "vllm_omni.diffusion.models.sensenova_u1.fused_rmsnorm_rope"


def rounding_variant(pipe, name: str):
    """Context manager: ``pipe`` computes with the named reference's rounding
    (``ROUNDING_REFERENCES``), restored on exit. An unknown name raises here."""
    if name not in ROUNDING_REFERENCES:
        raise ValueError(f"unknown rounding reference {name!r}; accepted: "
                         f"{', '.join(ROUNDING_REFERENCES)}")
    return _rope_fallback(pipe) if name == "rope_fallback" else _other_release_rmsnorm(pipe)


@contextlib.contextmanager
def _rope_fallback(pipe):
    import inspect

    attn = pipe.language_model.model.layers[0].self_attn
    if "import triton_qk_norm_rope" not in inspect.getsource(type(attn)._project_and_rope):
        raise RuntimeError("this release does not import its Triton q/k norm + rope kernel per "
                           "call, so blocking the import would not swap it")
    saved = sys.modules.get(TRITON_ROPE_MODULE, False)
    sys.modules[TRITON_ROPE_MODULE] = None  # the per-call import raises ImportError
    try:
        yield
    finally:
        if saved is False:
            sys.modules.pop(TRITON_ROPE_MODULE, None)
        else:
            sys.modules[TRITON_ROPE_MODULE] = saved


@contextlib.contextmanager
def _other_release_rmsnorm(pipe):
    from vllm_omni_graphdecode.hooks.sensenova_u1 import fast_denoise as fd

    norm = pipe.language_model.model.norm_mot_gen
    cls, chain = type(norm), fd.cast_chain_norm(norm)
    if chain is None:
        raise RuntimeError(f"{cls.__qualname__}.forward is neither definition")
    original = cls.forward
    cls.forward = lambda self, x: fd.rms_norm(x, self.weight, self.variance_epsilon, not chain)
    try:
        yield
    finally:
        cls.forward = original


def rounding_references(pipe, args, device, log: Log, eager_image) -> dict:
    """Each reference's think-off image (one request, same seed) and its PSNR against eager's."""
    out = {}
    request = make_request(size=args.size, steps=args.steps, cfg=args.cfg, think=False,
                           seed=args.seed, prompt=args.prompt, tag="rounding-reference")
    for name, what in ROUNDING_REFERENCES.items():
        try:
            with rounding_variant(pipe, name):
                image, bd = run_request(pipe, request, device, args.think_tokens)
        except Exception as exc:  # a reference missing must not lose the run
            out[name] = {"what": what, "error": f"{type(exc).__name__}: {exc}"[:400]}
            log(f"rounding reference {name}: {out[name]['error']}")
            continue
        out[name] = {"what": what, "image": image, "ms": bd["total_ms"],
                     "psnr_db_vs_eager": psnr_db(eager_image, image)}
        log(f"rounding reference {name}: PSNR {out[name]['psnr_db_vs_eager']:.2f} dB against "
            f"eager ({bd['total_ms']:.1f} ms)")
    return out


def _json_safe(value):
    """JSON without NaN/Infinity literals: an infinite PSNR is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _profile_or_error(pipe, args, device, log, side: str) -> dict:
    try:
        rep = profile_branch_step(pipe, args, device)
    except Exception as exc:  # a diagnostic: never the reason a run ends
        rep = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"{side} branch step profile: " + json.dumps(
        {k: rep.get(k) for k in ("error", "wall_ms_per_step", "gpu_busy_ms_per_step",
                                  "kernels_per_step")} | {
            c: v["ms_per_step"] for c, v in rep.get("by_category", {}).items()}))
    return rep


def case_name(kind: str, size: int, tiny_model: bool, fp8: str = "off") -> str:
    return (f"sensenova_{kind}_{size}" + ("_fp8" if fp8 != "off" else "")
            + ("_tiny" if tiny_model else ""))


def request_row(name: str, think: bool, eager: dict, ours: dict | None, args, floor_step_ms,
                plugin: dict) -> dict:
    bd = eager["breakdown"]
    row_extra = dict(
        think=think, think_tokens_forced=args.think_tokens if think else 0,
        eager_think_tokens=bd["think_tokens"], first_eager_ms=eager["first_ms"],
        size=args.size, steps=args.steps, cfg=args.cfg, seed=args.seed, warmup=args.warmup,
        repeats=args.repeats, prefix_tokens=bd["prefix_tokens"], image_tokens=bd["image_tokens"],
        denoise_floor_ms=(floor_step_ms * args.steps if floor_step_ms else None))
    breakdown = {"eager": bd}
    syncs = {"eager": eager["syncs"]}
    if ours is not None:
        obd = ours["breakdown"]
        breakdown["ours"] = obd
        syncs["ours"] = ours["syncs"]
        row_extra.update(
            ours_think_tokens=obd["think_tokens"], first_ours_ms=ours["first_ms"],
            psnr_db=psnr_db(eager["image"], ours["image"]),
            ssim=common.ssim(eager["image"], ours["image"]),
            identical=bool((eager["image"] == ours["image"]).all()),
            plugin_counters=obd.get("plugin_counters", {}), plugin_fallbacks=plugin["fallbacks"],
            plugin_summary=plugin["summary"])
    row_extra.update(breakdown=breakdown,
                     first_breakdown={"eager": eager["first_breakdown"],
                                      **({"ours": ours["first_breakdown"]} if ours else {})},
                     syncs=syncs)
    return common.case(name, eager["ms"], ours["ms"] if ours else None, None, **row_extra)


def step_row(name: str, from_mode: str, eager: dict, ours: dict | None, pipe, rate: float) -> dict:
    bd = eager["breakdown"]
    image = bd["image_tokens"]
    flops = {b: branch_flops(pipe, image, bd["prefix_tokens"][b]) for b in bd["branches"]}
    floor = sum(flops.values()) / rate * 1e3
    extra = dict(
        from_case=from_mode, branches=bd["branches"], image_tokens=image,
        prefix_tokens=bd["prefix_tokens"],
        branch_floor_ms={b: f / rate * 1e3 for b, f in flops.items()},
        branch_flop={b: int(f) for b, f in flops.items()},
        outside_floor_ms=outside_flops(pipe, image) / rate * 1e3,
        gen_linear_params=gen_linear_params(pipe), matmul_tflops=rate / 1e12,
        eager_branch_ms=bd["branch_ms_median"], eager_outside_ms=bd["outside_ms_median"],
        eager_first_step_ms=bd["first_step_ms"])
    if ours is not None:
        obd = ours["breakdown"]
        extra.update(ours_branch_ms=obd["branch_ms_median"],
                     ours_outside_ms=obd["outside_ms_median"],
                     ours_first_step_ms=obd["first_step_ms"])
    return _rounded(common.case(name, bd["step_ms_median"],
                                ours["breakdown"]["step_ms_median"] if ours else None, floor,
                                **extra))


# -- main ----------------------------------------------------------------------------------------

def build_rows(results: dict, plugin: dict, args, modes: list[bool], pipe, rate: float) -> list:
    """The step row, then one request row per think mode (``ours_ms`` None until the plugin
    side has run)."""
    eager, ours = results.get("eager", {}), results.get("plugin", {})
    step_mode = "no_think" if "no_think" in eager else "think"
    srow = step_row(case_name("image_step", args.size, args.tiny, args.fp8), step_mode, eager[step_mode],
                    ours.get(step_mode), pipe, rate)
    rows = [srow]
    for think in modes:
        mode = "think" if think else "no_think"
        name = case_name("t2i_think" if think else "t2i", args.size, args.tiny, args.fp8)
        rows.append(request_row(name, think, eager[mode], ours.get(mode), args, srow["floor_ms"],
                                plugin))
    if "error" in plugin:
        for row in rows:
            row["plugin_error"] = plugin["error"]
    return rows


def _environment(device: torch.device) -> dict:
    env = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "versions": common.versions(), "device": str(device)}
    if device.type == "cuda":
        env.update(common.gpu_info())
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for sensenova-request.json and .log")
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels (square)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cfg", type=float, default=4.0,
                    help="cfg_scale (CFG 1: the cond branch only)")
    ap.add_argument("--think", choices=("on", "off", "both"), default="both")
    ap.add_argument("--think-tokens", type=int, default=1024,
                    help="tokens every think request decodes (end tokens can never win)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed requests per side and mode before the timed ones; the first "
                         "one's time is first_ms")
    ap.add_argument("--repeats", type=int, default=1, help="timed requests (median)")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny checkpoint (make_tiny_checkpoints) instead of the real shape")
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--denoise", choices=("graph", "fast"), default="graph",
                    help="the plugin side's VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE (graph: the "
                         "exact mode, the pipeline's own step; fast: the restated body)")
    ap.add_argument("--fp8", default="off",
                    help="the plugin side's VLLM_OMNI_GRAPHDECODE_FP8 (off, on, or paths: "
                         "sensenova_decode, sensenova_denoise); rows get an _fp8 suffix")
    ap.add_argument("--rounding-references", action="store_true",
                    help="also run the think-off request with each rounding vllm-omni ships or "
                         "has shipped (ROUNDING_REFERENCES) and report its PSNR against eager's "
                         "and the plugin's image: the scale a fast mode's PSNR is read on")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one cond branch step per side (kernels by category)")
    ap.add_argument("--no-audit", dest="audit", action="store_false",
                    help="skip the host-sync audit request (CUDA only anyway)")
    args = ap.parse_args(argv)
    args.prompt = PROMPT
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.tiny and device.type != "cuda":
        ap.error("the real shape holds ~35 GB of bf16 weights and needs a CUDA device; use --tiny "
                 "on a CPU")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.think_tokens < 1:
        ap.error("--steps, --repeats and --think-tokens must be >= 1, --warmup >= 0")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.think]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sensenova-request.json")
    log = Log(os.path.join(args.out, "sensenova-request.log"))
    dtype = torch.bfloat16

    from vllm_omni_graphdecode.core import stats
    from vllm_omni_graphdecode.hooks import sensenova_u1
    from vllm_omni_graphdecode.testing import sensenova as rm

    env = _environment(device)
    workdir = tempfile.mkdtemp(prefix="sensenova-request-")
    rows: list[dict] = []

    def write():
        with open(path, "w") as f:  # after every side: a run cut short keeps what it measured
            json.dump(_json_safe({"environment": env, "cases": rows}), f, indent=2)

    try:
        start = time.perf_counter()
        if args.tiny:
            pipe = build_tiny_pipeline(device, dtype, args.seed, workdir)
        else:
            pipe = build_real_pipeline(device, dtype, args.seed, workdir, args.prompt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        env["build"] = {
            "model": "tiny checkpoint" if args.tiny else "real shape", "dtype": str(dtype),
            "seconds": round(time.perf_counter() - start, 1), "params": param_counts(pipe),
            "memory_allocated_gib": (round(torch.cuda.memory_allocated() / 2**30, 2)
                                     if device.type == "cuda" else None),
            "end_tokens_zeroed": dict(zip(END_TOKENS, end_token_ids(pipe.tokenizer))),
            "sources": REAL_SOURCES if not args.tiny else "examples/make_tiny_checkpoints.py"}
        env["request"] = {"path": "SenseNovaU1Pipeline.forward", "size": args.size,
                          "steps": args.steps, "cfg_scale": args.cfg, "think": args.think,
                          "think_tokens": args.think_tokens, "seed": args.seed,
                          "prompt": args.prompt}
        env["in_tree_paged_decode"] = {"present": rm.has_intree_paged_decode(),
                                       INTREE_VAR: os.environ.get(INTREE_VAR, "unset (on)")}
        log(f"built the {env['build']['model']} pipeline in {env['build']['seconds']} s: "
            f"{env['build']['params']}")
        rate = matmul_rate(device, dtype)
        env["matmul_tflops"] = round(rate / 1e12, 3)
        log(f"matmul {rate / 1e12:.1f} TFLOP/s")

        results: dict[str, dict] = {}
        plugin: dict[str, Any] = {"summary": None, "fallbacks": {}}
        results["eager"] = run_side(pipe, "eager", args, modes, device, log)
        profiles = env.setdefault("branch_step_profile", {})
        if args.profile:
            profiles["eager"] = _profile_or_error(pipe, args, device, log, "eager")
        env["eager_peak_memory_mib"] = results["eager"].pop("peak_memory_mib", None)
        references = {}
        if args.rounding_references and "no_think" in results["eager"]:
            references = rounding_references(pipe, args, device, log,
                                             results["eager"]["no_think"]["image"])
        rows[:] = build_rows(results, plugin, args, modes, pipe, rate)
        write()
        cfg, record, saved = plugin_config(log, args.denoise, args.fp8)
        env["plugin_config"] = record
        stats.reset()
        free_before = _free_mib(device)
        try:
            plugin["summary"] = sensenova_u1.install(pipe, cfg, None)
            log(f"plugin: {plugin['summary']}")
            results["plugin"] = run_side(pipe, "plugin", args, modes, device, log)
            if args.profile:
                profiles["plugin"] = _profile_or_error(pipe, args, device, log, "plugin")
            env["plugin_peak_memory_mib"] = results["plugin"].pop("peak_memory_mib", None)
        except Exception as exc:  # keep the eager side's rows
            import traceback

            traceback.print_exc()
            plugin["error"] = f"{type(exc).__name__}: {exc}"
            log(f"plugin side failed: {plugin['error']}")
        finally:
            _restore_env(saved)
        snap = stats.snapshot()
        plugin["fallbacks"] = snap["fallbacks"]
        env["plugin"] = dict(plugin, counters=snap["counters"], degraded=snap["degraded"],
                             wired_extra_mib=(None if free_before is None else
                                              round(free_before - _free_mib(device), 1)))
        rows[:] = build_rows(results, plugin, args, modes, pipe, rate)
        if references:
            ours = results.get("plugin", {}).get("no_think")
            for ref in references.values():
                image = ref.pop("image", None)
                if ours is not None and image is not None:
                    ref["psnr_db_vs_plugin"] = psnr_db(ours["image"], image)
            env["rounding_references"] = references
            log(f"rounding references: {_json_safe(env['rounding_references'])}")
        write()
        for row in rows:
            print(json.dumps(_json_safe({k: v for k, v in row.items()
                                         if k not in ("breakdown", "first_breakdown")})),
                  flush=True)
        log(f"wrote {path}")
        return 0 if "error" not in plugin else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
