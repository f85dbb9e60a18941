#!/usr/bin/env bash
# The next device session (prepared without device time): where the batched decode step's time
# goes (issue #22: the 16-row step takes ~8 ms against the 6.1 ms one-request step, its linear
# layers ~4.5 of it), bf16 and FP8; the GPU files on vllm-omni 0.26 that have not run there since
# the stats and engine-runner changes (h200-2026-12-02c ran every file on 0.30); and the first
# speed figures on vllm-omni 0.30 with the torch its vllm pins (2.13). One machine, calls back to
# back (a machine goes back after 30 s idle); carried folders stay for later calls:
#
#   scripts/gpu/step_profile_session.sh u    # once per folder, in order: .gpu-bundle,
#                                            # .gpu-bundle-serve, .gpu-bundle-2, .gpu-bundle-3,
#                                            # .gpu-bundle-torch-1 ... -5; after the last, FA2
#                                            # compiles in the background (warm_fa2.py)
#   scripts/gpu/step_profile_session.sh p1   # 0.26: the batched step at 1 / 8 / 16 rows, timed,
#                                            # then profiled (sensenova_batch.py --profile-rows),
#                                            # bf16 and FP8
#   scripts/gpu/step_profile_session.sh s1   # 0.26: the denoising, Qwen-Image-2.1 and four
#                                            # smaller files; the engine file
#   scripts/gpu/step_profile_session.sh s2   # 0.26: the serving file
#   scripts/gpu/step_profile_session.sh t    # 0.30 on torch 2.13: eight text answers and eight
#                                            # think requests, the release one at a time against
#                                            # the plugin's batch, and the step, profiled
#
# About 1,400 device seconds with the start. Build first (git-ignored): build_bundle.sh,
# build_serving_bundle.sh all, python3 scripts/gpu/build_torch_bundle.py.
set -uo pipefail
what=${1:?usage: step_profile_session.sh u|p1|s1|s2|t}
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
    warm_fa2_213
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
  t)
    cp /tmp/warm-fa2.log "$res/" 2>/dev/null
    mkdir -p "$res/batch-0.30-torch2.13"
    on213 timeout 520 python3 benchmarks/sensenova_batch.py --out "$res/batch-0.30-torch2.13" \
      --think-ns "" --budget-s 420 --profile-rows 8,16 >"$res/batch-0.30-torch2.13/log" 2>&1
    stamp batch-0.30-torch2.13
    ;;
esac
finish
