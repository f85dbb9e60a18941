"""Test scaffolding no one model owns: vllm-omni's version, LoRA adapters bound into vllm-omni's
LoRA wrappers, a lock that says when someone blocks on it, and the settings a whole GPU run puts
under every test's own."""

from __future__ import annotations

import os
import threading
from typing import Mapping

import torch

from .. import config

# Test-only, not a product setting: the GPU tests build their configuration from dicts, so the
# product's own variable in the environment changes nothing there. This one runs every test that
# leaves SenseNova-U1's decode step to the default in the named mode (e.g. rowgemv), to see
# whether that mode may become the default.
SUITE_STEP_VAR = "GRAPHDECODE_TEST_SENSENOVA_STEP"


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


def suite_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings a whole GPU run puts under every test's own: ``{}`` unless
    ``GRAPHDECODE_TEST_SENSENOVA_STEP`` is set, then the decode step it names. A value the
    product setting refuses raises ``config.ConfigError`` (a ValueError) naming it and what is
    accepted."""
    environ = os.environ if environ is None else environ
    raw = environ.get(SUITE_STEP_VAR, "").strip()
    if not raw:
        return {}
    step = next(s for s in config.SETTINGS if s.var == config.SENSENOVA_STEP_VAR)
    return {config.SENSENOVA_STEP_VAR: step.parse(SUITE_STEP_VAR, raw)}


def with_suite_overrides(values: Mapping[str, str]) -> dict[str, str]:
    """``values`` over ``suite_overrides()``: a test that names its own step mode keeps it."""
    return {**suite_overrides(), **values}
