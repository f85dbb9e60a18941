"""Wiring SenseNova-U1's pipeline: what is patched at load, and how each request reaches the
paged path.

At load (``install``): every method patched or called is checked first (``layouts``); then
- ``_generate_think`` / ``_generate_text`` open a session (``decode/session.py``) from the prefill
  cache (or run as they are, with the reason counted), ``_ar_step`` runs through it, and
  ``_append_text_tokens_to_cache`` (the think path's next reader of the cache) first gets the
  decoded K/V written back;
- vllm-omni 0.30's own ``_decode_context`` is replaced by one that returns None under
  ``takeover`` (so the in-tree path cannot run too); under ``defer`` nothing is wired at all;
- ``release_captured_graphs`` on the pipeline drops this plugin's graphs (and the in-tree ones),
  reached at sleep level 2 (0.30's runner calls it; on 0.24-0.28 through the runner's
  ``graph_runners.clear()``, the only call those workers make); each request checks, in constant
  time, that sleep still reaches it, and runs eagerly with the reason if not; a change to the
  language model (a hook, an adapter, weights moved) is seen by a watch in constant time, at
  each request and before each token or launch of one in flight;
- the pre-capture buckets are captured, so the first think request pays no capture.

Everything set on objects the plugin does not own goes through one ``patching.Patches``:
``unwire(pipeline)`` puts every attribute back and drops every graph.
"""

from __future__ import annotations

import functools
import inspect
import threading

import torch

from ...core import eligibility, patching, stats
from ...core.patching import HookRefused, check_signature
from ...core.reasons import CHANGED, WEIGHTS_MOVED, Reason
from ...decode import paged as paged_decode
from ...decode.session import ARSessions, PagedDecoder
from ...decode.token_loop import Sampling
from ...ops import attention as kernels
from . import batch as batch_mod
from . import gemv_table, layouts, rules
from .step import MODEL, Step, patch_attention, select_kv_writer

STATE_ATTR = "_graphdecode_sensenova_u1"
FP8_NEEDS_FUSED = Reason("FP8 weights need the fused step",
                         "unset VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP (fused) or set it to tuned: "
                         "exact runs the model's own modules, which read the bf16 weights")


