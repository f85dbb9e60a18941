"""Decode with the next token chosen on the device: several tokens per graph launch.

Why: with one graph per token, the host still waits for every token (the loop's argmax and
``.item()``), and the GPU idles while it does: 0.43 ms of a 6.5 ms token of the measured decode
on the H200 (docs/performance.md). Here one graph records ``k`` decode steps, each feeding the
argmax of its logits to the next step on the device, and the host reads the ``k`` tokens once per
launch.

The pipeline's own loop keeps running unchanged above this: it still calls ``_ar_step`` once per
token and still decides when to stop. ``Lookahead.next`` serves each call from the tokens already
decoded, after checking that the loop fed exactly the token and position the device fed. Anything
else (a loop that chose another token, another position) drops what ran ahead and starts a new
launch from the caller's token, so the result is always what the per-token path gives.

Surplus: a launch decodes past the loop's stop (its end token, ``</think>``, its token limit).
Those tokens' K/V sit in rows past the cache's valid length, which is what ``keep`` records after
every served token: they are never read, and the next sequence overwrites them. While the host
serves one launch's tokens, the next launch already runs (chained on the device from the last
token), unless a stop token or the limit is among the tokens just read, or the next launch would
need a larger bucket: so at most one launch's work is wasted, and only when a stop is not known.

Sampled loops (``Sampling``): the text loop's ``do_sample`` draws each token as
``torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1)``; a sampling program runs
those same two calls on the device after every step, so each token comes from the same
distribution by the same algorithm (an exponential draw per vocabulary entry, then the argmax of
p / q). The draws come from the device's default generator in token order, one launch after
another; inside a graph each replay advances the generator's offset by what its steps draw, as
the eager calls would. What is not the loop's: tokens decoded past a stop draw too (the next
request's draws start later), and a capture's warm-ups draw nothing (``capture.capture``
restores the generator), so a seeded request decodes the same tokens whether or not it captured.
On CPU (tests) the draws come from the CPU generator in the loop's own order, so a seeded sampled
request decodes the eager loop's tokens.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..core import stats
from .paged import DecodeGraphRunner, PagedKVCache, bucket_for


def pick(logits: torch.Tensor) -> torch.Tensor:
    """The greedy next token, (1,) long: the argmax the pipelines' loops take of the last
    position's logits (``torch.argmax(logits[:, -1, :], dim=-1)``), same reduction, same ties."""
    return torch.argmax(logits.reshape(-1, logits.shape[-1])[-1:], dim=-1)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The text loop's sampling (``do_sample`` with ``temperature`` > 0), as its own code draws:
    ``choose`` is its two calls on the last position's logits. A Python float, as the loop
    divides by (a device tensor would divide by another rounding of it)."""

    temperature: float

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """(1,) long: one draw from ``softmax(logits[-1] / temperature)``."""
        last = logits.reshape(-1, logits.shape[-1])[-1:]
        probs = torch.softmax(last / self.temperature, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(-1)


def chooser(sampling: Sampling | None):
    """How a program picks each next token: the loop's argmax, or its sampling."""
    return pick if sampling is None else sampling.choose


class TokenProgram:
    """``k`` decode steps of one tier's cache as one function a graph records.

    Reads its start (token, position, valid length) from device tensors, which the host writes
    before a launch (or the previous launch's last token, on the device); writes the ``k`` chosen
    tokens into ``tokens``. Every run starts from those inputs, so the warm-ups of a capture and
    a replay write the same K/V rows with the same values.
    """

    def __init__(self, model, cache: PagedKVCache, k: int, step, *, name: str, graphs: bool,
                 verify: bool, pool=None, sampling: Sampling | None = None,
                 on_capture_failed=None):
        device = model.device
        self.model = model
        self.cache = cache
        self.k = k
        self.sampling = sampling
        self.choose = chooser(sampling)
        self.step = step  # one decode step of the tier: begin_step, then the model's forward
        self.start_token = torch.zeros(1, dtype=torch.long, device=device)
        self.start_position = torch.zeros(1, dtype=torch.long, device=device)
        self.start_length = torch.zeros(1, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(k, dtype=torch.long, device=device)
        self.runner = DecodeGraphRunner(self.forward, cache, model=name, graphs=graphs,
                                        verify=verify, pool=pool,
                                        on_capture_failed=on_capture_failed)

    def forward(self) -> torch.Tensor:
        """Returns the last step's logits (what verify compares); the tokens go to ``tokens``."""
        self.model.load_inputs(self.start_token, self.start_position)
        self.cache.load_length(self.start_length)
        logits = None
        for j in range(self.k):
            if j:
                self.model.advance(self.tokens[j - 1:j])
                self.cache.advance()
            logits = self.step()
            self.tokens[j:j + 1].copy_(self.choose(logits))
        return logits


class ServedLogits(torch.Tensor):
    """Host logits that know their token: 0 at the served token, -inf elsewhere.

    What the loop reads in place of the device's logits. Every operation sees those values (a
    softmax puts all mass on the token); the loops' own picks over the vocabulary of the one row
    are answered from the token instead of computed on the host: ``argmax`` (scanning 150k floats
    cost ~0.1 ms a token on a 2-core CPU), after checking that the row still holds the token's 0
    there, and ``multinomial`` of one sample from ``softmax(logits / temperature)`` (drawing on
    the host would take the CPU generator's numbers, which the eager loop leaves alone), after
    checking that the row holds all its mass at the token. Indexing, division by a positive number
    and a softmax over the row keep the subclass (they keep a row whose only finite entry is the
    token's); other results are plain.
    """

    _token: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.argmax, torch.Tensor.argmax):
            found = _served_argmax(args, kwargs)
            if found is not None:
                return found
        if func in (torch.multinomial, torch.Tensor.multinomial):
            found = _served_draw(args, kwargs)
            if found is not None:
                return found
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and _keeps_token(func, args, kwargs):
            out = out.as_subclass(cls)
            out._token = args[0]._token
        return out


