"""What a faster SenseNova-U1 denoising step body could gain, part by part, before it is built.

    python3 benchmarks/probes/sensenova_denoise_probe.py --out DIR [--size 1024]      (H200: ~2 min)

writes ``DIR/sensenova-denoise-probe.json`` and prints it. ``--tiny --device cpu --size 64``
runs the same code on the tiny checkpoint (the CPU test; nothing there is a GPU figure).

Why (issue #13)
    The plugin replays each CFG branch's step as the pipeline's own code. On vllm-omni 0.30 at
    1024x1024 that step is 34 ms of GPU work a branch (``h200-2026-12-01b/request-0.30.json``):
    GEMMs 22.7 ms, already at the measured matmul rate, and ~11 ms of everything else: the Triton
    q/k norm + 3-D rope kernel (~53 us a layer for 1,024 tokens), the diffusion attention, the
    transposes around them, RMSNorm, the residual adds and SiLU * up as separate kernels. A
    compiled body would restate the layer around the GEMMs; this probe measures, on the real
    layer's weights and the real branch inputs, what each part costs today and what its
    replacement costs, and how far the replacement's result is from the layer's, so the body is
    built from numbers. Nothing here changes the pipeline.

Parts (layer 0 of the generation pathway, inputs taken from the cond branch's first step of a
one-step request, inside the denoising loop while its prefix + image buffers live)
    qk_rope    the layer's ``_project_and_rope`` after the qkv GEMM (the Triton kernel where it
               loads, else the PyTorch fallback) plus the ``transpose(1, 2).contiguous()``
               copies ``forward_gen`` makes of q, k and v; against the fallback's math restated
               as one function of tensors producing (B, S, H, D) directly, compiled by Inductor.
    attention  the layer's own attention call (vllm-omni's diffusion ``Attention``, whatever
               backend it picked) on q against the prefix + image K/V; against vllm's FA3 and
               FA2 varlen builds (``kernels.select_dense_attention``).
    post       o_proj, residual add, ``post_attention_layernorm_mot_gen``, ``mlp_mot_gen``
               (gate_up GEMM, SiLU, multiply, down GEMM), residual add, and the next layer's input
               RMSNorm, as the modules run them; against the same math compiled by Inductor (the
               GEMMs stay cuBLAS calls inside the compiled region).
    The restated functions are the fast denoising body's own (``fast_denoise.py``), so this
    measures what ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE=fast`` runs, part by part.
    Each is timed as a CUDA graph replay (median of ``--iters``), per layer and x layers for a
    branch step; ``max_abs_diff`` against the layer's own result (bf16).

Not a benchmark of the plugin: no row here is a speed claim. The whole-request figures are
``sensenova_request.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

# The repository root (the plugin) and benchmarks/ (common, sensenova_request) on the path: this
# file lives in benchmarks/probes/ and runs as `python3 benchmarks/probes/NAME.py`.
_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))
sys.path.insert(0, _BENCHMARKS)

import common  # noqa: E402
import sensenova_request as sr  # noqa: E402
from vllm_omni_graphdecode.hooks.sensenova_u1 import fast_denoise as fd  # noqa: E402


class Probe:
    def __init__(self, args, device):
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn) -> float:
        """Median ms per call: a CUDA graph's replay where there is CUDA, else a plain call."""
        if self.cuda:
            graph, _ = common.capture_graph(fn)
            return round(common.time_ms(graph.replay, warmup=1, repeats=self.args.iters), 4)
        run = fn
        run()
        samples = []
        for _ in range(self.args.iters):
            start = time.perf_counter()
            run()
            samples.append((time.perf_counter() - start) * 1e3)
        return round(statistics.median(samples), 4)

    def attempt(self, record: dict, key: str, fn):
        try:
            record[key] = fn()
        except Exception as exc:  # one part failing must not lose the others
            record[key] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        return record[key]


def _diff(a, b) -> float:
    if isinstance(a, (tuple, list)):
        return max(_diff(x, y) for x, y in zip(a, b))
    return round(float((a.float() - b.float()).abs().max()), 6)


