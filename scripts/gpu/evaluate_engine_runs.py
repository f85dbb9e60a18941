#!/usr/bin/env python3
"""Evaluate tests/test_e2e_engine_gpu.py's assertions on engine runs already made.

    python3 scripts/gpu/evaluate_engine_runs.py DIR

DIR is what the engine file's runs wrote under GRAPHDECODE_E2E_OUT (CASE.log and CASE/ with its
result.json, images and stats files, for each of the file's cases). A device call cut by its time
limit after the four engine runs had finished, and before pytest reached its assertions, still
brings that folder back; this runs the same test functions on it, on any machine without a GPU
(it imports the test file: pytest and numpy). The runners' exit statuses are in DIR/summary.json
only when the file's fixture finished; without it, `test_engine_serves_both_models` checks each
model's result entry and says that the status was not evaluated. Prints one line per test case
and exits 1 if any failed.
"""
import inspect
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def load_runs(base, cases):
    """The fixture's `runs`, from the folder. Returns (runs, statuses_known)."""
    summary_path = os.path.join(base, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else None
    runs = {}
    for name in cases:
        result = os.path.join(base, name, "result.json")
        log_path = os.path.join(base, f"{name}.log")
        log = open(log_path).read() if os.path.exists(log_path) else ""
        rc = summary[name]["rc"] if summary and name in summary else 0
        runs[name] = {"name": name, "rc": rc, "log": log, "log_path": log_path,
                      "result": json.load(open(result)) if os.path.exists(result) else None,
                      "dir": os.path.join(base, name), "seconds": None}
    return runs, summary is not None


def main(argv):
    if len(argv) != 1:
        print(__doc__)
        return 2
    import test_e2e_engine_gpu as t

    runs, statuses_known = load_runs(argv[0], t.CASES)
    if not statuses_known:
        print("NOTE: no summary.json: the runners' exit statuses are not evaluated")
    passed = failed = 0
    for name, fn in sorted(vars(t).items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        argname, values = (marks[0].args[0], list(marks[0].args[1])) if marks else (None, [None])
        ids = marks[0].kwargs.get("ids") if marks else None
        for index, value in enumerate(values):
            kwargs = {"runs": runs} if "runs" in inspect.signature(fn).parameters else {}
            if argname:
                kwargs[argname] = value
            label = f"{name}[{ids[index] if ids else value}]" if argname else name
            try:
                fn(**kwargs)
            except Exception as exc:  # an assertion, or what the test's own code raised
                failed += 1
                print(f"FAILED {label}: {str(exc).splitlines()[0][:300]}")
            else:
                passed += 1
                print(f"PASSED {label}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
