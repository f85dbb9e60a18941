"""The whole-request SenseNova-U1 benchmark harness (benchmarks/sensenova_request.py), on CPU.

The tiny checkpoint end to end through ``SenseNovaU1Pipeline.forward``, eager then wired: on CPU
the plugin's denoising gate refuses (not CUDA) and the request runs the pipeline's own code, so
the two images must be equal to the bit; what is checked is the harness: rows and fields, a
breakdown whose disjoint parts fit in the request, per-branch step split, forced think tokens.
The real shape is checked on the meta device (parameter counts against the released model's),
and the real shape's build path (word-level tokenizer, weights drawn in place, end tokens
zeroed) on a small shape.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import sensenova_request as sr  # noqa: E402

from vllm_omni_graphdecode.core.reasons import NOT_CUDA  # noqa: E402

SIZE, STEPS, THINK_TOKENS = 64, 2, 8
# Rounding of each part to 4 decimals: the parts' sum may exceed the total by that much.
EPS = 1e-3
REQUEST_FIELDS = ("eager_ms", "ours_ms", "speedup", "psnr_db", "ssim", "identical", "breakdown",
                  "first_eager_ms", "first_ours_ms", "eager_think_tokens", "ours_think_tokens",
                  "plugin_counters", "plugin_fallbacks", "plugin_summary", "prefix_tokens",
                  "image_tokens", "denoise_floor_ms", "syncs")
STEP_FIELDS = ("eager_ms", "ours_ms", "floor_ms", "branches", "eager_branch_ms", "ours_branch_ms",
               "eager_outside_ms", "ours_outside_ms", "branch_floor_ms", "prefix_tokens",
               "image_tokens", "matmul_tflops")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tiny model's ops are microseconds long: two intra-op threads on two shared cores
    spend their time in OpenMP barriers."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("sensenova_request")
    rc = sr.main(["--tiny", "--device", "cpu", "--size", str(SIZE), "--steps", str(STEPS),
                  "--cfg", "4", "--think", "both", "--think-tokens", str(THINK_TOKENS),
                  "--profile", "--rounding-references", "--out", str(out)])
    with open(out / "sensenova-request.json") as f:
        data = json.load(f)
    return rc, data, out


def _rows(data):
    return {row["case"]: row for row in data["cases"]}


def _breakdowns(data):
    for row in data["cases"]:
        for side, bd in row.get("breakdown", {}).items():
            yield row["case"], side, bd


def test_both_sides_run_and_the_json_has_the_step_row_and_one_request_row_per_think_mode(result):
    rc, data, out = result
    assert rc == 0
    rows = _rows(data)
    assert set(rows) == {f"sensenova_image_step_{SIZE}_tiny", f"sensenova_t2i_{SIZE}_tiny",
                         f"sensenova_t2i_think_{SIZE}_tiny"}
    for name in (f"sensenova_t2i_{SIZE}_tiny", f"sensenova_t2i_think_{SIZE}_tiny"):
        missing = [f for f in REQUEST_FIELDS if f not in rows[name]]
        assert not missing, f"{name} lacks {missing}"
        assert rows[name]["eager_ms"] > 0 and rows[name]["ours_ms"] > 0
        assert rows[name]["speedup"] == pytest.approx(
            rows[name]["eager_ms"] / rows[name]["ours_ms"], rel=1e-3)
        assert set(rows[name]["breakdown"]) == {"eager", "ours"}
    step = rows[f"sensenova_image_step_{SIZE}_tiny"]
    missing = [f for f in STEP_FIELDS if f not in step]
    assert not missing, f"step row lacks {missing}"
    env = data["environment"]
    assert env["command"] and env["versions"]["torch"] and env["device"] == "cpu"
    assert env["build"]["model"] == "tiny checkpoint"
    assert (out / "sensenova-request.log").read_text().count("plugin think:") >= 1


def test_on_cpu_the_wired_pipeline_runs_its_own_steps_so_the_images_are_equal(result):
    _, data, _ = result
    for name in (f"sensenova_t2i_{SIZE}_tiny", f"sensenova_t2i_think_{SIZE}_tiny"):
        row = _rows(data)[name]
        assert row["psnr_db"] == "inf" and row["identical"] is True
        # The plugin was wired for that side and refused each branch for its reason: every
        # branch step of the timed request ran the pipeline's own code.
        assert "image denoising" in row["plugin_summary"]
        assert row["plugin_counters"] == {"sensenova_u1_image.eager_branch": STEPS * 2}
        assert any(NOT_CUDA.key in k for k in row["plugin_fallbacks"])
    config = data["environment"]["plugin_config"]
    assert config["env"][sr.DENOISE_VAR] == "graph" and "error" not in config
    assert config["parsed"][sr.DENOISE_VAR] == "graph"
    assert sr.DENOISE_VAR not in os.environ  # set for the plugin side only


def test_fp8_option_names_the_rows_and_sets_the_variable_for_the_plugin_side_only():
    assert sr.case_name("image_step", 1024, False, "on") == "sensenova_image_step_1024_fp8"
    assert sr.case_name("t2i_think", 1024, False, "off") == "sensenova_t2i_think_1024"
    saved_env = dict(os.environ)
    cfg, record, saved = sr.plugin_config(lambda *a: None, "fast", "sensenova_denoise")
    try:
        assert cfg.fp8 == {"sensenova_denoise"} and cfg.sensenova_denoise == "fast"
        assert record["env"][sr.FP8_VAR] == "sensenova_denoise"
    finally:
        sr._restore_env(saved)
    assert dict(os.environ) == saved_env


def test_the_branch_step_profile_ran_on_both_sides(result):
    _, data, _ = result
    profiles = data["environment"]["branch_step_profile"]
    assert set(profiles) == {"eager", "plugin"}
    for side, rep in profiles.items():
        assert "error" not in rep, (side, rep)
        assert rep["wall_ms_per_step"] > 0 and rep["image_tokens"] > 0
        assert rep["prefix_tokens"] > 0


def test_breakdown_parts_are_non_negative_and_fit_in_the_request(result):
    _, data, _ = result
    seen = 0
    for case, side, bd in _breakdowns(data):
        parts = {p: bd[p] for p in sr.PARTS}
        assert all(v >= 0 for v in parts.values()), (case, side, parts)
        assert sum(parts.values()) <= bd["total_ms"] + EPS, (case, side, parts, bd["total_ms"])
        assert bd["host_gap_ms"] >= -EPS
        assert bd["host_gap_ms"] + sum(parts.values()) == pytest.approx(bd["total_ms"], abs=EPS)
        # the loop is its steps plus the final image, with nothing left over
        assert bd["denoise_steps_ms"] + bd["final_image_ms"] == pytest.approx(
            bd["denoise_loop_ms"], abs=EPS)
        assert bd["prefill_cond_ms"] > 0 and bd["prefill_uncond_ms"] > 0
        seen += 1
    assert seen == 4  # two think modes, two sides


def test_each_step_splits_into_the_cond_and_uncond_branches_and_the_work_outside(result):
    _, data, _ = result
    for case, side, bd in _breakdowns(data):
        assert bd["branches"] == ["cond", "uncond"]
        assert len(bd["steps"]) == STEPS
        for step in bd["steps"]:
            assert set(step["branch_ms"]) == {"cond", "uncond"}
            assert all(v > 0 for v in step["branch_ms"].values())
            assert step["outside_ms"] == pytest.approx(
                step["step_ms"] - sum(step["branch_ms"].values()), abs=EPS)
            assert step["outside_ms"] > 0 and step["extract_feature_ms"] > 0
            assert step["combine_ms"] > 0
            assert step["extract_feature_ms"] + step["combine_ms"] <= step["outside_ms"] + EPS
        # the cond branch attends over the system prompt, the uncond one over 20 byte tokens
        assert bd["prefix_tokens"]["cond"] > bd["prefix_tokens"]["uncond"] > 0
        assert bd["image_tokens"] == (SIZE // 16) ** 2  # tiny patch 8, merge 2


def test_think_on_decodes_exactly_the_forced_tokens_on_both_sides_and_think_off_none(result):
    _, data, _ = result
    rows = _rows(data)
    think = rows[f"sensenova_t2i_think_{SIZE}_tiny"]
    assert think["eager_think_tokens"] == think["ours_think_tokens"] == THINK_TOKENS
    assert think["think_tokens_forced"] == THINK_TOKENS
    no_think = rows[f"sensenova_t2i_{SIZE}_tiny"]
    assert no_think["eager_think_tokens"] is None and no_think["ours_think_tokens"] is None
    for side in ("eager", "ours"):
        assert think["breakdown"][side]["think_ms"] > 0
        assert no_think["breakdown"][side]["think_ms"] == 0
        # the decoded tokens sit in the cond prefix the denoising attends to
        assert (think["breakdown"][side]["prefix_tokens"]["cond"]
                > no_think["breakdown"][side]["prefix_tokens"]["cond"])


def test_step_floor_is_the_branches_flops_over_the_measured_matmul_rate(result):
    _, data, _ = result
    step = _rows(data)[f"sensenova_image_step_{SIZE}_tiny"]
    assert step["floor_ms"] > 0 and step["matmul_tflops"] > 0
    assert step["floor_ms"] == pytest.approx(sum(step["branch_floor_ms"].values()), rel=1e-3)
    assert step["floor_ms"] == pytest.approx(
        sum(step["branch_flop"].values()) / (step["matmul_tflops"] * 1e12) * 1e3, rel=1e-2)
    # the longer prefix costs the cond branch more attention
    assert step["branch_floor_ms"]["cond"] > step["branch_floor_ms"]["uncond"]
    request = _rows(data)[f"sensenova_t2i_{SIZE}_tiny"]
    assert request["denoise_floor_ms"] == pytest.approx(step["floor_ms"] * STEPS, rel=1e-3)


def test_real_shape_on_meta_has_the_released_models_parameter_counts(tmp_path):
    """17.55 B parameters in all, 9.37 B in the understanding pathway (FACTS 6): the guessed
    vision and flow-matching sizes must land the total there."""
    from vllm_omni_graphdecode.testing import sensenova as rm

    rm.setup_runtime("cpu")
    ckpt = sr.write_real_checkpoint(str(tmp_path / "real"), sr.PROMPT)
    pipe = sr.construct_pipeline(ckpt, torch.device("meta"), torch.bfloat16)
    counts = sr.param_counts(pipe)
    assert counts["total"] == pytest.approx(17.55e9, rel=2e-3)
    assert counts["language_model_und"] + counts["vision_model"] == pytest.approx(9.37e9, rel=2e-3)
    h, q, kv, ff, layers = 4096, 32 * 128, 2 * 8 * 128, 12288, 42
    per_layer = h * (q + kv) + q * h + 2 * ff * h + ff * h
    fm_head = h * 4096 + 4096 * 3 * 32 ** 2
    assert sr.gen_linear_params(pipe) == layers * per_layer + fm_head


def test_real_build_path_with_word_tokenizer_forces_think_tokens_on_a_small_shape(tmp_path):
    """What the H200 run builds, at a CPU size: config.json and the word-level tokenizer written
    here, weights drawn in place, end tokens' lm_head rows zero, vLLM-Omni's weight finishing."""
    small = dict(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                 vision_hidden=32, patch_size=8, add_noise_scale_embedding=True)
    pipe = sr.build_real_pipeline(torch.device("cpu"), torch.bfloat16, 0, str(tmp_path),
                                  sr.PROMPT, shape=small, vocab_size=1024)
    ends = sr.end_token_ids(pipe.tokenizer)
    assert torch.count_nonzero(pipe.language_model.lm_head.weight[ends]) == 0
    assert torch.count_nonzero(pipe.language_model.lm_head.weight) > 0
    request = sr.make_request(size=32, steps=1, cfg=4, think=True, seed=0, prompt=sr.PROMPT,
                              tag="small")
    image, bd = sr.run_request(pipe, request, torch.device("cpu"), 4)
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert bd["think_tokens"] == 4
    # Qwen's chat template gives the empty uncond prompt 9 tokens; the stand-in must as well,
    # and the system message plus prompt one token per word or punctuation run.
    assert bd["prefix_tokens"]["uncond"] == 9
    assert 300 < bd["prefix_tokens"]["cond"] < 420


def test_rounding_references_ran_after_the_eager_side_with_their_psnr_against_both_images(
        result):
    _, data, _ = result
    refs = data["environment"]["rounding_references"]
    assert set(refs) == set(sr.ROUNDING_REFERENCES)
    for name, ref in refs.items():
        assert "error" not in ref, (name, ref)
        assert ref["what"] == sr.ROUNDING_REFERENCES[name] and ref["ms"] > 0
        # on CPU the plugin side runs the pipeline's own steps: its image is eager's
        assert ref["psnr_db_vs_plugin"] == ref["psnr_db_vs_eager"]
    # the other releases' RMSNorm rounds differently, so its image differs from eager's
    assert refs["other_release_rmsnorm"]["psnr_db_vs_eager"] != "inf"


def test_rounding_variant_swaps_one_rounding_for_its_block_and_restores_it(tmp_path):
    from vllm_omni_graphdecode.hooks.sensenova_u1 import fast_denoise as fd

    pipe = sr.build_tiny_pipeline(torch.device("cpu"), torch.bfloat16, 0, str(tmp_path))
    norm = pipe.language_model.model.norm_mot_gen
    cls, forward = type(norm), type(norm).forward
    chain = fd.cast_chain_norm(norm)
    assert chain is not None
    probe = cls(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(8, 64, dtype=torch.bfloat16) * 3
    own = probe(x)
    with sr.rounding_variant(pipe, "other_release_rmsnorm"):
        swapped = probe(x)
        assert torch.equal(swapped, fd.rms_norm(x, probe.weight, 1e-6, not chain))
        assert not torch.equal(swapped, own)  # the two definitions round apart on this input
    assert cls.forward is forward and torch.equal(probe(x), own)
    assert torch.equal(own, fd.rms_norm(x, probe.weight, 1e-6, chain))

    before = sys.modules.get(sr.TRITON_ROPE_MODULE, "absent")
    with sr.rounding_variant(pipe, "rope_fallback"):
        with pytest.raises(ImportError):
            __import__(sr.TRITON_ROPE_MODULE)
    assert sys.modules.get(sr.TRITON_ROPE_MODULE, "absent") is before
    with pytest.raises(ValueError, match="rope_fallback, other_release_rmsnorm"):
        sr.rounding_variant(pipe, "fp64")


def test_ssim_is_scikit_images_and_one_for_equal_images():
    # scikit-image comes with vllm-omni's dependencies (cosmos-guardrail), not pinned here
    structural_similarity = pytest.importorskip("skimage.metrics").structural_similarity
    import common

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (40, 33, 3)).astype(np.uint8)  # odd sizes: the mirrored edges
    b = np.clip(a + rng.normal(0, 25, a.shape), 0, 255).astype(np.uint8)
    want = structural_similarity(a, b, gaussian_weights=True, sigma=1.5,
                                 use_sample_covariance=False, data_range=255, channel_axis=-1)
    assert common.ssim(a, b) == pytest.approx(want, abs=1e-9)
    assert common.ssim(a, a.copy()) == 1.0
    assert common.ssim(a[..., 0], b[..., 0]) == pytest.approx(structural_similarity(
        a[..., 0], b[..., 0], gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
        data_range=255), abs=1e-9)
    with pytest.raises(ValueError):
        common.ssim(a, b[:-1])


def test_psnr_db_is_inf_for_equal_images_and_10log10_of_peak_over_mse_otherwise():
    a = np.zeros((4, 4, 3), dtype=np.uint8)
    assert sr.psnr_db(a, a.copy()) == math.inf
    b = a.copy()
    b[0, 0, 0] = 255  # one channel of 48 off by the peak: mse = 255**2 / 48
    assert sr.psnr_db(a, b) == pytest.approx(10 * math.log10(48))
    with pytest.raises(ValueError):
        sr.psnr_db(a, np.zeros((2, 2, 3), dtype=np.uint8))


def test_bench_py_runs_the_image_case_and_takes_its_rows(tmp_path):
    """``bench.py --cases sensenova_image`` runs this harness (here on the tiny checkpoint, on
    CPU, through ``--image-args``) and adds its rows to its own results."""
    from types import SimpleNamespace

    import bench

    args = SimpleNamespace(out=str(tmp_path), image_args=(
        f"--tiny --device cpu --size {SIZE} --steps 1 --cfg 4 --think off --no-audit"))
    rows, env = [], {}
    bench.bench_sensenova_image(args, rows, env)
    assert {row["case"] for row in rows} == {f"sensenova_image_step_{SIZE}_tiny",
                                              f"sensenova_t2i_{SIZE}_tiny"}
    assert all(row["eager_ms"] > 0 and row["ours_ms"] > 0 for row in rows)
    assert env["sensenova_request"]["argv"][:2] == ["--out", str(tmp_path / "sensenova-request")]
    assert (tmp_path / "sensenova-request" / "sensenova-request.json").exists()
