#!/usr/bin/env bash
# A record: this ran as scripts/gpu/head_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The device session for issue #23's FP8 lm_head and the fast bodies' reproducibility across
# machines (prepared without device time). Two machines, calls back to back on each (a machine
# goes back after 30 s idle); carried folders stay:
#
#   scripts/gpu/head_session.sh u    # once per folder, in order: .gpu-bundle, .gpu-bundle-2,
#                                    # .gpu-bundle-3 (0.26 and the 0.30 tree on the host's torch)
#   scripts/gpu/head_session.sh x1   # 0.26: the fast denoising layer compiled in one process,
#                                    # tuned and deterministic (hashes to compare with the
#                                    # machine of h200-2026-12-02e); the FP8 GPU tests (lm_head,
#                                    # replay); decode at context 2048: bf16, FP8, FP8 + lm_head;
#                                    # Qwen-Image-2.1's W8A8 image and its hash
#   scripts/gpu/head_session.sh x2   # 0.30: decode at 2048, 512, 8192 beside the in-tree path
#   scripts/gpu/head_session.sh x3   # a second machine (after u): x1's repro, image and decode
#                                    # at 2048 again
#   scripts/gpu/head_session.sh q    # (a later machine, after u) 0.26: FP8 fast accumulation at
#                                    # Qwen-Image-2.1's GEMM shapes (probe), the W8A8 image with
#                                    # it, and the Qwen-Image-2.1 fast-step GPU tests
#   scripts/gpu/head_session.sh i    # (another machine, after u) 0.26: q's image again
#
# About 1,200 device seconds with both starts. Build first (git-ignored): build_bundle.sh.
set -uo pipefail
what=${1:?usage: head_session.sh u|x1|x2|x3|q|i}
source "$(dirname "$0")/session_common.sh"
decode=(--cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --fp8-lm-head)
repro() {
  mkdir -p "$res/repro-0.26"
  PYTHONPATH=$py26 timeout 90 python3 benchmarks/probes/compiled_repro.py \
    --out "$res/repro-0.26" --tag "$1" >/dev/null 2>>"$res/repro-0.26/log"
  stamp "repro-$1"
}
image() {
  mkdir -p "$res/qwen-image-0.26"
  PYTHONPATH=$py26 timeout 120 python3 benchmarks/qwen_image.py --out "$res/qwen-image-0.26" \
    --modes fast_fp8 --cfg 1 >"$res/qwen-image-0.26/stdout.json" 2>"$res/qwen-image-0.26/log"
  stamp qwen-image-0.26
}
case "$what" in
  u)
    unpack
    ;;
  x1)
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    repro M1
    suite 150 fp8-tests-0.26 tests/test_sensenova_fp8_gpu.py -q -rfE -s \
      -k "lm_head or graph_replay or dequantised_weights_within"
    bench 150 decode-0.26 "$py26" "${decode[@]}" --contexts 2048
    image
    ;;
  x2)
    bench 400 decode-0.30 "$py30" "${decode[@]}" --contexts 2048,512,8192
    ;;
  x3)
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    repro M2
    image
    bench 150 decode-0.26 "$py26" "${decode[@]}" --contexts 2048
    ;;
  i)
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    image
    ;;
  q)
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    mkdir -p "$res/fp8-accum-0.26"
    PYTHONPATH=$py26 timeout 120 python3 benchmarks/probes/fp8_accum.py --out "$res/fp8-accum-0.26" \
      >/dev/null 2>"$res/fp8-accum-0.26/log"
    stamp fp8-accum-0.26
    image
    suite 150 qwen-fast-gpu-0.26 "tests/test_qwen_image_21_fast_step.py tests/test_qwen_image_21_gpu.py" \
      -q -rfE -k "fp8 or fast"
    ;;
esac
finish
