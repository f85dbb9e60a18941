"""Qwen-Image-2.1 (diffusers ``QwenImage21Transformer2DModel``): cached denoising steps as CUDA graphs.

Why this exists
    Qwen-Image-2.1's pipeline runs step 0 with ``kv_cache_mode="extract"`` (the whole joint sequence,
    storing the text and condition-image K/V of every layer, post-RoPE, ``(B, prefix, heads,
    head_dim)``) and every later step with ``"cached"``: only the target image's tokens are recomputed,
    each layer attending over ``torch.cat([cached_k, k])``. A cached step has the same shapes for the
    whole request. ``graphs/prefix.py`` captures it once per entry and replays it; this file is
    everything Qwen-specific: what it reads from diffusers, eligibility, the step body and the
    wiring.

What runs where on a cached step
    once per request branch (bind), eager: the target's rotary rows and modulation mask from the
        model's own ``pos_embed`` and ``build_token_metadata`` (host syncs: ``.tolist()``,
        ``nonzero``, ``int()``), checked against the cached prefix length; the prefix K/V copied into
        buffers the request owns, and the request's cache re-pointed at them (so they are not held
        twice).
    every step, eager: constant-time checks, a lookup and two copies (latents, timestep). No host
        sync, no walk of the module tree (structure changes between binds: ``eligibility.Watch``).
    captured: ``img_in``, timestep embedding and the shared modulation, all blocks (each with its
        ``torch.cat`` over the prefix), ``norm_out``, ``proj_out``.
    (``cached_step.py`` in detail.)
    The forward's prologue (text projection, ``repeat_interleave``, rotary over the whole sequence,
    token metadata, boolean-index scatter) does not run on a cached step at all: what it yields for
    the target rows is fixed per request. Results equal diffusers' own cached forward bit for bit on
    CPU (tests/test_qwen_image_21.py); on GPU the graph is asserted equal to the eager static step.

Numbers
    A replayed cached step equals diffusers' own bit for bit (exact mode); it saves much where the
    eager step is bound by the host's launch speed (small images) and only launch gaps where it is
    kernel-bound (1024x1024). Measured figures (``benchmarks/bench.py --cases
    qwen_image_21_step``, H200): ``docs/performance.md``.

Runs eagerly, each with its own reason in ``stats`` (logged once): not a CUDA device; autograd on;
padded text mask (``encoder_hidden_states_mask`` set: the masked path depends on its contents);
sequence/ring/tensor parallel or HSDP; torch.compile'd blocks; offload or hooks on the model or
blocks; weights not resident on the device; dynamic LoRA wrappers (peft, vLLM); a custom attention
processor; quantized prefix K/V; prefix K/V not populated or not matching the request's layout; a
forward call with arguments this hook does not know (a newer diffusers'); sleep's release no
longer reaching the graphs (checked at bind); and, from ``graphs/prefix.py``, capacity, OOM, capture
failure (until sleep level 2), verify mismatch and a release during the step. The extract step
always runs as diffusers runs it. A hook, adapter or compile added after binding is seen at the
next step (``eligibility.Watch``); weights moved by ``.to()`` (``pipe.to("cpu");
pipe.to("cuda")``) make the next step capture again, counted under ``WEIGHTS_MOVED``.

Use without vLLM-Omni (bare diffusers)::

    from diffusers import QwenImage21Pipeline
    from vllm_omni_graphdecode.hooks import qwen_image_21

    pipe = QwenImage21Pipeline.from_pretrained(path, torch_dtype=torch.bfloat16).to("cuda")
    graphs = qwen_image_21.enable(pipe)   # or enable(pipe.transformer); verify=, max_entries=
    image = pipe(prompt).images[0]        # step 0 eager, steps 1.. replay a graph
    qwen_image_21.unwire(pipe)            # everything the wiring set put back

Under vLLM-Omni, ``loading`` calls ``wire`` for the diffusers adapter's inner pipeline
(``--diffusion-load-format diffusers``). Sleep level 2 releases every graph
(``patching.release_on_sleep``); each request checks that it still would.

Files: ``names.py`` (what is read from diffusers, checked before wiring), ``rules.py`` (the
reasons and the structure gate), ``cached_step.py`` (the patched forward, binding, the step body).

Delete this file when diffusers or vLLM-Omni captures the cached step itself; until then the hook
stands aside when the model already carries one of ``INTREE_GRAPH_ATTRS``.
"""

