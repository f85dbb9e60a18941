"""scripts/gpu/rebalance_bundle.py on a small fake bundle: after it moves parts between folders 2
and 3, each folder's MANIFEST.json still names that folder (``this_folder``), so the bundle's own
unpack.py, run in a folder carried alone, finds the parts that folder holds: it unpacks what is
whole there and stashes the rest for a later folder. (Seen on the H200: with folder 1's manifest
copied into every folder, folders 2 and 3 carried one per call unpacked nothing and stashed
nothing.)

unpack.py is the shared bundle builder's (../shared/gpu/unpack.py where that checkout is beside
this one; tests/data/gpu_bundle_unpack.py, a copy of it, elsewhere)."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import random
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REBALANCE = os.path.join(ROOT, "scripts", "gpu", "rebalance_bundle.py")
SHARED_UNPACK = os.path.join(os.environ.get("GRAPHDECODE_SHARED", os.path.join(ROOT, "..", "shared")),
                             "gpu", "unpack.py")
UNPACK = SHARED_UNPACK if os.path.exists(SHARED_UNPACK) else os.path.join(
    ROOT, "tests", "data", "gpu_bundle_unpack.py")
NAMES = {1: ".gpu-bundle", 2: ".gpu-bundle-2", 3: ".gpu-bundle-3"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tar_xz(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tf:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tf.addfile(info, io.BytesIO(data))
    return lzma.compress(raw.getvalue())


def _fake_bundle(repo) -> dict:
    """Folder 1 holds the base archive; folders 2 and 3 the extras as the shared builder leaves
    them, folder 2 overfull: one archive split in two parts, two whole ones. Random bytes, so xz
    cannot shrink the sizes the rebalance balances."""
    rng = random.Random(0)
    payload = {"base": {"base_pkg/__init__.py": b"BASE = 1\n"},
               "split": {"split_pkg/blob.bin": rng.randbytes(550_000)},
               "whole_a": {"a_pkg/blob.bin": rng.randbytes(200_000)},
               "whole_b": {"b_pkg/blob.bin": rng.randbytes(100_000)}}
    blobs = {k: _tar_xz(v) for k, v in payload.items()}
    for name in NAMES.values():
        os.makedirs(os.path.join(repo, name))
    layout = {"base": [(1, 0, None)], "split": [(2, 0, 300_000), (2, 300_000, None)],
              "whole_a": [(2, 0, None)], "whole_b": [(3, 0, None)]}
    archives = []
    for key, pieces in layout.items():
        parts = []
        for i, (folder, start, end) in enumerate(pieces):
            data = blobs[key][start:end]
            fname = f"{key}.tar.xz" + (f".part{i + 1}" if len(pieces) > 1 else "")
            with open(os.path.join(repo, NAMES[folder], fname), "wb") as f:
                f.write(data)
            parts.append({"file": fname, "folder": folder, "size": len(data), "sha256": _sha(data)})
        target = "site" if key in ("base", "split") else "site-omni-0.30.0"
        archives.append({"name": f"{key}.tar.xz", "kind": "tar", "target": target,
                         "size": len(blobs[key]), "sha256": _sha(blobs[key]), "parts": parts})
    manifest = {"format": 1, "python": "%d.%d" % sys.version_info[:2],
                "folders": {str(k): v for k, v in NAMES.items()},
                "targets": ["site", "site-omni-0.30.0"], "archives": archives}
    for k, name in NAMES.items():
        with open(os.path.join(repo, name, "MANIFEST.json"), "w") as f:
            json.dump(dict(manifest, this_folder=k), f, indent=1)
        shutil.copy(UNPACK, os.path.join(repo, name, "unpack.py"))
    return payload


def _unpack_alone(folder, call_dir, site):
    """unpack.py of ``folder`` copied alone into ``call_dir``, as one device call carries it."""
    os.makedirs(call_dir, exist_ok=True)
    alone = os.path.join(call_dir, os.path.basename(folder))
    shutil.copytree(folder, alone)
    proc = subprocess.run([sys.executable, os.path.join(alone, "unpack.py"), "--site", site],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_each_folder_keeps_its_number_and_unpacks_or_stashes_its_parts_alone(tmp_path):
    repo = str(tmp_path / "repo")
    payload = _fake_bundle(repo)
    proc = subprocess.run([sys.executable, REBALANCE, os.path.join(repo, NAMES[1]),
                           "--tree-mib", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    manifests = {k: json.load(open(os.path.join(repo, name, "MANIFEST.json")))
                 for k, name in NAMES.items()}
    for k, m in manifests.items():
        assert m["this_folder"] == k, (k, m["this_folder"])
        assert {**m, "this_folder": 0} == {**manifests[1], "this_folder": 0}  # the same layout
    archives = {a["name"]: {p["folder"] for p in a["parts"]} for a in manifests[1]["archives"]}
    for a in manifests[1]["archives"]:  # every part where its manifest says
        for p in a["parts"]:
            assert os.path.exists(os.path.join(repo, NAMES[p["folder"]], p["file"])), p
    whole_in_2 = [n for n, f in archives.items() if f == {2}]
    split = [n for n, f in archives.items() if f == {2, 3}]
    assert whole_in_2 and split, archives  # the layout this test is about: rebalance's choice

    site = str(tmp_path / "site")
    sites = {"site": site, "site-omni-0.30.0": site + "-omni-0.30.0"}
    targets = {a["name"]: sites[a["target"]] for a in manifests[1]["archives"]}
    files = {f"{k}.tar.xz": v for k, v in payload.items()}

    def unpacked(name):
        return all(os.path.exists(os.path.join(targets[name], rel)) for rel in files[name])

    _unpack_alone(os.path.join(repo, NAMES[2]), str(tmp_path / "call-2"), site)
    for name in whole_in_2:
        assert unpacked(name), name
        for rel, data in files[name].items():
            assert open(os.path.join(targets[name], rel), "rb").read() == data
    stash = os.listdir(site + ".parts")
    for name in split:
        assert not unpacked(name)
        held = [p["file"] for a in manifests[1]["archives"] if a["name"] == name
                for p in a["parts"] if p["folder"] == 2]
        assert held and set(held) <= set(stash), (held, stash)

    _unpack_alone(os.path.join(repo, NAMES[3]), str(tmp_path / "call-3"), site)
    for name in archives:
        if name != "base.tar.xz":  # folder 1 never travelled
            assert unpacked(name), name
    assert not os.path.exists(site + ".parts")  # every stashed part used and removed
