#!/usr/bin/env python3
"""Build the torch 2.13 bundle: the torch vllm 0.30 pins, for the GPU host's 0.30 stack.

    python3 scripts/gpu/build_torch_bundle.py [--out .gpu-bundle-torch] [--triton]

The GPU host has torch 2.11.0+cu130; vllm 0.27-0.32 pin torch 2.13.0, and on 2.11 vllm-omni 0.30's
own decode trips the caching allocator's `use_count > 0` assert (plugin off). This packs torch
2.13.0 (and with --triton, the triton 3.7.1 it pins) into folders OUT-1, OUT-2, ... that each fit
one device call beside the working tree. Their unpack.py (torch_bundle_unpack.py) stashes each
part in /tmp/site-torch-2.13.0.parts as it arrives and unpacks the archive into
/tmp/site-torch-2.13.0 once every part is there. `run_suite.sh` puts that folder first on the 0.30
stack's PYTHONPATH when TORCH=2.13 (see there for the two environment settings it adds).

What travels, and what does not (sizes measured on this wheel):
- torch 2.13.0 without its C++ headers, CMake files and protoc (not needed to run), with the CUDA
  device code of its libraries cut to what sm_90 runs (`../shared/gpu/fatbin.py`): libtorch_cpu
  74 MB and libtorch_cuda 61 MB after xz.
- Not NCCL 2.29.7 (141 MB after xz even when trimmed). torch 2.13 references eight NCCL 2.29
  functions the host's 2.28.9 lacks, and Python loads torch with RTLD_NOW, so `nccl_compat.c`
  defines those eight (built here with the host C compiler, preloaded with LD_PRELOAD). The
  host's cuDNN 9.19 (torch 2.13 pins 9.20; every cuDNN symbol torch references is there),
  cuSPARSELt 0.8.0 (0.8.1 pinned; the same) and CUDA 13.0.2 libraries (13.0.3 pinned: cuBLAS
  13.1.0 against 13.1.1) serve as they are.
- torchvision 0.28.0, the one built for torch 2.13 (vllm-omni imports it; the host's, built for
  2.11, fails with "operator torchvision::nms does not exist").
- vllm 0.30's FA2 library (vllm-omni 0.30's in-tree decode runs it), under overlay-omni-0.30.0/.
- triton 3.7.1 only with --triton (torch 2.13's Inductor may need it; the host has 3.6).

The archive is deterministic (sorted members, the wheels' timestamps, `xz -T0 -6`), split into
parts of PART_MIB (52 MiB: five folders for this torch, torchvision and FA2). Staging holds the
members in memory (about 1.3 GB).
"""
import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_bundle_unpack import sha256_file  # noqa: E402  (the unpacker is stdlib-only)
ROOT = os.path.dirname(os.path.dirname(HERE))
SHARED_GPU = os.environ.get("GRAPHDECODE_SHARED", os.path.join(ROOT, "..", "shared")) + "/gpu"
CACHE = os.environ.get("GRAPHDECODE_BUNDLE_CACHE",
                       os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                    "graphdecode-gpu-bundle"))
