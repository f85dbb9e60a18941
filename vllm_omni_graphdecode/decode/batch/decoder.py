"""Several sequences decoding together: one captured launch decodes ``k`` tokens for every row.

Why: a decode token at batch 1 reads all of the language model's weights (~17.5 GB measured); on
the H200 the step's linear layers at 16 rows cost 1.03x one row (FACTS 5c: 4.56 against 4.42 ms
for the 42 layers' GEMMs, one graph per row count). So requests that decode at the same time
should decode in one step. vLLM-Omni hands a pipeline several requests in one ``forward``
(``turns`` runs each through the pipeline's own code); their decode loops meet here.

How:

- The step always runs ``rows`` rows (``BatchKV``): idle rows decode a dummy token over one
  scratch key. One row count means one shape for every kernel, so no library kernel picks another
  algorithm for another batch, and rows never mix outside attention, which is batch-invariant by
  construction (``kv.py``). A request's tokens are therefore the same whether it decodes alone
  or beside fifteen others, in whichever row.
- ``BatchProgram``: ``k`` steps of all rows as one function a graph records (one graph per
  program and pool generation: the attention takes no maximum length, so one graph serves every
  length). After each step every row's next token is chosen on the device: the argmax (the loops'
  own pick), or for a row that samples a Gumbel-max draw from ``softmax(logits / t)`` with noise
  from a counter-based hash of (the request's seed, the token's position, the vocabulary index).
  That is the loops' distribution, and the same numbers whatever else decodes (the device's
  global generator would hand each row whatever its neighbours left).
- ``BatchDecoder``: rows join (their prefill copied in), ``Row.next`` serves each loop its
  tokens from the last launch as ``token_loop.Lookahead`` does for one sequence (checking the loop
  fed exactly what the device fed), and a row that needs more waits (``turns.Turns.wait_until``);
  when no request can run, ``launch`` decodes the next ``k`` tokens of every waiting row.
- Faults keep a row's answer. A row without room waits: the step runs the rows that have room,
  and a row waiting for blocks (at join, or to grow) joins the next launch after another row
  leaves. When no waiting row has room, the youngest rows holding blocks are swapped out to host
  memory (their K/V copied bit for bit, their blocks freed) until the oldest has room; a swapped
  row comes back the same way. A row computes the same tokens whenever it runs, so waiting and
  swapping change no answer. A failed capture or a release (sleep) mid-batch drops the graphs and
  the rows go on with the same step run without them (the same kernels: the same tokens). Only a
  row that cannot have room even alone is handed back: its K/V written back to its own cache, its
  loop continues on the pipeline's eager path from exactly the tokens decoded so far (the
  model's own step: its later tokens may part from the batch's at a near-tie).

Counted under the model's key: ``batch_launch``, ``batch_rows`` (rows decoded, summed over
launches: their ratio is the mean batch), ``batch_capture``, ``batch_row_join``,
``batch_eager_launch``, ``batch_row_waited`` (launches a row sat out for room),
``batch_row_swapped`` (swap-outs); the degraded and fallback reasons ``OOM`` (a swap-out,
detail "swapped out"; a hand-back), ``CAPTURE_FAILED`` and ``RELEASED`` (rows going on without
graphs), their detail saying "batched decode".
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

import torch

from ...core import stats
from ...core.reasons import CAPTURE_FAILED, OOM, RELEASED, Reason
from ...graphs import capture as cuda_graphs
from ...graphs.capture import CaptureFailed, is_oom
from ..sampling import RowSampling, choose
from . import turns
from .kv import BatchKV, blocks_for

logger = stats.logger


class BatchStepModel(Protocol):
    """What a hook supplies: one decode step of its model for ``rows`` rows over a ``BatchKV``.

    ``forward(cache)`` reads only static tensors (weights, the inputs ``load_inputs`` /
    ``advance`` write, the cache's buffers and device state) and returns (rows, vocab) logits.
    ``positions`` is the (rows,) long tensor of each row's current token position.
    """

    rows: int
    positions: torch.Tensor

    def load_inputs(self, tokens: torch.Tensor, positions: torch.Tensor) -> None: ...

    def advance(self, tokens: torch.Tensor, active: torch.Tensor) -> None: ...

    def forward(self, cache: BatchKV) -> torch.Tensor: ...


# The rows of ``BatchProgram.inputs``, in order.
INPUTS = ("start_tokens", "start_positions", "start_lengths", "active", "seed")


class BatchProgram:
    """``k`` decode steps of every row as one function a graph records (module docstring).

    Inputs (written by the host before a launch, rows of ``inputs``): ``start_tokens``,
    ``start_positions``, ``start_lengths`` (valid keys in the first step, the fed token's
    included), ``active`` (1 or 0), ``seed``, each (rows,) long; ``temperature`` (rows,) float32.
    Output: ``tokens`` (k, rows) long.
    """

    def __init__(self, model: BatchStepModel, cache: BatchKV, k: int, *, sampled: bool):
        rows, device = cache.rows, cache.device
        self.model, self.cache, self.k, self.sampled = model, cache, k, sampled
        # The integer inputs in one tensor, so a launch writes them with one copy (``INPUTS``).
        self.inputs = torch.zeros(len(INPUTS), rows, dtype=torch.long, device=device)
        (self.start_tokens, self.start_positions, self.start_lengths, self.active,
         self.seed) = self.inputs.unbind(0)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(k, rows, dtype=torch.long, device=device)
        self.graph = None
        self.output: torch.Tensor | None = None  # the last step's logits of the last launch
        self.generation = -1
        self.vocab = 0

    def forward(self) -> torch.Tensor:
        """Returns the last step's logits; the chosen tokens go to ``tokens``."""
        m, c = self.model, self.cache
        m.load_inputs(self.start_tokens, self.start_positions)
        c.load_lengths(self.start_lengths, self.active)
        logits = None
        for j in range(self.k):
            if j:
                m.advance(self.tokens[j - 1], self.active)
                c.advance()
            logits = m.forward(c)
            self.tokens[j].copy_(choose(logits, self.temperature, self.seed, m.positions,
                                        self.sampled))
        return logits

    def run(self, *, graphs: bool) -> bool:
        """One launch: the graph (captured first when missing or stale), or eagerly. Returns
        whether a graph was captured now. Raises ``CaptureFailed``."""
        if not graphs:
            self.output = self.forward()
            self.vocab = self.output.shape[-1]
            return False
        captured = False
        if self.graph is None or self.generation != self.cache.generation:
            self.graph = self.output = None
            done = cuda_graphs.capture(self.forward, self.cache.device)
            self.graph, self.output = done.graph, done.output
            self.vocab = self.output.shape[-1]
            self.generation = self.cache.generation
            captured = True
        self.graph.replay()
        return captured

    def drop_graph(self) -> None:
        self.graph = self.output = None


class Row:
    """One sequence's place in the batch: what its loop fed, what the launches decoded for it.

    A row is *in the pool* (``loaded``: its K/V in blocks of the batch's cache) or waits outside it
    for room: at join its prefill K/V are still only in its own cache (``cache``); swapped out,
    they are in ``swapped`` (host memory, bit for bit). ``length`` counts its valid tokens either
    way."""

    def __init__(self, decoder: "BatchDecoder", index: int, cache, sampling: RowSampling,
                 order: int):
        self.decoder = decoder
        self.index = index
        self.cache = cache  # the request's own DynamicCache (written back at the end)
        self.sampling = sampling
        self.order = order  # join order: the oldest row gets room first
        self.live = True
        self.loaded = False
        self.swapped: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = cache.layers[0].keys.shape[2]
        self.handed_back: Reason | None = None
        self.graphless = False  # counted once: it went on without graphs (release, capture)
        # The next launch starts from (want_token, want_position) over ``length`` valid tokens.
        self.want: tuple[int, int] | None = None
        # The last launch's tokens: fed[i] was fed at start_position + i, nexts[i] followed it.
        self.fed: list[int] = []
        self.nexts: list[int] = []
        self.start_length = 0
        self.start_position = 0
        self.cursor = -1
        self.steps = 0

    def next(self, token: int, position: int) -> int | None:
        """The loop feeds ``token`` at ``position``: the token that follows it, or None after a
        hand-back (the loop's cache then holds every token decoded so far)."""
        if not self.live:
            return None
        i = self.cursor + 1
        if (0 < i < len(self.fed) and self.fed[i] == token
                and self.start_position + i == position):
            self.cursor = i
            self.length = self.start_length + i + 1
            self.steps += 1
            return self.nexts[i]
        self.want = (token, position)
        self.fed = []
        self.decoder.wait_for(self)
        if not self.live:
            return None
        self.steps += 1
        return self.nexts[0]

    def receive(self, tokens: list[int]) -> None:
        token, position = self.want
        self.start_length, self.start_position = self.length, position
        self.nexts = tokens
        self.fed = [token] + tokens[:-1]
        self.cursor = 0
        self.length = self.start_length + 1
        self.want = None

    @property
    def waiting(self) -> bool:
        return self.live and self.want is not None


class BatchDecoder:
    """Up to ``cache.rows`` sequences decoding together (module docstring).

    ``model``: the hook's ``BatchStepModel``; ``graphs``: capture launches (else run them
    eagerly, the same kernels); ``k``: tokens per launch; ``reopen_blocks``/``reopen_width``:
    the pool a released decoder allocates again for its next row (default: its first size);
    ``changed()``, checked before every launch (constant time), returns why the model changed
    under the rows, or None: every live row is then handed back to the eager path.
    """

    def __init__(self, model: BatchStepModel, cache: BatchKV, *, name: str, k: int,
                 graphs: bool, reopen_blocks: int | None = None,
                 reopen_width: int | None = None,
                 changed: Callable[[], Reason | None] | None = None):
        self.model = model
        self.changed = changed
        self.cache = cache
        self.name = name
        self.k = k
        self.graphs = graphs
        self.rows: list[Row | None] = [None] * cache.rows
        self.programs: dict[bool, BatchProgram] = {}
        self.capture_failed: str | None = None  # until release(): launches run without graphs
        self.lock = threading.RLock()
        pin = cache.device.type == "cuda"
        self._pin = pin
        self._host_tokens = torch.zeros(k, cache.rows, dtype=torch.long, pin_memory=pin)
        # A launch's inputs, staged in pinned memory: two copies a launch, not one a field.
        self._host_inputs = torch.zeros(len(INPUTS), cache.rows, dtype=torch.long, pin_memory=pin)
        self._host_temps = torch.zeros(cache.rows, dtype=torch.float32, pin_memory=pin)
        self._released = False
        self._joined = 0
        self._reopen = (reopen_blocks or cache.num_blocks, reopen_width or max(cache.width, 1))
        self.vocab = 0

    @property
    def live_rows(self) -> list[Row]:
        return [r for r in self.rows if r is not None and r.live]

    def free_rows(self) -> int:
        return sum(r is None for r in self.rows)

    # -- rows ---------------------------------------------------------------------------------

    def join(self, past_key_values, sampling: RowSampling = RowSampling()) -> Row | None:
        """A row for a prefilled ``DynamicCache`` (batch 1), or None when every row is taken.
        Its K/V enter the pool at its first launch, once there is room (module docstring)."""
        with self.lock:
            try:
                index = self.rows.index(None)
            except ValueError:
                return None
            if self._released and not self.live_rows:
                self._reopen_buffers()
            row = Row(self, index, past_key_values, sampling, self._joined)
            self._joined += 1
            self.rows[index] = row
            stats.count(self.name, "batch_row_join")
            return row

    def leave(self, row: Row, *, write_back: bool) -> None:
        """``row``'s loop is over: its K/V written back to its cache when asked (the caller reads
        the cache next), its blocks returned."""
        with self.lock:
            if row.live and write_back and row.steps:
                self._write_back(row)
            row.live = False
            self._free(row)
            if self._released and not self.live_rows:
                self._drop()

    def hand_back(self, row: Row, reason: Reason) -> None:
        """Write ``row``'s decoded K/V back and let the eager path take its loop over."""
        if not row.live:
            return
        if row.steps:
            self._write_back(row)
        row.live = False
        row.handed_back = reason
        stats.fallback(self.name, reason)
        self._free(row)

    def _write_back(self, row: Row) -> None:
        if row.loaded:
            self.cache.write_back(row.index, row.cache, row.length)
        elif row.swapped is not None:
            device = row.cache.layers[0].keys.device
            for layer, (k, v) in zip(row.cache.layers, row.swapped):
                layer.keys = k.to(device).transpose(0, 1).unsqueeze(0)
                layer.values = v.to(device).transpose(0, 1).unsqueeze(0)

    def _free(self, row: Row) -> None:
        row.swapped = None
        if self.rows[row.index] is row:
            self.rows[row.index] = None
            if row.loaded:
                self.cache.release_row(row.index)
        row.loaded = False

    def _reserve(self, index: int, tokens: int) -> bool:
        """Blocks for ``tokens`` tokens in row ``index``, growing the pool (and table) if needed.
        False under memory pressure (nothing changed)."""
        cache = self.cache
        if blocks_for(tokens) > cache.width:
            try:
                cache.grow(cache.num_blocks, width=max(blocks_for(tokens), 2 * cache.width))
            except Exception as exc:
                if not is_oom(exc):
                    raise
                return False
        if cache.reserve(index, tokens):
            return True
        short = blocks_for(tokens) - len(cache.row_blocks[index]) - len(cache.free)
        try:
            # Grow by at least a quarter: a pool that grows one block at a time recaptures often.
            cache.grow(cache.num_blocks + max(short, cache.num_blocks // 4))
        except Exception as exc:
            if not is_oom(exc):
                raise
            return False
        return cache.reserve(index, tokens)

    # -- room ---------------------------------------------------------------------------------

    def _room(self, row: Row) -> bool:
        """Blocks for ``row``'s next launch, its K/V brought into the pool when they were not
        there. False: no room now (nothing changed)."""
        if not self._reserve(row.index, row.length + 1 + self.k):
            return False
        if not row.loaded:
            if row.swapped is not None:
                self.cache.restore(row.index, row.swapped, row.length)
                row.swapped = None
            else:
                self.cache.load(row.index, row.cache)
            row.loaded = True
        self.cache.lengths[row.index] = row.length
        return True

    def _swap_out(self, row: Row) -> None:
        """``row``'s K/V to host memory, its blocks back to the pool: it waits for room."""
        row.swapped = self.cache.save(row.index, row.length)
        self.cache.release_row(row.index)
        row.loaded = False
        stats.count(self.name, "batch_row_swapped")
        stats.degraded(self.name, OOM.because(
            f"batched decode: row {row.index} swapped out at {row.length} tokens until another "
            f"row leaves ({len(self.cache.free)} free blocks): lower --max-num-seqs or the "
            f"buckets"))

    def _admit(self, waiting: list[Row]) -> list[Row]:
        """The waiting rows that have room for the next launch, oldest first; a row without room
        keeps waiting. When none has room, the youngest rows in the pool are swapped out until
        the oldest waiting row has it; when even that cannot give it room, it is handed back
        (module docstring). Never returns an empty list while a waiting row stays waiting."""
        waiting = sorted(waiting, key=lambda r: r.order)
        ready = [r for r in waiting if self._room(r)]
        if not ready:
            oldest = waiting[0]
            for victim in sorted(self.live_rows, key=lambda r: -r.order):
                if victim is oldest or not victim.loaded:
                    continue
                self._swap_out(victim)
                if self._room(oldest):
                    ready = [oldest] + [r for r in waiting[1:] if r.loaded and self._room(r)]
                    break
            else:
                self.hand_back(oldest, OOM.because(
                    f"batched decode: no room in the batch's paged K/V for row {oldest.index} at "
                    f"{oldest.length} tokens even alone ({len(self.cache.free)} free blocks): "
                    f"lower --max-num-seqs or the buckets"))
        for row in waiting:
            if row.live and row not in ready:
                stats.count(self.name, "batch_row_waited")
        return ready

    # -- launches -----------------------------------------------------------------------------

    def wait_for(self, row: Row) -> None:
        """``row`` wants the next launch: give the turn away until it has run, or launch now
        when this thread is not one of a group's members (one request, or a direct caller)."""
        group = turns.current()
        if group is None:
            with self.lock:
                while row.waiting:
                    self.launch()
            return
        group.group.wait_until(lambda: not row.waiting)

    @torch.inference_mode()
    def launch(self) -> None:
        """Decode the next ``k`` tokens of every waiting row that has room in one launch (the
        turns' idle work). In inference mode whichever thread runs it: the member holding the
        turn may have left its request's ``forward``."""
        with self.lock:
            waiting = [r for r in self.rows if r is not None and r.waiting]
            if not waiting:
                return
            changed = self.changed() if self.changed is not None else None
            if changed is not None:
                # The launches read what the model was: none runs again for these rows.
                self.drop_graphs()
                for r in self.live_rows:
                    self.hand_back(r, changed)
                return
            ready = self._admit(waiting)
            if ready:
                self._run(ready)

    def _graphless(self, rows: list[Row]) -> None:
        """Count, once per row, why these rows decode without graphs."""
        if self._released:
            reason = RELEASED.because("batched decode goes on without graphs, the same step")
        else:
            reason = CAPTURE_FAILED.because(f"batched decode goes on without graphs, the same "
                                            f"step: {self.capture_failed}")
        for r in rows:
            if not r.graphless:
                r.graphless = True
                stats.fallback(self.name, reason)

    def _run(self, waiting: list[Row]) -> None:
        sampled = any(r.sampling.temperature > 0 for r in waiting)
        program = self.programs.get(sampled)
        if program is None:
            program = self.programs[sampled] = BatchProgram(self.model, self.cache, self.k,
                                                            sampled=sampled)
        rows = self.cache.rows
        tokens, positions = [0] * rows, [0] * rows
        lengths, active = [1] * rows, [0] * rows
        temps, seeds = [0.0] * rows, [0] * rows
        for r in waiting:
            tokens[r.index], positions[r.index] = r.want
            lengths[r.index] = r.length + 1
            active[r.index] = 1
            temps[r.index], seeds[r.index] = r.sampling.temperature, r.sampling.seed
        # The pinned buffers are free again: the last launch's tokens were read (a sync) before.
        self._host_inputs.copy_(torch.tensor([tokens, positions, lengths, active, seeds]))
        self._host_temps.copy_(torch.tensor(temps, dtype=torch.float32))
        program.inputs.copy_(self._host_inputs, non_blocking=True)
        program.temperature.copy_(self._host_temps, non_blocking=True)
        graphs = self.graphs and not self._released and self.capture_failed is None
        try:
            if program.run(graphs=graphs):
                stats.count(self.name, "batch_capture")
        except CaptureFailed as exc:
            # The capture's repair left the device usable: this launch runs without a graph,
            # and so does every later one until a release lets capture try again.
            self.capture_failed = str(exc)[:300]
            program.drop_graph()
            program.run(graphs=False)
            graphs = False
        if not graphs:
            stats.count(self.name, "batch_eager_launch")
            if self.capture_failed is not None or self._released:
                self._graphless(waiting)
        self._host_tokens.copy_(program.tokens, non_blocking=True)
        if program.tokens.is_cuda:
            torch.cuda.current_stream(self.cache.device).synchronize()
        self.vocab = program.vocab
        host = self._host_tokens.t().tolist()
        for r in waiting:
            r.receive(host[r.index])
            self.cache.lengths[r.index] = r.length
        stats.count(self.name, "batch_launch")
        stats.count(self.name, "batch_rows", len(waiting))

    @torch.inference_mode()
    def precapture(self) -> float:
        """Capture the greedy program now (model load): idle rows only, so nothing of any
        request is touched. Returns seconds. A failed capture leaves the launches without graphs
        (counted) until a release."""
        with self.lock:
            start = time.perf_counter()
            program = self.programs.get(False)
            if program is None:
                program = self.programs[False] = BatchProgram(self.model, self.cache, self.k,
                                                              sampled=False)
            if self.graphs and self.capture_failed is None:
                try:
                    program.run(graphs=True)
                except CaptureFailed as exc:
                    self.capture_failed = str(exc)[:300]
                    stats.fallback(self.name, CAPTURE_FAILED.because(
                        f"batched decode pre-capture: {self.capture_failed}"))
                else:
                    stats.count(self.name, "batch_capture")
            return time.perf_counter() - start

    # -- release ------------------------------------------------------------------------------

    def release(self) -> None:
        """Sleep level 2: drop the graphs now and the buffers once no row decodes. Rows still
        decoding go on with the same step without graphs (module docstring)."""
        with self.lock:
            self._released = True
            self.capture_failed = None
            self.drop_graphs()
            if not self.live_rows:
                self._drop()

    def drop_graphs(self) -> None:
        """Forget the captured launches (the next launch captures again)."""
        with self.lock:
            for program in self.programs.values():
                program.drop_graph()

    def _drop(self) -> None:
        self.drop_graphs()
        self.programs.clear()
        self.cache.release()

    def _reopen_buffers(self) -> None:
        self._released = False
        if not self.cache.num_blocks:
            blocks, width = self._reopen
            self.cache.grow(blocks, width=width)

    def reopen(self, blocks: int, width: int) -> None:
        """After a release: buffers again (the next request's)."""
        with self.lock:
            self._reopen = (blocks, width)
            if self._released and not self.live_rows:
                self._reopen_buffers()
