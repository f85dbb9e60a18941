#!/usr/bin/env bash
# Build .gpu-bundle-serve/: the few wheels vLLM-Omni 0.26's offline engine (Omni, its stage and
# diffusion-worker processes) imports that neither the GPU host (Python 3.12, see
# /work/.library/device/KINDS.md) nor the main bundle's site-deps carries.
#
#   scripts/gpu/build_serving_bundle.sh          # -> .gpu-bundle-serve/ (git-ignored, ~1 MiB)
#
# How the list was found (docs/e2e-notes.md): vllm-omni 0.26.0 and vllm 0.26.0's Python trees were
# imported on the CPU venv with every distribution that is neither on the host nor in the bundle
# hidden from the import system, down to the engine, stage, diffusion-worker, runner, SenseNova-U1
# pipeline and diffusers-adapter modules; a hidden distribution that made an import fail is needed:
#   more-itertools  vllm_omni.engine.{async_omni_engine,stage_runtime,async_engine_utils}, top level
#   janus           vllm_omni's engine/stage clients (sync<->async queues), top level
# and one imported lazily on a path the tests do not take today but a request with an image does:
#   blake3          vllm.multimodal.hasher (the orchestrator hashes multi_modal_data items)
# Versions are the ones the CPU venv runs with vllm-omni 0.30 (same requirement ranges in 0.26).
# On the host, scripts/gpu/run_suite.sh runs .gpu-bundle-serve/install.sh, which installs them into
# /tmp/site (the main bundle's target) without an index and without dependencies.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out="$here/.gpu-bundle-serve"
pkgs=(more-itertools==11.2.1 janus==2.0.0 blake3==1.0.11)
limit_mib=12

rm -rf "$out" && mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform any -d "$out" "${pkgs[@]}"

cat >"$out/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Install the serving wheels next to the main bundle (default /tmp/site). Idempotent, offline.
set -euo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
target=${1:-${GRAPHDECODE_SITE:-/tmp/site}}
mkdir -p "$target"
"${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$target" "$dir"/*.whl
echo "serving bundle: installed $(cd "$dir" && ls *.whl | tr '\n' ' ')into $target"
INSTALL
chmod +x "$out/install.sh"
(cd "$out" && sha256sum ./*.whl >SHA256SUMS)

size=$(du -sb "$out" | cut -f1)
echo "$out: $(ls "$out" | tr '\n' ' ')"
echo "size: $size bytes ($(( (size + 1048575) / 1048576 )) MiB, limit $limit_mib MiB)"
if [ "$size" -gt $((limit_mib * 1048576)) ]; then
  echo "serving bundle over $limit_mib MiB" >&2; exit 1
fi
