"""vllm-omni-graphdecode: paged-KV + CUDA-graph decode for vLLM-Omni's SenseNova-U1 and
Qwen-Image-2.1, wired in at model load.

``register()`` is the entry point under both ``vllm.general_plugins`` and
``vllm_omni.general_plugins``. It runs in every vllm/vllm-omni process, twice in one process from
vllm-omni 0.26 on, so it is idempotent, imports no model code, touches no CUDA, and does nothing
unless ``VLLM_OMNI_GRAPHDECODE`` enables it.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from . import config

    cfg = config.get()  # a bad value raises here, at start-up, naming the variable
    _registered = True
    if not cfg.enabled:
        return
    from .core import loading

    loading.install()
