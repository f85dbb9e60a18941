"""The demo (``bash scripts/demo.sh``): tiny real models with random weights through the plugin.

It builds vllm-omni's ``SenseNovaU1ForCausalLM`` + ``SenseNovaU1Pipeline`` loops and diffusers'
``QwenImage21Transformer2DModel`` at small sizes, hands each to the plugin's model-load hook the
way vllm-omni's ``DiffusionModelRunner.load_model`` does, runs the same request with and without
the plugin, and prints what was wired, the path each step took, timings, whether the outputs are
equal, and every fallback reason. On a CPU-only machine the path is the eager one, with its
reason; on a GPU the decode steps replay CUDA graphs.
"""

from __future__ import annotations

import importlib
import json
import os
import time

import torch

from .. import config
from ..core import loading, stats

# head_dim 128 and 4:1 grouped-query attention, as in the released model.
SENSENOVA_GPU = dict(num_layers=4, hidden=512, heads=8, kv_heads=2, head_dim=128, vocab=96,
                     intermediate=1024)
QWEN_CPU = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, context_in_dim=24,
                in_channels=8, out_channels=8, axes_dims_rope=(4, 6, 6))
QWEN_GPU = dict(num_layers=4, attention_head_dim=64, num_attention_heads=8, context_in_dim=64,
                in_channels=16, out_channels=16, axes_dims_rope=(16, 24, 24))


def _load_hook_runner(pipeline):
    """A real ``DiffusionModelRunner`` holding ``pipeline``, as after its ``load_model`` (its
    constructor needs a serving config; the load hook reads only ``runner.pipeline``)."""
    module = importlib.import_module(loading.RUNNER_MODULE)
    runner = object.__new__(module.DiffusionModelRunner)
    runner.pipeline = pipeline
    return runner


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def _path(model: str) -> str:
    replays = stats.get(model, "replay")
    paged = stats.get(model, "paged_eager_step")
    eager = stats.get(model, "eager_step")
    parts = [f"{replays} graph replays"]
    if paged:
        parts.append(f"{paged} paged steps without a graph")
    if eager:
        parts.append(f"{eager} eager steps")
    return ", ".join(parts)


def sensenova(device: str) -> bool:
    from . import sensenova as rm

    print("\n== SenseNova-U1 (vllm-omni SenseNovaU1ForCausalLM, random weights) ==")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = SENSENOVA_GPU if device == "cuda" else {}
    tok = rm.build_tokenizer(shape.get("vocab", 96))
    lm = rm.build_lm(rm.llm_config(**shape) if shape else None, device=device, dtype=dtype,
                     banned_ids=rm.stop_ids(tok))
    ids = rm.prompt_ids(tok, 24, device=device)
    steps = 300 if device == "cuda" else 40
    eager = rm.build_pipeline(lm, tok, device=device)
    ref_logits = rm.record_ar_steps(eager)
    ref_text, eager_ms = _timed(lambda: rm.run_text(eager, ids, steps))
    ref_think = rm.run_think(eager, ids, steps)[2]

    pipe = rm.build_pipeline(lm, tok, device=device)
    for line in loading.after_load(_load_hook_runner(pipe)):
        print(f"wired: {line}")
    stats.reset_counters()
    text, ours_ms = _timed(lambda: rm.run_text(pipe, ids, steps))  # first request
    text2, ours2_ms = _timed(lambda: rm.run_text(pipe, ids, steps))
    think = rm.run_think(pipe, ids, steps)[2]
    print(f"text loop, {steps} tokens: eager {eager_ms / steps:.2f} ms/token; plugin "
          f"{ours_ms / steps:.2f} ms/token (first request), {ours2_ms / steps:.2f} ms/token "
          f"(second)")
    print(f"path: {_path('sensenova_u1')}")
    if device != "cuda":
        # No graph and no FlashAttention here: the fallback is the pipeline's own eager step.
        ok = True
        for name, ref, got in (("text", ref_text, text), ("text, again", ref_text, text2),
                               ("think", ref_think, think)):
            ok &= _report_tokens(name, ref.split(), got.split(), ref_logits[:steps])
        return ok
    # On the GPU the graph must replay exactly what the same paged step computes without a graph
    # (same kernels). Against the pipeline's eager step (SDPA over a DynamicCache) the math is the
    # same but the kernel is not: FA3 and SDPA round bf16 differently, and with random weights a
    # greedy decode drifts apart after a few dozen tokens. The math itself is checked on CPU in
    # fp32 (tests/test_sensenova_cpu.py: logits within 1e-4, identical tokens).
    from ..hooks import sensenova_u1

    paged = rm.build_pipeline(lm, tok, device=device)
    sensenova_u1.install(paged, cfg_no_precapture(), graphs=False)
    paged_logits = rm.record_ar_steps(paged)
    paged_text = rm.run_text(paged, ids, steps)
    paged_think = rm.run_think(paged, ids, steps)[2]
    ok = True
    for name, ref, got in (("text: graph replay vs the paged step without graphs", paged_text, text),
                           ("text, again", paged_text, text2),
                           ("think: graph replay vs the paged step without graphs", paged_think,
                            think)):
        ok &= _report_tokens(name, ref.split(), got.split(), paged_logits[:steps])
    _report_tokens("text: paged step (FA3) vs the pipeline's eager step (SDPA), for information",
                   ref_text.split(), text.split(), ref_logits[:steps])
    return ok


