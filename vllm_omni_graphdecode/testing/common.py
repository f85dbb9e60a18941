"""Test scaffolding no one model owns: vllm-omni's version, LoRA adapters bound into vllm-omni's
LoRA wrappers, and a lock that says when someone blocks on it."""

from __future__ import annotations

import threading

import torch


def omni_version() -> str:
    import vllm_omni

    return vllm_omni.__version__


def bind_adapter(wrappers, seed=5, scale=0.5):
    """Bind a random rank-r adapter in slot 0 of every wrapper (what activating an adapter does)."""
    gen = torch.Generator().manual_seed(seed)
    for w in wrappers:
        a = w.lora_a_stacked[0]
        b = w.lora_b_stacked[0]
        rank, n_in, n_out = a.shape[2], a.shape[3], b.shape[2]
        lora_a = (torch.randn(rank, n_in, generator=gen) * scale).to(a.dtype).to(a.device)
        lora_b = (torch.randn(n_out, rank, generator=gen) * scale).to(b.dtype).to(b.device)
        w.set_lora(0, lora_a, lora_b)


def unbind_adapter(wrappers):
    for w in wrappers:
        w.reset_lora(0)


class ObservedLock:
    """A lock that says when someone blocks on it: ``waiting`` is set by the first acquire that
    has to wait (tests synchronise on it instead of on time)."""

    def __init__(self, lock=None):
        self._lock = lock if lock is not None else threading.Lock()
        self.waiting = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.waiting.set()
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