class Wiring:
    """What ``install`` attached to one pipeline (``pipeline._graphdecode_sensenova_u1``)."""

    def __init__(self, pipeline, layout, cfg, kernel, graphs: bool, fusion, kv_writer, runner):
        self.pipeline = pipeline
        self.lm = pipeline.language_model
        self.layout = layout
        self.cfg = cfg
        self.kernel = kernel
        self.graphs = graphs
        self.fusion = fusion
        self.kv_writer = kv_writer
        self.runner = runner
        self.patches = patching.Patches()
        self.release_fn = None  # the pipeline's release_captured_graphs this wiring set
        self.lora = False  # what the last verdict found (rules.verdict, at every request)
        # The language model's structure and where its weights are, checked in constant time at
        # every request and before every token or launch (armed at install's end, after the
        # plugin's own patches): the walk the verdict reads is kept until the watch sees a
        # change (``_structure``, ``changed_during_request``).
        self.watch = eligibility.Watch(self.lm)
        self._found: eligibility.Structure | None = None
        self._watch_lock = threading.Lock()
        self.sessions = ARSessions(MODEL, make_decoder=self._decoder, kernel=kernel,
                                   gate=self.refusal, per_request=lambda: self.lora,
                                   changed=self.changed_during_request)
        # The batched decode (batch.py) when the engine hands forward several requests; then the
        # loops decode there and ``sessions`` is not used.
        self.batch: batch_mod.BatchWiring | None = None
        self.row_sessions = threading.local()

    def row_session(self):
        """This thread's batch row session (``batch.RowSession``), or None."""
        return getattr(self.row_sessions, "session", None)

    def refusal(self) -> Reason | None:
        """Why a request's loop runs eagerly now on the one-sequence path: its kernel, or
        ``batch_refusal``."""
        if isinstance(self.kernel, Reason):
            return self.kernel
        return self.batch_refusal()

    def batch_refusal(self) -> Reason | None:
        """Why requests decode eagerly now: sleep no longer reaching this wiring's release (a
        constant-time check; its graphs are dropped then), or the hook's gate
        (``rules.verdict`` over the model's walk, ``_structure``; ``self.lora`` keeps its LoRA
        finding for the request)."""
        lost = self.sleep_lost()
        if lost is not None:
            self.release()
            return lost
        reason, self.lora = rules.verdict(self.pipeline, self.lm, self._structure())
        return reason

    def changed_during_request(self) -> Reason | None:
        """Before every token or launch of a request in flight, in constant time: whether the
        watch saw a change since the request's check (weights moved, a hook, an adapter). The
        request then finishes on the model's own code; the next request's check settles the
        watch, drops every graph and walks again (``_structure``)."""
        if not self.watch.changed():
            return None
        what = "its weights moved" if self.watch.moved() else "its structure changed"
        return CHANGED.because(f"language_model: {what} while the request decoded")

    def _structure(self) -> eligibility.Structure:
        """The language model's walk (``eligibility.scan``): made once the watch is armed, then
        again only after it saw a change. A change first drops every decode graph, which read
        the old structure or weight addresses (the one-request path's decoder, released as
        sleep does; the batched step's launches): weights moved are counted under
        ``WEIGHTS_MOVED``, anything else as ``structure_changed``, and the walk then gives the
        hook's reason, if any (a hook: ``HOOKED``)."""
        with self._watch_lock:
            if self.watch.changed():
                moved = self.watch.moved()
                self.watch.arm()  # settles; modules added since are watched too
                self._found = None
                self.sessions.release()
                decoder = self.batch.decoder if self.batch is not None else None
                if decoder is not None:
                    decoder.drop_graphs()
                if moved:
                    stats.degraded(MODEL, WEIGHTS_MOVED.because("language_model"))
                else:
                    stats.count(MODEL, "structure_changed")
            found = self._found
            if found is None:
                found = eligibility.scan(self.lm, "language_model")
                if self.watch.armed:
                    self._found = found
            return found

    def sleep_lost(self) -> Reason | None:
        if self.release_fn is None:
            return None
        if vars(self.pipeline).get("release_captured_graphs") is not self.release_fn:
            return patching.SLEEP_UNREACHABLE.because(
                f"{type(self.pipeline).__qualname__}.release_captured_graphs was replaced")
        if self.runner is not None and not patching.runner_releases_pipeline(self.runner):
            return patching.release_lost(self.runner, self.release_fn)
        return None

    def unwire(self) -> list[str]:
        """Drop every graph and buffer and put back every attribute ``install`` set. Returns the
        attributes left because someone replaced them since (their wrapper stays)."""
        self.release()
        return self.patches.undo()

    def _decoder(self) -> PagedDecoder:
        step = Step(self.lm, self.layout, fusion=self.fusion, kv_writer=self.kv_writer)
        return PagedDecoder(step, name=MODEL, kernel=self.kernel, buckets=self.cfg.buckets,
                            graphs=self.graphs, verify=self.cfg.verify,
                            tokens_per_launch=self.cfg.tokens_per_launch)

    @property
    def decoder(self) -> PagedDecoder | None:
        return self.sessions.decoder

    def precapture(self) -> str:
        cfg = self.cfg
        if not cfg.precapture:
            return "pre-capture off"
        if isinstance(self.kernel, Reason):
            return f"pre-capture skipped: {self.kernel.key}"
        if not self.graphs:
            return "pre-capture skipped: graphs off"
        dtype = self.lm.model.layers[0].self_attn.qkv_proj.weight.dtype
        if self.kernel.fa_version is not None and dtype not in (torch.float16, torch.bfloat16):
            return f"pre-capture skipped: {dtype} is not a FlashAttention dtype"
        return self.sessions.precapture(cfg.precapture_buckets, dtype)

    def release(self) -> None:
        self.sessions.release()
        if self.batch is not None:
            self.batch.release()
        linears = _fp8_of(self.fusion)
        if linears is not None:  # after the graphs that read them; re-made at the next capture
            linears.release()


