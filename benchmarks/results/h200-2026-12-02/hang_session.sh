#!/usr/bin/env bash
# A record: this ran as scripts/gpu/hang_session.sh for the session of this folder (its README).
# It sourced scripts/gpu/session_common.sh (its last version: h200-2026-12-03c/); a new
# session runs scripts/gpu/run.py instead (scripts/gpu/README.md).
# The follow-up GPU runs to pool_session.sh (results h200-2026-12-02): one machine, three device
# calls in a row, each result packed into $OUT/results-STEP.tgz:
#
#   scripts/gpu/hang_session.sh h1   # .gpu-bundle arrives (unpacked)
#   scripts/gpu/hang_session.sh h2   # .gpu-bundle-2 arrives (unpacked)
#   scripts/gpu/hang_session.sh h3   # .gpu-bundle-3; two runs side by side:
#     - 0.26: the decode file's capture tests (the failed capture, the dead graph collected
#       during a capture, the token loop's launches), with the two fixes of this session;
#     - 0.30: the decode file whole, with pytest's faulthandler dumping every thread's stack
#       when a test runs past 40 s (pool_session.sh p3 saw it stop at its 14th test, whose
#       reference run is vllm-omni 0.30's in-tree decode, for over a minute).
#
# carry: h1 [.gpu-bundle], h2 [.gpu-bundle-2], h3 [.gpu-bundle-3]. The two runs of h3 install
# the project's metadata into two folders, so that they do not race (run_suite.sh).
set -uo pipefail
what=${1:?usage: hang_session.sh h1|h2|h3}
source "$(dirname "$0")/session_common.sh"
case "$what" in
  h1|h2)
    unpack
    ;;
  h3)
    unpack
    # Side by side, so no `reap` (session_common.sh, added after this ran): one would kill the
    # other's engines; neither file starts one.
    export GRAPHDECODE_REAP=0
    GRAPHDECODE_SITE_PROJECT=/tmp/site-project-026 \
      suite 170 suite-0.26-capture tests/test_sensenova_gpu.py -q -rfE --durations=0 \
      -k "capture or dead_graph or token_loop" &
    STACK=0.30 suite 190 suite-0.30-decode tests/test_sensenova_gpu.py -q -rfE --durations=0 \
      -o faulthandler_timeout=40
    wait
    ;;
esac
finish
