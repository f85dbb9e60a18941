#!/usr/bin/env bash
# Build the serving folders: the wheels vLLM-Omni's offline engine (Omni, its stage and
# diffusion-worker processes) and its OpenAI server (`vllm serve MODEL --omni`: API server, engine
# core, workers) import that neither the GPU host (Python 3.12, see
# /work/.library/device/KINDS.md) nor the main bundle (scripts/gpu/build_bundle.sh: its site-deps,
# and vllm 0.30 + vllm-omni 0.30 + partial-json-parser in its 0.30 tree) carries, plus what the
# end-to-end serving test's client needs beyond those (nothing today: openai is in site-deps,
# httpx/numpy/pillow are on the host).
#
#   scripts/gpu/build_serving_bundle.sh [all]  # both folders below
#   scripts/gpu/build_serving_bundle.sh base   # .gpu-bundle-serve/     (git-ignored, ~4 MiB, limit 12)
#   scripts/gpu/build_serving_bundle.sh 030    # .gpu-bundle-serve-030/ (git-ignored, ~35 MiB, limit 45)
#
# .gpu-bundle-serve holds what vllm-omni 0.26 needs (and the small 0.30 additions); the 0.30-only
# extras that do not fit its 12 MiB (PyAV) go to .gpu-bundle-serve-030, sized to travel alone in
# one device call beside the ~6 MiB working tree (64 MiB a call). Each folder has an install.sh;
# scripts/gpu/run_suite.sh runs every .gpu-bundle-serve*/install.sh present.
#
# How the lists were found: vllm-omni's and vllm's Python trees were imported on the CPU venv
# with every distribution that is neither on the host nor in a bundle hidden from the import system
# (a meta-path finder that refuses their top-level modules, importlib.util.find_spec answering None
# and importlib.metadata raising PackageNotFoundError for them, so availability probes see them
# absent), one missing distribution added per run until the imports passed. A hidden distribution
# that made an import fail is needed; one that was only probed or whose import is caught is
# optional and left out.
# For 0.26 (vllm 0.26.0 + vllm-omni 0.26.0 from the main bundle): optional were av, soxr,
# torchcodec, gguf, flashinfer, opentelemetry, fastsafetensors, email-validator, ...
# For 0.30 (vllm 0.30.0 + vllm-omni 0.30.0, the CPU venv's; openai 2.54.0 and distro unpacked from
# the main bundle's wheels first on sys.path, since the venv's openai 3.x needs httpx2, which the
# host does not need with the bundle's 2.x): the same modules plus vllm.v1.engine.core,
# vllm.v1.worker.{gpu_worker,gpu_model_runner}, vllm_omni.worker, the diffusion engine/stage
# client/proc modules and executor. The only new needed distribution was av (below); optional:
# soxr, torchcodec, gguf, flashinfer-python, fastsafetensors, email-validator, opentelemetry-*,
# kernels, humming-kernels, torchsde, nltk, cosmos-guardrail, better-profanity, dill, defusedxml,
# z3-solver, opencv-python (the host's opencv-python-headless gives cv2).
# Offline engine (Omni): vllm_omni.engine.*, the stage client, executor, diffusion worker, model
# runner, SenseNova-U1 pipeline and diffusers adapter modules:
#   more-itertools  vllm_omni.engine.{async_omni_engine,stage_runtime,async_engine_utils}, top level
#   janus           vllm_omni's engine/stage clients (sync<->async queues), top level
#   blake3          vllm.multimodal.hasher (the orchestrator hashes multi_modal_data items: any
#                   request with an image)
# Server (`python -m vllm.entrypoints.cli.main serve MODEL --omni`): the modules of
# vllm.entrypoints.cli.{main,serve,launch,openai,run_batch,benchmark.main,collect_env},
# vllm_omni.entrypoints.cli.{main,serve,benchmark.main}, and every module under
# vllm.entrypoints.{serve,openai}, vllm_omni.entrypoints and vllm_omni.engine (walked):
#   uvicorn, watchfiles           vllm.entrypoints.launcher (serve_http), top level
#   python-multipart              FastAPI refuses Form/File routes without it at import
#                                 (vllm-omni's /v1/images/edits, /v1/videos, voices)
#   prometheus-fastapi-instrumentator  vllm.entrypoints.serve.instrumentator.metrics (build_app)
#   model-hosting-container-standards, jmespath  vllm.entrypoints.serve.sagemaker.api_router
#   mistral_common, jsonschema, referencing, rpds-py, jsonschema-specifications,
#   pydantic-extra-types, pycountry  vllm.tokenizers.mistral, imported at top level by
#                                 vllm_omni.entrypoints.openai.serving_chat (and transformers'
#                                 MistralCommonBackend once mistral_common is present)
#   ijson                         vllm.tool_parsers.mistral_tool_parser, top level
#   pydantic-settings, python-dotenv  vllm_omni.config.server_settings, top level
#   soundfile, cffi               vllm_omni.entrypoints.cli -> vllm_omni.benchmarks.patch, top level
#                                 (soundfile's wheel carries libsndfile)
#   partial-json-parser           vllm.tool_parsers.utils, imported by the server's argument parser
#                                 (the main bundle carries it only in its 0.30 tree)
#   websockets                    vllm-omni 0.30's server stops at start without it ("Install
#                                 websockets first")
# vllm-omni 0.30 only (.gpu-bundle-serve-030):
#   av (PyAV; its wheel carries FFmpeg's libraries in av.libs/)  vllm_omni.diffusion.utils.media_utils,
#                                 top level, imported by vllm_omni.entrypoints.openai.serving_video
#                                 <- vllm_omni.entrypoints.openai.api_server <- vllm_omni.entrypoints
#                                 .cli.serve: the 0.30 server stopped at start-up without it. The
#                                 wheel is cp311-abi3 (35 MiB), none of it trimmed: 30 MiB of it are
#                                 the shared libraries av's 49 extension modules load, the rest
#                                 (.py, .pyi, .pxd) is 0.15 MiB.
# Versions are the ones the CPU venv runs with vllm-omni 0.30, inside vllm's and vllm-omni's
# requirement ranges (0.26.0 and 0.30.0).
# On the host, scripts/gpu/run_suite.sh runs each folder's install.sh, which installs its wheels
# into /tmp/site (the main bundle's target) without an index and without dependencies.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
mode=${1:-all}
case "$mode" in all|base|030) ;; *) echo "usage: $0 [all|base|030]" >&2; exit 2 ;; esac

