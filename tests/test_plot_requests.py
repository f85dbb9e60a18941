"""benchmarks/plot_requests.py on CPU: it draws a PNG from the committed whole-request results, and
every figure it draws is the one in its results file (it prints them as JSON); --batch rows (N
concurrent requests) are drawn per request, each figure its file's total divided by N."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "plot_requests.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# What the README's picture shows: (results file, case) -> the figures a reader would look up.
EXPECTED = {
    ("benchmarks/results/h200-2026-12-01b/request-0.30.json", "sensenova_t2i_1024"),
    ("benchmarks/results/h200-2026-12-01b/request-0.30.json", "sensenova_t2i_think_1024"),
    ("benchmarks/results/h200-2026-11-30c/qwen-image.json", "qwen_image_21_image_t2i_1024_50steps"),
    ("benchmarks/results/h200-2026-11-30c/qwen-image.json",
     "qwen_image_21_image_t2i_1024_50steps_cfg4"),
}
# What the README's picture adds with --batch: the concurrent rows of this session's results.
BATCH_FILE = "benchmarks/results/h200-2026-12-01e/batch-0.30/sensenova-batch.json"
BATCH_LABELS = {"sensenova_batch_text_n8": "8 concurrent text requests (per request)",
                "sensenova_batch_think_t2i_1024_n8": "8 concurrent think requests (per request)"}


def _run(*args):
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _case(path, case):
    with open(os.path.join(ROOT, path) if not os.path.isabs(path) else path) as f:
        doc = json.load(f)
    cases = doc["cases"] if isinstance(doc, dict) else doc
    return next(c for c in cases if c["case"] == case)


def test_the_png_is_drawn_and_every_bar_is_its_results_files_figure(tmp_path):
    out = tmp_path / "sub" / "requests.png"
    doc = _run("--out", str(out))
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert doc["png"] == str(out)
    assert {(r["file"], r["case"]) for r in doc["rows"]} == EXPECTED
    for row in doc["rows"]:
        found = _case(row["file"], row["case"])
        assert row["release_ms"] == found["eager_ms"] and row["plugin_ms"] == found["ours_ms"]
        assert row["speedup"] == round(found["eager_ms"] / found["ours_ms"], 2)
    releases = {r["model"]: r["release"] for r in doc["rows"]}
    assert releases == {"SenseNova-U1": "vllm-omni 0.30", "Qwen-Image-2.1": "diffusers 0.42.1"}


def test_batch_rows_are_drawn_per_request_and_step_rows_are_left_out(tmp_path):
    batch = tmp_path / "sensenova-batch.json"
    batch.write_text(json.dumps({"cases": [
        {"case": "sensenova_batch_think_t2i_1024_n4", "eager_ms": 17000.0, "ours_ms": 9000.5,
         "requests": 4},
        {"case": "sensenova_batch_decode_step_b8", "eager_ms": 7.5, "ours_ms": 8.0}]}))
    out = tmp_path / "requests.png"
    doc = _run("--out", str(out), "--batch", str(batch))
    assert out.read_bytes()[:8] == PNG_MAGIC
    added = [r for r in doc["rows"] if r["file"] == str(batch)]
    assert added == [{"model": "SenseNova-U1",
                      "request": "4 concurrent think requests (per request)",
                      "file": str(batch), "case": "sensenova_batch_think_t2i_1024_n4",
                      "release": "vllm-omni 0.30", "release_ms": 4250.0, "plugin_ms": 2250.125,
                      "speedup": 1.89, "requests": 4, "release_total_ms": 17000.0,
                      "plugin_total_ms": 9000.5}]
    assert [s["case"] for s in doc["skipped"]] == ["sensenova_batch_decode_step_b8"]
    assert len(doc["rows"]) == len(EXPECTED) + 1


def test_the_readme_pictures_concurrent_rows_are_the_batch_results_per_request(tmp_path):
    doc = _run("--out", str(tmp_path / "requests.png"), "--batch", BATCH_FILE)
    added = {r["case"]: r for r in doc["rows"] if r["file"] == BATCH_FILE}
    assert {c: r["request"] for c, r in added.items()} == BATCH_LABELS
    for case, row in added.items():
        found = _case(BATCH_FILE, case)
        n = found["requests"]
        assert row["requests"] == n == 8
        assert row["release_ms"] == found["eager_ms"] / n
        assert row["plugin_ms"] == found["ours_ms"] / n
        assert row["release_total_ms"] == found["eager_ms"]
        assert row["plugin_total_ms"] == found["ours_ms"]
        assert row["speedup"] == round(found["eager_ms"] / found["ours_ms"], 2)
    # the decode-step rows (ms per token / per step) are not requests
    with open(os.path.join(ROOT, BATCH_FILE)) as f:
        cases = json.load(f)["cases"]
    assert {s["case"] for s in doc["skipped"]} == {c["case"] for c in cases
                                                   if "requests" not in c}
    assert len(doc["rows"]) == len(EXPECTED) + len(BATCH_LABELS)
