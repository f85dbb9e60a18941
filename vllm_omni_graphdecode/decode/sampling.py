"""The seeded per-request draws of a batched decode: each row's next token chosen on the device,
the argmax or a Gumbel-max draw from ``softmax(logits / t)`` whose noise is a counter-based hash
of (the request's seed, the token's position, the vocabulary index). The same numbers whatever
else decodes beside the row and on every device (the device's global generator would hand each
row whatever its neighbours left); ``batch/decoder.py`` calls ``choose`` after every step.
"""

from __future__ import annotations

import dataclasses

import torch

# Multipliers of the counter-based hash (splitmix64's); int64 arithmetic wraps in torch.
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_LOW31 = (1 << 31) - 1


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniform(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) float32 in (0, 1): a hash of (seed, position, vocabulary index) per entry.

    ``seed``/``position`` (rows,) int64. splitmix64's finaliser over a key mixing the three; 24
    bits become the uniform. Deterministic on every device and independent of the batch.
    """
    key = (seed * _GOLDEN + position)[:, None] * _GOLDEN
    key = key + torch.arange(vocab, device=seed.device, dtype=torch.int64)[None, :]
    key = (key ^ _shr(key, 30)) * _MIX1
    key = (key ^ _shr(key, 27)) * _MIX2
    key = key ^ _shr(key, 31)
    bits = _shr(key, 40).to(torch.float32)  # the top 24 bits
    return (bits + 0.5) * (1.0 / (1 << 24))


def choose(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
           position: torch.Tensor, sampled: bool) -> torch.Tensor:
    """(rows,) long: each row's next token. ``temperature`` (rows,) float32, 0 for the argmax
    (the loops' greedy pick, first maximum on ties); > 0: argmax of ``logits / t + Gumbel``, a
    draw from ``softmax(logits / t)``. ``sampled`` False: every row takes the argmax."""
    logits = logits.reshape(-1, logits.shape[-1])
    greedy = torch.argmax(logits, dim=-1)
    if not sampled:
        return greedy
    u = uniform(seed, position, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    t = temperature.clamp(min=1e-6)[:, None]
    drawn = torch.argmax(logits.float() / t + gumbel, dim=-1)
    return torch.where(temperature > 0, drawn, greedy)


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """How a row's loop picks: ``temperature`` 0 is the argmax; > 0 draws with ``seed``."""

    temperature: float = 0.0
    seed: int = 0
