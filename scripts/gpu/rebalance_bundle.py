"""Rebalance the extra folders of an offline GPU bundle so each travels beside the working tree.

    python3 scripts/gpu/rebalance_bundle.py .gpu-bundle [--limit-mib 64] [--tree-mib N]

A device call carries the working tree plus one bundle folder, at most 64 MiB together. The
shared builder fills folder 2 (vllm-omni 0.30's tree, vllm 0.30's Python tree and ``_C``, FA3,
FA2's first half) to ~58 MiB, which leaves the tree ~6 MiB: too little once the results of this
project grow. Folder 1 (the complete 0.26 stack) is left alone so it still runs by itself; the
parts of folders 2.. are moved (whole files, checksums unchanged) so the largest folder is as
small as it can be, and every copy of ``MANIFEST.json`` says where each part now lives, which is
all ``unpack.py`` reads besides ``this_folder``: each folder's copy keeps its own number, since
``unpack.py`` finds its siblings (and the parts it holds) from it, and a folder carried alone in a
call has no sibling to learn it from. Idempotent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

MIB = 2 ** 20


def tree_bytes(repo: str) -> int:
    """Bytes the device call sends: tracked files and untracked files git does not ignore."""
    names = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=True).stdout
    total = 0
    for name in names.decode().split("\0"):
        path = os.path.join(repo, name)
        if name and os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("first", help="the bundle's first folder (its siblings are FIRST-2, FIRST-3)")
    ap.add_argument("--limit-mib", type=float, default=64.0)
    ap.add_argument("--tree-mib", type=float, default=None,
                    help="the working tree's size (default: measured from git)")
    args = ap.parse_args(argv)
    first = os.path.abspath(args.first)
    manifest = json.load(open(os.path.join(first, "MANIFEST.json")))
    folders = {int(k): os.path.join(os.path.dirname(first), os.path.basename(v))
               for k, v in manifest["folders"].items()}
    movable = sorted(k for k in folders if k != 1)
    if len(movable) < 2:
        print("rebalance: nothing to balance")
        return 0
    parts = [p for a in manifest["archives"] for p in a["parts"] if p["folder"] in movable]
    # Largest first, each into the folder with the least so far: within one part of the best.
    load = {k: 0 for k in movable}
    placed = {}
    for p in sorted(parts, key=lambda p: -p["size"]):
        k = min(movable, key=lambda f: (load[f], f))
        placed[p["file"]] = k
        load[k] += p["size"]
    for a in manifest["archives"]:
        for p in a["parts"]:
            if p["file"] in placed and placed[p["file"]] != p["folder"]:
                src = os.path.join(folders[p["folder"]], p["file"])
                dst = os.path.join(folders[placed[p["file"]]], p["file"])
                if os.path.exists(src):
                    shutil.move(src, dst)
                p["folder"] = placed[p["file"]]
    for k, folder in folders.items():
        with open(os.path.join(folder, "MANIFEST.json"), "w") as f:
            json.dump(dict(manifest, this_folder=k), f, indent=1)
            f.write("\n")
    tree = args.tree_mib * MIB if args.tree_mib is not None else tree_bytes(
        os.path.dirname(first))
    worst = 0
    for k, folder in sorted(folders.items()):
        size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
        worst = max(worst, size + tree)
        print(f"rebalance: folder {k} {size / MIB:.1f} MiB + tree {tree / MIB:.1f} MiB = "
              f"{(size + tree) / MIB:.1f} MiB")
    if worst > args.limit_mib * MIB:
        print(f"rebalance: a call would carry {worst / MIB:.1f} MiB > {args.limit_mib} MiB",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
