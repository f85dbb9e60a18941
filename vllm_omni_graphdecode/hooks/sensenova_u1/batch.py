"""SenseNova-U1 under load: the requests of one ``forward`` decode together.

Why: vLLM-Omni refuses ``--max-num-seqs`` above 1 for SenseNova-U1 ("does not support
request-level batching"), so a server decodes one request at a time, each token reading all of
the understanding weights. Here the pipeline declares request batching (``declare``), and the
think and text loops of the requests it is handed together decode as rows of one batched step
(``decode/batch/decoder.py``), each request otherwise running the pipeline's own code
(``turns``): its prefill, its loop, its denoising, its output.

Three places:

- ``declare(cls)``: at import of the pipeline module, in every process that loads this plugin
  (vLLM-Omni's engine checks ``supports_request_batch`` on the class where it starts, before any
  model exists), when ``VLLM_OMNI_GRAPHDECODE`` names ``sensenova_u1`` and
  ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_BATCH`` is not ``off``. It also gives the class a ``forward``
  that serves a batch one request after another, so a pipeline this plugin then does not wire
  (a refusal, no GPU) still answers every request of a batch.
- ``BatchWiring`` (from ``wiring.install`` when the engine runs more than one sequence): the
  decoder, its gate (checked once per ``forward``), pre-capture, release.
- ``forward``: each request of the batch a ``turns`` member; the loops' rows meet in
  ``BatchDecoder.launch``. A batch of one takes the same path, so a request's answer never
  depends on whether it arrived alone.

Sampling: a text loop that samples draws from the row's own stream, seeded by the request's
``seed`` (default 0), by position: the same request gives the same text whatever decodes beside
it, in any process, also where it decodes eagerly (a refused batch, a row handed back: its draws
come from the same stream, over the eager step's logits). A loop whose signature takes a
parameter the device-side choice does not implement (``LOOP_PARAMS``) runs its own code.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from ...core import patching, stats
from ...core.patching import HookRefused, check_signature
from ...core.reasons import ARGUMENTS, OOM, Reason
from ...decode.batch import turns
from ...decode.batch.decoder import BatchDecoder
from ...decode.batch.kv import BLOCK_SIZE, BatchKV, blocks_for, bytes_per_token, select_attention
from ...decode.sampling import RowSampling, choose
from ...decode.token_loop import HostLogits
from . import images, layouts, rules
from .step import MODEL, PAGED_KWARG, StepArgs, patch_attention

MAX_ROWS = 16
# Rows of every batched step, whatever the server's --max-num-seqs: one shape for every server
# configuration, so a request's answer does not depend on it either (measured on the H200: the
# linear layers cost the same at 8 and 16 rows, 8 rows decoding took 7.97 ms a step in an 8-row
# step and 7.98 in a 16-row one; results h200-2026-12-01e).
STEP_ROWS = MAX_ROWS
BATCH_ATTR = "supports_request_batch"
CANCEL_ATTR = "supports_request_cancellation"

NOT_WIRED = Reason("batched decode not wired on this pipeline",
                   "see the load line (python -m vllm_omni_graphdecode stats)")
# vllm-omni before 0.28: the diffusion executor's execute_batch registers how to split a batch's
# output only after the worker's reply, and the worker's background thread can publish the output
# first (a text batch is packed at once); the output is then cached under the batch's id and its
# requests wait out the engine's 30 s timeout and fail (seen over HTTP on 0.26 at
# --max-num-seqs 8). 0.28 and 0.30 adopt such an early output (multiproc_executor.execute_batch).
BATCHING_SAFE_FROM = (0, 28)
ENGINE_LOSES_BATCHES = Reason(
    "request batching not declared: this vllm-omni loses batched outputs",
    "upgrade vllm-omni to 0.28 or newer to serve SenseNova-U1 with --max-num-seqs above 1; on "
    "this release the server refuses it, as without the plugin, and requests run one at a time")


def engine_loses_batches(version: str | None) -> Reason | None:
    """Why the installed vllm-omni's engine must not be handed request batches, or None."""
    if version is None:
        return None
    try:
        release = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return None
    if release < BATCHING_SAFE_FROM:
        return ENGINE_LOSES_BATCHES.because(f"vllm-omni {version}")
    return None