def install(pipeline, cfg, runner=None, *, kernel=None, graphs: bool | None = None,
            image_graphs: bool | None = None, rows: int | None = None,
            batch_attention=None) -> str:
    """Wire ``pipeline``; returns the one-line summary. HookRefused leaves it untouched.

    ``kernel``/``graphs`` override the kernel selection and the graph switch (tests run the paged
    path on CPU with ``kernels.REFERENCE`` and ``graphs=False``); ``image_graphs=False`` runs the
    denoising branches' static-buffer step without capture on any device (CPU tests). ``rows``:
    requests the engine hands one ``forward`` (default: the runner's ``max_num_seqs``); above 1
    the loops decode in the batch (``batch.py``), with ``batch_attention`` (default: vLLM's
    Triton decode kernel on CUDA).
    """
    if getattr(pipeline, STATE_ATTR, None) is not None or getattr(pipeline, IMAGE_ATTR, None):
        return "already wired"
    lm = getattr(pipeline, "language_model", None)
    if lm is None:
        raise HookRefused(layouts.MODEL_MOVED.because(
            f"{type(pipeline).__qualname__} has no language_model"))
    cls = type(pipeline)
    layout = layouts.detect_layout(lm, cls)
    if rows is None:
        rows = batch_mod.engine_rows(runner, cfg)
    # FP8 weights exist only in this plugin's step: on 0.30 its decode then serves (takeover).
    use_fp8 = "sensenova_decode" in cfg.fp8
    if rows > 1:
        check_signature(cls, "forward", batch_mod.FORWARD_PARAMS)
    elif layout.in_tree and cfg.sensenova_intree == "defer" and not use_fp8:
        image = _wire_denoise(pipeline, layout, cfg, runner, image_graphs, decode=None,
                              rows=rows)
        head = (f"{cls.__name__} ({layout.versions}) has its own paged decode, which stays in "
                f"charge (VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE=defer)")
        if getattr(pipeline, IMAGE_ATTR, None) is None:
            return f"{head}; nothing wired ({image})"
        return f"{head}; decode not wired; {image}"
    originals = {name: check_signature(cls, name, params)
                 for name, params in layouts.PIPELINE_METHODS.items()}
    if layout.in_tree:
        check_signature(cls, "_decode_context", ("self", "past_key_values"))
    layouts.check_model(lm, layout)
    unreachable = patching.can_release_on_sleep(runner)
    if unreachable is not None:
        raise HookRefused(unreachable)

    attn = layouts.attention_modules(lm)[0]
    device = torch.device(pipeline.device)
    dtype = next(lm.parameters()).dtype
    if kernel is None:
        kernel = kernels.select_kernel(device, attn.head_dim, cfg.fa_version)
    if graphs is None:
        graphs = isinstance(kernel, kernels.Kernel) and device.type == "cuda"
    step = resolve_step(cfg.sensenova_step, device)
    fusion, writer, off = _step_parts(lm, layout, device, dtype, step, use_fp8, rows,
                                      lm_head="sensenova_lm_head" in cfg.fp8)
    if off and isinstance(kernel, kernels.Kernel):
        from .fused_step import UNFUSED

        stats.degraded(MODEL, UNFUSED.because("; ".join(off)))
    wiring = Wiring(pipeline, layout, cfg, kernel, graphs, fusion, writer, runner)
    if rows > 1:
        wiring.batch = batch_mod.BatchWiring(pipeline, layout, cfg, rows,
                                             attention=batch_attention, graphs=graphs,
                                             writer=writer, refusal=wiring.batch_refusal,
                                             lora=lambda: wiring.lora,
                                             linears=_batch_linears_of(fusion),
                                             changed=wiring.changed_during_request)

    # From here on nothing is checked any more: patch.
    patches = wiring.patches
    if isinstance(kernel, kernels.Kernel) or wiring.batch is not None:
        patch_attention(lm, layout, patches)
        if fusion is not None:
            fusion.patch_layers(lm, patches)
    bound = {name: getattr(pipeline, name) for name in originals}
    patches.set(pipeline, "_generate_think",
                _wrap_loop(wiring, bound["_generate_think"], think=True))
    patches.set(pipeline, "_generate_text",
                _wrap_loop(wiring, bound["_generate_text"], think=False))
    patches.set(pipeline, "_ar_step",
                _wrap_ar_step(wiring, bound["_ar_step"], layouts.output_class(lm)))
    patches.set(pipeline, "_append_text_tokens_to_cache",
                _wrap_append(wiring, bound["_append_text_tokens_to_cache"]))
    if layout.in_tree:
        patches.set(pipeline, "_decode_context", _decode_context_taken_over)
    if wiring.batch is not None:
        patches.set(pipeline, "forward", batch_mod.wrap_forward(wiring.batch, pipeline.forward))
        patches.set(pipeline, batch_mod.BATCH_ATTR, True)
    patches.set(pipeline, STATE_ATTR, wiring)
    image = _wire_denoise(pipeline, layout, cfg, runner, image_graphs, decode=wiring, rows=rows)

    if isinstance(kernel, kernels.Kernel):
        what = f"{kernel.name}, {'CUDA graphs' if graphs else 'no graphs'}"
        refusal = wiring.sessions.refusal()
        if refusal is not None:
            what += f"; requests run eagerly now: {refusal.key}"
    else:
        what = f"requests run eagerly: {kernel.key}"
    step_line = " + ".join(describe_step(fusion, writer)) or "the model's own"
    buckets = ",".join(map(str, cfg.buckets))
    tail = paged_decode.tail_step(cfg.buckets)
    taken = ""
    if layout.in_tree:
        taken = ("; in-tree decode context taken over"
                 + (" (FP8 weights run in this plugin's step only)"
                    if use_fp8 and cfg.sensenova_intree == "defer" else ""))
    if wiring.batch is not None:
        line = (f"{cls.__name__} ({layout.name} layout, {layout.versions}): think/text decode "
                f"{wiring.batch.describe()}{taken}; {wiring.batch.precapture()}; {image}")
    else:
        line = (f"{cls.__name__} ({layout.name} layout, {layout.versions}): think/text decode "
                f"paged ({what}; step {step_line}); buckets {buckets} (+{tail} tail){taken}; "
                f"{wiring.precapture()}; {image}")
    # Every patch of this plugin is in place (and pre-captured): a change from here on is
    # someone else's, and the first request's walk is kept until the watch sees one.
    wiring.watch.arm()
    patches.on_undo(wiring.watch.disarm)
    return line