from __future__ import annotations

from typing import Any

from ... import config
from ...core import patching
from ...core.patching import HookRefused
from ...core.reasons import Reason
from . import names
from .cached_step import MODEL, CachedStepGraphs
from .names import find_target
from .rules import (AUTOGRAD, COMPILED, HOOKS, LAYOUT, LORA, NOT_CUDA, NOT_POPULATED, NOT_RESIDENT,
                    OFFLOAD, PADDED, PARALLEL, PROCESSOR, QUANT_KV, structure_reason)

__all__ = ["AUTOGRAD", "COMPILED", "CachedStepGraphs", "HOOKS", "LAYOUT", "LORA", "MODEL",
           "NOT_CUDA", "NOT_POPULATED", "NOT_RESIDENT", "OFFLOAD", "PADDED", "PARALLEL",
           "PROCESSOR", "QUANT_KV", "enable", "find_target", "structure_reason", "support",
           "unwire", "wire"]

NO_DIFFUSERS = Reason("diffusers with Qwen-Image-2.1 (>= 0.41) is not importable",
                      "pip install --no-deps diffusers==0.42.1 (README, Install and serve)")
NO_PREFIX_CACHE = Reason("causal_condition=False: this checkpoint has no prefix K/V to decode from",
                         "nothing to change: its steps run as diffusers runs them")
OWN_GRAPH = Reason("the model captures its own cached step; standing aside",
                   "nothing to change: the model's own graphs run")


def support() -> dict[str, str]:
    """vLLM-Omni version -> what happens (doctor, README)."""
    served = ("served through the diffusers adapter (--diffusion-load-format diffusers) with "
              "diffusers 0.41.0-0.42.1 installed --no-deps; cached steps replay graphs, step 0 "
              "stays eager")
    return {
        "0.24": served + "; sleep level 2 releases graphs via runner.graph_runners",
        "0.26": served + "; sleep level 2 releases graphs via runner.graph_runners",
        "0.28": served + "; sleep level 2 releases graphs via runner.graph_runners",
        "0.30": served + "; sleep level 2 releases graphs via release_captured_graphs",
    }


def _prepare(target, *extra_owners) -> Any:
    """Check what the hook reads and return the transformer to wire. Raises HookRefused."""
    d = names.resolve()
    if d is None:
        raise HookRefused(NO_DIFFUSERS)
    names.check_signatures(d)
    if not isinstance(target, d.transformer_cls):
        raise HookRefused(COMPILED.because(
            f"{type(target).__name__} wraps the transformer with torch.compile as a whole"))
    if getattr(target, "_compiled_call_impl", None) is not None:
        raise HookRefused(COMPILED.because("the transformer was compiled in place as a whole "
                                           "(module.compile())"))
    missing = [a for a in names.TRANSFORMER_ATTRS if not hasattr(target, a)]
    if missing:
        raise HookRefused(names.MOVED.because(
            f"QwenImage21Transformer2DModel lacks {', '.join(missing)}"))
    if not target.config.causal_condition:
        raise HookRefused(NO_PREFIX_CACHE)
    intree = names.intree_graph(target, *extra_owners)
    if intree is not None:
        raise HookRefused(OWN_GRAPH.because(intree))
    return target