class BatchStep:
    """The ``decoder.BatchStepModel`` of a SenseNova-U1 language model: ``rows`` one-token
    sequences as one sequence of ``rows`` tokens through the model's forward, attention through
    the batch's paged K/V (``PAGED_KWARG``). ``fusion``: the fused step's norms and rope
    (``fused_step.Fusion``; the linear layers the modules' own, cuBLAS at a fixed row count, or
    the batch's ``linears``), or None (the model's own layers)."""

    def __init__(self, language_model, layout: layouts.Layout, rows: int, *, fusion=None):
        layouts.check_model(language_model, layout)
        patch_attention(language_model, layout)
        if fusion is not None:
            fusion.patch_layers(language_model)
        self.lm = language_model
        self.fusion = fusion
        self.rows = rows
        device = next(language_model.parameters()).device
        self.input_ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        # rows: t, h, w rope indexes; decode tokens are text, so h = w = 0
        self.indexes = torch.zeros(3, rows, dtype=torch.long, device=device)
        self.positions = self.indexes[0]

    def load_inputs(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        self.input_ids[0].copy_(tokens)
        self.indexes[0].copy_(positions)

    def advance(self, tokens: torch.Tensor, active: torch.Tensor) -> None:
        self.input_ids[0].copy_(tokens)
        self.indexes[0].add_(active)

    def forward(self, cache: BatchKV) -> torch.Tensor:
        out = self.lm(input_ids=self.input_ids, indexes=self.indexes, past_key_values=None,
                      use_cache=False, **{PAGED_KWARG: StepArgs(cache, self.fusion)})
        return out.logits.reshape(self.rows, -1)


def _batch_fusion(lm, layout, device, dtype, linears=None):
    """The fused step's norms (and rope once per step on 0.24-0.28) with the modules' own GEMMs
    or ``linears`` (the one-request step's FP8 copies, ``fp8.Fp8Linears``: Marlin at 16 rows, or
    ``rowgemv``'s 16-row bf16 GEMM, ``rows_gemm.RowsLinears``),
    never the tuned GEMVs (a kernel configured by timing could round the same request
    differently in another process)."""
    if not layout.fused_step or torch.device(device).type != "cuda":
        return None
    from .fused_step import Fusion

    fusion = Fusion.select(lm, layout, device, dtype, tuned_gemv=False, linears=linears)
    return fusion if fusion.active else None


class BatchWiring:
    """What ``wiring.install`` attaches when the engine batches SenseNova-U1's requests."""

    def __init__(self, pipeline, layout, cfg, rows: int, *, attention=None, graphs=None,
                 writer=None, refusal=None, lora=None, linears=None, changed=None):
        self.pipeline = pipeline
        self.lm = pipeline.language_model
        self.layout = layout
        self.cfg = cfg
        self.rows = rows
        self.k = cfg.tokens_per_launch
        device = torch.device(pipeline.device)
        self.device = device
        self.attention = select_attention(device) if attention is None else attention
        self.graphs = (device.type == "cuda" and not isinstance(self.attention, Reason)
                       if graphs is None else graphs)
        self.writer = writer
        # The pipeline's gate and LoRA check (``wiring.Wiring``: decided once per structure
        # change), or the rules' own walks.
        self._refusal = refusal or (lambda: rules.gate(pipeline, self.lm, kernel=None))
        self.lora = lora or (lambda: rules.lora_present(self.lm))
        self.changed = changed  # checked before every launch (``BatchDecoder``)
        self.decoder: BatchDecoder | None = None
        self.lock = threading.Lock()
        self._gate_reason: Reason | None = None
        self.dtype = next(self.lm.parameters()).dtype
        # FP8 copies (fp8.Fp8Linears), the 16-row bf16 GEMM (rows_gemm.RowsLinears) or None:
        # the modules' own GEMMs
        self.linears = linears
        # The pipeline's forward beneath this batch's (``wiring.install`` sets it): what a
        # request runs under step execution (``steps.py``).
        self.inner_forward = pipeline.forward

    # -- the decoder --------------------------------------------------------------------------

    def initial_blocks(self) -> int:
        """Pool size at first use: every row holding the largest pre-capture bucket (a think
        request from a prompt of a few hundred tokens stays inside it), plus the scratch block."""
        return self.rows * blocks_for(max(self.cfg.precapture_buckets)) + 1

    def table_width(self) -> int:
        return blocks_for(max(self.cfg.buckets))

    def _decoder(self) -> BatchDecoder:
        if self.decoder is None:
            attn = layouts.attention_modules(self.lm)[0]
            fusion = _batch_fusion(self.lm, self.layout, self.device, self.dtype, self.linears)
            step = BatchStep(self.lm, self.layout, STEP_ROWS, fusion=fusion)
            cache = BatchKV(len(self.lm.model.layers), attn.num_kv_heads, attn.head_dim,
                            attn.num_heads, rows=STEP_ROWS, dtype=self.dtype, device=self.device,
                            attention=self.attention, blocks=self.initial_blocks(),
                            writer=self.writer)
            cache.grow(cache.num_blocks, width=self.table_width())
            self.decoder = BatchDecoder(step, cache, name=MODEL, k=self.k, graphs=self.graphs,
                                        reopen_blocks=self.initial_blocks(),
                                        reopen_width=self.table_width(),
                                        changed=self.changed)
        else:
            self.decoder.reopen(self.initial_blocks(), self.table_width())
        return self.decoder

    def refusal(self) -> Reason | None:
        """Why this ``forward``'s loops decode eagerly, or None (checked once per forward). A
        failed capture is not one: the launches then run without graphs (``BatchDecoder``)."""
        if isinstance(self.attention, Reason):
            return self.attention
        return self._refusal()

    def precapture(self) -> str:
        if not self.cfg.precapture:
            return "batch pre-capture off"
        reason = self.refusal()
        if reason is not None:
            return f"batch pre-capture skipped: {reason.key}"
        if self.lora():
            return "batch pre-capture skipped: dynamic LoRA wrappers present"
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                free = torch.cuda.mem_get_info()[0]
            decoder = self._decoder()
            seconds = decoder.precapture()
            took = ""
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                took = f", took {(free - torch.cuda.mem_get_info()[0]) / 2**20:.0f} MiB"
        except Exception as exc:
            self.release()
            return f"batch pre-capture failed: {type(exc).__name__}: {str(exc)[:200]}"
        return f"batch graph pre-captured in {seconds:.2f} s{took}"

    def describe(self) -> str:
        if isinstance(self.attention, Reason):
            return f"batched decode of up to {self.rows} requests refused: {self.attention.key}"
        per = blocks_for(max(self.cfg.precapture_buckets)) * BLOCK_SIZE
        attn = layouts.attention_modules(self.lm)[0]
        slot = bytes_per_token(len(self.lm.model.layers), attn.num_kv_heads, attn.head_dim,
                               self.dtype)
        pool = self.initial_blocks() * BLOCK_SIZE * slot / 2**30
        return (f"batched decode of up to {self.rows} requests ({STEP_ROWS}-row step, "
                f"{self.attention.name}; "
                f"{'CUDA graphs' if self.graphs else 'no graphs'}; {self.k} tokens a launch; "
                f"paged K/V pool {pool:.2f} GiB = {self.rows} rows x {per} tokens, grows on "
                f"demand{self._linears_clause()})")

    def _linears_clause(self) -> str:
        return "" if self.linears is None else f"; {self.linears.describe()}"

    def release(self) -> None:
        with self.lock:
            if self.decoder is not None:
                self.decoder.release()


# -- forward -----------------------------------------------------------------------------------

def _sub_batch(req, request):
    return type(req)(requests=[request])


def _cancel_flag(request):
    """The engine's shared-memory cancellation flag of ``request`` (``buf[0]`` set: abort it),
    opened once for the row's whole loop, or None."""
    name = getattr(request, "cancellation_signal", None)
    if not name:
        return None
    try:
        from multiprocessing.shared_memory import SharedMemory

        return SharedMemory(name=name)
    except (FileNotFoundError, OSError, ValueError):
        return None


def _error_output(exc: BaseException):
    from vllm_omni.diffusion.data import DiffusionOutput

    try:
        from vllm_omni.diffusion.data import DiffusionRequestAbortedError
    except ImportError:  # older releases
        DiffusionRequestAbortedError = ()  # noqa: N806
    if DiffusionRequestAbortedError and isinstance(exc, DiffusionRequestAbortedError):
        return DiffusionOutput(aborted=True, abort_message=str(exc))
    return DiffusionOutput(error=f"{type(exc).__name__}: {exc}")


class _Member:
    """What one request's thread needs of the caller's thread: device, stream, grad mode."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.inference = torch.is_inference_mode_enabled()
        self.grad = torch.is_grad_enabled()

    def run(self, fn):
        def body():
            if self.cuda:
                torch.cuda.set_device(self.stream.device)
                torch.cuda.set_stream(self.stream)
            with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
                return fn()
        return body


_local = threading.local()


def current_request():
    """The request whose member runs in this thread (its seed and cancellation), or None."""
    return getattr(_local, "request", None)


@contextlib.contextmanager
def serving(request):
    """This thread serves ``request`` (``current_request``); its engine cancellation flag is
    opened once for the whole request (``check_cancelled``)."""
    _local.request = request
    _local.cancel = _cancel_flag(request)
    try:
        yield
    finally:
        flag, _local.cancel, _local.request = getattr(_local, "cancel", None), None, None
        if flag is not None:
            flag.close()


def cancelled() -> bool:
    """Whether the engine asked to abort the request this thread serves."""
    flag = getattr(_local, "cancel", None)
    return flag is not None and bool(flag.buf[0])


def check_cancelled() -> None:
    """Raise vLLM-Omni's abort error when the engine asked to abort this thread's request."""
    if cancelled():
        raise _abort_error("request cancelled")


def _abort_error(message: str) -> BaseException:
    try:
        from vllm_omni.diffusion.data import DiffusionRequestAbortedError
    except ImportError:  # older releases
        return RuntimeError(message)
    return DiffusionRequestAbortedError(message)


def wrap_forward(batch: "BatchWiring | None", original, *, why: Reason = NOT_WIRED):
    """``forward(req)`` for a ``DiffusionRequestBatch`` of any size: each request a member of one
    ``turns`` group (``batch`` given), or one after another (``batch`` None: ``why`` counted)."""

    @functools.wraps(original)
    def forward(req, *args, **kwargs):
        requests = list(getattr(req, "requests", None) or [])
        if len(requests) <= 1 and batch is None:
            return original(req, *args, **kwargs)
        if not requests:
            return original(req, *args, **kwargs)
        subs = [_sub_batch(req, r) if len(requests) > 1 else req for r in requests]
        if batch is None:
            stats.fallback(MODEL, why.because(f"{len(requests)} requests"))
            outputs = []
            for sub in subs:
                try:
                    outputs.append(original(sub, *args, **kwargs))
                except Exception as exc:
                    outputs.append(_error_output(exc))
            return outputs
        reason = batch.refusal()
        batch._gate_reason = reason
        if reason is not None:
            stats.fallback(MODEL, reason)
        member = _Member(batch.device)
        decoder = batch._decoder() if reason is None else None
        # LoRA wrappers switch adapters by Python branches a capture would freeze: the batch's
        # graphs then live for this forward only (the engine batches one adapter at a time).
        per_forward = decoder is not None and batch.lora()
        if per_forward:
            decoder.drop_graphs()
            stats.count(MODEL, "batch_lora_forward")

        def one(request, sub):
            def run():
                with serving(request):
                    return original(sub, *args, **kwargs)
            return member.run(run)

        rows = batch.rows
        results: list = []
        try:
            for start in range(0, len(requests), rows):
                chunk = list(zip(requests[start:start + rows], subs[start:start + rows]))
                group = turns.Turns(decoder.launch if decoder is not None else _nothing,
                                    name="graphdecode-sensenova")
                results += group.run([one(r, s) for r, s in chunk])
        finally:
            if per_forward:
                decoder.drop_graphs()
        stats.count(MODEL, "batch_forward")
        stats.count(MODEL, "batch_requests", len(requests))
        if len(requests) == 1:
            if isinstance(results[0], BaseException):
                raise results[0]
            return results[0]
        return [_error_output(r) if isinstance(r, BaseException) else r for r in results]

    forward.__graphdecode__ = True
    return forward


def _nothing() -> None:
    raise turns.Stuck("a member waits for a batched launch, but this forward decodes eagerly")


# -- serving a loop from the batch -------------------------------------------------------------

class EagerRow:
    """A loop of a batch that decodes on the pipeline's eager path (its batch refused, or its
    row handed back), drawing a sampled loop's tokens from the row's own stream: the launches'
    function (``decode/sampling.py`` ``choose``) over the eager step's logits, at the same positions."""

    live = False

    def __init__(self, cache, sampling: RowSampling, device):
        self.cache = cache
        self.sampling = sampling
        self.device = torch.device(device)
        self.thread = threading.get_ident()
        self.host = HostLogits()

    def owns(self, cache) -> bool:
        return cache is self.cache and threading.get_ident() == self.thread

    def serves(self, cache) -> bool:
        return False

    def logits(self, token: int, vocab: int):
        """Host logits whose argmax (and one draw) is ``token`` (``token_loop.ServedLogits``)."""
        return self.host.logits(token, vocab)

    def draw(self, logits: torch.Tensor, position) -> int:
        """The row's draw from ``logits``' last row, the token following ``position``."""
        s = self.sampling
        device = logits.device
        last = logits.reshape(-1, logits.shape[-1])[-1:]
        token = choose(last, torch.tensor([s.temperature], device=device),
                       torch.tensor([s.seed], device=device),
                       torch.tensor([int(position)], device=device), True)
        return int(token[0])

    def first_draw(self, prefix_logits: torch.Tensor, t_idx) -> int:
        """The draw from the prefill's last logits, at the prompt's last position."""
        return self.draw(prefix_logits, t_idx)

    def eager_step(self, original, output_cls, next_token, t_idx, past_key_values, *args,
                   **kwargs):
        """The pipeline's own step, on the device (the token the loop feeds may be a host
        tensor: it picked it from host logits), then the row's draw when it samples."""
        if torch.is_tensor(next_token) and next_token.device != self.device:
            next_token = next_token.to(self.device)
        out = original(next_token, t_idx, past_key_values, *args, **kwargs)
        stats.count(MODEL, "eager_step")
        if self.sampling.temperature <= 0:
            return out
        logits = out.logits
        token = self.draw(logits, t_idx + 1)
        return output_cls(logits=self.logits(token, logits.shape[-1]),
                          past_key_values=out.past_key_values)

    def close(self) -> None:
        pass


