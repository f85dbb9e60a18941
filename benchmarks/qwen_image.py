"""Whole-image benchmark of Qwen-Image-2.1: diffusers' ``QwenImage21Pipeline`` eager vs wired.

    python3 benchmarks/qwen_image.py --out DIR [--steps 50] [--size real] [--cfg 1,4]

prints one JSON line per case and writes ``DIR/qwen-image.json``. Cases:
``qwen_image_21_image_t2i_1024_50steps`` (CFG 1, Qwen's default: no guidance) and
``qwen_image_21_image_t2i_1024_50steps_cfg4`` (true CFG 4 with a negative prompt: two transformer
calls per step). Each case generates the same 1024x1024 image (fixed seed) eagerly and with the
plugin wired, and reports wall time per image, the split between prompt encoding, the denoising
loop and the VAE decode, per-step times, and the PSNR between the two images.

Why this exists
    ``bench.py`` times one cached transformer step on synthetic inputs. A user waits for a whole
    image: the text encoder, the extract step (always eager), 49 cached steps, the scheduler and
    the VAE decode. This file measures that, through the pipeline's own ``__call__``, nothing
    stubbed: what the plugin saves per step is set against everything it does not touch.

The pipeline (``build_pipeline(size="real")``): every component is the released model's class at
the released shape, with random weights drawn on the device; nothing is downloaded.

    transformer   ``QwenImage21Transformer2DModel`` with diffusers 0.42.1's default config, which
                  is the released shape: 32 layers, 32 heads x 128 (hidden 4096), SwiGLU 12288
                  (``mlp_ratio`` 3), ``in_channels`` 64, ``context_in_dim`` 4096, RoPE axes
                  (16, 56, 56), ``causal_condition``; 7.12 B parameters (14.2 GB bf16; Comfy-Org's
                  int8 file of the release is 7.26 GB). Built by ``random_transformer()``
                  (diffusers' own initialisation, on the device).
    text encoder  ``Qwen3VLForConditionalGeneration`` at Qwen3-VL-8B-Instruct's shape, full depth:
                  text 36 layers, hidden 4096, 32 heads / 8 KV heads x 128, MLP 12288, vocabulary
                  151,936 (untied ``lm_head``), M-RoPE theta 5e6, sections (24, 20, 20)
                  interleaved, 262,144 positions; vision 27 blocks, hidden 1152, MLP 4304, 16
                  heads, patch 16, spatial merge 2, temporal patch 2, 2,304 position embeddings,
                  deepstack layers (8, 16, 24), output 4096. Sources: the transformer's
                  ``context_in_dim`` 4096 is the encoder's hidden size, which among Qwen3-VL
                  models only the 8B has; the Comfy-Org release ships the encoder as
                  ``qwen3vl_8b_bf16.safetensors`` (~16.3 GB); the numbers are Qwen3-VL-8B's
                  ``config.json`` (mirrored on the Hub and in ollama's ``qwen3-vl:8b`` metadata).
                  Not seen: the release's own ``text_encoder/config.json``; it is assumed to be
                  Qwen3-VL-8B's unchanged. Transformers' ``Qwen3VLConfig()`` defaults are *not*
                  this model (32 layers, MLP 22016, no GQA), so every number is spelled out
                  below. 8.77 B parameters (the embedding and ``lm_head`` at the full
                  vocabulary; the pipeline's forward computes logits at every position, as the
                  real one does), built in bf16 (as ``from_pretrained(dtype=bfloat16)`` builds
                  it: rotary ``inv_freq`` stays float32), transformers' own initialisation
                  (normal, std 0.02) on the device.
    VAE           ``AutoencoderKLQwenImage21`` with diffusers' default config (base 96, decoder
                  base 144, z 64, ``dim_mult`` [1, 2, 4, 8, 8], 2 residual blocks, the released
                  latent mean/std): 338 M parameters, 0.68 GB bf16, which is the size of the
                  release's ``qwen_image_2.1_vae_bf16.safetensors``.
    scheduler     ``FlowMatchEulerDiscreteScheduler`` with the release's config (dynamic shift,
                  base/max shift 0.5/0.9 over 256..8192 tokens, exponential, terminal 0.02), as
                  quoted in ComfyUI issue #16447 and used by ``examples/make_tiny_checkpoints.py``.
                  ``sample_sigmas`` unset, so ``num_inference_steps`` decides the step count.
    processor     ``Qwen3VLProcessor`` from ``make_tiny_checkpoints.qwen_processor``: the released
                  image settings (patch 16, merge 2, temporal 2, mean/std 0.5) except the minimum
                  area, which text-to-image never reads. Its tokenizer is a byte-level BPE trained
                  here on the benchmark's own prompts (plus Qwen's special tokens and a chat
                  template that renders the system message as Qwen3-VL's does), so a prompt takes
                  about one position per word, as under Qwen's 151k-token BPE, instead of one per
                  byte. Unknown text still encodes (byte by byte). The prompt's positions are
                  reported (``prompt_tokens``): they set the prefix the cached steps attend over.

``size="tiny"`` is ``make_tiny_checkpoints``'s pipeline (2-layer transformer and text encoder, a
narrow VAE) for CPU tests of this harness.

What is timed
    ``generate``: one ``pipe(...)`` call from a synchronised start to a synchronised end (CUDA
    events; ``perf_counter`` on CPU), ``output_type="pt"`` so images compare before any uint8
    rounding. Inside it, CUDA events (no host sync) mark ``encode_prompt`` (wrapped on the
    instance), the loop's start (``scheduler.set_begin_index``, called right before it), the end of
    every step (``callback_on_step_end``) and ``vae.decode`` (wrapped on the instance).
    ``run_case``: an eager warm-up image (``warmup_steps``, fewer steps are enough to warm every
    kernel), the eager image, then ``enable(pipe)``, the first wired image (binds and captures:
    ``first_ours_ms``) and the wired image that is reported (``ours_ms``). Both sides run at
    the same steps, seed and prompts. ``eager_sha256`` / ``ours_sha256``: the two images' fp32
    bytes hashed, to compare runs in other processes or on other machines; ``first_equal``: the
    first wired image equals the reported one (captured against replayed).

Numbers (H200, ``benchmarks/results/h200-2026-11-30c/qwen-image.json``): 1024x1024, 50 steps,
CFG 1: diffusers 7,930 ms, the plugin's fast mode 5,848 ms at 52.5 dB PSNR; CFG 4: 15,691 and
11,580 ms at 51.8 dB. Both cases took ~64 s after a 3 s build (weights drawn on the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import hashlib
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here loads from the Hub; never try

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "examples"), os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import common  # noqa: E402
import make_tiny_checkpoints as tiny  # noqa: E402  (examples/: the tiny builders and templates)

SIZES = ("real", "tiny")

DEFAULT_PROMPT = (
    "A cozy bookshop on a rainy evening in an old European street, warm light spilling from tall "
    "windows onto wet cobblestones, a ginger cat asleep on a stack of books in the display, a "
    "hand-painted wooden sign above the door reading \"Chapter One Books\", people with umbrellas "
    "walking past, reflections in the puddles, soft cinematic lighting, rich colors, ultra "
    "detailed, photorealistic, 4K."
)
DEFAULT_NEGATIVE_PROMPT = (
    "low resolution, blurry, distorted text, deformed hands, extra limbs, oversaturated, "
    "watermark, jpeg artifacts"
)

# The release's scheduler_config.json (ComfyUI issue #16447 quotes it).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    time_shift_type="exponential",
)

# Qwen3-VL-8B-Instruct's config.json; the token ids are filled in from the local tokenizer.
QWEN3_VL_8B_TEXT = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
    max_position_embeddings=262144, rms_norm_eps=1e-6, attention_bias=False,
    initializer_range=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                     "mrope_section": [24, 20, 20], "mrope_interleaved": True},
)
QWEN3_VL_8B_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=4096, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh", initializer_range=0.02,
)


# -- building ------------------------------------------------------------------------------------

def prompt_tokenizer(texts: list[str]):
    """A ``PreTrainedTokenizerFast``: byte-level BPE whose merges are learned from ``texts``
    (deterministic), Qwen's special tokens atomic, Qwen's chat template for the system message."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = tiny.QWEN_VL_SPECIAL_TOKENS
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1 << 20, min_frequency=1, show_progress=False,
                                  special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in special if t not in ("<|im_end|>", "<|endoftext|>")])
    fast.chat_template = tiny.QWEN_CHAT_TEMPLATE
    return fast


