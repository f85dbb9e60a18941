"""Write tiny random-weight checkpoints of the two models this plugin serves, downloading nothing.

    python examples/make_tiny_checkpoints.py OUTDIR

writes

* ``OUTDIR/sensenova_u1``: a SenseNova-U1 checkpoint directory for vllm-omni's
  ``SenseNovaU1Pipeline``: ``config.json`` (``llm_config``, ``vision_config`` and the top-level
  flow-matching fields ``SenseNovaU1Config`` reads), a byte-level BPE tokenizer with the
  special tokens the pipeline looks up (``<img>``, ``</img>``, ``<IMG_CONTEXT>``,
  ``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``</think>``), and ``model.safetensors`` with the
  checkpoint's own (unfused) names: ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``,
  which the pipeline's ``load_weights`` fuses through its ``stacked_params_mapping``.
* ``OUTDIR/qwen_image_21``: a diffusers ``QwenImage21Pipeline`` directory (``model_index.json``,
  transformer, VAE, Qwen3-VL text encoder, Qwen3-VL processor with a byte-level BPE tokenizer and
  a chat template, scheduler), saved by diffusers' own ``save_pretrained``.

The weights are random (seeded), so the models produce noise; the checkpoints exist to drive the
real loading and serving code end to end at a size that runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

# --------------------------------------------------------------------------------------------
# Tokenizer (shared): byte-level BPE over the 256 byte symbols, no merges, plus special tokens.
# Any text round-trips through it, one token per byte.
# --------------------------------------------------------------------------------------------

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SENSENOVA_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                            "<img>", "</img>", "<IMG_CONTEXT>"]
QWEN_VL_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                          "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def byte_level_tokenizer(special_tokens, *, chat_template=None, vocab_size=None):
    """A ``PreTrainedTokenizerFast`` (byte-level BPE, 256 byte tokens, then ``special_tokens``).

    ``vocab_size``: filler tokens ``<wID>`` for every id from there up to it, so that every id a
    model of that vocabulary can pick decodes to text (a randomly drawn model at the released
    vocabulary picks ids past the bytes almost always; without the fillers its answers decode
    to empty strings, which every comparison of answers then finds equal). The BPE has no merges,
    so a prompt still encodes byte by byte, the same ids with the fillers as without."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def build(vocab):
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            additional_special_tokens=[t for t in special_tokens
                                       if t not in ("<|im_end|>", "<|endoftext|>")],
        )
        fast.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
        return fast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    fast = build(vocab)
    if vocab_size is not None:
        if vocab_size < len(fast):
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(fast)} ids")
        # The special tokens keep the ids they have without fillers; the fillers follow them.
        vocab.update({t: fast.convert_tokens_to_ids(t) for t in special_tokens})
        while len(vocab) < vocab_size:
            vocab[f"<w{len(vocab)}>"] = len(vocab)
        fast = build(vocab)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def _padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


# --------------------------------------------------------------------------------------------
# SenseNova-U1
# --------------------------------------------------------------------------------------------

def sensenova_config(vocab_size: int, *, num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                     intermediate=128, vision_hidden=32, patch_size=8,
                     add_noise_scale_embedding=True) -> dict:
    """``config.json`` in the layout ``SenseNovaU1Config.from_pretrained`` reads.

    ``patch_size`` 8 (the released model uses 16) keeps the flow-matching head small: its output is
    ``3 * (patch_size * 2) ** 2`` wide behind a fixed 4096-wide hidden layer.
    """
    llm = dict(
        model_type="sensenova_u1_llm", architectures=["Qwen3ForCausalLM"],
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
        rope_theta=5000000.0, rope_theta_hw=10000.0, max_position_embeddings=8192,
        max_position_embeddings_hw=10000, tie_word_embeddings=False,
        layer_types=["full_attention"] * num_layers, torch_dtype="bfloat16",
    )
    vision = dict(
        model_type="sensenova_u1_vision", num_channels=3, patch_size=patch_size,
        hidden_size=vision_hidden, llm_hidden_size=[hidden], downsample_ratio=[0.5],
        rope_theta_vision=10000.0, max_position_embeddings_vision=10000,
    )
    return dict(
        model_type="sensenova_u1", architectures=["SenseNovaU1ForConditionalGeneration"],
        llm_config=llm, vision_config=vision, downsample_ratio=0.5, template="neo1_0",
        fm_head_layers=2, fm_head_dim=4096, fm_head_mlp_ratio=1.0, use_pixel_head=False,
        noise_scale=1.0, noise_scale_mode="none", noise_scale_base_image_seq_len=256,
        noise_scale_max_value=10.0, add_noise_scale_embedding=add_noise_scale_embedding,
        time_schedule="standard", time_shift_type="exponential", base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, concat_time_token_num=0, t_eps=0.02,
        torch_dtype="bfloat16",
    )


