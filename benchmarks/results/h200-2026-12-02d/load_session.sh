#!/usr/bin/env bash
# A record: this ran as scripts/gpu/load_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The next device session (prepared without device time): SenseNova-U1 served over HTTP under
# load at the released shape (issue #22: "one run over HTTP at N = 8 on the real shape"),
# vllm-omni 0.30 on the torch its vllm pins; where the batched step's time goes on that stack;
# and the GPU files on vllm-omni 0.26 not run there since the stats and engine-runner changes.
# One machine, calls back to back (a machine goes back after 30 s idle); carried folders stay:
#
#   scripts/gpu/load_session.sh u    # once per folder, in order: .gpu-bundle, .gpu-bundle-serve,
#                                    # .gpu-bundle-2, .gpu-bundle-3, .gpu-bundle-torch-1 ... -5;
#                                    # after the last, FA2 compiles in the background
#   scripts/gpu/load_session.sh h0   # 0.30 + torch 2.13: the serving checkpoint (~35 GB, drawn on
#                                    # the GPU) in /tmp
#   scripts/gpu/load_session.sh h1   # the release's server: 8 text answers and 8 think images
#                                    # sent at once, served one at a time
#   scripts/gpu/load_session.sh h2   # the plugin's server, --max-num-seqs 8, the same requests
#   scripts/gpu/load_session.sh h3   # (a later machine, after u and h0) the plugin's server again
#                                    # with vLLM-Omni's --request-batch-max-wait-ms 100, against
#                                    # h1's release side from h200-2026-12-02d
#   scripts/gpu/load_session.sh t    # 0.30 + torch 2.13: the batched step at 1 / 8 / 16 rows,
#                                    # timed, then profiled (language model alone)
#   scripts/gpu/load_session.sh s2   # 0.26: the serving file
#   scripts/gpu/load_session.sh s1   # 0.26: the denoising, Qwen-Image-2.1 and four smaller
#                                    # files; the engine file
#
# About 1,600 device seconds with the start. Build first (git-ignored): build_bundle.sh,
# build_serving_bundle.sh all, python3 scripts/gpu/build_torch_bundle.py.
set -uo pipefail
what=${1:?usage: load_session.sh u|h0|h1|h2|h3|t|s2|s1}
source "$(dirname "$0")/session_common.sh"
serve_load() {  # serve_load LIMIT SIDES [ARGS...]: benchmarks/sensenova_serve.py, $res/serve-load
  local limit=$1 sides=$2; shift 2
  mkdir -p "$res/serve-load"
  cp -r /tmp/serve-load/. "$res/serve-load/" 2>/dev/null  # h2 adds to h1's record
  on213 timeout "$limit" python3 benchmarks/sensenova_serve.py --out "$res/serve-load" \
    --checkpoint /tmp/sensenova-u1-serve-checkpoint --sides "$sides" "$@" \
    >>"$res/serve-load/log" 2>&1
  stamp "serve-load-$sides"
  reap
  rm -rf /tmp/serve-load && cp -r "$res/serve-load" /tmp/serve-load
}
case "$what" in
  u)
    unpack
    warm_fa2_213
    ;;
  h0)
    # The serving wheels into /tmp/site and the plugin's entry points into /tmp/site-project
    # (what run_suite.sh prepares before its tests), then the checkpoint alone (no side).
    STACK=0.30 TORCH=2.13 scripts/gpu/run_suite.sh setup "$res/setup" >"$res/setup.out" 2>&1
    stamp setup
    serve_load 500 ""
    df -h /tmp >"$res/df.txt" 2>&1
    free -g >>"$res/df.txt" 2>&1
    ;;
  h1)
    serve_load 580 release
    cp /tmp/warm-fa2.log "$res/" 2>/dev/null
    ;;
  h2)
    serve_load 560 plugin
    ;;
  h3)
    rm -rf /tmp/serve-load
    serve_load 400 plugin --batch-wait-ms 100 \
      --release-from benchmarks/results/h200-2026-12-02d/serve-load-0.30/sensenova-serve.json
    ;;
  t)
    mkdir -p "$res/step-0.30-torch2.13"
    on213 timeout 200 python3 benchmarks/sensenova_batch.py --out "$res/step-0.30-torch2.13" \
      --cases step --lm-only --profile-rows 1,8,16 >"$res/step-0.30-torch2.13/log" 2>&1
    stamp step-0.30-torch2.13
    ;;
  s2)
    suite 330 suite-serve-0.26 tests/test_e2e_serve_gpu.py -q -rfE
    ;;
  s1)
    suite 190 suite-six-0.26 "tests/test_sensenova_denoise_gpu.py tests/test_qwen_image_21_gpu.py \
tests/test_qwen_image_21_fast_step.py tests/test_sensenova_paged_decode.py \
tests/test_gemv_bench.py tests/test_qwen_image_bench.py" -q -rfE
    GRAPHDECODE_E2E_TIMEOUT=150 suite 220 suite-engine-0.26 tests/test_e2e_engine_gpu.py -q -rfE
    ;;
esac
finish
