"""Kernels and which one runs: attention (``attention.py``), vllm's fused layer ops
(``layer_ops.py``), Inductor's batch-1 GEMVs (``gemv.py``) and the FP8 weight copies (``fp8/``).
No model: a hook passes its shapes and tables down."""
