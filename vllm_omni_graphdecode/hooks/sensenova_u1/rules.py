"""Why a SenseNova-U1 request cannot take the paged graph path: the hook's one gate.

``verdict(pipeline, language_model, found)`` returns (the first reason that applies or None,
whether LoRA wrappers are present) from the pipeline's configuration, read at every request (the
think or text loop's start, or a batched forward), and one walk of the language model
(``eligibility.scan``), which the wiring hands in: walked once, then again only after its
``eligibility.Watch`` saw a change (``wiring.py``, ``denoise.py``), so offload, hooks, LoRA or
compile applied after load are seen by the next request; nothing is checked per decode step.
Each reason is a ``Reason`` with its hint; the request then runs the pipeline's own eager code and
the reason is counted and logged once. ``gate`` is the reason alone, with the paged kernel's.
"""

from __future__ import annotations

from ...core import eligibility
from ...core.reasons import COMPILED, HOOKS, OFFLOAD, PARALLEL, QUANT_KV, Reason

# The shared reasons under the names this hook has always exported; the detail says which case.
TP = PARALLEL  # tensor parallel > 1: the captured step would hold collectives
KV_QUANT = QUANT_KV  # the paged kernel reads the cache unquantized
HOOKED = HOOKS

__all__ = ["COMPILED", "HOOKED", "KV_QUANT", "OFFLOAD", "TP", "gate", "lora_present", "verdict"]

_OFFLOAD_FLAGS = ("enable_cpu_offload", "enable_layerwise_offload",
                  "enable_distributed_layerwise_offload")


def _tensor_parallel(pipe) -> int:
    tp = getattr(getattr(getattr(pipe, "od_config", None), "parallel_config", None),
                 "tensor_parallel_size", 1) or 1
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp = max(tp, get_tensor_model_parallel_world_size())
    except Exception:  # no process group in this process: nothing is sharded by vllm
        pass
    return tp


def verdict(pipe, lm, found: eligibility.Structure | None = None) -> tuple[Reason | None, bool]:
    """(The first reason this pipeline's requests run eagerly now, or None; whether dynamic LoRA
    wrappers are present), from ``found``: ``eligibility.scan(lm)``, walked here when None."""
    tp = _tensor_parallel(pipe)
    if tp > 1:
        return TP.because(f"tensor parallel size {tp}"), False
    od = getattr(pipe, "od_config", None)
    flags = [f for f in _OFFLOAD_FLAGS if getattr(od, f, False)]
    if flags:
        return OFFLOAD.because(", ".join(flags)), False
    if found is None:
        found = eligibility.scan(lm, "language_model")
    lora = found.lora is not None
    if found.offload:
        return OFFLOAD.because(found.offload), lora
    if found.compiled:
        return COMPILED.because(found.compiled), lora
    dtype = getattr(od, "diffusion_kv_cache_dtype", None)
    if dtype not in (None, "auto", "float"):
        return KV_QUANT.because(f"kv_cache_dtype={dtype}"), lora
    if found.kv_cache_dtype is not None:
        return KV_QUANT.because(f"kv_cache_dtype={found.kv_cache_dtype}"), lora
    if found.hooks:
        return HOOKED.because(found.hooks), lora
    return None, lora


def gate(pipe, lm, kernel) -> Reason | None:
    """The first reason this pipeline's requests run eagerly now, or None. ``kernel`` is what
    ``attention.select_kernel`` found: a kernel, or its own ``Reason`` (None: not asked)."""
    if isinstance(kernel, Reason):
        return kernel
    return verdict(pipe, lm)[0]


def lora_present(lm) -> bool:
    """True once LoRA wrappers (vLLM's, peft's) are in the language model.

    The wrappers stay in the tree and switch adapters between requests by Python branches (active
    slices) that a capture freezes, invisibly to shape, dtype and bucket. So nothing captured may
    outlive a request then: graphs are captured per request and dropped after.
    """
    return eligibility.scan(lm).lora is not None
