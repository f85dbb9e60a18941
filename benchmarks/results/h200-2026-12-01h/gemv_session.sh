#!/usr/bin/env bash
# A record: this ran as scripts/gpu/gemv_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The GPU runs of one session (issue #23: the one-row FP8 GEMV; issue #22: eight think requests
# with FP8 on vllm-omni 0.30), one machine, four device calls in a row, results packed into
# $OUT/results-WHAT.tgz:
#
#   scripts/gpu/gemv_session.sh h1   # 0.26 stack (.gpu-bundle): the FP8 kernels probe with the
#                                    # GEMV's block-size sweep, then the FP8 decode GPU tests
#   scripts/gpu/gemv_session.sh h2   # .gpu-bundle-2 arrives; the pre-capture GPU tests (their
#                                    # load line, measured from an emptied allocator since 1e8bf8a)
#   scripts/gpu/gemv_session.sh h3   # .gpu-bundle-3: the 0.30 stack; eight think text-to-image
#                                    # requests, the release one at a time against the plugin's
#                                    # batch with FP8 on (decode and denoising)
#   scripts/gpu/gemv_session.sh h4   # (warm) 0.30: the decode step at context 2048, in-tree
#                                    # against bf16 and FP8 (the GEMV); the denoising FP8 test
#
# Then, with the sweep's block sizes in fp8_gemv.MEASURED and the MLP tail fused (a second
# machine, three calls in a row):
#
#   scripts/gpu/gemv_session.sh i1   # 0.26 (.gpu-bundle): the FP8 decode GPU tests, the probe's
#                                    # chain at one row, the decode step bf16 against FP8
#   scripts/gpu/gemv_session.sh i2   # .gpu-bundle-2 arrives (unpacked)
#   scripts/gpu/gemv_session.sh i3   # .gpu-bundle-3: 0.30; the decode step at context 2048,
#                                    # in-tree against bf16 and FP8; the FP8 decode GPU tests
#   scripts/gpu/gemv_session.sh j1   # a third machine, 0.26 (.gpu-bundle): where the FP8 step's
#                                    # time goes, a profile beside the bf16 step's
#   scripts/gpu/gemv_session.sh j2   # a fourth machine, 0.26 (.gpu-bundle), after the add + norm
#                                    # and SiLU-and-multiply went into the gate-up launch: the
#                                    # decode step bf16 against FP8, the FP8 GPU tests, the
#                                    # profile; each result copied to $OUT as it is done (the
#                                    # session's device time was nearly spent). It ran d30fc3f,
#                                    # whose fused gate-up launch gained nothing; reverted since
#
# Each step has its own time limit so the call ends inside its 10 minutes with what it measured.
set -uo pipefail
what=${1:?usage: gemv_session.sh h1|h2|h3|h4|i1|i2|i3|j1|j2}
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
res=/tmp/res-$what
mkdir -p "$res"
export VLLM_TARGET_DEVICE=cuda CUDA_CACHE_MAXSIZE=4294967296 PYTHONUNBUFFERED=1
git log -1 --format='%H %s' >"$res/commit.txt" 2>/dev/null || true
nvidia-smi >"$res/nvidia-smi.txt" 2>&1
suite() {  # suite LIMIT DIR TESTS [pytest args...]
  local limit=$1 dir=$2 tests=$3; shift 3
  GRAPHDECODE_TESTS="$tests" timeout "$limit" scripts/gpu/run_suite.sh tests "$res/$dir" -- "$@" \
    >"$res/$dir.out" 2>&1
  echo "$dir: exit $?" >>"$res/summary.txt"
}
py26="$here:/tmp/site-project:/tmp/site"
py30="$here:/tmp/site-project:/tmp/site-omni-0.30.0:/tmp/site"
unpack() {
  for u in .gpu-bundle*/unpack.py; do python3 "$u" >>"$res/unpack.log" 2>&1; done
}
case "$what" in
  h1)
    unpack
    mkdir -p "$res/fp8-probe-0.26"
    PYTHONPATH=$py26 timeout 200 python3 benchmarks/probes/fp8_gemv.py --out "$res/fp8-probe-0.26" \
      --gemv-sweep >"$res/fp8-probe-0.26/stdout.json" 2>"$res/fp8-probe-0.26/log"
    echo "fp8-probe-0.26: exit $?" >>"$res/summary.txt"
    suite 300 fp8-tests-0.26 tests/test_sensenova_fp8_gpu.py -q -rfE -s
    ;;
  h2)
    unpack
    suite 200 precapture-0.26 tests/test_sensenova_gpu.py -q -rfE -s -k "precapture or pre_captured"
    ;;
  h3)
    export STACK=0.30
    unpack
    mkdir -p "$res/batch-fp8-0.30"
    PYTHONPATH=$py30 timeout 560 python3 benchmarks/sensenova_batch.py --out "$res/batch-fp8-0.30" \
      --cases think --n 8 --think-ns "" --fp8 on --budget-s 500 >"$res/batch-fp8-0.30/log" 2>&1
    echo "batch-fp8-0.30: exit $?" >>"$res/summary.txt"
    ;;
  h4)
    export STACK=0.30
    mkdir -p "$res/decode-0.30"
    PYTHONPATH=$py30 timeout 300 python3 benchmarks/bench.py --out "$res/decode-0.30" \
      --cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --contexts 2048 \
      >"$res/decode-0.30/stdout.json" 2>"$res/decode-0.30/log"
    echo "decode-0.30: exit $?" >>"$res/summary.txt"
    suite 200 fp8-denoise-0.30 tests/test_sensenova_denoise_gpu.py -q -rfE -s -k "fp8"
    ;;
  i1)
    unpack
    suite 200 fp8-tests-0.26 tests/test_sensenova_fp8_gpu.py -q -rfE -s
    mkdir -p "$res/fp8-probe-0.26"
    PYTHONPATH=$py26 timeout 120 python3 benchmarks/probes/fp8_gemv.py --out "$res/fp8-probe-0.26" \
      --rows 1 >"$res/fp8-probe-0.26/stdout.json" 2>"$res/fp8-probe-0.26/log"
    echo "fp8-probe-0.26: exit $?" >>"$res/summary.txt"
    mkdir -p "$res/decode-0.26"
    PYTHONPATH=$py26 timeout 200 python3 benchmarks/bench.py --out "$res/decode-0.26" \
      --cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --contexts 2048 \
      >"$res/decode-0.26/stdout.json" 2>"$res/decode-0.26/log"
    echo "decode-0.26: exit $?" >>"$res/summary.txt"
    ;;
  i2)
    unpack
    ;;
  i3)
    export STACK=0.30
    unpack
    mkdir -p "$res/decode-0.30"
    PYTHONPATH=$py30 timeout 330 python3 benchmarks/bench.py --out "$res/decode-0.30" \
      --cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --contexts 2048 \
      >"$res/decode-0.30/stdout.json" 2>"$res/decode-0.30/log"
    echo "decode-0.30: exit $?" >>"$res/summary.txt"
    suite 200 fp8-tests-0.30 tests/test_sensenova_fp8_gpu.py -q -rfE -s
    ;;
  j1)
    unpack
    mkdir -p "$res/profile-0.26"
    PYTHONPATH=$py26 timeout 170 python3 benchmarks/bench.py --out "$res/profile-0.26" \
      --cases profile --profile-parts graph,graph_fp8 --profile-context 2048 \
      >"$res/profile-0.26/stdout.json" 2>"$res/profile-0.26/log"
    echo "profile-0.26: exit $?" >>"$res/summary.txt"
    ;;
  j2)
    unpack
    mkdir -p "$res/decode-0.26"
    PYTHONPATH=$py26 timeout 120 python3 benchmarks/bench.py --out "$res/decode-0.26" \
      --cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --contexts 2048 \
      >"$res/decode-0.26/stdout.json" 2>"$res/decode-0.26/log"
    echo "decode-0.26: exit $?" >>"$res/summary.txt"
    cp "$res/decode-0.26/log" "$OUT/decode-0.26.log"; cp "$res/decode-0.26/"bench-*.json "$OUT/" || true
    suite 100 fp8-tests-0.26 tests/test_sensenova_fp8_gpu.py -q -rfE -s
    cp "$res/fp8-tests-0.26/gpu-tests-default.log" "$OUT/fp8-tests-0.26.log" || true
    mkdir -p "$res/profile-0.26"
    PYTHONPATH=$py26 timeout 60 python3 benchmarks/bench.py --out "$res/profile-0.26" \
      --cases profile --profile-parts graph_fp8 --profile-context 2048 \
      >"$res/profile-0.26/stdout.json" 2>"$res/profile-0.26/log"
    echo "profile-0.26: exit $?" >>"$res/summary.txt"
    cp "$res/profile-0.26/log" "$OUT/profile-0.26.log" || true
    ;;
esac
tar czf "$OUT/results-$what.tgz" -C /tmp "res-$what"
cat "$res/summary.txt"