def _compile(fn, args):
    return torch.compile(fn, dynamic=False, fullgraph=True) if args.compile else None


def probe_layer(pipe, kw, args, device) -> dict:
    lm = pipe.language_model
    model = lm.model
    layer, nxt = model.layers[0], model.layers[min(1, len(model.layers) - 1)]
    attn = layer.self_attn
    p = Probe(args, device)
    x = kw["input_embeds"]
    idx = kw["indexes_image"]
    cache = kw["past_key_values"].layers[0]
    prefix = int(cache.flash_prefix_len)
    b, s = x.shape[:2]
    eps = layer.input_layernorm_mot_gen.variance_epsilon
    chain = bool(fd.cast_chain_norm(layer.input_layernorm_mot_gen))
    rot_t = getattr(attn, "rotary_emb", None) or model.rotary_emb
    rot_hw = getattr(attn, "rotary_emb_hw", None) or model.rotary_emb_hw
    tables = (rot_t(x, idx[0].unsqueeze(0)), rot_hw(x, idx[1].unsqueeze(0)),
              rot_hw(x, idx[2].unsqueeze(0)))
    qkv_w = attn.qkv_proj_mot_gen.weight
    qkv_b = getattr(attn.qkv_proj_mot_gen, "bias", None)
    normed = layer.input_layernorm_mot_gen(x)
    qkv = F.linear(normed, qkv_w, qkv_b)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(b, s, attn.num_heads, attn.head_dim)
    k = k.view(b, s, attn.num_kv_heads, attn.head_dim)
    v = v.view(b, s, attn.num_kv_heads, attn.head_dim)
    norms = (attn.q_norm_mot_gen, attn.k_norm_mot_gen, attn.q_norm_hw_mot_gen,
             attn.k_norm_hw_mot_gen)
    weights = tuple(n.weight for n in norms)
    out = {"layers": len(model.layers), "image_tokens": s, "prefix_tokens": prefix,
           "heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim}

    # -- q/k norm + rope -----------------------------------------------------------------------
    try:
        from vllm_omni.diffusion.models.sensenova_u1.fused_rmsnorm_rope import triton_qk_norm_rope
    except ImportError:
        triton_qk_norm_rope = None

    def own_rope():
        if triton_qk_norm_rope is not None:
            qh, kh = triton_qk_norm_rope(q, k, *weights, *tables[0], *tables[1], *tables[2], eps)
        else:
            qs, ks = fd.qk_norm_rope(q, k, *weights, tables, eps, chain)
            qh, kh = qs.transpose(1, 2), ks.transpose(1, 2)
        vh = v.transpose(1, 2)
        return (qh.transpose(1, 2).contiguous(), kh.transpose(1, 2).contiguous(),
                vh.transpose(1, 2).contiguous())

    rec = out.setdefault("qk_rope", {"own_kernel": "triton_qk_norm_rope"
                                     if triton_qk_norm_rope is not None else "PyTorch fallback"})
    want = own_rope()
    p.attempt(rec, "own_ms", lambda: p.time_ms(own_rope))
    restated = functools.partial(fd.qk_norm_rope, q, k, *weights, tables, eps, chain)
    rec["restated_max_abs_diff"] = _diff(restated(), want[:2])
    fast = _compile(fd.qk_norm_rope, args)
    if fast is not None:
        call = functools.partial(fast, q, k, *weights, tables, eps, chain)
        p.attempt(rec, "compiled_ms", lambda: p.time_ms(call))
        p.attempt(rec, "compiled_max_abs_diff", lambda: _diff(call(), want[:2]))

    # -- attention -------------------------------------------------------------------------------
    qs, ks, vs = want
    keys = cache.flash_k_cache[:, : prefix + s]
    values = cache.flash_v_cache[:, : prefix + s]
    keys[:, prefix:].copy_(ks)
    values[:, prefix:].copy_(vs)
    from vllm_omni_graphdecode.hooks.sensenova_u1 import denoise

    rec = out.setdefault("attention", {"own_backend": denoise._attention_backend(lm)})
    reference = attn._run_attn_bshd(qs, keys, values, None)
    p.attempt(rec, "own_ms", lambda: p.time_ms(lambda: attn._run_attn_bshd(qs, keys, values,
                                                                           None)))
    from vllm_omni_graphdecode import kernels

    for setting in ("3", "2"):
        kernel = kernels.select_dense_attention(device, attn.head_dim, qs.dtype, setting)
        entry = rec.setdefault(f"fa{setting}", {})
        if not callable(kernel):
            entry["skipped"] = str(kernel)
            continue
        kernel.prepare(b, s, prefix + s, device)
        call = functools.partial(kernel, qs, keys.contiguous(), values.contiguous())
        p.attempt(entry, "ms", lambda c=call: p.time_ms(c))
        p.attempt(entry, "max_abs_diff", lambda c=call: _diff(c(), reference))

    # -- after the attention ------------------------------------------------------------------
    mlp = layer.mlp_mot_gen
    post_norm = layer.post_attention_layernorm_mot_gen
    post_w = (attn.o_proj_mot_gen.weight, getattr(attn.o_proj_mot_gen, "bias", None),
              post_norm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
              nxt.input_layernorm_mot_gen.weight, post_norm.variance_epsilon,
              nxt.input_layernorm_mot_gen.variance_epsilon, chain)

    def own_post():
        h = x + attn.o_proj_mot_gen(reference.reshape(b, s, -1))[0]
        o = h + mlp(post_norm(h))
        return o, nxt.input_layernorm_mot_gen(o)

    rec = out.setdefault("post", {})
    want_post = own_post()
    p.attempt(rec, "own_ms", lambda: p.time_ms(own_post))
    rec["restated_max_abs_diff"] = _diff(fd.post_attention(x, reference, *post_w), want_post)
    fast = _compile(fd.post_attention, args)
    if fast is not None:
        call = functools.partial(fast, x, reference, *post_w)
        p.attempt(rec, "compiled_ms", lambda: p.time_ms(call))
        p.attempt(rec, "compiled_max_abs_diff", lambda: _diff(call(), want_post))

    # -- per branch step ----------------------------------------------------------------------
    gain = 0.0
    for part, new in (("qk_rope", "compiled_ms"), ("post", "compiled_ms")):
        own, alt = out[part].get("own_ms"), out[part].get(new)
        if isinstance(own, float) and isinstance(alt, float):
            gain += own - alt
    fas = [out["attention"].get(f"fa{v}", {}).get("ms") for v in ("3", "2")]
    fas = [t for t in fas if isinstance(t, float)]
    if isinstance(out["attention"].get("own_ms"), float) and fas:
        gain += out["attention"]["own_ms"] - min(fas)
    out["projected_saving_ms_per_branch_step"] = round(gain * len(model.layers), 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the Inductor variants")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.tiny and device.type != "cuda":
        ap.error("the real shape needs a CUDA device; use --tiny on a CPU")
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="sensenova-probe-")
    dtype = torch.bfloat16
    if args.tiny:
        pipe = sr.build_tiny_pipeline(device, dtype, args.seed, workdir)
    else:
        pipe = sr.build_real_pipeline(device, dtype, args.seed, workdir, sr.PROMPT)
    result = {"environment": dict(common.environment() if device.type == "cuda" else
                                  {"device": "cpu"}, command=" ".join(sys.argv))}
    original = pipe._t2i_predict_v

    def measure(*a, **kw):
        if "layer" not in result:  # the cond branch's first call: its buffers live here
            with torch.inference_mode():
                result["layer"] = probe_layer(pipe, kw, args, device)
        return original(*a, **kw)

    pipe._t2i_predict_v = measure
    try:
        pipe.forward(sr.make_request(size=args.size, steps=1, cfg=args.cfg, think=False,
                                     seed=args.seed, prompt=sr.PROMPT, tag="probe"))
    finally:
        pipe._t2i_predict_v = original
    path = os.path.join(args.out, "sensenova-denoise-probe.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
