#!/usr/bin/env bash
# The next device session (prepared without device time): where the batched decode step's time
# goes (issue #22: the 16-row step takes ~8 ms against the 6.1 ms one-request step, and its linear
# layers ~4.5 of it), bf16 and FP8, and the GPU files on vllm-omni 0.26 that have not run there
# since the stats and engine-runner changes (h200-2026-12-02c ran every file on 0.30). One
# machine, calls back to back (a machine goes back after 30 s idle):
#
#   scripts/gpu/step_profile_session.sh u    # once per folder: .gpu-bundle, .gpu-bundle-serve
#   scripts/gpu/step_profile_session.sh p1   # the batched step at 1 / 8 / 16 rows, timed and
#                                            # profiled (benchmarks/sensenova_batch.py
#                                            # --profile-rows), bf16 and FP8, on 0.26
#   scripts/gpu/step_profile_session.sh s1   # the denoising, Qwen-Image-2.1 and four smaller
#                                            # files; the engine file
#   scripts/gpu/step_profile_session.sh s2   # the serving file
#
# About 1,000 device seconds with the start.
set -uo pipefail
what=${1:?usage: step_profile_session.sh u|p1|s1|s2}
source "$(dirname "$0")/session_common.sh"
step_profile() {  # step_profile DIR [sensenova_batch.py args...]
  local dir=$1; shift
  mkdir -p "$res/$dir"
  PYTHONPATH=$py26 timeout 170 python3 benchmarks/sensenova_batch.py --out "$res/$dir" \
    --cases step --lm-only --profile-rows 1,8,16 "$@" >"$res/$dir/log" 2>&1
  stamp "$dir"
}
case "$what" in
  u)
    unpack
    ;;
  p1)
    step_profile step-profile-bf16-0.26
    step_profile step-profile-fp8-0.26 --fp8
    ;;
  s1)
    suite 190 suite-six-0.26 "tests/test_sensenova_denoise_gpu.py tests/test_qwen_image_21_gpu.py \
tests/test_qwen_image_21_fast_step.py tests/test_sensenova_paged_decode.py \
tests/test_gemv_bench.py tests/test_qwen_image_bench.py" -q -rfE
    GRAPHDECODE_E2E_TIMEOUT=150 suite 220 suite-engine-0.26 tests/test_e2e_engine_gpu.py -q -rfE
    ;;
  s2)
    suite 330 suite-serve-0.26 tests/test_e2e_serve_gpu.py -q -rfE
    ;;
esac
finish
