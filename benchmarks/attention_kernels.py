"""One paged single-token attention call, kernel against kernel: FA3, FA2 and FlashInfer.

    python benchmarks/bench.py --out DIR --cases attention [--fa 3,2] [--contexts 512,2048,8192]

Rows ``attention_paged_decode_ctxN``: microseconds per call at SenseNova-U1's decode shape (32 query
heads, 8 KV heads, head_dim 128, bf16, batch 1, one query token), each kernel run as a CUDA-graph
replay the way the plugin's decode graph runs it. A graph holds one call per layer (42), each layer
with its own K/V buffers, so consecutive calls do not find their K/V in L2 (60 MB) any more than
they do in a real step; ``us`` is the replay time over 42. ``kv_gb_s`` is the K/V bytes a call must
read over that time. ``max_abs_diff`` is against fp32 attention over the same keys.

- FA3 / FA2: vllm's ``vllm.vllm_flash_attn.flash_attn_varlen_func`` with ``seqused_k`` and
  ``block_table`` (block size 16, the plugin's), ``fa_version`` 3 or 2. FA2 has no sm_90 machine
  code in vllm's wheel: its first call JIT-compiles PTX for ~106 s (measured on the H200, CONTRIBUTING.md), so it runs only when
  ``--fa`` names 2, after a warm-up call.
- FlashInfer: ``BatchDecodeWithPagedKVCacheWrapper`` (NHD, page size 16, CUDA-graph mode, planned
  once per context outside the graph). vllm 0.26.0 pins flashinfer-python 0.6.14, which is not in
  the offline bundle; ``scripts/gpu/build_flashinfer_bundle.sh`` packs its wheel into
  ``.gpu-bundle-fi/`` (5.5 MiB), whose ``unpack.py`` puts it into /tmp/site-fi. Its decode kernel
  is compiled on first use by nvcc + ninja (75-98 s on 2 cores with nvcc 13.0 for sm_90a, against
  tvm-ffi 0.1.11 and 0.1.15's headers; fewer seconds on the host's 16 cores).
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

import common

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 32, 8, 128, 42, 16
FLASHINFER_SITE = os.environ.get("GRAPHDECODE_FLASHINFER_SITE", "/tmp/site-fi")
FLASHINFER_PIN = "0.6.14"  # vllm 0.26.0's Requires-Dist


def import_flashinfer():
    """``flashinfer``, from the environment or from the unpacked ``.gpu-bundle-fi`` (appended to
    sys.path only now, so nothing else in the process sees it). Raises ImportError with the why."""
    try:
        import flashinfer

        return flashinfer
    except ImportError as first:
        if not os.path.isdir(FLASHINFER_SITE):
            raise ImportError(
                f"flashinfer is not importable ({first}) and {FLASHINFER_SITE} does not exist: "
                f"flashinfer-python {FLASHINFER_PIN} (vllm 0.26.0's pin, 14 MiB wheel) is not in "
                f"the offline bundle; build .gpu-bundle-fi with "
                f"scripts/gpu/build_flashinfer_bundle.sh and run its unpack.py") from None
    sys.path.append(FLASHINFER_SITE)
    import flashinfer

    return flashinfer


def _prepare_jit_env() -> dict:
    """What FlashInfer's JIT needs to find on a host whose nvcc is a wrapper script and whose
    toolkit may lack ``libcuda.so`` (only the driver's ``libcuda.so.1`` exists): CUDA_HOME, and a
    link folder for ``-lcuda``/``-lcudart`` pointing at the libraries this process loaded."""
    done = {}
    if not os.environ.get("CUDA_HOME"):
        for home in ("/usr/local/cuda", "/usr/local/cuda-13.0"):
            if os.path.exists(os.path.join(home, "bin", "nvcc")):
                os.environ["CUDA_HOME"] = home
                break
    done["CUDA_HOME"] = os.environ.get("CUDA_HOME")
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        loaded = loaded_libs(f)
    links = os.path.join(FLASHINFER_SITE if os.path.isdir(FLASHINFER_SITE) else "/tmp",
                         "graphdecode-link-libs")
    os.makedirs(links, exist_ok=True)
    for lib, path in loaded.items():
        dst = os.path.join(links, lib)
        if os.path.lexists(dst) and os.path.realpath(dst) != os.path.realpath(path):
            os.remove(dst)
        if not os.path.lexists(dst):
            os.symlink(path, dst)
    extra = os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")
    if links not in extra:
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"{extra} -L{links}".strip()
    done["link_libs"] = loaded
    return done


def loaded_libs(maps_lines, names=("libcuda.so", "libcudart.so")) -> dict[str, str]:
    """{name: path} of the versioned shared libraries (``name.N...``) in /proc/self/maps lines."""
    loaded: dict[str, str] = {}
    for line in maps_lines:
        path = line.split()[-1] if "/" in line else ""
        base = os.path.basename(path)
        for lib in names:
            if base.startswith(lib + ".") and lib not in loaded:
                loaded[lib] = path
    return loaded


class _Layers:
    """K/V for LAYERS layers at one context, paged (blocks, 16, kv_heads, d), identity table."""

    def __init__(self, ctx: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        blocks = ctx // BLOCK
        shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.ctx = ctx
        self.k = [torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
                  for _ in range(LAYERS)]
        self.v = [torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
                  for _ in range(LAYERS)]
        self.q = [torch.randn((1, Q_HEADS, HEAD_DIM), generator=g, device="cuda",
                              dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.block_table = torch.arange(blocks, dtype=torch.int32, device="cuda")[None]
        self.cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        self.seqused = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        self.scale = 1.0 / math.sqrt(HEAD_DIM)
        self.kv_bytes = 2 * ctx * KV_HEADS * HEAD_DIM * 2

    def reference(self, i: int) -> torch.Tensor:
        k = self.k[i].view(-1, KV_HEADS, HEAD_DIM)[: self.ctx].float()
        v = self.v[i].view(-1, KV_HEADS, HEAD_DIM)[: self.ctx].float()
        group = Q_HEADS // KV_HEADS
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", self.q[i][0].float(), k) * self.scale
        return torch.einsum("hl,lhd->hd", s.softmax(-1), v)[None]


def _fa_call(layers: _Layers, version: int):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def call(i):
        return flash_attn_varlen_func(
            layers.q[i], layers.k[i], layers.v[i], max_seqlen_q=1, cu_seqlens_q=layers.cu_seqlens_q,
            max_seqlen_k=layers.ctx, seqused_k=layers.seqused, block_table=layers.block_table,
            softmax_scale=layers.scale, causal=False, fa_version=version)

    return call


def _flashinfer_call(fi, layers: _Layers):
    blocks = layers.ctx // BLOCK
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    indptr = torch.tensor([0, blocks], dtype=torch.int32, device="cuda")
    indices = torch.arange(blocks, dtype=torch.int32, device="cuda")
    last = torch.tensor([BLOCK], dtype=torch.int32, device="cuda")
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    # plan() reads the lengths on the host and fixes the split: once per context, outside graphs.
    wrapper.plan(indptr.cpu(), indices.cpu(), last.cpu(), Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK,
                 pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=layers.scale)

    def call(i):
        return wrapper.run(layers.q[i], (layers.k[i], layers.v[i]))

    call.keep = (wrapper, workspace, indptr, indices, last)
    return call


def _measure(call, layers: _Layers) -> dict:
    """Warm up, check against fp32, capture LAYERS calls in one graph, time replays."""
    outs = [call(i) for i in range(LAYERS)]
    torch.cuda.synchronize()
    diff = max(float((outs[i].float().reshape(1, Q_HEADS, HEAD_DIM) - layers.reference(i))
                     .abs().max()) for i in (0, LAYERS - 1))
    eager_ms = common.time_ms(lambda: [call(i) for i in range(LAYERS)], warmup=2, repeats=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(LAYERS):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            call(i)
    graph_ms = common.time_ms(graph.replay, warmup=5, repeats=7, inner=10)
    us = graph_ms * 1e3 / LAYERS
    del graph
    return {"us": round(us, 2), "eager_us": round(eager_ms * 1e3 / LAYERS, 2),
            "kv_gb_s": round(layers.kv_bytes / (us * 1e-6) / 1e9, 1),
            "max_abs_diff": round(diff, 5)}


def bench_attention(args, rows, env, log):
    """Rows ``attention_paged_decode_ctxN``: FA3 (and FA2 when --fa has 2), FlashInfer."""
    fi, fi_note, fi_env = None, None, {}
    try:
        fi_env = _prepare_jit_env()  # before the import: FlashInfer reads some of it then
        fi = import_flashinfer()
        env["flashinfer"] = {"version": getattr(fi, "__version__", None),
                             "file": getattr(fi, "__file__", None), **fi_env}
    except Exception as exc:
        fi_note = f"not measured: {type(exc).__name__}: {exc}"
    log(f"attention: flashinfer {'ok ' + str(env.get('flashinfer')) if fi else fi_note}")
    versions = [3] + ([2] if "2" in args.fa else [])
    fa2_note = None
    if 2 in versions:
        # The first FA2 call compiles its PTX (~106 s); do it once before anything is timed.
        start = time.perf_counter()
        try:
            warm = _Layers(512, seed=99)
            _fa_call(warm, 2)(0)
            torch.cuda.synchronize()
            env["fa2_first_call_s"] = round(time.perf_counter() - start, 1)
            log(f"attention: FA2 first call (PTX JIT) {env['fa2_first_call_s']} s")
        except Exception as exc:  # e.g. the bundle without .gpu-bundle-3 has no FA2 library
            fa2_note = f"not measured: {type(exc).__name__}: {str(exc)[:300]}"
            versions.remove(2)
            log(f"attention: FA2 {fa2_note}")
    fi_jit_s = None
    for ctx in args.contexts:
        layers = _Layers(ctx, seed=ctx)
        row = {"kv_bytes_per_call": layers.kv_bytes, "layers_per_graph": LAYERS,
               "block_size": BLOCK}
        if fa2_note:
            row["fa2"] = {"note": fa2_note}
        for v in versions:
            try:
                row[f"fa{v}"] = _measure(_fa_call(layers, v), layers)
            except Exception as exc:
                row[f"fa{v}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if fi is not None:
            try:
                start = time.perf_counter()
                call = _flashinfer_call(fi, layers)  # the first plan() JIT-compiles
                if fi_jit_s is None:
                    fi_jit_s = round(time.perf_counter() - start, 1)
                    row["flashinfer_first_plan_s"] = fi_jit_s
                row["flashinfer"] = _measure(call, layers)
            except Exception as exc:
                row["flashinfer"] = {"error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
                # A failed build would be retried (minutes) at every context: stop here.
                fi, fi_note = None, f"not measured: failed at context {ctx}, see that row"
        else:
            row["flashinfer"] = {"note": fi_note}
        rows.append({"case": f"attention_paged_decode_ctx{ctx}", **row})
        log(f"attention ctx {ctx}: " + "; ".join(
            f"{k} {v.get('us', v.get('error', v.get('note')))}" for k, v in row.items()
            if isinstance(v, dict)))
        del layers
        torch.cuda.empty_cache()
