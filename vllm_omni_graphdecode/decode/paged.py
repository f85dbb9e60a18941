"""Paged K/V buffers for single-token decode, and one captured CUDA graph per length bucket.

Why: an autoregressive decode step of a 42-layer model is hundreds of small kernels, and issuing
them from Python is what costs. Measured on an H200 (docs/performance.md): such a model's eager
decode on vllm-omni 0.26 runs 57 ms/token at context 512, ~14x above the time needed to read its
weights once. A CUDA graph retires the dispatch, but capture needs fixed shapes while a
``DynamicCache`` grows its K/V with ``torch.cat`` every step. Padding the cache to a bucket and
masking the tail gives fixed shapes, but the mask is what costs then (upstream measured 7.96-11.55
ms per step against 1.03 ms for exact-length attention on an A800). A *paged* cache avoids both: the
buffers stay bucket-sized, and the kernel (``ops/attention.py``) reads only ``seqused_k`` valid
keys, a device tensor. One capture then serves every step until the length leaves its bucket.

What is here:

- ``PagedKVCache``: per-layer K/V ``(num_blocks, BLOCK_SIZE, kv_heads, head_dim)`` behind an
  identity block table, filled from and written back to a transformers ``DynamicCache``. The
  allocation (``capacity``) grows to the bucket of the longest sequence seen (or the pre-capture
  size) and is only given back by ``release()``; the *bucket* is the smallest scheduled length
  that holds the current sequence and may be smaller than the capacity, so every bucket's graph
  stays valid while the buffers do. At 42 layers, 8 KV heads, d 128, bf16 a token slot costs
  168 KiB: 336 MiB for 2048 tokens, 1.3 GiB for 8192.
- ``DecodeGraphRunner``: one CUDA graph per (bucket, buffer generation), captured with
  ``capture.capture``. The step is given as a closure; this module knows no model.

Scope: one sequence (batch 1), one query token per step, and one request at a time per cache: the
caller serialises (``decode/session.py``). Growth past the last bucket goes in steps of
``tail_step`` rather than doubling. Delete this module when vllm-omni drives decode through a
scheduler-visible paged KV manager.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from ..core import stats
from ..graphs import capture as graph_capture

logger = stats.logger

BLOCK_SIZE = 16


def tail_step(buckets: Sequence[int]) -> int:
    """Growth step past the last bucket: the gap between the last two buckets (or the last)."""
    return buckets[-1] - buckets[-2] if len(buckets) > 1 else buckets[-1]


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest scheduled length that holds ``length`` tokens.

    Past the last bucket the schedule grows by ``tail_step``, not by doubling: doubling 8192
    would reserve up to 8192 unused token slots per layer, and rounding to single blocks instead
    cost a ~9,100-token think edit 41 reallocations and 42 captures upstream.
    """
    for b in buckets:
        if length <= b:
            return b
    step = tail_step(buckets)
    return buckets[-1] + -(-(length - buckets[-1]) // step) * step


class PagedKVCache:
    """Per-layer paged K/V for one sequence decoded one token at a time.

    ``kernel`` is a ``attention.Kernel`` (or anything with its call contract). The step's state
    lives in device tensors (``seqused``, ``slot``), so a captured graph reads what they hold at
    replay. ``generation`` changes whenever the buffers are replaced: a graph captured under
    another generation points at freed memory.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, dtype, device,
                 buckets: Sequence[int], kernel: Callable, length: int = 1,
                 writer: Callable | None = None):
        if any(b % BLOCK_SIZE for b in buckets):
            raise ValueError(f"buckets must be multiples of {BLOCK_SIZE}: {tuple(buckets)}")
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.buckets = tuple(buckets)
        self.kernel = kernel
        # writer(key, value, k_cache, v_cache, slot) stores one token's (1, kv_heads, head_dim)
        # K and V at ``slot`` (layer_ops.KVWriter: one kernel); None: two index_copy_ kernels.
        self.writer = writer
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.capacity = 0
        self.bucket = 0
        self.generation = -1
        self._length = 0
        self._tables: dict[int, torch.Tensor] = {}
        self.cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        self.seqused = torch.zeros(1, dtype=torch.int32, device=self.device)
        # The write slot is a tensor, not a Python int: under capture a Python index is baked in,
        # and every replay would write the same slot (right eagerly, silently wrong in a graph).
        self.slot = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._schedule = None  # the kernel's schedule for the current step (attend)
        self.reserve(length)

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def fits(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device) -> bool:
        """Can these buffers hold another sequence of this model (any length: they grow)?"""
        return (self.capacity > 0 and (num_layers, kv_heads, head_dim, dtype)
                == (self.num_layers, self.kv_heads, self.head_dim, self.dtype)
                and torch.device(device) == self.device)

    def reserve(self, length: int) -> bool:
        """Make room for ``length`` tokens and select their bucket. True if the buffers moved.

        Raises ``torch.cuda.OutOfMemoryError`` (or the device's equivalent) with the old buffers
        untouched and nothing new left allocated.
        """
        bucket = bucket_for(length, self.buckets)
        moved = False
        if bucket > self.capacity:
            self._reallocate(bucket)
            moved = True
        self.bucket = bucket
        return moved

    def _reallocate(self, capacity: int) -> None:
        blocks = capacity // BLOCK_SIZE
        shape = (blocks, BLOCK_SIZE, self.kv_heads, self.head_dim)
        keep = self._length
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        try:
            for i in range(self.num_layers):
                k = _alloc(shape, self.dtype, self.device)
                v = _alloc(shape, self.dtype, self.device)
                if keep:
                    _flat(k)[:keep].copy_(_flat(self.k[i])[:keep])
                    _flat(v)[:keep].copy_(_flat(self.v[i])[:keep])
                new_k.append(k)
                new_v.append(v)
        except BaseException:
            # Free the half-built set now; the traceback would otherwise keep it alive.
            new_k.clear()
            new_v.clear()
            raise
        # Publish everything together, with a new generation: a graph keyed on the old one must
        # never be replayed over buffers that are about to be freed.
        self.k, self.v = new_k, new_v
        self._tables = {}
        self.capacity = capacity
        self.generation += 1
        logger.debug("graphdecode: paged K/V now %d tokens x %d layers (generation %d)",
                     capacity, self.num_layers, self.generation)

    def block_table(self, bucket: int | None = None) -> torch.Tensor:
        """The identity block table of ``bucket`` (default: the current one), kept per bucket so
        a graph finds the same tensor at every replay."""
        bucket = bucket or self.bucket
        table = self._tables.get(bucket)
        if table is None:
            table = torch.arange(bucket // BLOCK_SIZE, dtype=torch.int32, device=self.device)[None]
            self._tables[bucket] = table
        return table

    def set_length(self, n: int) -> None:
        """``n`` tokens are valid; the current step writes token ``n - 1``."""
        self._length = n
        self.seqused.fill_(n)
        self.slot.fill_(max(n - 1, 0))

    def keep(self, n: int) -> None:
        """``n`` tokens are valid: host bookkeeping only. After a multi-token launch
        (``token_loop``) the device state ran ahead; the next launch or ``set_length`` rewrites
        it, and rows past ``n`` are never read (``write_back`` stops at ``n``)."""
        self._length = n

    def load_length(self, n: torch.Tensor) -> None:
        """Device-side ``set_length``: ``n`` a (1,) int device tensor (recorded in a graph)."""
        self.seqused.copy_(n)
        self.slot.copy_(n - 1)

    def advance(self) -> None:
        """Device-side: one more valid token, written at the next slot (recorded in a graph)."""
        self.seqused.add_(1)
        self.slot.add_(1)

    def begin_step(self) -> None:
        """A decode step starts: the kernel's per-step schedule is computed again, once, by the
        first layer that attends (``attend``)."""
        self._schedule = None

    def copy_from(self, other: "PagedKVCache", n: int) -> None:
        """Take the first ``n`` tokens of ``other`` (same model, this one at least as large)."""
        self.reserve(n)
        for i in range(self.num_layers):
            _flat(self.k[i])[:n].copy_(_flat(other.k[i])[:n])
            _flat(self.v[i])[:n].copy_(_flat(other.v[i])[:n])
        self._length = n

    def load(self, cache) -> int:
        """Copy a prefilled ``DynamicCache`` (``layers[i].keys`` ``[1, kv_heads, S, D]``) in.

        Returns S. Leaves room for one more token; only the first ``seqused`` rows are ever read,
        so what an earlier sequence left past S stays and does no harm.
        """
        prefix = cache.layers[0].keys.shape[2]
        self._length = 0  # nothing of the previous sequence needs to survive a reallocation
        self.reserve(prefix + 1)
        for i, layer in enumerate(cache.layers):
            # [1, H, S, D] -> [S, H, D]
            _flat(self.k[i])[:prefix].copy_(layer.keys[0].transpose(0, 1))
            _flat(self.v[i])[:prefix].copy_(layer.values[0].transpose(0, 1))
        self.set_length(prefix)
        return prefix

    def write_back(self, cache, length: int | None = None) -> None:
        """Replace ``cache``'s K/V with the first ``length`` (default: all valid) tokens here."""
        n = self._length if length is None else length
        for i, layer in enumerate(cache.layers):
            layer.keys = _flat(self.k[i])[:n].transpose(0, 1).unsqueeze(0).contiguous()
            layer.values = _flat(self.v[i])[:n].transpose(0, 1).unsqueeze(0).contiguous()

    def attend(self, layer_idx: int, query, key, value, softmax_scale: float) -> torch.Tensor:
        """Store this step's K/V at ``slot`` and attend over the ``seqused`` valid keys.

        query ``(1, q_heads, 1, head_dim)``; key/value ``(1, kv_heads, 1, head_dim)`` (the
        [batch, heads, seq, dim] layout of HF-style attention). Returns ``(1, q_heads, head_dim)``.
        """
        if self.writer is not None:
            self.writer(key[:, :, 0], value[:, :, 0], self.k[layer_idx], self.v[layer_idx],
                        self.slot)
        else:
            _flat(self.k[layer_idx]).index_copy_(0, self.slot, key[0, :, 0].unsqueeze(0))
            _flat(self.v[layer_idx]).index_copy_(0, self.slot, value[0, :, 0].unsqueeze(0))
        heads = query.shape[1]
        return self.attend_stored(layer_idx, query[0].transpose(0, 1).reshape(1, heads,
                                                                             self.head_dim),
                                  softmax_scale)

    def store_target(self, layer_idx: int):
        """``(k buffer, v buffer, slot)``: where this step's K/V go, for a kernel that writes
        them itself before ``attend_stored`` (the slot is read at replay, never baked in)."""
        return self.k[layer_idx], self.v[layer_idx], self.slot

    def attend_stored(self, layer_idx: int, query, softmax_scale: float) -> torch.Tensor:
        """``attend`` with this step's K/V already at ``slot``: query ``(1, q_heads, head_dim)``.
        Returns ``(1, q_heads, head_dim)``."""
        schedule = getattr(self.kernel, "schedule", None)
        extra = {}
        if schedule is not None:
            # FA3 plans its split of the keys from seqused_k in a kernel of its own before every
            # call; the plan is the same for every layer of a step, so it is made once.
            if self._schedule is None:
                self._schedule = schedule(query, self.k[layer_idx],
                                          cu_seqlens_q=self.cu_seqlens_q,
                                          seqused_k=self.seqused, max_seqlen_k=self.bucket)
            extra["scheduler_metadata"] = self._schedule
        return self.kernel(query, self.k[layer_idx], self.v[layer_idx],
                           cu_seqlens_q=self.cu_seqlens_q, seqused_k=self.seqused,
                           block_table=self.block_table(), max_seqlen_k=self.bucket,
                           softmax_scale=softmax_scale, **extra)

    def release(self) -> None:
        """Drop the buffers. Any graph captured against them is stale from now on."""
        self.k, self.v = [], []
        self._tables = {}
        self.capacity = 0
        self.bucket = 0
        self._length = 0
        self.generation += 1


def _alloc(shape, dtype, device) -> torch.Tensor:
    """One K or V buffer (a seam for tests that inject an OOM at a chosen allocation). Zeros, not
    empty: the reference kernel multiplies masked-out values by 0, and 0 * NaN from stale memory
    would be NaN."""
    return torch.zeros(shape, dtype=dtype, device=device)


def _flat(buf: torch.Tensor) -> torch.Tensor:
    """``(blocks, BLOCK_SIZE, H, D)`` viewed as ``(tokens, H, D)`` (identity block table)."""
    return buf.view(-1, buf.shape[2], buf.shape[3])


@dataclasses.dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    output: torch.Tensor
    verified: bool = False


class DecodeGraphRunner:
    """Replays one captured decode step per (bucket, generation) of a ``PagedKVCache``.

    ``forward()`` runs one step reading only static tensors (the token, its position, the cache's
    ``seqused``/``slot``) and returns the output (logits). Workflow of ``step()``:

    1. Key the step by ``(cache.bucket, cache.generation)``. Graphs of an older generation point
       at freed buffers: they are dropped as soon as the generation moves.
    2. A key disabled by verify, or ``graphs=False``, runs ``forward()`` eagerly.
    3. No graph yet: ``capture.capture`` (warm-ups, then the capture). Warm-up and capture
       rewrite the same K/V into the same slot, so they are idempotent.
    4. With ``verify``, the first replay of a new graph is compared with the eager step; a
       mismatch disables that graph (WARNING with the max difference) and the runner stays eager
       until ``reset()``.
    5. Replay; return the graph's static output, valid until the next step.

    A capture that fails raises ``CaptureFailed``, unless ``on_capture_failed`` is given: it is
    called with the error (its owner turns graphs off) and this step runs ``forward()`` eagerly,
    the same kernels on the same inputs (the failed capture gave the generator its state back,
    so a sampling step draws what the graph would have).
    """

    def __init__(self, forward: Callable[[], torch.Tensor], cache: PagedKVCache, *, model: str,
                 graphs: bool = True, verify: bool = False, pool=None,
                 on_capture_failed: Callable[[Exception], None] | None = None):
        self.forward = forward
        self.cache = cache
        self.model = model
        self.graphs_enabled = graphs
        self.verify = verify
        self._pool = pool
        self.on_capture_failed = on_capture_failed
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._disabled: set[tuple[int, int]] = set()
        self._generation = cache.generation
        self.eager_after_mismatch = False

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def buckets_captured(self) -> list[int]:
        return sorted(b for b, g in self._graphs if g == self.cache.generation)

    def reset(self) -> None:
        """Start of a request: leave eager-after-mismatch mode (disabled graphs stay disabled)."""
        self.eager_after_mismatch = False

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._disabled.clear()

    def _key(self) -> tuple[int, int]:
        if self.cache.generation != self._generation:
            # A private pool per capture set would keep every dropped graph's arena: upstream
            # measured +40 MiB per request. In the shared pool the memory returns for reuse.
            self.drop_graphs()
            self._generation = self.cache.generation
        return self.cache.bucket, self.cache.generation

    def step(self) -> torch.Tensor:
        key = self._key()
        if not self.graphs_enabled or self.eager_after_mismatch or key in self._disabled:
            stats.count(self.model, "paged_eager_step")
            return self.forward()
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key)
            except graph_capture.CaptureFailed as exc:
                if self.on_capture_failed is None:
                    raise
                self.on_capture_failed(exc)
                stats.count(self.model, "paged_eager_step")
                return self.forward()
        if self.verify and not entry.verified:
            return self._verify(key, entry)
        entry.graph.replay()
        stats.count(self.model, "replay")
        return entry.output

    def capture(self) -> float:
        """Capture the current key's graph now if it has none (pre-capture). Returns seconds.

        Replays it once too: the first launch of a graph uploads it, and that belongs to load
        time, not to the first request. The replay rewrites the slot warm-up already wrote.
        """
        key = self._key()
        if key in self._graphs or key in self._disabled or not self.graphs_enabled:
            return 0.0
        start = time.perf_counter()
        self._capture(key).graph.replay()
        return time.perf_counter() - start

    def _capture(self, key) -> _Graph:
        """Raises ``capture.CaptureFailed`` (the process repaired, nothing kept)."""
        captured = graph_capture.capture(self.forward, self.cache.device, pool=self._pool)
        entry = _Graph(captured.graph, captured.output)
        self._graphs[key] = entry
        stats.count(self.model, "capture")
        logger.debug("graphdecode: %s captured decode graph bucket=%d generation=%d",
                     self.model, key[0], key[1])
        return entry

    def _verify(self, key, entry: _Graph) -> torch.Tensor:
        # A step that samples draws from the device's generator: the eager step starts from the
        # state the replay started from, so both draw the same numbers (and end in one state).
        rng = torch.cuda.get_rng_state(self.cache.device)
        entry.graph.replay()
        replayed = entry.output.clone()
        torch.cuda.set_rng_state(rng, self.cache.device)
        # Eager second: it rewrites this step's K/V slot, so a faulty graph leaves nothing behind.
        eager = self.forward()
        result = graph_capture.compare(replayed, eager, graph_capture.VERIFY_RTOL)
        if not result.ok:
            self._graphs.pop(key, None)
            self._disabled.add(key)
            self.eager_after_mismatch = True
            stats.count(self.model, graph_capture.VERIFY_MISMATCH)
            logger.warning("graphdecode: %s decode graph for bucket %d differs from the eager step "
                           "(max |diff| %.4g > %.4g): graph disabled, this request continues "
                           "eagerly", self.model, key[0], result.max_abs_diff, result.limit)
            return eager
        entry.verified = True
        stats.count(self.model, graph_capture.VERIFIED)
        return eager
