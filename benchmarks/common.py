"""Measurement helpers shared by the benchmark cases: timers, ceilings, environment record.

Every number a case reports is a median over repeats of CUDA-event-timed runs, warm-up excluded,
and every ceiling (copy bandwidth, bf16 matmul rate) is measured in the same process run, so a
result file compares like with like.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "vllm", "vllm-omni", "diffusers", "transformers", "flashinfer-python"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    # The offline bundle puts vllm-omni on sys.path without dist-info for the 0.30 stack.
    try:
        import vllm_omni

        out["vllm-omni"] = getattr(vllm_omni, "__version__", out["vllm-omni"])
    except Exception:
        pass
    return out


def gpu_info() -> dict:
    info = {"gpu": torch.cuda.get_device_name(0),
            "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "memory_mib": torch.cuda.get_device_properties(0).total_memory // 2**20}
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        info["driver"] = None
    return info


def machine(env: dict) -> dict:
    """The GPU and versions one run of a results file ran on, from the file's ``environment``:
    the runs of one file may come from separate device calls, on other machines or torches."""
    return {k: env.get(k) for k in ("gpu", "memory_mib", "driver")} | {"versions": env["versions"]}


def environment() -> dict:
    return {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "versions": versions(), **gpu_info()}


def time_ms(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 5,
            inner: int = 1) -> float:
    """Median wall time of ``inner`` calls of ``fn`` (ms per call), by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


class Marks:
    """Points on the device's timeline: CUDA events (recorded, never waited on until ``sync``),
    or ``perf_counter`` readings on a CPU, where every op has finished on return. ``mark(name)``
    also keeps the point under ``points[name]``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: dict[str, list] = {}

    def mark(self, name: str | None = None):
        if self.cuda:
            point = torch.cuda.Event(enable_timing=True)
            point.record()
        else:
            point = time.perf_counter()
        if name is not None:
            self.points.setdefault(name, []).append(point)
        return point

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def capture_graph(fn: Callable[[], object]):
    """``fn`` warmed up on a side stream, then captured: (the CUDA graph, what the capture
    returned: the output tensors a replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def copy_bandwidth_bytes_per_s(size_bytes: int = 4 << 30) -> float:
    """Device-to-device copy rate counted as read + write, the ceiling for a weight-streaming step."""
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, repeats=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * size_bytes / (ms / 1e3)


def matmul_flops_per_s(n: int = 8192) -> float:
    """bf16 dense matmul rate on random data, the ceiling for a compute-bound step."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, warmup=5, repeats=10, inner=5)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms / 1e3)


def percentiles(values: list[float]) -> dict:
    """p50 (the upper middle of an even count) and p99 of ``values``, as the request benchmarks
    report them; {} for none."""
    v = sorted(values)
    if not v:
        return {}
    return {"p50": v[len(v) // 2], "p99": v[min(len(v) - 1, int(round(0.99 * (len(v) - 1))))]}


def case(name: str, eager_ms: float | None, ours_ms: float | None, floor_ms: float | None,
         **extra) -> dict:
    row = {"case": name, "eager_ms": _r(eager_ms), "ours_ms": _r(ours_ms), "floor_ms": _r(floor_ms),
           "speedup": _r(eager_ms / ours_ms) if eager_ms and ours_ms else None,
           "of_floor": _r(ours_ms / floor_ms) if ours_ms and floor_ms else None}
    row.update({k: _r(v) if isinstance(v, float) else v for k, v in extra.items()})
    return row


def _r(x):
    return None if x is None else significant(x)


def significant(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits: a rate of 0.0012 TFLOP/s on a slow CPU keeps
    as many digits as 989.5 on an H200, so a figure recomputed from rounded fields agrees with
    the one computed before rounding on any machine."""
    return float(f"{float(x):.{digits}g}")


def random_init_(module: torch.nn.Module, std: float = 0.02) -> None:
    """Random weights in place, on whatever device the parameters live (fast on GPU)."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.dtype.is_floating_point:
                p.normal_(0.0, std, generator=g)


def ssim(a, b, data_range: float = 255.0) -> float:
    """Mean structural similarity of two images (H, W) or (H, W, C), each channel alone, then
    averaged: Wang et al. 2004 as ``skimage.metrics.structural_similarity`` computes it with
    ``gaussian_weights=True, sigma=1.5, use_sample_covariance=False`` (an 11x11 Gaussian window,
    K1 0.01, K2 0.03, edges mirrored, the 5-pixel border left out of the mean). 1.0: equal. Here
    in torch, because the GPU host has no scikit-image (a CPU test checks the two agree)."""
    import numpy as np

    x = torch.as_tensor(np.asarray(a), dtype=torch.float64)
    y = torch.as_tensor(np.asarray(b), dtype=torch.float64)
    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    if x.dim() == 2:
        x, y = x[..., None], y[..., None]
    radius = 5  # skimage: int(3.5 * sigma + 0.5) with sigma 1.5
    t = torch.arange(-radius, radius + 1, dtype=torch.float64)
    g = torch.exp(-0.5 * (t / 1.5) ** 2)
    g = g / g.sum()

    def blur(img):  # (C, H, W): separable Gaussian over mirrored edges (scipy's "reflect")
        img = _mirror(img, radius)
        img = torch.nn.functional.conv2d(img[:, None], g.view(1, 1, 1, -1))
        return torch.nn.functional.conv2d(img, g.view(1, 1, -1, 1))[:, 0]

    x, y = x.permute(2, 0, 1), y.permute(2, 0, 1)
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s[:, radius:-radius, radius:-radius].mean())


def _mirror(img: torch.Tensor, r: int) -> torch.Tensor:
    """``img`` (C, H, W) padded by ``r`` on both spatial sides, edge pixels repeated (numpy's
    "symmetric", scipy.ndimage's "reflect")."""
    img = torch.cat([img[:, :r].flip(1), img, img[:, -r:].flip(1)], dim=1)
    return torch.cat([img[:, :, :r].flip(2), img, img[:, :, -r:].flip(2)], dim=2)
