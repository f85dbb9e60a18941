"""SenseNova-U1 under vLLM-Omni's step execution (``--step-execution``): continuous batching.

Why: in request mode (``batch.py``) the engine hands the pipeline a whole batch and the batch
leaves only when all of it is done: a request that arrives meanwhile waits for all of it, text
answers and images never share a forward, and images come back together at the end. vLLM-Omni
0.28 and 0.30 ship the machinery a server needs instead: under ``--step-execution`` its
``StepScheduler`` admits new requests at every step and its runner calls the pipeline once per
step for every running request (``prepare_encode`` for new ones, one ``denoise_step`` for all,
then ``step_scheduler`` and ``post_decode`` per request, which may end it). SenseNova-U1 does not
implement that protocol in any release; BAGEL, the in-tree unified model that does, runs its
whole think phase inside ``prepare_encode`` and refuses text outputs in step mode.

How: each request runs the pipeline's own ``forward`` in a thread of its own, a member of one
``turns.Ticks`` group per pipeline; the runner's ``denoise_step`` is one tick of that group:

- a new request runs its prefill at the tick after it was admitted;
- a request in its think or text decode is a row of the batched step (``batch.py``, the same
  16-row, batch-invariant launch as in request mode) and gets one launch (``k`` tokens) a tick,
  beside every other request's row, text answers and think images alike;
- the requests in their denoising run as many denoising steps a tick as there are of them,
  each its own step (graph-replayed where ``denoise.py`` is wired), the oldest request's first
  (``VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_ORDER=fcfs``, the default: it finishes, and its
  output leaves, as early as the same work allows) or one step each (``round_robin``); at
  most ``VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE_BESIDE_DECODE`` (1) of them in a tick where a
  request decodes, so that a text answer does not wait for every image's step at each launch;
- a request whose ``forward`` returned leaves at that tick: ``post_decode`` hands its output to
  the runner, which sends it at once.

So a request's answer is what it gives alone, whatever joins or leaves beside it: the same code,
the same rows of the same batched step. The scheduler admits a waiting request only when its
batch key equals the running batch's (size, CFG, steps, ...); for SenseNova-U1 under this
plugin the key keeps only what the worker applies to a whole step (the LoRA adapter, the quality
mode and the CFG fields vLLM-Omni's input batch requires to agree): ``widen_step_admission``,
patched on ``StepScheduler`` in the engine's process, checked for signature, counted
(``step_admission_widened``) and removable (``undo_step_admission``).

Aborts: vLLM-Omni's step engine finishes an aborted request in its scheduler, which then stops
scheduling it; a member whose request is missing from a tick's scheduled states is stopped at
that tick (its rows leave the batch, its caches are freed). Where nothing else runs, the engine
schedules no tick, and the stopped member's memory is freed at the next request's tick.

Without the batched decode (the batch refused, or ``--max-num-seqs 1``), the members still take
turns a step at a time, and a loop decodes eagerly inside one tick (counted:
``step_decode_in_one_tick``).

Counted under "sensenova_u1": ``step_tick``, ``step_request`` (members started),
``step_finished``, ``step_stopped`` (aborts), ``step_lora_batch``, ``step_denoise_held``
(denoising steps put off to a later step because a request decoded).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ... import config
from ...core import stats
from ...core.patching import HookRefused, check_signature
from ...core.reasons import Reason
from ...decode.batch import turns
from . import batch as batch_mod
from .step import MODEL

STEPS_ATTR = "_graphdecode_sensenova_u1_steps"
PIPELINE_CLASS = "SenseNovaU1Pipeline"
# vllm-omni 0.28-0.30 (``models/interface.py``, ``SupportsStepExecution``).
PROTOCOL = {
    "prepare_encode": ("self", "state"),
    "denoise_step": ("self", "input_batch"),
    "step_scheduler": ("self", "state", "noise_pred"),
    "post_decode": ("self", "state"),
}
DENOISE_PARAMS = ("self", "image_prediction", "ns", "t", "z", "image_embeds", "caches", "p",
                  "step_i", "is_it2i")
# The batch key fields that still keep requests apart (``widen_step_admission``).
KEEP_IN_KEY = frozenset({"lora_int_id", "lora_scale", "quality", "use_step_execution",
                         "true_cfg_scale", "cfg_normalize"})

NO_BATCHED_DECODE = Reason(
    "step execution without the batched decode",
    "serve with --max-num-seqs above 1 (and see the load line for why the batch is refused): "
    "meanwhile each request's think or text loop decodes inside one step, the others waiting")


def has_step_execution() -> bool:
    """Whether the installed vllm-omni's engine runs step execution (0.28 and newer)."""
    try:
        from vllm_omni.diffusion.models import interface
    except ImportError:
        return False
    return hasattr(interface, "SupportsStepExecution")


# -- the class-level declaration (every process, at import of the pipeline module) -------------

