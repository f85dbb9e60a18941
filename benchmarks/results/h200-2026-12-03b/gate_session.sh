#!/usr/bin/env bash
# A record: this ran as scripts/gpu/gate_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The device session for issue #23's two missed decode rows after 6b3112a, which cut the host
# check every request makes before it decodes on the paged path (one walk of the language model)
# from 8.1 to 1.2 ms on a CI CPU. The rows time a 64-token request, so that walk weighed on each
# token; this measures it on the H200 host, the old walk beside the new on one machine.
# Prepared without device time; calls back to back on one machine (it goes back after 30 s idle):
#
#   scripts/gpu/gate_session.sh prep  # here, before the calls: the walk as it was before 6b3112a
#                                     # into .gpu-ab/ (git-ignored, carried with a, c and d)
#   scripts/gpu/gate_session.sh a     # carry .gpu-bundle and .gpu-ab. 0.26: decode at 2048
#                                     # (bf16, FP8, FP8 + lm_head) with the new walk, the old,
#                                     # the new again; each row records its gate's ms a request
#   scripts/gpu/gate_session.sh b     # carry .gpu-bundle-2: unpacks it; the SenseNova-U1 FP8 and
#                                     # paged-decode GPU tests on 0.26
#   scripts/gpu/gate_session.sh c     # carry .gpu-bundle-3 and .gpu-ab: unpacks it; 0.30: decode
#                                     # at 8192, 2048, 512 beside the in-tree path, then at 8192
#                                     # with the old walk (plugin rows only)
#   scripts/gpu/gate_session.sh d     # (a fresh machine) carry .gpu-bundle and .gpu-ab. 0.26:
#                                     # one text request profiled with its phases named
#                                     # (probes/text_request_timeline.py, the walk timed both
#                                     # ways), then decode at 2048 with the new walk and the old,
#                                     # alternating
#
# The old walk is swapped into the machine's copy of the tree (`walk old`), not put first on
# PYTHONPATH: bench.py puts the repository root first on sys.path itself. At c513408 steps a and c
# did the latter, so their "old" runs (h200-2026-12-03b) ran the new walk, as their rows' gate
# times show.
set -uo pipefail
what=${1:?usage: gate_session.sh prep|a|b|c|d}
if [ "$what" = prep ]; then
  cd "$(dirname "$0")/../.."
  mkdir -p .gpu-ab
  git show 6b3112a^:vllm_omni_graphdecode/eligibility.py >.gpu-ab/eligibility-before.py
  exit 0
fi
source "$(dirname "$0")/session_common.sh"
decode=(--cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --fp8-lm-head)
walk() {
  # walk old|now: this copy of the tree with that eligibility.py. Fails (the caller skips its
  # old run) without the carried .gpu-ab.
  [ -f /tmp/eligibility-now.py ] || cp vllm_omni_graphdecode/eligibility.py /tmp/eligibility-now.py
  if [ "$1" = now ]; then
    cp /tmp/eligibility-now.py vllm_omni_graphdecode/eligibility.py
  elif [ -f .gpu-ab/eligibility-before.py ]; then
    cp .gpu-ab/eligibility-before.py vllm_omni_graphdecode/eligibility.py
  else
    echo "no .gpu-ab carried: no old walk" >>"$res/summary.txt"
    return 1
  fi
}
case "$what" in
  a)
    unpack
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    bench 150 decode-0.26-new-1 "$py26" "${decode[@]}" --contexts 2048
    walk old && bench 150 decode-0.26-old "$py26" "${decode[@]}" --contexts 2048
    walk now
    bench 150 decode-0.26-new-2 "$py26" "${decode[@]}" --contexts 2048
    ;;
  b)
    unpack
    suite 240 sensenova-gpu-0.26 "tests/test_sensenova_fp8_gpu.py tests/test_sensenova_gpu.py" \
      -q -rfE
    ;;
  c)
    unpack
    bench 420 decode-0.30-new "$py30" "${decode[@]}" --contexts 8192,2048,512
    walk old && bench 150 decode-0.30-old-8192 "$py30" "${decode[@]}" --contexts 8192 \
      --no-intree
    walk now
    ;;
  d)
    unpack
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    mkdir -p "$res/timeline-0.26"
    PYTHONPATH=$py26 timeout 150 python3 benchmarks/probes/text_request_timeline.py \
      --out "$res/timeline-0.26" --old-eligibility .gpu-ab/eligibility-before.py \
      >/dev/null 2>"$res/timeline-0.26/log"
    stamp timeline-0.26
    for run in now-1 old-1 now-2 old-2; do
      walk "${run%-*}" && bench 120 "decode-0.26-walk-$run" "$py26" "${decode[@]}" --contexts 2048
    done
    walk now
    ;;
esac
finish
