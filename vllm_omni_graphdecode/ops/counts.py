"""Zeroed int32 count buffers for launches whose last program finishes the work: the one-row
GEMV's norm folds (a count per row, ``fp8/gemv.py``'s ``norm``) and the row GEMM's split adds (a
count per weight block, ``rows_gemm.py``). The program that counts last puts its count back to
zero, so one buffer serves every launch on a stream, in graphs and out."""

from __future__ import annotations

import os

import torch


class CountBuffers:
    """One zeroed buffer of ``size`` counts per device. ``on(device)`` makes it at the first
    call outside a graph capture (a step's warm-ups come before its capture) and answers None
    inside a capture before that (the caller runs its launches apart, without counts), and off
    CUDA unless Triton's interpreter runs the kernels (the CPU tests)."""

    def __init__(self, size: int):
        self.size = size
        self.made: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor | None:
        device = torch.device(device)
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return None
        buf = self.made.get(device)
        if buf is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            buf = self.made[device] = torch.zeros(self.size, dtype=torch.int32, device=device)
        return buf