def sensenova_image(device: str) -> bool:
    """A SenseNova-U1 text-to-image request (CFG 4) through vllm-omni's whole pipeline, built by
    its own ``__init__`` from the tiny checkpoint ``examples/make_tiny_checkpoints.py`` writes."""
    import tempfile

    import numpy as np

    from . import sensenova as rm

    print("\n== SenseNova-U1 image (vllm-omni SenseNovaU1Pipeline, tiny checkpoint) ==")
    if not os.path.exists(rm.TINY_CHECKPOINTS):
        print(f"skipped: {rm.TINY_CHECKPOINTS} not found (the demo's image part runs from the "
              f"repository)")
        return True
    out = rm.write_tiny_checkpoints(tempfile.mkdtemp(prefix="graphdecode_demo_"))
    checkpoint = os.path.join(out, "sensenova_u1")
    request = rm.image_request(num_steps=6)

    def generate(pipe):
        with torch.inference_mode():
            result = pipe._forward_t2i(request)
        return np.asarray(result.output["payload"]["image"])

    eager = rm.load_sensenova_pipeline(checkpoint, device=device, dtype=torch.bfloat16)
    generate(eager)  # warm-up: one-time initialisation is not the eager step's cost
    ref, eager_ms = _timed(lambda: generate(eager))
    pipe = rm.load_sensenova_pipeline(checkpoint, device=device, dtype=torch.bfloat16)
    for line in loading.after_load(_load_hook_runner(pipe)):
        print(f"wired: {line}")
    stats.reset_counters()
    image, ours_ms = _timed(lambda: generate(pipe))  # first request: binds and captures
    image2, ours2_ms = _timed(lambda: generate(pipe))
    print(f"text-to-image, {request.num_steps} steps, CFG {request.cfg_scale:g}: eager "
          f"{eager_ms:.1f} ms; plugin {ours_ms:.1f} ms (first request), {ours2_ms:.1f} ms "
          f"(second)")
    model = "sensenova_u1_image"
    print(f"path: {stats.get(model, 'replay')} graph replays, "
          f"{stats.get(model, 'eager_branch')} branch steps of the pipeline's own")
    exact = np.array_equal(ref, image) and np.array_equal(ref, image2)
    print(f"images equal to eager: {'bit for bit' if exact else 'NO'}")
    return exact


def cfg_no_precapture():
    env = dict(os.environ, VLLM_OMNI_GRAPHDECODE_PRECAPTURE="0")
    return config.parse(env)


# Where eager's best two logits are closer than this, a different kernel's bf16 rounding (FA3 here,
# SDPA in the eager path) may pick the other one: a near-tie, not a wrong result.
NEAR_TIE = 0.125


