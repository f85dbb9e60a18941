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

A committed results folder keeps the runs' logs and arrays in its raw.tar.xz
(scripts/pack_results.py): DIR may name a folder inside it, e.g.
benchmarks/results/h200-2026-12-02c/s2/suite-engine-1/e2e, and is read from there.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from pack_results import materialized  # noqa: E402


def main(argv):
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    with materialized(argv[0]) as runs:
        env = dict(os.environ, GRAPHDECODE_E2E_FROM=os.path.abspath(runs))
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
               os.path.join(ROOT, "tests", "test_e2e_engine_gpu.py"), *argv[1:]]
        return subprocess.call(cmd, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
