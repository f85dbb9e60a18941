"""scripts/pack_results.py: a results folder's raw files go into one deterministic raw.tar.xz, its
README, JSON, figures and session script stay plain, and a reader gets the folder back whole.
Every committed results folder is packed (the device call carries the tree beside a 49 MiB bundle
within 64 MiB)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import pack_results  # noqa: E402

FILES = {"README.md": b"# session\n", "bench.json": b"{}\n", "plot.png": b"\x89PNG",
         "x_session.sh": b"echo\n", "bench.log": b"log line\n" * 50,
         "gpu-tests/a.log": b"passed\n", "gpu-tests/a.xml": b"<x/>", "e2e/on/image.npy": b"\x93NUMPY",
         "e2e/on/result.json": b"{\"ok\": 1}\n"}
RAW = {"bench.log", "gpu-tests/a.log", "gpu-tests/a.xml", "e2e/on/image.npy"}


def _folder(path, files):
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)) or path, exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
    return str(path)


def test_raw_files_go_into_one_archive_and_the_rest_stays_plain(tmp_path):
    folder = _folder(tmp_path / "a", FILES)
    assert pack_results.pack(folder) == len(RAW)
    left = {os.path.relpath(os.path.join(r, n), folder) for r, _, ns in os.walk(folder) for n in ns}
    assert left == (set(FILES) - RAW) | {"raw.tar.xz"}
    assert not os.path.exists(os.path.join(folder, "gpu-tests"))  # emptied folders go too
    assert pack_results.read_archive(folder) == {k: FILES[k] for k in RAW}
    assert pack_results.loose_raw(folder) == [] and pack_results.pack(folder) == 0


def test_the_archive_is_the_same_bytes_for_the_same_contents_packed_in_two_goes(tmp_path):
    one = _folder(tmp_path / "one", FILES)
    pack_results.pack(one)
    two = _folder(tmp_path / "two", {k: v for k, v in FILES.items() if k != "bench.log"})
    pack_results.pack(two)
    _folder(two, {"bench.log": FILES["bench.log"]})  # a later raw file, added to the archive
    pack_results.pack(two)
    with open(os.path.join(one, "raw.tar.xz"), "rb") as a, \
            open(os.path.join(two, "raw.tar.xz"), "rb") as b:
        assert a.read() == b.read()


def test_a_folder_inside_an_archive_is_read_back_whole(tmp_path):
    folder = _folder(tmp_path / "a", FILES)
    pack_results.pack(folder)
    with pack_results.materialized(os.path.join(folder, "e2e")) as runs:
        assert runs != os.path.join(folder, "e2e")
        got = {os.path.relpath(os.path.join(r, n), runs) for r, _, ns in os.walk(runs) for n in ns}
        assert got == {"on/image.npy", "on/result.json"}
        with open(os.path.join(runs, "on", "image.npy"), "rb") as f:
            assert f.read() == FILES["e2e/on/image.npy"]
    assert not os.path.exists(runs)  # a temporary copy
    plain = _folder(tmp_path / "b", {"x.json": b"{}"})
    with pack_results.materialized(plain) as same:
        assert same == plain  # nothing archived: the folder itself


def test_every_committed_results_folder_is_packed():
    folders = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*", "")))
    assert folders
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pack_results.py"),
                           "--check", *folders], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
