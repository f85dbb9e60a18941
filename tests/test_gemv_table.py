"""scripts/gpu/gemv_table.py: a GEMV sweep's picks become ``gemv_table.MEASURED``'s entries."""

import json
import os
import subprocess
import sys

from vllm_omni_graphdecode.ops.fp8 import gemv as fp8_gemv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(n, k, pick, today_us=9.5, pick_us=7.25):
    return {"shape": [n, k], "floor_us": 5.88, "pick": {"config": pick, "us": pick_us},
            "config_for": {"config": {}, "us": today_us}}


def test_gemv_table_writes_each_pick_into_measured(tmp_path):
    sweep = {
        "qkv": _row(6144, 4096, {"block_n": 16, "block_k": 512, "num_warps": 8, "num_stages": 1}),
        "lm_head": _row(151936, 4096, {"block_n": 32, "block_k": 1024, "num_warps": 4,
                                       "num_stages": 2}),
    }
    doc = tmp_path / "fp8-gemv.json"
    doc.write_text(json.dumps({"gemv_sweep": sweep}))
    source = tmp_path / "gemv_table.py"
    original = open(os.path.join(ROOT, "vllm_omni_graphdecode", "hooks", "sensenova_u1",
                                 "gemv_table.py")).read()
    source.write_text(original)
    args = [str(doc), str(source)]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu", "gemv_table.py"),
                           *args], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    text = source.read_text()
    # Only the table's entries changed, and they are exactly the picks.
    head, _, rest = text.partition("MEASURED = {\n")
    body, _, tail = rest.partition("\n}")
    assert head == original.partition("MEASURED = {\n")[0]
    assert tail == original.partition("MEASURED = {\n")[2].partition("\n}")[2]
    table = eval("{\n" + body + "\n}", {"KernelConfig": fp8_gemv.KernelConfig})  # noqa: S307
    assert table == {
        (6144, 4096): fp8_gemv.KernelConfig(16, 512, 8, 1),
        (151936, 4096): fp8_gemv.KernelConfig(32, 1024, 4, 2)}
    assert "# qkv 7.25 (was 9.5, floor 5.88)" in body


def test_gemv_table_refuses_a_file_without_the_table(tmp_path):
    doc = tmp_path / "fp8-gemv.json"
    doc.write_text(json.dumps({"gemv_sweep": {}}))
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu", "gemv_table.py"),
                           str(doc), str(other)], capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "no `MEASURED" in proc.stderr
    assert other.read_text() == "x = 1\n"
