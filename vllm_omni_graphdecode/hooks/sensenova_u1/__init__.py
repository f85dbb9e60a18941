"""SenseNova-U1: think and text decode through paged K/V and CUDA graphs, one request at a time
or several together; image denoising replayed as CUDA graphs.

Why: SenseNova-U1 decodes its think text (before an image) and its text answers one token per
``language_model`` call inside the pipeline's own loop, with a ``DynamicCache`` that grows by
``torch.cat``; every token reads all of the understanding weights. The figures (eager against
paged + graph, per vllm-omni release, and requests served together) are in
docs/performance.md, each linked to its results folder. Upstream reported the same change on an
A800 as think decode 16.1 s eager -> 6.2 s paged -> 3.5 s paged + graph (the project's
shared/FACTS.md, section 5; the pull request was not recorded there).

Files, one concern each:

    layouts.py     the vllm-omni code layouts (0.24-0.28 "backport", 0.30 "in-tree") and every
                   signature checked before patching
    rules.py       the gate: why a request runs eagerly (TP, offload, compile, KV quant, hooks),
                   over a walk of the model made again only after a change
    step.py        the one-token step over paged K/V (the attention branch, the static inputs)
    step_args.py   the plugin's keyword down the model's kwargs chain and its value, which
                   step.py passes and fused_step.py's patched layers read
    fused_step.py  vllm's fused norms and SiLU; on 0.24-0.28 also rope once per step (delete that
                   part with the backport layout); opt-in tuned GEMVs; FP8 copies
    gemv_table.py  the one-row FP8 GEMV's measured block sizes at this model's shapes, handed to
                   ``ops/fp8``
    ops.py         one rms_norm, rope-table and q/k-norm + rope, shared by the bodies below
    batch.py       requests decoding together under --max-num-seqs > 1: the engine's declaration,
                   the batched forward, the 16-row step
    images.py      n images for one request (num_outputs_per_prompt), from one prefill
    steps.py       continuous batching under --step-execution: requests join and leave the
                   batch at every step (vLLM-Omni's step-execution protocol, its admission key)
    wiring.py      install() / unwire(): the pipeline methods patched (through one
                   patching.Patches), sleep release, pre-capture
    denoise.py     image denoising: each CFG branch's step replayed over static prefix + image
                   K/V buffers (``graphs/prefix.py``); ``fast_denoise.py`` its restated body

The mechanisms are model-agnostic: ``decode/session.py`` / ``decode/tiers.py`` (one sequence at a
time, hand-backs, LoRA, release), ``decode/batch/decoder.py`` / ``decode/batch/kv.py`` / ``turns``
(several together).

vllm-omni 0.30 ships its own paged decode (``_decode_context``). By default this hook defers to
it for one request at a time; with ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE=takeover``, or
whenever the engine batches (``--max-num-seqs`` above 1), the in-tree context is replaced by one
that returns None (so it cannot run too) and this hook's path runs.

Both loops take several tokens per graph launch, each next token chosen on the device
(``vllm_omni_graphdecode.decode.token_loop``, ``decode/batch/decoder.py``): by argmax, or, for a
text loop that samples, drawn on the device at the loop's temperature.

Counted in ``stats`` under "sensenova_u1": ``paged_request`` (sessions opened), ``capture``,
``replay``, ``token_launch`` (multi-token launches), ``host_picked_token`` (tokens near a bucket's
end, one launch each), ``sampled_request`` (text loops drawn on the device), ``paged_eager_step``
(paged step without a graph), ``eager_step`` (a step of the pipeline's own decode),
``lora_request`` (graphs captured for one request only), ``verified`` / ``verify_mismatch``, the
batched path's ``batch_*`` counters (``decode/batch/decoder.py``, ``batch.py``), and each fallback
by its reason.

Scope: TP 1. Delete the backport layout and the rope-once part of ``fused_step.py`` when
vllm-omni < 0.30 is no longer supported.
"""

from __future__ import annotations

from ...decode.session import BUSY, CAPTURE_FAILED, OOM, RELEASED
from .fused_step import UNFUSED, Fusion
from .layouts import LAYOUTS, Layout, detect_layout
from .rules import COMPILED, HOOKED, KV_QUANT, OFFLOAD, TP
from .step import MODEL, PAGED_KWARG, paged_decoder
from .wiring import STATE_ATTR, install, unwire

__all__ = ["BUSY", "CAPTURE_FAILED", "COMPILED", "Fusion", "HOOKED", "KV_QUANT", "LAYOUTS",
           "Layout", "MODEL", "OFFLOAD", "OOM", "PAGED_KWARG", "RELEASED", "STATE_ATTR", "TP",
           "UNFUSED", "declare_batching", "detect_layout", "find_target", "install",
           "paged_decoder", "support", "unwire", "widen_step_admission", "wire"]


def support() -> dict[str, str]:
    image = ("; image denoising: each CFG branch's step replays a CUDA graph "
             "(VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE=graph, default)")
    done = "think + text decode: paged K/V + CUDA graph per bucket (backport)" + image
    return {
        "0.24": done,
        "0.26": done,
        "0.28": done,
        "0.30": ("in-tree paged decode present: defer (default) leaves it in charge; "
                 "takeover replaces its decode context with this plugin's (FA3 on Hopper); "
                 "VLLM_OMNI_GRAPHDECODE_FP8 naming sensenova_decode makes the plugin's decode "
                 "serve too (the in-tree step has no FP8 weights)" + image),
    }


def find_target(pipeline):
    """The pipeline itself when it is (or derives from) vllm-omni's SenseNovaU1Pipeline."""
    for cls in type(pipeline).__mro__:
        if cls.__name__ == "SenseNovaU1Pipeline" and cls.__module__.startswith("vllm_omni."):
            return pipeline
    return None


def wire(target, cfg, runner) -> str:
    return install(target, cfg, runner)


def declare_batching(module, cfg) -> str | None:
    """Called right after vllm-omni imports its SenseNova-U1 pipeline module, in every process
    that loads the plugin (``models.Model.on_import``): declares request batching and
    cancellation (``batch.declare``) and step execution (``steps.declare``) there unless
    ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_BATCH=off``."""
    if cfg.sensenova_batch == "off":
        return None
    cls = getattr(module, "SenseNovaU1Pipeline", None)
    if cls is None:
        return "request batching not declared: the module has no SenseNovaU1Pipeline"
    from . import batch, images, steps

    return f"{batch.declare(cls)}; {images.declare(module)}; {steps.declare(cls)}"


def widen_step_admission(module, cfg) -> str | None:
    """Called right after vllm-omni imports its step scheduler (``models.Model.on_import``):
    SenseNova-U1 requests of every size and kind join one running batch (``steps.py``)."""
    from . import steps

    return steps.widen_step_admission(module, cfg)