def declare(cls) -> str:
    """Give ``cls`` vLLM-Omni's step-execution protocol (module docstring) and the denoising
    step's tick boundary. Idempotent; returns what was done, for the log."""
    if getattr(cls, "supports_step_execution", False) and getattr(cls.prepare_encode,
                                                                  "__graphdecode__", False):
        return "step execution already declared"
    if not has_step_execution():
        return "step execution not declared: this vllm-omni has none"
    for name in PROTOCOL:
        if name in cls.__dict__:
            return (f"step execution not declared: {cls.__name__} has its own {name} (vllm-omni "
                    f"implements it; this plugin leaves it in charge)")
    try:
        original = check_signature(cls, "_denoise", DENOISE_PARAMS)
    except HookRefused as exc:
        stats.refused(MODEL, exc.reason)
        return f"step execution not declared: {exc.reason.describe()}"

    @functools.wraps(original)
    def _denoise(self, *args, **kwargs):
        member = turns.current()
        if member is not None:
            if isinstance(member.group, turns.Ticks):
                member.group.end_of_step()  # one denoising step a tick
            else:
                batch_mod.check_cancelled()  # request mode: the engine's abort, per step
        return original(self, *args, **kwargs)

    _denoise.__graphdecode__ = True
    cls._denoise = _denoise
    for name, fn in (("prepare_encode", prepare_encode), ("denoise_step", denoise_step),
                     ("step_scheduler", step_scheduler), ("post_decode", post_decode)):
        setattr(cls, name, fn)
    cls.supports_step_execution = True
    stats.count(MODEL, "step_declared")
    return f"{cls.__name__}: step execution declared (--step-execution: continuous batching)"


# -- the protocol ---------------------------------------------------------------------------------

class StepRequests:
    """The requests one pipeline serves under step execution: a ``turns.Ticks`` member each,
    keyed by request id."""

    def __init__(self, pipeline):
        from .wiring import STATE_ATTR

        self.pipeline = pipeline
        wiring = getattr(pipeline, STATE_ATTR, None)
        self.batch = getattr(wiring, "batch", None)
        # The pipeline's forward for one request, beneath the request-mode batch.
        self.forward = (self.batch.inner_forward if self.batch is not None
                        else pipeline.forward)
        member = batch_mod._Member(pipeline.device)
        cfg = wiring.cfg if wiring is not None else config.get()
        self.ticks = turns.Ticks(self._launch, name="graphdecode-sensenova-step",
                                 setup=member.run, order=cfg.sensenova_denoise_order,
                                 beside_launch=cfg.sensenova_denoise_beside_decode)
        self.members: dict[str, turns.TickMember] = {}

    def _launch(self) -> None:
        decoder = self.batch.decoder if self.batch is not None else None
        if decoder is None:
            raise turns.Stuck("a request waits for a batched launch, but no batch is wired")
        decoder.launch()

    def add(self, state) -> None:
        from vllm_omni.diffusion.request import OmniDiffusionRequest
        from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

        request = OmniDiffusionRequest(prompt=state.prompt, sampling_params=state.sampling,
                                       request_id=state.request_id,
                                       kv_sender_info=state.kv_sender_info)
        sub = DiffusionRequestBatch(requests=[request])
        forward = self.forward

        def body():
            with batch_mod.serving(request):
                return forward(sub)

        old = self.members.pop(state.request_id, None)
        if old is not None:
            self.ticks.stop(old, _aborted("request id reused"))
        self.members[state.request_id] = self.ticks.add(body)
        stats.count(MODEL, "step_request")
        if self.batch is None:
            stats.degraded(MODEL, NO_BATCHED_DECODE.because("the pipeline has no request batch "
                                                            "wired"))
        else:
            refusal = self.batch.refusal()
            if refusal is not None:  # its loops decode eagerly, inside one step each
                stats.fallback(MODEL, refusal)

    def tick(self, scheduled: set[str]) -> None:
        """One tick; members of requests the runner no longer schedules are stopped first."""
        for rid, member in list(self.members.items()):
            if rid not in scheduled and not member.done:
                self.ticks.stop(member, _aborted("the engine stopped scheduling it"))
                stats.count(MODEL, "step_stopped")
        batch = self.batch
        if batch is not None:
            fresh = all(m.state == turns.NEW for m in self.members.values())
            reason = batch.refusal()
            batch._gate_reason = reason
            if reason is None:
                decoder = batch._decoder()
                if fresh and batch.lora():
                    # A new running batch may bring another adapter: the launches a capture
                    # froze on the last one go (the scheduler runs one adapter at a time).
                    decoder.drop_graphs()
                    stats.count(MODEL, "step_lora_batch")
        held = self.ticks.held
        self.ticks.tick()
        stats.count(MODEL, "step_tick")
        if self.ticks.held > held:
            stats.count(MODEL, "step_denoise_held", self.ticks.held - held)
        for rid, member in list(self.members.items()):
            if rid not in scheduled and member.done:
                self._drop(rid)

    def done(self, rid: str) -> bool:
        member = self.members.get(rid)
        return member is None or member.done

    def output(self, rid: str):
        member = self.members.get(rid)
        self._drop(rid)
        if member is None:
            return batch_mod._error_output(
                RuntimeError(f"request {rid} has no step-execution member"))
        stats.count(MODEL, "step_finished")
        if member.error is not None:
            return batch_mod._error_output(member.error)
        return member.result

    def _drop(self, rid: str) -> None:
        member = self.members.pop(rid, None)
        if member is not None:
            self.ticks.forget(member)