_DIVIDE = (torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide)
_SOFTMAX = (torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax)


def _keeps_token(func, args, kwargs) -> bool:
    """Does ``func(*args)`` keep the served row's shape of values: one finite entry, at the
    token?"""
    x = args[0] if args else None
    if getattr(x, "_token", None) is None:
        return False
    if func is torch.Tensor.__getitem__:
        return True
    if func in _DIVIDE:
        by = args[1] if len(args) > 1 else kwargs.get("other")
        return (isinstance(by, (int, float)) and not isinstance(by, bool) and 0 < by < math.inf
                and not kwargs.get("rounding_mode"))
    if func in _SOFTMAX:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return dim in (-1, x.dim() - 1) and kwargs.get("dtype") is None
    return False


def _served_argmax(args, kwargs):
    x = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    token = getattr(x, "_token", None)
    if token is None or dim is None or dim not in (-1, x.dim() - 1) or x.numel() != x.shape[-1]:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        if not 0 <= token < x.shape[-1] or float(x.reshape(-1)[token]) != 0.0:
            return None
    shape = tuple(x.shape[:-1]) + ((1,) if keepdim else ())
    return torch.full(shape, token, dtype=torch.long)


def _served_draw(args, kwargs):
    """``multinomial(probs, 1)`` of the served row after its softmax: the token, when the row
    holds probability 1 there and sums to 1 (so every other entry holds 0, also after an
    in-place write)."""
    x = args[0]
    n = kwargs.get("num_samples", args[1] if len(args) > 1 else None)
    token = getattr(x, "_token", None)
    if token is None or n != 1 or x.dim() not in (1, 2) or x.numel() != x.shape[-1]:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        row = x.reshape(-1)
        if not 0 <= token < row.numel() or float(row[token]) != 1.0 or float(row.sum()) != 1.0:
            return None
    return torch.full(tuple(x.shape[:-1]) + (1,), token, dtype=torch.long)


class HostLogits:
    """One loop's host logits ``(1, 1, vocab)`` whose argmax (and whose one draw) is a given
    token: 0 there, -inf elsewhere (``ServedLogits``). What the loop reads in place of the
    device's logits, so its own pick and ``.item()`` cost no device sync. One buffer, rewritten
    in two entries per token; a result is valid until the next call."""

    def __init__(self):
        self._logits: torch.Tensor | None = None
        self._hot: int | None = None

    def logits(self, token: int, vocab: int) -> ServedLogits:
        if self._logits is None or self._logits.shape[-1] != vocab:
            self._logits = torch.full((1, 1, vocab), float("-inf"))
            self._hot = None
        if self._hot is not None:
            self._logits[0, 0, self._hot] = float("-inf")
        self._logits[0, 0, token] = 0.0
        self._hot = token
        served = self._logits.as_subclass(ServedLogits)
        served._token = token
        return served


@dataclasses.dataclass
class _Launch:
    length: int  # valid tokens before the launch's first fed token
    position: int  # position of that token
    first: int | None  # that token; None while unknown (chained on the device)
    host: torch.Tensor  # where the chosen tokens land on the host
    done: object  # an event recorded after the copy, or None (CPU: synchronous)
    fed: list[int] = dataclasses.field(default_factory=list)
    nexts: list[int] = dataclasses.field(default_factory=list)
    cursor: int = 0


