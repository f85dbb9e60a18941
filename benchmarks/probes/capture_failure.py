"""What a failed CUDA graph capture leaves behind in this torch, one thing at a time. Prints JSON;
writes ``capture-failure.json`` to --out.

    python benchmarks/probes/capture_failure.py --out DIR

The question it settles (``vllm_omni_graphdecode.cuda_graphs``, ``recover_failed_capture``):
after a capture that fails at ``capture_end`` (here a host sync inside it, as in the GPU test),
is the pool still marked as recording, and by which allocator? torch's ``CUDAGraph.cpp`` as
published in 2026 marks the pool in the device caching allocator and in the pinned-host
allocator at ``capture_begin``, and ends both marks only after ``cudaStreamEndCapture``
succeeds. The device mark can be ended from Python (``torch._C._cuda_endAllocateToPool``, which
the repair calls); no binding ends the host one. On the H200 (torch 2.11), after the plugin's
failed capture and its repair, a capture into the same pool raised "beginAllocateToPool: already
recording to mempool_id" (the plugin's graphs then shared vLLM's global pool, so vLLM's own next
capture failed). This probe says which mark was left. On the H200 (torch 2.11, results
h200-2026-12-02): the device mark was ended from Python and the pool still refused a capture; a
fresh pool took one.

Steps, each recorded: fail a capture into a fresh pinned pool; is this thread's stream still the
capture stream; does ending the device allocator's mark succeed (it was left) or raise (it was
not); after that, does a second capture into the same pool succeed; does a capture into another
pool succeed; does a pinned host allocation work.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from vllm_omni_graphdecode import cuda_graphs  # noqa: E402


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _capture_into(pool, x: torch.Tensor, side) -> dict:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, pool=pool):
                x.add_(1)
    except RuntimeError as exc:  # the outer stream context gave the caller's stream back
        return {"ok": False, "error": _error(exc)}
    before = x.clone()
    graph.replay()
    torch.cuda.synchronize()
    return {"ok": bool(torch.equal(x, before + 1)), "graph": graph}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device", "command": " ".join(sys.argv)}))
        return
    device = torch.device("cuda", torch.cuda.current_device())
    result: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "gpu": torch.cuda.get_device_name(device)}
    pool = torch.cuda.graph_pool_handle()
    anchor = cuda_graphs._pin(pool, device)  # the pool's graph count never reaches 0
    x = torch.zeros(4, device=device)
    side = torch.cuda.Stream(device=device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    failing = torch.cuda.CUDAGraph()
    try:
        # As cuda_graphs._capture does it: no stream context around the capture's own, which
        # would give the caller's stream back and hide whether a failure left the capture's.
        with torch.cuda.graph(failing, pool=pool, capture_error_mode="thread_local"):
            (x + 1).sum().item()  # a host sync: illegal while capturing
        result["capture_error"] = None
    except Exception as exc:  # noqa: BLE001 - what it raises is what is recorded
        result["capture_error"] = _error(exc)
    result["stream_left_on_capture_stream"] = torch.cuda.current_stream(device) != current
    torch.cuda.set_stream(current)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        result["device_allocator_mark_left"] = "unknown: no _cuda_endAllocateToPool in this torch"
    else:
        try:
            end(device.index, pool)
            result["device_allocator_mark_left"] = True
        except RuntimeError as exc:
            result["device_allocator_mark_left"] = False
            result["device_allocator_end_error"] = _error(exc)
    try:
        generator = torch.cuda.default_generators[device.index]
        generator.graphsafe_set_state(generator.clone_state())
    except (AttributeError, RuntimeError) as exc:
        result["generator_repair_error"] = _error(exc)
    del failing
    gc.collect()
    same = _capture_into(pool, x, side)
    result["same_pool_takes_a_capture"] = same["ok"]
    result["same_pool_error"] = same.get("error")
    other = _capture_into(torch.cuda.graph_pool_handle(), x, side)
    result["fresh_pool_takes_a_capture"] = other["ok"]
    result["fresh_pool_error"] = other.get("error")
    try:
        pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        pinned.fill_(1)
        result["pinned_host_allocation"] = bool(pinned.is_pinned())
    except RuntimeError as exc:
        result["pinned_host_allocation"] = _error(exc)
    del anchor
    text = json.dumps(result, indent=2)
    with open(os.path.join(args.out, "capture-failure.json"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