def _aborted(why: str) -> BaseException:
    try:
        from vllm_omni.diffusion.data import DiffusionRequestAbortedError
    except ImportError:  # older releases
        return RuntimeError(f"request aborted: {why}")
    return DiffusionRequestAbortedError(f"request aborted: {why}")


def requests_of(pipeline) -> StepRequests:
    steps = pipeline.__dict__.get(STEPS_ATTR)
    if steps is None:
        steps = StepRequests(pipeline)
        setattr(pipeline, STEPS_ATTR, steps)
    return steps


def prepare_encode(self, state, **kwargs):
    """A member for ``state``'s request (it runs from the next tick). The runner's batch view
    gets one placeholder latent row per request: the request's own latents live in its
    thread, and ``denoise_step`` returns no noise prediction."""
    state.latents = torch.zeros(1, 1)
    state.timesteps = torch.zeros(2)  # two "steps": running (0) and ended (2)
    state.step_index = 0
    requests_of(self).add(state)
    return state


def denoise_step(self, input_batch, *, states=None, **kwargs):
    """One tick of every member (``StepRequests.tick``). Returns None: each request advanced
    its own latents."""
    scheduled = {s.request_id for s in (states if states is not None else
                                        getattr(input_batch, "states", ()))}
    requests_of(self).tick(scheduled)
    return None


def step_scheduler(self, state, noise_pred, **kwargs) -> None:
    """A request whose member ended is complete (the runner then calls ``post_decode``)."""
    if requests_of(self).done(state.request_id):
        state.step_index = state.total_steps


def post_decode(self, state, **kwargs):
    return requests_of(self).output(state.request_id)


for _fn in (prepare_encode, denoise_step, step_scheduler, post_decode):
    _fn.__graphdecode__ = True


# -- the engine's admission (engine process, at import of the step scheduler) ------------------

KEY_METHOD = "_build_sampling_params_key"
KEY_PARAMS = ("self", "request")
TOTAL_METHOD = "_get_total_steps"
_admission: dict = {}


def widen_step_admission(module, cfg) -> str | None:
    """Patch ``module.StepScheduler`` so that, for a SenseNova-U1 server, a waiting request's
    batch key keeps only ``KEEP_IN_KEY`` (module docstring), and a request that names no step
    count (a text answer) counts as one step. Idempotent; removable (``undo_step_admission``)."""
    if cfg.sensenova_batch == "off":
        return None
    cls = getattr(module, "StepScheduler", None)
    if cls is None:
        return "step admission not widened: no StepScheduler"
    if _admission.get("cls") is cls:
        return "step admission already widened"
    try:
        key_fn = check_signature(cls, KEY_METHOD, KEY_PARAMS)
        total_fn = check_signature(cls, TOTAL_METHOD, KEY_PARAMS)
    except HookRefused as exc:
        stats.refused(MODEL, exc.reason)
        return f"step admission not widened: {exc.reason.describe()}"

    @functools.wraps(key_fn)
    def build_key(self, request):
        key = key_fn(self, request)
        if not _serves_sensenova(self) or not dataclasses.is_dataclass(key):
            return key
        stats.count(MODEL, "step_admission_widened")
        return widened(key)

    @functools.wraps(total_fn)
    def total_steps(self, request):
        if _serves_sensenova(self):
            sampling = request.sampling_params
            if all(getattr(sampling, name, None) is None
                   for name in ("timesteps", "sigmas", "num_inference_steps")):
                return 1
        return total_fn(self, request)

    _admission.update(cls=cls, originals={KEY_METHOD: cls.__dict__.get(KEY_METHOD),
                                          TOTAL_METHOD: cls.__dict__.get(TOTAL_METHOD)})
    setattr(cls, KEY_METHOD, build_key)
    setattr(cls, TOTAL_METHOD, total_steps)
    return "StepScheduler admits SenseNova-U1 requests of every size and kind into one batch"


def undo_step_admission() -> None:
    cls = _admission.pop("cls", None)
    if cls is None:
        return
    for name, original in _admission.pop("originals").items():
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


def _serves_sensenova(scheduler) -> bool:
    od = getattr(scheduler, "od_config", None)
    return getattr(od, "model_class_name", None) == PIPELINE_CLASS


def widened(key):
    """``key`` with every field outside ``KEEP_IN_KEY`` at its default."""
    changes = {}
    for field in dataclasses.fields(key):
        if field.name in KEEP_IN_KEY:
            continue
        if field.default is not dataclasses.MISSING:
            changes[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            changes[field.name] = field.default_factory()
    return dataclasses.replace(key, **changes)
