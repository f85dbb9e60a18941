"""What of the engine test's runner (tests/e2e_engine.py) holds without a GPU: which stats files
count as a model's. vllm-omni 0.26 spawns a worker per engine, so each model's worker writes a
file of its own; 0.30 runs a single diffusion stage inside the client process, so the second
model's engine writes the first one's file again (h200-2026-12-02b: every Qwen-Image-2.1 stats
check of the engine file failed with "stats files []" on 0.30, its counters in that file)."""

from __future__ import annotations

import json
import os

import e2e_engine


def _write(path, pid, counters, mtime_ns):
    """As the plugin writes it: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": pid, "counters": counters}))
    os.utime(tmp, ns=(mtime_ns, mtime_ns))
    os.replace(tmp, path)


def test_a_file_written_again_by_the_same_process_counts_for_the_next_model(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE_STATS_FILE", str(tmp_path / "stats-{pid}.json"))
    shared = tmp_path / "stats-7.json"
    _write(shared, 7, {"sensenova_u1_image.replay": 8}, 1_000_000_000)
    before = e2e_engine._stats_files()
    assert e2e_engine._written_since(before) == []  # nothing written since

    # The second model's engine: the same process writes its file again, another process a new one.
    _write(shared, 7, {"sensenova_u1_image.replay": 8, "qwen_image_21.replay": 4}, 2_000_000_000)
    _write(tmp_path / "stats-9.json", 9, {}, 2_000_000_000)
    written = sorted(os.path.basename(p) for p in e2e_engine._written_since(before))
    assert written == ["stats-7.json", "stats-9.json"]
    snaps = e2e_engine._read_stats(e2e_engine._written_since(before))
    assert snaps[0]["counters"]["qwen_image_21.replay"] == 4

    # A rewrite within the same timestamp (a coarse file system) still counts: a new inode.
    before = e2e_engine._stats_files()
    _write(shared, 7, {"qwen_image_21.replay": 5}, 2_000_000_000)
    assert [os.path.basename(p) for p in e2e_engine._written_since(before)] == ["stats-7.json"]


def test_no_stats_variable_means_no_files(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_GRAPHDECODE_STATS_FILE", "0")
    (tmp_path / "stats-1.json").write_text("{}")
    assert e2e_engine._stats_files() == {}
    assert e2e_engine._written_since({}) == []
