#!/usr/bin/env python3
"""Pack a results folder's raw files into one archive, and read them back. Stdlib only.

    python3 scripts/pack_results.py benchmarks/results/FOLDER [...]   # pack, in place
    python3 scripts/pack_results.py --check benchmarks/results/FOLDER [...]

A GPU session's folder (benchmarks/results/<machine>-<date>/) keeps, as plain files, what a reader
opens: its README, the JSON each benchmark wrote, the figures (PNG: xz cannot shrink them) and the
session script that ran it. Everything else (logs, arrays, XML, text dumps) goes into
FOLDER/raw.tar.xz, member paths relative to FOLDER: a README that names `gpu-tests/x.log` finds
it there (`tar xJf raw.tar.xz gpu-tests/x.log`). The archive is deterministic: members sorted,
mtimes 0, owners and permissions fixed, single-threaded xz; packing again adds the loose raw
files to what the archive holds and writes the same bytes for the same contents. --check exits 1
naming each loose raw file.

``materialized(path)`` gives a folder holding ``path``'s plain files and its archived ones, for
readers that expect the folder as the session wrote it (scripts/gpu/evaluate_engine_runs.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import lzma
import os
import shutil
import sys
import tarfile
import tempfile

ARCHIVE = "raw.tar.xz"
PLAIN_SUFFIXES = (".md", ".json", ".png", ".sh")


def is_plain(name: str) -> bool:
    return name == ARCHIVE or name.endswith(PLAIN_SUFFIXES)


def loose_raw(folder: str) -> list[str]:
    """Raw files lying outside the archive, as paths relative to ``folder``, sorted."""
    out = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if not is_plain(name):
                out.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(out)


def read_archive(folder: str) -> dict[str, bytes]:
    path = os.path.join(folder, ARCHIVE)
    if not os.path.exists(path):
        return {}
    with tarfile.open(path, "r:xz") as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}


def write_archive(folder: str, members: dict[str, bytes]) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(members[name]), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tf.addfile(info, io.BytesIO(members[name]))
    data = lzma.compress(raw.getvalue(), preset=9 | lzma.PRESET_EXTREME)
    tmp = os.path.join(folder, ARCHIVE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(folder, ARCHIVE))


def pack(folder: str) -> int:
    """Move ``folder``'s loose raw files into its archive; returns how many were added."""
    loose = loose_raw(folder)
    if not loose:
        return 0
    members = read_archive(folder)
    for rel in loose:
        with open(os.path.join(folder, rel), "rb") as f:
            members[rel.replace(os.sep, "/")] = f.read()
    write_archive(folder, members)
    for rel in loose:
        os.remove(os.path.join(folder, rel))
    for root, dirs, files in os.walk(folder, topdown=False):  # folders left empty
        if root != folder and not dirs and not files:
            os.rmdir(root)
    return len(loose)


def results_folder(path: str) -> tuple[str, str]:
    """(the nearest folder at or above ``path`` holding an archive, ``path`` relative to it)."""
    path = os.path.abspath(path)
    probe = path
    while True:
        if os.path.exists(os.path.join(probe, ARCHIVE)):
            return probe, os.path.relpath(path, probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            return path, "."
        probe = parent


@contextlib.contextmanager
def materialized(path: str):
    """A temporary folder with ``path``'s plain files and its files from the archive above it
    (``path`` itself when nothing of it is archived)."""
    top, rel = results_folder(path)
    prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
    archived = {n[len(prefix):]: d for n, d in read_archive(top).items() if n.startswith(prefix)}
    if not archived:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="results-") as tmp:
        out = os.path.join(tmp, os.path.basename(os.path.abspath(path)))
        if os.path.isdir(path):
            shutil.copytree(path, out)
        for name, data in archived.items():
            dest = os.path.join(out, *name.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(data)
        yield out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--check", action="store_true", help="only say which raw files lie loose")
    args = ap.parse_args(argv)
    rc = 0
    for folder in args.folders:
        if args.check:
            for rel in loose_raw(folder):
                print(f"{os.path.join(folder, rel)}: a raw file outside {ARCHIVE} "
                      f"(python3 scripts/pack_results.py {folder})", file=sys.stderr)
                rc = 1
        else:
            print(f"{folder}: {pack(folder)} file(s) packed into {ARCHIVE}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
