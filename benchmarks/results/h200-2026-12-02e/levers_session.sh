#!/usr/bin/env bash
# A record: this ran as scripts/gpu/levers_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The device session after the HTTP load run (prepared without device time): the two levers the
# open issues left. One machine, calls back to back (a machine goes back after 30 s idle);
# carried folders stay:
#
#   scripts/gpu/levers_session.sh u   # once per folder, in order: .gpu-bundle, .gpu-bundle-2,
#                                     # .gpu-bundle-3 + -serve, -serve-030 + -torch-5,
#                                     # -torch-1 ... -4; after the last, FA2 compiles in the
#                                     # background
#   scripts/gpu/levers_session.sh b   # 0.30 + torch 2.13: eight think text-to-image requests,
#                                     # the release one at a time against the plugin's batch in
#                                     # bf16 with the fast denoising body (issue #22's think row)
#   scripts/gpu/levers_session.sh a   # 0.30 + torch 2.13: the batched step's attention
#                                     # candidates (probe); 0.26: the Qwen-Image-2.1 GPU files
#                                     # (the tail written inside the compiled region), then a
#                                     # whole image, bf16 fast and W8A8 (issue #23's Qwen row)
#   scripts/gpu/levers_session.sh s   # 0.26: the engine file, then the serving file, as long
#                                     # as the limits allow
#   scripts/gpu/levers_session.sh r   # (a later machine, after u with .gpu-bundle, -2, -3 only)
#                                     # 0.26: the fast denoising layer compiled in two
#                                     # processes, reductions tuned by timing and in Inductor's
#                                     # deterministic mode; Qwen-Image-2.1's W8A8 image and the
#                                     # fast-mode GPU tests with the deterministic mode; each
#                                     # result copied into $OUT as it ends
#
# About 1,300 device seconds with the start. Build first (git-ignored): build_bundle.sh,
# build_serving_bundle.sh all, python3 scripts/gpu/build_torch_bundle.py.
set -uo pipefail
what=${1:?usage: levers_session.sh u|b|a|s|r}
source "$(dirname "$0")/session_common.sh"
case "$what" in
  u)
    unpack
    warm_fa2_213
    ;;
  b)
    mkdir -p "$res/batch-fast-0.30"
    on213 timeout 540 python3 benchmarks/sensenova_batch.py --out "$res/batch-fast-0.30" \
      --cases think --n 8 --think-ns "" --denoise fast --budget-s 480 \
      >"$res/batch-fast-0.30/log" 2>&1
    stamp batch-fast-0.30
    cp /tmp/warm-fa2.log "$res/" 2>/dev/null
    ;;
  a)
    mkdir -p "$res/attention-probe-0.30"
    on213 timeout 120 python3 benchmarks/probes/batched_attention.py \
      --out "$res/attention-probe-0.30" >"$res/attention-probe-0.30/log" 2>&1
    stamp attention-probe-0.30
    suite 200 qwen-gpu-0.26 "tests/test_qwen_image_21_fast_step.py tests/test_qwen_image_21_gpu.py" \
      -q -rfE
    mkdir -p "$res/qwen-image-0.26"
    PYTHONPATH=$py26 timeout 200 python3 benchmarks/qwen_image.py --out "$res/qwen-image-0.26" \
      --modes fast,fast_fp8 --cfg 1 >"$res/qwen-image-0.26/stdout.json" \
      2>"$res/qwen-image-0.26/log"
    stamp qwen-image-0.26
    ;;
  s)
    GRAPHDECODE_E2E_TIMEOUT=150 suite 220 suite-engine-0.26 tests/test_e2e_engine_gpu.py -q -rfE
    suite 330 suite-serve-0.26 tests/test_e2e_serve_gpu.py -q -rfE
    ;;
  r)
    mkdir -p "$res/repro-0.26"
    for tag in A B; do
      PYTHONPATH=$py26 timeout 90 python3 benchmarks/probes/compiled_repro.py \
        --out "$res/repro-0.26" --tag $tag >/dev/null 2>>"$res/repro-0.26/log"
      stamp "repro-$tag"
      cp "$res/repro-0.26/compiled-repro-$tag.json" "$OUT/" 2>/dev/null
    done
    mkdir -p "$res/qwen-image-det-0.26"
    PYTHONPATH=$py26 timeout 110 python3 benchmarks/qwen_image.py \
      --out "$res/qwen-image-det-0.26" --modes fast_fp8 --cfg 1 \
      >"$res/qwen-image-det-0.26/stdout.json" 2>"$res/qwen-image-det-0.26/log"
    stamp qwen-image-det-0.26
    cp "$res/qwen-image-det-0.26/qwen-image.json" "$OUT/" 2>/dev/null
    suite 100 fast-gpu-0.26 "tests/test_qwen_image_21_fast_step.py tests/test_qwen_image_21_gpu.py \
tests/test_sensenova_denoise_gpu.py" -q -rfE -k fast
    ;;
esac
finish
