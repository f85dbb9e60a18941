#!/usr/bin/env bash
# A record: this ran as scripts/gpu/rope_store_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The device session for two cuts to the fused decode step's launches (issue #23): q/k norm +
# rope and the K/V write as one launch (hooks/sensenova_u1/rope_store.py, 0235783), and the FP8
# gate-up launch ending in silu(gate) * up (fp8_gemv.py's SWIGLU_OUT). Their GPU tests, and the
# decode rows with both, with the first only and with neither, on one machine. Prepared without
# device time; calls back to back (a machine goes back after 30 s idle):
#
#   scripts/gpu/rope_store_session.sh prep  # here: the trees before (b01698e) and with the
#                                           # first cut only (0235783) into .gpu-ab/
#                                           # (git-ignored), carried with a and c
#   scripts/gpu/rope_store_session.sh a     # carry .gpu-bundle and .gpu-ab. 0.26: decode at
#                                           # 2048 (bf16, FP8, FP8 + lm_head): this tree, the
#                                           # one before, the first cut only, alternating; then
#                                           # the step's profile
#   scripts/gpu/rope_store_session.sh b     # carry .gpu-bundle-2: the SenseNova-U1 paged, FP8
#                                           # and batched decode GPU tests on 0.26
#   scripts/gpu/rope_store_session.sh c     # carry .gpu-bundle-3 and .gpu-ab. 0.30: the new
#                                           # GPU tests, then decode at 2048 beside the in-tree
#                                           # path, and with the tree before
#   scripts/gpu/rope_store_session.sh d     # (after c) 0.30: decode at 8192 and 512 beside the
#                                           # in-tree path
#
# An older tree runs from its own copy (/tmp/TAG): bench.py puts its own repository root first
# on sys.path, so that copy's package is the one imported.
set -uo pipefail
what=${1:?usage: rope_store_session.sh prep|a|b|c|d}
if [ "$what" = prep ]; then
  cd "$(dirname "$0")/../.."
  mkdir -p .gpu-ab
  # The package and the benchmark scripts only: the call that carries these carries the 49 MiB
  # bundle beside the 13 MiB tree, under the tool's 64 MiB.
  for pair in before:b01698e rope-store:0235783; do
    rm -f ".gpu-ab/tree-${pair%%:*}.tgz"
    git archive --format=tar.gz -o ".gpu-ab/tree-${pair%%:*}.tgz" "${pair#*:}" \
      vllm_omni_graphdecode benchmarks/bench.py benchmarks/common.py benchmarks/profile_step.py \
      benchmarks/qwen_step.py benchmarks/plot.py
  done
  exit 0
fi
source "$(dirname "$0")/session_common.sh"
decode=(--cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --fp8-lm-head)
old() {
  # old TAG LIMIT DIR PYTHONPATH-AFTER-THE-TREE [bench.py args...]: bench.py of an older tree
  local tag=$1 limit=$2 dir=$3 rest=$4; shift 4
  if [ ! -d "/tmp/$tag" ]; then
    mkdir -p "/tmp/$tag" && tar xzf ".gpu-ab/tree-$tag.tgz" -C "/tmp/$tag" || {
      echo "no .gpu-ab carried: no run of $tag" >>"$res/summary.txt"; return 1; }
  fi
  mkdir -p "$res/$dir"
  (cd "/tmp/$tag" && PYTHONPATH=/tmp/$tag:$rest timeout "$limit" python3 benchmarks/bench.py \
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
      old before 120 "decode-0.26-before-$run" "/tmp/site-project:/tmp/site" "${decode[@]}" \
        --contexts 2048
      [ "$run" = 2 ] || old rope-store 120 "decode-0.26-rope-store-$run" \
        "/tmp/site-project:/tmp/site" "${decode[@]}" --contexts 2048
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
    STACK=0.30 suite 200 gpu-tests-0.30 "tests/test_sensenova_gpu.py \
tests/test_sensenova_fp8_gpu.py" -q -rfE -k "rope_store or fused_step or graph_replay or swiglu"
    bench 200 decode-0.30-new-2048 "$py30" "${decode[@]}" --contexts 2048
    old before 120 decode-0.30-before-2048 "/tmp/site-project:/tmp/site-omni-0.30.0:/tmp/site" \
      "${decode[@]}" --contexts 2048 --no-intree
    ;;
  d)
    bench 420 decode-0.30-new-8192-512 "$py30" "${decode[@]}" --contexts 8192,512
    ;;
esac
finish
