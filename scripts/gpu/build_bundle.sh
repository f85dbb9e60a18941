#!/usr/bin/env bash
# Build the offline GPU-host bundle (../shared/gpu) for this project's GPU suite and benchmarks:
# vllm 0.26 + vllm-omni 0.26 + diffusers 0.42.1, plus vllm-omni 0.30 (with vllm 0.30) and FA2.
#
#   scripts/gpu/build_bundle.sh [OUTDIR]        (default .gpu-bundle; extras in OUTDIR-2, -3)
#
# The shared builder downloads every missing wheel in one `pip download -r`, and pip refuses a
# requirements file that pins two versions of one distribution (vllm 0.26 and 0.30, vllm-omni
# 0.26 and 0.30). So the wheels are fetched here first, one pip call per wheel, into the cache the
# builder reads; it then finds them all present and only verifies and packs.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
shared=${GRAPHDECODE_SHARED:-$here/../shared}
out=${1:-$here/.gpu-bundle}
cache=${GRAPHDECODE_BUNDLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/graphdecode-gpu-bundle}
mkdir -p "$cache/wheels"
python3 - "$shared/gpu" "$cache/wheels" <<'PY'
import hashlib, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import pins
wheel_dir = sys.argv[2]
for key, (fname, digest, _why) in sorted(pins.WHEELS.items()):
    path = os.path.join(wheel_dir, fname)
    if os.path.exists(path) and hashlib.sha256(open(path, "rb").read()).hexdigest() == digest:
        continue
    dist, version = fname.split("-")[:2]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--python-version", pins.PYTHON_VERSION, "--implementation", "cp",
           "-d", wheel_dir, f"{dist}=={version}"]
    for plat in pins.PLATFORMS:
        cmd += ["--platform", plat]
    print(f"[bundle] fetching {fname}", flush=True)
    subprocess.run(cmd, check=True)
PY
"$shared/gpu/build_bundle.sh" "$out" --omni 0.30.0 --fa2
# The builder fills folder 2 to ~58 MiB; a device call carries the working tree beside it.
python3 "$here/scripts/gpu/rebalance_bundle.py" "$out"
