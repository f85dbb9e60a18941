#!/usr/bin/env bash
# A record: this ran as scripts/gpu/pool_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The GPU runs that the plugin's own graph pool (commit c78d4a4) and issue #22's open items need,
# prepared in a session without device time: one machine, four device calls in a row (a machine
# goes back after 30 s idle), each result packed into $OUT/results-STEP.tgz:
#
#   scripts/gpu/pool_session.sh p1   # .gpu-bundle, 0.26: benchmarks/probes/capture_failure.py
#                                    # (which allocator keeps a failed capture's mark), then the
#                                    # decode, denoising, Qwen-Image and batch GPU files (every
#                                    # capture path, in the new pool; the capture-failure test
#                                    # now captures into vLLM's pool)
#   scripts/gpu/pool_session.sh p2   # .gpu-bundle-2 arrives (unpacked)
#   scripts/gpu/pool_session.sh p3   # .gpu-bundle-3: 0.30; the decode file (the capture-failure
#                                    # test's in-tree reference run), the batch file (its last
#                                    # three tests have not run on 0.30) and the FP8 file
#   scripts/gpu/pool_session.sh p4   # .gpu-bundle-serve*: 0.30; the engine file (expectations
#                                    # fixed in aa5fd65, not run since), then one think
#                                    # text-to-image request with FP8 on, against the release
#
# The bundles are built here first (git-ignored; gone when this machine is fresh):
# scripts/gpu/build_bundle.sh and scripts/gpu/build_serving_bundle.sh (CONTRIBUTING.md). They
# travel with `carry` as in fold_session.sh: p1 [.gpu-bundle], p2 [.gpu-bundle-2],
# p3 [.gpu-bundle-3], p4 [.gpu-bundle-serve, .gpu-bundle-serve-030]. Each step's time limits add
# up to at most 550 s, inside a call's 10 minutes with the unpacking.
set -uo pipefail
what=${1:?usage: pool_session.sh p1|p2|p3|p4}
source "$(dirname "$0")/session_common.sh"
case "$what" in
  p1)
    unpack
    mkdir -p "$res/capture-failure-0.26"
    PYTHONPATH=$py26 timeout 60 python3 \
      benchmarks/probes/capture_failure.py --out "$res/capture-failure-0.26" \
      >"$res/capture-failure-0.26/log" 2>&1
    stamp capture-failure-0.26
    suite 200 suite-0.26-decode tests/test_sensenova_gpu.py -q -rfE
    suite 150 suite-0.26-denoise-qwen "tests/test_sensenova_denoise_gpu.py \
tests/test_qwen_image_21_gpu.py" -q -rfE
    suite 140 suite-0.26-batch tests/test_sensenova_batch_gpu.py -q -rfE
    ;;
  p2)
    unpack
    ;;
  p3)
    export STACK=0.30
    unpack
    suite 170 suite-0.30-decode tests/test_sensenova_gpu.py -q -rfE
    suite 270 suite-0.30-batch tests/test_sensenova_batch_gpu.py -q -rfE
    suite 90 suite-0.30-fp8 tests/test_sensenova_fp8_gpu.py -q -rfE
    ;;
  p4)
    export STACK=0.30
    suite 200 suite-0.30-engine tests/test_e2e_engine_gpu.py -q -rfE
    mkdir -p "$res/request-fp8-0.30"
    PYTHONPATH=$py30 timeout 220 python3 benchmarks/sensenova_request.py \
      --out "$res/request-fp8-0.30" --size 1024 --steps 50 --cfg 4 --think both --denoise fast \
      --fp8 on --no-audit >"$res/request-fp8-0.30/stdout.jsonl" 2>"$res/request-fp8-0.30/stderr.log"
    stamp request-fp8-0.30
    ;;
esac
finish
