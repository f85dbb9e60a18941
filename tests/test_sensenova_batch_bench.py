"""``benchmarks/sensenova_batch.py`` on the tiny checkpoint, on CPU: the JSON it writes holds both
sides of every case, their ratio, latencies within the batch's time, and the answers' agreement.
(On CPU the plugin's batched decode is refused, "not CUDA": the numbers are the CPU's, the
structure is the benchmark's; the H200 run is in benchmarks/results.)"""

import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch_bench")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "sensenova_batch.py"), "--out",
           str(out), "--tiny", "--device", "cpu", "--cases", "text,think", "--n", "2",
           "--think-ns", "1", "--steps", "2", "--size", "64", "--text-tokens", "10",
           "--text-prompt", "30"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, "sensenova-batch.json")) as f:
        return json.load(f)


def test_every_case_compares_both_sides_in_one_file(result):
    rows = {r["case"]: r for r in result["cases"]}
    assert set(rows) == {"sensenova_batch_text_n2", "sensenova_batch_think_t2i_64_n2",
                         "sensenova_batch_think_t2i_64_n1"}
    for row in rows.values():
        assert row["eager_ms"] > 0 and row["ours_ms"] > 0
        assert row["speedup"] == pytest.approx(row["eager_ms"] / row["ours_ms"], rel=1e-4)
        assert row["rows"] == 2
        assert 0 < row["ours_latency_ms"]["p50"] <= row["ours_latency_ms"]["p99"]
        assert row["ours_latency_ms"]["p99"] <= row["ours_ms"] * 1.0001
    n2 = rows["sensenova_batch_think_t2i_64_n2"]
    assert len(n2["eager_request_ms"]) == 2 and len(n2["ours_answers"]) == 2
    assert sum(n2["eager_request_ms"]) <= n2["eager_ms"] * 1.0001
    n1 = rows["sensenova_batch_think_t2i_64_n1"]
    assert "median request" in n1["eager_from"]
    assert n1["eager_ms"] == pytest.approx(statistics.median(n2["eager_request_ms"]), rel=1e-4)


def test_answers_agree_with_the_release_and_request0_across_batches(result):
    rows = {r["case"]: r for r in result["cases"]}
    for name in ("sensenova_batch_text_n2", "sensenova_batch_think_t2i_64_n2"):
        for a in rows[name]["agreement_with_release"]:
            assert a["chars_equal_before_parting"] <= a["chars"]
            # on CPU both sides decode eagerly (the batch is refused there): the same answers
            assert a["equal"]
    think = rows["sensenova_batch_think_t2i_64_n2"]["ours_answers"][0]
    assert len(think["image_sha256"]) == 64 and think["think_text"]
    env = result["environment"]
    assert env["think_request0_same_in_every_batch"] == {"batch_sizes": [1, 2], "same": True}
    assert "refused: not CUDA" in env["plugin_summary"]
    assert env["versions"]["torch"]


def test_fp8_option_names_rows_and_asks_the_fast_denoising_only_for_its_fp8_gemms():
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import sensenova_batch as sb

    assert sb._denoise_mode("sensenova_decode") == "graph"
    assert sb._denoise_mode("on") == "fast"
    assert sb._denoise_mode("sensenova_decode,sensenova_denoise") == "fast"
    assert sb._denoise_mode("off", "fast") == "fast"  # --denoise fast: bf16 with the fast body
    assert sb._denoise_mode("on", "graph") == "graph"  # --denoise wins over what FP8 implies
    ours = {"ms": 2.0, "latency_ms": [1.0, 2.0], "answers": []}
    for fp8, denoise, name in (("off", None, "sensenova_batch_think_t2i_64_n2"),
                               ("off", "graph", "sensenova_batch_think_t2i_64_n2"),
                               ("off", "fast", "sensenova_batch_think_t2i_64_n2_fast"),
                               ("on", None, "sensenova_batch_think_t2i_64_n2_fp8")):
        args = SimpleNamespace(size=64, fp8=fp8, denoise=denoise)
        row = sb.request_rows("think", 2, None, ours, args, rows=2, eager_ms=4.0)
        assert row["case"] == name and row["speedup"] == pytest.approx(2.0)