def enable(pipe_or_transformer, *, verify: bool | None = None, max_entries: int | None = None,
           capture: bool = True, mode: str | None = None, attention: str = "auto",
           compile: bool = True, fp8: bool | None = None) -> CachedStepGraphs:
    """Wire cached-step graphs onto a diffusers Qwen-Image-2.1 pipeline or transformer.

    ``verify``, ``max_entries`` and ``mode`` ("fast" or "exact") default to
    ``VLLM_OMNI_GRAPHDECODE_VERIFY`` / ``_MAX_ENTRIES`` / ``_QWEN_MODE``. ``attention`` ("auto",
    "3", "2", "sdpa") and ``compile`` choose the fast mode's parts (``ops/attention.py``,
    ``fast_step``); ``ops/fp8`` (default: ``VLLM_OMNI_GRAPHDECODE_FP8`` names ``qwen_image_21``)
    its W8A8 GEMMs.
    ``capture=False`` runs the same static-buffer step eagerly (any device). Returns the wiring
    (``unwire`` undoes it); enabling an already wired transformer returns the existing one.
    Raises HookRefused when this diffusers version moved what the hook reads, and ValueError when no
    Qwen-Image-2.1 transformer is found.
    """
    if names.resolve() is None:
        raise ValueError("diffusers with Qwen-Image-2.1 (>= 0.41) is not importable")
    target = find_target(pipe_or_transformer)
    if target is None:
        raise ValueError(f"no QwenImage21Transformer2DModel in {type(pipe_or_transformer).__name__}")
    existing = getattr(target, "_graphdecode_qwen", None)
    if existing is not None:
        return existing
    transformer = _prepare(target, pipe_or_transformer)
    cfg = config.get()
    return CachedStepGraphs(transformer, verify=cfg.verify if verify is None else verify,
                            max_entries=cfg.max_entries if max_entries is None else max_entries,
                            capture=capture, mode=cfg.qwen_mode if mode is None else mode,
                            attention=attention, compile=compile,
                            fp8=MODEL in cfg.fp8 if fp8 is None else fp8)


def unwire(target) -> bool:
    """Undo ``enable`` / ``wire`` on ``target`` (a pipeline, the adapter or the transformer): every
    attribute the wiring set is put back and every graph dropped (``CachedStepGraphs.unwire``).
    False when nothing was wired there."""
    found = find_target(target) if names.resolve() is not None else None
    wiring = getattr(found if found is not None else target, "_graphdecode_qwen", None)
    if not isinstance(wiring, CachedStepGraphs):
        return False
    wiring.unwire()
    return True


def wire(target, cfg: config.Config, runner) -> str:
    """Patch the transformer found by ``find_target``; one summary line for the load log."""
    pipeline = getattr(runner, "pipeline", None)
    existing = getattr(target, "_graphdecode_qwen", None)
    if existing is not None:
        return "already wired"
    transformer = _prepare(target, pipeline, getattr(pipeline, "_pipeline", None))
    unreachable = patching.can_release_on_sleep(runner)
    if unreachable is not None:
        raise HookRefused(unreachable)
    # Checked: patch from here on.
    wiring = CachedStepGraphs(transformer, verify=cfg.verify, max_entries=cfg.max_entries,
                              mode=cfg.qwen_mode, fp8=MODEL in cfg.fp8)
    release = "no runner: release graphs yourself before sleeping"
    if runner is not None:
        wiring.attach_release(runner)  # sleep level 2 discards the memory graphs were recorded on
        release = "sleep level 2 releases them"
    line = (f"cached steps of {type(transformer).__name__} ({len(transformer.transformer_blocks)} "
            f"layers) replay CUDA graphs, {cfg.qwen_mode} mode"
            f"{' with FP8 (W8A8) GEMMs' if MODEL in cfg.fp8 and cfg.qwen_mode == 'fast' else ''}"
            f"; max_entries={cfg.max_entries}, "
            f"verify={'on' if cfg.verify else 'off'}; {release}")
    if cfg.qwen_mode == "fast" and cfg.precapture:
        line += f"; {wiring.precompile()}"
    try:
        device = next(transformer.parameters()).device
        found = structure_reason(transformer, device)
        if found is None and device.type != "cuda":
            found = NOT_CUDA.because(device)
    except StopIteration:
        found = None
    if found is not None:
        line += f"; steps run eagerly while: {found.describe()}"
    return line
