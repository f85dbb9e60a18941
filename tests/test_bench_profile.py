"""The benchmark's profile case and kernel comparison, on CPU.

The kernel categories and the GEMM attribution are checked on synthetic device traces with the
kernel names cuBLAS, cutlass, FA3, FlashInfer, Triton and vllm's ``_C`` ops use on Hopper. The
profile case itself (``bench.bench_profile``) runs end to end on a tiny SenseNova-U1 model and a
tiny Qwen-Image-2.1 transformer on CPU: same code, with the reference paged kernel, no graphs and
no device events.
"""

import json
import os
import sys
from types import SimpleNamespace

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import profile_step as ps  # noqa: E402

NAMES = {
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16>": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<int>>": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "gemm",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<int>>>":
        "attention",
    "void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128>>": "attention",
    "void flashinfer::BatchDecodeWithPagedKVCacheKernel<true, 2u, 4u>": "attention",
    "_fwd_grouped_kernel_stage1": "attention",  # vLLM's Triton decode attention
    "_fwd_kernel_stage2": "attention",
    "void marlin::Marlin<__nv_bfloat16, 4, 8, 8, true, 1>": "gemm",  # vLLM's W8A16
    "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
    "void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>": "norm",
    "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>": "norm",
    "void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>": "norm",
    "_fused_qk_norm_rope_kernel": "rope",
    "void vllm::rotary_embedding_kernel<c10::BFloat16, true>": "rope",
    "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>>":
        "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>":
        "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>":
        "elementwise",
    "void at::native::index_elementwise_kernel<128, 4>": "copy",
    "void at::native::indexSelectLargeIndex<c10::BFloat16, long>": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<int>": "copy",
    "some_new_kernel_nobody_knows": "other",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_kernel_names_fall_into_their_category(name):
    assert ps.classify(name) == NAMES[name]


def test_memcpy_and_memset_events_are_copies_whatever_their_name():
    assert ps.classify("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "copy"
    assert ps.classify("Memset (Device)", "gpu_memset") == "copy"


def test_busy_time_is_the_union_of_intervals():
    ev = [{"ts": 0.0, "dur": 10.0}, {"ts": 5.0, "dur": 10.0}, {"ts": 30.0, "dur": 5.0},
          {"ts": 31.0, "dur": 1.0}]
    assert ps.busy_us(ev) == 20.0


GEMM = "nvjet_tst_64x8_splitK_TNT"
GEMM_O = "nvjet_tst_64x8_64x16_o"
GEMM_UP = "sm90_xmma_gemm_bf16bf16_bf16f32_up"
GEMM_HEAD = "nvjet_tst_256x8_head"
REDUCE = "void cublasLt::splitKreduce_kernel<32, 16>"


def _step_events(layers, t0, prologue=()):
    """One synthetic decode step: ``prologue`` kernels, then per layer qkv, rope, attention,
    o (+ split-K reduce), norm, gate_up, silu, down; then lm_head. Durations in us."""
    seq = list(prologue)
    for _ in range(layers):
        seq += [(GEMM, 10.0), ("_fused_qk_norm_rope_kernel", 1.0),
                ("void flash::FlashAttnFwdSm90<int>", 5.0), (GEMM_O, 4.0), (REDUCE, 1.0),
                ("void vllm::fused_add_rms_norm_kernel<int>", 1.0), (GEMM_UP, 20.0),
                ("void vllm::act_and_mul_kernel<int>", 1.0), (GEMM, 12.0)]
    seq += [(GEMM_HEAD, 40.0), ("mystery_kernel", 2.0)]
    events, t = [], t0
    for name, dur in seq:
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur})
        t += dur + 1.0  # a 1 us gap after each kernel
    return events, t


def _trace(layers=2, steps=3, prologue=()):
    events, t = [], 0.0
    for _ in range(steps):
        step, t = _step_events(layers, t, prologue)
        events += step
        t += 100.0
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0,
                   "dur": 3.0})
    return {"traceEvents": events}


SIZES = {"qkv_proj": 10_000, "o_proj": 4_000, "gate_up_proj": 20_000, "down_proj": 12_000,
         "lm_head": 80_000}


