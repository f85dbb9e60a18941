#!/usr/bin/env python3
"""Warm vllm's FA2 on a fresh GPU host: vllm-omni 0.30's in-tree SenseNova-U1 decode runs it.

    PYTHONPATH=<0.30 stack> CUDA_CACHE_MAXSIZE=4294967296 python3 scripts/gpu/warm_fa2.py

vllm's FA2 library carries no sm_90 machine code, only compute_80 PTX, so the driver compiles a
kernel's module the first time it runs (128 s on the H200, h200-2026-12-02b) and keeps the result
in its cache (`CUDA_CACHE_MAXSIZE`) for every later process on that host. The two stacks carry
different FA2 libraries (vllm 0.26's for torch 2.11, vllm 0.30's for 2.13): warm the one the run
will use, in its environment (scripts/gpu/torch213_env.sh for 2.13). A test or benchmark whose first
in-tree decode call pays that inside its own time limit looks hung: in h200-2026-12-02 the 0.30
decode file stopped for good inside `flash_attn_varlen_func` in the in-tree capture's warm-up,
on a machine where nothing had called FA2 before. This makes the in-tree decode's call, through
its own `PagedDecodeCache.attend`, at the head sizes the tests and benchmarks use, and prints
each call's time as JSON.
"""
import json
import time

import torch


def main():
    from vllm_omni.diffusion.models.sensenova_u1 import paged_decode as PD
    from transformers.cache_utils import DynamicCache

    out = []
    for heads, kv_heads, head_dim in ((4, 2, 128), (32, 8, 128)):
        torch.manual_seed(0)
        cache = DynamicCache()
        keys, values = (torch.randn(1, kv_heads, 300, head_dim, device="cuda",
                                    dtype=torch.bfloat16) for _ in range(2))
        cache.update(keys, values, 0)
        paged = PD.PagedDecodeCache.from_dynamic_cache(cache, 1, torch.device("cuda"),
                                                       torch.bfloat16)
        paged.set_length(301)
        q = torch.randn(1, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        start = time.perf_counter()
        paged.attend(0, q, k, v, head_dim ** -0.5)
        torch.cuda.synchronize()
        out.append(dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        first_call_s=round(time.perf_counter() - start, 2)))
        print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