# .gpu-bundle-serve: vllm-omni 0.26's needs and the small 0.30 additions (header).
base_pkgs=(more-itertools==11.2.1 janus==2.0.0 blake3==1.0.11
  uvicorn==0.54.0 watchfiles==1.3.0 python-multipart==0.0.34
  prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0
  mistral_common==1.13.1 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1
  jsonschema-specifications==2025.9.1 pydantic-extra-types==2.11.1 pycountry==26.2.16
  ijson==3.6.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 soundfile==0.14.0 cffi==2.1.1
  partial-json-parser==0.2.1.1.post7 websockets==17.4)
# partial-json-parser: the 0.26 server failed on the host without it (first GPU run of
# tests/test_e2e_serve_gpu.py). websockets: its version is the CPU venv's (vllm-omni 0.30
# installs it there).
# .gpu-bundle-serve-030: vllm-omni 0.30-only extras too big for the first folder.
omni030_pkgs=(av==18.1.0)

# build_folder OUT LIMIT_MIB PKG...: download the wheels for the host, trim, write install.sh.
build_folder() {
  local out=$1 limit_mib=$2; shift 2
  rm -rf "$out" && mkdir -p "$out"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$out" "$@"

  # Data the server never reads, dropped from two wheels of the first folder (11 of their 14.6
  # MiB): pycountry's translations (pydantic-extra-types only needs its ISO tables) and
  # mistral_common's bundled Mistral tokenizer files (read only when a Mistral tokenizer is
  # loaded). RECORD loses their lines. PyAV is left whole (header).
  python3 - "$out" <<'TRIM'
import os, sys, zipfile
drop = {"pycountry-": ("pycountry/locales/",), "mistral_common-": ("mistral_common/data/",)}
out = sys.argv[1]
for name in sorted(os.listdir(out)):
    prefixes = next((v for k, v in drop.items() if name.startswith(k) and name.endswith(".whl")), None)
    if not prefixes:
        continue
    src = os.path.join(out, name)
    tmp = src + ".tmp"
    kept = dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename.startswith(prefixes):
                dropped += 1
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(keepends=True)
                                if not l.decode().startswith(prefixes))
            zout.writestr(info, data)
            kept += 1
    os.replace(tmp, src)
    print(f"trimmed {name}: dropped {dropped} files under {', '.join(prefixes)}, kept {kept}")
TRIM

  cat >"$out/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Install this serving folder's wheels next to the main bundle (default /tmp/site). Idempotent,
# offline.
set -euo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
target=${1:-${GRAPHDECODE_SITE:-/tmp/site}}
mkdir -p "$target"
"${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$target" "$dir"/*.whl
echo "$(basename "$dir"): installed $(cd "$dir" && ls *.whl | tr '\n' ' ')into $target"
INSTALL
  chmod +x "$out/install.sh"
  (cd "$out" && sha256sum ./*.whl >SHA256SUMS)

  local size
  size=$(du -sb "$out" | cut -f1)
  echo "$out: $(ls "$out" | tr '\n' ' ')"
  echo "size: $size bytes ($(( (size + 1048575) / 1048576 )) MiB, limit $limit_mib MiB)"
  if [ "$size" -gt $((limit_mib * 1048576)) ]; then
    echo "$out over $limit_mib MiB" >&2; return 1
  fi
}

if [ "$mode" != 030 ]; then build_folder "$here/.gpu-bundle-serve" 12 "${base_pkgs[@]}"; fi
# 45 MiB: travels alone in one device call beside the ~6 MiB working tree (64 MiB a call).
if [ "$mode" != base ]; then build_folder "$here/.gpu-bundle-serve-030" 45 "${omni030_pkgs[@]}"; fi