def test_profile_rows_takes_the_step_cases_row_counts_and_names_what_it_accepts(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import sensenova_batch as sb

    assert sb._row_counts("8,16") == [8, 16]
    assert sb._row_counts("") == []
    with pytest.raises(SystemExit) as exit_info:
        sb.main(["--out", str(tmp_path), "--profile-rows", "8,12"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'8,12'" in err and "1, 8 and 16" in err
    with pytest.raises(SystemExit):
        sb.main(["--out", str(tmp_path), "--step-tokens", "100"])
    assert "--step-tokens 100: accepted: a multiple" in capsys.readouterr().err


def test_row_launches_are_refused_without_the_row_gemm_they_choose_for(tmp_path, capsys):
    """``--row-launches`` picks the 16-row GEMM's launches: with the default cuBLAS step it is
    refused before anything is built, naming the option it needs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import sensenova_batch as sb

    with pytest.raises(SystemExit) as exit_info:
        sb.main(["--out", str(tmp_path), "--row-launches", "dependent"])
    assert exit_info.value.code == 2
    assert ("--row-launches dependent: accepted with --step-mode rowgemv only"
            in capsys.readouterr().err)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("fp8, step_mode, launches, suffix",
                         [("off", "fused", None, ""), ("off", "rowgemv", None, "_rowgemv"),
                          ("off", "rowgemv", "dependent", "_rowgemv_dependent"),
                          ("on", "fused", None, "_fp8")])
def test_profile_of_the_batched_step_writes_its_report_and_a_summary_row(tmp_path, fp8,
                                                                         step_mode, launches,
                                                                         suffix):
    """On CPU the profiler sees no device kernels: the report is written, and says so; its
    names carry the step rows' suffix (a ``--step-mode rowgemv`` profile was once named _fp8)."""
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import sensenova_batch as sb
    from vllm_omni_graphdecode.testing import sensenova as rm

    lm = rm.build_lm()
    hidden = torch.zeros(8, lm.lm_head.weight.shape[1], dtype=lm.lm_head.weight.dtype)
    calls = []

    def run():  # what a step ends in: the logits of 8 rows
        with torch.inference_mode():
            torch.nn.functional.linear(hidden, lm.lm_head.weight)
        calls.append(1)

    rows = []
    args = SimpleNamespace(step_tokens=4, context=64, out=str(tmp_path), fp8=fp8,
                           step_mode=step_mode, row_launches=launches)
    sb.profile_batched_step(run, 8, 2.5, lm, args, rows, fp8=False, device_type="cpu")
    assert calls == [1]
    name = "profile-batch-b8" + suffix.replace("_", "-") + ".json"
    with open(tmp_path / name) as f:
        rep = json.load(f)
    assert rep["rows"] == 8 and rep["context"] == 64 and rep["steps"] == 4
    assert rep["wall_ms_per_step"] == 2.5
    assert rep["kernels_from"].startswith("the profiler saw no device activity")
    (row,) = rows
    assert row["case"] == "sensenova_batch_step_profile_b8" + suffix
    assert row["file"] == name and row["kernels_per_step"] == 0


@pytest.mark.parametrize("mix, name, kinds", [
    ("text", "sensenova_batch_memory_n2", {"text_answers": 2, "think_images": 0}),
    ("mixed", "sensenova_batch_memory_mixed_n2", {"text_answers": 1, "think_images": 1}),
])
def test_memory_case_says_it_needs_cuda_where_the_batched_decode_is_refused(tmp_path, mix, name,
                                                                           kinds):
    """The memory case measures the worker threads of the batched decode, which runs on CUDA
    only: on CPU it writes a row that names its requests and says so, and measures nothing (the
    H200 run holds the figures); a mixed batch is half think images."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "sensenova_batch.py"), "--out",
           str(tmp_path), "--tiny", "--device", "cpu", "--cases", "memory", "--n", "2",
           "--memory-mix", mix]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(tmp_path, "sensenova-batch.json")) as f:
        rows = json.load(f)["cases"]
    assert len(rows) == 1 and rows[0]["case"] == name
    assert {k: rows[0][k] for k in kinds} == kinds
    assert rows[0]["skipped"] == ("needs CUDA: the batched decode (and its worker threads) runs "
                                  "on CUDA only")
    assert "used_mib" not in json.dumps(rows[0])
