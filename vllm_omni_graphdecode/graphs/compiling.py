"""torch.compile pieces shared by the hooks' fast step bodies (a cached diffusion step, a denoising
step): whether Inductor can build for a device, the backend object that
counts what it compiles, the error a failed compile becomes, a stride fix Dynamo needs, and
``Regions``: a body's plain functions and their compiled versions, made once per process.

A fast body is plain functions of tensors (weights are arguments, so nothing per module is
guarded), called around an uncompiled attention kernel::

    REGIONS = Regions(pre_attention, post_attention)            # module level, once
    pre, post = REGIONS.select(device, compile=True, emulate_precision_casts=True)
    q, k, v = pre(...)      # a compile or recompile that fails raises CompileFailed
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable

import torch

from ..core.reasons import Reason

Tensor = torch.Tensor

NO_COMPILE = Reason("torch.compile unavailable", "use torch >= 2.5 on a Python that Dynamo supports")
NO_TRITON = Reason("Triton unavailable for this GPU", "install the triton that matches torch (sm_70+)")
NO_CXX = Reason("no C++ compiler for Inductor's CPU backend", "install g++ or set CXX")
COMPILE_FAILED = Reason("torch.compile of the fast step body failed",
                        "report the logged error (with `python -m vllm_omni_graphdecode doctor`); "
                        "the exact step runs from then on, every shape, until sleep level 2 "
                        "(release_captured_graphs) or a change to the model lets it compile again")



def triton_kernel(define: Callable) -> Callable:
    """For a hand-written Triton kernel: ``define(triton, tl)`` returns the ``@triton.jit``
    function. Returns a function that imports Triton and defines the kernel at its first call,
    then hands out that kernel: the module holding it imports without Triton, and
    ``TRITON_INTERPRET=1`` set before that first call runs it on CPU tensors."""
    @functools.cache
    def kernel():
        import triton
        import triton.language as tl

        return define(triton, tl)

    return kernel

# Inductor's options for every fast body. ``emulate_precision_casts``: a fused kernel rounds to
# bf16 where eager materialises a bf16 tensor. ``deterministic``: each reduction's configuration
# (block sizes, warps: its sum order) fixed by Inductor's heuristics, never picked by timing at the
# first call, so every process rounds a request alike. Tuned by timing, two machines serving the
# same eight think requests with the same think tokens gave other image bits
# (benchmarks/results/h200-2026-12-02e, -02f).
FAST_BODY_OPTIONS = {"emulate_precision_casts": True, "deterministic": True}


class CompileFailed(RuntimeError):
    """torch.compile cannot run here, or could not compile (or recompile) a fast-body region.
    ``reason`` says which; the caller runs the exact step and counts it."""

    def __init__(self, reason: Reason):
        super().__init__(reason.describe())
        self.reason = reason


def dense_strides(t: Tensor) -> Tensor:
    """``t`` with a fresh tensor's strides, without a copy when its memory is contiguous. Dynamo
    guards on strides, size-1 dims included, and a batch-1 slice of ``img_in``'s output has a
    batch stride set by the reference images' token count: a prefix length in disguise."""
    if not t.is_contiguous():
        return t.contiguous()
    return t.as_strided(t.shape, torch.empty(t.shape, device="meta").stride())


class Inductor:
    """Inductor as a torch.compile backend, counting the graphs it compiles. One per option set
    and body, process-wide: Dynamo guards on the backend object, so sharing it shares the
    compiled code."""

    def __init__(self, options: dict):
        self.options = options
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        with config.patch(self.options):
            return compile_fx(gm, example_inputs)


def compile_supported(device) -> Reason | None:
    """Why torch.compile cannot build a fast step body for ``device``; None when it can."""
    device = torch.device(device)
    try:
        import torch._dynamo as dynamo
        import torch._inductor.config as inductor_config

        if not dynamo.is_dynamo_supported():
            return NO_COMPILE.because(f"Dynamo does not support Python {sys.version.split()[0]}")
    except Exception as exc:
        return NO_COMPILE.because(repr(exc)[:300])
    for option in FAST_BODY_OPTIONS:
        if not hasattr(inductor_config, option):
            return NO_COMPILE.because(f"torch {torch.__version__}'s Inductor lacks {option}")
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else NO_TRITON.because(f"torch {torch.__version__}")
    if device.type == "cpu":
        found = any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "c++", "clang++"))
        return None if found else NO_CXX.because("no g++, c++, clang++ or $CXX on PATH")
    return NO_COMPILE.because(f"device type {device.type}")


def dynamo_errors() -> tuple[type, ...]:
    """What a compiled region raises when Dynamo cannot compile or recompile it."""
    import torch._dynamo.exc as dynamo_exc

    # FailOnRecompileLimitHit (torch >= 2.6) is not a TorchDynamoException.
    return tuple(filter(None, (dynamo_exc.TorchDynamoException,
                               getattr(dynamo_exc, "FailOnRecompileLimitHit", None))))


def call_compiled(fn, errors: tuple[type, ...], *args):
    """``fn(*args)``, a compile error turned into ``CompileFailed`` (the caller's exact step)."""
    try:
        return fn(*args)
    except errors as exc:
        raise CompileFailed(COMPILE_FAILED.because(repr(exc)[:500])) from exc


class Regions:
    """A fast body's regions: its plain functions (``plain``) and, per Inductor option set, their
    compiled versions (fullgraph, static shapes) sharing one counting backend, made on first use
    and kept for the process (Dynamo guards on the backend object, so every caller with the same
    options shares the compiled code)."""

    def __init__(self, *fns: Callable):
        self.plain = fns
        self._made: dict[tuple, tuple[Inductor, tuple[Callable, ...]]] = {}

    def select(self, device, *, compile: bool, **options) -> tuple[Callable, ...]:
        """The functions a body calls on ``device``: the compiled ones, each turning a failed
        compile or recompile into ``CompileFailed``, or with ``compile=False`` the plain ones.
        Raises ``CompileFailed`` when ``compile_supported(device)`` says no."""
        if not compile:
            return self.plain
        found = compile_supported(device)
        if found is not None:
            raise CompileFailed(found)
        key = tuple(sorted(options.items()))
        if key not in self._made:
            backend = Inductor(options)
            self._made[key] = (backend, tuple(
                torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
                for fn in self.plain))
        errors = dynamo_errors()
        return tuple(functools.partial(call_compiled, fn, errors) for fn in self._made[key][1])

    def compiled_graphs(self) -> int:
        """Graphs Inductor compiled for these regions in this process (first compiles and
        recompiles)."""
        return sum(backend.graphs for backend, _ in self._made.values())