class RowSession(EagerRow):
    """One loop's row: ``decode`` serves its tokens, ``finish`` writes its K/V back; after a
    hand-back it steps eagerly as ``EagerRow``."""

    def __init__(self, batch: BatchWiring, row, think: bool):
        super().__init__(row.cache, row.sampling, batch.device)
        self.batch = batch
        self.row = row
        self.think = think
        self.request = current_request()

    @property
    def live(self) -> bool:
        return self.row.live

    def logits(self, token: int, vocab: int | None = None):
        return self.host.logits(token, vocab or self.batch.decoder.vocab)

    def serves(self, cache) -> bool:
        return self.row.live and self.owns(cache)

    def decode(self, token: int, position: int) -> int | None:
        if cancelled():  # read at every token: the flag was opened once (``serving``)
            self.close()
            raise _abort_error("request cancelled while decoding in a batch")
        return self.row.next(token, position)

    def finish(self) -> None:
        """The cache is read next: the decoded K/V are written back and the row left."""
        self.batch.decoder.leave(self.row, write_back=True)

    def close(self) -> None:
        self.batch.decoder.leave(self.row, write_back=self.think)


def open_row(batch: BatchWiring, cache, *, think: bool, sampling: RowSampling):
    """A row for this loop, or None (the loop runs eagerly; the reason is counted)."""
    if turns.current() is None or batch._gate_reason is not None:
        return None
    decoder = batch.decoder
    if decoder is None:
        return None
    from ...decode.session import dynamic_cache_reason
    from ...ops import attention as kernels

    reason = dynamic_cache_reason(cache, kernels.REFERENCE)
    if reason is None and cache.layers[0].keys.dtype != batch.dtype:
        reason = rules.KV_QUANT.because(f"cache dtype {cache.layers[0].keys.dtype}")
    if reason is not None:
        stats.fallback(MODEL, reason)
        return None
    row = decoder.join(cache, sampling)
    if row is None:
        stats.fallback(MODEL, OOM.because(f"every one of the batch's {decoder.cache.rows} rows "
                                          f"is taken at join"))
        return None
    return RowSession(batch, row, think)