def _tokenizer_corpus(prompts: list[str]) -> list[str]:
    """The texts the pipeline will tokenize: its system message and the t2i template per prompt."""
    system = "Comprehend and analyze the provided prompt."  # QwenImage21Pipeline.sys_prompt
    template = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
                f"<|im_start|>assistant\n")
    return [template.format(p) for p in prompts]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build modules in ``dtype`` the way ``from_pretrained(dtype=...)`` does (buffers computed in
    float32 on purpose, such as rotary ``inv_freq``, stay float32)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def text_encoder_config(token_ids: dict[str, int]):
    """Qwen3-VL-8B's ``Qwen3VLConfig`` with the local tokenizer's special-token ids."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(QWEN3_VL_8B_TEXT, pad_token_id=token_ids["<|endoftext|>"],
                         bos_token_id=token_ids["<|endoftext|>"],
                         eos_token_id=token_ids["<|im_end|>"]),
        vision_config=dict(QWEN3_VL_8B_VISION),
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"], tie_word_embeddings=False,
    )


def real_text_encoder(token_ids: dict[str, int], *, device, dtype, seed: int = 0, config=None):
    """``Qwen3VLForConditionalGeneration`` at Qwen3-VL-8B's shape, weights drawn on ``device``."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(dtype):
        model = Qwen3VLForConditionalGeneration(config or text_encoder_config(token_ids))
    return model.eval()