def test_report_counts_per_step_and_attributes_gemms_by_position():
    layers, steps = 2, 3
    layout = (ps.SENSENOVA_PROJECTIONS, layers, "lm_head")
    rep = ps.report(_trace(layers, steps), steps, wall=1.0, gemm_layout=layout,
                    weight_bytes=SIZES, copy_bytes_per_s=2e9)
    per_step_kernels = 9 * layers + 2
    assert rep["kernels_per_step"] == per_step_kernels
    gemm_us = layers * (10 + 4 + 1 + 20 + 12) + 40
    assert rep["by_category"]["gemm"]["ms_per_step"] == pytest.approx(gemm_us / 1e3)
    assert rep["by_category"]["attention"]["kernels_per_step"] == layers
    assert rep["by_category"]["other"]["kernels_per_step"] == 1
    assert "mystery_kernel" in rep["other_kernel_names"]
    total_us = layers * 55 + 42
    assert rep["gpu_kernel_ms_per_step"] == pytest.approx(total_us / 1e3)
    assert rep["gpu_busy_ms_per_step"] == pytest.approx(total_us / 1e3)  # no overlap
    assert rep["launch_gap_ms_per_step"] == pytest.approx(1.0 - total_us / 1e3)
    assert rep["graph_launches_per_step"] == pytest.approx(1 / 3, abs=0.01)
    g = rep["gemm"]
    assert g["attributed"] and g["gemm_launches_per_step"] == 4 * layers + 1
    by = g["by_projection"]
    assert by["o_proj"]["mean_us"] == 5.0  # the split-K reduction joins its GEMM
    assert by["qkv_proj"]["calls_per_step"] == layers and by["lm_head"]["calls_per_step"] == 1
    assert by["down_proj"]["mean_us"] == 12.0 and "other_gemm" not in by
    assert by["gate_up_proj"]["achieved_gb_s"] == pytest.approx(20_000 / 20e-6 / 1e9, rel=1e-3)
    assert by["lm_head"]["of_copy_bandwidth"] == pytest.approx(80_000 / 40e-6 / 2e9, rel=1e-3)
    top = rep["top_kernels"][0]
    assert top["name"] == GEMM and top["count_per_step"] == 2 * layers  # qkv and down
    assert "gemm qkv_proj" in ps.table({"x": rep})


def test_gemms_before_the_layers_are_found_and_set_apart():
    layers, steps = 3, 2
    prologue = [("void gemv2T_kernel_val<int, 128>", 2.0), (GEMM, 3.0)]
    rep = ps.report(_trace(layers, steps, prologue), steps, wall=1.0,
                    gemm_layout=(ps.SENSENOVA_PROJECTIONS, layers, "lm_head"), weight_bytes=SIZES)
    by = rep["gemm"]["by_projection"]
    assert by["other_gemm"]["calls_per_step"] == 2 and by["other_gemm"]["mean_us"] == 2.5
    assert by["qkv_proj"]["mean_us"] == 10.0 and by["lm_head"]["mean_us"] == 40.0


def test_gemm_attribution_refuses_when_no_layer_run_fits():
    rep = ps.report(_trace(2, 3), 3, wall=1.0,
                    gemm_layout=(ps.SENSENOVA_PROJECTIONS, 3, "lm_head"), weight_bytes={})
    assert rep["gemm"]["attributed"] is False and "no run of 3 layers" in rep["gemm"]["why"]
    assert "gemm not attributed" in ps.table({"x": rep})
    uneven = ps.report(_trace(2, 3), 2, wall=1.0,
                       gemm_layout=(ps.SENSENOVA_PROJECTIONS, 2, "lm_head"), weight_bytes={})
    assert "not the same number per step" in uneven["gemm"]["why"]


def test_an_opaque_replay_is_detected():
    rep = ps.report({"traceEvents": []}, 10, wall=9.5)
    assert rep["kernels_per_step"] == 0 and ps.opaque(rep, 5 * 42)


# ------------------------------------------------------------------ the case itself, on CPU

@pytest.fixture(scope="module")
def tiny_lm():
    from vllm_omni_graphdecode.testing import sensenova as rm

    tok = rm.build_tokenizer()
    lm = rm.build_lm(banned_ids=rm.stop_ids(tok))
    return lm, tok


