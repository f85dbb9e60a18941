#!/usr/bin/env bash
# Run the GPU-marked tests and/or the benchmarks on a CUDA host, results into one folder.
#
#   scripts/gpu/run_suite.sh {tests|bench|all} RESULTS_DIR [-- extra pytest/bench args]
#
# Works wherever vllm, vllm-omni and diffusers are importable: a normal install, or the offline
# bundle (scripts/gpu/build_bundle.sh), whose folders .gpu-bundle* are unpacked here first when
# present (idempotent; a later call while the host is up only adds what it brings).
# STACK=0.30 runs against vllm-omni 0.30.0's tree (bundle target /tmp/site-omni-0.30.0) instead of
# the bundle's default 0.26.0.
set -uo pipefail
what=${1:?usage: run_suite.sh TESTS_BENCH_OR_ALL RESULTS_DIR}
results=${2:?usage: run_suite.sh TESTS_BENCH_OR_ALL RESULTS_DIR}
shift 2; [ "${1:-}" = "--" ] && shift
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$results"
py=${PYTHON:-python3}

for unpack in "$here"/.gpu-bundle*/unpack.py; do
  [ -f "$unpack" ] && "$py" "$unpack" >>"$results/unpack.log" 2>&1
done
site=${GRAPHDECODE_SITE:-/tmp/site}
pp="$here"
if [ -d "$site" ]; then
  pp="$here:$site"
  [ "${STACK:-}" = "0.30" ] && pp="$here:$site-omni-0.30.0:$site"
fi
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cuda PYTHONUNBUFFERED=1
export CUDA_CACHE_MAXSIZE=4294967296  # keep FA2's JIT-compiled PTX between runs
tag=${STACK:-default}

rc=0
"$py" -m vllm_omni_graphdecode doctor >"$results/doctor-$tag.txt" 2>&1 || rc=1
if [ "$what" = tests ] || [ "$what" = all ]; then
  "$py" -m pytest -m gpu -p no:cacheprovider -ra --junitxml="$results/gpu-tests-$tag.xml" \
    "$@" "$here/tests" 2>&1 | tee "$results/gpu-tests-$tag.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  "$py" "$here/benchmarks/bench.py" --out "$results" "$@" 2>&1 | tee "$results/bench-$tag.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
exit $rc