def real_vae(*, device, dtype, seed: int = 0):
    """``AutoencoderKLQwenImage21`` at diffusers' default (the released) config, on ``device``."""
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    with torch.device(device):
        vae = AutoencoderKLQwenImage21()
    return vae.to(dtype=dtype).eval()


def build_pipeline(device="cuda", dtype=torch.bfloat16, size="real", seed=0, *,
                   prompts: tuple[str, ...] = (DEFAULT_PROMPT, DEFAULT_NEGATIVE_PROMPT)):
    """A ``QwenImage21Pipeline`` of real component classes with random weights (see the module
    docstring for every shape and its source). ``prompts``: the texts the tokenizer learns whole
    words from. ``size="real"`` holds ~32 GB of bf16 weights; ``"tiny"`` runs on a CPU."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    from diffusers.utils import logging as diffusers_logging

    if size not in SIZES:
        raise ValueError(f"size={size!r}; known: {', '.join(SIZES)}")
    tokenizer = prompt_tokenizer(_tokenizer_corpus(list(prompts)))
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.QWEN_VL_SPECIAL_TOKENS}
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # not the per-model "cast with to()" advice
    try:
        if size == "real":
            from vllm_omni_graphdecode.testing.qwen import random_transformer

            text_encoder = real_text_encoder(token_ids, device=device, dtype=dtype, seed=seed)
            torch.manual_seed(seed + 1)
            transformer = random_transformer(device=device, dtype=dtype)
            vae = real_vae(device=device, dtype=dtype, seed=seed + 2)
        else:
            z_dim = 16
            token_ids["pad"] = tokenizer.pad_token_id
            text_encoder = tiny.qwen_text_encoder(tiny._padded_vocab(len(tokenizer)), token_ids,
                                                  seed=seed)
            transformer = tiny.qwen_transformer(in_channels=z_dim, seed=seed)
            vae = tiny.qwen_vae(z_dim=z_dim, seed=seed)
            for module in (text_encoder, transformer, vae):
                module.to(device=device, dtype=dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
                               vae=vae, text_encoder=text_encoder,
                               processor=tiny.qwen_processor(tokenizer), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def param_counts(pipe) -> dict[str, int]:
    return {name: sum(p.numel() for p in getattr(pipe, name).parameters())
            for name in ("transformer", "text_encoder", "vae")}


# -- timing one image ----------------------------------------------------------------------------

class _Instrumented:
    """Wraps ``encode_prompt``, ``scheduler.set_begin_index`` and ``vae.decode`` on the instances
    (never the classes) to mark their boundaries; restores them on exit."""

    def __init__(self, pipe, marks: common.Marks, seen: dict):
        self.marks, self.seen = marks, seen
        self.owners = ((pipe, "encode_prompt"), (pipe.scheduler, "set_begin_index"),
                       (pipe.vae, "decode"))

    def __enter__(self):
        marks, seen = self.marks, self.seen
        encode, begin, decode = (getattr(o, n) for o, n in self.owners)

        def encode_prompt(*args, **kwargs):
            marks.mark("encode_start")
            out = encode(*args, **kwargs)
            marks.mark("encode_end")
            seen.setdefault("prompt_tokens", []).append(int(out[0].shape[1]))
            return out

        def set_begin_index(*args, **kwargs):
            marks.mark("loop_start")
            return begin(*args, **kwargs)

        def vae_decode(*args, **kwargs):
            marks.mark("decode_start")
            out = decode(*args, **kwargs)
            marks.mark("decode_end")
            return out

        for (owner, name), fn in zip(self.owners, (encode_prompt, set_begin_index, vae_decode)):
            setattr(owner, name, fn)
        return self

    def __exit__(self, *exc):
        for owner, name in self.owners:
            if name in owner.__dict__:
                delattr(owner, name)


def _split(marks: common.Marks, steps: int) -> dict[str, Any]:
    """The phases of one image, in ms: encode (every ``encode_prompt`` call), denoise (loop start
    to the last step's end), per-step times, decode, and the rest (latents, timesteps,
    post-processing)."""
    p, ms = marks.points, marks.ms
    total = ms(p["start"][0], p["end"][0])
    encode = sum(ms(a, b) for a, b in zip(p.get("encode_start", []), p.get("encode_end", [])))
    ends = p.get("step", [])
    out: dict[str, Any] = {"total_ms": total, "encode_ms": encode}
    if "loop_start" in p and len(ends) == steps:
        bounds = [p["loop_start"][-1]] + ends
        per_step = [ms(a, b) for a, b in itertools.pairwise(bounds)]
        out["denoise_ms"] = sum(per_step)
        out["step0_ms"] = per_step[0]  # the extract step: always diffusers' own forward
        if steps > 1:
            out["step1_ms"] = per_step[1]  # the first cached step (binds, captures when wired)
            out["cached_step_ms"] = statistics.median(per_step[1:])
    if "decode_start" in p:
        out["decode_ms"] = ms(p["decode_start"][-1], p["decode_end"][-1])
    out["other_ms"] = total - sum(out.get(k, 0.0) for k in ("encode_ms", "denoise_ms", "decode_ms"))
    return {k: round(v, 3) for k, v in out.items()}


def generate(pipe, prompt, *, height, width, steps, true_cfg_scale, seed, negative_prompt=None,
             details: dict | None = None) -> tuple[torch.Tensor, float]:
    """One image through ``pipe(...)``; returns (image, ms).

    image: float32, ``(C, height, width)`` in [0, 1], straight from the VAE's output
    (``output_type="pt"``; Qwen-Image-2.1's VAE decodes RGBA, so C is 4). ms: wall time of the
    whole call. ``details``, when given, receives the phase split (``_split``), ``prompt_tokens``
    (positions of each encoded prompt, after the dropped system message) and ``latents`` (the
    final latents, before the VAE). True CFG needs ``true_cfg_scale > 1`` and a negative prompt;
    one without the other is refused here (the pipeline would only warn and run without CFG).
    """
    if (true_cfg_scale > 1) != (negative_prompt is not None):
        given = "set" if negative_prompt is not None else "None"
        raise ValueError(f"true_cfg_scale={true_cfg_scale} with negative_prompt={given}: "
                         f"true CFG needs both, CFG 1 neither")
    if steps < 2:
        # The release's scheduler stretches sigmas to shift_terminal by dividing by
        # 1 - sigmas[-1], which is 0 for a one-step schedule: every sigma would be NaN.
        raise ValueError(f"steps={steps}: the scheduler needs at least 2 steps")
    device = pipe._execution_device
    marks = common.Marks(device)
    seen: dict = {}
    generator = torch.Generator(device=device).manual_seed(seed)

    def on_step_end(_pipe, i, _t, tensors):
        marks.mark("step")
        if i == steps - 1:
            seen["latents"] = tensors["latents"]
        return {}

    with _Instrumented(pipe, marks, seen):
        marks.sync()
        marks.mark("start")
        out = pipe(prompt=prompt, negative_prompt=negative_prompt, true_cfg_scale=true_cfg_scale,
                   height=height, width=width, num_inference_steps=steps, generator=generator,
                   output_type="pt", callback_on_step_end=on_step_end)
        marks.mark("end")
        marks.sync()
    image = out.images[0].float()
    split = _split(marks, steps)
    if details is not None:
        details.update(split)
        details["prompt_tokens"] = seen.get("prompt_tokens", [])
        details["latents"] = seen.get("latents")
    return image, split["total_ms"]


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of two images in [0, 1] (peak 1), in dB; ``inf`` when equal."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    mse = float(torch.mean((a.double() - b.double()) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


# -- one case: eager vs wired --------------------------------------------------------------------

def _counters(snapshot: dict, model: str) -> dict[str, int]:
    prefix = model + "."
    return {k[len(prefix):]: v for k, v in snapshot["counters"].items() if k.startswith(prefix)}


def _free_mib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**20


def run_case(pipe, *, enable: Callable[..., Any], cfg: float, steps: int, height: int, width: int,
             prompt: str = DEFAULT_PROMPT, negative_prompt: str = DEFAULT_NEGATIVE_PROMPT,
             seed: int = 0, warmup_steps: int | None = None, **enable_kwargs) -> dict:
    """Time one image eagerly and with ``enable(pipe, **enable_kwargs)`` wired; returns the row.

    Order: an eager warm-up image (``warmup_steps``, default ``steps``), the eager image, then
    ``handle = enable(pipe, ...)``, the first wired image (``first_ours_ms``: binds each request
    branch and captures), the wired image (``ours_ms``), ``handle.disable()``. CFG > 1 uses
    ``negative_prompt``. ``psnr_db`` and ``ssim`` compare the wired image with the eager one
    (``inf`` and 1.0: equal to the bit); ``latents_max_abs_diff`` compares the final latents, before the VAE clamps
    anything. ``plugin_counters`` are the plugin's ``stats`` counters over the reported wired
    image (replays, static steps, eager steps), ``plugin_fallbacks`` its fallback reasons so far:
    a wired image that fell back to eager must not read as a result. ``wired_extra_mib``: device
    memory taken by enabling and the first wired image (static buffers, graph pools), from free
    memory on the device; None off CUDA.
    """
    from vllm_omni_graphdecode.core import stats

    negative = negative_prompt if cfg > 1 else None

    def image(n):
        details: dict = {}
        img, ms = generate(pipe, prompt, height=height, width=width, steps=n,
                           true_cfg_scale=cfg, seed=seed, negative_prompt=negative,
                           details=details)
        return img, ms, details

    device = pipe._execution_device
    image(warmup_steps or steps)
    eager_img, eager_ms, eager = image(steps)
    free_before = _free_mib(device)
    handle = enable(pipe, **enable_kwargs)
    try:
        first_img, first_ms, first = image(steps)
        free_after = _free_mib(device)
        before = stats.snapshot()
        ours_img, ours_ms, ours = image(steps)
        after = stats.snapshot()
    finally:
        handle.disable()
    model = "qwen_image_21"
    counters_before = _counters(before, model)
    counters = {k: v - counters_before.get(k, 0) for k, v in _counters(after, model).items()}
    latents_diff = (ours.pop("latents").float() - eager.pop("latents").float()).abs().max()
    first.pop("latents")
    return {
        "eager_ms": eager_ms, "ours_ms": ours_ms, "first_ours_ms": first_ms,
        "psnr_db": psnr_db(eager_img, ours_img), "first_psnr_db": psnr_db(eager_img, first_img),
        "ssim": common.ssim(eager_img.permute(1, 2, 0).cpu().numpy(),
                            ours_img.permute(1, 2, 0).cpu().numpy(), data_range=1.0),
        "identical": bool(torch.equal(eager_img, ours_img)),
        "first_equal": bool(torch.equal(first_img, ours_img)),
        "eager_sha256": _sha256(eager_img), "ours_sha256": _sha256(ours_img),
        "latents_max_abs_diff": float(latents_diff),
        "steps": steps, "warmup_steps": warmup_steps or steps, "height": height, "width": width,
        "true_cfg_scale": cfg, "seed": seed, "prompt_tokens": eager.pop("prompt_tokens"),
        "eager_step_ms": eager.get("cached_step_ms"), "ours_step_ms": ours.get("cached_step_ms"),
        "eager_split": _without(eager, "prompt_tokens"),
        "ours_split": _without(ours, "prompt_tokens"),
        "first_ours_split": _without(first, "prompt_tokens"),
        "wired_extra_mib": (None if free_before is None
                            else round(free_before - free_after, 1)),
        "plugin_counters": counters, "plugin_fallbacks": after["fallbacks"],
        "enable_kwargs": {k: repr(v) for k, v in enable_kwargs.items()},
    }


def _sha256(image: torch.Tensor) -> str:
    """The image's bytes as fp32 on the host, hashed: two processes or machines that made the
    same image print the same digest."""
    return hashlib.sha256(image.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()


def _without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


# -- CLI -----------------------------------------------------------------------------------------

def case_name(*, height: int, width: int, steps: int, cfg: float, size: str,
              mode: str = "fast") -> str:
    res = str(height) if height == width else f"{width}x{height}"
    name = f"qwen_image_21_image_t2i_{res}_{steps}steps"
    if cfg != 1:
        name += f"_cfg{cfg:g}".replace(".", "p")
    if mode == "fast_fp8":
        name += "_fp8"
    elif mode != "fast":
        name += f"_{mode}"
    return name if size == "real" else f"{name}_{size}"


def _json_safe(value):
    """JSON without NaN/Infinity literals: an infinite PSNR is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def log(msg: str) -> None:
    print(f"[qwen-image] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for qwen-image.json")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup-steps", type=int, default=5,
                    help="steps of the eager warm-up image (the wired warm-up runs --steps)")
    ap.add_argument("--size", choices=SIZES, default="real")
    ap.add_argument("--cfg", default="1,4", help="comma list of true_cfg_scale values")
    ap.add_argument("--height", type=int, default=None, help="default 1024 (real), 64 (tiny)")
    ap.add_argument("--width", type=int, default=None, help="default: --height")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--modes", default="fast,exact",
                    help="the plugin's Qwen-Image-2.1 modes to time, each against eager; "
                         "fast_fp8: the fast mode with W8A8 GEMMs (case names end in _fp8)")
    ap.add_argument("--enable-kwargs", default="{}",
                    help='JSON keywords for qwen_image_21.enable, e.g. \'{"verify": true}\'')
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.size == "real" and device.type != "cuda":
        ap.error("--size real holds ~32 GB of bf16 weights and needs a CUDA device; "
                 "use --size tiny on a CPU")
    cfgs = [float(c) for c in args.cfg.split(",") if c.strip()]
    height = args.height or (1024 if args.size == "real" else 64)
    width = args.width or height
    enable_kwargs = json.loads(args.enable_kwargs)
    if device.type != "cuda":
        enable_kwargs.setdefault("capture", False)  # the static-buffer step, run eagerly
    os.makedirs(args.out, exist_ok=True)

    import common
    from vllm_omni_graphdecode.hooks import qwen_image_21

    if device.type == "cuda":
        env = common.environment()
    else:  # common.versions() imports vllm_omni (20-35 s on 2 cores): metadata is enough here
        env = {"command": " ".join(sys.argv),
               "versions": {d: importlib.metadata.version(d)
                            for d in ("torch", "diffusers", "transformers")}}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    pipe = build_pipeline(device=str(device), dtype=dtype, size=args.size, seed=args.seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
    env["build"] = {"size": args.size, "dtype": str(dtype),
                    "seconds": round(time.perf_counter() - start, 1), "params": param_counts(pipe),
                    "memory_allocated_gib": (round(torch.cuda.memory_allocated() / 2**30, 2)
                                             if device.type == "cuda" else None)}
    log(f"built {args.size} pipeline in {env['build']['seconds']} s: {env['build']['params']}")

    rows: list[dict] = []
    path = os.path.join(args.out, "qwen-image.json")
    modes = [m for m in args.modes.split(",") if m.strip()]
    for cfg, mode in itertools.product(cfgs, modes):
        name = case_name(height=height, width=width, steps=args.steps, cfg=cfg, size=args.size,
                         mode=mode)
        t0 = time.perf_counter()
        try:
            fp8 = mode == "fast_fp8"
            r = run_case(pipe, enable=qwen_image_21.enable, cfg=cfg, steps=args.steps,
                         height=height, width=width, seed=args.seed,
                         warmup_steps=min(args.warmup_steps, args.steps),
                         **dict(enable_kwargs, mode="fast" if fp8 else mode, fp8=fp8))
            row = common.case(name, r.pop("eager_ms"), r.pop("ours_ms"), None, **r)
        except Exception as exc:  # keep the other case's result
            import traceback

            traceback.print_exc()
            row = {"case": name, "error": repr(exc)}
        row["case_seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(_json_safe(row))
        print(json.dumps(rows[-1]), flush=True)
        with open(path, "w") as f:  # after every case: a run cut short keeps what it measured
            json.dump({"environment": env, "cases": rows}, f, indent=2)
    log(f"wrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
