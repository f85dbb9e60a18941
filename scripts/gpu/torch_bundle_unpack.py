#!/usr/bin/env python3
"""Unpack the torch 2.13 bundle (build_torch_bundle.py) on the GPU host. Stdlib only.

    python3 .gpu-bundle-torch-N/unpack.py

Each folder .gpu-bundle-torch-N brings one part of one archive. Its part is checked against
MANIFEST.json (size, sha256) and stashed in /tmp/site-torch-2.13.0.parts (copied under a
temporary name, then renamed, so a copy cut short never passes for a part). Once every part is
there, each stashed part is checked again, the archive is unpacked into a temporary folder that
replaces /tmp/site-torch-2.13.0 only when the whole archive came out, and the parts are removed.
Running it again after that does nothing: the target's .bundle-state.json records the archive.
"""
import hashlib
import json
import lzma
import os
import shutil
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))


class Joined:
    """The parts in order, read as one file."""

    def __init__(self, paths):
        self.paths, self.f = list(paths), None

    def read(self, n=-1):
        out = b""
        while n < 0 or len(out) < n:
            if self.f is None:
                if not self.paths:
                    break
                self.f = open(self.paths.pop(0), "rb")
            chunk = self.f.read(-1 if n < 0 else n - len(out))
            if not chunk:
                self.f.close()
                self.f = None
                continue
            out += chunk
        return out


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def good(path, part):
    return (os.path.exists(path) and os.path.getsize(path) == part["size"]
            and sha256_file(path) == part["sha256"])


def main():
    manifest = json.load(open(os.path.join(HERE, "MANIFEST.json")))
    target = os.path.join(os.environ.get("GRAPHDECODE_SITE_ROOT", "/tmp"), manifest["target"])
    state = os.path.join(target, ".bundle-state.json")
    if os.path.exists(state) and json.load(open(state)).get("archive_sha256") == manifest[
            "archive_sha256"]:
        print(f"[torch-bundle] {target}: already unpacked")
        return 0
    stash = target + ".parts"
    os.makedirs(stash, exist_ok=True)
    for part in manifest["parts"]:
        here, stashed = os.path.join(HERE, part["name"]), os.path.join(stash, part["name"])
        if not os.path.exists(here) or good(stashed, part):
            continue
        if not good(here, part):
            print(f"[torch-bundle] {part['name']}: size or sha256 differs from MANIFEST.json")
            return 1
        shutil.copy(here, stashed + ".tmp")
        os.replace(stashed + ".tmp", stashed)
        print(f"[torch-bundle] stashed {part['name']}")
    missing = [p["folder"] for p in manifest["parts"]
               if not good(os.path.join(stash, p["name"]), p)]
    if missing:  # absent, or a stale or damaged copy: that folder has to come (again)
        print(f"[torch-bundle] waiting for {', '.join(missing)}")
        return 0
    paths = [os.path.join(stash, p["name"]) for p in manifest["parts"]]
    whole = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                whole.update(chunk)
    if whole.hexdigest() != manifest["archive_sha256"]:
        print("[torch-bundle] the joined parts' sha256 differs from MANIFEST.json")
        return 1
    fresh = target + ".tmp"
    shutil.rmtree(fresh, ignore_errors=True)
    with lzma.open(Joined(paths)) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        tar.extractall(fresh, filter="tar")
    json.dump({"archive_sha256": manifest["archive_sha256"]},
              open(os.path.join(fresh, ".bundle-state.json"), "w"))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(fresh, target)
    shutil.rmtree(stash)
    print(f"[torch-bundle] unpacked into {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
