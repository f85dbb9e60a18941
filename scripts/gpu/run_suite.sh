#!/usr/bin/env bash
# Run the GPU-marked tests and/or the benchmarks on a CUDA host, results into one folder.
#
#   scripts/gpu/run_suite.sh {tests|bench|all|setup|env} RESULTS_DIR [-- extra pytest/bench args]
#
# Works wherever vllm, vllm-omni and diffusers are importable: a normal install, or the offline
# bundle (scripts/gpu/build_bundle.sh), whose folders .gpu-bundle* are unpacked here first when
# present (idempotent; a later call while the host is up only adds what it brings).
# STACK=0.30 runs against vllm-omni 0.30.0's tree (bundle target /tmp/site-omni-0.30.0) instead of
# the bundle's default 0.26.0. The .gpu-bundle-serve* folders (scripts/gpu/build_serving_bundle.sh),
# when present, add the few wheels vllm-omni's engine and server need beyond the bundle.
# The project's own metadata (its entry points: vllm-omni finds the plugin only through them) is
# installed into /tmp/site-project; the code itself runs from this checkout, first on PYTHONPATH.
# GRAPHDECODE_TESTS (default: the tests folder) picks the test files or folders to run.
# TORCH=2.13 (with STACK=0.30) runs on the torch vllm 0.30 pins instead of the host's 2.11, from
# the .gpu-bundle-torch-N folders (scripts/gpu/build_torch_bundle.py), carried one per call.
# setup: unpack, install and report (entry points, doctor) only. env: unpack and install, then
# print the run's environment (`env -0`) and nothing else (scripts/gpu/run.py reads it).
# GRAPHDECODE_SETUP=0 skips unpacking and installing (scripts/gpu/run.py did it earlier in the call).
set -uo pipefail
what=${1:?usage: run_suite.sh TESTS_BENCH_ALL_SETUP_OR_ENV RESULTS_DIR}
results=${2:?usage: run_suite.sh TESTS_BENCH_ALL_SETUP_OR_ENV RESULTS_DIR}
shift 2; [ "${1:-}" = "--" ] && shift
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$results"
py=${PYTHON:-python3}
site=${GRAPHDECODE_SITE:-/tmp/site}
meta=${GRAPHDECODE_SITE_PROJECT:-/tmp/site-project}

setup() {
  for unpack in "$here"/.gpu-bundle*/unpack.py; do
    [ -f "$unpack" ] && "$py" "$unpack" >>"$results/unpack.log" 2>&1
  done
  for install in "$here"/.gpu-bundle-serve*/install.sh; do
    [ -x "$install" ] && [ -d "$site" ] || continue
    PYTHON="$py" "$install" "$site" >>"$results/unpack.log" 2>&1 \
      || echo "serving bundle: $install failed (see $results/unpack.log)" >&2
  done
  # Entry points need installed metadata: PYTHONPATH to the checkout alone makes none.
  rm -rf "$meta"
  "$py" -m pip install -q --no-deps --no-index --no-build-isolation --no-compile \
    --target "$meta" "$here" >>"$results/unpack.log" 2>&1 && return 0
  # An older setuptools rejects pyproject's PEP 639 license string: write the dist-info ourselves.
  echo "pip could not build the project here; writing its dist-info from pyproject.toml" \
    >>"$results/unpack.log"
  "$py" - "$here/pyproject.toml" "$meta" <<'PY' >>"$results/unpack.log" 2>&1
import os, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
name = project["name"].replace("-", "_")
info = os.path.join(sys.argv[2], f"{name}-{project['version']}.dist-info")
os.makedirs(info, exist_ok=True)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
with open(os.path.join(info, "entry_points.txt"), "w") as f:
    for group, eps in project.get("entry-points", {}).items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
print("wrote", info)
PY
}
[ "${GRAPHDECODE_SETUP:-1}" = 0 ] || setup

pp="$here:$meta"
if [ -d "$site" ]; then
  pp="$here:$meta:$site"
  [ "${STACK:-}" = "0.30" ] && pp="$here:$meta:$site-omni-0.30.0:$site"
fi
tag=${STACK:-default}
if [ -n "${TORCH:-}" ]; then
  if [ "$TORCH" != 2.13 ] || [ "${STACK:-}" != 0.30 ]; then
    echo "TORCH=$TORCH with STACK=${STACK:-0.26}: only TORCH=2.13 with STACK=0.30 is built" >&2
    exit 2
  fi
  source "$here/scripts/gpu/torch213_env.sh" || exit 2
  pp="$torch_site:$here:$meta:$omni_site:$site"
  tag="$tag-torch$TORCH"
fi
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cuda PYTHONUNBUFFERED=1
export CUDA_CACHE_MAXSIZE=4294967296  # keep FA2's JIT-compiled PTX between runs
if [ "$what" = env ]; then
  env -0
  exit 0
fi

rc=0
"$py" - >"$results/entry-points-$tag.txt" 2>&1 <<'PY' || rc=1
import importlib.metadata as md
for group in ("vllm.general_plugins", "vllm_omni.general_plugins"):
    names = sorted(ep.name for ep in md.entry_points(group=group))
    print(group, names)
    assert "vllm_omni_graphdecode" in names, f"vllm_omni_graphdecode not found under {group}"
PY
"$py" -m vllm_omni_graphdecode doctor >"$results/doctor-$tag.txt" 2>&1 || rc=1
if [ "$what" = tests ] || [ "$what" = all ]; then
  # A test still running after GRAPHDECODE_FAULTHANDLER_S seconds (default 120; 0: never) gets
  # every thread's Python stack in the log, so that a run cut by a time limit says where it was.
  "$py" -m pytest -m gpu -p no:cacheprovider -ra --junitxml="$results/gpu-tests-$tag.xml" \
    -o faulthandler_timeout="${GRAPHDECODE_FAULTHANDLER_S:-120}" \
    "$@" ${GRAPHDECODE_TESTS:-"$here/tests"} 2>&1 | tee "$results/gpu-tests-$tag.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  "$py" "$here/benchmarks/bench.py" --out "$results" "$@" 2>&1 | tee "$results/bench-$tag.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
exit $rc
