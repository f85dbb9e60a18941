"""``examples/make_tiny_checkpoints.py`` writes checkpoints the real pipeline classes load, on CPU.

SenseNova-U1: vllm-omni's ``SenseNovaU1Pipeline`` is constructed from the directory (its own
``__init__``: config, tokenizer, model graph), the weights go through vllm-omni's diffusers loader
(file discovery, safetensors iterator) into the pipeline's ``load_weights`` (q/k/v and gate/up
fusion), and every parameter must be loaded with the file's value. The CPU adjustments are
``testing.sensenova.setup_runtime("cpu")``'s (gloo process group, SDPA attention, PyTorch rope).

Qwen-Image-2.1: diffusers' ``QwenImage21Pipeline.from_pretrained`` loads every component, and one
tiny text-to-image and one image-conditioned call run through them.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "make_tiny_checkpoints.py")


def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoints", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_ckpts")
    start = time.perf_counter()
    assert _script().main([str(out)]) == 0
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"writing the checkpoints took {elapsed:.1f}s"
    return {"sensenova_u1": str(out / "sensenova_u1"), "qwen_image_21": str(out / "qwen_image_21")}


def _file_tensors(path):
    from safetensors.torch import load_file

    return load_file(path)


# ---------------------------------------------------------------------------------------------
# SenseNova-U1
# ---------------------------------------------------------------------------------------------

SENSENOVA_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>", "<|im_start|>", "<|im_end|>", "<think>",
                    "</think>"]


@pytest.fixture(scope="module")
def sensenova(ckpt):
    from vllm_omni_graphdecode.testing import sensenova as rm

    rm.setup_runtime("cpu")
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.models.sensenova_u1.pipeline_sensenova_u1 import SenseNovaU1Pipeline

    od_config = OmniDiffusionConfig(model=ckpt["sensenova_u1"], dtype=torch.float32)
    pipe = SenseNovaU1Pipeline(od_config=od_config)
    loader = DiffusersPipelineLoader(LoadConfig(), od_config)
    weights = loader._get_weights_iterator(pipe.weights_sources[0])
    loaded = pipe.load_weights(weights)
    # What the loader's load_model does next: each linear layer's quant method finishes its
    # weights (on vllm's CPU platform the unquantized method builds its ``cpu_linear`` here).
    loader._process_weights_after_loading(pipe, torch.device("cpu"))
    return pipe.eval(), loaded


def test_sensenova_config_and_tokenizer(ckpt):
    from transformers import AutoTokenizer
    from vllm_omni.transformers_utils.configs.sensenova_u1 import SenseNovaU1Config

    cfg = SenseNovaU1Config.from_pretrained(ckpt["sensenova_u1"])
    llm, vis = cfg.llm_config, cfg.vision_config
    assert (llm.num_hidden_layers, llm.hidden_size, llm.head_dim) == (2, 64, 16)
    assert vis.llm_hidden_size == [llm.hidden_size]
    assert cfg.downsample_ratio == 0.5

    tok = AutoTokenizer.from_pretrained(ckpt["sensenova_u1"])
    ids = [tok.convert_tokens_to_ids(t) for t in SENSENOVA_TOKENS]
    assert len(set(ids)) == len(ids) and tok.unk_token_id not in ids
    assert all(0 <= i < llm.vocab_size for i in ids)
    # Special tokens are single ids inside text, and any text round-trips.
    text = "<|im_start|>user\nA café, 猫 🐈<|im_end|>\n\n<img><IMG_CONTEXT></img>"
    enc = tok(text, add_special_tokens=False)["input_ids"]
    for t, i in zip(["<|im_start|>", "<|im_end|>", "<img>", "<IMG_CONTEXT>"],
                    [ids[3], ids[4], ids[0], ids[2]]):
        assert i in enc, t
    assert tok.decode(enc) == text
    assert max(enc) < llm.vocab_size


def test_sensenova_pipeline_loads_every_parameter(ckpt, sensenova):
    pipe, loaded = sensenova
    params = dict(pipe.named_parameters())
    assert loaded == set(params), f"not loaded: {sorted(set(params) - loaded)}"
    assert pipe.img_context_token_id == pipe.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")

    files = _file_tensors(os.path.join(ckpt["sensenova_u1"], "model.safetensors"))

    def same(param_name, *file_names, dim=0):
        expected = torch.cat([files[n] for n in file_names], dim=dim).to(params[param_name].dtype)
        got = params[param_name].detach()[: expected.shape[0]]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)

    attn = "language_model.model.layers.1.self_attn"
    same(f"{attn}.qkv_proj.weight", f"{attn}.q_proj.weight", f"{attn}.k_proj.weight",
         f"{attn}.v_proj.weight")
    same(f"{attn}.qkv_proj_mot_gen.weight", f"{attn}.q_proj_mot_gen.weight",
         f"{attn}.k_proj_mot_gen.weight", f"{attn}.v_proj_mot_gen.weight")
    same(f"{attn}.o_proj.weight", f"{attn}.o_proj.weight")
    mlp = "language_model.model.layers.0.mlp_mot_gen"
    same(f"{mlp}.gate_up_proj.weight", f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight")
    same("language_model.model.embed_tokens.weight", "language_model.model.embed_tokens.weight")
    same("language_model.lm_head.weight", "language_model.lm_head.weight")
    same("fm_modules.fm_head.2.weight", "fm_modules.fm_head.2.weight")
    same("vision_model.embeddings.patch_embedding.weight",
         "vision_model.embeddings.patch_embedding.weight")
    same(f"{attn}.q_norm_hw_mot_gen.weight", f"{attn}.q_norm_hw_mot_gen.weight")


def test_sensenova_loaded_model_decodes(sensenova):
    """The loaded weights drive the pipeline's own text loop (prefill + ``_generate_text``)."""
    from vllm_omni_graphdecode.testing import sensenova as rm

    pipe, _ = sensenova
    ids = pipe.tokenizer("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                         return_tensors="pt", add_special_tokens=False)["input_ids"]
    out, _, _ = rm.prefill(pipe, ids)
    assert out.logits.shape[-1] >= pipe.llm_cfg.vocab_size
    assert torch.isfinite(out.logits).all()
    text = rm.run_text(pipe, ids, max_tokens=4)
    assert isinstance(text, str)


# ---------------------------------------------------------------------------------------------
# Qwen-Image-2.1 (diffusers)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(ckpt):
    from diffusers import QwenImage21Pipeline

    return QwenImage21Pipeline.from_pretrained(ckpt["qwen_image_21"], dtype=torch.float32)


def test_qwen_image_21_components(ckpt, qwen):
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler,
                           QwenImage21Transformer2DModel)
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    assert isinstance(qwen.transformer, QwenImage21Transformer2DModel)
    assert isinstance(qwen.vae, AutoencoderKLQwenImage21)
    assert isinstance(qwen.text_encoder, Qwen3VLForConditionalGeneration)
    assert isinstance(qwen.processor, Qwen3VLProcessor)
    assert isinstance(qwen.scheduler, FlowMatchEulerDiscreteScheduler)
    # Shapes that must agree across components.
    assert qwen.transformer.config.in_channels == qwen.vae.config.z_dim
    text_hidden = qwen.text_encoder.config.text_config.hidden_size
    assert qwen.transformer.config.context_in_dim == text_hidden
    tok = qwen.processor.tokenizer
    assert qwen._img_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert qwen._img_token_id == qwen.text_encoder.config.image_token_id
    assert qwen._drop_idx > 0

    root = ckpt["qwen_image_21"]
    files = _file_tensors(os.path.join(root, "transformer", "diffusion_pytorch_model.safetensors"))
    state = qwen.transformer.state_dict()
    assert set(files) == set(state)
    name = "transformer_blocks.1.attn.to_q.weight"
    torch.testing.assert_close(state[name], files[name].float(), rtol=0, atol=0)

    files = _file_tensors(os.path.join(root, "vae", "diffusion_pytorch_model.safetensors"))
    state = qwen.vae.state_dict()
    assert set(files) <= set(state)
    for name in list(files)[:3]:
        torch.testing.assert_close(state[name], files[name].float(), rtol=0, atol=0)

    files = _file_tensors(os.path.join(root, "text_encoder", "model.safetensors"))
    state = qwen.text_encoder.state_dict()
    common = set(files) & set(state)
    assert len(common) == len(files), sorted(set(files) - set(state))[:5]
    for name in sorted(common)[:5]:
        torch.testing.assert_close(state[name], files[name].float(), rtol=0, atol=0)


def test_qwen_image_21_runs(qwen):
    """Text-to-image and image-conditioned calls through every component. Two steps: with one,
    the scheduler's terminal-shift stretch divides by zero."""
    import numpy as np
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    out = qwen("a red cube", height=32, width=32, num_inference_steps=2, output_type="np",
               generator=gen)
    assert out.images.shape[:3] == (1, 32, 32)
    assert np.isfinite(out.images).all()

    ref = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    out = qwen("make it blue", image=ref, height=32, width=32, output_resolution=32,
               num_inference_steps=2, output_type="np", generator=gen)
    assert out.images.shape[:3] == (1, 32, 32)
    assert np.isfinite(out.images).all()