TARGET = "site-torch-2.13.0"
PART_MIB = 52  # a device call carries 64 MiB; the working tree needs the rest
WHEELS = {
    "torch": ("torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl",
              "796633c4cdf0fe2cdced72d8f88f22e73dbcfce83132763162f6d4bff13b820b"),
    "torchvision": ("torchvision-0.28.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                    "028a3d481b37d785605620d7cdad897064c5a55bae2aa1f2658766333e291940"),
    # Only its FA2 library is taken (see FA2_MEMBER); the rest of vllm 0.30 is in .gpu-bundle-3.
    "vllm": ("vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl",
             "ef52ee58c410ead0b8afb190838fa4cbcb52075596f67862a03859d984966ac4"),
    "triton": ("triton-3.7.1-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
               "7e40869937a68206ec70d7f25bb7ec6433cb083f9135e1f36dbd318dc449a728"),
}
# vllm 0.30's FA2, built against torch 2.13 (the FA2 the main bundle carries does not load on it:
# `undefined symbol ... TensorBase::const_data_ptr<int>`). It travels under OVERLAY; run_suite.sh
# lays it over a hard-linked copy of the 0.30 tree for TORCH=2.13 runs.
FA2_MEMBER = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
OVERLAY = "overlay-omni-0.30.0/"
# Members not needed to run, left out of the archive.
SKIP_PREFIXES = ("torch/include/", "torch/share/", "torch/bin/protoc")
SKIP_SUFFIXES = (".a",)


def log(msg):
    print(f"[torch-bundle] {msg}", flush=True)


def fetch(name):
    fname, digest = WHEELS[name]
    wheel_dir = os.path.join(CACHE, "wheels")
    os.makedirs(wheel_dir, exist_ok=True)
    path = os.path.join(wheel_dir, fname)
    if not (os.path.exists(path) and sha256_file(path) == digest):
        dist, version = fname.split("-")[:2]
        log(f"fetching {fname}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--no-cache-dir", "--python-version", "3.12",
                        "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "-d", wheel_dir, f"{dist}=={version}"], check=True)
    got = sha256_file(path)
    if got != digest:
        raise SystemExit(f"{fname}: sha256 {got}, expected {digest} (a different build?)")
    return path


def wanted(wheel, member):
    if os.path.basename(wheel).startswith("vllm-"):
        return member == FA2_MEMBER
    return not (member.startswith(SKIP_PREFIXES) or member.endswith(SKIP_SUFFIXES))


def stage(wheels, tree):
    sys.path.insert(0, SHARED_GPU)
    import fatbin  # ../shared/gpu/fatbin.py: stdlib only
    entries = []  # (name, bytes, mode, mtime)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if info.is_dir() or not wanted(wheel, info.filename):
                    continue
                data = z.read(info)
                if info.filename.endswith(".so") or ".so." in info.filename:
                    try:
                        fatbin.elf_section(data, ".nv_fatbin")
                    except (KeyError, ValueError):
                        pass
                    else:
                        with tempfile.TemporaryDirectory() as tmp:
                            src, dst = os.path.join(tmp, "in.so"), os.path.join(tmp, "out.so")
                            open(src, "wb").write(data)
                            fatbin.trim(src, dst, 90)
                            data = open(dst, "rb").read()
                        log(f"trimmed to sm_90: {info.filename}")
                mode = (info.external_attr >> 16) & 0o777 or 0o644
                mtime = zipfile_time(info)
                name = OVERLAY + info.filename if info.filename == FA2_MEMBER else info.filename
                entries.append((name, data, mode, mtime))
    names = {e[0] for e in entries}
    if any(os.path.basename(w).startswith("vllm-") for w in wheels) and \
            OVERLAY + FA2_MEMBER not in names:
        raise SystemExit(f"{FA2_MEMBER} is not in the vllm wheel: the 0.30 tree's FA2 would "
                         "stay the one built for torch 2.11")
    compat = os.path.join(tree, "libnccl_compat.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", compat,
                    os.path.join(HERE, "nccl_compat.c")], check=True)
    entries.append(("libnccl_compat.so", open(compat, "rb").read(), 0o755, entries[0][3]))
    return sorted(entries)


def zipfile_time(info):
    import calendar
    return calendar.timegm(info.date_time + (0, 0, -1))


def pack(entries, raw):
    """Write the sorted members as one tar, then compress it to RAW.xz."""
    with tarfile.open(raw, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data, mode, mtime in entries:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), mode, mtime
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            tar.addfile(ti, io.BytesIO(data))
    subprocess.run(["xz", "-T0", "-6", "-f", raw], check=True)


def split(archive, out, part_bytes):
    """Cut the archive into folders OUT-1 ... OUT-N, each with its part, MANIFEST.json (every
    part's size and sha256, the whole archive's) and unpack.py. Folders of an earlier build with
    more parts are removed."""
    size = os.path.getsize(archive)
    count = -(-size // part_bytes)
    stale = count + 1
    while os.path.isdir(f"{out}-{stale}"):
        shutil.rmtree(f"{out}-{stale}")
        stale += 1
    parts = []
    with open(archive, "rb") as f:
        for i in range(count):
            folder = f"{out}-{i + 1}"
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            name = f"{TARGET}.tar.xz.part{i + 1}of{count}"
            data = f.read(part_bytes)
            open(os.path.join(folder, name), "wb").write(data)
            parts.append(dict(name=name, folder=os.path.basename(folder), size=len(data),
                              sha256=hashlib.sha256(data).hexdigest()))
    manifest = dict(target=TARGET, archive_sha256=sha256_file(archive), archive_size=size,
                    parts=parts)
    for part in parts:
        folder = os.path.join(os.path.dirname(out), part["folder"])
        json.dump(manifest, open(os.path.join(folder, "MANIFEST.json"), "w"), indent=1)
        shutil.copy(os.path.join(HERE, "torch_bundle_unpack.py"), os.path.join(folder, "unpack.py"))
    return manifest


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, ".gpu-bundle-torch"))
    ap.add_argument("--triton", action="store_true", help="also triton 3.7.1 (torch 2.13's pin)")
    args = ap.parse_args()
    wheels = [fetch("torch"), fetch("torchvision"), fetch("vllm")]
    wheels += [fetch("triton")] if args.triton else []
    with tempfile.TemporaryDirectory() as work:
        entries = stage(wheels, work)
        log(f"{len(entries)} files, {sum(len(e[1]) for e in entries) / 2**20:.0f} MiB")
        archive = os.path.join(work, f"{TARGET}.tar")
        pack(entries, archive)
        manifest = split(archive + ".xz", os.path.abspath(args.out), PART_MIB << 20)
    log(f"archive {manifest['archive_size'] / 2**20:.1f} MiB in {len(manifest['parts'])} parts: "
        + ", ".join(p["folder"] for p in manifest["parts"]))


if __name__ == "__main__":
    main()
