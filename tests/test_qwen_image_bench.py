"""The whole-image Qwen-Image-2.1 benchmark harness (benchmarks/qwen_image.py).

CPU: the tiny pipeline (real diffusers/transformers classes, 2-layer models) end to end, eager vs
the plugin's static-buffer step run eagerly (``capture=False``), which equals diffusers' cached
forward bit for bit on CPU (tests/test_qwen_image_21.py), so the two images must be equal. The
real shape is checked on the meta device (parameter counts, no memory). GPU: the real shape with
captured graphs, a couple of steps.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import qwen_image as qi  # noqa: E402
from vllm_omni_graphdecode.hooks import qwen_image_21  # noqa: E402

SIZE = 64  # 4x4 latents: the tiny pipeline's VAE compresses 16x, like the released one
STEPS = 3

ROW_FIELDS = ("eager_ms", "ours_ms", "first_ours_ms", "psnr_db", "first_psnr_db", "ssim", "identical",
              "first_equal", "eager_sha256", "ours_sha256", "latents_max_abs_diff", "steps", "warmup_steps", "height", "width", "true_cfg_scale",
              "prompt_tokens", "eager_step_ms", "ours_step_ms", "eager_split", "ours_split",
              "first_ours_split", "plugin_counters", "plugin_fallbacks")
SPLIT_FIELDS = ("total_ms", "encode_ms", "denoise_ms", "step0_ms", "step1_ms", "cached_step_ms",
                "decode_ms", "other_ms")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tiny models' ops are microseconds long: with two intra-op threads on two shared cores
    they spend their time in OpenMP barriers (this file took 35-50 s under a load of 4, 7 s with
    one thread)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def static_step(pipe):
    return qwen_image_21.enable(pipe, capture=False, mode="exact")


@pytest.fixture(scope="module")
def tiny_pipe():
    return qi.build_pipeline(device="cpu", dtype=torch.float32, size="tiny")


def test_psnr_db_is_inf_for_equal_images_and_10log10_of_inverse_mse_otherwise():
    a = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert qi.psnr_db(a, a.clone()) == math.inf
    zeros = torch.zeros(3, 4, 4)
    assert qi.psnr_db(zeros, torch.full((3, 4, 4), 0.1)) == pytest.approx(20.0)  # mse 1e-2
    assert qi.psnr_db(zeros, torch.ones(3, 4, 4)) == pytest.approx(0.0)  # mse 1 = peak
    half = torch.zeros(1, 2, 2)
    half[0, 0] = 1.0  # two of four pixels off by 1: mse 0.5
    assert qi.psnr_db(torch.zeros(1, 2, 2), half) == pytest.approx(10 * math.log10(2))
    with pytest.raises(ValueError, match="shapes differ"):
        qi.psnr_db(torch.zeros(3, 4, 4), torch.zeros(4, 4, 4))


def test_generate_returns_a_float_chw_image_in_0_1_and_the_phase_split(tiny_pipe):
    details: dict = {}
    image, ms = qi.generate(tiny_pipe, qi.DEFAULT_PROMPT, height=SIZE, width=SIZE, steps=STEPS,
                            true_cfg_scale=1.0, seed=0, details=details)
    assert image.dtype == torch.float32 and image.shape == (4, SIZE, SIZE)  # RGBA
    assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0
    assert float(image.std()) > 0.01  # not a blank image: PSNR between two of them means something
    assert ms > 0 and details["total_ms"] == ms
    assert set(SPLIT_FIELDS) <= set(details)
    phases = sum(details[k] for k in ("encode_ms", "denoise_ms", "decode_ms", "other_ms"))
    assert phases == pytest.approx(ms, abs=0.01)
    assert details["latents"].shape == (1, (SIZE // 16) ** 2, 16)
    # The instance wrappers are gone again: the pipeline is as it was built.
    assert "encode_prompt" not in tiny_pipe.__dict__
    assert "decode" not in tiny_pipe.vae.__dict__
    assert "set_begin_index" not in tiny_pipe.scheduler.__dict__


def test_generate_refuses_cfg_without_negative_prompt_negative_prompt_at_cfg_1_and_one_step(
        tiny_pipe):
    kwargs = dict(height=SIZE, width=SIZE, seed=0)
    with pytest.raises(ValueError, match="true CFG needs both"):
        qi.generate(tiny_pipe, "a cat", true_cfg_scale=4.0, steps=2, **kwargs)
    with pytest.raises(ValueError, match="true CFG needs both"):
        qi.generate(tiny_pipe, "a cat", true_cfg_scale=1.0, negative_prompt="blurry", steps=2,
                    **kwargs)
    with pytest.raises(ValueError, match="at least 2 steps"):
        qi.generate(tiny_pipe, "a cat", true_cfg_scale=1.0, steps=1, **kwargs)


@pytest.mark.parametrize("cfg, branches", [(1.0, 1), (4.0, 2)])
def test_run_case_wired_image_equals_eager_and_every_cached_step_ran_the_plugin(
        tiny_pipe, cfg, branches):
    row = qi.run_case(tiny_pipe, enable=static_step, cfg=cfg, steps=STEPS, height=SIZE,
                      width=SIZE, warmup_steps=2)
    assert set(ROW_FIELDS) <= set(row)
    assert row["psnr_db"] == math.inf and row["first_psnr_db"] == math.inf
    assert row["identical"] and row["latents_max_abs_diff"] == 0.0
    # The digests hash the images: equal images, equal 64-hex digests.
    assert row["first_equal"] and row["eager_sha256"] == row["ours_sha256"]
    assert len(row["ours_sha256"]) == 64
    assert (row["steps"], row["warmup_steps"], row["height"], row["width"],
            row["true_cfg_scale"]) == (STEPS, 2, SIZE, SIZE, cfg)
    assert len(row["prompt_tokens"]) == branches
    for split in ("eager_split", "ours_split", "first_ours_split"):
        assert set(SPLIT_FIELDS) <= set(row[split])
    # Not a silent fallback: every cached step of every branch went through the plugin.
    assert row["plugin_counters"].get("static_step") == branches * (STEPS - 1)
    assert "eager_step" not in row["plugin_counters"]
    assert row["plugin_fallbacks"] == {}
    assert "forward" not in tiny_pipe.transformer.__dict__  # disabled again


def test_run_case_passes_enable_kwargs_through_and_disables_on_the_way_out(tiny_pipe):
    seen = []

    def enable(pipe, **kwargs):
        seen.append(kwargs)
        return qwen_image_21.enable(pipe, **kwargs)

    row = qi.run_case(tiny_pipe, enable=enable, cfg=1.0, steps=2, height=SIZE, width=SIZE,
                      warmup_steps=2, capture=False, max_entries=3)
    assert seen == [{"capture": False, "max_entries": 3}]
    assert row["enable_kwargs"] == {"capture": "False", "max_entries": "3"}
    assert getattr(tiny_pipe.transformer, "_graphdecode_qwen", None) is None


def test_case_names_match_the_result_files():
    name = qi.case_name
    assert name(height=1024, width=1024, steps=50, cfg=1.0, size="real") == \
        "qwen_image_21_image_t2i_1024_50steps"
    assert name(height=1024, width=1024, steps=50, cfg=4.0, size="real") == \
        "qwen_image_21_image_t2i_1024_50steps_cfg4"
    assert name(height=64, width=64, steps=3, cfg=4.0, size="tiny") == \
        "qwen_image_21_image_t2i_64_3steps_cfg4_tiny"


def test_real_size_components_have_the_released_parameter_counts():
    """On the meta device: no memory, no weights drawn; the shapes only."""
    tok = qi.prompt_tokenizer(qi._tokenizer_corpus([qi.DEFAULT_PROMPT]))
    ids = {t: tok.convert_tokens_to_ids(t) for t in qi.tiny.QWEN_VL_SPECIAL_TOKENS}
    from vllm_omni_graphdecode.testing.qwen import random_transformer

    def count(module):
        return sum(p.numel() for p in module.parameters())

    encoder = qi.real_text_encoder(ids, device="meta", dtype=torch.bfloat16)
    assert count(encoder) == 8_767_123_696  # Qwen3-VL-8B
    assert encoder.config.text_config.num_hidden_layers == 36
    assert count(random_transformer(device="meta", dtype=torch.bfloat16)) == 7_115_124_736
    assert count(qi.real_vae(device="meta", dtype=torch.bfloat16)) == 337_740_404


def test_tokenizer_gives_a_word_one_position_and_keeps_special_tokens_whole():
    tok = qi.prompt_tokenizer(qi._tokenizer_corpus(["a ginger cat asleep on a stack of books"]))
    assert len(tok("a ginger cat asleep", add_special_tokens=False)["input_ids"]) == 4
    ids = tok("<|im_start|>user\n<|image_pad|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|image_pad|>")
    unseen = tok("unseen wörds", add_special_tokens=False)["input_ids"]
    assert tok.decode(unseen) == "unseen wörds"


def test_cli_prints_a_json_line_per_case_and_writes_qwen_image_json(tmp_path, capsys):
    rc = qi.main(["--out", str(tmp_path), "--size", "tiny", "--device", "cpu", "--steps", "2",
                  "--warmup-steps", "2", "--cfg", "1,4", "--modes", "exact"])
    assert rc == 0
    # vllm, imported on the way, logs to stdout too: the rows are the lines that are JSON objects.
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("{")]
    names = ["qwen_image_21_image_t2i_64_2steps_exact_tiny",
             "qwen_image_21_image_t2i_64_2steps_cfg4_exact_tiny"]
    assert [row["case"] for row in lines] == names
    with open(tmp_path / "qwen-image.json") as f:
        written = json.load(f)  # strict enough: an infinite PSNR is the string "inf"
    assert [row["case"] for row in written["cases"]] == names
    for row in written["cases"]:
        assert row["psnr_db"] == "inf" and row["speedup"] is not None
    assert written["environment"]["build"]["size"] == "tiny"


@pytest.mark.gpu
def test_real_size_on_gpu_wired_image_matches_eager_and_cached_steps_replay_graphs():
    steps = 2
    pipe = qi.build_pipeline(device="cuda", dtype=torch.bfloat16, size="real")
    try:
        for cfg, branches in ((1.0, 1), (4.0, 2)):
            row = qi.run_case(pipe, enable=qwen_image_21.enable, cfg=cfg, steps=steps,
                              height=1024, width=1024, warmup_steps=2)
            # The cached step replays bit for bit on the H200 (bench.py's qwen_image_21_step
            # rows: exact, max_abs_diff 0.0); 40 dB leaves room for a kernel that is not
            # deterministic run to run.
            assert row["psnr_db"] >= 40.0, row
            assert row["plugin_counters"].get("replay") == branches * (steps - 1), row
            assert "eager_step" not in row["plugin_counters"], row
    finally:
        del pipe
        torch.cuda.empty_cache()
