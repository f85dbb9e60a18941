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
- ``--cases attention_layouts`` (rows ``attention_layouts_ctxN``): FA3 alone on the one-request
  step's cache, whose block table is the identity, read as 16-key pages (the step's call), as
  bigger pages of the same memory, or as one plain sequence, each with FA3's split and with
  fixed split counts; whether each answer is bit-equal to the step's call
  (``benchmarks/results/h100-2026-12-07b``: nothing there worth a change).
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


def _graph_us(call) -> float:
    """``call(i)`` for every layer, warmed up on a side stream, captured as one graph: us per
    call over its replays."""
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
    del graph
    return graph_ms * 1e3 / LAYERS


def _measure(call, layers: _Layers) -> dict:
    """Warm up, check against fp32, capture LAYERS calls in one graph, time replays."""
    outs = [call(i) for i in range(LAYERS)]
    torch.cuda.synchronize()
    diff = max(float((outs[i].float().reshape(1, Q_HEADS, HEAD_DIM) - layers.reference(i))
                     .abs().max()) for i in (0, LAYERS - 1))
    eager_ms = common.time_ms(lambda: [call(i) for i in range(LAYERS)], warmup=2, repeats=5)
    us = _graph_us(call)
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


# -- the batched step's attention: vLLM's Triton decode kernel at the plugin's fixed row count ---

STEP_ROWS = 16  # hooks/sensenova_u1/batch.py: the batched step always runs 16 rows
SCRATCH_TOKENS = 64  # the pool's first tokens, read by idle rows (decode/batch/kv.py SCRATCH)


