#!/usr/bin/env bash
# A record: this ran as scripts/gpu/fold_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The GPU runs of one session (issue #23: the FP8 GEMV step with the layer's norms inside its
# launches; issue #22: the whole GPU suite on vllm-omni 0.30), one machine, five device calls in a
# row (a machine goes back after 30 s idle), each result packed into $OUT/results-STEP.tgz:
#
#   scripts/gpu/fold_session.sh k1   # .gpu-bundle, 0.26: the FP8 decode GPU tests, the decode
#                                    # step at context 2048 bf16 against FP8, the FP8 profile
#   scripts/gpu/fold_session.sh k2   # .gpu-bundle-2 arrives (unpacked)
#   scripts/gpu/fold_session.sh k3   # .gpu-bundle-3: 0.30; the decode step at contexts 512, 2048
#                                    # and 8192, in-tree against bf16 and FP8; then the suite's
#                                    # decode files (FP8, then the bf16 decode tests)
#   scripts/gpu/fold_session.sh k4   # .gpu-bundle-serve*: 0.30; the suite's serving and engine
#                                    # files
#   scripts/gpu/fold_session.sh k5   # 0.30; the suite's other files, then one whole think
#                                    # text-to-image request with FP8 against the release
#
# k3-k5 run every file of the GPU suite once on 0.30, on one machine, at one commit. Each step
# has its own time limit so that a call ends inside its 10 minutes with what it measured.
set -uo pipefail
what=${1:?usage: fold_session.sh k1|k2|k3|k4|k5}
source "$(dirname "$0")/session_common.sh"
case "$what" in
  k1)
    unpack
    suite 150 fp8-tests-0.26 tests/test_sensenova_fp8_gpu.py -q -rfE -s
    bench 120 decode-0.26 "$py26" --cases sensenova_decode --fa 3 --tokens-per-launch "" \
      --no-exact --fp8 --contexts 2048
    bench 90 profile-0.26 "$py26" --cases profile --profile-parts graph_fp8 --profile-context 2048
    ;;
  k2)
    unpack
    ;;
  k3)
    export STACK=0.30
    unpack
    bench 300 decode-0.30 "$py30" --cases sensenova_decode --fa 3 --tokens-per-launch "" \
      --no-exact --fp8 --contexts 512,2048,8192
    suite 100 suite-0.30-fp8 tests/test_sensenova_fp8_gpu.py -q -rfE -s
    suite 170 suite-0.30-decode tests/test_sensenova_gpu.py -q -rfE
    ;;
  k4)
    export STACK=0.30
    GRAPHDECODE_SERVE_OUT="$res/serve-out" GRAPHDECODE_SERVE_TIMEOUT=150 \
      suite 340 suite-0.30-serve tests/test_e2e_serve_gpu.py -q -rfE
    suite 220 suite-0.30-engine tests/test_e2e_engine_gpu.py -q -rfE
    ;;
  k5)
    export STACK=0.30
    suite 140 suite-0.30-batch tests/test_sensenova_batch_gpu.py -q -rfE
    suite 240 suite-0.30-rest "tests/test_sensenova_denoise_gpu.py tests/test_qwen_image_21_gpu.py \
tests/test_qwen_image_21_fast_step.py tests/test_sensenova_paged_decode.py tests/test_gemv_bench.py \
tests/test_qwen_image_bench.py" -q -rfE
    mkdir -p "$res/request-fp8-0.30"
    PYTHONPATH=$py30 timeout 190 python3 benchmarks/sensenova_request.py \
      --out "$res/request-fp8-0.30" --size 1024 --steps 50 --cfg 4 --think both --denoise fast \
      --fp8 on --no-audit >"$res/request-fp8-0.30/stdout.jsonl" 2>"$res/request-fp8-0.30/stderr.log"
    stamp request-fp8-0.30
    ;;
esac
finish
