#!/usr/bin/env bash
# The device session for the fused decode step's one-launch q/k norm + rope and K/V write
# (hooks/sensenova_u1/rope_store.py, issue #23): its GPU tests, and the decode rows with it
# beside the tree before it, on one machine. Prepared without device time; calls back to back
# (a machine goes back after 30 s idle):
#
#   scripts/gpu/rope_store_session.sh prep  # here: the tree before the kernel (b01698e) into
#                                           # .gpu-ab/ (git-ignored), carried with a and c
#   scripts/gpu/rope_store_session.sh a     # carry .gpu-bundle and .gpu-ab. 0.26: decode at
#                                           # 2048 (bf16, FP8, FP8 + lm_head), this tree and
#                                           # the one before alternating, then the step's profile
#   scripts/gpu/rope_store_session.sh b     # carry .gpu-bundle-2: the SenseNova-U1 paged, FP8
#                                           # and batched decode GPU tests on 0.26
#   scripts/gpu/rope_store_session.sh c     # carry .gpu-bundle-3 and .gpu-ab. 0.30: the new
#                                           # GPU tests, then decode at 8192, 2048, 512 beside
#                                           # the in-tree path, and at 2048 with the tree before
#
# The tree before runs from its own copy (/tmp/before): bench.py puts its own repository root
# first on sys.path, so that copy's package is the one imported.
set -uo pipefail
what=${1:?usage: rope_store_session.sh prep|a|b|c}
before=b01698e
if [ "$what" = prep ]; then
  cd "$(dirname "$0")/../.."
  mkdir -p .gpu-ab
  # The package and the benchmark scripts only: the call that carries this carries the 49 MiB
  # bundle beside the 13 MiB tree, under the tool's 64 MiB.
  rm -f .gpu-ab/tree-before.tgz
  git archive --format=tar.gz -o .gpu-ab/tree-before.tgz "$before" vllm_omni_graphdecode \
    benchmarks/bench.py benchmarks/common.py benchmarks/profile_step.py benchmarks/qwen_step.py \
    benchmarks/plot.py
  exit 0
fi
source "$(dirname "$0")/session_common.sh"
decode=(--cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --fp8-lm-head)
# Each step's results reach $OUT as it ends, so that a call cut by the tool's limit brings back
# what finished.
eval "$(declare -f stamp | sed '1s/stamp/stamp_one/')"
stamp() { stamp_one "$1"; mkdir -p "$OUT/partial"; cp -r "$res" "$OUT/partial/" 2>/dev/null; }
old() {
  # old LIMIT DIR PYTHONPATH-AFTER-THE-TREE [bench.py args...]: bench.py of the tree before
  if [ ! -d /tmp/before ]; then
    mkdir -p /tmp/before && tar xzf .gpu-ab/tree-before.tgz -C /tmp/before || {
      echo "no .gpu-ab carried: no run of the tree before" >>"$res/summary.txt"; return 1; }
  fi
  local limit=$1 dir=$2 rest=$3; shift 3
  mkdir -p "$res/$dir"
  (cd /tmp/before && PYTHONPATH=/tmp/before:$rest timeout "$limit" python3 benchmarks/bench.py \
    --out "$res/$dir" "$@" >"$res/$dir/stdout.json" 2>"$res/$dir/log")
  stamp "$dir"
}
case "$what" in
  a)
    unpack
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    git -C "$here" rev-parse HEAD >"$res/commit.txt" 2>&1
    for run in 1 2; do
      bench 120 "decode-0.26-new-$run" "$py26" "${decode[@]}" --contexts 2048
      old 120 "decode-0.26-before-$run" "/tmp/site-project:/tmp/site" "${decode[@]}" \
        --contexts 2048
    done
    bench 150 profile-0.26 "$py26" --cases profile --profile-parts graph_fp8 --fp8-lm-head \
      --profile-context 2048
    ;;
  b)
    unpack
    suite 480 gpu-tests-0.26 "tests/test_sensenova_gpu.py tests/test_sensenova_fp8_gpu.py \
tests/test_sensenova_batch_gpu.py" -q -rfE --durations=15
    ;;
  c)
    unpack
    STACK=0.30 suite 150 gpu-tests-0.30 tests/test_sensenova_gpu.py -q -rfE \
      -k "rope_store or fused_step or graph_replay"
    bench 300 decode-0.30-new "$py30" "${decode[@]}" --contexts 8192,2048,512
    old 120 decode-0.30-before-2048 "/tmp/site-project:/tmp/site-omni-0.30.0:/tmp/site" \
      "${decode[@]}" --contexts 2048 --no-intree
    ;;
esac
finish