def _report_tokens(name, ref, got, ref_logits) -> bool:
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if first is None and len(ref) == len(got):
        print(f"{name}: all {len(ref)} tokens identical")
        return True
    if first is None or first == 0 or first - 1 >= len(ref_logits):
        print(f"{name}: differs from eager (lengths {len(ref)} vs {len(got)})")
        return False
    top2 = ref_logits[first - 1].topk(2).values.flatten()
    margin = float(top2[0] - top2[1])
    tie = margin < NEAR_TIE
    print(f"{name}: first {first} of {len(ref)} tokens identical; token {first} differs where "
          f"the reference's top-2 logits are {margin:.3f} apart "
          f"({'a bf16 near-tie, accepted' if tie else 'NOT a near-tie'})")
    return tie


def qwen_image_21(device: str) -> bool:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    from . import qwen

    print("\n== Qwen-Image-2.1 (diffusers QwenImage21Transformer2DModel, random weights) ==")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    tf = qwen.random_transformer(device=device, dtype=dtype,
                                 **(QWEN_GPU if device == "cuda" else QWEN_CPU))
    kwargs = qwen.synthetic_inputs(tf, text_tokens=32, target_shape=(16, 16))
    steps = 8

    def denoise():
        cache = QwenImage21KVCache(len(tf.transformer_blocks))
        outs = []
        with torch.no_grad():
            tf(**kwargs, kv_cache=cache, kv_cache_mode="extract", return_dict=False)
            for i in range(steps):
                step = dict(kwargs, timestep=torch.full_like(kwargs["timestep"], 0.9 - 0.1 * i))
                outs.append(tf(**step, kv_cache=cache, kv_cache_mode="cached",
                               return_dict=False)[0].clone())
        return outs

    ref, eager_ms = _timed(denoise)
    # The load hook finds the transformer in whatever vllm-omni loaded (a diffusers pipeline,
    # the adapter's inner pipeline, or the transformer itself).
    for line in loading.after_load(_load_hook_runner(tf)):
        print(f"wired: {line}")
    stats.reset_counters()
    outs, ours_ms = _timed(denoise)  # first request: binds and captures
    outs2, ours2_ms = _timed(denoise)
    pairs = list(zip(ref, outs)) + list(zip(ref, outs2))
    diff = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    exact = all(torch.equal(a, b) for a, b in pairs)
    print(f"extract + {steps} cached steps: eager {eager_ms:.1f} ms; plugin {ours_ms:.1f} ms "
          f"(first request), {ours2_ms:.1f} ms (second)")
    print(f"path: {_path('qwen_image_21')}")
    print(f"outputs equal to eager: {'bit for bit' if exact else f'max |diff| {diff:.3g}'}")
    return exact or diff < 1e-2


def main(json_stats: bool = False) -> int:
    os.environ.setdefault(config.ENABLE_VAR, "all")
    # vllm-omni 0.30 (this environment) has its own SenseNova paged decode, which the plugin
    # defers to by default; the demo shows the plugin's own path unless told otherwise.
    os.environ.setdefault("VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE", "takeover")
    cfg = config.get()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("vllm-omni-graphdecode demo")
    print(f"device: {torch.cuda.get_device_name(0) if device == 'cuda' else 'CPU (no CUDA device)'}")
    print(f"configuration: {cfg.as_env()}")
    ok = True
    if "sensenova_u1" in cfg.models:
        ok &= sensenova(device)
        ok &= sensenova_image(device)
    if "qwen_image_21" in cfg.models:
        ok &= qwen_image_21(device)
    snap = stats.snapshot()
    print("\n== fallbacks (reason: count) ==")
    for reason, n in snap["fallbacks"].items() or {"none": 0}.items():
        print(f"  {reason}: {n}")
    if json_stats:
        print(json.dumps(snap, indent=2))
    print("\nresult: " + ("outputs equal with and without the plugin" if ok
                          else "OUTPUTS DIFFER (see above)"))
    return 0 if ok else 1
