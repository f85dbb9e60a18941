"""Benchmarks that decide the plugin's defaults. Prints JSON; writes JSON + PNG to --out.

    python benchmarks/bench.py --out DIR [--cases sensenova_decode,qwen_image_21_step,memory]
    python benchmarks/bench.py --out DIR --cases profile,memory     (where the time goes; ~4 min)
    python benchmarks/bench.py --out DIR --cases attention [--fa 3,2]  (paged-attention kernels)
    python benchmarks/bench.py --out DIR --cases batch_attention --contexts 2048  (the batched
        step's attention at each split count and page size)

Every side of a comparison runs in this one process, on random weights at the real layer shapes
(bf16), timed with CUDA events, warm-up excluded, median of repeats; the ceilings (copy bandwidth,
bf16 matmul rate) are measured in the same run. Run it through scripts/gpu/run_suite.sh on a GPU
host (CONTRIBUTING.md).

Cases (names as in the result rows):
  sensenova_decode_ctxN[_fa2|_fa3|_fa3_kK|_fa3_exact|_intree|_fp8|_fp8_lmhead]: ms/token of
      SenseNova-U1's text
      loop (`_generate_text`, which is what a request runs: argmax and `.item()` every step) eager
      vs the plugin (paged + graph, FA3 and FA2 at the defaults; FA3 at each tokens-per-launch K
      and with the model's own step), or vs vllm-omni 0.30's in-tree path when that is the stack.
      With --fp8, ``_fp8``: the step's linear layers on FP8 weight copies (issue #23), with its
      bf16 row's time, the in-tree path's on 0.30, and greedy-token agreement with the bf16 step;
      with --fp8-lm-head also ``_fp8_lmhead``: lm_head in FP8 too, compared with ``_fp8`` as well.
      Floor: the bytes a decode step must read (understanding weights without `*_mot_gen`, one
      embedding row, lm_head, and the K/V at that context) over the measured copy bandwidth.
  sensenova_sampled_ctxN_kK: the same text loop sampling (do_sample, temperature 0.7): eager vs
      the plugin at each tokens-per-launch K (1: the loop draws from the graph's logits; more:
      the device draws, as the loop's own code would).
  sensenova_think_T: one whole `_generate_think` of T tokens (ms per request): eager, the plugin,
      and on 0.30 its in-tree path (`intree_ms`).
  qwen_image_21_step_{t2i,edit2}_{512,1024}[_exact]: ms per cached denoising step of diffusers'
      QwenImage21Transformer2DModel, eager vs the plugin's graph. Floor: the step's FLOPs over the
      measured bf16 matmul rate.
  memory_*: device memory after each of 20 requests, capture time, first-request latency with and
      without pre-capture (``--memory-steps`` tokens per request).
  profile_*: a summary row per profile; the profiles themselves (kernels per step, GPU busy vs
      wall, time by kernel category, top kernels, achieved GEMM bandwidth) go to
      ``profile-<tag>.json`` and a table on stderr (``profile_step.py``).
  sensenova_image_step_S, sensenova_t2i_S, sensenova_t2i_think_S: SenseNova-U1 image generation
      (one denoising step of all CFG branches; the whole text-to-image request with the think
      off and on) through ``SenseNovaU1Pipeline.forward``, vllm-omni's default path vs the plugin
      on the same pipeline object, by ``sensenova_request.py`` (which documents the rows, the
      breakdown and the floor); its own JSON and log go to ``--out``/sensenova-request.
      ``--image-args`` passes that script's options (default: 1024x1024, 50 steps, CFG 4, think
      off and on, one branch step profiled per side; ~5 min and ~36 GB on an H200).
  attention_paged_decode_ctxN: one paged decode attention call, FA3 / FA2 / FlashInfer, as graph
      replays (``attention_kernels.py``).
  batch_attention_ctxN_rR_sS_pP: one attention call of the batched step (16 rows, R decoding)
      through vLLM's Triton decode kernel at S fixed splits and page size P, against the
      plugin's 16 and 16, with whether row 0 stays bit-equal beside other rows
      (``attention_kernels.bench_batch_attention``).

The SenseNova-U1 model (17.5 B random parameters) is built once per process and shared by the
cases that use it; it is dropped before the Qwen-Image-2.1 parts when no later case needs it, so
memory readings stay comparable with a run of one case.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import profile_step  # noqa: E402
import qwen_step  # noqa: E402
from plot import plot  # noqa: E402
from vllm_omni_graphdecode import config  # noqa: E402
from vllm_omni_graphdecode.core import stats  # noqa: E402
from vllm_omni_graphdecode.hooks import sensenova_u1  # noqa: E402
from vllm_omni_graphdecode.hooks.sensenova_u1 import wiring as sensenova_wiring  # noqa: E402
from vllm_omni_graphdecode.ops import attention  # noqa: E402
from vllm_omni_graphdecode.testing import sensenova as rm, qwen as qwen_models  # noqa: E402

SENSENOVA_SHAPE = dict(num_layers=42, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                       intermediate=12288, vocab=151936)


LM_CASES = ("sensenova_decode", "sensenova_sampled", "sensenova_think", "profile", "memory")  # cases that use the SenseNova-U1 model
_shared: dict = {}


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sensenova_model():
    """(language model, tokenizer) at SENSENOVA_SHAPE, built once per process; the end tokens'
    lm_head rows are zero so every loop runs its full length."""
    if "lm" not in _shared:
        start = time.perf_counter()
        lm = rm.build_lm(rm.llm_config(**SENSENOVA_SHAPE), device="cuda", dtype=torch.bfloat16,
                         seed=0, on_device_init=True)
        tok = rm.build_tokenizer(SENSENOVA_SHAPE["vocab"])
        with torch.no_grad():
            for end in ("<|im_end|>", "</think>"):
                lm.lm_head.weight[tok.convert_tokens_to_ids(end)].zero_()
        torch.cuda.synchronize()
        _shared.update(lm=lm, tok=tok)
        log(f"SenseNova-U1 model built in {time.perf_counter() - start:.1f} s")
    return _shared["lm"], _shared["tok"]


def release_model_unless_needed(args):
    """Drop the shared model when no case after the current one uses it."""
    if "lm" in _shared and not any(c in LM_CASES for c in args.pending):
        _shared.clear()
        torch.cuda.empty_cache()


def copy_bandwidth(env) -> float:
    if "copy_bandwidth" not in _shared:
        _shared["copy_bandwidth"] = common.copy_bandwidth_bytes_per_s()
        env["copy_bandwidth_tb_s"] = round(_shared["copy_bandwidth"] / 1e12, 3)
        log(f"copy bandwidth {_shared['copy_bandwidth'] / 1e12:.2f} TB/s")
    return _shared["copy_bandwidth"]


# ------------------------------------------------------------------ SenseNova-U1 decode

def sensenova_read_bytes(lm, ctx: int) -> int:
    """Bytes one decode step must read: understanding weights, one embedding row, K/V at ctx."""
    total = 0
    for name, p in lm.named_parameters():
        if "_mot_gen" in name:
            continue
        if "embed_tokens" in name:
            total += p.shape[-1] * p.element_size()  # one row
            continue
        total += p.numel() * p.element_size()
    cfg = lm.config
    kv = 2 * cfg.num_hidden_layers * ctx * cfg.num_key_value_heads * cfg.head_dim * 2
    return total + kv


FP8_DECODE_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def sensenova_fp8_read_bytes(lm, ctx: int, lm_head: bool = False) -> int:
    """``sensenova_read_bytes`` with the decode step's FP8 copies in place of the bf16 weights of
    the layers they cover (qkv, o, gate-up, down: one byte a weight and an fp32 scale a row);
    ``lm_head`` stays bf16 unless ``lm_head`` (``sensenova_lm_head``)."""
    saved = 0
    for name, p in lm.named_parameters():
        if "_mot_gen" in name or not name.endswith(".weight"):
            continue
        if ((name.rsplit(".", 2)[-2] in FP8_DECODE_LAYERS and name.startswith("model.layers."))
                or (lm_head and name == "lm_head.weight")):
            saved += p.numel() * (p.element_size() - 1) - p.shape[0] * 4
    return sensenova_read_bytes(lm, ctx) - saved


def _text_loop_ms(pipe, prefix_logits, make_cache, t_idx, steps, repeats=3, temperature=None):
    """ms/token of the pipeline's own text loop over `steps` tokens, median of repeats;
    ``temperature``: the loop samples (``do_sample``) at it, seeded per run."""
    times = []
    sample = {} if temperature is None else {"do_sample": True, "temperature": temperature}
    for r in range(repeats + 1):  # the first run is warm-up (and capture, when lazy)
        cache = make_cache()
        if sample:
            torch.manual_seed(r)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            pipe._generate_text(prefix_logits, cache, t_idx, max_tokens=steps, **sample)
        torch.cuda.synchronize()
        if r:
            times.append((time.perf_counter() - start) * 1e3 / steps)
    times.sort()
    return times[len(times) // 2]


def _gate_ms(wiring) -> float:
    """ms of the host check every request makes before it may decode on the paged path (the
    hook's gate: one walk of the language model, ``rules.verdict``), median of 5; the GPU waits
    for it at each request's start, so a 64-token row carries 1/64 of it per token."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        wiring.sessions.refusal()
        times.append((time.perf_counter() - start) * 1e3)
    return round(sorted(times)[2], 3)


def _text_contexts(args, env, rows):
    """Yields (model, tokenizer, ctx, prefix logits, cache factory, floor ms) for each
    ``--contexts`` of the text-loop cases; on 0.30 the in-tree decode is switched off for the
    eager side (the child that times it switches it on for itself). ``rows`` is written out
    before each context after the first: a run cut at its time limit keeps the contexts it
    finished."""
    lm, tok = sensenova_model()
    bw = copy_bandwidth(env)
    if rm.has_intree_paged_decode():
        os.environ["VLLM_OMNI_SENSENOVA_PAGED_DECODE"] = "0"
    for i, ctx in enumerate(args.contexts):
        if i:
            _write(args, rows, env)
        prefix_logits, make_cache = rm.random_prefix(lm, ctx, seed=ctx)
        floor = sensenova_read_bytes(lm, ctx + args.steps // 2) / bw * 1e3
        yield lm, tok, ctx, prefix_logits, make_cache, floor


def bench_sensenova(args, rows, env):
    is_030 = rm.has_intree_paged_decode()
    steps = args.steps
    lm = None
    for lm, tok, ctx, prefix_logits, make_cache, floor in _text_contexts(args, env, rows):
        t_idx = ctx - 1
        eager_pipe = rm.build_pipeline(lm, tok, device="cuda")
        eager = _text_loop_ms(eager_pipe, prefix_logits, make_cache, t_idx, steps)
        log(f"ctx {ctx}: eager {eager:.2f} ms/token (floor {floor:.2f})")
        if is_030 and not args.no_intree:
            intree = _in_child(args, "intree_decode", ctx)
            log(f"ctx {ctx}: vllm-omni 0.30 in-tree {intree}")
            rows.append(common.case(f"sensenova_decode_ctx{ctx}_intree", eager,
                                    intree.get("ms"), floor, error=intree.get("error"),
                                    side="vllm-omni 0.30 in-tree paged decode (FA2), timed in a "
                                         "child process of this run (see _in_child)"))
        texts, by_name = {}, {}
        intree_ms = rows[-1].get("ours_ms") if is_030 and not args.no_intree else None
        for name, fa, env_over in _plugin_variants(args, ctx):
            env_over = dict(env_over)
            pdl = env_over.pop("_pdl", None)  # "plain": the linears' pdl set to None
            cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                                "VLLM_OMNI_GRAPHDECODE_FA_VERSION": fa,
                                "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
                                "VLLM_OMNI_GRAPHDECODE_PRECAPTURE": "0", **env_over})
            pipe = rm.build_pipeline(lm, tok, device="cuda")
            stats.reset()
            try:
                summary = sensenova_u1.install(pipe, cfg)
            except Exception as exc:
                rows.append(common.case(name, eager, None, floor, error=repr(exc)))
                continue
            wiring = getattr(pipe, sensenova_u1.STATE_ATTR)
            if pdl is not None:  # BENCH_STEP_MODES: before the first capture
                linears = getattr(wiring.fusion, "gemv", None)
                if not hasattr(linears, "pdl"):
                    rows.append(common.case(name, eager, None, floor,
                                            error=f"no row GEMV linears to set pdl on: {linears}"))
                    continue
                linears.pdl = None if pdl == "plain" else pdl
            ours = _text_loop_ms(pipe, prefix_logits, make_cache, t_idx, steps)
            gate = _gate_ms(wiring)
            snap = stats.snapshot()
            step = " + ".join(sensenova_wiring.describe_step(wiring.fusion,
                                                             wiring.kv_writer)) or "unfused"
            k = cfg.tokens_per_launch
            if pdl is not None:  # set after install: the summary names the hook's default
                step += (", each GEMV a plain launch" if pdl == "plain" else
                         f", each GEMV a programmatic dependent launch (pdl={pdl})")
            log(f"ctx {ctx}: {name} {ours:.2f} ms/token (gate {gate:.2f} ms a request), "
                f"step {step}, {k} tokens/launch (install: {summary}; {snap['counters']})")
            rows.append(common.case(name, eager, ours, floor,
                                    side=f"plugin paged + graph, FA{fa}, step {step}, "
                                         f"{k} tokens per launch",
                                    tokens_per_launch=k,
                                    sensenova_step=sensenova_wiring.resolve_step(
                                        cfg.sensenova_step, "cuda"),
                                    request_gate_ms=gate,
                                    **({"pdl": getattr(wiring.fusion.gemv, "pdl", None) or "plain"}
                                       if hasattr(getattr(wiring.fusion, "gemv", None), "pdl")
                                       else {}),
                                    counters=snap["counters"], fallbacks=snap["fallbacks"],
                                    degraded=snap.get("degraded")))
            by_name[name] = rows[-1]
            if args.step_modes and name in _step_mode_pairs(args, ctx, by_name):
                with torch.inference_mode():
                    texts[name] = pipe._generate_text(prefix_logits, make_cache(), t_idx,
                                                      max_tokens=args.agree_tokens)
            if args.fp8 and name in _fp8_pair(args, ctx) + _fp8_head_names(args, ctx):
                with torch.inference_mode():
                    texts[name] = pipe._generate_text(prefix_logits, make_cache(), t_idx,
                                                      max_tokens=args.agree_tokens)
            pipe.release_captured_graphs()
            del pipe, wiring
            torch.cuda.empty_cache()
        if args.fp8:
            bw = copy_bandwidth(env)
            fp8_floor = sensenova_fp8_read_bytes(lm, ctx + args.steps // 2) / bw * 1e3
            _fp8_fields(args, ctx, by_name, texts, intree_ms, fp8_floor)
            for head_name in _fp8_head_names(args, ctx):
                head_floor = sensenova_fp8_read_bytes(lm, ctx + args.steps // 2,
                                                      lm_head=True) / bw * 1e3
                _fp8_fields(args, ctx, by_name, texts, intree_ms, head_floor, head_name)
        _step_mode_fields(args, ctx, by_name, texts, intree_ms)
        _write(args, rows, env)  # a run cut short keeps every context it finished
        rows.append(common.case(f"sensenova_decode_ctx{ctx}_flashinfer", eager, None, floor,
                                note=rm.flashinfer_status()))
    del lm
    release_model_unless_needed(args)


def bench_sampled(args, rows, env):
    """``sensenova_sampled_ctxN[_kK]``: the text loop sampling (``do_sample``, temperature 0.7),
    ms/token: eager against the plugin at each ``--tokens-per-launch`` K (1: the loop draws each
    token itself from the graph's logits; more: the device draws them, ``token_loop.Sampling``)."""
    steps = args.steps
    for lm, tok, ctx, prefix_logits, make_cache, floor in _text_contexts(args, env, rows):
        eager = _text_loop_ms(rm.build_pipeline(lm, tok, device="cuda"), prefix_logits,
                              make_cache, ctx - 1, steps, temperature=0.7)
        log(f"ctx {ctx}: sampled eager {eager:.2f} ms/token")
        for k in sorted(set([1] + args.tokens_per_launch)):
            cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                                "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
                                "VLLM_OMNI_GRAPHDECODE_PRECAPTURE": "0",
                                "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": str(k)})
            pipe = rm.build_pipeline(lm, tok, device="cuda")
            stats.reset()
            sensenova_u1.install(pipe, cfg)
            ours = _text_loop_ms(pipe, prefix_logits, make_cache, ctx - 1, steps,
                                 temperature=0.7)
            counters = stats.snapshot()["counters"]
            log(f"ctx {ctx}: sampled k={k} {ours:.2f} ms/token ({counters})")
            rows.append(common.case(f"sensenova_sampled_ctx{ctx}_k{k}", eager, ours, floor,
                                    tokens_per_launch=k, temperature=0.7, counters=counters,
                                    side=("plugin, the loop's own draws on the graph's logits"
                                          if k == 1 else "plugin, drawn on the device")))
            pipe.release_captured_graphs()
    release_model_unless_needed(args)