class Lookahead:
    """Serves one request's loop from multi-token launches (see the module docstring).

    ``decoder`` is the ``tiers.PagedDecoder`` (its current tier, ``room`` and ``step``);
    ``stops``: token ids after which the loop feeds nothing more (its end tokens; a token it
    feeds and then stops on, like ``</think>``, belongs here too); ``limit``: the most tokens the
    loop feeds, or None; ``sampling``: how the loop draws its tokens, or None (argmax).
    """

    def __init__(self, decoder, k: int, *, stops=(), limit: int | None = None,
                 sampling: Sampling | None = None):
        self.decoder = decoder
        self.k = k
        self.sampling = sampling
        self.stops = frozenset(stops)
        self.limit = limit
        self.fed_total = 0  # tokens the loop fed so far
        self.current: _Launch | None = None
        self.chained: _Launch | None = None
        cuda = decoder.model.device.type == "cuda"
        self._hosts = [torch.zeros(k, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._turn = 0
        self.vocab = 0
        self._served = HostLogits()

    def logits(self, token: int) -> ServedLogits:
        """``HostLogits.logits`` over this loop's vocabulary."""
        return self._served.logits(token, self.vocab)

    def next(self, token: int, position: int) -> int:
        """The loop feeds ``token`` at ``position``: returns the token that follows it."""
        self.fed_total += 1
        cur = self.current
        if cur is not None:
            i = cur.cursor + 1
            if i < len(cur.fed):
                if cur.fed[i] == token and cur.position + i == position:
                    cur.cursor = i
                    self._cache().keep(cur.length + i + 1)
                    return cur.nexts[i]
            elif (self.chained is not None and token == cur.nexts[-1]
                  and position == cur.position + len(cur.fed)):
                launch, self.chained = self.chained, None
                return self._serve(launch, token)
        self.drain()
        return self._start(token, position)

    def drain(self) -> None:
        """Forget what ran ahead (waiting for a launch still running: its rows are past the
        valid length, but its host buffer must be free before the next launch)."""
        if self.chained is not None and self.chained.done is not None:
            self.chained.done.synchronize()
        self.current = self.chained = None

    def _cache(self) -> PagedKVCache:
        return self.decoder.current.cache

    def _fits(self, length: int, k: int) -> bool:
        """Can ``k`` tokens after ``length`` run in the bucket the next token needs anyway?"""
        buckets = self.decoder.buckets
        return bucket_for(length + k, buckets) == bucket_for(length + 1, buckets)

    def _start(self, token: int, position: int) -> int:
        length = self._cache().length
        if self.k == 1 or not self._fits(length, self.k):
            # Near a bucket's end (or k = 1): one token at a time until the next bucket.
            logits = self.decoder.step(token, position)
            self.vocab = logits.shape[-1]
            stats.count(self.decoder.name, "host_picked_token")
            return int(chooser(self.sampling)(logits))
        self.decoder.room(length + self.k)
        launch = self._launch(length, position, token)
        return self._serve(launch, token)

    def _launch(self, length: int, position: int, token: int | None) -> _Launch:
        """Enqueue one launch; ``token`` None: start from the last launch's last token."""
        tier = self.decoder.current
        program = tier.program(self.k, self.sampling)
        tier.cache.reserve(length + self.k)
        if token is None:
            program.start_token.copy_(program.tokens[-1:])
        else:
            program.start_token.fill_(token)
        program.start_position.fill_(position)
        program.start_length.fill_(length + 1)
        self.vocab = program.runner.step().shape[-1]
        host = self._hosts[self._turn]
        self._turn ^= 1
        done = None
        if program.tokens.is_cuda:
            host.copy_(program.tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host.copy_(program.tokens)
        stats.count(self.decoder.name, "token_launch")
        return _Launch(length, position, token, host, done)

    def _serve(self, launch: _Launch, token: int) -> int:
        if launch.done is not None:
            launch.done.synchronize()
        launch.nexts = launch.host.tolist()
        launch.fed = [token] + launch.nexts[:-1]
        self.current = launch
        # Chained first: a chained launch that fails (its capture, or memory) then leaves the
        # cache without ``token``, which the eager loop taking over feeds again (kept first, it
        # was fed twice: on the H200 the text ran into one repeated word).
        self._chain(launch)
        self._cache().keep(launch.length + 1)
        return launch.nexts[0]

    def _chain(self, launch: _Launch) -> None:
        """Start the next launch now, from this one's last token, when it will be needed."""
        after = launch.length + self.k
        fed_after = self.fed_total - 1 + self.k  # tokens fed once this launch is used up
        if (self.stops.intersection(launch.nexts)
                or (self.limit is not None and fed_after >= self.limit)
                or after + self.k > self._cache().capacity
                or bucket_for(after + self.k, self.decoder.buckets) != self._cache().bucket):
            return
        self.chained = self._launch(after, launch.position + self.k, None)
