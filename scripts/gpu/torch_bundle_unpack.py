#!/usr/bin/env python3
"""Unpack the torch 2.13 bundle (build_torch_bundle.py) on the GPU host. Stdlib only.

    python3 .gpu-bundle-torch-N/unpack.py

Each folder .gpu-bundle-torch-N brings one part of one archive. Its part is checked against
MANIFEST.json (size, sha256) and stashed in /tmp/site-torch-2.13.0.parts; once every part is
there, the archive is checked whole and unpacked into /tmp/site-torch-2.13.0, and the parts are
removed. Running it again after that does nothing (the target's .bundle-state.json records the
archive's sha256).
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
    """The parts in order, read as one file, hashed as they are read."""

    def __init__(self, paths):
        self.paths, self.f, self.sha = list(paths), None, hashlib.sha256()

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
        self.sha.update(out)
        return out


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


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
        here = os.path.join(HERE, part["name"])
        if os.path.exists(here) and not os.path.exists(os.path.join(stash, part["name"])):
            if os.path.getsize(here) != part["size"] or sha256_file(here) != part["sha256"]:
                print(f"[torch-bundle] {part['name']}: size or sha256 differs from MANIFEST.json")
                return 1
            shutil.copy(here, stash)
            print(f"[torch-bundle] stashed {part['name']}")
    missing = [p["folder"] for p in manifest["parts"]
               if not os.path.exists(os.path.join(stash, p["name"]))]
    if missing:
        print(f"[torch-bundle] waiting for {', '.join(missing)}")
        return 0
    shutil.rmtree(target, ignore_errors=True)
    joined = Joined(os.path.join(stash, p["name"]) for p in manifest["parts"])
    with lzma.open(joined) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        tar.extractall(target, filter="tar")
    if joined.sha.hexdigest() != manifest["archive_sha256"]:
        shutil.rmtree(target, ignore_errors=True)
        print("[torch-bundle] the joined archive's sha256 differs from MANIFEST.json")
        return 1
    json.dump({"archive_sha256": manifest["archive_sha256"]}, open(state, "w"))
    shutil.rmtree(stash)
    print(f"[torch-bundle] unpacked into {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