def _in_child(args, what: str, ctx: int) -> dict:
    """Time vllm-omni 0.30's in-tree path in a child process of this run: {"ms": ...} or
    {"error": ...}.

    Why a child: the in-tree path builds a new paged cache and graph runner when a request
    outgrows its buffers; the old graphs are freed, and its next capture into vLLM's graph pool in
    the same process tripped torch's ``use_count > 0`` assert in the caching allocator (torch
    2.11 on the H200), which would end this whole run. The child builds the same model (same
    seed) and prefix (same seed) and reports one number; the eager row stays this process's.
    """
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--child", what,
           "--child-context", str(ctx), "--steps", str(args.steps),
           "--think-prompt", str(args.think_prompt), "--think-tokens", str(args.think_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    with open(os.path.join(args.out, f"child-{what}-{ctx}.log"), "w") as f:
        f.write(proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"child exited {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def _child_main(args) -> None:
    """The child side of ``_in_child``: one in-tree figure, as JSON on stdout."""
    lm, tok = sensenova_model()
    os.environ["VLLM_OMNI_SENSENOVA_PAGED_DECODE"] = "1"
    pipe = rm.build_pipeline(lm, tok, device="cuda")
    ctx = args.child_context
    if args.child == "intree_decode":
        prefix_logits, make_cache = rm.random_prefix(lm, ctx, seed=ctx)
        result = {"ms": _text_loop_ms(pipe, prefix_logits, make_cache, ctx - 1, args.steps)}
    else:  # intree_think
        times, text = _think_times(lm, pipe, args.think_prompt, args.think_tokens, 4)
        result = {"ms": sorted(times[1:])[1], "first_ms": times[0], "text": text}
    print(json.dumps(result), flush=True)


def _think_times(lm, pipe, prompt: int, tokens: int, runs: int):
    """ms of each of ``runs`` whole ``_generate_think`` calls, and the last think text."""
    from types import SimpleNamespace

    prefix_logits, make_cache = rm.random_prefix(lm, prompt, seed=prompt)
    prefix = SimpleNamespace(logits=prefix_logits)
    times, text = [], ""
    for _ in range(runs):
        cache = make_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            _, _, text = pipe._generate_think(prefix, cache, prompt - 1, max_think_tokens=tokens)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times, text


def _agree(a: str, b: str) -> int:
    """How many leading think tokens two texts share (the bench tokenizer: one word a token)."""
    words = [a.split(), b.split()]
    return next((i for i, (x, y) in enumerate(zip(*words)) if x != y), min(map(len, words)))


def _step_mode_pairs(args, ctx, by_name=None) -> list[str]:
    """The default rows and the ``--step-modes`` rows at ``ctx``, every repeat: whose greedy
    text is kept for the agreement fields."""
    fa = args.fa[0]
    names = []
    for r in range(1, max(1, args.repeats) + 1):
        suffix = "" if r == 1 else f"_r{r}"
        names.append(f"sensenova_decode_ctx{ctx}_fa{fa}{suffix}")
        names += [f"sensenova_decode_ctx{ctx}_fa{fa}_{mode}{suffix}" for mode in args.step_modes]
    return names


def _step_mode_fields(args, ctx, by_name, texts, intree_ms) -> None:
    """Each ``--step-modes`` row against the default row of the same repeat: ``fused_ms``,
    ``speedup_vs_fused``, ``agree_tokens_vs_fused`` (greedy tokens from the same prefix, over
    ``--agree-tokens``; random weights), and against the in-tree decode timed in this run."""
    fa = args.fa[0]
    for r in range(1, max(1, args.repeats) + 1):
        suffix = "" if r == 1 else f"_r{r}"
        base_name = f"sensenova_decode_ctx{ctx}_fa{fa}{suffix}"
        base = by_name.get(base_name)
        for mode in args.step_modes:
            name = f"sensenova_decode_ctx{ctx}_fa{fa}_{mode}{suffix}"
            row = by_name.get(name)
            if row is None or base is None or not row.get("ours_ms"):
                continue
            row["fused_ms"] = base.get("ours_ms")
            if base.get("ours_ms"):
                row["speedup_vs_fused"] = common.significant(base["ours_ms"] / row["ours_ms"])
            if intree_ms:
                row["intree_ms"] = intree_ms
                row["speedup_vs_intree"] = common.significant(intree_ms / row["ours_ms"])
            if name in texts and base_name in texts:
                row["agree_tokens_vs_fused"] = _agree(texts[name], texts[base_name])
                row["agree_of"] = min(len(texts[name].split()), len(texts[base_name].split()))
            plain = by_name.get(f"sensenova_decode_ctx{ctx}_fa{fa}_rowgemv{suffix}")
            if mode in BENCH_STEP_MODES and plain and plain.get("ours_ms"):
                row["rowgemv_ms"] = plain["ours_ms"]
                row["speedup_vs_rowgemv"] = common.significant(plain["ours_ms"] / row["ours_ms"])
            log(f"ctx {ctx}: {mode}{suffix} {row['ours_ms']} ms/token against fused "
                f"{row['fused_ms']}; agree {row.get('agree_tokens_vs_fused')} of "
                f"{row.get('agree_of')}")


def _fp8_pair(args, ctx) -> tuple[str, str]:
    """The bf16 row (the first FA version at the defaults) and its FP8 counterpart."""
    return f"sensenova_decode_ctx{ctx}_fa{args.fa[0]}", f"sensenova_decode_ctx{ctx}_fp8"


def _fp8_head_names(args, ctx) -> tuple[str, ...]:
    """The ``_fp8_lmhead`` row's name where ``--fp8-lm-head`` asks for it."""
    return (f"sensenova_decode_ctx{ctx}_fp8_lmhead",) if args.fp8 and args.fp8_lm_head else ()


def _fp8_fields(args, ctx, by_name, texts, intree_ms, fp8_floor=None, name=None) -> None:
    """The ``_fp8`` row's comparisons (or row ``name``'s: ``_fp8_lmhead``): against the bf16
    step of the same run (time and greedy tokens: how many of ``--agree-tokens`` lead alike, the
    bench tokenizer giving one word a token) and, on 0.30, against the in-tree path timed in this
    run; ``fp8_floor_ms``: its own floor (``floor_ms`` is the bf16 step's), and
    ``of_fp8_floor``. The ``_fp8_lmhead`` row also against the ``_fp8`` row
    (``fp8_ms``, ``speedup_vs_fp8``, ``agree_tokens_vs_fp8``)."""
    bf16_name, fp8_name = _fp8_pair(args, ctx)
    if name is not None:
        fp8_row = by_name.get(fp8_name)
        row = by_name.get(name)
        if row is not None and fp8_row is not None and row.get("ours_ms") and fp8_row.get(
                "ours_ms"):
            row["fp8_ms"] = fp8_row["ours_ms"]
            row["speedup_vs_fp8"] = common.significant(fp8_row["ours_ms"] / row["ours_ms"])
        if row is not None and name in texts and fp8_name in texts:
            row["agree_tokens_vs_fp8"] = _agree(texts[name], texts[fp8_name])
        fp8_name = name
    row, bf16 = by_name.get(fp8_name), by_name.get(bf16_name)
    if row is None or bf16 is None:
        return
    ours, base = row.get("ours_ms"), bf16.get("ours_ms")
    if fp8_floor:
        row["fp8_floor_ms"] = common.significant(fp8_floor)
        row["of_fp8_floor"] = common.significant(ours / fp8_floor) if ours else None
    row["bf16_ms"] = base
    row["speedup_vs_bf16"] = common.significant(base / ours) if ours and base else None
    if intree_ms:
        row["intree_ms"] = intree_ms
        row["speedup_vs_intree"] = common.significant(intree_ms / ours) if ours else None
    if fp8_name in texts and bf16_name in texts:
        a, b = texts[fp8_name], texts[bf16_name]
        row["agree_tokens"] = _agree(a, b)
        row["agree_of"] = min(len(a.split()), len(b.split()))
        row["agree_note"] = ("greedy tokens from the same prefix, FP8 step against the bf16 step; "
                             "random weights (real checkpoints are not available here)")
    log(f"ctx {ctx}: FP8 {ours} ms/token against bf16 {base} and in-tree {intree_ms}; "
        f"agree {row.get('agree_tokens')} of {row.get('agree_of')}")


# The default rows' step: ``fused`` (cuBLAS), as every committed results file's default rows.
FUSED = {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "fused"}
# ``--step-modes`` the benchmark adds to the setting's own: the ``rowgemv`` step with each GEMV
# launched in that ``fp8.gemv.gemv`` ``pdl`` mode ("plain": None, ordinary launches; the step's
# own is ``fp8.gemv.dependent_launches``: "prefetch" on Hopper), set on the wired step's linears
# after install.
BENCH_STEP_MODES = {"rowgemv_plain": ("rowgemv", "plain"), "rowgemv_pdl": ("rowgemv", "prefetch"),
                    "rowgemv_pdlwait": ("rowgemv", "wait")}


def _step_mode_settings(mode: str) -> dict:
    """The settings of a ``--step-modes`` row (``_pdl``: the benchmark's own, popped before the
    settings are parsed)."""
    if mode in BENCH_STEP_MODES:
        step, pdl = BENCH_STEP_MODES[mode]
        return {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": step, "_pdl": pdl}
    return {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": mode}


def _plugin_variants(args, ctx):
    """(row name, FA version, settings) of every plugin side timed at ``ctx``: each FA version at
    the ``fused`` step (the default off Hopper; ``auto`` reads ``rowgemv`` there, a
    ``--step-modes`` row); for the first, every ``--tokens-per-launch`` and the exact (model's
    own) step."""
    variants = [(f"sensenova_decode_ctx{ctx}_fa{fa}", fa, dict(FUSED)) for fa in args.fa]
    if args.fa:
        fa = args.fa[0]
        variants += [(f"sensenova_decode_ctx{ctx}_fa{fa}_k{k}", fa,
                      {**FUSED, "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH": str(k)})
                     for k in args.tokens_per_launch]
        # Each --step-modes mode beside the default row, alternated --repeats times (rows of
        # one run vary by a few % on the H200: the pairs are compared run by run).
        for r in range(1, max(1, args.repeats)):
            variants.append((f"sensenova_decode_ctx{ctx}_fa{fa}_r{r + 1}", fa, dict(FUSED)))
            variants += [(f"sensenova_decode_ctx{ctx}_fa{fa}_{mode}_r{r + 1}", fa,
                          _step_mode_settings(mode)) for mode in args.step_modes]
        variants[1:1] = [(f"sensenova_decode_ctx{ctx}_fa{fa}_{mode}", fa,
                          _step_mode_settings(mode)) for mode in args.step_modes]
        if args.exact:
            variants.append((f"sensenova_decode_ctx{ctx}_fa{fa}_exact", fa,
                             {"VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "exact"}))
        if args.fp8:
            variants.append((f"sensenova_decode_ctx{ctx}_fp8", fa,
                             {"VLLM_OMNI_GRAPHDECODE_FP8": "sensenova_decode"}))
        for name in _fp8_head_names(args, ctx):
            variants.append((name, fa, {"VLLM_OMNI_GRAPHDECODE_FP8":
                                        "sensenova_decode,sensenova_lm_head"}))
    return variants


def bench_think(args, rows, env):
    """One whole ``_generate_think`` of ``--think-tokens`` tokens from a ``--think-prompt``-token
    prompt (``sensenova_think_1024``): eager (one run: ~1 minute on 0.26), vllm-omni 0.30's in-tree
    path when that is the stack, and the plugin at its defaults (median of 3, after a warm-up
    request that pre-captures nothing: the plugin's first request is in ``first_ms``)."""
    is_030 = rm.has_intree_paged_decode()
    lm, tok = sensenova_model()
    prompt, tokens = args.think_prompt, args.think_tokens
    floor = tokens * sensenova_read_bytes(lm, prompt + tokens // 2) / copy_bandwidth(env) * 1e3
    if is_030:
        os.environ["VLLM_OMNI_SENSENOVA_PAGED_DECODE"] = "0"
    (eager,), eager_text = _think_times(lm, rm.build_pipeline(lm, tok, device="cuda"), prompt,
                                        tokens, 1)
    log(f"think {tokens}: eager {eager:.0f} ms")
    extra = {}
    if is_030 and not args.no_intree:
        intree = _in_child(args, "intree_think", prompt)
        extra = dict(intree_ms=intree.get("ms"), intree_first_ms=intree.get("first_ms"),
                     intree_error=intree.get("error"),
                     intree_equals_eager_text=intree.get("text") == eager_text)
        log(f"think {tokens}: in-tree {extra}")
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover"})
    pipe = rm.build_pipeline(lm, tok, device="cuda")
    stats.reset()
    summary = sensenova_u1.install(pipe, cfg)
    times, ours_text = _think_times(lm, pipe, prompt, tokens, 4)
    ours = sorted(times[1:])[1]
    counters = stats.snapshot()["counters"]
    pipe.release_captured_graphs()
    log(f"think {tokens}: ours {ours:.0f} ms ({summary})")
    # The exact step (the model's own modules in the graph): what the fused one is measured against.
    exact_pipe = rm.build_pipeline(lm, tok, device="cuda")
    sensenova_u1.install(exact_pipe, config.parse({
        "VLLM_OMNI_GRAPHDECODE": "sensenova_u1", "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
        "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": "exact"}))
    (exact_ms,), exact_text = _think_times(lm, exact_pipe, prompt, tokens, 1)
    exact_pipe.release_captured_graphs()
    rows.append(common.case(f"sensenova_think_{tokens}", eager, ours, floor,
                            prompt_tokens=prompt, think_tokens=tokens, first_ms=round(times[0], 2),
                            tokens_agree_with_eager=_agree(eager_text, ours_text),
                            exact_step_ms=round(exact_ms, 2),
                            exact_tokens_agree_with_eager=_agree(eager_text, exact_text),
                            tokens_agree_with_exact_step=_agree(exact_text, ours_text),
                            counters=counters, **extra))
    release_model_unless_needed(args)


# ------------------------------------------------------------------ Qwen-Image-2.1 cached step

QWEN_CASES = (  # name, target latent grid, reference grids (a 1024x1024 image is 64x64 latents)
    ("t2i_512", (32, 32), ()),
    ("t2i_1024", (64, 64), ()),
    ("edit2_512", (32, 32), ((32, 32), (32, 32))),
    ("edit2_1024", (64, 64), ((64, 64), (64, 64))),
)


def qwen_step_flops(tf, target: int, prefix: int, batch: int = 1) -> float:
    """FLOPs of one cached step: every block's projections and SwiGLU on the target tokens,
    attention of the target queries over prefix + target keys, img_in and proj_out."""
    cfg = tf.config
    h = cfg.num_attention_heads * cfg.attention_head_dim
    ff = cfg.mlp_ratio * h
    per_layer = 2 * target * (4 * h * h + 3 * h * ff) + 4 * target * (prefix + target) * h
    io = 2 * target * h * (cfg.in_channels + (cfg.out_channels or cfg.in_channels))
    return batch * (cfg.num_layers * per_layer + io)


def bench_qwen(args, rows, env):
    from vllm_omni_graphdecode.hooks import qwen_image_21 as q

    rate = common.matmul_flops_per_s()
    env["bf16_matmul_tflops"] = round(rate / 1e12, 1)
    log(f"bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    tf = qwen_models.random_transformer(device="cuda", dtype=torch.bfloat16)
    for (name, target, refs), mode in itertools.product(QWEN_CASES, args.qwen_modes):
        stats.reset()
        r = qwen_step.bench_cached_step(tf, text_tokens=256, reference_shapes=refs,
                                        target_shape=target, mode=mode)
        floor = qwen_step_flops(tf, r["target_tokens"], r["prefix_len"]) / rate * 1e3
        log(f"qwen {name} {mode}: eager {r['eager_ms']:.2f} graph {r['graph_ms']:.2f} "
            f"static {r['static_ms']:.2f} floor {floor:.2f} ms exact={r['exact']} "
            f"max_abs_diff={r['max_abs_diff']:.3g} first={r['first_graph_step_ms']:.0f} ms")
        rows.append(common.case(
            f"qwen_image_21_step_{name}" + ("" if mode == "fast" else f"_{mode}"),
            r["eager_ms"], r["graph_ms"], floor, mode=mode,
            static_ms=r["static_ms"], first_graph_step_ms=r["first_graph_step_ms"],
            prefix_len=r["prefix_len"], target_tokens=r["target_tokens"], exact=r["exact"],
            max_abs_diff=r["max_abs_diff"], max_abs_ref=r["max_abs_ref"],
            prefix_buffer_mb=r["prefix_buffer_mb"], fallbacks=r["fallbacks"],
            degraded=r["degraded"]))
    del tf
    torch.cuda.empty_cache()


# ------------------------------------------------------------------ memory and first request

def _mib(x):
    return round(x / 2**20, 1)


def bench_memory(args, rows, env):
    """Device memory after each of 20 requests, capture cost, first-request latency.

    Both pre-capture settings share one model (built once per process). ``--memory-steps``
    tokens per request (default 24, ~0.25 s at ~10 ms/token): memory and first-request capture
    cost do not depend on the request's length, and 48 made the case outlast the job's limit.
    """
    is_030 = rm.has_intree_paged_decode()
    lm, tok = sensenova_model()
    steps = args.memory_steps

    def request(pipe, ctx, seed):
        logits, make_cache = rm.random_prefix(lm, ctx, seed=seed)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            pipe._generate_text(logits, make_cache(), ctx - 1, max_tokens=steps)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / steps

    fa = args.fa[0] if args.fa else "3"
    for precapture in ("1", "0"):
        cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                            "VLLM_OMNI_GRAPHDECODE_FA_VERSION": fa,
                            "VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE": "takeover",
                            "VLLM_OMNI_GRAPHDECODE_PRECAPTURE": precapture})
        stats.reset()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        pipe = rm.build_pipeline(lm, tok, device="cuda")
        summary = sensenova_u1.install(pipe, cfg)
        torch.cuda.synchronize()
        wire_s = time.perf_counter() - t0
        wire_mib = _mib(torch.cuda.memory_allocated() - before)
        log(f"precapture={precapture}: wired in {wire_s:.2f} s, +{wire_mib} MiB ({summary})")
        # Contexts cycle over the pre-captured buckets (512, 1024, 2048): every bucket is reached
        # in the first 4 requests, so requests 5..20 must not grow memory.
        first = request(pipe, 500, seed=1)
        mem = []
        per_token = []
        for i in range(20):
            per_token.append(request(pipe, (500, 900, 1500, 1900)[i % 4], seed=2 + i))
            mem.append(_mib(torch.cuda.memory_allocated()))
        steady = sorted(per_token[4:])[len(per_token[4:]) // 2]
        rows.append(common.case(
            f"memory_sensenova_precapture{precapture}", None, steady, None,
            first_request_ms_per_token=first, first_vs_steady=round(first / steady, 3),
            wire_seconds=wire_s, wire_mib=wire_mib, memory_mib_after_request=mem,
            growth_5_to_20_mib=round(mem[-1] - mem[4], 1),
            tokens_per_request=steps,
            counters=stats.snapshot()["counters"], fallbacks=stats.snapshot()["fallbacks"]))
        log(f"precapture={precapture}: first {first:.2f} ms/token, steady {steady:.2f}; "
            f"memory 5->20 {mem[4]} -> {mem[-1]} MiB")
        pipe.release_captured_graphs()
        del pipe
        torch.cuda.empty_cache()
        _write(args, rows, env)  # a cut-off run keeps the finished half
    del lm
    release_model_unless_needed(args)
    if is_030:
        return
    from vllm_omni_graphdecode.hooks import qwen_image_21 as q

    tf = qwen_models.random_transformer(device="cuda", dtype=torch.bfloat16)
    cfg = config.parse({"VLLM_OMNI_GRAPHDECODE": "qwen_image_21"})
    stats.reset()
    graphs = q.enable(tf, max_entries=cfg.max_entries)
    mem = []
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    with torch.no_grad():
        for i in range(20):
            kwargs = qwen_models.synthetic_inputs(tf, text_tokens=200 + 8 * (i % 3),
                                                  target_shape=(64, 64), seed=i)
            cache = QwenImage21KVCache(len(tf.transformer_blocks))
            tf(**kwargs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)
            for _ in range(3):
                tf(**kwargs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)
            del cache
            torch.cuda.synchronize()
            mem.append(_mib(torch.cuda.memory_allocated()))
    rows.append(common.case("memory_qwen_image_21_t2i_1024", None, None, None,
                            memory_mib_after_request=mem,
                            growth_5_to_20_mib=round(mem[-1] - mem[4], 1),
                            counters=stats.snapshot()["counters"],
                            fallbacks=stats.snapshot()["fallbacks"]))
    log(f"qwen memory 5->20 {mem[4]} -> {mem[-1]} MiB")
    graphs.disable()
    del tf
    torch.cuda.empty_cache()


# ------------------------------------------------------------------ profiles

QWEN_PROFILE_TARGET = (64, 64)  # t2i 1024x1024


def bench_profile(args, rows, env):
    """Where the time goes (profile_step.py): the plugin's graphed decode step and the eager loop
    at the real SenseNova-U1 shape, and one Qwen-Image-2.1 cached step at t2i 1024."""
    is_030 = rm.has_intree_paged_decode()
    path = os.path.join(args.out, f"profile-{args.tag}.json")
    result = {"environment": env, "profiles": {}}
    profiles = result["profiles"]
    ctx = args.profile_context

    def save(name, fn):
        start = time.perf_counter()
        try:
            profiles[name] = fn()
        except Exception as exc:
            import traceback

            traceback.print_exc()
            profiles[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        log(f"profile {name}: {time.perf_counter() - start:.1f} s")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

    lm, tok = sensenova_model()
    device = next(lm.parameters()).device
    bw = copy_bandwidth(env)
    fa = args.fa[0] if args.fa else "3"
    kernel = attention.select_kernel(device, lm.config.head_dim, fa)
    buckets = config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1"}).buckets
    prefix_logits, make_cache = rm.random_prefix(lm, ctx, seed=ctx)
    floor = sensenova_read_bytes(lm, ctx) / bw * 1e3
    result["sensenova"] = {"context": ctx, "kernel": str(getattr(kernel, "name", kernel)),
                           "buckets": list(buckets), "copy_bandwidth_tb_s": round(bw / 1e12, 3),
                           "floor_ms_per_token": round(floor, 4)}
    k = config.parse({}).tokens_per_launch
    parts = set(getattr(args, "profile_parts", PROFILE_PARTS))
    head = getattr(args, "fp8_lm_head", False)
    fp8_name = f"sensenova_graph_fp8{'_lmhead' if head else ''}_ctx{ctx}"
    graphs = [(f"sensenova_graph_ctx{ctx}", k, "graph"), (f"sensenova_graph_k1_ctx{ctx}", 1, "graph_k1"),
              (fp8_name, k, "graph_fp8"),
              (fp8_name.replace("_ctx", "_plain_ctx"), k, "graph_fp8_plain"),
              (f"sensenova_graph_rowgemv_ctx{ctx}", k, "graph_rowgemv"),
              (f"sensenova_graph_rowgemv_nofold_ctx{ctx}", k, "graph_rowgemv_nofold"),
              (f"sensenova_graph_rowgemv_pdl_ctx{ctx}", k, "graph_rowgemv_pdl"),
              (f"sensenova_graph_rowgemv_pdlwait_ctx{ctx}", k, "graph_rowgemv_pdlwait")]
    fusions = {"graph_fp8": lambda: _fp8_fusion(lm, device, head),
               "graph_fp8_plain": lambda: _fp8_fusion(lm, device, head, plain=True),
               "graph_rowgemv": lambda: _rowgemv_fusion(lm, device),
               "graph_rowgemv_nofold": lambda: _rowgemv_fusion(lm, device, fold_norms=False),
               "graph_rowgemv_pdl": lambda: _rowgemv_fusion(lm, device, pdl="prefetch"),
               "graph_rowgemv_pdlwait": lambda: _rowgemv_fusion(lm, device, pdl="wait")}
    for name, per_launch, part in graphs:
        if part not in parts:
            continue
        if not isinstance(kernel, attention.Kernel):
            profiles[name] = {"error": f"no paged kernel: {kernel}"}
            continue
        save(name, lambda per_launch=per_launch, part=part: profile_step.profile_sensenova_graph(
            lm, kernel, prefix_logits, make_cache, ctx, steps=args.profile_steps,
            buckets=buckets, copy_bytes_per_s=bw, device_type=device.type,
            tokens_per_launch=per_launch,
            fusion=fusions[part]() if part in fusions else "auto"))

    def eager():
        if is_030:
            os.environ["VLLM_OMNI_SENSENOVA_PAGED_DECODE"] = "0"
        pipe = rm.build_pipeline(lm, tok, device=device.type)
        return profile_step.profile_sensenova_eager(
            pipe, prefix_logits, make_cache, ctx, steps=args.profile_eager_steps, lm=lm,
            copy_bytes_per_s=bw, device_type=device.type)

    if "eager" in parts:
        save(f"sensenova_eager_ctx{ctx}", eager)
    del lm, prefix_logits, make_cache
    release_model_unless_needed(args)

    def qwen():
        tf = qwen_models.random_transformer(device=device.type, dtype=torch.bfloat16)
        try:
            return profile_step.profile_qwen_step(tf, target_shape=QWEN_PROFILE_TARGET,
                                                  text_tokens=256)
        finally:
            del tf
            torch.cuda.empty_cache()

    if not is_030 and "qwen" in parts:  # this bundle's 0.30 stack runs SenseNova-U1 only
        save("qwen_image_21_t2i_1024", qwen)
    log("profiles:\n" + profile_step.table(
        {k: v for k, v in profiles.items() if isinstance(v, dict) and "error" not in v}))
    for name, prof in profiles.items():
        rows.append(_profile_row(name, prof, os.path.basename(path),
                                 floor if name.startswith("sensenova") else None))


PROFILE_PARTS = ("graph", "graph_k1", "eager", "qwen")  # the default; the graph_fp8 and graph_rowgemv
# parts on request


def _rowgemv_fusion(lm, device, fold_norms=True, pdl=None):
    """The fused step with the bf16 row GEMV (``..._SENSENOVA_STEP=rowgemv`` at one row, the head
    included), or the error why not. ``fold_norms=False`` (the profile part
    ``graph_rowgemv_nofold``): the RMSNorms in launches of their own, as before issue #42's
    folds, for the A/B in one process. ``pdl`` (``graph_rowgemv_pdl`` / ``_pdlwait``): every
    GEMV a programmatic dependent launch in that mode (``fp8.gemv.gemv``'s ``pdl``)."""
    from vllm_omni_graphdecode.hooks.sensenova_u1 import fused_step, layouts as sl

    linears, why = sensenova_wiring.row_gemv_linears(device, 1, lm)
    if linears is None or why:
        raise RuntimeError(f"no row GEMV: {[w.describe() for w in why]}")
    linears.fold_norms = fold_norms
    linears.pdl = pdl  # graph_rowgemv_pdl(wait): each GEMV a programmatic dependent launch
    return fused_step.Fusion.select(lm, sl.detect_layout(lm), device, linears=linears)


def _fp8_fusion(lm, device, lm_head=False, plain=False):
    """The fused step with the one-request step's FP8 copies (as ``VLLM_OMNI_GRAPHDECODE_FP8``
    wires it; ``lm_head``: the head's copy too, as ``sensenova_lm_head`` does), or the error why
    not. ``plain`` (the profile part ``graph_fp8_plain``): without the norm folds and with plain
    launches, as before they were the FP8 step's, for the A/B in one process."""
    from vllm_omni_graphdecode.hooks.sensenova_u1 import fused_step, layouts as sl

    linears, why = fused_step.fp8_linears(lm, device, "sensenova_u1", one_row=True,
                                          lm_head=lm_head)
    if linears is None or (lm_head and not linears.has_head):
        raise RuntimeError(f"no FP8 copies: {[w.describe() for w in why]}")
    if plain:
        linears.fold_norms, linears.pdl = False, None
    fusion = fused_step.Fusion.select(lm, sl.detect_layout(lm), device, linears=linears)
    if not fusion.active:
        raise RuntimeError(f"no fused step: {fusion.reasons}")
    return fusion


def _profile_row(name, prof, file, floor=None):
    """One bench row per profile: wall, GPU busy and the launch gap per step."""
    if "error" in prof:
        return {"case": f"profile_{name}", "error": prof["error"], "file": file}
    main = prof.get("graph") or prof.get("replay") or prof
    if "wall_ms_per_step" not in main:
        return {"case": f"profile_{name}", "file": file}
    eager = prof.get("eager", {}).get("wall_ms_per_step")
    return common.case(f"profile_{name}", eager, main["wall_ms_per_step"], floor,
                       gpu_busy_ms=main["gpu_busy_ms_per_step"],
                       gpu_kernel_ms=main["gpu_kernel_ms_per_step"],
                       kernels_per_step=main["kernels_per_step"],
                       launch_gap_ms=main["launch_gap_ms_per_step"],
                       kernels_from=prof.get("kernels_from") or main.get("kernels_from"),
                       file=file)


def bench_qwen_profile(args, rows, env):
    """Where the time goes in one Qwen-Image-2.1 cached step at t2i 1024 (profile_step.py):
    diffusers' eager step, the exact mode's replay ("graph") and the fast mode's
    ("graph_fast"); writes ``profile-qwen-<tag>.json``."""
    path = os.path.join(args.out, f"profile-qwen-{args.tag}.json")
    tf = qwen_models.random_transformer(device="cuda", dtype=torch.bfloat16)
    try:
        prof = profile_step.profile_qwen_step(tf, target_shape=QWEN_PROFILE_TARGET,
                                              text_tokens=256)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        prof = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    finally:
        del tf
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump({"environment": env, "profiles": {"qwen_image_21_t2i_1024": prof}}, f, indent=2)
    if "error" not in prof:
        log("profiles:\n" + profile_step.table({"qwen_image_21_t2i_1024": prof}))
        for key in ("graph", "graph_fast"):
            one = {"eager": prof["eager"], "graph": prof[key]}
            rows.append(_profile_row(f"qwen_image_21_t2i_1024_{key}", one,
                                     os.path.basename(path)))
    else:
        rows.append({"case": "profile_qwen_image_21_t2i_1024", "error": prof["error"]})


IMAGE_ARGS = "--size 1024 --steps 50 --cfg 4 --think both --profile"


def bench_sensenova_image(args, rows, env):
    """SenseNova-U1 whole requests and the denoising step (``sensenova_request.py``), their rows
    added to this run's. A run cut short keeps the rows of the side that finished (that script
    writes its JSON after each side)."""
    import shlex

    import sensenova_request

    out = os.path.join(args.out, "sensenova-request")
    argv = ["--out", out, *shlex.split(getattr(args, "image_args", None) or IMAGE_ARGS)]
    try:
        rc = sensenova_request.main(argv)
    finally:
        path = os.path.join(out, "sensenova-request.json")
        if os.path.exists(path):
            with open(path) as f:
                image = json.load(f)
            rows.extend(image["cases"])
            env["sensenova_request"] = {"argv": argv, "environment": image["environment"]}
    if rc:
        raise RuntimeError(f"sensenova_request.py {' '.join(argv)} exited {rc} (its log: {out})")


def bench_attention(args, rows, env):
    import attention_kernels

    attention_kernels.bench_attention(args, rows, env, log)


def bench_attention_layouts(args, rows, env):
    import attention_kernels

    attention_kernels.bench_attention_layouts(args, rows, env, log)


def bench_batch_attention(args, rows, env):
    import attention_kernels

    attention_kernels.bench_batch_attention(args, rows, env, log)


# ------------------------------------------------------------------ output

CASES = {"sensenova_decode": bench_sensenova, "sensenova_sampled": bench_sampled,
         "sensenova_think": bench_think,
         "sensenova_image": bench_sensenova_image,
         "qwen_image_21_step": bench_qwen,
         "memory": bench_memory, "profile": bench_profile, "attention": bench_attention,
         "batch_attention": bench_batch_attention,
         "attention_layouts": bench_attention_layouts,
         "qwen_profile": bench_qwen_profile}


def _write(args, rows, env):
    with open(os.path.join(args.out, f"bench-{args.tag}.json"), "w") as f:
        json.dump({"environment": env, "cases": rows}, f, indent=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="sensenova_decode,qwen_image_21_step,memory",
                    help="comma-separated, run in order: " + ", ".join(CASES))
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--qwen-modes", default="fast,exact",
                    help="Qwen-Image-2.1 modes timed per case (rows without suffix: fast)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--fa", default="3,2", help="plugin FA versions to time")
    ap.add_argument("--batch-splits", default="8,16,32",
                    help="batch_attention case: fixed split counts to time")
    ap.add_argument("--batch-pages", default="16,32,64",
                    help="batch_attention case: page sizes to time")
    ap.add_argument("--tokens-per-launch", default="1,4,8,16",
                    help="SenseNova-U1 decode: tokens per launch timed with the first FA version")
    ap.add_argument("--step-modes", type=lambda v: [m for m in v.split(",") if m], default=[],
                    help="..._SENSENOVA_STEP modes timed beside the default row (e.g. rowgemv), "
                         "with their token agreement against it; also rowgemv_plain / "
                         "rowgemv_pdl / rowgemv_pdlwait (the rowgemv step, its GEMVs plain "
                         "launches or programmatic dependent launches in that mode: the "
                         "benchmark's own, against the rowgemv row of its repeat)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="times the default row and each --step-modes row run, alternated")
    ap.add_argument("--no-exact", dest="exact", action="store_false",
                    help="skip the exact-step row of sensenova_decode")
    ap.add_argument("--fp8", action="store_true",
                    help="sensenova_decode: also the FP8 step (`_fp8` rows: against the bf16 "
                         "step and, on 0.30, the in-tree path; greedy-token agreement)")
    ap.add_argument("--fp8-lm-head", action="store_true",
                    help="with --fp8: also the step with its lm_head in FP8 (`_fp8_lmhead` rows, "
                         "VLLM_OMNI_GRAPHDECODE_FP8=sensenova_decode,sensenova_lm_head)")
    ap.add_argument("--agree-tokens", type=int, default=1024,
                    help="greedy tokens compared between the FP8 and bf16 steps")
    ap.add_argument("--think-prompt", type=int, default=512, help="sensenova_think prompt tokens")
    ap.add_argument("--think-tokens", type=int, default=1024, help="sensenova_think tokens")
    ap.add_argument("--image-args", default=IMAGE_ARGS,
                    help="sensenova_image: options for benchmarks/sensenova_request.py")
    ap.add_argument("--tag", default=None, help="result file name suffix (default: the stack)")
    ap.add_argument("--no-intree", action="store_true",
                    help="vllm-omni 0.30: skip its in-tree decode (otherwise timed in a child "
                         "process per figure, see _in_child)")
    ap.add_argument("--memory-steps", type=int, default=24, help="tokens per memory-case request")
    ap.add_argument("--child", choices=("intree_decode", "intree_think"), help=argparse.SUPPRESS)
    ap.add_argument("--child-context", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--profile-context", type=int, default=2048)
    ap.add_argument("--profile-steps", type=int, default=16, help="graphed tokens profiled")
    ap.add_argument("--profile-eager-steps", type=int, default=6, help="eager steps profiled")
    ap.add_argument("--profile-parts", type=lambda v: [p for p in v.split(",") if p],
                    default=list(PROFILE_PARTS),
                    help="which profiles: graph, graph_k1, graph_fp8 (the one-request step with "
                         "FP8 copies), graph_fp8_plain (the same without its norm folds and "
                         "dependent launches), graph_rowgemv (the bf16 row GEMV step), "
                         "graph_rowgemv_nofold (the same, its RMSNorms in launches of their "
                         "own; both with plain launches), graph_rowgemv_pdl / "
                         "graph_rowgemv_pdlwait (the same, each GEMV a programmatic dependent "
                         "launch, its first weight block asked into L2 before it waits, or not: "
                         "the step's default on Hopper is the first), eager, qwen (default: all "
                         "but graph_fp8 "
                         "and the graph_rowgemv "
                         "parts)")
    args = ap.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.fa = [f for f in args.fa.split(",") if f]
    args.tokens_per_launch = [int(k) for k in args.tokens_per_launch.split(",") if k]
    args.qwen_modes = [m for m in args.qwen_modes.split(",") if m]
    for mode in args.step_modes:  # an unknown mode: the setting's own message
        if mode in BENCH_STEP_MODES:
            continue
        try:
            config.parse({"VLLM_OMNI_GRAPHDECODE": "sensenova_u1",
                          "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP": mode})
        except ValueError as exc:
            ap.error(f"--step-modes: {exc}")
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        rm.setup_runtime("cuda")
        return _child_main(args)
    env = common.environment()
    rows: list[dict] = []
    rm.setup_runtime("cuda")
    args.tag = args.tag or ("0.30" if rm.has_intree_paged_decode() else "default")
    for i, name in enumerate(cases):
        args.pending = cases[i + 1:]
        start = time.perf_counter()
        try:
            CASES[name](args, rows, env)
        except Exception as exc:  # keep what the other cases measured
            import traceback

            traceback.print_exc()
            rows.append({"case": name, "error": repr(exc)})
        log(f"case {name}: {time.perf_counter() - start:.1f} s")
        release_model_unless_needed(args)
        torch.cuda.empty_cache()
        # Written after every case: a run cut short still leaves what it measured.
        _write(args, rows, env)
    plot(rows, os.path.join(args.out, f"bench-{args.tag}.png"))
    print(json.dumps({"environment": env, "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