def test_profile_case_runs_end_to_end_on_cpu(tmp_path, monkeypatch, tiny_lm):
    import bench
    import qwen_tiny
    from vllm_omni_graphdecode.ops import attention as kernels

    monkeypatch.setattr(bench, "sensenova_model", lambda: tiny_lm)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda env: 1e11)
    monkeypatch.setattr(bench.attention, "select_kernel", lambda *a, **k: kernels.REFERENCE)
    monkeypatch.setattr(bench.rm, "has_intree_paged_decode", lambda: False)
    monkeypatch.setattr(bench.qwen_models, "random_transformer",
                        lambda device, dtype: qwen_tiny.tiny_transformer())
    monkeypatch.setattr(bench, "QWEN_PROFILE_TARGET", (4, 4))
    monkeypatch.setenv("VLLM_OMNI_SENSENOVA_PAGED_DECODE", "0")  # 0.30's in-tree path stays off
    args = SimpleNamespace(out=str(tmp_path), tag="cpu", profile_context=20, profile_steps=3,
                           profile_eager_steps=3, fa=["3"], pending=[])
    rows, env = [], {}
    bench.bench_profile(args, rows, env)
    with open(tmp_path / "profile-cpu.json") as f:
        result = json.load(f)
    profiles = result["profiles"]
    assert set(profiles) == {"sensenova_graph_ctx20", "sensenova_graph_k1_ctx20",
                             "sensenova_eager_ctx20", "qwen_image_21_t2i_1024"}
    for name, prof in profiles.items():
        assert "error" not in prof, (name, prof)
    graph = profiles["sensenova_graph_ctx20"]
    assert graph["kernels_from"].startswith("graphs=False") and graph["steps"] == 3
    assert graph["wall_ms_per_step"] > 0 and graph["kernels_per_step"] == 0  # no device here
    assert graph["gemm"]["attributed"] is False
    assert profiles["sensenova_graph_k1_ctx20"]["steps"] == 3
    eager = profiles["sensenova_eager_ctx20"]
    assert eager["forwards"] == 3 and eager["steps"] == 3 and eager["wall_ms_per_step"] > 0
    qwen = profiles["qwen_image_21_t2i_1024"]
    assert qwen["prefix_len"] == 256 and qwen["target_tokens"] == 16
    assert qwen["attention_backend"] and qwen["graph"]["kernels_from"].startswith("static")
    assert qwen["graph"]["fallbacks"] == {}
    assert [r["case"] for r in rows] == ["profile_" + n for n in profiles]
    assert rows[0]["ours_ms"] == pytest.approx(graph["wall_ms_per_step"], rel=1e-3)
    assert result["sensenova"]["context"] == 20


