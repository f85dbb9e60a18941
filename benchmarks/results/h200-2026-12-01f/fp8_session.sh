#!/usr/bin/env bash
# A record: this ran as scripts/gpu/fp8_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The GPU runs of issue #23 (FP8 decode) and #22's serving tests, one device call each, results
# packed into $OUT/results-WHAT.tgz:
#
#   scripts/gpu/fp8_session.sh f1   # 0.26 stack (.gpu-bundle, .gpu-bundle-serve): the FP8 GPU
#                                   # tests, the two-process test (bf16 and FP8), the decode
#                                   # step bf16 against FP8 at context 2048 with token agreement
#   scripts/gpu/fp8_session.sh f2   # (warm) tests/test_e2e_serve_gpu.py on 0.26
#   scripts/gpu/fp8_session.sh f3   # .gpu-bundle-2 arrives (unpacked; no run: the session's
#                                   # device time went to f2 and f4)
#   scripts/gpu/fp8_session.sh f4   # .gpu-bundle-3: the 0.30 stack; the decode step at 512,
#                                   # 2048 and 8192: in-tree, bf16 and FP8
#   scripts/gpu/fp8_session.sh f6   # a fresh machine, 0.26 (.gpu-bundle, .gpu-bundle-serve):
#                                   # the two FP8 tests changed after f1, the serving test again
#                                   # (0.26 now refuses --max-num-seqs 8 with the plugin on too),
#                                   # the batched decode step bf16 and FP8
#   scripts/gpu/fp8_session.sh f7   # a fresh machine, 0.26 (.gpu-bundle): the FP8 GPU tests of
#                                   # both models, then Qwen-Image-2.1's 1024x1024 image with the
#                                   # fast step bf16 and W8A8 against diffusers
#
# A later session (one machine, four calls in a row; #23's SenseNova-U1 FP8 denoising, #22's
# 0.30 serving run and the engine test three times):
#
#   scripts/gpu/fp8_session.sh g1   # 0.26 (.gpu-bundle, .gpu-bundle-serve): the FP8 GPU tests
#                                   # of both models (denoising, copies after writes and release),
#                                   # lm_head both ways (probe)
#   scripts/gpu/fp8_session.sh g2   # .gpu-bundle-2 arrives; the engine test of #22 item 4 three
#                                   # times in a row on 0.26, each run its own processes
#   scripts/gpu/fp8_session.sh g3   # .gpu-bundle-3: the 0.30 stack; the whole request, release
#                                   # against the plugin with FP8 on and the fast denoising
#   scripts/gpu/fp8_session.sh g4   # .gpu-bundle-serve-030: tests/test_e2e_serve_gpu.py on 0.30,
#                                   # then the denoising FP8 GPU test on 0.30
#   scripts/gpu/fp8_session.sh g5   # a fresh machine, 0.26 (.gpu-bundle): the denoising FP8
#                                   # GPU tests with the bounds measured in g1/g4, and the
#                                   # compiled FP8 step against its fp32 restatement
#   scripts/gpu/fp8_session.sh g6   # a fresh machine, 0.26 (.gpu-bundle): FA3's FP8 attention
#                                   # at Qwen-Image-2.1's shape (probe), then the W8A8 image
#                                   # against diffusers with SSIM
#
# Each step has its own time limit so the call ends inside its 10 minutes with what it measured.
set -uo pipefail
what=${1:?usage: fp8_session.sh f1|f2|f3|f4|f6|f7|g1|g2|g3|g4|g5|g6}
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
res=/tmp/res-$what
mkdir -p "$res"
export VLLM_TARGET_DEVICE=cuda CUDA_CACHE_MAXSIZE=4294967296 PYTHONUNBUFFERED=1
nvidia-smi >"$res/nvidia-smi.txt" 2>&1
suite() {  # suite LIMIT DIR TESTS [pytest args...]
  local limit=$1 dir=$2 tests=$3; shift 3
  GRAPHDECODE_TESTS="$tests" timeout "$limit" scripts/gpu/run_suite.sh tests "$res/$dir" -- "$@" \
    >"$res/$dir.out" 2>&1
  echo "$dir: exit $?" >>"$res/summary.txt"
}
bench() {  # bench LIMIT DIR PYTHONPATH [bench.py args...]
  local limit=$1 dir=$2 pp=$3; shift 3
  mkdir -p "$res/$dir"
  PYTHONPATH=$pp timeout "$limit" python3 benchmarks/bench.py --out "$res/$dir" "$@" \
    >"$res/$dir/stdout.json" 2>"$res/$dir/log"
  echo "$dir: exit $?" >>"$res/summary.txt"
}
py26="$here:/tmp/site-project:/tmp/site"
py30="$here:/tmp/site-project:/tmp/site-omni-0.30.0:/tmp/site"
decode=(--cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8)
case "$what" in
  f1)
    suite 330 fp8-tests-0.26 "tests/test_sensenova_fp8_gpu.py tests/test_sensenova_batch_gpu.py" \
      -q -rfE -s -k "fp8 or two_processes"
    bench 230 decode-0.26 "$py26" "${decode[@]}" --contexts 2048
    ;;
  f2)
    GRAPHDECODE_SERVE_OUT="$res/serve-0.26-out" suite 450 serve-0.26 tests/test_e2e_serve_gpu.py -q -rfE
    ;;
  f3)
    for unpack in .gpu-bundle*/unpack.py; do python3 "$unpack" >>"$res/unpack.log" 2>&1; done
    ;;
  f4)
    export STACK=0.30
    for unpack in .gpu-bundle*/unpack.py; do python3 "$unpack" >>"$res/unpack.log" 2>&1; done
    bench 540 decode-0.30 "$py30" "${decode[@]}" --contexts 2048,512,8192
    ;;
  f6)
    suite 150 fp8-tests-0.26 tests/test_sensenova_fp8_gpu.py -q -rfE -s -k "dequantised or rows_do_not_mix"
    GRAPHDECODE_SERVE_OUT="$res/serve-0.26-out" suite 240 serve-0.26 tests/test_e2e_serve_gpu.py -q -rfE
    for side in bf16 fp8; do
      mkdir -p "$res/step-$side-0.26"
      PYTHONPATH=$py26 timeout 150 python3 benchmarks/sensenova_batch.py --out "$res/step-$side-0.26" \
        --cases step --lm-only $([ $side = fp8 ] && echo --fp8) >"$res/step-$side-0.26/log" 2>&1
      echo "step-$side-0.26: exit $?" >>"$res/summary.txt"
    done
    ;;
  f7)
    suite 150 fp8-tests-0.26 "tests/test_sensenova_fp8_gpu.py tests/test_qwen_image_21_fast_step.py" \
      -q -rfE -s -k "dequantised or fp8"
    mkdir -p "$res/qwen-image-0.26"
    PYTHONPATH=$py26 timeout 240 python3 benchmarks/qwen_image.py --out "$res/qwen-image-0.26" \
      --modes fast,fast_fp8 --cfg 1 >"$res/qwen-image-0.26/stdout.jsonl" 2>"$res/qwen-image-0.26/log"
    echo "qwen-image-0.26: exit $?" >>"$res/summary.txt"
    ;;
  g1)
    suite 280 fp8-tests-0.26 "tests/test_sensenova_denoise_gpu.py tests/test_sensenova_fp8_gpu.py tests/test_qwen_image_21_fast_step.py" \
      -q -rfE -s -k "fp8"
    mkdir -p "$res/lm-head-0.26"
    PYTHONPATH=$py26 timeout 120 python3 benchmarks/probes/fp8_gemv.py --out "$res/lm-head-0.26" \
      --lm-head-only >"$res/lm-head-0.26/stdout.json" 2>"$res/lm-head-0.26/log"
    echo "lm-head-0.26: exit $?" >>"$res/summary.txt"
    ;;
  g2)
    for unpack in .gpu-bundle*/unpack.py; do python3 "$unpack" >>"$res/unpack.log" 2>&1; done
    for run in 1 2 3; do
      suite 170 "e2e-think-0.26-run$run" tests/test_e2e_engine_gpu.py -q -rfE \
        -k "same_for_the_same_think_tokens"
    done
    ;;
  g3)
    export STACK=0.30
    for unpack in .gpu-bundle*/unpack.py; do python3 "$unpack" >>"$res/unpack.log" 2>&1; done
    mkdir -p "$res/request-fp8-0.30"
    PYTHONPATH=$py30 timeout 500 python3 benchmarks/sensenova_request.py --out "$res/request-fp8-0.30" \
      --size 1024 --steps 50 --cfg 4 --think both --denoise fast --fp8 on --no-audit \
      >"$res/request-fp8-0.30/stdout.jsonl" 2>"$res/request-fp8-0.30/stderr.log"
    echo "request-fp8-0.30: exit $?" >>"$res/summary.txt"
    ;;
  g4)
    export STACK=0.30
    GRAPHDECODE_SERVE_OUT="$res/serve-0.30-out" suite 330 serve-0.30 tests/test_e2e_serve_gpu.py -q -rfE
    suite 150 fp8-denoise-0.30 tests/test_sensenova_denoise_gpu.py -q -rfE -s -k "fp8 or fast"
    ;;
  g5)
    suite 240 fp8-denoise-0.26 tests/test_sensenova_denoise_gpu.py -q -rfE -s -k "fp8"
    ;;
  g6)
    for unpack in .gpu-bundle*/unpack.py; do python3 "$unpack" >>"$res/unpack.log" 2>&1; done
    mkdir -p "$res/fp8-attention-0.26" "$res/qwen-image-0.26"
    PYTHONPATH=$py26 timeout 80 python3 benchmarks/probes/fp8_attention.py \
      --out "$res/fp8-attention-0.26" >"$res/fp8-attention-0.26/stdout.json" \
      2>"$res/fp8-attention-0.26/log"
    echo "fp8-attention-0.26: exit $?" >>"$res/summary.txt"
    PYTHONPATH=$py26 timeout 150 python3 benchmarks/qwen_image.py --out "$res/qwen-image-0.26" \
      --modes fast_fp8 --cfg 1 >"$res/qwen-image-0.26/stdout.jsonl" 2>"$res/qwen-image-0.26/log"
    echo "qwen-image-0.26: exit $?" >>"$res/summary.txt"
    ;;
esac
rm -rf "$res"/serve-*-out/*/*.npy 2>/dev/null
tar czf "$OUT/results-$what.tgz" -C /tmp "res-$what"
cat "$res/summary.txt"
