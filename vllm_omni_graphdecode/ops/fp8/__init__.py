"""FP8 (e4m3) copies of a hot path's linear weights (no model): weight-only for decode steps,
through vLLM's Marlin GEMM at 1-16 rows (the batched step) or the plugin's one-row GEMV
(``gemv.py``, the one-request step), and W8A8 (``w8a8.py``) for the many-row GEMMs of a
denoising step. ``quant.py``: the e4m3 rounding every copy shares; ``marlin.py``: vLLM's Marlin
GEMM; ``linears.py``: the per-layer linears of a decode step, which choose between the two.

Decode (``Fp8Weight``, ``Fp8Linears``).

Why: a decode step at 1-16 rows is bound by the bytes of its weights. On the H200 the 42 layers
of the measured decode step's GEMVs read 16.2 GB in bf16 and take 4.59 ms as one graph; with e4m3
weights they read half. Measured there, the same chain as one graph at 1 / 8 / 16 rows
(``benchmarks/probes/fp8_gemv.py``, ``benchmarks/results/h200-2026-12-01f/fp8-probe-0.26``), ms:

    cuBLAS bf16                                     4.59 / 4.84 / 4.62   (relative error 0)
    vLLM Marlin W8A16 (e4m3 weights, bf16 inputs)   3.31 / 3.33 / 3.38   (2.66%)
    vLLM CUTLASS W8A8, dynamic per-token inputs     3.09 / 3.16 / 3.18   (3.75%)
    torch._scaled_mm W8A8, the same inputs          5.02 / 5.01 / 4.86   (3.74%)
    a hand-written Triton W8A16 (tensor-core tile)  5.15 / 5.85 / 5.10   (2.65%)

Marlin is what runs at 2-16 rows: the activations stay bf16 (only the weights' rounding changes,
error 2.66% of a layer's output against 3.75% when the inputs are quantised too), 7% behind
CUTLASS W8A8 and well-kept by vLLM. The hand-written tensor-core kernel above was slower than
cuBLAS and is not used. At one row a plain GEMV beats them all: ``gemv.py`` (hand-written, bf16
activations, the same copies' values), 2.44 ms for the chain against Marlin's 3.31
(``h200-2026-12-01h``); it runs where no batched step shares the copies
(``Fp8Linears(one_row=True)``). Marlin's
configuration is chosen from the shape by fixed rules (no timing at load) and its reduction
across thread blocks runs in a fixed order (``use_atomic_add`` stays off, vLLM's default), so
every process rounds a request the same way (a configuration tuned by timing could differ
between processes, and with it a request's rounding); a step at a fixed row count
(the batched step's 16 rows) computes each row the same whatever the others hold.

Quantisation: per output channel (one scale a weight row, ``amax / 448``), once, when the step
is built, from the layer's bf16 weight, which stays where it is: prefill, the eager fallbacks,
the unquantised step modes and LoRA still read it, so the copies cost half the bf16 bytes of the
layers they cover (``Fp8Linears.nbytes``). A copy remembers its source's storage and version and
is made again when the weight was replaced or written (sleep level 2 and wake-up, an update).
"""
