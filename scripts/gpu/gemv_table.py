#!/usr/bin/env python3
"""Write a GEMV sweep's picks into ``gemv_table.MEASURED`` (the one-row FP8 GEMV's fixed configs).

    python3 scripts/gpu/gemv_table.py RESULTS/fp8-gemv.json \
        [vllm_omni_graphdecode/hooks/sensenova_u1/gemv_table.py]

The sweep (``benchmarks/probes/fp8_gemv.py --gemv-sweep``) names a ``pick`` per shape; this
rewrites the entries between ``MEASURED = {`` and its closing ``}``, one line per shape with the
pick's time, today's and the byte floor (us per layer, at one row), and prints the new table. The
configs stay fixed in the source: nothing is timed at load (``ops/fp8/gemv.py``'s ``config_for``).
"""

import json
import re
import sys

DEFAULTS = {"num_stages": 1}  # KernelConfig's defaults, left out of an entry


def entry(name: str, row: dict) -> str:
    cfg = row["pick"]["config"]
    args = ", ".join(f"{key}={value}" for key, value in cfg.items()
                     if DEFAULTS.get(key, object()) != value)
    n, k = row["shape"]
    return (f"    ({n}, {k}): KernelConfig({args}),  # {name} {row['pick']['us']} "
            f"(was {row['config_for']['us']}, floor {row['floor_us']})")


def main(argv) -> int:
    doc = json.load(open(argv[1]))
    path = argv[2] if len(argv) > 2 else "vllm_omni_graphdecode/hooks/sensenova_u1/gemv_table.py"
    source = open(path).read()
    sweep = doc["gemv_sweep"]
    body = "\n".join(entry(name, row) for name, row in sweep.items())
    new, count = re.subn(r"(MEASURED = \{\n)(.*?)(\n\})", lambda m: m.group(1) + body + m.group(3),
                         source, count=1, flags=re.S)
    if count != 1:
        print(f"{path}: no `MEASURED = {{ ... }}` block found", file=sys.stderr)
        return 1
    open(path, "w").write(new)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
