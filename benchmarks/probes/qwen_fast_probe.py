"""Qwen-Image-2.1 cached step, fast mode against diffusers, at the real shape on one GPU.

    python3 benchmarks/probes/qwen_fast_probe.py --out DIR [--scenarios t2i_1024,edit2_1024,t2i_512]
    python3 benchmarks/probes/qwen_fast_probe.py --out DIR --smoke  # tiny model on CPU, no graphs

The model is ``random_transformer()`` (the released shape, ~7 B parameters, random bf16 weights).
Per scenario (``synthetic_inputs``, 256 text tokens): one real extract step fills the prefix K/V,
then each variant runs the 32 blocks of one cached step from the same inputs:

- ``diffusers_forward``: the transformer's own cached forward, prologue and head included (no
  graph: it syncs the host).
- ``diffusers_blocks``: its block loop alone (per-layer ``torch.cat``, SDPA): what the exact graph
  replays, less ``img_in`` and the head.
- ``fast_sdpa``, ``fast_fa3``, ``fast_fa3_compile`` (emulated bf16 casts), ``..._fused_qkv``,
  ``..._no_emulate``: ``FastBlocks`` over ``KVBuffers``.

Each reports ``ms`` (eager, CUDA events, median of ``--iters`` after warm-up), ``graph_ms`` (the
same call captured in a plain ``torch.cuda.CUDAGraph`` and replayed), ``first_call_s`` (compile
included), ``max_abs_diff_blocks`` against ``diffusers_blocks`` and ``max_abs_diff_output``
(after ``norm_out``/``proj_out``) against ``diffusers_forward``. Also: one attention call at
4,096 queries, 32 heads x 128, 4,352 and 12,544 keys, FA3 vs SDPA; and Inductor graphs compiled
while 5 prefix lengths run after warm-up (0 expected). Each measurement is in its own try, so one
failure leaves the rest; results are written after every scenario; past ``--budget-s`` the rest
is recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

# The repository root (the plugin) and benchmarks/ (common) on the path: this file lives in
# benchmarks/probes/ and runs as `python3 benchmarks/probes/NAME.py`.
_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))
sys.path.insert(0, _BENCHMARKS)

import common  # noqa: E402

from vllm_omni_graphdecode import kernels
from vllm_omni_graphdecode.hooks.qwen_image_21 import fast_step as fs
from vllm_omni_graphdecode.reasons import Reason
from vllm_omni_graphdecode.testing.random_models import random_transformer, synthetic_inputs

SCENARIOS = {
    "t2i_1024": dict(target_shape=(64, 64)),
    "edit2_1024": dict(target_shape=(64, 64), reference_shapes=((64, 64), (64, 64))),
    "t2i_512": dict(target_shape=(32, 32)),
}
SMOKE_CONFIG = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, context_in_dim=24,
                    in_channels=8, out_channels=8, axes_dims_rope=(4, 6, 6))
SMOKE_SCENARIOS = {"t2i": dict(target_shape=(8, 8), text_tokens=12),
                   "edit2": dict(target_shape=(8, 8), reference_shapes=((4, 4), (4, 4)), text_tokens=12)}
# (name, attention, compile, fuse_qkv, emulate_casts)
VARIANTS = (("fast_sdpa", "sdpa", False, False, True), ("fast_fa3", "fa", False, False, True),
            ("fast_fa3_compile", "fa", True, False, True),
            ("fast_fa3_compile_fused_qkv", "fa", True, True, True),
            ("fast_fa3_compile_no_emulate", "fa", True, False, False))


def log(msg: str) -> None:
    print(msg, flush=True)


class Probe:
    def __init__(self, args):
        self.args = args
        self.cuda = not args.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.started = time.perf_counter()
        self.result = {"env": self.env(), "scenarios": {}, "attention": {}, "recompiles": {}}
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, "qwen_fast_probe.json")

    def env(self) -> dict:
        env = {"command": " ".join(sys.argv), "python": platform.python_version(),
               "torch": torch.__version__}
        for mod in ("triton", "vllm", "diffusers"):
            try:
                env[mod] = __import__(mod).__version__
            except Exception as exc:
                env[mod] = f"unavailable: {exc!r}"[:200]
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        return env

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.result, f, indent=1, default=str)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def attempt(self, record: dict, key: str, fn):
        """``record[key] = fn()``, or the error / the skip, so nothing else is lost."""
        if self.over_budget():
            record[key] = "skipped: time budget"
            return None
        try:
            record[key] = fn()
            return record[key]
        except Exception as exc:
            record[key] = f"error: {exc!r}"[:1000]
            log(f"  {key}: {record[key]}")
            return None
        finally:
            try:
                self.sync()
                if self.cuda:
                    torch.cuda.empty_cache()
            except Exception as exc:  # a sticky CUDA error: the later measurements will say so
                log(f"  {key}: sync failed: {exc!r}")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        samples = []
        for _ in range(self.args.iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t) * 1e3)
        return round(statistics.median(samples), 3)

    def graph(self, fn) -> dict:
        """``fn`` captured in a plain CUDA graph: replay ms, and whether a replay equals eager."""
        if not self.cuda:
            return {"skipped": "not CUDA"}
        expected = fn().clone()
        graph, out = common.capture_graph(fn)
        graph.replay()
        self.sync()
        equal = bool(torch.equal(out, expected))
        ms = self.time_ms(graph.replay)
        del graph, out
        return {"graph_ms": ms, "graph_equals_eager": equal}

    # -- one scenario ------------------------------------------------------------------------

    def scenario(self, tf, name: str, spec: dict) -> None:
        from diffusers.models.transformers.transformer_qwenimage21 import (
            QwenImage21KVCache,
            QwenImage21KVLayerCache,
        )

        rec = self.result["scenarios"].setdefault(name, {})
        spec = dict(spec)
        kwargs = synthetic_inputs(tf, text_tokens=spec.pop("text_tokens", 256), **spec)
        n = len(tf.transformer_blocks)
        cache = QwenImage21KVCache(n)
        tf(**kwargs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)
        prefix = [(cache.get_layer(i).k, cache.get_layer(i).v) for i in range(n)]
        seen = {}
        hooks = [tf.transformer_blocks[0].register_forward_pre_hook(
                     lambda m, a, kw: seen.update(block0=kw), with_kwargs=True),
                 tf.transformer_blocks[-1].register_forward_hook(
                     lambda m, a, out: seen.update(blocks_out=out)),
                 tf.norm_out.register_forward_pre_hook(lambda m, a: seen.update(norm_args=a[1:]))]

        def diffusers_forward():
            return tf(**kwargs, kv_cache=cache, kv_cache_mode="cached", return_dict=False)[0]

        try:
            reference = diffusers_forward()
        finally:
            for h in hooks:
                h.remove()
        b0 = seen["block0"]
        hidden = b0["hidden_states"].clone()
        modulation, rotary, mask = b0["modulation"], b0["rotary_emb"], b0["target_token_mask"]
        temb, _ = seen["norm_args"]
        blocks_ref = seen["blocks_out"]
        target = hidden.shape[1]
        rec.update(prefix_len=prefix[0][0].shape[1], target_tokens=target,
                   keys=prefix[0][0].shape[1] + target, mask_all_target=fs.mask_all_target(mask))
        log(f"{name}: prefix {rec['prefix_len']}, target {target}")

        def head(h):
            return tf.proj_out(tf.norm_out(h, temb, mask))

        def diffusers_blocks():
            h = hidden
            for block, (k, v) in zip(tf.transformer_blocks, prefix):
                layer = QwenImage21KVLayerCache()
                layer.store(k, v)
                h = block(hidden_states=h, modulation=modulation, rotary_emb=rotary,
                          target_token_mask=mask, layer_cache=layer, kv_cache_mode="cached")
            return h

        self.attempt(rec, "diffusers_forward", lambda: {"ms": self.time_ms(diffusers_forward)})

        def measure_diffusers_blocks():
            out = {"ms": self.time_ms(diffusers_blocks),
                   "max_abs_diff_blocks": float((diffusers_blocks().float() - blocks_ref.float()).abs().max())}
            out.update(self.graph(diffusers_blocks))
            return out

        self.attempt(rec, "diffusers_blocks", measure_diffusers_blocks)
        log(f"  diffusers: forward {rec['diffusers_forward']}, blocks {rec['diffusers_blocks']}")

        bufs = self.attempt(rec, "kv_buffers", lambda: fs.KVBuffers.from_prefix(prefix, target))
        if isinstance(bufs, fs.KVBuffers):
            rec["kv_buffers"] = {"gib": round(bufs.nbytes / 2**30, 3)}
            for variant in VARIANTS:
                self.attempt(rec, variant[0], lambda v=variant: self.fast(
                    tf, v, hidden, modulation, rotary, bufs, blocks_ref, reference, head))
                log(f"  {variant[0]}: {rec[variant[0]]}")
            self.save()
            if name == self.args.recompile_scenario:
                self.attempt(self.result, "recompiles",
                             lambda: self.recompiles(tf, hidden, modulation, rotary, bufs))
                log(f"  recompiles: {self.result['recompiles']}")
        self.save()

    def attention_kernel(self, kind: str):
        if kind == "sdpa" or not self.cuda:  # --smoke: the FA3 variants run SDPA on CPU
            return kernels.SdpaAttention()
        head_dim = self.tf_head_dim
        found = kernels.select_dense_attention(self.device, head_dim, torch.bfloat16, "3")
        if isinstance(found, Reason):
            raise RuntimeError(f"FA3 not available: {found.describe()}; hint: {found.hint}")
        return found

    def fast(self, tf, variant, hidden, modulation, rotary, bufs, blocks_ref, reference, head) -> dict:
        _, kind, compile_, fuse, emulate = variant
        if compile_ and not self.args.compile:
            return {"skipped": "--no-compile"}
        attention = self.attention_kernel(kind)
        fast = fs.FastBlocks(tf, attention, compile=compile_, fuse_qkv=fuse, emulate_casts=emulate)
        fast.prepare(bufs)
        graphs = fs.compiled_graphs()
        start = time.perf_counter()
        out = fast(hidden, modulation, rotary, bufs)
        self.sync()
        rec = {"attention": attention.name, "first_call_s": round(time.perf_counter() - start, 3),
               "compiled_graphs": fs.compiled_graphs() - graphs,
               "max_abs_diff_blocks": float((out.float() - blocks_ref.float()).abs().max()),
               "max_abs_diff_output": float((head(out).float() - reference.float()).abs().max()),
               "ms": self.time_ms(lambda: fast(hidden, modulation, rotary, bufs))}
        static = hidden.clone()
        rec.update(self.graph(lambda: fast(static, modulation, rotary, bufs)))
        return rec

    def recompiles(self, tf, hidden, modulation, rotary, bufs) -> dict:
        """Inductor graphs compiled while 5 other prefix lengths run (random prefix K/V)."""
        fast = fs.FastBlocks(tf, self.attention_kernel("fa"), compile=True)
        fast.prepare(bufs)
        fast(hidden, modulation, rotary, bufs)  # warm-up at this shape
        before = fs.compiled_graphs()
        k = bufs.k[0]
        lengths = (77, 300, 901, 2048, 4000) if self.cuda else (3, 9, 17, 30, 41)
        for p in lengths:
            other = fs.KVBuffers(len(bufs.k), k.shape[0], p, bufs.target_len, k.shape[2], k.shape[3],
                                 dtype=k.dtype, device=k.device)
            for pk, pv in other.prefix_views():
                pk.normal_()
                pv.normal_()
            fast.prepare(other)
            fast(hidden, modulation, rotary, other)
            del other
        self.sync()
        return {"prefix_lengths": list(lengths), "graphs_compiled_after_warmup": fs.compiled_graphs() - before}

    def attention(self) -> None:
        rec = self.result["attention"]
        if not self.cuda:
            rec["skipped"] = "not CUDA"
            return
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, 4096, 32, 128, device="cuda", generator=gen).bfloat16()
        for keys in (4352, 12544):
            k, v = (torch.randn(1, keys, 32, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))

            def one(keys=keys, k=k, v=v):
                sdpa = kernels.SdpaAttention()
                fa = self.attention_kernel("fa")
                fa.prepare(1, 4096, keys, "cuda")
                ref = sdpa(q.float(), k.float(), v.float())
                return {"sdpa_ms": self.time_ms(lambda: sdpa(q, k, v)),
                        "fa3_ms": self.time_ms(lambda: fa(q, k, v)),
                        "sdpa_max_abs_diff_vs_fp32": float((sdpa(q, k, v).float() - ref).abs().max()),
                        "fa3_max_abs_diff_vs_fp32": float((fa(q, k, v).float() - ref).abs().max())}

            self.attempt(rec, f"keys_{keys}", one)
            log(f"attention {keys} keys: {rec[f'keys_{keys}']}")
        self.save()

    def run(self) -> None:
        args = self.args
        start = time.perf_counter()
        if args.smoke:
            tf = random_transformer(device="cpu", dtype=torch.bfloat16, **SMOKE_CONFIG)
            scenarios = SMOKE_SCENARIOS
        else:
            tf = random_transformer()
            scenarios = {n: SCENARIOS[n] for n in args.scenarios.split(",") if n}
        self.result["env"]["build_s"] = round(time.perf_counter() - start, 1)
        attn0 = tf.transformer_blocks[0].attn
        self.tf_head_dim = attn0.inner_dim // attn0.heads
        selected = kernels.select_dense_attention(self.device, self.tf_head_dim, torch.bfloat16)
        self.result["env"]["auto_attention"] = selected.name
        self.result["env"]["auto_attention_skipped"] = [s.describe() for s in selected.skipped]
        unsupported = fs.compile_supported(self.device)
        self.result["env"]["compile_supported"] = unsupported.describe() if unsupported else "yes"
        log(f"model built in {self.result['env']['build_s']} s; attention {self.result['env']['auto_attention']}")
        with torch.no_grad():
            self.attention()
            for name, spec in scenarios.items():
                try:
                    self.scenario(tf, name, spec)
                except Exception as exc:
                    self.result["scenarios"].setdefault(name, {})["error"] = f"{exc!r}"[:1000]
                    log(f"{name}: error {exc!r}")
                self.save()
        self.result["total_s"] = round(time.perf_counter() - self.started, 1)
        self.save()
        log(f"wrote {self.path} in {self.result['total_s']} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=320.0,
                    help="stop starting measurements after this many seconds")
    ap.add_argument("--recompile-scenario", default="t2i_1024")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, no FA3 and no graphs")
    args = ap.parse_args()
    if args.smoke:
        args.recompile_scenario = "t2i"
        args.iters = min(args.iters, 3)
    Probe(args).run()


if __name__ == "__main__":
    main()
