#!/usr/bin/env bash
# Set up the pinned environment (first run: several minutes) and run the test suite.
# Extra arguments go to pytest. GPU tests are collected and skipped with their reason on CPU.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$here/scripts/setup_env.sh" | tail -n 1)
cd "$here"
set +e
"$venv/bin/python" -m pytest -ra "$@"
rc=$?
set -e
# Exit code 5 means pytest collected no test at all: for this suite that is a broken checkout or
# a bad -k/path filter, never a pass.
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests (exit 5); treating that as a failure" >&2
  exit 1
fi
exit "$rc"