IMAGE_ATTR = "_graphdecode_sensenova_u1_image"


def _wire_denoise(pipeline, layout, cfg, runner, capture, decode, rows: int = 1) -> str:
    """Wire the denoising branches (``denoise.py``) when asked, and the sleep release of what was
    wired (``decode``'s sessions, the denoiser's entries); returns the summary's clause. ``rows``:
    the requests the engine runs at once (the denoiser keeps an entry per live branch of each)."""
    from ...config import SENSENOVA_DENOISE_VAR
    from . import denoise

    releases = [decode.release] if decode is not None else []
    patches = decode.patches if decode is not None else patching.Patches()
    clause = f"image denoising: the pipeline's own steps ({SENSENOVA_DENOISE_VAR}=off)"
    if cfg.sensenova_denoise != "off":
        try:
            if decode is None:
                unreachable = patching.can_release_on_sleep(runner)
                if unreachable is not None:
                    raise HookRefused(unreachable)
            # Its branches check the runner's release themselves only where the runner's
            # release is the plugin's registration (0.24-0.28); on 0.30 the runner calls the
            # pipeline's own release_captured_graphs, set below.
            denoiser = denoise.install(
                pipeline, layout, cfg, capture=capture, patches=patches, rows=rows,
                runner=None if runner is None or patching.runner_releases_pipeline(runner)
                else runner)
        except HookRefused as exc:
            stats.refused(denoise.MODEL, exc.reason)
            clause = f"image denoising not wired: {exc.reason.describe()}"
        else:
            patches.set(pipeline, IMAGE_ATTR, denoiser)
            releases.append(denoiser.release)
            clause = denoiser.describe()
    if releases:
        release_fn = _wire_release(pipeline, releases, runner, patches)
        if decode is not None:
            decode.release_fn = release_fn
        elif getattr(pipeline, IMAGE_ATTR, None) is not None:
            patches.set(pipeline, UNWIRE_ATTR, patches)
    return clause


def describe_step(fusion, writer) -> list[str]:
    """The decode step's parts as the load line names them: the fusion's, and vLLM's K/V
    writer where the step writes K/V with it (not when its rope kernel writes them itself)."""
    parts = fusion.describe() if fusion is not None else []
    if writer is not None and getattr(fusion, "rope_store", None) is None:
        parts.append("one-kernel K/V write")
    return parts


