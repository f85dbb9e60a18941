#!/usr/bin/env bash
# The next device session's calls, prepared without device time: the restored graph pool (the
# plugin's graphs in vLLM's global pool, beea3e0) with the two capture fixes of afe243c, on both
# stacks, where they have not run together; then which half of the taken-back pool design hung
# vllm-omni 0.30's in-tree decode (results h200-2026-12-02). One machine, calls back to back (a
# machine goes back after 30 s idle), each result packed into $OUT/results-STEP.tgz:
#
#   scripts/gpu/verify_session.sh v1   # .gpu-bundle: 0.26; the decode file, the batch file
#                                      # (cut at 140 s last time), the denoising + Qwen files
#   scripts/gpu/verify_session.sh v2   # .gpu-bundle-2 arrives (unpacked)
#   scripts/gpu/verify_session.sh v3   # .gpu-bundle-3: 0.30; the decode file (its capture-failure
#                                      # test's in-tree reference is expected to fail on torch
#                                      # 2.11, pytorch/pytorch#180395), the batch file
#   scripts/gpu/verify_session.sh v4   # .gpu-bundle-serve*: 0.30; the engine file (expectations
#                                      # fixed in aa5fd65, never run to the end on 0.30)
#   scripts/gpu/verify_session.sh v5   # .gpu-bundle-variants: 0.30; the decode file's first tests
#                                      # up to the one that hung, once per pool design
#
# Build first (git-ignored): scripts/gpu/build_bundle.sh, scripts/gpu/build_serving_bundle.sh,
# scripts/gpu/build_pool_variants.sh. carry: v1 [.gpu-bundle], v2 [.gpu-bundle-2],
# v3 [.gpu-bundle-3], v4 [.gpu-bundle-serve, .gpu-bundle-serve-030], v5 [.gpu-bundle-variants].
# Each step's limits add up to at most 560 s.
set -uo pipefail
what=${1:?usage: verify_session.sh v1|v2|v3|v4|v5}
source "$(dirname "$0")/session_common.sh"
case "$what" in
  v1)
    unpack
    suite 200 suite-0.26-decode tests/test_sensenova_gpu.py -q -rfE --durations=20
    suite 220 suite-0.26-batch tests/test_sensenova_batch_gpu.py -q -rfE --durations=20
    suite 140 suite-0.26-denoise-qwen "tests/test_sensenova_denoise_gpu.py \
tests/test_qwen_image_21_gpu.py" -q -rfE
    ;;
  v2)
    unpack
    ;;
  v3)
    export STACK=0.30
    unpack
    suite 220 suite-0.30-decode tests/test_sensenova_gpu.py -q -rfE --durations=20
    suite 200 suite-0.30-batch tests/test_sensenova_batch_gpu.py -q -rfE --durations=20
    ;;
  v4)
    export STACK=0.30
    # Each engine run ends before the file's limit, so the file reports, whatever hangs.
    GRAPHDECODE_E2E_TIMEOUT=170 suite 230 suite-0.30-engine tests/test_e2e_engine_gpu.py -q -rfE
    ;;
  v5)
    export STACK=0.30 GRAPHDECODE_FAULTHANDLER_S=40
    first="paged_kernel_matches_reference_attention or graph_replay_matches_eager or \
graph_decode_matches_the_dynamic_cache_path"
    for variant in own_pool own_pool_no_anchor; do
      tree=/tmp/tree-$variant
      rm -rf "$tree" && mkdir -p "$tree"
      tar -C "$here" --exclude='./.gpu-bundle*' -cf - . | tar -C "$tree" -xf -
      cp ".gpu-bundle-variants/$variant.py" "$tree/vllm_omni_graphdecode/cuda_graphs.py"
      (cd "$tree" && GRAPHDECODE_TESTS=tests/test_sensenova_gpu.py timeout 130 \
        scripts/gpu/run_suite.sh tests "$res/$variant" -- -q -rfE -k "$first" \
        >"$res/$variant.out" 2>&1)
      stamp "$variant"
    done
    ;;
esac
finish
