#!/usr/bin/env bash
# Build (or reuse) the pinned virtual environment the demo and the tests run in.
#
# Prints the environment's path on its last line. The environment lives outside the checkout,
# keyed by a hash of requirements/, so a fresh clone on the same machine reuses it (CI does) and a
# change of pins builds a new one. Measured on a 2-core CPU machine: ~7 min and ~9 GB from scratch.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
key=$(cat "$here"/requirements/*.txt | sha256sum | cut -c1-12)
venv=${GRAPHDECODE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-omni-graphdecode/venv-$key}
py=${PYTHON:-python3}

if [ ! -f "$venv/.complete" ]; then
  echo "setup_env: building $venv (first run on this machine: several minutes)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  # --isolated: this machine's pip configuration offers a CPU-only torch wheel that would win over
  # PyPI's, and PyPI's torchvision (a CUDA build) then fails to import beside it. Isolated, pip
  # takes torch and torchvision from PyPI together.
  pipi=("$venv/bin/python" -m pip install --isolated --disable-pip-version-check -q)
  "${pipi[@]}" --upgrade pip setuptools wheel
  "${pipi[@]}" -r "$here/requirements/base.txt"
  # vllm-omni pins diffusers==0.40.0; Qwen-Image-2.1 needs 0.41+, so it goes in after, unresolved.
  "${pipi[@]}" --no-deps -r "$here/requirements/diffusers.txt"
  "${pipi[@]}" -r "$here/requirements/test.txt"
  # vllm-omni 0.28.0's source, unpacked beside (not installed): the tests apply the backport to
  # its real SenseNova-U1 code in a subprocess that puts it first on sys.path.
  tmp=$(mktemp -d)
  "$venv/bin/python" -m pip download --isolated -q --no-deps --only-binary=:all: -d "$tmp" \
    -r "$here/requirements/omni-0.28.txt"
  mkdir -p "$venv/omni-0.28.0"
  "$venv/bin/python" -m zipfile -e "$tmp"/vllm_omni-*.whl "$venv/omni-0.28.0"
  rm -rf "$tmp"
  touch "$venv/.complete"
fi
# The project itself, every time (seconds): its entry points must come from this checkout.
"$venv/bin/python" -m pip install --isolated --disable-pip-version-check -q --no-deps \
  --no-build-isolation "$here" >&2
echo "$venv"