def _step_parts(lm, layout, device, dtype, step: str = "fused", use_fp8: bool = False,
                rows: int = 1, lm_head: bool = False):
    """(fusion or None, K/V writer or None, why each missing part is off). ``use_fp8``: the
    linear layers read e4m3 copies (``fused_step.fp8_linears``; laid out for the one-row GEMV
    when ``rows`` is 1, for the batched step's Marlin otherwise), each reason it cannot (or a
    layer cannot) counted as a degraded path; ``lm_head``: the head too (one row only)."""
    off: list[str] = []
    fusion = None
    if use_fp8 and not (layout.fused_step and step in FUSED_STEPS):
        stats.degraded(MODEL, FP8_NEEDS_FUSED.because(
            f"{layout.name} layout, VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP={step}"))
    if layout.fused_step and step in FUSED_STEPS:
        from .fused_step import Fusion, fp8_linears

        linears = None
        if use_fp8:
            linears, why = fp8_linears(lm, device, MODEL, one_row=rows == 1,
                                       lm_head=lm_head)
            for reason in why:
                stats.degraded(MODEL, reason)
        elif step == "rowgemv":
            linears, why = row_gemv_linears(device, rows, lm)
            for reason in why:
                stats.degraded(MODEL, reason)
        fusion = Fusion.select(lm, layout, device, dtype, tuned_gemv=step == "tuned",
                               linears=linears)
        off += fusion.reasons
        fusion = fusion if fusion.active else None
    writer = select_kv_writer(device, dtype)
    if isinstance(writer, Reason):
        off.append(f"two-kernel K/V write: {writer.describe()}")
        writer = None
    return fusion, writer, off


# The step modes that run the fused step (``config``'s ``sensenova_step``, ``auto`` resolved);
# ``exact`` runs the model's own modules.
FUSED_STEPS = ("fused", "tuned", "rowgemv")


def resolve_step(setting: str, device) -> str:
    """The step mode that runs for ``..._SENSENOVA_STEP=setting`` on ``device``: ``setting``
    itself, or for ``auto`` ``rowgemv`` on a Hopper GPU (compute capability 9.x, where the
    row GEMV's and the 16-row GEMM's block sizes were measured and the GPU tests ran with
    them, issue #42) and ``fused`` on any other device."""
    if setting != "auto":
        return setting
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "rowgemv"
    return "fused"


def row_gemv_linears(device, rows: int, language_model=None):
    """``(linears or None, [why not / what stays on cuBLAS])`` for
    ``..._SENSENOVA_STEP=rowgemv``: with one request at a time (``rows`` 1) the one-row GEMV
    (``row_linears.RowLinears``), ``language_model``'s ``lm_head`` too where its logits are a
    plain projection and its forward takes ``compute_logits``; with the batched step (``rows``
    above 1) the 16-row GEMM (``rows_gemm.RowsLinears``), which every step of the process then
    reads, so a request rounds alike alone and in a batch. None on a device that runs neither."""
    from ...ops import row_linears, rows_gemm

    if rows != 1:
        why = rows_gemm.available(device)
        return (None, [why]) if why is not None else (rows_gemm.RowsLinears(MODEL), [])
    why = row_linears.available(device)
    if why is not None:
        return None, [why]
    linears = row_linears.RowLinears(MODEL, table=gemv_table.ROW_BF16,
                                     pdl=row_linears.row_gemv.dependent_launches(device))
    if language_model is None:
        return linears, []
    from .fused_step import _takes

    if not _takes(language_model, "compute_logits"):
        return linears, [row_linears.ROW_HEAD_KEPT.because(
            f"{type(language_model).__name__}.forward takes no compute_logits")]
    kept = linears.take_head(language_model)
    return linears, [kept] if kept is not None else []


def _fp8_of(fusion):
    """The fused step's FP8 copies, shared with the batched step (made once), or None."""
    from ...ops.fp8.linears import Fp8Linears

    linears = getattr(fusion, "gemv", None)
    return linears if isinstance(linears, Fp8Linears) else None


def _batch_linears_of(fusion):
    """What the batched step's linear layers read: the fused step's FP8 copies or its 16-row
    bf16 GEMM (``rowgemv`` with rows above 1), else None (the modules' own GEMMs)."""
    from ...ops.rows_gemm import RowsLinears

    linears = getattr(fusion, "gemv", None)
    return linears if isinstance(linears, RowsLinears) else _fp8_of(fusion)


def _wrap_loop(wiring: Wiring, original, think: bool):
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def decode_loop(*args, **kwargs):
        cache = args[1] if len(args) > 1 else kwargs.get("past_key_values")
        if wiring.batch is not None:
            return _batch_loop(wiring, original, signature, args, kwargs, think, cache)
        session = wiring.sessions.open(cache, finish_on_close=think)
        try:
            if session is not None:
                _serve_launches(wiring.pipeline, session, signature, args, kwargs, think)
            return original(*args, **kwargs)
        finally:
            if session is not None:
                session.close()

    decode_loop.__graphdecode__ = True
    return decode_loop