FM_HEAD_HIDDEN = 4096  # fixed by the pipeline, whatever config.json says


def sensenova_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a SenseNova-U1 checkpoint, by the checkpoint's names (unfused q/k/v and
    gate/up projections; the understanding and ``_mot_gen`` generation branches)."""
    llm, vis = cfg["llm_config"], cfg["vision_config"]
    H, I, V = llm["hidden_size"], llm["intermediate_size"], llm["vocab_size"]
    nh, nkv, hd = llm["num_attention_heads"], llm["num_key_value_heads"], llm["head_dim"]
    bias = llm["attention_bias"]
    shapes: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (V, H),
        "language_model.lm_head.weight": (V, H),
        "language_model.model.norm.weight": (H,),
        "language_model.model.norm_mot_gen.weight": (H,),
    }
    for i in range(llm["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}"
        for branch in ("", "_mot_gen"):
            for proj, out in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
                shapes[f"{p}.self_attn.{proj}{branch}.weight"] = (out, H)
                if bias:
                    shapes[f"{p}.self_attn.{proj}{branch}.bias"] = (out,)
            shapes[f"{p}.self_attn.o_proj{branch}.weight"] = (H, nh * hd)
            if bias:
                shapes[f"{p}.self_attn.o_proj{branch}.bias"] = (H,)
            for norm in ("q_norm", "k_norm", "q_norm_hw", "k_norm_hw"):
                shapes[f"{p}.self_attn.{norm}{branch}.weight"] = (hd // 2,)
            shapes[f"{p}.mlp{branch}.gate_proj.weight"] = (I, H)
            shapes[f"{p}.mlp{branch}.up_proj.weight"] = (I, H)
            shapes[f"{p}.mlp{branch}.down_proj.weight"] = (H, I)
            shapes[f"{p}.input_layernorm{branch}.weight"] = (H,)
            shapes[f"{p}.post_attention_layernorm{branch}.weight"] = (H,)

    E, ps = vis["hidden_size"], vis["patch_size"]
    merge = int(round(1 / cfg["downsample_ratio"]))
    vis_merge = int(round(1 / vis["downsample_ratio"][0]))
    for prefix in ("vision_model", "fm_modules.vision_model_mot_gen"):
        shapes[f"{prefix}.embeddings.patch_embedding.weight"] = (E, vis["num_channels"], ps, ps)
        shapes[f"{prefix}.embeddings.patch_embedding.bias"] = (E,)
        shapes[f"{prefix}.embeddings.dense_embedding.weight"] = (H, E, vis_merge, vis_merge)
        shapes[f"{prefix}.embeddings.dense_embedding.bias"] = (H,)
    embedders = ["timestep_embedder"]
    if cfg["add_noise_scale_embedding"]:
        embedders.append("noise_scale_embedder")
    for name in embedders:
        shapes[f"fm_modules.{name}.mlp.0.weight"] = (H, 256)
        shapes[f"fm_modules.{name}.mlp.0.bias"] = (H,)
        shapes[f"fm_modules.{name}.mlp.2.weight"] = (H, H)
        shapes[f"fm_modules.{name}.mlp.2.bias"] = (H,)
    if cfg["use_pixel_head"]:
        raise NotImplementedError("use_pixel_head=True is not generated")
    out_dim = 3 * (ps * merge) ** 2
    shapes["fm_modules.fm_head.0.weight"] = (FM_HEAD_HIDDEN, H)
    shapes["fm_modules.fm_head.0.bias"] = (FM_HEAD_HIDDEN,)
    shapes["fm_modules.fm_head.2.weight"] = (out_dim, FM_HEAD_HIDDEN)
    shapes["fm_modules.fm_head.2.bias"] = (out_dim,)
    return shapes


def iter_random_tensors(shapes: dict[str, tuple[int, ...]], *, seed=0, dtype=torch.bfloat16,
                        device="cpu"):
    """(name, tensor) in ``shapes`` order, drawn on ``device`` from one seeded generator: norm
    weights near 1, everything else small and random (fan-in scaled)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():
        if "norm" in name and name.endswith(".weight"):
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=gen, device=device)
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
            t = torch.randn(shape, generator=gen, device=device) / fan_in ** 0.5
        yield name, t.to(dtype).contiguous()


