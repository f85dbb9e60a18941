"""Paged K/V shared by several sequences decoding together, and their batch-invariant attention.

Why: a batch-1 decode step reads every weight of the model for one token; ``rows`` sequences
decoding in one step read them once for ``rows`` tokens (``decode/batch/decoder.py``). This module
is the cache those rows share: one pool of blocks per layer, a block table row and a ``seqused``
entry per sequence, and the attention that reads it.

Batch invariance. A request's tokens must not depend on what decodes beside it, so every kernel of
the batched step must reduce each row in an order that depends on that row alone. The step always
runs at ``rows`` rows (unused rows are idle: one key in a scratch block), so every library kernel
sees one shape whatever the batch, and rows never mix in a linear layer, a norm or an argmax.
Attention is the exception, because its work split depends on the keys: FlashAttention 3's
split-KV plans the number of splits of each sequence from the total work of the batch
(``prepare_varlen_num_blocks``: ``total_blocks`` summed over every sequence), so a row's rounding
would change with its neighbours' lengths, and FA2 and FA3 take ``max_seqlen_k``, a host value
that changes with the longest row. The attention here is vLLM's Triton decode kernel
(``triton_decode_attention.decode_attention_fwd``, from SGLang/LightLLM): each row's keys are cut
into ``SPLITS`` equal parts of *its own* length, reduced in fp32 and combined in split order, so a
row's result is a function of that row alone, and the kernel takes no maximum length at all: one
captured graph serves every length. ``REFERENCE`` is the same contract in plain torch (CPU tests).

What is here: ``BatchKV`` (the pool, the per-row block lists and tables, the device state a
captured step reads: ``seqused``, ``slot``, ``active``) and ``select_attention``.

Scope: one query token per row, TP 1, bf16/fp16. Block ids are stable while the pool grows (a
grown pool copies the old one), so rows keep their blocks; a grown pool is a new ``generation``
(graphs recorded against the old buffers are stale).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Sequence

import torch

from ...core import stats
from ...core.reasons import Reason
from ...ops import attention as attention_ops

logger = stats.logger

BLOCK_SIZE = 16
# Splits of each row's keys in the Triton decode kernel: fixed for the process (never chosen from
# the batch or the length), which is what keeps a row's attention independent of its neighbours.
SPLITS = 16
# Block 0 is never given to a row: idle rows write their dummy token to its first slot.
SCRATCH = 0

NO_BATCH_ATTENTION = Reason("batch-invariant decode attention unavailable",
                            "a CUDA build of vllm with vllm/v1/attention/ops/"
                            "triton_decode_attention.py (vllm 0.26-0.30 ship it)")

_KERNEL_MODULES = ("vllm.v1.attention.ops.triton_decode_attention",
                   "vllm.attention.ops.triton_decode_attention")
_KERNEL_PARAMS = ("q", "k_buffer", "v_buffer", "o", "lse", "req_to_token", "b_seq_len",
                  "attn_logits", "num_kv_splits", "sm_scale", "page_size")


@dataclasses.dataclass(frozen=True)
class BatchAttention:
    """One query token per row over the rows' paged keys, called as::

        out = attention(q, k_cache, v_cache, table=..., seqused=..., scale=..., scratch=...)

    q:       (rows, q_heads, head_dim); k_cache/v_cache: (blocks, BLOCK_SIZE, kv_heads, head_dim).
    table:   (rows, width) int32 block ids, each row's blocks in order (unused entries: SCRATCH).
    seqused: (rows,) int32 valid keys per row, this step's included (a device tensor).
    scratch: ``Scratch`` buffers of this cache (the kernel's fp32 partials).
    returns  (rows, q_heads, head_dim), q's dtype.
    """

    name: str
    fn: Callable = dataclasses.field(repr=False)

    def __call__(self, q, k_cache, v_cache, *, table, seqused, scale, scratch):
        return self.fn(q, k_cache, v_cache, table, seqused, scale, scratch)


@dataclasses.dataclass
class Scratch:
    partial: torch.Tensor  # (rows, q_heads, SPLITS, head_dim + 1) fp32
    lse: torch.Tensor  # (rows, q_heads) fp32
    one: torch.Tensor  # () fp32 1.0: the kernel's K/V scales (unquantized cache)


def _reference(q, k_cache, v_cache, table, seqused, scale, scratch):
    return attention_ops.reference_paged_attention(
        q, k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=None,
        max_seqlen_k=table.shape[1] * BLOCK_SIZE, seqused_k=seqused, block_table=table,
        softmax_scale=scale)


REFERENCE = BatchAttention("reference (plain torch, fp32; tests and CPU)", _reference)


def select_attention(device) -> BatchAttention | Reason:
    """vLLM's Triton decode attention on ``device``, or why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return attention_ops.NOT_CUDA.because(f"device is {device}")
    fn = None
    errors = []
    for name in _KERNEL_MODULES:
        try:
            module = __import__(name, fromlist=["decode_attention_fwd"])
            fn = module.decode_attention_fwd
            break
        except Exception as exc:  # an ImportError, or a Triton that fails to load
            errors.append(f"{name}: {exc!r}")
    if fn is None:
        return NO_BATCH_ATTENTION.because("; ".join(errors))
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return NO_BATCH_ATTENTION.because("decode_attention_fwd has no readable signature")
    if params[:len(_KERNEL_PARAMS)] != list(_KERNEL_PARAMS) or "k_scale" not in params:
        return NO_BATCH_ATTENTION.because(f"decode_attention_fwd takes ({', '.join(params)})")

    def call(q, k_cache, v_cache, table, seqused, scale, scratch):
        out = torch.empty_like(q)
        # The K/V scales are passed: left out, the kernel makes them with torch.tensor() on every
        # call, a host-to-device copy that a graph capture refuses.
        fn(q, k_cache, v_cache, out, scratch.lse, table, seqused, scratch.partial, SPLITS,
           scale, BLOCK_SIZE, k_scale=scratch.one, v_scale=scratch.one)
        return out

    return BatchAttention(f"vllm Triton decode attention ({SPLITS} fixed splits per row)", call)


def _flat(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(-1, buf.shape[2], buf.shape[3])


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class BatchKV:
    """Per-layer paged K/V for up to ``rows`` sequences, one token per row per step.

    Host side: which blocks each row holds (``row_blocks``) and its valid length
    (``lengths``). Device side, read by a captured step: ``table`` (rows, width) int32,
    ``seqused`` (rows,) int32, ``slot`` (rows,) int64 (where each row's step writes its K/V) and
    ``active`` (rows,) int32. ``generation`` changes whenever a buffer the step reads is replaced.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, q_heads: int, *, rows: int,
                 dtype, device, attention: BatchAttention, blocks: int,
                 writer: Callable | None = None):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.rows = rows
        self.dtype = dtype
        self.device = torch.device(device)
        self.attention = attention
        # writer(key, value, k_cache, v_cache, slot): (rows, kv_heads, head_dim) K/V at (rows,)
        # slots in one kernel (layer_ops.KVWriter); None: two index_copy_.
        self.writer = writer
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.num_blocks = 0
        self.free: list[int] = []
        self.row_blocks: list[list[int]] = [[] for _ in range(rows)]
        self.lengths = [0] * rows
        self.generation = -1
        self.width = 0
        self.table = torch.zeros(rows, 0, dtype=torch.int32, device=self.device)
        self.seqused = torch.ones(rows, dtype=torch.int32, device=self.device)
        self.slot = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.active = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.scratch = Scratch(
            torch.zeros(rows, q_heads, SPLITS, head_dim + 1, dtype=torch.float32,
                        device=self.device),
            torch.zeros(rows, q_heads, dtype=torch.float32, device=self.device),
            torch.ones((), dtype=torch.float32, device=self.device))
        self.grow(blocks, width=1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # -- allocation (host) --------------------------------------------------------------------

    def grow(self, blocks: int, width: int | None = None) -> None:
        """At least ``blocks`` blocks in the pool (SCRATCH included) and a table ``width`` blocks
        wide; both only grow. The old contents are copied and block ids kept. Raises an OOM with
        the old buffers untouched."""
        width = max(self.width, width or 0)
        if blocks <= self.num_blocks and width <= self.width:
            return
        blocks = max(blocks, self.num_blocks)
        new_k, new_v = [], []
        try:
            if blocks > self.num_blocks:
                shape = (blocks, BLOCK_SIZE, self.kv_heads, self.head_dim)
                for i in range(self.num_layers):
                    k = torch.zeros(shape, dtype=self.dtype, device=self.device)
                    v = torch.zeros(shape, dtype=self.dtype, device=self.device)
                    if self.num_blocks:
                        k[:self.num_blocks].copy_(self.k[i])
                        v[:self.num_blocks].copy_(self.v[i])
                    new_k.append(k)
                    new_v.append(v)
            table = torch.zeros(self.rows, width, dtype=torch.int32, device=self.device)
        except BaseException:
            new_k.clear()
            new_v.clear()
            raise
        if new_k:
            self.k, self.v = new_k, new_v
            first = max(self.num_blocks, SCRATCH + 1)
            self.free.extend(range(first, blocks))
            self.num_blocks = blocks
        if self.table.shape[1]:
            table[:, :self.table.shape[1]].copy_(self.table)
        self.table, self.width = table, width
        self.generation += 1
        logger.debug("graphdecode: batch K/V now %d blocks, table width %d (generation %d)",
                     blocks, width, self.generation)

    def reserve(self, row: int, tokens: int) -> bool:
        """Give ``row`` blocks for ``tokens`` tokens. False when the pool has too few free
        blocks (nothing taken); the table row is written to the device when blocks were added."""
        need = blocks_for(tokens) - len(self.row_blocks[row])
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        if blocks_for(tokens) > self.width:
            raise ValueError("table too narrow: grow(width=...) first")
        taken = [self.free.pop() for _ in range(need)]
        start = len(self.row_blocks[row])
        self.row_blocks[row].extend(taken)
        self.table[row, start:start + need].copy_(
            torch.tensor(taken, dtype=torch.int32), non_blocking=False)
        return True

    def release_row(self, row: int) -> None:
        """``row``'s blocks go back to the pool; its table row points at SCRATCH again."""
        blocks = self.row_blocks[row]
        if blocks:
            self.free.extend(reversed(blocks))
            self.table[row, :len(blocks)].fill_(SCRATCH)
        self.row_blocks[row] = []
        self.lengths[row] = 0

    # -- moving a sequence in and out (host) --------------------------------------------------

    def load(self, row: int, cache) -> int:
        """Copy a prefilled ``DynamicCache`` (``layers[i].keys`` ``[1, kv_heads, S, D]``) into
        ``row`` (its blocks reserved first). Returns S."""
        prefix = cache.layers[0].keys.shape[2]
        blocks = self.row_blocks[row]
        index = self._token_index(blocks, prefix)
        for i, layer in enumerate(cache.layers):
            _flat(self.k[i]).index_copy_(0, index, layer.keys[0].transpose(0, 1))
            _flat(self.v[i]).index_copy_(0, index, layer.values[0].transpose(0, 1))
        self.lengths[row] = prefix
        return prefix

    def write_back(self, row: int, cache, length: int | None = None) -> None:
        """Replace ``cache``'s K/V with ``row``'s first ``length`` (default: all valid) tokens."""
        n = self.lengths[row] if length is None else length
        index = self._token_index(self.row_blocks[row], n)
        for i, layer in enumerate(cache.layers):
            layer.keys = _flat(self.k[i]).index_select(0, index).transpose(0, 1).unsqueeze(0)
            layer.values = _flat(self.v[i]).index_select(0, index).transpose(0, 1).unsqueeze(0)

    def save(self, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A host copy of ``row``'s first ``n`` tokens, per layer ``(n, kv_heads, head_dim)``
        K and V (``restore`` puts them back bit for bit, into whatever blocks the row holds
        then). One layer at a time: the device copy in between is one layer's tokens."""
        index = self._token_index(self.row_blocks[row], n)
        return [(_flat(k).index_select(0, index).cpu(), _flat(v).index_select(0, index).cpu())
                for k, v in zip(self.k, self.v)]

    def restore(self, row: int, saved, n: int) -> None:
        """Copy ``save``'s ``n`` tokens into ``row`` (its blocks reserved first)."""
        index = self._token_index(self.row_blocks[row], n)
        for i, (k, v) in enumerate(saved):
            _flat(self.k[i]).index_copy_(0, index, k.to(self.device))
            _flat(self.v[i]).index_copy_(0, index, v.to(self.device))
        self.lengths[row] = n

    def _token_index(self, blocks: Sequence[int], n: int) -> torch.Tensor:
        ids = torch.tensor(blocks, dtype=torch.int64).repeat_interleave(BLOCK_SIZE) * BLOCK_SIZE
        ids += torch.arange(BLOCK_SIZE).repeat(len(blocks))
        return ids[:n].to(self.device)

    # -- the step's device state (recorded in a graph) ----------------------------------------

    def load_lengths(self, lengths: torch.Tensor, active: torch.Tensor) -> None:
        """``lengths`` (rows,): valid keys of each active row this step (``active`` 1); idle rows
        read one key (SCRATCH's, or their own first while they wait for room) and write
        SCRATCH's first slot."""
        self.active.copy_(active)
        self.seqused.copy_(torch.where(active.bool(), lengths, torch.ones_like(lengths)))
        self._set_slot()

    def advance(self) -> None:
        """One more valid token in every active row, written at its next slot."""
        self.seqused.add_(self.active)
        self._set_slot()

    def _set_slot(self) -> None:
        last = (self.seqused - 1).long()
        block = self.table.gather(1, (last // BLOCK_SIZE).clamp_(max=self.width - 1)[:, None])
        slot = block[:, 0].long() * BLOCK_SIZE + last % BLOCK_SIZE
        # An idle row may hold blocks (it waits for room while others decode): its dummy token
        # is written to SCRATCH, never over its own first key.
        self.slot.copy_(torch.where(self.active.bool(), slot, SCRATCH * BLOCK_SIZE))

    def attend(self, layer_idx: int, query, key, value, softmax_scale: float) -> torch.Tensor:
        """Store this step's K/V at each row's ``slot`` and attend over its ``seqused`` keys.

        query ``(1, q_heads, rows, head_dim)``, key/value ``(1, kv_heads, rows, head_dim)`` (the
        [batch, heads, seq, dim] layout of HF-style attention, the rows as one sequence).
        Returns ``(rows, q_heads, head_dim)``.
        """
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        if self.writer is not None:
            # vLLM's writer reads each token's heads as one contiguous run.
            self.writer(k.contiguous(), v.contiguous(), self.k[layer_idx], self.v[layer_idx],
                        self.slot)
        else:
            _flat(self.k[layer_idx]).index_copy_(0, self.slot, k)
            _flat(self.v[layer_idx]).index_copy_(0, self.slot, v)
        return self.attend_stored(layer_idx, query[0].transpose(0, 1).contiguous(),
                                  softmax_scale)

    def store_target(self, layer_idx: int):
        """``(k buffer, v buffer, slot)``: where this step's K/V go (each row at its ``slot``),
        for a kernel that writes them itself before ``attend_stored``."""
        return self.k[layer_idx], self.v[layer_idx], self.slot

    def attend_stored(self, layer_idx: int, query, softmax_scale: float) -> torch.Tensor:
        """``attend`` with this step's K/V already at each row's ``slot``: query ``(rows,
        q_heads, head_dim)`` contiguous. Returns ``(rows, q_heads, head_dim)``."""
        return self.attention(query, self.k[layer_idx], self.v[layer_idx],
                              table=self.table, seqused=self.seqused, scale=softmax_scale,
                              scratch=self.scratch)

    def release(self) -> None:
        """Drop the buffers (sleep level 2). Any graph recorded against them is stale."""
        self.k, self.v = [], []
        self.num_blocks = 0
        self.free = []
        self.row_blocks = [[] for _ in range(self.rows)]
        self.lengths = [0] * self.rows
        self.table = torch.zeros(self.rows, 0, dtype=torch.int32, device=self.device)
        self.width = 0
        self.generation += 1