# The loops' own stop tokens (both loops: "<|im_end|>"; the think loop also feeds "</think>" and
# stops), and their token limits, as vllm-omni 0.24-0.30 name them.
END, THINK_END = "<|im_end|>", "</think>"
LIMIT_PARAM = {True: "max_think_tokens", False: "max_tokens"}


def _batch_loop(wiring: Wiring, original, signature, args, kwargs, think: bool, cache):
    """The loop as a row of the batch (``batch.RowSession``): ``_ar_step`` serves its tokens.
    Without a row (the batch refused), a sampled loop still draws from the row's own stream
    (``batch.EagerRow``)."""
    params = _loop_params(signature, args, kwargs)
    sampling = batch_mod.sampling_for(params, think)
    if isinstance(sampling, Reason):
        stats.fallback(MODEL, sampling)
        return original(*args, **kwargs)
    session = batch_mod.open_row(wiring.batch, cache, think=think, sampling=sampling)
    if session is None:
        if sampling.temperature <= 0:
            return original(*args, **kwargs)
        session = batch_mod.EagerRow(cache, sampling, wiring.batch.device)
    if sampling.temperature > 0:
        # The loop draws its first token from the prefill's logits itself, from the process's
        # generator: drawn here from the row's own stream instead, as every later token is.
        args, kwargs = _first_token_drawn(session, signature, args, kwargs, params)
    wiring.row_sessions.session = session
    try:
        return original(*args, **kwargs)
    finally:
        wiring.row_sessions.session = None
        session.close()


def _first_token_drawn(session, signature, args, kwargs, params):
    """The text loop's arguments with ``prefix_logits`` replaced by host logits whose draw is the
    row's own draw from them (``batch.RowSession.first_draw``)."""
    logits = params.get("prefix_logits")
    if logits is None:
        return args, kwargs
    token = session.first_draw(logits, params.get("t_idx"))
    bound = signature.bind(*args, **kwargs)
    bound.arguments["prefix_logits"] = session.logits(token, vocab=logits.shape[-1])
    return bound.args, bound.kwargs


def _loop_params(signature, args, kwargs) -> dict | None:
    """The loop's arguments by name, defaults applied, a ``**kwargs`` parameter's entries in its
    place; None where they do not bind."""
    try:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
    except (AttributeError, TypeError):
        return None
    params = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            params.update(value)
        else:
            params[name] = value
    return params


def _serve_launches(pipeline, session, signature, args, kwargs, think: bool) -> None:
    """Serve this loop from multi-token launches: the think loop picks by argmax; the text loop
    too, unless it samples (``do_sample`` with a temperature > 0), when the device draws each token
    as the loop's own code would (``token_loop.Sampling``). Its stop tokens and limit let a launch
    skip what is not needed."""
    if session.decoder.tokens_per_launch <= 1:
        return
    params = _loop_params(signature, args, kwargs)
    if params is None:
        if not think:
            return  # cannot tell whether this text loop samples: its own picks, token by token
        params = {}
    unknown = batch_mod.unknown_loop_params(params, think)
    if unknown:
        # The loop picks from the step's own logits, token by token (still replayed graphs).
        stats.degraded(MODEL, batch_mod.UNKNOWN_LOOP_PARAMS.because(
            f"{'think' if think else 'text'} loop takes {', '.join(unknown)}: one token a "
            f"launch"))
        return
    sampling = None
    temperature = params.get("temperature")
    if not think and params.get("do_sample") and (temperature or 0) > 0:
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            return  # not a number the device can divide by as the loop does: the loop's own draws
        sampling = Sampling(float(temperature))
        stats.count(MODEL, "sampled_request")
    stops = []
    for name in (END, THINK_END) if think else (END,):
        try:
            token = pipeline.tokenizer.convert_tokens_to_ids(name)
        except Exception:  # a tokenizer without it: the loops would fail first
            continue
        if isinstance(token, int):
            stops.append(token)
    limit = params.get(LIMIT_PARAM[think])
    session.launches(stops=stops, limit=limit if isinstance(limit, int) else None,
                     sampling=sampling)


