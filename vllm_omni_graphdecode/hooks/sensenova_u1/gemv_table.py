"""SenseNova-U1's block sizes for the one-row FP8 GEMV (``ops/fp8/gemv.py``), per weight shape:
what the hook hands ``Fp8Linears`` (``gemv_table=MEASURED``); a shape not here takes the GEMV's
shape rule (``config_for``). Written by ``scripts/gpu/gemv_table.py`` from a sweep
(``benchmarks/probes/fp8_gemv.py --gemv-sweep``); fixed here, never re-timed at load."""

from __future__ import annotations

from ...ops.fp8.gemv import KernelConfig

# SenseNova-U1's decode shapes (N, K) -> the fastest block sizes of a sweep at one row on the
# H200 (``benchmarks/probes/fp8_gemv.py --gemv-sweep``,
# benchmarks/results/h200-2026-12-01h/fp8-probe-sweep-0.26, us per layer: best / the shape rule
# (config_for) / byte floor).
MEASURED = {
    (6144, 4096): KernelConfig(block_n=16, block_k=512, num_warps=8),    # qkv 8.69 / 9.58 / 5.88
    (4096, 4096): KernelConfig(block_n=8, block_k=1024, num_warps=4),    # o 6.71 / 8.36 / 3.92
    (24576, 4096): KernelConfig(block_n=32, block_k=512, num_warps=8),   # gate_up 27.62 / 28.03 / 23.52
    (4096, 12288): KernelConfig(block_n=8, block_k=1024, num_warps=4),   # down 14.87 / 20.73 / 11.76
}

# The bf16 row GEMV's block sizes (``ops/row_linears.py``, ``..._SENSENOVA_STEP=rowgemv``), per
# weight shape. Empty: every shape takes the shape rule (``config_for``), which the sweep on an
# H100 (``benchmarks/probes/fp8_gemv.py --bf16-gemv``, benchmarks/results/h100-2026-12-05d)
# found within 1-3% of the best configuration at every shape. An H200 sweep may fill it.
ROW_BF16: dict = {}