# The loops' parameters whose meaning the device-side choice implements (vllm-omni 0.24-0.30):
# the think loop's argmax and limit; the text loop's argmax, or softmax(logits / temperature)
# sampling, and limit.
LOOP_PARAMS = {
    True: frozenset({"self", "prefix_outputs", "past_key_values", "t_idx", "max_think_tokens"}),
    False: frozenset({"self", "prefix_logits", "past_key_values", "t_idx", "max_tokens",
                      "do_sample", "temperature"}),
}
UNKNOWN_LOOP_PARAMS = Reason(
    "the decode loop takes parameters the device-side token choice does not implement",
    "report it with the vllm-omni version (python -m vllm_omni_graphdecode doctor): the loop "
    "picks its own tokens from the model's logits meanwhile (the detail names the parameters)")


def unknown_loop_params(params: dict, think: bool) -> list[str]:
    """The names among a loop's bound arguments (defaults applied, a ``**kwargs`` parameter's
    keys in its place: ``wiring._loop_params``) that ``LOOP_PARAMS`` does not know."""
    return sorted(name for name in params if name not in LOOP_PARAMS[think])


def sampling_for(params: dict | None, think: bool) -> RowSampling | Reason:
    """The row's pick: the loop's argmax, or its draw at its temperature from the request's own
    seeded stream. ``params``: the loop's bound arguments, or None where they could not be read.
    A text loop whose sampling cannot be read (its arguments unbound, a temperature that is not a
    number) gets ``ARGUMENTS``, and a loop with a parameter the choice does not implement
    (``LOOP_PARAMS``) ``UNKNOWN_LOOP_PARAMS``: it decodes eagerly, drawing as its own code does,
    rather than being served tokens it might not have picked."""
    if params is not None:
        unknown = unknown_loop_params(params, think)
        if unknown:
            return UNKNOWN_LOOP_PARAMS.because(
                f"{'think' if think else 'text'} loop takes {', '.join(unknown)}")
    if think:
        return RowSampling()
    if params is None:
        return ARGUMENTS.because("batched text loop: its arguments do not bind to its "
                                 "signature")
    if not params.get("do_sample"):
        return RowSampling()
    temperature = params.get("temperature")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        return ARGUMENTS.because(f"batched text loop: temperature {temperature!r}, not a "
                                 f"number")
    if temperature <= 0:
        return RowSampling()
    request = current_request()
    seed = getattr(getattr(request, "sampling_params", None), "seed", None)
    return RowSampling(float(temperature), int(seed) if seed is not None else 0)


