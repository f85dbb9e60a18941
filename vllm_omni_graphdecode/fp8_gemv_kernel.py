"""The Triton source of ``fp8_gemv.gemv`` (HAND-WRITTEN; why, and what it guarantees, are in
``fp8_gemv.py``). Imported on the first call, so that importing the plugin needs no Triton.

``PREFETCH`` (0, 1 or 2) is how many weight blocks a program keeps loading ahead of the one it
multiplies. At one row a GEMV program's time is its loads' round trips: with ``PREFETCH=0`` each
loop step waits for its own block, so a 4,096-wide row of 1,024-byte steps waits four times in a
row, and the whole grid keeps ~4 MB in flight where the H200 needs ~6 (bandwidth x latency).
Prefetching keeps the next blocks' loads in flight while one is multiplied. It changes no
rounding: each program adds the same products to the same accumulator in the same order, so a
config's outputs are the same bits whatever its ``PREFETCH`` (``tests/test_fp8.py`` under the
interpreter, ``tests/test_sensenova_fp8_gpu.py`` on the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch (Triton 3.4+): the kernel may start before the one before
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - an older Triton: ``PDL_SUPPORTED`` says so
    gdc_wait = None
PDL_SUPPORTED = gdc_wait is not None


@triton.jit
def _load_w(w_ptrs, n_mask, EVEN_N: tl.constexpr):
    """One whole [BLOCK_N, BLOCK_K] weight block."""
    if EVEN_N:
        return tl.load(w_ptrs, eviction_policy="evict_first")
    return tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")


@triton.jit
def _load_x(x_ptrs, K, SILU_MUL: tl.constexpr):
    """A block's BLOCK_K inputs: gate and up with ``SILU_MUL``, else the input twice (``up``
    unused)."""
    x = tl.load(x_ptrs)
    if SILU_MUL:
        up = tl.load(x_ptrs + K)
    else:
        up = x
    return x, up


@triton.jit
def _accumulate(acc, w, x, up, SILU_MUL: tl.constexpr):
    """``acc + w * x`` elementwise in fp32; with ``SILU_MUL`` the input is ``silu(x) * up``
    rounded to the inputs' dtype, as vLLM's ``silu_and_mul`` would have written it."""
    if SILU_MUL:
        gate = x.to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(up.dtype)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def fp8_gemv(x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, out_ptr, N, K, stride_xm, stride_wn,
             stride_rm, stride_om, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
             HAS_RESIDUAL: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
             PDL: tl.constexpr):
    # out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]) (+ res[m, n]): program
    # (pid_n, m). The [BLOCK_N, BLOCK_K] products accumulate elementwise in fp32 over K and are
    # summed once at the end, so a row's order depends on the block sizes only. PREFETCH > 0
    # needs EVEN_K and at least PREFETCH blocks (``fp8_gemv.gemv`` passes 0 otherwise).
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + row * stride_xm + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH == 0:
        if PDL:
            gdc_wait()
        for start in range(0, K, BLOCK_K):
            if EVEN_K:
                w = _load_w(w_ptrs, n_mask, EVEN_N)
                x, up = _load_x(x_ptrs, K, SILU_MUL)
            else:
                k_mask = start + offs_k < K
                x = tl.load(x_ptrs, mask=k_mask, other=0.0)
                if SILU_MUL:
                    up = tl.load(x_ptrs + K, mask=k_mask, other=0.0)
                else:
                    up = x
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                            eviction_policy="evict_first")
            acc = _accumulate(acc, w, x, up, SILU_MUL)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    elif PREFETCH == 1:
        w0 = _load_w(w_ptrs, n_mask, EVEN_N)
        if PDL:
            # Launched while the kernel before it finishes: everything up to here reads only
            # this layer's weight, which no kernel of the step writes (a refresh writes it
            # before the scale and bias copies, each a kernel of its own); the inputs, the
            # residual and the output wait for the kernel before to complete.
            gdc_wait()
        x0, u0 = _load_x(x_ptrs, K, SILU_MUL)
        for start in range(BLOCK_K, K, BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w1 = _load_w(w_ptrs, n_mask, EVEN_N)
            x1, u1 = _load_x(x_ptrs, K, SILU_MUL)
            acc = _accumulate(acc, w0, x0, u0, SILU_MUL)
            w0, x0, u0 = w1, x1, u1
        acc = _accumulate(acc, w0, x0, u0, SILU_MUL)
    else:
        w0 = _load_w(w_ptrs, n_mask, EVEN_N)
        w1 = _load_w(w_ptrs + BLOCK_K, n_mask, EVEN_N)
        if PDL:
            gdc_wait()  # as in PREFETCH 1: only weights before it
        x0, u0 = _load_x(x_ptrs, K, SILU_MUL)
        x1, u1 = _load_x(x_ptrs + BLOCK_K, K, SILU_MUL)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        for start in range(2 * BLOCK_K, K, BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w2 = _load_w(w_ptrs, n_mask, EVEN_N)
            x2, u2 = _load_x(x_ptrs, K, SILU_MUL)
            acc = _accumulate(acc, w0, x0, u0, SILU_MUL)
            w0, x0, u0 = w1, x1, u1
            w1, x1, u1 = w2, x2, u2
        acc = _accumulate(acc, w0, x0, u0, SILU_MUL)
        acc = _accumulate(acc, w1, x1, u1, SILU_MUL)
    out = tl.sum(acc, axis=1) * tl.load(scale_ptr + offs_n, mask=n_mask, other=1.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out = out.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:  # residual + out as two bf16 tensors add: one more rounding
        res = tl.load(res_ptr + row * stride_rm + offs_n, mask=n_mask, other=0.0)
        out = (res.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_om + offs_n, out, mask=n_mask)