def random_tensors(shapes: dict[str, tuple[int, ...]], *, seed=0, dtype=torch.bfloat16):
    """Every tensor of ``shapes`` on the CPU (``iter_random_tensors``)."""
    return dict(iter_random_tensors(shapes, seed=seed, dtype=dtype))


def save_sharded(tensors, path: str, shard_bytes: int) -> list[str]:
    """Save (name, tensor) pairs as ``model-0000i-of-0000n.safetensors`` files of at most
    ``shard_bytes`` each (a larger tensor gets a file of its own) and the
    ``model.safetensors.index.json`` a loader reads them by. Each shard is written, and its
    tensors let go, as soon as it is full. Returns the file names."""
    from safetensors.torch import save_file

    written: list[tuple[str, list[str]]] = []  # (temporary file, its tensor names)
    shard: dict = {}
    size = total = 0

    def flush():
        nonlocal total
        tmp = os.path.join(path, f".shard-{len(written)}.partial")
        on_cpu = {k: v.cpu() for k, v in shard.items()}
        save_file(on_cpu, tmp, metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in on_cpu.values())
        written.append((tmp, list(shard)))
        shard.clear()

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += nbytes
    if shard or not written:
        flush()
    names, weight_map = [], {}
    for i, (tmp, keys) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(tmp, os.path.join(path, fname))
        weight_map.update(dict.fromkeys(keys, fname))
        names.append(fname)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def write_sensenova_u1(path: str, *, seed: int = 0, dtype=torch.bfloat16, cfg: dict | None = None,
                       device="cpu", shard_bytes: int | None = None,
                       silent_tokens: tuple[str, ...] = (), **config_overrides) -> dict:
    """The checkpoint directory. ``cfg``: a whole ``config.json`` instead of ``sensenova_config``
    at the tokenizer's vocabulary with ``config_overrides`` (the released shape, say); ``device``:
    where the weights are drawn; ``shard_bytes``: sharded files with an index instead of one
    ``model.safetensors``; ``silent_tokens``: their ``lm_head`` rows zeroed, so that the model
    never picks them (every think and text answer then runs to its limit)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    if cfg is None:
        ids = len(byte_level_tokenizer(SENSENOVA_SPECIAL_TOKENS))  # bytes and special tokens
        cfg = sensenova_config(_padded_vocab(ids), **config_overrides)
    elif config_overrides:
        raise TypeError(f"cfg and config overrides together: {sorted(config_overrides)}")
    # Every id of the model's vocabulary decodes (``byte_level_tokenizer``'s fillers).
    tokenizer = byte_level_tokenizer(SENSENOVA_SPECIAL_TOKENS, chat_template=QWEN_CHAT_TEMPLATE,
                                     vocab_size=cfg["llm_config"]["vocab_size"])
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
                   "pad_token_id": tokenizer.pad_token_id}, f, indent=2)
    silent = [tokenizer.convert_tokens_to_ids(t) for t in silent_tokens]
    counts = {"num_tensors": 0, "num_params": 0}

    def drawn():
        for name, t in iter_random_tensors(sensenova_tensor_shapes(cfg), seed=seed, dtype=dtype,
                                           device=device):
            if silent and name == "language_model.lm_head.weight":
                t[silent] = 0
            counts["num_tensors"] += 1
            counts["num_params"] += t.numel()
            yield name, t

    if shard_bytes is None:
        save_file(dict(drawn()), os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        save_sharded(drawn(), path, shard_bytes)
    return {"config": cfg, **counts}


# --------------------------------------------------------------------------------------------
# Qwen-Image-2.1 (diffusers)
# --------------------------------------------------------------------------------------------

QWEN_TEXT_HIDDEN = 32


def qwen_text_encoder(vocab_size: int, token_ids: dict, *, seed: int = 0):
    """A tiny ``Qwen3VLForConditionalGeneration`` (2 text layers, 1 vision block)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    head_dim = 16
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=QWEN_TEXT_HIDDEN, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
            max_position_embeddings=4096, rms_norm_eps=1e-6, pad_token_id=token_ids["pad"],
            # mrope sections (t, h, w) cover head_dim // 2 rotary frequencies
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=QWEN_TEXT_HIDDEN,
            num_position_embeddings=64, deepstack_visual_indexes=[0],
        ),
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"], tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).eval()