def _wrap_ar_step(wiring: Wiring, original, output_cls):
    device = torch.device(wiring.pipeline.device)

    @functools.wraps(original)
    def ar_step(next_token, t_idx, past_key_values, *args, **kwargs):
        row = wiring.row_session()
        if row is not None and row.owns(past_key_values):
            if row.live:
                token = row.decode(int(next_token), t_idx + 1)
                if token is not None:
                    return output_cls(logits=row.logits(token), past_key_values=past_key_values)
            # No row, or handed back: the cache holds every token so far; the eager step goes on
            return row.eager_step(original, output_cls, next_token, t_idx, past_key_values,
                                  *args, **kwargs)
        if torch.is_tensor(next_token) and next_token.device != device:
            # The loop picked it from host logits this plugin served before a hand-back.
            next_token = next_token.to(device)
        session = wiring.sessions.session
        if session is not None and session.serves(past_key_values) and session.ahead is not None:
            token = session.decode(int(next_token), t_idx + 1)
            if token is not None:
                # The loop's argmax (or draw) of these host logits is the token the device chose.
                return output_cls(logits=session.ahead.logits(token),
                                  past_key_values=past_key_values)
        elif session is not None and session.serves(past_key_values):
            logits = session.step(next_token, t_idx + 1)
            if logits is not None:
                # The caller reassigns its cache handle from this field; the paged tokens reach
                # that cache at write-back.
                return output_cls(logits=logits, past_key_values=past_key_values)
        stats.count(MODEL, "eager_step")
        return original(next_token, t_idx, past_key_values, *args, **kwargs)

    ar_step.__graphdecode__ = True
    return ar_step


def _wrap_append(wiring: Wiring, original):
    @functools.wraps(original)
    def append_text_tokens_to_cache(cache, t_idx, input_ids, *args, **kwargs):
        row = wiring.row_session()
        if row is not None and row.serves(cache):
            row.finish()  # the think loop is over and the cache is read next
        session = wiring.sessions.session
        if session is not None and session.serves(cache):
            # The think loop is over and the cache is read next: it must hold the decoded tokens.
            session.finish()
        return original(cache, t_idx, input_ids, *args, **kwargs)

    append_text_tokens_to_cache.__graphdecode__ = True
    return append_text_tokens_to_cache


def _decode_context_taken_over(past_key_values):
    """vllm-omni 0.30's in-tree paged decode, disabled: this plugin's path decodes instead
    (VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE=takeover). Returning None sends the in-tree loop to
    its plain ``_ar_step``, which this plugin routes."""
    return None


def _wire_release(pipeline, releases, runner, patches):
    """``pipeline.release_captured_graphs``: this plugin's releases, then the pipeline's own (0.30's
    in-tree one). vllm-omni 0.30's runner calls it at sleep level 2 itself; on 0.24-0.28 it is
    registered on the runner's ``graph_runners`` (``patching.release_on_sleep``)."""
    previous = getattr(pipeline, "release_captured_graphs", None)  # 0.30's in-tree one, if any

    def release_captured_graphs() -> None:
        """Drop this plugin's graphs: decode graphs and paged K/V, denoising entries (and the
        in-tree ones, if any)."""
        for release in releases:
            release()
        if previous is not None:
            previous()

    patches.set(pipeline, "release_captured_graphs", release_captured_graphs)
    if runner is not None and not patching.runner_releases_pipeline(runner):
        patching.release_on_sleep(runner, release_captured_graphs, patches)
    return release_captured_graphs


UNWIRE_ATTR = "_graphdecode_sensenova_u1_patches"


def unwire(pipeline) -> list[str] | None:
    """Undo ``install`` on ``pipeline``: every graph and buffer dropped, every attribute put back
    (the pipeline's methods, each attention layer's and decoder layer's patched forward, the
    runner's release). Returns the attributes left because someone replaced them since, or None
    when nothing was wired. The class-level request-batching declaration (``batch.declare``) is
    the process's, not the pipeline's, and stays."""
    wiring = getattr(pipeline, STATE_ATTR, None)
    if wiring is not None:
        return wiring.unwire()
    patches = vars(pipeline).get(UNWIRE_ATTR)  # only the denoising was wired (defer)
    if patches is None:
        return None
    denoiser = getattr(pipeline, IMAGE_ATTR, None)
    if denoiser is not None:
        denoiser.release()
    return patches.undo()