# -- the class-level declaration ---------------------------------------------------------------

FORWARD_PARAMS = ("self", "req")


def declare(cls) -> str:
    """Declare request batching on the pipeline class and give it a serial batch ``forward``
    (module docstring). Returns what was done, for the log. Idempotent."""
    unsafe = engine_loses_batches(patching.omni_version())
    if unsafe is not None:
        stats.refused(MODEL, unsafe)
        return unsafe.describe()
    if getattr(cls.forward, "__graphdecode__", False):
        setattr(cls, BATCH_ATTR, True)
        setattr(cls, CANCEL_ATTR, True)
        return "already declared"
    try:
        original = check_signature(cls, "forward", FORWARD_PARAMS)
    except HookRefused as exc:
        stats.refused(MODEL, exc.reason)
        return f"request batching not declared: {exc.reason.describe()}"

    @functools.wraps(original)
    def forward(self, req, *args, **kwargs):
        requests = getattr(req, "requests", None) or []
        # One request: the pipeline's own forward, serving ``n`` images (``images.py``).
        bound = images.wrap(functools.partial(original, self))
        if len(requests) <= 1:
            return bound(req, *args, **kwargs)
        return wrap_forward(None, bound, why=NOT_WIRED)(req, *args, **kwargs)

    forward.__graphdecode__ = True
    cls.forward = forward
    setattr(cls, BATCH_ATTR, True)
    # The engine then gives each request a cancellation flag (vllm-omni 0.30), which a row
    # reads at every token and a denoising request at every step (``check_cancelled``).
    setattr(cls, CANCEL_ATTR, True)
    stats.count(MODEL, "batch_declared")
    return f"{cls.__name__}: request batching and cancellation declared"


def engine_rows(runner, cfg) -> int:
    """How many requests the engine hands one ``forward`` (its ``max_num_seqs``), capped at
    ``MAX_ROWS``; 1 when batching is off or the engine runs one at a time."""
    if cfg.sensenova_batch == "off":
        return 1
    od = getattr(runner, "od_config", None)
    try:
        n = int(getattr(od, "max_num_seqs", 1) or 1)
    except (TypeError, ValueError):
        n = 1
    return max(1, min(n, MAX_ROWS))
