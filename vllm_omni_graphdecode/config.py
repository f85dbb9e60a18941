"""The plugin's environment variables, parsed once, with errors that say what is accepted.

Every setting the plugin reads is declared in ``SETTINGS`` below; README's configuration table is
written from the same list (``python -m vllm_omni_graphdecode doctor`` prints the parsed values).
A bad value raises ``ConfigError`` at start-up naming the variable, the value and what is accepted:
a typo must not silently leave the server on the slow path.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping

from .models import MODEL_KEYS

ENABLE_VAR = "VLLM_OMNI_GRAPHDECODE"
BUCKETS_VAR = "VLLM_OMNI_GRAPHDECODE_BUCKETS"
PRECAPTURE_VAR = "VLLM_OMNI_GRAPHDECODE_PRECAPTURE"
PRECAPTURE_BUCKETS_VAR = "VLLM_OMNI_GRAPHDECODE_PRECAPTURE_BUCKETS"
TOKENS_PER_LAUNCH_VAR = "VLLM_OMNI_GRAPHDECODE_TOKENS_PER_LAUNCH"
SENSENOVA_STEP_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_STEP"
SENSENOVA_DENOISE_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE"
SENSENOVA_BATCH_VAR = "VLLM_OMNI_GRAPHDECODE_SENSENOVA_BATCH"
FP8_VAR = "VLLM_OMNI_GRAPHDECODE_FP8"
# The hot paths that can read FP8 weight copies (issue #23); ``on`` means all of them.
FP8_PATHS = ("sensenova_decode", "sensenova_denoise", "qwen_image_21")
# Named only, never by ``on``: SenseNova-U1's lm_head in FP8 too (the layer that picks the token;
# vLLM's ``--quantization fp8`` keeps lm_head unquantised as well).
FP8_NAMED_ONLY = ("sensenova_lm_head",)
# A launch records this many decode steps in one graph: capture time and graph memory grow with it.
MAX_TOKENS_PER_LAUNCH = 64
# Unset, the pre-capture buckets are the configured buckets up to this length: what a think
# request (1024 tokens from a prompt of a few hundred) passes through.
PRECAPTURE_UP_TO = 2048

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """An environment variable of this plugin holds a value it does not accept."""


def _bad(var: str, raw: str, accepted: str) -> ConfigError:
    return ConfigError(f"{var}={raw!r} is not accepted; accepted: {accepted}")


def _parse_models(var: str, raw: str) -> frozenset[str]:
    value = raw.strip().lower()
    if value in ("", "0", "off", "false", "none"):
        return frozenset()
    if value in ("1", "all", "on", "true"):
        return frozenset(MODEL_KEYS)
    keys = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODEL_KEYS]
    if unknown or not keys:
        raise _bad(var, raw, "unset or 0 (off), 1 or all (every model), or a comma list of "
                   + ", ".join(MODEL_KEYS))
    return frozenset(keys)


def _parse_bool(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _bad(var, raw, "1/true/yes/on or 0/false/no/off")


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(var: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise _bad(var, raw, ", ".join(choices))
        return value
    return parse


def _positive_int(var: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise _bad(var, raw, "a positive integer") from None
    if value <= 0:
        raise _bad(var, raw, "a positive integer")
    return value


def _tokens_per_launch(var: str, raw: str) -> int:
    accepted = f"an integer from 1 to {MAX_TOKENS_PER_LAUNCH}"
    try:
        value = int(raw.strip())
    except ValueError:
        raise _bad(var, raw, accepted) from None
    if not 1 <= value <= MAX_TOKENS_PER_LAUNCH:
        raise _bad(var, raw, accepted)
    return value


def _int_list_or_unset(var: str, raw: str) -> tuple[int, ...]:
    return () if raw.strip() == "" else _int_list(var, raw)


def _int_list(var: str, raw: str) -> tuple[int, ...]:
    accepted = "a comma list of increasing positive multiples of 16, e.g. 512,1024,2048"
    try:
        values = tuple(int(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise _bad(var, raw, accepted) from None
    if (not values or any(v <= 0 or v % 16 for v in values)
            or any(b <= a for a, b in zip(values, values[1:]))):
        raise _bad(var, raw, accepted)
    return values


def _parse_fp8(var: str, raw: str) -> frozenset[str]:
    value = raw.strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return frozenset()
    if value in ("1", "on", "true", "yes", "all"):
        return frozenset(FP8_PATHS)
    paths = [p.strip() for p in value.split(",") if p.strip()]
    accepted = FP8_PATHS + FP8_NAMED_ONLY
    if not paths or any(p not in accepted for p in paths):
        raise _bad(var, raw, "off (default), on (every FP8 path but the lm_head), or a comma "
                   "list of " + ", ".join(accepted))
    if "sensenova_lm_head" in paths and "sensenova_decode" not in paths:
        raise _bad(var, raw, "sensenova_lm_head together with sensenova_decode (the lm_head "
                   "copy is read by the FP8 decode step), e.g. sensenova_decode,sensenova_lm_head")
    return frozenset(paths)


def _path_or_off(var: str, raw: str) -> str:
    value = raw.strip()
    return "" if value.lower() in ("", "0", "off", "false", "no") else value


@dataclasses.dataclass(frozen=True)
class Setting:
    var: str
    default: str
    parse: Callable[[str, str], object]
    field: str
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting(ENABLE_VAR, "0", _parse_models, "models",
            "Turns the plugin on: unset/0 off; 1/all every model; or a comma list of "
            + ", ".join(MODEL_KEYS) + "."),
    Setting("VLLM_OMNI_GRAPHDECODE_VERIFY", "0", _parse_bool, "verify",
            "1: the first replay of every new graph is checked against the eager step; a mismatch "
            "disables that graph (WARNING) and the request goes on eagerly. Costs one eager step "
            "per new graph."),
    Setting(PRECAPTURE_VAR, "1", _parse_bool, "precapture",
            "1: at model load, capture SenseNova-U1's decode graphs for the pre-capture buckets "
            "and compile Qwen-Image-2.1's fast step for 1024x1024, so the first request pays "
            "neither. 0: both on first use."),
    Setting("VLLM_OMNI_GRAPHDECODE_FA_VERSION", "auto", _choice("auto", "2", "3"), "fa_version",
            "FlashAttention version for paged decode: auto (FA3 on Hopper when the build has it, "
            "else FA2), 2 or 3."),
    Setting("VLLM_OMNI_GRAPHDECODE_SENSENOVA_INTREE", "defer", _choice("defer", "takeover"),
            "sensenova_intree",
            "vllm-omni >= 0.30 ships its own SenseNova-U1 paged decode: defer leaves it in charge; "
            "takeover replaces its decode context with this plugin's."),
    Setting(TOKENS_PER_LAUNCH_VAR, "8", _tokens_per_launch, "tokens_per_launch",
            "SenseNova-U1 think/text decode: tokens decoded per graph launch, each next token "
            "chosen on the device (the loop's argmax, or for a sampling text loop its softmax + "
            "multinomial at its temperature), the loop's stop tokens and limit checked once per "
            "launch (tokens past a stop are discarded with their K/V). 1: one launch and one host "
            "sync per token, the loop picking each token itself."),
    Setting(SENSENOVA_STEP_VAR, "fused", _choice("fused", "tuned", "exact"), "sensenova_step",
            "SenseNova-U1 decode step inside the graph: fused (the decoder layer's norms, residual "
            "add and SiLU through vllm's fused kernels, rope tables once per step, the linear "
            "layers' own cuBLAS GEMMs; rounds slightly differently from the model, the same in "
            "every process), tuned (fused, with the linear layers through Inductor GEMVs tuned "
            "by timing at load: 4% faster on the H200, but another process may round a request "
            "differently) or exact (the model's own modules, as its eager step computes)."),
    Setting(SENSENOVA_DENOISE_VAR, "graph", _choice("off", "graph", "fast"), "sensenova_denoise",
            "SenseNova-U1 image denoising: graph replays each CFG branch's step (the pipeline's "
            "own code, over static prefix + image K/V buffers per request branch) as a CUDA "
            "graph, bit for bit the pipeline's result; fast replays a restated step instead "
            "(Inductor-fused elementwise work, FlashAttention; 1.67x per step on 0.26, 1.20x on "
            "0.30; rounding differs: 30.4 dB from the pipeline's image with random weights, "
            "opt-in); off leaves the pipeline's steps as they are. graph by default: "
            "1.41x per step on vllm-omni 0.26, 1.13x on 0.30 (H200, 1024x1024), ~0.75 GB more "
            "peak memory. Unset while VLLM_OMNI_GRAPHDECODE_FP8 names sensenova_denoise: fast."),
    Setting(SENSENOVA_BATCH_VAR, "auto", _choice("auto", "off"), "sensenova_batch",
            "SenseNova-U1 under load: auto declares request batching (vllm-omni 0.28 and newer: "
            "0.24 and 0.26 can lose a batch's outputs), so `vllm serve ... --omni "
            "--max-num-seqs N` starts, and the think/text loops of the requests the engine hands "
            "one forward decode together (up to 16 rows a batched step; a request's tokens do not "
            "depend on what decodes beside it); with N = 1 nothing changes. off: vLLM-Omni "
            "refuses --max-num-seqs above 1 for SenseNova-U1, as without the plugin."),
    Setting(FP8_VAR, "off", _parse_fp8, "fp8",
            "FP8 (e4m3) weight copies on the hot paths, opt-in: off; on (every path below but "
            "sensenova_lm_head); or a comma list of " + ", ".join(FP8_PATHS + FP8_NAMED_ONLY)
            + ". sensenova_decode: SenseNova-U1's "
            "think/text decode step (fused step, one-request and batched) reads its 42 layers' "
            "linear weights as e4m3 with a scale per output channel (one request at a time: "
            "the plugin's one-row FP8 GEMV; batched steps: vLLM's Marlin GEMM), "
            "bf16 activations; it rounds differently from the bf16 step (docs/performance.md, "
            "FP8 weights); the copies take half the bytes of the layers they cover (8.1 GB for "
            "SenseNova-U1-8B), the bf16 weights stay for prefill and fallbacks. On vllm-omni 0.30 it makes the plugin's decode "
            "serve in place of the in-tree one. sensenova_denoise: SenseNova-U1's fast denoising "
            "body runs the generation pathway's 168 linear layers W8A8, like qwen_image_21 (the "
            "copies take 8.1 GB); with VLLM_OMNI_GRAPHDECODE_SENSENOVA_DENOISE unset it selects "
            "the fast mode, set to graph it is counted as not run. "
            "qwen_image_21: Qwen-Image-2.1's fast cached step "
            "runs its 224 linear layers W8A8 (e4m3 weights with a scale per output channel, each "
            "activation row quantised on the fly inside the compiled regions, torch._scaled_mm "
            "with FP8 fast accumulation, as vLLM's CUTLASS FP8 kernels); "
            "the copies take 6.98 GB beside the bf16 weights. sensenova_lm_head (named only, "
            "never by on; with sensenova_decode): the one-request decode step's lm_head too, "
            "through the one-row FP8 GEMV (0.62 GB of copies); it is the layer that picks the "
            "token, so greedy tokens part from the FP8 step's sooner (docs/performance.md, FP8 "
            "weights); a batched step (--max-num-seqs above 1) keeps the bf16 head, counted."),
    Setting(BUCKETS_VAR, "512,1024,2048,4096,8192", _int_list, "buckets",
            "SenseNova-U1 decode length buckets (tokens). One graph per bucket; past the last, "
            "buffers grow in steps of the gap between the last two buckets (tail step)."),
    Setting(PRECAPTURE_BUCKETS_VAR, "", _int_list_or_unset, "precapture_buckets",
            f"Buckets captured at model load when pre-capture is on (a think request reaches "
            f"these); each must be one of {BUCKETS_VAR}. Unset: those buckets up to "
            f"{PRECAPTURE_UP_TO}."),
    Setting("VLLM_OMNI_GRAPHDECODE_QWEN_MODE", "fast", _choice("fast", "exact"), "qwen_mode",
            "Qwen-Image-2.1 cached steps: fast (FlashAttention over one prefix + target K/V buffer, "
            "the block's elementwise work fused by torch.compile, captured as a graph; rounding "
            "differs from diffusers) or exact (diffusers' own block code captured as a graph: bit "
            "for bit diffusers' output)."),
    Setting("VLLM_OMNI_GRAPHDECODE_MAX_ENTRIES", "16", _positive_int, "max_entries",
            "Qwen-Image-2.1: most prefix-graph entries kept (LRU). Each live request branch "
            "(cond, uncond) holds one; 16 covers --max-num-seqs 8 with true CFG."),
    Setting("VLLM_OMNI_GRAPHDECODE_STATS_FILE", "0", _path_or_off, "stats_file",
            "A path: every process that wires a model or counts an event writes its stats "
            "snapshot there as JSON ({pid} is replaced by the process id): after each wiring, at "
            "most once a second while counting, and at exit. The counters live in vllm-omni's "
            "worker process, out of reach of the client; this makes them readable. 0: off."),
)


@dataclasses.dataclass(frozen=True)
class Config:
    models: frozenset[str]
    verify: bool
    precapture: bool
    fa_version: str
    sensenova_intree: str
    buckets: tuple[int, ...]
    precapture_buckets: tuple[int, ...]
    max_entries: int
    qwen_mode: str = "fast"
    stats_file: str = ""
    tokens_per_launch: int = 8
    sensenova_step: str = "fused"
    sensenova_denoise: str = "graph"
    sensenova_batch: str = "auto"
    fp8: frozenset = frozenset()

    @property
    def enabled(self) -> bool:
        return bool(self.models)

    def as_env(self) -> dict[str, str]:
        """The parsed values keyed by variable, for logs and `doctor`."""
        return {s.var: _show(getattr(self, s.field)) for s in SETTINGS}


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, frozenset):
        return ",".join(sorted(value)) or "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def parse(environ: Mapping[str, str] | None = None) -> Config:
    """Parse the plugin's variables from ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    values = {}
    for s in SETTINGS:
        raw = environ.get(s.var)
        values[s.field] = s.parse(s.var, s.default if raw is None else raw)
    if "sensenova_denoise" in values["fp8"] and environ.get(SENSENOVA_DENOISE_VAR) is None:
        # FP8 weights exist only in the fast body; asking for them is asking for its rounding.
        values["sensenova_denoise"] = "fast"
    if not values["precapture_buckets"]:
        values["precapture_buckets"] = (
            tuple(b for b in values["buckets"] if b <= PRECAPTURE_UP_TO) or values["buckets"][:1])
    elif values["precapture"] and not set(values["precapture_buckets"]) <= set(values["buckets"]):
        # Checked only when pre-capture is on: off, the list is never read.
        raw_pre = environ.get(PRECAPTURE_BUCKETS_VAR)
        raw_buckets = environ.get(BUCKETS_VAR, _setting(BUCKETS_VAR).default)
        missing = [b for b in values["precapture_buckets"] if b not in values["buckets"]]
        raise ConfigError(
            f"{PRECAPTURE_BUCKETS_VAR}={raw_pre!r} is not accepted with "
            f"{BUCKETS_VAR}={raw_buckets!r}: {', '.join(map(str, missing))} not among the buckets; "
            f"accepted: buckets listed in {BUCKETS_VAR}. To change: list only those, unset "
            f"{PRECAPTURE_BUCKETS_VAR} (the buckets up to {PRECAPTURE_UP_TO}), or set "
            f"{PRECAPTURE_VAR}=0")
    return Config(**values)


def _setting(var: str) -> Setting:
    return next(s for s in SETTINGS if s.var == var)


_CONFIG: Config | None = None


def get() -> Config:
    """The process's configuration, parsed on first use."""
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = parse()
    return _CONFIG


def reset_for_tests(cfg: Config | None = None) -> None:
    global _CONFIG
    _CONFIG = cfg