def qwen_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # Pixel-area bounds (min: one 32x32 merged patch). The pipeline resizes reference images
    # itself, and the processor must then leave them alone, so that its image-token count matches
    # the VAE latents the transformer drops into those slots.
    size = {"shortest_edge": 32 * 32, "longest_edge": 16777216}
    image_processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                            size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                            size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor, chat_template=QWEN_CHAT_TEMPLATE)


def qwen_transformer(*, in_channels: int, seed: int = 0):
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=in_channels, out_channels=in_channels, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, context_in_dim=QWEN_TEXT_HIDDEN, mlp_ratio=3,
        axes_dims_rope=(4, 6, 6), causal_condition=True,
    )
    # The default init zeroes the output projections: draw everything so each block matters.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def qwen_vae(*, z_dim: int, seed: int = 0):
    """A tiny ``AutoencoderKLQwenImage21``: the released model's structure (16x spatial, 8x
    temporal compression, the pipeline hardcodes the 16x) at a fraction of its width."""
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1,
        attn_scales=[], temperal_downsample=[False, True, True, True],
        latents_mean=(0.1 * torch.randn(z_dim, generator=gen)).tolist(),
        latents_std=(1.0 + 0.1 * torch.rand(z_dim, generator=gen)).tolist(),
    ).eval()


def write_qwen_image_21(path: str, *, seed: int = 0, dtype=torch.bfloat16, z_dim: int = 16) -> dict:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    tokenizer = byte_level_tokenizer(QWEN_VL_SPECIAL_TOKENS, chat_template=QWEN_CHAT_TEMPLATE)
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    token_ids["pad"] = tokenizer.pad_token_id
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
        time_shift_type="exponential")
    pipe = QwenImage21Pipeline(
        scheduler=scheduler,
        vae=qwen_vae(z_dim=z_dim, seed=seed),
        text_encoder=qwen_text_encoder(_padded_vocab(len(tokenizer)), token_ids, seed=seed),
        processor=qwen_processor(tokenizer),
        transformer=qwen_transformer(in_channels=z_dim, seed=seed),
    )
    pipe.to(dtype)
    pipe.save_pretrained(path, safe_serialization=True)
    counts = {name: sum(p.numel() for p in getattr(pipe, name).parameters())
              for name in ("transformer", "vae", "text_encoder")}
    return {"num_params": counts}


# --------------------------------------------------------------------------------------------

def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def write_all(outdir: str, *, seed: int = 0, dtype=torch.bfloat16) -> dict[str, str]:
    paths = {"sensenova_u1": os.path.join(outdir, "sensenova_u1"),
             "qwen_image_21": os.path.join(outdir, "qwen_image_21")}
    write_sensenova_u1(paths["sensenova_u1"], seed=seed, dtype=dtype)
    write_qwen_image_21(paths["qwen_image_21"], seed=seed, dtype=dtype)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # not the per-model "cast with to()" advice
    os.makedirs(args.outdir, exist_ok=True)

    sn_path = os.path.join(args.outdir, "sensenova_u1")
    info = write_sensenova_u1(sn_path, seed=args.seed, dtype=dtype)
    print(f"wrote {sn_path}: SenseNova-U1, {info['num_tensors']} tensors, "
          f"{info['num_params'] / 1e6:.2f}M params, {_dir_size(sn_path) / 2**20:.1f} MiB")
    qw_path = os.path.join(args.outdir, "qwen_image_21")
    info = write_qwen_image_21(qw_path, seed=args.seed, dtype=dtype)
    parts = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in info["num_params"].items())
    print(f"wrote {qw_path}: QwenImage21Pipeline ({parts} params), "
          f"{_dir_size(qw_path) / 2**20:.1f} MiB")
    for path in (sn_path, qw_path):
        for root, _, files in sorted(os.walk(path)):
            for f in sorted(files):
                print("  ", os.path.relpath(os.path.join(root, f), args.outdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
