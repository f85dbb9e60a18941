#!/usr/bin/env bash
# Pack FlashInfer for the offline GPU host, for the benchmark's kernel-level comparison
# (benchmarks/bench.py --cases attention -> rows attention_paged_decode_ctxN).
#
#   scripts/gpu/build_flashinfer_bundle.sh [OUTDIR]        (default .gpu-bundle-fi, git-ignored)
#
# vllm 0.26.0 pins flashinfer-python==0.6.14 (its METADATA); the main bundle leaves it out. The
# wheel is pure Python plus sources and headers (14 MiB as a wheel, 85 MiB unpacked); packed here
# as tar.xz it is 5.5 MiB, one small transfer. No flashinfer-cubin / flashinfer-jit-cache: the
# batch-1 decode kernel is compiled on the host at first use by nvcc + ninja (both in the host's
# image; measured here with nvcc 13.0 for sm_90a: 75-98 s on 2 cores). Its other needs on the host:
# apache-tvm-ffi (the main bundle's 0.1.15.post2, within flashinfer's >=0.1.6,<0.2), and click,
# einops, ninja, numpy, nvidia-ml-py, packaging, requests, tabulate, torch, tqdm (in the image).
# cuda-tile, nvidia-cudnn-frontend and nvidia-cutlass-dsl are not needed to import it (checked
# here with those three blocked) nor by the decode path.
#
# On the host, OUTDIR/unpack.py (stdlib only; scripts/gpu/run_suite.sh runs every .gpu-bundle*/
# unpack.py) puts it into /tmp/site-fi ($GRAPHDECODE_FLASHINFER_SITE), which nothing else imports
# from; the benchmark appends it to sys.path for its attention case only.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$here/.gpu-bundle-fi}
version=0.6.14
cache=${GRAPHDECODE_BUNDLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/graphdecode-gpu-bundle}
wheel_dir=$cache/wheels
wheel=$wheel_dir/flashinfer_python-$version-py3-none-any.whl
py=${PYTHON:-python3}
mkdir -p "$wheel_dir" "$out"

# The pin must still be vllm 0.26.0's, when that wheel is in the cache (build_bundle.sh puts it).
vllm_whl=$(ls "$wheel_dir"/vllm-0.26.0-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$vllm_whl" ]; then
  pin=$("$py" - "$vllm_whl" <<'PY'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
m = re.search(r"^Requires-Dist: flashinfer-python==(\S+)", z.read(meta).decode(), re.M)
print(m.group(1) if m else "")
PY
)
  if [ "$pin" != "$version" ]; then
    echo "build_flashinfer_bundle: vllm 0.26.0 pins flashinfer-python==$pin, not $version" >&2
    exit 1
  fi
fi

if [ ! -f "$wheel" ]; then
  echo "[fi-bundle] fetching flashinfer-python==$version" >&2
  "$py" -m pip download -q --no-deps --only-binary=:all: --no-cache-dir --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$wheel_dir" "flashinfer-python==$version"
fi

archive=flashinfer-python-$version.tar.xz
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m zipfile -e "$wheel" "$tmp/tree"
# Only the package and its dist-info; the wheel's top-level build_backend.py/build_utils.py
# are its build hooks.
(cd "$tmp/tree" && tar cf - flashinfer "flashinfer_python-$version.dist-info") | xz -9 -T0 \
  > "$tmp/$archive"
mv "$tmp/$archive" "$out/$archive"
sha=$(sha256sum "$out/$archive" | cut -d' ' -f1)
printf '%s  %s\n' "$sha" "$archive" > "$out/SHA256SUMS"

cat > "$out/unpack.py" <<'PY'
#!/usr/bin/env python3
"""Unpack FlashInfer (built by scripts/gpu/build_flashinfer_bundle.sh) into /tmp/site-fi.

    python3 unpack.py [--site DIR]     (default $GRAPHDECODE_FLASHINFER_SITE or /tmp/site-fi)

Stdlib only. Checks the archive's sha256; a second run with the same archive does nothing.
"""
import argparse
import hashlib
import os
import shutil
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("--site", default=os.environ.get("GRAPHDECODE_FLASHINFER_SITE", "/tmp/site-fi"))
site = ap.parse_args().site
with open(os.path.join(HERE, "SHA256SUMS")) as f:
    digest, name = f.read().split()
path = os.path.join(HERE, name)
marker = os.path.join(site, ".graphdecode-fi-" + digest[:16])
if os.path.exists(marker):
    print(f"[fi-unpack] {name} already in {site}")
    sys.exit(0)
h = hashlib.sha256()
with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
if h.hexdigest() != digest:
    sys.exit(f"[fi-unpack] {path}: sha256 differs from SHA256SUMS")
if os.path.isdir(site):
    shutil.rmtree(site)  # another build's files must not mix with this one's
os.makedirs(site)
with tarfile.open(path, "r:xz") as tar:
    tar.extractall(site)
open(marker, "w").close()
print(f"[fi-unpack] {name} -> {site}")
PY

# The folder is ignored by .gitignore (/.gpu-bundle*/); a custom OUTDIR inside the checkout too.
if [ -d "$here/.git" ] && ! git -C "$here" check-ignore -q "$out" 2>/dev/null; then
  case "$out" in
    "$here"/*) echo "/${out#"$here"/}/" >> "$here/.git/info/exclude" ;;
  esac
fi
ls -la "$out" >&2
echo "[fi-bundle] $out: carry it with the checkout; on the host run" \
  "python3 $(basename "$out")/unpack.py" >&2
