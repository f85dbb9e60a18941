#!/usr/bin/env bash
# The device session for issue #23's two missed decode rows: the one-row FP8 GEMV with its
# weight blocks prefetched (and launched as programmatic dependent launches), swept, written into
# fp8_gemv.MEASURED on the machine, and the decode step measured before and after. Prepared
# without device time; calls back to back on one machine (it goes back after 30 s idle):
#
#   scripts/gpu/prefetch_session.sh a   # carry .gpu-bundle. 0.26: decode at 2048 with today's
#                                       # table; the GEMV sweep (fp8_gemv.py --gemv-sweep
#                                       # --gemv-only); decode with its picks, then with the picks
#                                       # as dependent launches; keeps the fastest of the three
#                                       # (/tmp/gemv-choice) and profiles that step
#   scripts/gpu/prefetch_session.sh b   # carry .gpu-bundle-2: unpacks it; 0.26 with a's choice:
#                                       # the FP8 GPU tests (prefetch, lm_head, replay, bound)
#   scripts/gpu/prefetch_session.sh c   # carry .gpu-bundle-3: unpacks it; 0.30 with a's choice:
#                                       # decode at 2048, 512, 8192 beside the in-tree path, and
#                                       # the profile
#   scripts/gpu/prefetch_session.sh d   # (another machine, after `head_session.sh u`'s three
#                                       # unpacks) the committed table: decode 0.26 at 2048 and
#                                       # 0.30 at 8192 and 2048
#
# Each step after a writes a's chosen table into this machine's copy of fp8_gemv.py (the tool
# copies the working tree afresh each call) and keeps that file in its results; on a machine
# without a's choice the committed table runs.
set -uo pipefail
what=${1:?usage: prefetch_session.sh a|b|c|d}
source "$(dirname "$0")/session_common.sh"
decode=(--cases sensenova_decode --fa 3 --tokens-per-launch "" --no-exact --fp8 --fp8-lm-head)
sweep=/tmp/res-a/gemv-sweep-0.26/fp8-gemv.json
# Each step's results reach $OUT as it ends, so that a call cut by the tool's limit brings back
# what finished.
eval "$(declare -f stamp | sed '1s/stamp/stamp_one/')"
stamp() { stamp_one "$1"; mkdir -p "$OUT/partial"; cp -r "$res" "$OUT/partial/" 2>/dev/null; }
apply_choice() {
  # fp8_gemv.MEASURED as step a chose it: today's (before), the sweep's picks, or with --pdl.
  local choice
  choice=$(cat /tmp/gemv-choice 2>/dev/null || echo committed)
  echo "table: $choice" >>"$res/summary.txt"
  case "$choice" in
    prefetch) python3 scripts/gpu/gemv_table.py "$sweep" >>"$res/table.txt" ;;
    pdl) python3 scripts/gpu/gemv_table.py "$sweep" --pdl >>"$res/table.txt" ;;
  esac
  cp vllm_omni_graphdecode/fp8_gemv.py "$res/fp8_gemv-$choice.py"
}
profile() {  # profile DIR PYTHONPATH: where the FP8 + lm_head step's time goes at 2048
  bench 90 "$1" "$2" --cases profile --profile-parts graph_fp8 --fp8-lm-head \
    --profile-context 2048
}
case "$what" in
  a)
    unpack
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    bench 120 decode-0.26-before "$py26" "${decode[@]}" --contexts 2048
    mkdir -p "$res/gemv-sweep-0.26"
    PYTHONPATH=$py26 timeout 180 python3 benchmarks/probes/fp8_gemv.py --out "$res/gemv-sweep-0.26" \
      --gemv-sweep --gemv-only >/dev/null 2>"$res/gemv-sweep-0.26/log"
    stamp gemv-sweep-0.26
    if [ -f "$sweep" ]; then
      cp vllm_omni_graphdecode/fp8_gemv.py /tmp/fp8_gemv-today.py
      python3 scripts/gpu/gemv_table.py "$sweep" >"$res/table-prefetch.txt" 2>&1
      cp vllm_omni_graphdecode/fp8_gemv.py "$res/fp8_gemv-prefetch.py"
      bench 120 decode-0.26-prefetch "$py26" "${decode[@]}" --contexts 2048
      python3 scripts/gpu/gemv_table.py "$sweep" --pdl >"$res/table-pdl.txt" 2>&1
      cp vllm_omni_graphdecode/fp8_gemv.py "$res/fp8_gemv-pdl.py"
      bench 120 decode-0.26-pdl "$py26" "${decode[@]}" --contexts 2048
      python3 - "$res" >/tmp/gemv-choice 2>>"$res/summary.txt" <<'PY'
import json, os, sys
res = sys.argv[1]
ms = {}
for side in ("before", "prefetch", "pdl"):
    try:
        doc = json.load(open(os.path.join(res, f"decode-0.26-{side}", "bench-default.json")))
        row = next(r for r in doc["cases"] if r["case"] == "sensenova_decode_ctx2048_fp8_lmhead")
        ms[side] = row["ours_ms"]
    except (OSError, StopIteration, KeyError, ValueError) as exc:
        print(f"{side}: {exc!r}", file=sys.stderr)
ms = {k: v for k, v in ms.items() if v}
choice = min(ms, key=ms.get) if ms else "before"
# The dependent launch only where it beats the plain prefetch by more than noise (0.5%).
if choice == "pdl" and "prefetch" in ms and ms["pdl"] > ms["prefetch"] * 0.995:
    choice = "prefetch"
print(f"choice {choice} from {ms}", file=sys.stderr)
print(choice)
PY
      cp /tmp/fp8_gemv-today.py vllm_omni_graphdecode/fp8_gemv.py
    fi
    apply_choice
    profile profile-0.26 "$py26"
    ;;
  b)
    unpack
    apply_choice
    suite 200 fp8-tests-0.26 tests/test_sensenova_fp8_gpu.py -q -rfE -s \
      -k "prefetch or lm_head or graph_replay or dequantised_weights_within or copy_computes"
    ;;
  c)
    unpack
    apply_choice
    bench 400 decode-0.30 "$py30" "${decode[@]}" --contexts 2048,512,8192
    profile profile-0.30 "$py30"
    ;;
  d)
    nvidia-smi -L >"$res/gpu-uuid.txt" 2>&1
    apply_choice
    bench 150 decode-0.26 "$py26" "${decode[@]}" --contexts 2048
    bench 250 decode-0.30 "$py30" "${decode[@]}" --contexts 8192,2048
    ;;
esac
finish