class _BatchLayers:
    """K/V of LAYERS layers for STEP_ROWS rows of ``ctx`` keys each, in one flat buffer per layer
    that any page size in ``pages`` divides: viewed as (blocks, page, kv_heads, d), row r owns
    the blocks after the scratch tokens, in order; idle rows read one scratch key."""

    def __init__(self, ctx: int, device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        tokens = SCRATCH_TOKENS + STEP_ROWS * ctx
        self.ctx, self.device = ctx, device
        self.k = [torch.randn((tokens, KV_HEADS, HEAD_DIM), generator=g, device=device,
                              dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.v = [torch.randn((tokens, KV_HEADS, HEAD_DIM), generator=g, device=device,
                              dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.q = [torch.randn((STEP_ROWS, Q_HEADS, HEAD_DIM), generator=g, device=device,
                              dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def table(self, page: int, active: int):
        """(block table, seqused) with the first ``active`` rows at ``ctx`` keys."""
        per_row = self.ctx // page
        first = SCRATCH_TOKENS // page
        table = torch.zeros(STEP_ROWS, per_row, dtype=torch.int32, device=self.device)
        for r in range(active):
            table[r] = torch.arange(first + r * per_row, first + (r + 1) * per_row,
                                    dtype=torch.int32, device=self.device)
        seqused = torch.ones(STEP_ROWS, dtype=torch.int32, device=self.device)
        seqused[:active] = self.ctx
        return table, seqused

    def reference_row0(self, i: int) -> torch.Tensor:
        """Row 0's attention over its keys in fp32, (q_heads, d)."""
        keys = slice(SCRATCH_TOKENS, SCRATCH_TOKENS + self.ctx)
        group = Q_HEADS // KV_HEADS
        k = self.k[i][keys].float().repeat_interleave(group, dim=1)
        v = self.v[i][keys].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", self.q[i][0].float(), k) * self.scale
        return torch.einsum("hl,lhd->hd", s.softmax(-1), v)


def _batch_call(fn, layers: _BatchLayers, page: int, splits: int, active: int):
    table, seqused = layers.table(page, active)
    dev = layers.device
    partial = torch.zeros(STEP_ROWS, Q_HEADS, splits, HEAD_DIM + 1, dtype=torch.float32,
                          device=dev)
    lse = torch.zeros(STEP_ROWS, Q_HEADS, dtype=torch.float32, device=dev)
    one = torch.ones((), dtype=torch.float32, device=dev)
    outs = [torch.empty_like(q) for q in layers.q]

    def call(i):
        k = layers.k[i].view(-1, page, KV_HEADS, HEAD_DIM)
        v = layers.v[i].view(-1, page, KV_HEADS, HEAD_DIM)
        fn(layers.q[i], k, v, outs[i], lse, table, seqused, partial, splits, layers.scale, page,
           k_scale=one, v_scale=one)
        return outs[i]

    call.keep = (table, seqused, partial, lse, one)
    return call


def bench_batch_attention(args, rows, env, log):
    """Rows ``batch_attention_ctxN_rR_sS_pP``: one attention call of the batched step (16 rows,
    ``R`` of them at N keys, the rest idle) through vLLM's Triton decode kernel with ``S`` fixed
    splits and page size ``P``, us per call as a graph of LAYERS calls, against the plugin's
    configuration (16 splits, page 16: ``speedup_vs_current``). ``row0_same_at_8_and_16_rows``:
    row 0's output bit for bit whether 8 or 16 rows decode (what batch invariance needs);
    ``max_abs_diff``: row 0 against fp32. Issue #42's batched-step target (the profile of
    h200-2026-12-02d: this kernel's first stage 29 us a layer at 8 rows of 2048 keys, where
    their bytes take ~17 us)."""
    from vllm_omni_graphdecode.decode.batch import kv as batch_kv

    splits_list = [int(s) for s in getattr(args, "batch_splits", "8,16,32").split(",")]
    pages = [int(p) for p in getattr(args, "batch_pages", "16,32,64").split(",")]
    bad = [p for p in pages if SCRATCH_TOKENS % p or any(c % p for c in args.contexts)]
    if bad or not splits_list or min(splits_list) < 1:
        raise ValueError(f"--batch-pages {pages} / --batch-splits {splits_list}: accepted: page "
                         f"sizes that divide {SCRATCH_TOKENS} and every context, and positive "
                         f"split counts")
    attention = batch_kv.select_attention("cuda")
    if not isinstance(attention, batch_kv.BatchAttention):
        raise RuntimeError(attention.describe())
    fn = None
    for name in batch_kv._KERNEL_MODULES:
        try:
            fn = __import__(name, fromlist=["decode_attention_fwd"]).decode_attention_fwd
            break
        except ImportError:
            continue
    for ctx in args.contexts:
        layers = _BatchLayers(ctx, "cuda", seed=ctx)
        results, current = [], {}
        for page in pages:
            for splits in splits_list:
                pair = []
                for active in (8, 16):
                    call = _batch_call(fn, layers, page, splits, active)
                    name = f"batch_attention_ctx{ctx}_r{active}_s{splits}_p{page}"
                    try:
                        timing = _measure_batch(call, layers, active)
                    except Exception as exc:
                        rows.append({"case": name, "error": f"{type(exc).__name__}: "
                                                            f"{str(exc)[:300]}"})
                        continue
                    pair.append({"case": name, "rows": active, "splits": splits, "page": page,
                                 **timing})
                    if (page, splits) == (batch_kv.BLOCK_SIZE, batch_kv.SPLITS):
                        current[active] = pair[-1]["us"]
                if pair:
                    # Row 0 at 8 and at 16 rows: the same keys, other neighbours.
                    a = _batch_call(fn, layers, page, splits, 8)(0).clone()
                    b = _batch_call(fn, layers, page, splits, 16)(0)
                    torch.cuda.synchronize()
                    for row in pair:
                        row["row0_same_at_8_and_16_rows"] = bool(torch.equal(a[0], b[0]))
                results.extend(pair)
        for row in results:
            if row["rows"] in current:
                row["speedup_vs_current"] = round(current[row["rows"]] / row["us"], 3)
            rows.append(row)
            log(f"{row['case']}: {row['us']} us ({row['kv_gb_s']} GB/s), "
                f"invariant {row['row0_same_at_8_and_16_rows']}")
        del layers
        torch.cuda.empty_cache()


def _measure_batch(call, layers: _BatchLayers, active: int) -> dict:
    """As ``_measure``: check row 0 against fp32, a graph of LAYERS calls, time replays."""
    out = call(0)
    torch.cuda.synchronize()
    diff = float((out[0].float() - layers.reference_row0(0)).abs().max())
    us = _graph_us(call)
    kv_bytes = 2 * active * layers.ctx * KV_HEADS * HEAD_DIM * 2
    return {"us": round(us, 2), "kv_gb_s": round(kv_bytes / (us * 1e-6) / 1e9, 1),
            "max_abs_diff": round(diff, 5)}


# -- the one-request step's cache read other ways: same memory, same keys --------------------

def _fa3_layout_call(layers: _Layers, layout: str, splits: int = 0):
    """FA3 over ``layers``' K/V as the one-request step would call it with its plan made once
    (``scheduler_metadata``, as ``ops.attention._fa3_schedule`` does), reading the identity-table
    cache (``decode/paged.py``) as: ``page16`` (the step's call today), ``pageN`` (the same
    memory viewed as N-key pages, the table ``arange``) or ``contiguous`` (one (1, keys, h, d)
    sequence, no table: FA3's non-paged loads)."""
    from vllm.vllm_flash_attn.flash_attn_interface import (flash_attn_varlen_func,
                                                           get_scheduler_metadata)

    ctx = layers.ctx
    if layout == "contiguous":
        page, table = None, None
        ks = [k.view(1, ctx, KV_HEADS, HEAD_DIM) for k in layers.k]
        vs = [v.view(1, ctx, KV_HEADS, HEAD_DIM) for v in layers.v]
    else:
        page = int(layout.removeprefix("page"))
        table = torch.arange(ctx // page, dtype=torch.int32, device="cuda")[None]
        ks = [k.view(-1, page, KV_HEADS, HEAD_DIM) for k in layers.k]
        vs = [v.view(-1, page, KV_HEADS, HEAD_DIM) for v in layers.v]
    plan = get_scheduler_metadata(
        batch_size=1, max_seqlen_q=1, max_seqlen_k=ctx, num_heads_q=Q_HEADS,
        num_heads_kv=KV_HEADS, headdim=HEAD_DIM, cache_seqlens=layers.seqused,
        qkv_dtype=torch.bfloat16, cu_seqlens_q=layers.cu_seqlens_q, page_size=page,
        causal=False, num_splits=splits)

    def call(i):
        return flash_attn_varlen_func(
            layers.q[i], ks[i], vs[i], max_seqlen_q=1, cu_seqlens_q=layers.cu_seqlens_q,
            max_seqlen_k=ctx, seqused_k=layers.seqused, block_table=table,
            softmax_scale=layers.scale, causal=False, fa_version=3, scheduler_metadata=plan,
            num_splits=splits)

    call.keep = (plan, table)
    return call


LAYOUTS = ("page16", "page64", "page128", "page256", "contiguous")
LAYOUT_SPLITS = (0, 1, 2, 4, 8, 16, 32)


def bench_attention_layouts(args, rows, env, log):
    """Rows ``attention_layouts_ctxN``: FA3's us per call on the one-request step's cache for
    each layout in ``LAYOUTS`` with FA3's own split (0), and for ``page16`` and ``contiguous``
    each fixed split count in ``LAYOUT_SPLITS``; ``same_as_page16``: the output bit-equal to the
    step's call today."""
    for ctx in args.contexts:
        layers = _Layers(ctx, seed=ctx)
        row = {"kv_bytes_per_call": layers.kv_bytes, "layers_per_graph": LAYERS}
        base = [_fa3_layout_call(layers, "page16")(i) for i in (0, LAYERS - 1)]
        variants = [(lay, 0) for lay in LAYOUTS] + [
            (lay, s) for lay in ("page16", "contiguous") for s in LAYOUT_SPLITS if s]
        for lay, splits in variants:
            name = f"{lay}_splits{splits}" if splits else lay
            try:
                call = _fa3_layout_call(layers, lay, splits)
                got = _measure(call, layers)
                outs = [call(i) for i in (0, LAYERS - 1)]
                got["same_as_page16"] = all(torch.equal(a, b) for a, b in zip(outs, base))
                row[name] = got
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append({"case": f"attention_layouts_ctx{ctx}", **row})
        log(f"attention layouts ctx {ctx}: " + "; ".join(
            f"{k} {v.get('us', v.get('error'))}" for k, v in row.items() if isinstance(v, dict)))
        del layers
        torch.cuda.empty_cache()
