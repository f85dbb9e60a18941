"""One query token per row over paged keys, split along the keys: HAND-WRITTEN Triton, measured
against the libraries in ``benchmarks/attention_kernels.py`` before anything calls it (issue #42).

Why try one: at one token a decode step's attention must read its K/V once, and the kernels the
plugin calls read it well short of that. FA3's paged call costs 9.9-18.2 us at contexts 512-8192
on an H200 (``ops/attention.py``), a split-K/V kernel and a combine, where the 8 MB of K/V at
2,048 keys take ~2 us at copy bandwidth; the batched step's vLLM Triton kernel took 29 us a layer
at 8 rows of 2,048 keys where their bytes take ~17 us (``bench_batch_attention``), in two
launches. Whether this kernel does better is the benchmark's question; until it answers, no step
runs it.

What it computes: for row ``m`` with ``L = seqused[m]`` keys (its block table ``table[m]``, pages
of ``PAGE`` tokens), query head ``h`` reading KV head ``h // GROUP``: softmax(q . k * scale) @ v,
returned in q's dtype. Each (row, KV head) is cut into ``splits`` equal parts of *its own* length
(``ceil(L / splits)`` keys each); one program reads one part once for all ``GROUP`` query heads
of that KV head, keeping an fp32 running maximum, sum and output; the parts are then combined in
split order. With ``one_launch`` the program that finishes a (row, KV head) last (an atomic count
per pair, reset by that program) combines them, so there is no second launch; otherwise a second
launch does. Either way a row's result depends on its own keys and query only, never on the other
rows or on a maximum length (batch-invariant: a row equals itself computed alone), and there is
no host value in the call, so one captured graph serves every length.

Rounding: scores and the running sums in fp32; the probabilities are rounded to the K/V dtype
for the product with V (as vLLM's Triton decode kernel does); one rounding of the output.
``reference`` is the same in plain fp32 torch. Triton's interpreter (``TRITON_INTERPRET=1``
before Triton is imported) runs the kernel on CPU tensors: the CPU tests check it there.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ..graphs.compiling import triton_kernel

MIN_HEADS_TILE = 16  # tl.dot's smallest tile side: a KV head's query heads are padded to it


@dataclasses.dataclass(frozen=True)
class Config:
    splits: int = 16  # parts of each row's keys (fixed for a process: it sets the rounding)
    block_n: int = 64  # keys a loop step reads
    num_warps: int = 4
    num_stages: int = 2
    one_launch: bool = True  # the last program of a (row, KV head) combines its parts


class Workspace:
    """What a call needs besides its inputs, allocated once per shape so that a captured graph
    reads the same buffers: fp32 parts ``(rows, q_heads, splits, head_dim + 1)`` (output, then
    log-sum-exp) and the per-(row, KV head) counts ``one_launch`` keeps (always zero between
    calls)."""

    def __init__(self, rows: int, q_heads: int, kv_heads: int, head_dim: int, splits: int,
                 device):
        self.parts = torch.zeros(rows, q_heads, splits, head_dim + 1, dtype=torch.float32,
                                 device=device)
        self.counts = torch.zeros(rows * kv_heads, dtype=torch.int32, device=device)
        self.splits = splits

    @classmethod
    def over(cls, parts: torch.Tensor, kv_heads: int) -> "Workspace":
        """A workspace whose parts are ``parts`` ``(rows, q_heads, splits, head_dim + 1)``, an
        fp32 buffer the caller keeps (the batched step's scratch), with its own counts."""
        ws = cls.__new__(cls)
        ws.parts = parts
        ws.splits = parts.shape[2]
        ws.counts = torch.zeros(parts.shape[0] * kv_heads, dtype=torch.int32,
                                device=parts.device)
        return ws


def split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    table: torch.Tensor, seqused: torch.Tensor, scale: float,
                    workspace: Workspace, config: Config = Config(),
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q ``(rows, q_heads, d)``; k_cache, v_cache ``(blocks, page, kv_heads, d)``; table
    ``(rows, width)`` int32 block ids; seqused ``(rows,)`` int32 valid keys (at least 1). Returns
    ``(rows, q_heads, d)`` in q's dtype (``out``: written into)."""
    rows, q_heads, d = q.shape
    _, page, kv_heads, d_k = k_cache.shape
    if d_k != d or q_heads % kv_heads or d & (d - 1) or page & (page - 1):
        raise ValueError(f"split_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}: "
                         "want the same power-of-two head size, q heads a multiple of KV heads "
                         "and a power-of-two page")
    if workspace.splits != config.splits or workspace.parts.shape[:2] != (rows, q_heads):
        raise ValueError(f"split_attention: workspace for {tuple(workspace.parts.shape)}, "
                         f"call with {rows} rows, {q_heads} heads, {config.splits} splits")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("split_attention: q and the caches need unit-stride heads and the "
                         "caches one layout")
    group = q_heads // kv_heads
    heads_tile = max(MIN_HEADS_TILE, 1 << (group - 1).bit_length())
    if out is None:
        out = torch.empty_like(q)
    parts = workspace.parts
    args = (q, k_cache, v_cache, table, seqused, parts, workspace.counts, out, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            table.stride(0), parts.stride(0), parts.stride(1), parts.stride(2),
            out.stride(0), out.stride(1))
    kernel, combine = _kernels()
    kernel[(rows, kv_heads, config.splits)](
        *args, GROUP=group, HEADS=heads_tile, HEAD_DIM=d, PAGE=page, BLOCK_N=config.block_n,
        SPLITS=config.splits, ONE_LAUNCH=config.one_launch, WIDE_DOT=_interpreted(),
        num_warps=config.num_warps,
        num_stages=config.num_stages)
    if not config.one_launch:
        combine[(rows, kv_heads)](
            *args, GROUP=group, HEADS=heads_tile, HEAD_DIM=d, SPLITS=config.splits,
            num_warps=config.num_warps)
    return out


def _interpreted() -> bool:
    # Triton's interpreter multiplies bf16 tiles wrongly in tl.dot (triton 3.7: errors of 1e10
    # on a 16x16 product), so there the kernel widens both sides to fp32 first: the CPU tests
    # check the indexing, splits and combine; the GPU's bf16 products are checked against
    # ``reference`` by the benchmark and the GPU tests.
    return os.environ.get("TRITON_INTERPRET") == "1"


def reference(q, k_cache, v_cache, table, seqused, scale) -> torch.Tensor:
    """The same attention in fp32 torch, row by row (tests)."""
    rows, q_heads, d = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    outs = []
    for m in range(rows):
        n = int(seqused[m])
        blocks = table[m, :-(-n // page)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, d)[:n].float().repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, kv_heads, d)[:n].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[m].float(), k) * scale
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
    return torch.stack(outs).to(q.dtype)


def _define(triton, tl):
    @triton.jit
    def combine_group(parts_ptr, out_ptr, row, kvh, stride_pm, stride_ph, stride_ps,
                       stride_om, stride_oh, GROUP: tl.constexpr, HEADS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
        # The parts of one (row, KV head), each weighted by exp(lse - max) and added one split
        # after another, read through L2 (.cg), where the other programs wrote them.
        h = tl.arange(0, HEADS)
        d = tl.arange(0, HEAD_DIM)
        h_mask = h < GROUP
        heads = parts_ptr + row * stride_pm + (kvh * GROUP + h) * stride_ph
        lse_all = tl.load(heads[:, None] + tl.arange(0, SPLITS)[None, :] * stride_ps + HEAD_DIM,
                          mask=h_mask[:, None], other=float("-inf"), cache_modifier=".cg")
        top = tl.max(lse_all, axis=1)
        top = tl.where(top == float("-inf"), 0.0, top)
        acc = tl.zeros((HEADS, HEAD_DIM), dtype=tl.float32)
        total = tl.zeros((HEADS,), dtype=tl.float32)
        for i in tl.static_range(SPLITS):
            lse = tl.load(heads + i * stride_ps + HEAD_DIM, mask=h_mask, other=float("-inf"),
                          cache_modifier=".cg")
            w = tl.exp(lse - top)
            part = tl.load(heads[:, None] + i * stride_ps + d[None, :], mask=h_mask[:, None],
                           other=0.0, cache_modifier=".cg")
            acc += part * w[:, None]
            total += w
        acc = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        o_ptrs = out_ptr + row * stride_om + (kvh * GROUP + h)[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])

    # The kernels call it by its global name (Triton resolves a called @jit function through the
    # caller's globals, here and in its interpreter).
    global _combine_group
    _combine_group = combine_group

    @triton.jit
    def split_attention_kernel(
            q_ptr, k_ptr, v_ptr, table_ptr, seqused_ptr, parts_ptr, counts_ptr, out_ptr, scale,
            stride_qm, stride_qh, stride_kb, stride_kt, stride_kh, stride_tm, stride_pm,
            stride_ph, stride_ps, stride_om, stride_oh, GROUP: tl.constexpr,
            HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
            BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ONE_LAUNCH: tl.constexpr,
            WIDE_DOT: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(seqused_ptr + row)
        per_split = tl.cdiv(length, SPLITS)
        start = split * per_split
        end = tl.minimum(start + per_split, length)
        h = tl.arange(0, HEADS)
        d = tl.arange(0, HEAD_DIM)
        h_mask = h < GROUP
        q = tl.load(q_ptr + row * stride_qm + (kvh * GROUP + h)[:, None] * stride_qh
                    + d[None, :], mask=h_mask[:, None], other=0.0)
        m_i = tl.full((HEADS,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((HEADS,), dtype=tl.float32)
        acc = tl.zeros((HEADS, HEAD_DIM), dtype=tl.float32)
        offs = tl.arange(0, BLOCK_N)
        for key0 in range(start, end, BLOCK_N):
            keys = key0 + offs
            k_mask = keys < end
            block = tl.load(table_ptr + row * stride_tm + keys // PAGE, mask=k_mask, other=0)
            loc = block.to(tl.int64) * stride_kb + (keys % PAGE) * stride_kt + kvh * stride_kh
            k = tl.load(k_ptr + loc[None, :] + d[:, None], mask=k_mask[None, :], other=0.0)
            if WIDE_DOT:
                s = tl.dot(q.to(tl.float32), k.to(tl.float32)) * scale
            else:
                s = tl.dot(q, k) * scale
            s = tl.where(k_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A head whose keys so far are all masked keeps -inf: subtract 0 there, not -inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_ptr + loc[:, None] + d[None, :], mask=k_mask[:, None], other=0.0)
            if WIDE_DOT:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        # This part: its normalised output and its log-sum-exp (-inf where it had no keys).
        nonempty = l_i > 0.0
        part = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        base = parts_ptr + row * stride_pm + (kvh * GROUP + h) * stride_ph + split * stride_ps
        tl.store(base[:, None] + d[None, :], part, mask=h_mask[:, None])
        tl.store(base + HEAD_DIM, lse, mask=h_mask)
        if ONE_LAUNCH:
            # Every thread's stores before the count (release); the program that counts last
            # sees every part (acquire), combines them and puts the count back to zero.
            tl.debug_barrier()
            done = tl.atomic_add(counts_ptr + row * tl.num_programs(1) + kvh, 1, sem="acq_rel")
            if done == SPLITS - 1:
                _combine_group(parts_ptr, out_ptr, row, kvh, stride_pm, stride_ph, stride_ps,
                               stride_om, stride_oh, GROUP, HEADS, HEAD_DIM, SPLITS)
                tl.atomic_xchg(counts_ptr + row * tl.num_programs(1) + kvh, 0, sem="relaxed")

    @triton.jit
    def split_attention_combine(
            q_ptr, k_ptr, v_ptr, table_ptr, seqused_ptr, parts_ptr, counts_ptr, out_ptr, scale,
            stride_qm, stride_qh, stride_kb, stride_kt, stride_kh, stride_tm, stride_pm,
            stride_ph, stride_ps, stride_om, stride_oh, GROUP: tl.constexpr,
            HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
        _combine_group(parts_ptr, out_ptr, tl.program_id(0), tl.program_id(1), stride_pm,
                       stride_ph, stride_ps, stride_om, stride_oh, GROUP, HEADS, HEAD_DIM,
                       SPLITS)

    return split_attention_kernel, split_attention_combine


_kernels = triton_kernel(_define)
