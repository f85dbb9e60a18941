#!/usr/bin/env python3
"""Evaluate tests/test_e2e_engine_gpu.py's assertions on engine runs already made.

    python3 scripts/gpu/evaluate_engine_runs.py DIR [pytest args...]

DIR is what the engine file's runs wrote under GRAPHDECODE_E2E_OUT (CASE.log and CASE/ with its
result.json, images and stats files, for each of the file's cases). A device call cut by its time
limit after the four engine runs had finished, and before pytest reached its assertions, still
brings that folder back; this runs the test file on it with GRAPHDECODE_E2E_FROM=DIR, which
starts no engine and needs no GPU. The runners' exit statuses are in DIR/summary.json only when
the file's fixture finished; without it, `test_engine_serves_both_models` checks each model's
result entry and skips the status check, saying so. Exits with pytest's status.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv):
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    env = dict(os.environ, GRAPHDECODE_E2E_FROM=os.path.abspath(argv[0]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           os.path.join(ROOT, "tests", "test_e2e_engine_gpu.py"), *argv[1:]]
    return subprocess.call(cmd, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
