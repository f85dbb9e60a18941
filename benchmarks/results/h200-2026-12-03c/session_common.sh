# A record: scripts/gpu/session_common.sh as the session scripts of h200-2026-12-01i ...
# h200-2026-12-03c sourced it; scripts/gpu/run.py does its work now.
# Sourced by a session script (scripts/gpu/*_session.sh) after it sets `what` (its step's name):
# the results folder /tmp/res-$what, the environment every GPU run here uses, and the helpers
#   suite LIMIT DIR TESTS [pytest args...]   one or more GPU test files through run_suite.sh
#   bench LIMIT DIR PYTHONPATH [bench.py args...]
#   request LIMIT DIR PYTHONPATH [sensenova_request.py args...]
#                                            one whole think text-to-image request at the
#                                            real shape, the release beside the plugin
#   unpack                                   every carried .gpu-bundle* into /tmp/site*
#   warm_fa2_213                             FA2's first call in the background, once torch 2.13
#                                            and the 0.30 tree are unpacked
#   on213 COMMAND...                         COMMAND on the 0.30 stack with torch 2.13
#   reap                                     what a cut engine or serving test left running
#                                            (after each suite; GRAPHDECODE_REAP=0: not, for
#                                            suites run side by side)
#   stamp NAME                               NAME's exit status and the time, in summary.txt;
#                                            what is done so far packed into $OUT
# and the two stacks' PYTHONPATHs, py26 and py30. A step packs $res into $OUT at its end
# (`finish`). The session scripts written before fold_session.sh carry the same lines inline.
: "${OUT:?set by the device tool: the folder whose files come back}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$here"
res=/tmp/res-$what
mkdir -p "$res"
export VLLM_TARGET_DEVICE=cuda CUDA_CACHE_MAXSIZE=4294967296 PYTHONUNBUFFERED=1
nvidia-smi >"$res/nvidia-smi.txt" 2>&1
py26="$here:/tmp/site-project:/tmp/site"
py30="$here:/tmp/site-project:/tmp/site-omni-0.30.0:/tmp/site"
stamp() {
  # NAME's exit status, then everything so far packed into $OUT: a call cut by the tool's limit
  # still brings back each step that finished (one file; folders under $OUT come back only a
  # few levels deep).
  echo "$1: exit $? ($(date +%T))" >>"$res/summary.txt"
  tar czf "$OUT/results-$what.tgz" -C /tmp "res-$what" 2>/dev/null
  true
}
suite() {
  # The engine and serving tests write each run's log into $res/DIR/e2e or serve-out as it goes
  # (unless the caller named a folder), so that a run cut by LIMIT still brings its logs back.
  local limit=$1 dir=$2 tests=$3; shift 3
  mkdir -p "$res/$dir"
  GRAPHDECODE_E2E_OUT="${GRAPHDECODE_E2E_OUT:-$res/$dir/e2e}" \
    GRAPHDECODE_SERVE_OUT="${GRAPHDECODE_SERVE_OUT:-$res/$dir/serve-out}" \
    GRAPHDECODE_TESTS="$tests" timeout "$limit" scripts/gpu/run_suite.sh tests "$res/$dir" -- "$@" \
    >"$res/$dir.out" 2>&1
  stamp "$dir"
  [ "${GRAPHDECODE_REAP:-1}" = 0 ] || reap
}
reap() {
  # The engine runners and servers run in sessions of their own, out of reach of `timeout`'s
  # kill: after a cut, they (and the workers they spawned) went on beside the next step (in
  # h200-2026-12-02, p4's engine runs beside its request benchmark). Kill each one's group.
  local pid group mine
  mine=$(ps -o pgid= -p $$ | tr -d ' ')
  for pid in $(pgrep -f "$here/tests/e2e_|--omni"); do
    group=$(ps -o pgid= -p "$pid" | tr -d ' ')
    if [ -n "$group" ] && [ "$group" != "$mine" ]; then
      kill -9 -- "-$group" 2>/dev/null
    fi
  done
  true
}
bench() {
  local limit=$1 dir=$2 pp=$3; shift 3
  mkdir -p "$res/$dir"
  PYTHONPATH=$pp timeout "$limit" python3 benchmarks/bench.py --out "$res/$dir" "$@" \
    >"$res/$dir/stdout.json" 2>"$res/$dir/log"
  stamp "$dir"
}
request() {
  local limit=$1 dir=$2 pp=$3; shift 3
  mkdir -p "$res/$dir"
  PYTHONPATH=$pp timeout "$limit" python3 benchmarks/sensenova_request.py --out "$res/$dir" \
    --size 1024 --steps 50 --cfg 4 --think both --denoise fast --no-audit "$@" \
    >"$res/$dir/stdout.jsonl" 2>"$res/$dir/stderr.log"
  stamp "$dir"
}
unpack() {
  for u in .gpu-bundle*/unpack.py; do python3 "$u" >>"$res/unpack.log" 2>&1; done
}
warm_fa2_213() {
  # Once torch 2.13 and the 0.30 tree are unpacked, vllm-omni 0.30's FA2 compiles its PTX in the
  # background (its first call on a machine: 96-129 s), once per machine; log /tmp/warm-fa2.log.
  if [ -f /tmp/site-torch-2.13.0/.bundle-state.json ] && [ -d /tmp/site-omni-0.30.0 ] \
      && [ ! -f /tmp/warm-fa2.started ]; then
    touch /tmp/warm-fa2.started
    (on213 setsid nohup python3 scripts/gpu/warm_fa2.py >/tmp/warm-fa2.log 2>&1 &)
  fi
}
on213() {  # on213 COMMAND...: COMMAND on the 0.30 stack with torch 2.13, in a subshell
  (site=/tmp/site && source scripts/gpu/torch213_env.sh \
    && PYTHONPATH=$torch_site:$here:/tmp/site-project:$omni_site:$site "$@")
}
finish() {
  tar czf "$OUT/results-$what.tgz" -C /tmp "res-$what"
  cat "$res/summary.txt"
}
echo "start $(date +%T)" >"$res/summary.txt"
