#!/usr/bin/env bash
# A record: this ran as scripts/gpu/suite213_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The next device session (prepared without device time): the whole GPU suite on vllm-omni 0.30
# as its vllm pins it, torch 2.13 (build_torch_bundle.py), where vllm-omni 0.30's own decode runs
# with the plugin off (h200-2026-12-02b), and the engine file three times in a row. One machine,
# calls back to back (a machine goes back after 30 s idle); carried folders stay for later calls.
#
#   scripts/gpu/suite213_session.sh u    # once per folder, in order: .gpu-bundle, .gpu-bundle-2,
#                                        # .gpu-bundle-3, .gpu-bundle-torch-1 ... -5; after the
#                                        # last, FA2 starts compiling in the background
#                                        # (warm_fa2.py, about 130 s)
#   scripts/gpu/suite213_session.sh s1   # .gpu-bundle-serve*: the decode, batch and FP8 files
#   scripts/gpu/suite213_session.sh s2   # the denoising, Qwen-Image-2.1 and six smaller files;
#                                        # the engine file
#   scripts/gpu/suite213_session.sh s3   # the serving file
#   scripts/gpu/suite213_session.sh s4   # the engine file twice more (three runs in a row of
#                                        # its same-think-image test)
#
# Build first (git-ignored): scripts/gpu/build_bundle.sh, scripts/gpu/build_serving_bundle.sh
# all, python3 scripts/gpu/build_torch_bundle.py. About 1,600 device seconds with the start.
# A file whose limit cuts it after the engine runs: scripts/gpu/evaluate_engine_runs.py on its
# e2e folder.
set -uo pipefail
what=${1:?usage: suite213_session.sh u|s1|s2|s3|s4}
source "$(dirname "$0")/session_common.sh"
export STACK=0.30 TORCH=2.13
case "$what" in
  u)
    unpack
    warm_fa2_213
    ;;
  s1)
    suite 230 suite-decode tests/test_sensenova_gpu.py -q -rfE --durations=20
    cp /tmp/warm-fa2.log "$res/" 2>/dev/null
    suite 170 suite-batch tests/test_sensenova_batch_gpu.py -q -rfE --durations=20
    suite 90 suite-fp8 tests/test_sensenova_fp8_gpu.py -q -rfE
    ;;
  s2)
    suite 190 suite-six "tests/test_sensenova_denoise_gpu.py tests/test_qwen_image_21_gpu.py \
tests/test_qwen_image_21_fast_step.py tests/test_sensenova_paged_decode.py \
tests/test_gemv_bench.py tests/test_qwen_image_bench.py" -q -rfE
    GRAPHDECODE_E2E_TIMEOUT=150 suite 200 suite-engine-1 tests/test_e2e_engine_gpu.py -q -rfE
    ;;
  s3)
    suite 300 suite-serve tests/test_e2e_serve_gpu.py -q -rfE
    ;;
  s4)
    GRAPHDECODE_E2E_TIMEOUT=110 suite 140 suite-engine-2 tests/test_e2e_engine_gpu.py -q -rfE
    GRAPHDECODE_E2E_TIMEOUT=110 suite 140 suite-engine-3 tests/test_e2e_engine_gpu.py -q -rfE
    ;;
esac
finish
