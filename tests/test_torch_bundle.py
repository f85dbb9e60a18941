"""The torch 2.13 bundle's format (scripts/gpu/build_torch_bundle.py, torch_bundle_unpack.py),
round-tripped on a small archive without a GPU: parts arrive one folder per device call, a stash
copy cut short is replaced rather than used, and the target appears only whole."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))
import build_torch_bundle as bundle  # noqa: E402


def _unpack(folder, site):
    env = dict(os.environ, GRAPHDECODE_SITE_ROOT=str(site))
    out = subprocess.run([sys.executable, str(folder / "unpack.py")], env=env,
                         capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(shutil.which("xz") is None, reason="the bundle is packed with the xz tool")
def test_parts_arrive_one_by_one_and_a_cut_copy_is_replaced(tmp_path):
    rng = __import__("random").Random(0)
    entries = [(f"torch/lib/f{i}.bin", rng.randbytes(200_000), 0o644, 0) for i in range(6)]
    bundle.pack(entries, str(tmp_path / "a.tar"))
    manifest = bundle.split(str(tmp_path / "a.tar.xz"), str(tmp_path / "b"), 400_000)
    folders = [tmp_path / p["folder"] for p in manifest["parts"]]
    assert len(folders) >= 3
    site = tmp_path / "site"
    target = site / bundle.TARGET

    assert _unpack(folders[0], site) == (0, "[torch-bundle] waiting for " + ", ".join(
        f.name for f in folders[1:]))
    stashed = site / (bundle.TARGET + ".parts") / manifest["parts"][0]["name"]
    with open(stashed, "r+b") as f:  # a copy cut short by a call's time limit
        f.truncate(1000)
    for folder in folders[1:]:
        code, line = _unpack(folder, site)
        assert code == 0 and not target.exists(), line
    assert line == f"[torch-bundle] waiting for {folders[0].name}"
    assert _unpack(folders[0], site) == (0, f"[torch-bundle] unpacked into {target}")
    for name, data, _, _ in entries:
        assert (target / name).read_bytes() == data
    assert _unpack(folders[0], site) == (0, f"[torch-bundle] {target}: already unpacked")


def test_a_part_that_differs_from_its_manifest_is_refused(tmp_path):
    rng = __import__("random").Random(1)
    raw = tmp_path / "a.tar.xz"
    raw.write_bytes(rng.randbytes(50_000))  # split only cuts bytes: no xz needed here
    manifest = bundle.split(str(raw), str(tmp_path / "b"), 30_000)
    folder = tmp_path / manifest["parts"][1]["folder"]
    part = folder / manifest["parts"][1]["name"]
    part.write_bytes(b"x" + part.read_bytes()[1:])
    code, line = _unpack(folder, tmp_path / "site")
    assert code == 1 and "differs from MANIFEST.json" in line


def test_a_rebuild_with_fewer_parts_removes_the_extra_folders(tmp_path):
    raw = tmp_path / "a.tar.xz"
    raw.write_bytes(bytes(100_000))
    bundle.split(str(raw), str(tmp_path / "b"), 30_000)
    assert (tmp_path / "b-4").is_dir()
    bundle.split(str(raw), str(tmp_path / "b"), 60_000)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("b-")) == ["b-1", "b-2"]