def test_unknown_case_is_refused_with_the_known_ones(monkeypatch, capsys):
    import bench

    monkeypatch.setattr(sys, "argv", ["bench.py", "--out", "/tmp/x", "--cases", "profile,nope"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "unknown case(s) nope" in capsys.readouterr().err


def test_flashinfer_missing_says_what_to_build(monkeypatch, tmp_path):
    import attention_kernels as ak

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails as on the GPU host
    monkeypatch.setattr(ak, "FLASHINFER_SITE", str(tmp_path / "absent"))
    with pytest.raises(ImportError, match="0.6.14.*build_flashinfer_bundle.sh"):
        ak.import_flashinfer()


def test_flashinfer_status_note_points_at_the_kernel_rows(monkeypatch):
    from vllm_omni_graphdecode.testing import sensenova as rm

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    note = rm.flashinfer_status()
    assert note.startswith("not measured") and "0.6.14" in note
    assert "attention_paged_decode_ctxN" in note


def test_profile_rows_stay_out_of_the_plot(tmp_path):
    from plot import plot

    out = tmp_path / "p.png"
    plot([{"case": "profile_qwen_image_21_t2i_1024", "eager_ms": 2.0, "ours_ms": 1.0,
           "floor_ms": None, "speedup": 2.0}], str(out))
    assert not out.exists()


def test_weight_gemms_add_up_to_one_achieved_bandwidth():
    layers, steps = 2, 3
    rep = ps.report(_trace(layers, steps), steps, wall=1.0,
                    gemm_layout=(ps.SENSENOVA_PROJECTIONS, layers, "lm_head"),
                    weight_bytes=SIZES, copy_bytes_per_s=2e9)
    w = rep["gemm"]["weights"]
    nbytes = layers * (10_000 + 4_000 + 20_000 + 12_000) + 80_000
    us = layers * (10 + 5 + 20 + 12) + 40
    assert w["bytes_per_step"] == nbytes
    assert w["achieved_gb_s"] == round(nbytes / (us * 1e-6) / 1e9, 1)
    assert "weight GEMMs" in ps.table({"x": rep})


def test_the_cuda_libraries_for_flashinfer_link_are_read_from_the_process_maps():
    import attention_kernels as ak

    maps = [
        "7f00-7f01 r-xp 00000000 00:2a 123 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04",
        "7f02-7f03 r-xp 00000000 00:2a 124 /site/nvidia/cu13/lib/libcudart.so.13",
        "7f04-7f05 r-xp 00000000 00:2a 125 /site/nvidia/cu13/lib/libcudart_static.a",
        "7f06-7f07 rw-p 00000000 00:00 0 [heap]",
    ]
    assert ak.loaded_libs(maps) == {
        "libcuda.so": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04",
        "libcudart.so": "/site/nvidia/cu13/lib/libcudart.so.13"}


def test_fp8_floor_counts_the_decode_layers_copies_at_one_byte_and_keeps_lm_head_bf16(tiny_lm):
    """The FP8 decode row's own floor: the bf16 floor's bytes less one byte a weight of the 4 x
    layers linear layers the copies cover (plus their fp32 row scales); embeddings, norms,
    ``lm_head``, generation weights and K/V count as before."""
    import bench

    lm, _ = tiny_lm
    covered = [m for layer in lm.model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert len(covered) == 4 * len(lm.model.layers)
    saved = sum(m.weight.numel() * (m.weight.element_size() - 1) - m.weight.shape[0] * 4
                for m in covered)
    assert saved > 0
    for ctx in (16, 300):
        assert bench.sensenova_fp8_read_bytes(lm, ctx) == bench.sensenova_read_bytes(lm, ctx) - saved


def test_profile_parts_pick_the_profiles_and_fp8_says_why_it_cannot_run_here(tmp_path, monkeypatch,
                                                                          tiny_lm):
    """``--profile-parts graph_fp8,graph_fp8_plain`` profiles only the one-request step with FP8
    copies, as wired and without its folds and dependent launches; without FP8 (this CPU) each
    entry is the error that says why, and nothing else runs."""
    import bench
    from vllm_omni_graphdecode.ops import attention as kernels

    monkeypatch.setattr(bench, "sensenova_model", lambda: tiny_lm)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda env: 1e11)
    monkeypatch.setattr(bench.attention, "select_kernel", lambda *a, **k: kernels.REFERENCE)
    monkeypatch.setattr(bench.rm, "has_intree_paged_decode", lambda: False)
    args = SimpleNamespace(out=str(tmp_path), tag="cpu", profile_context=20, profile_steps=3,
                           profile_eager_steps=3, fa=["3"], pending=[],
                           profile_parts=["graph_fp8", "graph_fp8_plain"])
    rows, env = [], {}
    bench.bench_profile(args, rows, env)
    with open(tmp_path / "profile-cpu.json") as f:
        profiles = json.load(f)["profiles"]
    assert list(profiles) == ["sensenova_graph_fp8_ctx20", "sensenova_graph_fp8_plain_ctx20"]
    for name in profiles:
        assert "no FP8 copies" in profiles[name]["error"]
        assert "FP8 weights unavailable" in profiles[name]["error"]


def test_pdl_step_modes_run_the_rowgemv_step_and_are_compared_with_its_row():
    """``--step-modes rowgemv,rowgemv_pdl`` (the benchmark's own mode, no setting): its rows
    set ``..._SENSENOVA_STEP=rowgemv`` plus the ``pdl`` mode to put on the wired linears,
    alternate with the others every repeat, and each carries ``speedup_vs_rowgemv`` against the
    ``rowgemv`` row of its repeat; the mode passes the command line's check where an unknown
    one is refused with the setting's own message."""
    import bench

    args = SimpleNamespace(fa=["3"], tokens_per_launch=[], repeats=2, exact=False, fp8=False,
                           fp8_lm_head=False, step_modes=["rowgemv", "rowgemv_pdl"])
    variants = bench._plugin_variants(args, 2048)
    names = [name for name, _, _ in variants]
    assert names == ["sensenova_decode_ctx2048_fa3", "sensenova_decode_ctx2048_fa3_rowgemv",
                     "sensenova_decode_ctx2048_fa3_rowgemv_pdl", "sensenova_decode_ctx2048_fa3_r2",
                     "sensenova_decode_ctx2048_fa3_rowgemv_r2",
                     "sensenova_decode_ctx2048_fa3_rowgemv_pdl_r2"]
    settings = dict((name, env) for name, _, env in variants)
    assert settings["sensenova_decode_ctx2048_fa3_rowgemv_pdl"] == {
        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "rowgemv", "_pdl": "prefetch"}
    assert "_pdl" not in settings["sensenova_decode_ctx2048_fa3_rowgemv"]
    by_name = {name: {"ours_ms": ms} for name, ms in zip(names, (8.0, 7.0, 6.9, 8.1, 7.2, 7.0))}
    bench._step_mode_fields(args, 2048, by_name, {}, None)
    pdl, pdl2 = (by_name["sensenova_decode_ctx2048_fa3_rowgemv_pdl" + s] for s in ("", "_r2"))
    assert (pdl["rowgemv_ms"], pdl2["rowgemv_ms"]) == (7.0, 7.2)
    assert pdl["speedup_vs_rowgemv"] == pytest.approx(7.0 / 6.9, rel=1e-3)
    assert pdl2["speedup_vs_rowgemv"] == pytest.approx(7.2 / 7.0, rel=1e-3)
    assert "speedup_vs_rowgemv" not in by_name["sensenova_decode_ctx2048_fa3_rowgemv"]
    # rowgemv_plain: the rowgemv step with plain launches, the A/B against the step's default.
    assert bench._step_mode_settings("rowgemv_plain") == {
        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "rowgemv", "_pdl": "plain"}


def test_step_modes_on_the_command_line_take_the_benchmarks_own_and_refuse_unknown(monkeypatch,
                                                                                 capsys):
    import bench

    monkeypatch.setattr(sys, "argv", ["bench.py", "--out", "/tmp/x", "--cases", "nope",
                                      "--step-modes", "rowgemv,rowgemv_pdlwait"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "unknown case(s) nope" in capsys.readouterr().err  # the modes passed their check
    monkeypatch.setattr(sys, "argv", ["bench.py", "--out", "/tmp/x", "--step-modes", "fast"])
    with pytest.raises(SystemExit):
        bench.main()
    err = capsys.readouterr().err
    assert "--step-modes" in err and "'fast'" in err


def test_sensenova_gemm_bytes_count_an_fp8_copy_at_one_byte_a_weight(tiny_lm):
    """The profile's bandwidth per projection divides by the bytes the step reads: one a weight
    for the layers' e4m3 copies, and for ``lm_head`` only where its own copy is read."""
    import profile_step

    lm, _ = tiny_lm
    head = lm.lm_head.weight
    (_, layers, tail), bf16 = profile_step.sensenova_gemms(lm)
    _, fp8 = profile_step.sensenova_gemms(lm, fp8=True)
    _, both = profile_step.sensenova_gemms(lm, fp8=True, fp8_head=True)
    assert layers == len(lm.model.layers) and tail == "lm_head"
    size = head.element_size()  # the tiny model's dtype on this device
    assert size > 1
    assert bf16["lm_head"] == fp8["lm_head"] == size * head.numel() != both["lm_head"]
    assert both["lm_head"] == head.numel()
    down = lm.model.layers[0].mlp.down_proj.weight
    assert bf16["down_proj"] == size * down.numel()
    assert fp8["down_proj"] == both["down_proj"] == down.numel()


def test_text_loop_cases_write_each_finished_context_before_the_next(tmp_path, monkeypatch,
                                                                     tiny_lm):
    """A text-loop case cut at its time limit inside its third context still leaves the rows of
    the first two in ``bench-<tag>.json``."""
    import bench

    monkeypatch.setattr(bench, "sensenova_model", lambda: tiny_lm)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda env: 1e11)
    monkeypatch.setattr(bench.rm, "has_intree_paged_decode", lambda: False)
    args = SimpleNamespace(out=str(tmp_path), tag="cpu", contexts=[16, 24, 32], steps=4)
    rows, env, seen = [], {"gpu": "none"}, []
    path = tmp_path / "bench-cpu.json"
    for _, _, ctx, _, _, _ in bench._text_contexts(args, env, rows):
        written = json.loads(path.read_text())["cases"] if path.exists() else None
        seen.append((ctx, written))
        rows.append({"case": f"row_ctx{ctx}"})
        if ctx == 32:
            break  # the run is cut here: the third context's row is never written
    assert [ctx for ctx, _ in seen] == [16, 24, 32]
    assert seen[0][1] is None
    assert seen[1][1] == [{"case": "row_ctx16"}]
    assert seen[2][1] == [{"case": "row_ctx16"}, {"case": "row_ctx24"}]
    assert json.loads(path.read_text())["environment"] == env
