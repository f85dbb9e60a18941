#!/usr/bin/env bash
# A record: this ran as scripts/gpu/batch_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The GPU runs of issue #22, one device call each, results packed into $OUT/results-WHAT.tgz (a
# call brings back at most 8 files):
#
#   scripts/gpu/batch_session.sh c1   # 0.26 stack (.gpu-bundle): batch GPU tests, the decode
#                                     # step at batch 1 / 8 / 16, the changed single-path tests
#   scripts/gpu/batch_session.sh c2   # .gpu-bundle-2 (+ -serve): half of the 0.30 stack arrives;
#                                     # the engine end-to-end test on 0.26, three runs in a row
#   scripts/gpu/batch_session.sh c3   # .gpu-bundle-3: the 0.30 stack complete: the request
#                                     # benchmark (sensenova_batch.py), release against plugin
#   scripts/gpu/batch_session.sh c4   # (warm machine after c3) N = 16, 1, 2, 4, and the batch
#                                     # GPU tests on 0.30
#
# Each step has its own time limit so the call ends inside its 10 minutes with what it measured.
set -uo pipefail
what=${1:?usage: batch_session.sh c1|c2|c3|c4}
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
case "$what" in
  c1)
    suite 300 batch-tests-0.26 tests/test_sensenova_batch_gpu.py -q -rfE
    mkdir -p "$res/step-0.26"
    PYTHONPATH=$py26 timeout 150 python3 benchmarks/sensenova_batch.py --out "$res/step-0.26" \
      --cases step --lm-only >"$res/step-0.26/log" 2>&1
    echo "step-0.26: exit $?" >>"$res/summary.txt"
    suite 110 single-tests-0.26 tests/test_sensenova_gpu.py -q -rfE \
      -k "lora or precapture or another_thread or fused_step_logits"
    ;;
  c2)
    for i in 1 2 3; do
      suite 170 "e2e-engine-0.26-run$i" tests/test_e2e_engine_gpu.py -q -rfE
    done
    ;;
  c3)
    export STACK=0.30
    for unpack in .gpu-bundle*/unpack.py; do python3 "$unpack" >>"$res/unpack.log" 2>&1; done
    mkdir -p "$res/bench-0.30"
    PYTHONPATH=$py30 timeout 500 python3 benchmarks/sensenova_batch.py --out "$res/bench-0.30" \
      --think-ns "" --budget-s 420 >"$res/bench-0.30/log" 2>&1
    echo "bench-0.30: exit $?" >>"$res/summary.txt"
    ;;
  c4)
    export STACK=0.30
    mkdir -p "$res/sweep-0.30"
    PYTHONPATH=$py30 timeout 420 python3 benchmarks/sensenova_batch.py --out "$res/sweep-0.30" \
      --cases think --n 16 --think-ns 1,2,4 --budget-s 330 \
      --release-from /tmp/res-c3/bench-0.30/sensenova-batch.json >"$res/sweep-0.30/log" 2>&1
    echo "sweep-0.30: exit $?" >>"$res/summary.txt"
    suite 120 batch-tests-0.30 tests/test_sensenova_batch_gpu.py -q -rfE \
      -k "alone_bit_for_bit or eager_step or eagerly"
    ;;
esac
tar czf "$OUT/results-$what.tgz" -C /tmp "res-$what"
cat "$res/summary.txt"
